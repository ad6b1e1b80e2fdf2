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


# Measured on one H200 (L 3584, D 7168, bf16, eps 1e-5; CUDA-graph medians, 14 weights rotated out of L2,
# benchmarks/moe_tail.py's harness, copy ceiling 4.22 TB/s).
# - First sweep (M 1, 4, 16): rg2-wn1-wk4-u2-s4 best at M 1 and 4; split-K clusters, 8 K-warps and the
#   register path slower at every M.
# - Sweep at M 8 and 16 (29 configurations, static weight off and on): at M 8 a 3-stage ring beat the 4-stage
#   one (16.45 / 16.05 µs static off / on against 17.31 / 16.53); rg2-wn1-wk8-u1-s4 tied it with static weight
#   only (16.04); register paths, rg4, wn2 and cluster splits were slower. At M 16 no configuration came within
#   15% of the Triton / split paths (best 23.38 µs, static 22.83, against 20.0): the A side (norm scaling of
#   two 8-row halves per step) costs more than the weight stream there.
# - Then s3 against s4 at every M, both ways (static off / on, µs):
#     M 1: 15.54 / 14.95 vs 16.22 / 15.18     M 2: 14.94 / 14.63 vs 15.65 / 14.85
#     M 4: 15.37 / 15.04 vs 16.18 / 15.37     M 8: 16.25, 17.01 / 15.86 vs 17.13, 17.74 / 16.32
#   so s3 both ways at M <= 8 (static weight does not change the winner: one table). Unfused torch.compile
#   in earlier runs of the same harness: 21.5-22.9 µs at M <= 8, 18.9-19.2 at M 16.
# Other shapes use the skinny GEMM's choice.
TAIL_TABLE: dict[tuple[int, int, int], _config.SkinnyConfig] = {
    (1, 7168, 3584): _config.SkinnyConfig(2, 1, 4, 2, stages=3),
    (2, 7168, 3584): _config.SkinnyConfig(2, 1, 4, 2, stages=3),
    (4, 7168, 3584): _config.SkinnyConfig(2, 1, 4, 2, stages=3),
    (8, 7168, 3584): _config.SkinnyConfig(2, 1, 4, 2, stages=3),
    (16, 7168, 3584): _config.SkinnyConfig(1, 1, 4, 2, stages=4),   # only where forced: Triton / split run M 16
}
# With ``static_weight=True`` (the first weight stages copied before the PDL wait): entries where another
# configuration measured faster than TAIL_TABLE's (none at K3's widths: see above); elsewhere TAIL_TABLE's.
TAIL_TABLE_STATIC: dict[tuple[int, int, int], _config.SkinnyConfig] = {}
# Above this many rows the fused kernel did not beat unfused torch.compile on the H200 (M = 16: 22.8-23.5 µs
# against 19).
PROFITABLE_MAX_M = 8


def tail_config(m: int, d: int, l: int, static_weight: bool = False) -> _config.SkinnyConfig:
    """The configuration for this tail: its own table (with ``static_weight``: TAIL_TABLE_STATIC first),
    else the skinny GEMM's mma.sync choice or heuristic.

    The skinny table's "cuBLAS is faster" entries do not apply here: the fused norm saves a launch. Nor do its
    wgmma entries: that kernel has no fused norm (a fused form measured 15.9 / 19.9 µs at M 8 / 16 against the
    Triton tail's 15.4, so it was not kept)."""
    key = (_config.m_bucket(m), d, l)
    if static_weight and key in TAIL_TABLE_STATIC:
        return TAIL_TABLE_STATIC[key]
    if key in TAIL_TABLE:
        return TAIL_TABLE[key]
    cfg = _config.choose(m, d, l)
    return cfg if isinstance(cfg, _config.SkinnyConfig) else _config.heuristic(m, d, l)


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
        cfg = tail_config(m, d, l, static_weight)
    fn = _skinny.compile_kernel(latent.dtype, m, cfg, False, True, static_weight, float(eps))
    if out is None:
        out = torch.empty((m, d), dtype=latent.dtype, device=latent.device)
    fn(latent, up_weight, out, None, shared, norm_weight)
    return out


def warmup(dtype: torch.dtype, m: int, d: int, l: int, eps: float, static_weight: bool = False) -> None:
    """Compile (or load from the disk cache) the variant a later call will use, before graph capture."""
    _skinny.compile_kernel(dtype, m, tail_config(m, d, l, static_weight), False, True, static_weight, float(eps))
