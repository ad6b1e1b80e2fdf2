"""Which implementation of a k3 op runs, and why.

Every op in ``k3compile/ops/<op>/`` has up to three implementations side by side: ``reference`` (plain PyTorch, any
device, the ground truth), ``triton`` (any GPU; CPU tensors under ``TRITON_INTERPRET=1``) and ``cute`` (NVIDIA sm_90+,
CuTe DSL). The op's ``dispatch.py`` declares them once::

    SKINNY_GEMM = OpImpls("skinny_gemm", reference=Impl(...), triton=Impl(...), cute=Impl(...), aten=Impl(...))

and the custom op body calls ``SKINNY_GEMM.select(backend, key, *args)`` (through the dispatch) with the backend
string the pass baked into the graph. Each ``Impl`` has two predicates that return ``None`` when they
pass and a human-readable reason when they do not:

- ``available(*args)``: can this implementation run on this machine / device at all
  (package importable, tensors on CUDA, not ROCm for CuTe, ...)?
- ``supports(*args)``: does it handle these particular shapes / dtypes / strides?

Rules:
- ``backend="auto"``: CuTe on CUDA (not ROCm) if available and supported, else Triton on any GPU,
  else the reference. Every step down is recorded with its reason.
- ``backend="cute"`` or ``"triton"`` (forced): if the implementation is not *available* the call raises
  ``BackendUnavailableError`` (the user asked for something this machine cannot do); if it is available but does not
  *support* the shape, the next implementation down runs and the fallback is recorded. Never a silently wrong result.
- ``backend="reference"``: always the reference.

Choices are cached per (op, backend, key) so dispatch costs one dict lookup after the first call; ``key`` must capture
everything the predicates read (dtypes, shapes or shape classes, device, contiguity). The cache is the whole process's
record; each model ``optimize`` compiled keeps its own (``choices.recording_choices``, set around its calls), which
``k3compile.report`` prints.
"""
from __future__ import annotations

import functools
import importlib.util
import os
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Optional

import torch

from .choices import Choice, logging_a_slow_build, record_for_model
from .kernel_cache import Build

BACKENDS = ("auto", "cute", "triton", "reference")
IMPL_ORDER = ("cute", "triton", "reference")

Reason = Optional[str]  # None = fine; a string says why not


class BackendUnavailableError(RuntimeError):
    """The user forced a backend that cannot run here (not installed, wrong device, ...)."""


def check_backend(backend: str) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    return backend


@functools.cache
def is_rocm() -> bool:
    return torch.version.hip is not None


@functools.cache
def sm90_nvidia(device: torch.device) -> bool:
    """TMA and programmatic dependent launch: an NVIDIA GPU of compute capability 9.0 or newer."""
    return device.type == "cuda" and not is_rocm() and torch.cuda.get_device_capability(device)[0] >= 9


@functools.cache
def _triton_has_gdc() -> bool:
    try:   # grid dependency control (PDL), Triton >= 3.4; imported only where a Triton launch asks
        from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait  # noqa: F401
    except ImportError:
        return False
    return True


