"""A simulated ROCm GPU for compile-only tests on a CPU machine (``tests/ops/test_rocm_compile.py``).

Inside :func:`simulated_rocm` torch looks like a ROCm build with one AMD Instinct MI300X (gfx942, 304 compute units):
``torch.version.hip`` is set, ``torch.cuda`` answers for that GPU, and tensors made on ``"cuda"`` are CPU tensors
that report ``cuda:0`` (:class:`SimCudaTensor`), so k3compile's launchers take the branches they take on ROCm.
Triton's active driver is a stand-in whose target is ``hip:gfx942``: a launch is bound and specialised by Triton as
on the GPU (its option check included: an NVIDIA-only keyword such as ``maxnreg`` or ``launch_pdl`` raises there),
then recorded as a :class:`Launch` instead of compiled and run. :func:`compile_for_gfx942` compiles recorded
launches with Triton's AMD backend (no GPU needed) and reports what each one's code object holds.

Needs a process without ``TRITON_INTERPRET`` (under it ``@triton.jit`` makes no compilable kernels).
"""
from __future__ import annotations

import contextlib
import dataclasses
import importlib
import re
import types
from typing import Any, Iterator, Optional

import torch

GFX942 = ("hip", "gfx942", 64)   # GPUTarget(backend, arch, warp size)
MI300X = dict(name="AMD Instinct MI300X", gcnArchName="gfx942:sramecc+:xnack-", multi_processor_count=304,
              major=9, minor=4, total_memory=192 * 2**30)


class SimCudaTensor(torch.Tensor):
    """A CPU tensor that says it lives on ``cuda:0`` (what the launchers branch on); results of ops on it stay one."""

    @property
    def device(self):
        return torch.device("cuda", 0)

    @property
    def is_cuda(self):
        return True


def on_sim_gpu(t: torch.Tensor) -> SimCudaTensor:
    return t.as_subclass(SimCudaTensor)


_FACTORIES = ("empty", "zeros", "ones", "full", "empty_strided", "arange", "randn", "rand", "randint", "tensor")


def _factory(fn):
    def make(*args, **kwargs):
        device = kwargs.get("device")
        if device is not None and torch.device(device).type == "cuda":
            kwargs["device"] = "cpu"
            return on_sim_gpu(fn(*args, **kwargs))
        return fn(*args, **kwargs)
    return make


class _Stream:
    def wait_stream(self, other):
        pass


@dataclasses.dataclass
class Launch:
    """One kernel launch as Triton bound it for gfx942 (what ``triton.compile`` takes), and who launched it."""
    kernel: str                   # module:qualname of the @triton.jit function
    signature: dict
    constexprs: dict
    attrs: dict
    options: dict
    case: str = ""

    def key(self) -> tuple:
        return (self.kernel, tuple(self.signature.items()), tuple(sorted(self.constexprs.items(), key=str)),
                repr(sorted(self.attrs.items(), key=str)), repr(sorted(self.options.items())))

    def constexpr(self, name: str) -> Any:
        """The value the launch gave the constexpr parameter ``name`` (None where it is not one)."""
        fn = _jit_fn(self.kernel)
        names = [p.name for p in fn.params]
        return self.constexprs.get((names.index(name),)) if name in names else None


def _jit_fn(kernel: str):
    module, name = kernel.split(":")
    return getattr(importlib.import_module(module), name)


class _Recorder:
    def __init__(self):
        self.launches: list[Launch] = []
        self.case = ""


