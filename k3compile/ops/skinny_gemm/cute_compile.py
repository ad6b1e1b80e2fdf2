"""Compiling the CuTe skinny GEMM (``cute.py``): one kernel per (dtype, M, configuration, bias?, residual?,
static weight?, fused-norm eps), kept in memory and exported to an on-disk cache so a second process loads
it instead of compiling (~0.3 s per variant; loading takes milliseconds).

N, K and the row strides are symbolic in the compiled kernel, so one compile serves every shape. The disk
cache is keyed by a fingerprint of the kernel's source, this module, the configuration class, the DSL
version and the target arch (``K3_CUTE_CACHE_DIR``, default ~/.cache/k3compile/cute; "0" disables it).
A cache built on a CPU host with ``CUTE_DSL_ARCH=sm_90a`` serves an H200. The memory and disk cache
(``cached_kernel``) serves the wgmma kernel (``cute_wgmma.py``) too, under its own fingerprint.

cutlass is imported only inside functions: CI has no CuTe DSL and must still import this module.
"""
import functools
import hashlib
import os
import struct
import threading
from typing import Optional

import torch

from k3compile.kernels.cute.configs import VEC, KernelConfig, MmaConfig

_compiled: dict = {}
_compile_lock = threading.Lock()


def cute_dtype(dtype: torch.dtype):
    import cutlass
    return {torch.bfloat16: cutlass.BFloat16, torch.float16: cutlass.Float16}[dtype]


def dsl_and_arch() -> str:
    """The DSL version and the target arch, for a fingerprint: a cache built on a CPU host with
    ``CUTE_DSL_ARCH=sm_90a`` serves an H200 (the DSL targets the arch-specific (a) variant from sm_90)."""
    import cutlass
    arch = os.environ.get("CUTE_DSL_ARCH", "")
    if not arch and torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        arch = "sm_%d%d%s" % (major, minor, "a" if major >= 9 else "")
    return f"{getattr(cutlass, '__version__', '?')}/{arch}"


def cached_kernel(key, name: str, fingerprint: str, build):
    """The compiled kernel for ``key``: from memory, else from the disk cache (``K3_CUTE_CACHE_DIR/<fingerprint>/
    <name>.o``; default ~/.cache/k3compile/cute, "0" disables it), else ``build()`` and saved there. Both CuTe
    kernels (``cute.py``'s, ``cute_wgmma.py``'s) go through here: one lock, as ``cute.compile`` is not thread-safe."""
    fn = _compiled.get(key)
    if fn is not None:
        return fn
    with _compile_lock:
        fn = _compiled.get(key)
        if fn is None:
            fn = _compiled[key] = _load_or_build(name, fingerprint, build)
    return fn


def _load_or_build(name: str, fingerprint: str, build):
    import cutlass.cute as cute

    root = os.environ.get("K3_CUTE_CACHE_DIR", os.path.join(os.path.expanduser("~"), ".cache", "k3compile", "cute"))
    cdir = None if root == "0" else os.path.join(root, fingerprint)
    path = os.path.join(cdir, name + ".o") if cdir else None
    if path and os.path.exists(path):
        try:
            return cute.runtime.load_module(path, enable_tvm_ffi=True)[name]
        except Exception:  # a stale or torn file: build below and overwrite it
            pass
    fn = build()
    if path:
        try:
            os.makedirs(cdir, exist_ok=True)
            tmp = f"{path}.{os.getpid()}.tmp"
            fn.export_to_c(object_file_path=tmp, function_name=name)
            os.replace(tmp, path)  # atomic: a second process sees the whole file or none
        except Exception:
            pass  # the cache is an optimisation; the compiled function is already in hand
    return fn


def _fake_args(dtype: torch.dtype, m: int, has_bias: bool, has_res: bool, has_norm: bool = False):
    """Fake tensors with symbolic N, K and row strides: one compile serves every N and K."""
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_stream, make_fake_tensor

    cd = cute_dtype(dtype)
    n, k = cute.sym_int(), cute.sym_int(divisibility=VEC)
    lda, ldb = cute.sym_int64(divisibility=VEC), cute.sym_int64(divisibility=VEC)
    a = make_fake_tensor(cd, (m, k), (lda, 1), assumed_align=16)
    b = make_fake_tensor(cd, (n, k), (ldb, 1), assumed_align=16)
    c = make_fake_tensor(cd, (m, n), (cute.sym_int64(), 1), assumed_align=2)
    bias = make_fake_tensor(cd, (n,), (1,), assumed_align=2) if has_bias else None
    res = make_fake_tensor(cd, (m, n), (cute.sym_int64(), 1), assumed_align=2) if has_res else None
    g = make_fake_tensor(cd, (k,), (1,), assumed_align=16) if has_norm else None
    return a, b, c, bias, res, g, make_fake_stream(use_tvm_ffi_env_stream=True)


@functools.cache
def _source_fingerprint() -> str:
    """What a cached kernel depends on: the kernel's source and this module, the configuration class (not
    the table: a variant's name spells its configuration), the DSL version and the target GPU arch."""
    import inspect

    h = hashlib.sha256()
    for f in ("cute.py", "cute_ring.py", "cute_compile.py"):
        with open(os.path.join(os.path.dirname(__file__), f), "rb") as fh:
            h.update(fh.read())
    h.update(inspect.getsource(MmaConfig).encode())
    h.update(dsl_and_arch().encode())
    return h.hexdigest()[:16]


def compile_kernel(dtype: torch.dtype, m: int, cfg: KernelConfig, has_bias: bool, has_res: bool,
                   static_weight: bool = False, norm_eps: Optional[float] = None):
    """The compiled kernel for this variant: from memory, else from disk, else compiled (and saved).

    ``norm_eps``: fuse the RMSNorm of A with this eps (the latent-MoE tail; the kernel then takes the
    norm weight as its sixth argument). It is baked into the kernel: one model uses one eps.
    A ``WgmmaConfig`` compiles ``cute_wgmma.py``'s kernel instead (its own cache, the same call signature:
    ``fn(a, w, out, bias, residual, norm_weight)``).
    """
    if not isinstance(cfg, MmaConfig):
        from k3compile.ops.skinny_gemm import cute_wgmma
        return cute_wgmma.compile_kernel(dtype, m, cfg, has_bias, has_res, static_weight, norm_eps)
    key = (dtype, m, cfg, has_bias, has_res, static_weight, None if norm_eps is None else float(norm_eps))
    return cached_kernel(key, _variant_name(key), _source_fingerprint(), lambda: _build(key))


def _variant_name(key) -> str:
    dtype, m, cfg, has_bias, has_res, static_w, eps = key
    norm = "" if eps is None else "_norm" + struct.pack(">d", eps).hex()  # the exact eps, name-safe
    return (f"k3_skinny_{str(dtype).split('.')[-1]}_m{m}_{cfg.tag().replace('-', '_')}"
            f"_b{int(has_bias)}_r{int(has_res)}_s{int(static_w)}{norm}")


def _build(key):
    import cutlass.cute as cute

    from k3compile.ops.skinny_gemm.cute import _kernel_class

    dtype, m, cfg, has_bias, has_res, static_w, eps = key
    kern = _kernel_class()(cute_dtype(dtype), m, cfg, has_bias, has_res, static_w, eps)
    return cute.compile(kern, *_fake_args(dtype, m, has_bias, has_res, eps is not None), options="--enable-tvm-ffi")
