"""The latent-MoE tail as one CuTe DSL kernel (NVIDIA sm_90+): the skinny GEMM with the RMSNorm fused.

    out[M, D] = RMSNorm_eps(latent[M, L]) · norm_weight[L] @ up_weight[D, L]ᵀ + shared[M, D]

The CuTe skinny GEMM (``k3compile/ops/skinny_gemm/cute.py``) splits K across the warps of a block
(or the blocks of a cluster), so every block sees all of K for its rows of the weight. With the norm
fused, each 16-byte vector of ``latent`` is multiplied by ``norm_weight`` as it is loaded (rounded to
the input dtype: it is the MMA's operand), the rows' sums of squares of the raw latent accumulate in
fp32 beside it, and the epilogue scales the fp32 dot products by ``rsqrt(ss / L + eps)`` before adding
``shared`` and rounding once. The model rounds differently (normalise, round, times the weight,
round): the two differ by about one bf16 ulp of the normalised activation, inside the op's tolerance.

bf16 only: x·g is rounded before the normalisation, so fp16 could overflow on large latents (the
model's order normalises first). fp16 takes the op's other implementations.

cutlass is imported only inside functions (through the skinny GEMM module): CI has no CuTe DSL.
"""
from __future__ import annotations

from typing import Optional

import torch

from k3compile.backends import cute_can_run_on
from k3compile.ops.skinny_gemm import config as _config
from k3compile.ops.skinny_gemm import cute as _skinny

MAX_M = _skinny.MAX_M
VEC = _skinny.VEC


def available(latent, shared, norm_weight, up_weight, eps) -> Optional[str]:
    """None when the CuTe tail can run on this machine for these tensors, else the reason."""
    return cute_can_run_on(latent, shared, norm_weight, up_weight)


def supports(latent, shared, norm_weight, up_weight, eps) -> Optional[str]:
    """None when the kernel handles these shapes/dtypes/strides, else the reason."""
    if latent.dtype != torch.bfloat16:
        return (f"dtype {latent.dtype}: the fused norm scales x by g before normalising, which can "
                "overflow fp16; bf16 only")
    if norm_weight.dim() != 1 or latent.dim() != 2 or norm_weight.shape[0] != latent.shape[1]:
        return f"norm_weight must be [L] for latent [M, L], got {tuple(norm_weight.shape)}"
    if norm_weight.dtype != latent.dtype or norm_weight.stride(0) != 1 or norm_weight.data_ptr() % 16:
        return "norm_weight must be a contiguous, 16-byte aligned tensor of latent's dtype"
    if not isinstance(eps, (int, float)) or not eps >= 0:
        return f"eps must be a non-negative number, got {eps!r}"
    return _skinny.supports(latent, up_weight, None, shared)


# Measured on one H200 (L 3584, D 7168, bf16, eps 1e-5; CUDA-graph medians, weights rotated out of L2).
# First a sweep at M 1, 4, 16 (ceiling 4.248 TB/s): rg2-wn1-wk4-u2-s4 was best at M 1 and 4; split-K
# clusters, 8 K-warps and the register path were slower at every M. Then this table, one run (ceiling
# 4.222 TB/s), against unfused torch.compile and the split path (Triton norm + skinny GEMM):
#   M  1: 16.22 µs (75% of the ceiling) vs compile 22.31, split 18.58: x1.38
#   M  2: 15.55 µs (78%) vs compile 21.52, split 21.54: x1.38
#   M  4: 15.86 µs (77%) vs compile 21.81, split 18.95: x1.38
#   M  8: 17.08 µs (72%) vs compile 22.04, split 19.33: x1.29
#   M 16: 20.50 µs (60%) vs compile 19.05, split 19.32: x0.93 (not profitable)
# With static_weight=True: 15.23 / 14.50 / 15.09 / 16.30 / 19.47 µs. Other shapes use the skinny GEMM's choice.
TAIL_TABLE: dict[tuple[int, int, int], _config.SkinnyConfig] = {
    (1, 7168, 3584): _config.SkinnyConfig(2, 1, 4, 2, stages=4),
    (2, 7168, 3584): _config.SkinnyConfig(2, 1, 4, 2, stages=4),
    (4, 7168, 3584): _config.SkinnyConfig(2, 1, 4, 2, stages=4),
    (8, 7168, 3584): _config.SkinnyConfig(2, 1, 4, 2, stages=4),
    (16, 7168, 3584): _config.SkinnyConfig(1, 1, 4, 2, stages=4),
}
# Above this many rows the fused kernel did not beat unfused torch.compile on the H200 (M = 16: x0.93).
PROFITABLE_MAX_M = 8


def tail_config(m: int, d: int, l: int) -> _config.SkinnyConfig:
    """The configuration for this tail: its own table, else the skinny GEMM's choice or heuristic.

    The skinny table's "cuBLAS is faster" entries do not apply here: the fused norm saves a launch."""
    key = (_config.m_bucket(m), d, l)
    if key in TAIL_TABLE:
        return TAIL_TABLE[key]
    return _config.choose(m, d, l) or _config.heuristic(m, d, l)


def profitable(latent, shared, norm_weight, up_weight, eps) -> Optional[str]:
    """None where the H200 measured the fused kernel ahead of the unfused sequence, else the reason."""
    m = latent.shape[0]
    if m > PROFITABLE_MAX_M:
        return f"M={m} > {PROFITABLE_MAX_M}: the fused CuTe tail measured x0.93 of unfused torch.compile at M=16"
    return None


def latent_moe_tail_cute(latent: torch.Tensor, shared: torch.Tensor, norm_weight: torch.Tensor,
                         up_weight: torch.Tensor, eps: float,
                         cfg: Optional[_config.SkinnyConfig] = None,
                         out: Optional[torch.Tensor] = None, static_weight: bool = False) -> torch.Tensor:
    """The fused tail on the current CUDA stream; returns a new [M, D] tensor (or fills ``out``).

    latent [M, L] (M ≤ 16), shared [M, D], norm_weight [L], up_weight [D, L], all bf16, L % 8 == 0.
    Call ``available``/``supports`` first. ``cfg`` overrides the configuration (benchmarks);
    ``static_weight=True`` promises that no kernel writes ``up_weight`` (see ``skinny_gemm_cute``).
    """
    m, l = latent.shape
    d = up_weight.shape[0]
    if cfg is None:
        cfg = tail_config(m, d, l)
    fn = _skinny.compile_kernel(latent.dtype, m, cfg, False, True, static_weight, float(eps))
    if out is None:
        out = torch.empty((m, d), dtype=latent.dtype, device=latent.device)
    fn(latent, up_weight, out, None, shared, norm_weight)
    return out


def warmup(dtype: torch.dtype, m: int, d: int, l: int, eps: float, static_weight: bool = False) -> None:
    """Compile (or load from the disk cache) the variant a later call will use, before graph capture."""
    _skinny.compile_kernel(dtype, m, tail_config(m, d, l), False, True, static_weight, float(eps))
