"""The skinny GEMM's CuTe implementation (NVIDIA sm_90+): ``C = A · Wᵀ (+ bias) (+ residual)`` by one of the CuTe DSL
kernels in ``k3compile/kernels/cute/`` (the configuration's type picks it: ``mma.py``'s mma.sync kernel for an
``MmaConfig``, ``wgmma.py``'s warpgroup-MMA kernel for a ``WgmmaConfig``).

a: [M, K] (M <= 16), w: [N, K], bias: [N] or None, residual: [M, N] or None, all bf16 or all fp16, fp32 accumulation,
one rounding at the end (as ``reference.py``); with a fp32 output (``out_dtype``, the upcast product) C and the
residual are fp32 and the sums are stored unrounded. The kernels are compiled per variant and cached
(``kernels/cute/compile.py``), launched through TVM-FFI on the current torch stream (capturable in CUDA graphs) with
programmatic dependent launch. ``dispatch.py`` decides when this runs and with which configuration.

Nothing here imports cutlass: the kernel modules load on the first compile.
"""
from __future__ import annotations

from typing import Optional

import torch

from k3compile.kernels.cute.compile import KIND, compile_kernel, variant
from k3compile.kernels.cute.configs import VEC, KernelConfig, WgmmaConfig

MAX_M = 16
_DTYPES = (torch.bfloat16, torch.float16)


def supports(a, w, bias=None, residual=None, out_dtype=None) -> Optional[str]:
    """None when the kernels take these shapes, dtypes and strides, else the reason."""
    out = out_dtype or a.dtype
    if out not in (a.dtype, torch.float32):
        return f"{out} output of {a.dtype} operands: the kernels store their operands' dtype or fp32"
    if a.dim() != 2 or w.dim() != 2:
        return f"needs 2-D a and w, got {a.dim()}-D and {w.dim()}-D"
    m, k = a.shape
    n, kw = w.shape
    if kw != k:
        return f"K mismatch: a is [{m}, {k}], w is [{n}, {kw}]"
    if not 1 <= m <= MAX_M:
        return f"M={m} outside 1..{MAX_M}"
    if n < 1 or k < 1:
        return f"empty product (N={n}, K={k})"
    if a.dtype not in _DTYPES or w.dtype != a.dtype:
        return f"dtypes {a.dtype}/{w.dtype}: needs bf16 or fp16, both the same"
    if k % VEC:
        return f"K={k} not a multiple of {VEC} (128-bit loads)"
    for name, t in (("a", a), ("w", w)):
        if t.stride(1) != 1 or t.stride(0) % VEC or t.data_ptr() % 16:
            return f"{name} must be row-major with 16-byte aligned rows (strides {t.stride()})"
    if bias is not None:
        if bias.shape != (n,) or bias.dtype != a.dtype or bias.stride(0) != 1:
            return f"bias must be a contiguous [{n}] {a.dtype} tensor"
    if residual is not None:
        if residual.shape != (m, n) or residual.dtype != out or residual.stride(1) != 1:
            return f"residual must be a row-major [{m}, {n}] {out} tensor"
    return None


def skinny_gemm_cute(a: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor], residual: Optional[torch.Tensor],
                     cfg: KernelConfig, out: Optional[torch.Tensor] = None, static_weight: bool = False,
                     out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """``a @ w.T (+ bias) (+ residual)`` on the current CUDA stream; returns a new [M, N] tensor (or fills ``out``).

    a: [M, K] (M <= 16), w: [N, K], bias: [N], residual: [M, N]; bf16 or fp16; K % 8 == 0 (``supports``). ``cfg``
    names the kernel and its work division (``dispatch.cute_config`` gives the op's): an ``MmaConfig`` runs the
    mma.sync kernel, a ``WgmmaConfig`` the wgmma kernel. ``out_dtype``: None (a's) or float32 (``supports``).
    ``out``: a contiguous [M, N] tensor of that dtype.
    ``static_weight=True`` promises that no kernel writes ``w`` (a module parameter): the kernel then starts
    streaming it before waiting on the previous kernel (PDL), which is unsafe otherwise; and with a ``trigger_first``
    configuration it lets the next kernel launch before its own wait (``op.py`` says what a caller vouches for).
    """
    m, k = a.shape
    n = w.shape[0]
    if isinstance(cfg, WgmmaConfig) and not cfg.share_fits(k):
        raise ValueError(f"{cfg.tag()}: a block's share of K={k} does not suit its register tiles / resident A "
                         f"({cfg.reg_stages}..{cfg.a_tiles()} tiles of {cfg.block_k})")
    fp32 = _out_fp32(a, out_dtype)
    fn = compile_kernel(a.dtype, m, cfg, bias is not None, residual is not None, static_weight, out_fp32=fp32)
    if out is None:
        out = torch.empty((m, n), dtype=torch.float32 if fp32 else a.dtype, device=a.device)
    fn(a, w, out, bias, residual, None)
    return out


def _out_fp32(a, out_dtype) -> bool:
    return out_dtype is not None and out_dtype != a.dtype


def kernels(a, w, bias, residual, cfg: KernelConfig, static_weight: bool = False, out_dtype=None) -> list:
    """The kernel ``skinny_gemm_cute`` builds at its first call with these operands: ``[(kind, key)]``
    (``k3compile/kernel_cache.py``); none where the call raises instead."""
    if isinstance(cfg, WgmmaConfig) and not cfg.share_fits(a.shape[1]):
        return []
    return [(KIND, variant(a.dtype, a.shape[0], cfg, bias is not None, residual is not None, static_weight,
                           out_fp32=_out_fp32(a, out_dtype)))]


def warmup(dtype: torch.dtype, m: int, cfg: KernelConfig, has_bias: bool = False, has_residual: bool = False,
           static_weight: bool = False) -> None:
    """Compile (or load) the variant a later call will use, so that CUDA-graph capture never compiles."""
    compile_kernel(dtype, m, cfg, has_bias, has_residual, static_weight)
