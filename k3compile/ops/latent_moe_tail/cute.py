"""The latent-MoE tail as one CuTe DSL kernel (NVIDIA sm_90+): the skinny GEMM with the RMSNorm fused.

    out[M, D] = RMSNorm_eps(latent[M, L]) · norm_weight[L] @ up_weight[D, L]ᵀ + shared[M, D]

Either CuTe skinny GEMM carries the norm (``k3compile/ops/skinny_gemm/``; the table entry's type picks it):

- the mma.sync kernel (``cute.py``, a ``SkinnyConfig``) splits K across the warps of a block (or the blocks
  of a cluster), so every block sees all of K for its rows of the weight; each 16-byte vector of ``latent``
  is multiplied by ``norm_weight`` as it is loaded;
- the wgmma kernel (``cute_wgmma.py``, a ``WgmmaConfig``) keeps the block's K share of ``latent`` resident
  in shared memory, and its norm warps scale each tile by ``norm_weight`` as it lands while the MMA warps
  stream the weight.

Both round x·g to the input dtype (it is the MMA's operand), sum the raw latent's squares per row in fp32
beside it, and scale the fp32 dot products by ``rsqrt(ss / L + eps)`` in the epilogue before adding
``shared`` and rounding once. The model rounds differently (normalise, round, times the weight, round):
the two differ by about one bf16 ulp of the normalised activation, inside the op's tolerance.

bf16 only: x·g is rounded before the normalisation, so fp16 could overflow on large latents (the
model's order normalises first). fp16 takes the op's other implementations.

cutlass is imported only inside functions (through the skinny GEMM modules): CI has no CuTe DSL.
"""
from __future__ import annotations

from typing import Optional, Union

import torch

from k3compile.backends import cute_can_run_on
from k3compile.ops.skinny_gemm import config as _config
from k3compile.ops.skinny_gemm import cute as _skinny
from k3compile.ops.skinny_gemm.cute_wgmma import WgmmaConfig

TailKernelConfig = Union[_config.SkinnyConfig, WgmmaConfig]

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


# The mma.sync kernel's form, measured on one H200 (L 3584, D 7168, bf16, eps 1e-5; CUDA-graph medians, 14 weights
# rotated out of L2, benchmarks/moe_tail.py's harness, copy ceiling 4.22 TB/s), sixth session (these entries were
# replaced by the wgmma form's below):
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
# The wgmma kernel's form (eighth session, .scratch/s8 runs 2-7 on one H200, the same harness, every candidate timed
# in 3 interleaved passes, medians; unfused torch.compile ran 19.2-22.3 µs in the seventh session's final run):
# - The MMA warps scaling A one tile ahead (WG6, seventh session): 15.9 / 19.9 µs at M 8 / 16.
# - Norm warps of their own, scalar shared-memory accesses: M 1-8 static 13.3-13.6 µs, but M 16 17.0-17.8 whatever
#   the stages, the producer warp, 4 or 8 norm warps or A's requests spread over the stream: 2-byte accesses (4-way
#   bank conflicts) took as many shared-memory wavefronts per tile as the ring's TMA writes and wgmma reads together.
# - 16-byte accesses (run 6): M16 13.30 static, 14.96 not; M 1-8 13.03-13.30 / 14.34-14.59.
# - Run 7, not static: the producer warp with 5 stages and the first 6 weight tiles prefetched into L2 before the PDL
#   wait (an l2_tiles option, removed in the ninth session once no entry used it) led at every M: 14.14 / 14.18 /
#   14.32 / 14.32 / 14.67 µs at M 1 / 2 / 4 / 8 / 16 (without the prefetch 14.32-14.86; 12 tiles 14.8-15.1, 28 tiles
#   18.0-18.3). Static: the producer warp with 6 stages,
#   13.03-13.30 µs (8 stages within 0.1 µs at M <= 8). The plain GEMM (no norm, residual) ran 13.21-13.30 µs beside.
# - Ninth session (.scratch/s9, same harness): a block's first PDL trigger is the one that counts, and the norm warps
#   and the producer warp reach theirs stages before the MMA warps finish. With the MMA warps alone triggering, after
#   their K loop (mma_trigger), not static: 6 stages 13.97 / 13.92 / 13.94 µs at M 16 / 8 / 1 in one run and
#   14.24 / 14.16 / 14.18 / 14.09 at M 16 / 8 / 4 / 1 in the next, against the L2-prefetch form's 14.55-14.66 at
#   M16 (14.13-14.34 at M 1-8); 5 stages 0.05-0.15 µs slower, 7-8 stages (M <= 8) 0.1 µs slower, no producer
#   warp 0.3 µs slower, with the L2 prefetch as well 0.5 µs slower. Static, the MMA-warps trigger lost (M16 14.23
#   against 13.13) and so did the trigger right after the wait (13.2-13.6 against 13.05-13.26).
# Other shapes use the skinny GEMM's mma.sync choice.
_WG = dict(producer_warp=True, evict_hints=True)
TAIL_TABLE: dict[tuple[int, int, int], TailKernelConfig] = {
    (m, 7168, 3584): WgmmaConfig(64, 128, 6, 1, mma_trigger=True, **_WG) for m in (1, 2, 4, 8, 16)}