@contextlib.contextmanager
def simulated_rocm(props: Optional[dict] = None) -> Iterator[_Recorder]:
    """torch as a ROCm build with one GPU of ``props`` (default :data:`MI300X`) and Triton recording launches for
    gfx942; yields the recorder (``.launches``; set ``.case`` to label the launches that follow)."""
    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver as triton_driver
    from triton.runtime.jit import JITFunction

    from k3compile import backends

    p = dict(MI300X, **(props or {}))
    rec = _Recorder()
    target = GPUTarget(*GFX942)

    class HipDriver:   # the part of Triton's driver a launch reads before it compiles
        def get_current_device(self):
            return 0

        def get_current_stream(self, device=None):
            return 0

        def get_current_target(self):
            return target

        def get_active_torch_device(self):
            return torch.device("cuda", 0)

        def get_device_interface(self):
            return torch.cuda

    def record(self, key, signature, device, constexprs, options, attrs, warmup):
        fn = self.fn
        rec.launches.append(Launch(f"{fn.__module__}:{fn.__qualname__}", dict(signature), dict(constexprs),
                                   dict(attrs), dict(options.__dict__), rec.case))
        return None   # nothing compiled here, nothing launched

    class device:   # torch.cuda.device
        def __init__(self, d):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    cuda = dict(
        is_available=lambda: True, device_count=lambda: 1, current_device=lambda: 0,
        get_device_properties=lambda d=None: types.SimpleNamespace(**p),
        get_device_capability=lambda d=None: (p["major"], p["minor"]),
        get_device_name=lambda d=None: p["name"], device=device, synchronize=lambda d=None: None,
        current_stream=lambda d=None: _Stream(), is_current_stream_capturing=lambda: False,
        empty_cache=lambda: None,
    )
    saved_cuda = {n: getattr(torch.cuda, n) for n in cuda}
    saved_factories = {n: getattr(torch, n) for n in _FACTORIES}
    saved_hip = torch.version.hip
    saved_do_compile = JITFunction._do_compile
    try:
        for n, f in cuda.items():
            setattr(torch.cuda, n, f)
        for n in _FACTORIES:
            setattr(torch, n, _factory(saved_factories[n]))
        torch.version.hip = "6.4.0-sim"
        backends.is_rocm.cache_clear()
        backends.sm90_nvidia.cache_clear()
        triton_driver.set_active(HipDriver())
        JITFunction._do_compile = record
        yield rec
    finally:
        JITFunction._do_compile = saved_do_compile
        triton_driver.reset_active() if triton_driver._default is not None else setattr(triton_driver, "_active", None)
        torch.version.hip = saved_hip
        backends.is_rocm.cache_clear()
        backends.sm90_nvidia.cache_clear()
        for n, f in saved_factories.items():
            setattr(torch, n, f)
        for n, f in saved_cuda.items():
            setattr(torch.cuda, n, f)


# --------------------------------------------------------------------------------------------------
# compiling recorded launches for gfx942

_SCRATCH = re.compile(r"\.private_segment_fixed_size:\s*(\d+)")
_INLINE_ASM = re.compile(r"\basm\s+(sideeffect\s+)?\"")


def compile_one(launch: Launch) -> dict:
    """``launch`` compiled for gfx942: what its code object holds (or the error), as plain data."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    try:
        src = ASTSource(fn=_jit_fn(launch.kernel), signature=launch.signature, constexprs=launch.constexprs,
                        attrs=launch.attrs)
        k = triton.compile(src, target=GPUTarget(*GFX942), options=launch.options)
    except Exception as e:
        return dict(error=f"{type(e).__name__}: {str(e)[-1500:]}")
    ttir, llir, isa = k.asm.get("ttir", ""), k.asm.get("llir", ""), k.asm.get("amdgcn", "")
    scratch = [int(s) for s in _SCRATCH.findall(isa)]
    return dict(
        shared=int(k.metadata.shared),                     # LDS bytes a workgroup takes
        scratch=max(scratch) if scratch else 0,            # private (spill) bytes per lane
        inline_asm=bool(_INLINE_ASM.search(llir)),
        volatile_loads="isVolatile = true" in ttir,
        spin_loops="scf.while" in ttir,
        tma="tensordesc" in ttir or "tt.descriptor" in ttir,
    )


def compile_for_gfx942(launches: list[Launch], workers: int = 2) -> list[dict]:
    """:func:`compile_one` of each launch, in ``workers`` processes (each distinct launch compiled once)."""
    from concurrent.futures import ProcessPoolExecutor
    import multiprocessing as mp

    unique: dict = {}
    for launch in launches:
        unique.setdefault(launch.key(), launch)
    todo = list(unique.values())
    if workers > 1 and len(todo) > 1:
        with ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn")) as pool:
            done = dict(zip((l.key() for l in todo), pool.map(compile_one, todo)))
    else:
        done = {l.key(): compile_one(l) for l in todo}
    return [done[launch.key()] for launch in launches]
