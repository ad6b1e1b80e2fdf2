"""The latent-MoE tail as one CuTe DSL kernel (NVIDIA sm_90+): the skinny GEMM with the RMSNorm fused.

    out[M, D] = RMSNorm_eps(latent[M, L]) · norm_weight[L] @ up_weight[D, L]ᵀ + shared[M, D]

Either CuTe skinny GEMM carries the norm (``k3compile/kernels/cute/``; the configuration's type picks it):

- the mma.sync kernel (an ``MmaConfig``) splits K across the warps of a block (or the blocks
  of a cluster), so every block sees all of K for its rows of the weight; each 16-byte vector of ``latent``
  is multiplied by ``norm_weight`` as it is loaded;
- the wgmma kernel (a ``WgmmaConfig``) keeps the block's K share of ``latent`` resident
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

from typing import Optional

import torch

from k3compile.kernels.cute.configs import KernelConfig, WgmmaConfig
from k3compile.ops.skinny_gemm import cute as _skinny
from k3compile.kernels.cute.compile import KIND, compile_kernel, variant


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


def latent_moe_tail_cute(latent: torch.Tensor, shared: torch.Tensor, norm_weight: torch.Tensor,
                         up_weight: torch.Tensor, eps: float, cfg: KernelConfig,
                         out: Optional[torch.Tensor] = None, static_weight: bool = False) -> torch.Tensor:
    """The fused tail on the current CUDA stream; returns a new [M, D] tensor (or fills ``out``).

    latent [M, L] (M <= 16), shared [M, D], norm_weight [L], up_weight [D, L], all bf16, L % 8 == 0 (``supports``).
    ``cfg``: the kernel and its work division (``dispatch.cute_config_for`` gives the op's). ``static_weight=True``
    promises that no kernel writes ``up_weight`` (``skinny_gemm/op.py`` says what a caller vouches for).
    """
    m, l = latent.shape
    d = up_weight.shape[0]
    if isinstance(cfg, WgmmaConfig) and not cfg.norm_fits(m, l):
        raise ValueError(f"{cfg.tag()}: a block's share of L={l} does not fit its resident A "
                         f"({cfg.norm_a_tiles(m)} tiles of {cfg.block_k})")
    fn = compile_kernel(latent.dtype, m, cfg, False, True, static_weight, float(eps))
    if out is None:
        out = torch.empty((m, d), dtype=latent.dtype, device=latent.device)
    fn(latent, up_weight, out, None, shared, norm_weight)
    return out


def kernels(latent, up_weight, eps: float, cfg: KernelConfig, static_weight: bool = False) -> list:
    """The kernel ``latent_moe_tail_cute`` builds at its first call: ``[(kind, key)]`` (``k3compile/kernel_cache.py``);
    none where the call raises instead."""
    m, l = latent.shape
    if isinstance(cfg, WgmmaConfig) and not cfg.norm_fits(m, l):
        return []
    return [(KIND, variant(latent.dtype, m, cfg, False, True, static_weight, float(eps)))]


def warmup(dtype: torch.dtype, m: int, cfg: KernelConfig, eps: float, static_weight: bool = False) -> None:
    """Compile (or load from the disk cache) the variant a later call will use, before graph capture."""
    compile_kernel(dtype, m, cfg, False, True, static_weight, float(eps))
