"""Compiling the CuTe skinny GEMM kernels: one cache for both (``mma.py`` for an ``MmaConfig``, ``wgmma.py`` for a
``WgmmaConfig``).

A variant is (dtype, M, configuration, bias?, residual?, static weight?, fused-norm eps, fp32 output?); N, K and the
row strides
are symbolic in the compiled kernel, so one compile serves every shape. A compiled variant is kept in memory and
exported to a disk cache so that another process loads it in milliseconds instead of compiling (~0.3 s): the file
is ``K3_CUTE_CACHE_DIR/<fingerprint>/<variant name>.o`` (default ``~/.cache/k3compile/cute``; "0" turns it off).
The fingerprint hashes this package's sources, the DSL version and the target arch, so a cache built on a CPU host
with ``CUTE_DSL_ARCH=sm_90a`` serves an H200. The cache is the "cute" kind of ``k3compile/kernel_cache.py``, into which
``k3compile/precompile.py`` builds the variants a compiled graph calls, in GPU-blind worker processes (``worker_env``),
ahead of its first call. Every compiled kernel is called ``fn(a, w, out, bias, residual, g)`` (``g``: the fused norm's
weight, else None) on the current torch stream, through TVM-FFI.

A cached kernel is a shared library (the DSL's object file linked with its runtime and TVM-FFI's, by the C compiler,
``CC`` or ``cc``) that TVM-FFI loads without CuTe DSL: a process whose kernels are all cached never imports the DSL
(2.2-2.8 s on the H200 host, most of a warm ``optimize()``'s excess over ``torch.compile``). No C compiler: no disk
cache. The planning of ``precompile`` (in the compiling process) does not import the DSL either: its workers do, and a
build failing there falls back.

Nothing here imports cutlass at its top: the kernel modules load on the first build (``KERNEL_MODULES``; an op's
``available`` predicate adds :func:`unavailable`, so a DSL that does not import them is a recorded fallback; where a
process of this install has imported them, its mark in the cache folder stands for the import).
"""
from __future__ import annotations

import functools
import hashlib
import os
import shutil
import struct
import subprocess
from typing import Optional

import torch

from k3compile import kernel_cache
from k3compile.backends import Reason, cute_importable
from k3compile.kernel_module import KernelModule
from k3compile.kernels.cute.configs import VEC, KernelConfig, MmaConfig, WgmmaConfig

_SOURCES = ("asm.py", "compile.py", "configs.py", "mma.py", "mma_ring.py", "wgmma.py")
# the kernel class of each configuration type, in a module that imports cutlass at its top
KERNEL_MODULES = {MmaConfig: (KernelModule(f"{__package__}.mma", cute_importable), "MmaSkinnyGemm"),
                  WgmmaConfig: (KernelModule(f"{__package__}.wgmma", cute_importable), "WgmmaSkinnyGemm")}
KIND = "cute"   # the kind of kernel in k3compile/kernel_cache.py


IMPORTED_MARK = ".kernel-modules-import"   # in directory(): a process of this install imported the kernel modules


def unavailable() -> Reason:
    """None where CuTe DSL imports both kernel modules, else why not: imported here, unless this install's cache folder
    holds the mark that a process (a precompile worker, an earlier run) imported them -- a warm start then loads its
    cached kernels without the DSL (a kernel it must build still imports the DSL and raises if it does not)."""
    folder = directory()
    if folder is not None and os.path.exists(os.path.join(folder, IMPORTED_MARK)):
        return None
    if folder is not None and kernel_cache.is_planning_ahead():
        return None   # precompile's workers import them (and mark); a build failing there falls back with the reason
    for module, _ in KERNEL_MODULES.values():
        reason = module.reason()
        if reason is not None:
            return reason
    _mark_imported()
    return None


def _mark_imported() -> None:
    folder = directory()
    if folder is None:
        return
    try:
        os.makedirs(folder, exist_ok=True)
        open(os.path.join(folder, IMPORTED_MARK), "a").close()
    except OSError:   # a read-only cache: the next process imports again
        pass