# With ``static_weight=True`` (the first weight stages requested before the PDL wait): where another configuration
# measured faster than TAIL_TABLE's; elsewhere TAIL_TABLE's.
TAIL_TABLE_STATIC: dict[tuple[int, int, int], TailKernelConfig] = {
    (m, 7168, 3584): WgmmaConfig(64, 128, 6, 1, **_WG) for m in (1, 2, 4, 8, 16)}


def wgmma_fits(cfg: WgmmaConfig, m: int, l: int) -> bool:
    """Whether a block's K share of the latent fits the wgmma tail's resident A (its shared memory)."""
    tiles = -(-l // cfg.block_k)
    return -(-tiles // cfg.split_k) <= cfg.norm_a_tiles(m)


def tail_config(m: int, d: int, l: int, static_weight: bool = False) -> TailKernelConfig:
    """The configuration for this tail: its own table (with ``static_weight``: TAIL_TABLE_STATIC first; a wgmma
    entry only where the block's share of the latent fits its shared memory), else the skinny GEMM's mma.sync
    choice or heuristic.

    The skinny table's "cuBLAS is faster" entries do not apply here: the fused norm saves a launch. Nor do its
    wgmma entries: they were measured without the norm warps, and their stages leave the resident A no room."""
    key = (_config.m_bucket(m), d, l)
    for table in ((TAIL_TABLE_STATIC, TAIL_TABLE) if static_weight else (TAIL_TABLE,)):
        cfg = table.get(key)
        if cfg is not None and (isinstance(cfg, _config.SkinnyConfig) or wgmma_fits(cfg, m, l)):
            return cfg
    cfg = _config.choose(m, d, l)
    return cfg if isinstance(cfg, _config.SkinnyConfig) else _config.heuristic(m, d, l)


def latent_moe_tail_cute(latent: torch.Tensor, shared: torch.Tensor, norm_weight: torch.Tensor,
                         up_weight: torch.Tensor, eps: float,
                         cfg: Optional[TailKernelConfig] = None,
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
    elif isinstance(cfg, WgmmaConfig) and not wgmma_fits(cfg, m, l):
        raise ValueError(f"{cfg.tag()}: a block's share of L={l} does not fit its resident A "
                         f"({cfg.norm_a_tiles(m)} tiles of {cfg.block_k})")
    fn = _skinny.compile_kernel(latent.dtype, m, cfg, False, True, static_weight, float(eps))
    if out is None:
        out = torch.empty((m, d), dtype=latent.dtype, device=latent.device)
    fn(latent, up_weight, out, None, shared, norm_weight)
    return out


def warmup(dtype: torch.dtype, m: int, d: int, l: int, eps: float, static_weight: bool = False) -> None:
    """Compile (or load from the disk cache) the variant a later call will use, before graph capture."""
    _skinny.compile_kernel(dtype, m, tail_config(m, d, l, static_weight), False, True, static_weight, float(eps))
