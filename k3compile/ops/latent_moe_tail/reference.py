"""Plain PyTorch forms of the latent-MoE tail (``model/moe.py``: the latent's norm, up-projection and shared add),
any device, any float dtype.

Shapes: latent [M, L], shared [M, D], norm_weight [L], up_weight [D, L] (nn.Linear layout), out [M, D].

- :func:`latent_moe_tail_ref` -- the ground truth: every step in fp32, one rounding at the end.
- :func:`latent_moe_tail_unfused` -- what the model computes, with the shared add folded into
  ``addmm``; the ``reference`` implementation of the op and its path above the small-M limit.
- :func:`kimi_rms_norm` -- ``KimiRMSNorm``: normalise in fp32, round, then scale by the weight.
"""
from __future__ import annotations

import torch


def kimi_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``w * (x_f32 * rsqrt(mean(x_f32^2) + eps)).to(x.dtype)``, exactly as the model writes it."""
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def latent_moe_tail_unfused(latent: torch.Tensor, shared: torch.Tensor, norm_weight: torch.Tensor,
                            up_weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm(latent) @ up_weightᵀ + shared as norm then one ``addmm`` (the add in the GEMM epilogue)."""
    return torch.addmm(shared, kimi_rms_norm(latent, norm_weight, eps), up_weight.t())


def latent_moe_tail_ref(latent: torch.Tensor, shared: torch.Tensor, norm_weight: torch.Tensor,
                        up_weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The tail in fp32 throughout (no intermediate rounding), returned in ``latent.dtype``."""
    x = latent.float()
    normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * norm_weight.float()
    return (normed @ up_weight.float().t() + shared.float()).to(latent.dtype)