def variant(dtype: torch.dtype, m: int, cfg: KernelConfig, has_bias: bool, has_res: bool,
            static_weight: bool = False, norm_eps: Optional[float] = None, out_fp32: bool = False) -> tuple:
    """The key of one compiled kernel (see the module doc)."""
    return (dtype, m, cfg, has_bias, has_res, static_weight, None if norm_eps is None else float(norm_eps),
            bool(out_fp32))


def compile_kernel(dtype: torch.dtype, m: int, cfg: KernelConfig, has_bias: bool, has_res: bool,
                   static_weight: bool = False, norm_eps: Optional[float] = None, out_fp32: bool = False):
    """The compiled kernel for this variant: from memory, else from disk, else compiled (and saved).

    ``norm_eps``: fuse the RMSNorm of A with this eps (the latent-MoE tail; ``g`` then is the norm weight). It is
    baked into the kernel: one model uses one eps. ``out_fp32``: C (and the residual) fp32, the fp32 sums stored
    unrounded (the upcast product ``linear(x.float(), w.float())`` of 16-bit operands); the kernels store C's
    element type, whatever it is.
    """
    return kernel_cache.get(KIND, variant(dtype, m, cfg, has_bias, has_res, static_weight, norm_eps, out_fp32))


def variant_name(key) -> str:
    """The variant's file and symbol name: its kernel, dtype, M, configuration tag, flags and the exact eps."""
    dtype, m, cfg, has_bias, has_res, static_w, eps, out_fp32 = key
    kernel = "skinny" if isinstance(cfg, MmaConfig) else "wgmma"
    norm = "" if eps is None else "_norm" + struct.pack(">d", eps).hex()   # the exact eps, name-safe
    return (f"k3_{kernel}_{str(dtype).split('.')[-1]}_m{m}_{cfg.tag().replace('-', '_')}"
            f"_b{int(has_bias)}_r{int(has_res)}_s{int(static_w)}{norm}{'_o32' if out_fp32 else ''}")


def cute_dtype(dtype: torch.dtype):
    import cutlass
    return {torch.bfloat16: cutlass.BFloat16, torch.float16: cutlass.Float16}[dtype]


def target_arch() -> str:
    """The arch kernels are built for: ``CUTE_DSL_ARCH``, else this process's GPU (the DSL targets the arch-specific
    "a" variant from sm_90); "" on a machine with neither."""
    arch = os.environ.get("CUTE_DSL_ARCH", "")
    if not arch and torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        arch = "sm_%d%d%s" % (major, minor, "a" if major >= 9 else "")
    return arch


def dsl_version() -> str:
    """CuTe DSL's version, from its package's metadata (importing the DSL costs seconds)."""
    from importlib import metadata

    try:
        return metadata.version("nvidia-cutlass-dsl")
    except metadata.PackageNotFoundError:   # a source build: ask the DSL itself
        import cutlass
        return getattr(cutlass, "__version__", "?")


def dsl_and_arch() -> str:
    """The DSL version and the target arch."""
    return f"{dsl_version()}/{target_arch()}"


def sources_fingerprint(paths) -> str:
    """A hash of these source files, the DSL version and the target arch: what a cached kernel built from them
    depends on (not the tables: a variant's name spells its configuration)."""
    h = hashlib.sha256()
    for path in paths:
        with open(path, "rb") as f:
            h.update(f.read())
    h.update(dsl_and_arch().encode())
    return h.hexdigest()[:16]


@functools.cache
def fingerprint() -> str:
    """``sources_fingerprint`` of this package's sources."""
    return sources_fingerprint(os.path.join(os.path.dirname(os.path.abspath(__file__)), name) for name in _SOURCES)


def directory() -> Optional[str]:
    """``K3_CUTE_CACHE_DIR/<fingerprint>`` (default ``~/.cache/k3compile/cute``), None where it is "0" or where no C
    compiler links the kernels."""
    root = os.environ.get("K3_CUTE_CACHE_DIR", os.path.join(os.path.expanduser("~"), ".cache", "k3compile", "cute"))
    return None if root == "0" or _linker() is None else os.path.join(root, fingerprint())


@functools.cache
def _linker() -> Optional[str]:
    return shutil.which(os.environ.get("CC") or "cc") or shutil.which("gcc")