def triton_pdl_capable(device: torch.device) -> bool:
    """Programmatic dependent launch of a Triton kernel: an sm_90+ NVIDIA GPU and a Triton that has it."""
    return sm90_nvidia(device) and _triton_has_gdc()


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA/ROCm device (what kernels size their grids by); 0 elsewhere."""
    return _sm_count(device.index or 0) if device.type == "cuda" else 0


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


# Local memory (shared memory / LDS) one program may take, by AMD architecture; gfx9 (MI200, MI300) has 64 KiB
LDS_BYTES = {"gfx950": 160 * 1024}
LDS_BYTES_DEFAULT = 64 * 1024


def local_memory_budget(device: torch.device) -> int:
    """Bytes of shared memory (AMD: LDS) one program may take on ``device``: a configuration whose pipeline needs
    more is refused at launch (NVIDIA: the opt-in per-block limit, 227 KiB on sm_90; AMD: ``LDS_BYTES``); no limit
    off the GPU (the interpreter)."""
    return _local_memory_budget(device.index or 0) if device.type == "cuda" else 1 << 40


@functools.cache
def _local_memory_budget(device_index: int) -> int:
    props = torch.cuda.get_device_properties(device_index)
    if is_rocm():
        return LDS_BYTES.get(props.gcnArchName.split(":")[0], LDS_BYTES_DEFAULT)
    return getattr(props, "shared_memory_per_block_optin", 227 * 1024)


def stages_within(budget: int, stage_bytes: int, fixed_bytes: int, stages: int) -> int:
    """The most software-pipeline stages, at most ``stages`` and at least 1, whose ring fits ``budget``: Triton's
    pipeliner keeps ``stages - 1`` tiles of ``stage_bytes`` in shared memory (checked against the code objects
    compiled for gfx942 in tests/ops/test_rocm_compile.py), besides ``fixed_bytes``."""
    while stages > 1 and (stages - 1) * stage_bytes + fixed_bytes > budget:
        stages -= 1
    return stages


@functools.cache
def triton_importable() -> Reason:
    try:
        import triton  # noqa: F401
    except Exception as e:  # pragma: no cover - depends on the machine
        return f"triton does not import ({type(e).__name__}: {e})"
    return None


@functools.cache
def cute_importable() -> Reason:
    if is_rocm():
        return "CuTe DSL is NVIDIA-only (ROCm build of torch)"
    try:
        import cutlass  # noqa: F401
        import cutlass.cute  # noqa: F401
    except Exception as e:
        return f"CuTe DSL does not import ({type(e).__name__}: {e})"
    return None


def triton_interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def triton_can_run_on(*tensors: torch.Tensor) -> Reason:
    """Triton runs on CUDA/ROCm tensors, or on CPU tensors under TRITON_INTERPRET=1."""
    reason = triton_importable()
    if reason:
        return reason
    for t in tensors:
        if t is None:
            continue
        if t.device.type == "cuda":
            continue
        if t.device.type == "cpu" and triton_interpret():
            continue
        return f"tensor on {t.device.type} (Triton needs a GPU, or TRITON_INTERPRET=1 for CPU tensors)"
    return None


def cute_installed() -> Reason:
    """CuTe DSL and TVM-FFI installed (not imported: seconds; whether the DSL imports is each kernel family's check)."""
    if is_rocm():
        return "CuTe DSL is NVIDIA-only (ROCm build of torch)"
    for package in ("cutlass", "tvm_ffi"):
        if importlib.util.find_spec(package) is None:
            return f"CuTe DSL is not installed (no module {package!r})"
    return None


def cute_can_run_on(*tensors: torch.Tensor) -> Reason:
    """CuTe kernels need CUDA tensors on an sm_90+ NVIDIA GPU and CuTe DSL installed."""
    reason = cute_installed()
    if reason:
        return reason
    for t in tensors:
        if t is None:
            continue
        if t.device.type != "cuda":
            return f"tensor on {t.device.type} (CuTe kernels need CUDA tensors)"
        if not torch.cuda.is_available():   # fake CUDA tensors traced on a host without one: no device to ask
            return "no CUDA device in this process (CuTe kernels are built for the device they run on)"
        major, _ = torch.cuda.get_device_capability(t.device)
        if major < 9:
            return f"GPU capability sm_{major}x < sm_90"
    return None


def forced_backend_reason(backend: str, devices: set) -> Reason:
    """Why a forced ``backend`` ("cute" / "triton") can run no kernel on tensors on ``devices`` (the model's;
    empty when unknown), or None. ``optimize`` raises on it before compiling anything."""
    if backend == "triton":
        for d in devices:
            if d.type == "cpu" and not triton_interpret():
                return "the model is on the CPU: Triton kernels need a GPU (or TRITON_INTERPRET=1, for tests)"
            if d.type not in ("cpu", "cuda"):
                return f"the model is on {d.type}: Triton kernels need a CUDA or ROCm GPU"
        return triton_importable()
    if backend == "cute":
        for d in devices:
            if d.type != "cuda":
                where = "the CPU" if d.type == "cpu" else d.type
                return f"the model is on {where}: CuTe kernels need CUDA tensors on an sm_90+ NVIDIA GPU"
        reason = cute_importable()
        if reason is None:
            for d in devices:
                major, minor = torch.cuda.get_device_capability(d)
                if major < 9:
                    return f"{d} is sm_{major}{minor}: CuTe kernels need sm_90+"
        return reason
    return None


def _always(*args, **kwargs) -> Reason:
    return None


@dataclass(frozen=True)
class Impl:
    """One implementation of an op: the function and its predicates (see module doc).

    ``profitable(*args)``: None where this kernel is measured (or expected) to beat what would run instead:
    the next kernel in order, or the op's fallback (``OpImpls.aten``: cuBLAS for the skinny GEMM, the split path
    for the latent-MoE tail), else the reason. Under ``backend="auto"`` an unprofitable kernel is passed over; if
    nothing after it but the reference can run, the fallback runs (where its ``available`` passes), else the kernel
    after all. A forced backend runs the kernel it names wherever it can. Only ``fn`` and ``available`` of the
    fallback are read.
    """
    fn: Callable[..., Any]
    available: Callable[..., Reason] = _always
    supports: Callable[..., Reason] = _always
    profitable: Callable[..., Reason] = _always
    # (*args, static_weight=) -> [(kind, key)] of k3compile/kernel_cache.py: the kernels ``fn`` builds at its first
    # call with these arguments (k3compile/precompile.py builds them ahead); a Build: another op's (it composes it)
    kernels: Optional[Callable[..., list]] = None



def _reason_of(predicate: Callable[..., Reason], args: tuple) -> Reason:
    """A predicate's answer; one taken from a ``KernelModule`` that does not import raises: its reason."""
    try:
        return predicate(*args)
    except BackendUnavailableError as e:
        return str(e)


@dataclass
class OpImpls:
    """The implementations of one op and the record of which one ran for which key."""
    name: str
    reference: Impl
    triton: Optional[Impl] = None
    cute: Optional[Impl] = None
    aten: Optional[Impl] = None      # the fallback an unprofitable kernel yields to (e.g. cuBLAS)
    # the op's call (its schema's arguments, by name) -> the Builds of its first call (the op's ``dispatch.kernels``)
    plan: Optional[Callable[..., list]] = None
    composes: tuple[str, ...] = ()   # no kernel of its own: it runs these ops (a backend is its if theirs)
    _choices: dict = field(default_factory=dict, repr=False)
    _decided: dict = field(default_factory=dict, repr=False)   # decide_once's cache
    _broken: dict = field(default_factory=dict, repr=False)    # (key, impl) -> why it may not run (mark_broken)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def impl(self, impl_name: str) -> Optional[Impl]:
        return getattr(self, impl_name)

    def has(self, impl_name: str) -> bool:
        """Whether ``backend=impl_name`` can be asked of this op (of every op it composes)."""
        return all(REGISTRY[n].has(impl_name) for n in self.composes) if self.composes else bool(self.impl(impl_name))

    def decide(self, backend: str, args: tuple, key: Hashable = None) -> tuple[str, str]:
        """(the implementation to run for these arguments, why), by the rules of the module doc; nothing recorded
        (``select`` records). An op whose own implementation composes another op decides that one here. An
        implementation marked broken for ``key`` (``mark_broken``) is passed over as one that does not support it."""
        check_backend(backend)
        if backend == "reference":
            return "reference", "backend='reference' requested"
        if backend == "auto":
            order = ("triton", "reference") if is_rocm() else IMPL_ORDER
        else:
            order = IMPL_ORDER[IMPL_ORDER.index(backend):]
        notes = []
        passed_over = None   # the first kernel that could run but was measured slower than another path
        for name in order:
            if name == "reference" and passed_over is not None:
                # the op's fallback where it has one that can run, else the kernel after all (it beats the reference)
                why = _reason_of(self.aten.available, args) if self.aten is not None else None
                if why is not None:
                    notes.append(f"aten: {why}")
                pick = "aten" if self.aten is not None and why is None else passed_over
                return pick, "; ".join(notes) + " -> " + pick
            impl = self.impl(name)
            if impl is None:
                why = f"{self.name} has no {name} implementation"
                if backend == name:
                    raise BackendUnavailableError(f"backend={backend!r}: {why}")
                notes.append(f"{name}: {why}")
                continue
            why = _reason_of(impl.available, args)
            if why is not None:
                if backend == name:
                    raise BackendUnavailableError(f"{self.name}: backend={backend!r} cannot run here: {why}")
                notes.append(f"{name}: {why}")
                continue
            why = self._broken.get((key, name)) if key is not None else None
            if why is None:
                why = _reason_of(impl.supports, args)
            if why is not None:
                notes.append(f"{name}: {why}")
                continue
            if backend == "auto" and name != "reference":
                why = _reason_of(impl.profitable, args)
                if why is not None:  # the next kernel, or the vendor library, was measured faster
                    notes.append(f"{name}: {why}")
                    passed_over = passed_over or name
                    continue
            return name, ("; ".join(notes) + " -> " + name) if notes else "preferred"
        raise AssertionError("the reference implementation must always run")  # pragma: no cover

    def select(self, backend: str, key: Hashable, *args) -> Callable[..., Any]:
        """The function to run for these arguments; records the choice under ``key``."""
        ck = (backend, key)
        choice = self._choices.get(ck)
        first = choice is None
        if first:
            impl_name, reason = self.decide(backend, args, key)
            choice = Choice(self.name, backend, impl_name, reason, key)
            with self._lock:
                choice = self._choices.setdefault(ck, choice)
        choice.calls += 1
        mine = record_for_model((self.name, *ck), choice)
        fn = self.impl(choice.impl).fn
        return logging_a_slow_build(fn, choice, mine) if first and choice.impl != "reference" else fn

    def select_fixed(self, backend: str, key: Hashable, label: str, reason: str,
                     fn: Callable[..., Any]) -> Callable[..., Any]:
        """Record that ``fn`` (shown as ``label``) runs for ``key`` regardless of the backends,
        e.g. a size the op sends to a vendor library; returns ``fn``."""
        ck = (backend, key, label)  # never collides with select()'s (backend, key)
        choice = self._choices.get(ck)
        if choice is None:
            with self._lock:
                choice = self._choices.setdefault(ck, Choice(self.name, backend, label, reason, key))
        choice.calls += 1
        record_for_model((self.name, *ck), choice)
        return fn

    def decide_once(self, backend: str, key: Hashable, args: tuple) -> str:
        """The implementation ``decide`` picks for ``key``, decided once (cached, not recorded): for an op whose own
        implementation composes this one."""
        impl = self._decided.get((backend, key))
        if impl is None:
            impl = self._decided[(backend, key)] = self.decide(backend, args, key)[0]
        return impl

    def kernels(self, backend: str, key: Hashable, args: tuple, **launch) -> list[Build]:
        """The kernels the implementation ``decide`` picks for these arguments builds at its first call (``launch``:
        the call's launch details, ``static_weight`` and the like, which never change the choice)."""
        impl_name, _ = self.decide(backend, args, key)
        found = self.impl(impl_name).kernels
        if found is None:
            return []
        return [b if isinstance(b, Build) else Build(*b, self.name, key, impl_name)
                for b in found(*args, **launch)]

    def mark_broken(self, key: Hashable, impl_name: str, why: str) -> None:
        """``impl_name`` may not run for ``key`` (its kernel failed to build): ``decide`` passes over it, saying why;
        choices already made for ``key`` are made again."""
        with self._lock:
            self._broken[(key, impl_name)] = why
            for table in (self._choices, self._decided):
                for ck in [ck for ck in table if ck[1] == key]:
                    del table[ck]

    def choices(self) -> list[Choice]:
        return list(self._choices.values())

    def clear(self) -> None:
        with self._lock:
            self._choices.clear()
            self._decided.clear()
            self._broken.clear()


# Every OpImpls registers here so the report can list them.
REGISTRY: dict[str, OpImpls] = {}


def register_op_impls(impls: OpImpls) -> OpImpls:
    if impls.name in REGISTRY and REGISTRY[impls.name] is not impls:
        raise ValueError(f"op {impls.name!r} registered twice")
    REGISTRY[impls.name] = impls
    return impls


def all_choices() -> list[Choice]:
    return [c for impls in REGISTRY.values() for c in impls.choices()]