def export(fn, path: str, name: str) -> None:
    """The kernel as a shared library at ``path``: the DSL's object file linked with the runtime libraries it calls
    (found by their own directories at load: rpath)."""
    from cutlass.cute.runtime import find_runtime_libraries

    obj = path + ".o"
    try:
        fn.export_to_c(object_file_path=obj, function_name=name)
        libs = find_runtime_libraries(enable_tvm_ffi=True)
        rpaths = [f"-Wl,-rpath,{d}" for d in dict.fromkeys(os.path.dirname(lib) for lib in libs)]
        done = subprocess.run([_linker(), "-shared", "-o", path, obj, *libs, *rpaths], capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"linking {name} failed: {done.stderr.strip()[-2000:]}")
    finally:
        if os.path.exists(obj):
            os.remove(obj)


def load(path: str, name: str):
    """The cached kernel, through TVM-FFI alone (no CuTe DSL import)."""
    import tvm_ffi

    return tvm_ffi.load_module(path)[name]


def worker_env() -> dict:
    """A precompile worker builds for this process's arch and never touches a GPU (CuTe DSL compiles on the host:
    ``cute.compile`` is not thread-safe, so parallel builds are processes)."""
    return {"CUTE_DSL_ARCH": target_arch(), "CUDA_VISIBLE_DEVICES": ""}


def warm_up() -> None:
    """Import CuTe DSL and both kernel modules (seconds in a fresh process, paid once per precompile worker), and
    leave the mark that they import (``unavailable``)."""
    for module, _ in KERNEL_MODULES.values():
        module.module()
    _mark_imported()


def build(key):
    """Compile one variant (no cache)."""
    import cutlass.cute as cute

    dtype, m, cfg, has_bias, has_res, static_w, eps, out_fp32 = key
    if isinstance(cfg, WgmmaConfig):
        bad = cfg.invalid()
        if bad:
            raise ValueError(f"WgmmaConfig {cfg.tag()}: {bad}")
    module, name = KERNEL_MODULES[type(cfg)]
    Kernel = getattr(module.module(), name)
    _mark_imported()
    kernel = Kernel(cute_dtype(dtype), m, cfg, has_bias, has_res, static_w, eps)
    fake = fake_args(dtype, m, has_bias, has_res, eps is not None, static_m=isinstance(cfg, MmaConfig),
                     out_fp32=out_fp32)
    return cute.compile(kernel, *fake, options="--enable-tvm-ffi")


def fake_args(dtype: torch.dtype, m: int, has_bias: bool, has_res: bool, has_norm: bool, static_m: bool,
              out_fp32: bool = False):
    """Fake tensors with symbolic N, K and row strides, as the kernels are called: (a, w, out, bias, residual, g,
    stream); out and residual fp32 with ``out_fp32``. ``static_m``: A's row count is M (the mma.sync kernel); the
    wgmma kernel leaves it symbolic, because a static extent of 1 collapses its TMA to 1-D (an illegal instruction on
    the H200 with the 2-D swizzled box) -- its M is the compile-time ``m`` all the same."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_stream, make_fake_tensor

    cd = cute_dtype(dtype)
    n, k = cute.sym_int(), cute.sym_int(divisibility=VEC)
    lda, ldw = cute.sym_int64(divisibility=VEC), cute.sym_int64(divisibility=VEC)
    a = make_fake_tensor(cd, (m if static_m else cute.sym_int(), k), (lda, 1), assumed_align=16)
    w = make_fake_tensor(cd, (n, k), (ldw, 1), assumed_align=16)
    od = cutlass.Float32 if out_fp32 else cd
    c = make_fake_tensor(od, (m, n), (cute.sym_int64(), 1), assumed_align=od.width // 8)
    bias = make_fake_tensor(cd, (n,), (1,), assumed_align=2) if has_bias else None
    res = make_fake_tensor(od, (m, n), (cute.sym_int64(), 1), assumed_align=od.width // 8) if has_res else None
    g = make_fake_tensor(cd, (k,), (1,), assumed_align=16) if has_norm else None
    return a, w, c, bias, res, g, make_fake_stream(use_tvm_ffi_env_stream=True)


# this process's variants: loaded from the disk cache, or built (and the seconds the builds took)
STATS = kernel_cache.register(KIND, kernel_cache.Builder(build, export, load, variant_name, directory, suffix=".so",
                                                         worker_env=worker_env, warm_up=warm_up))
