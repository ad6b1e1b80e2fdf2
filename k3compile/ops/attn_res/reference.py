"""Plain-PyTorch AttnRes mix and the RMSNorm after it: the ground truth of ``k3::attn_res`` (``model/attn_res.py``
``attn_res``, then ``model/layers.py`` ``rms_norm`` where the layer normalises the mix; K3 spec §7) and of
``k3::attn_res_add`` (the same, its last source the layer's residual add ``prefix + a``, ``model/modeling.py``)."""
from __future__ import annotations

from typing import Optional

import torch


def attn_res_ref(sources: list[torch.Tensor], proj_weight: torch.Tensor, mix_norm_weight: torch.Tensor, eps: float,
                 norm_weight: Optional[torch.Tensor], norm_eps: float) -> torch.Tensor:
    """sources: S tensors [..., D] of one dtype (the completed blocks, then the partial sum) -> the mix [..., D] in
    that dtype, or, with ``norm_weight``, ``norm_weight * rms_norm(mix)`` (the model's KimiRMSNorm)."""
    stacked = torch.stack(sources).float()                                          # [S, ..., D]
    keys = stacked * torch.rsqrt(stacked.pow(2).mean(-1, keepdim=True) + eps)
    query = mix_norm_weight.float() * proj_weight.float().reshape(-1)
    alpha = torch.softmax((keys * query).sum(-1), dim=0)                            # [S, ...]
    mix = (alpha[..., None] * stacked).sum(0).to(sources[-1].dtype)
    if norm_weight is None:
        return mix
    mix32 = mix.float()
    return norm_weight * (mix32 * torch.rsqrt(mix32.pow(2).mean(-1, keepdim=True) + norm_eps)).to(mix.dtype)


def attn_res_add_ref(sources: list[torch.Tensor], addend: torch.Tensor, proj_weight: torch.Tensor,
                     mix_norm_weight: torch.Tensor, eps: float, norm_weight: Optional[torch.Tensor],
                     norm_eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``attn_res_ref`` with the last source ``sources[-1] + addend`` (added in the sources' dtype, as the model's
    residual add is) -> (its output, that sum [..., D], contiguous)."""
    partial = (sources[-1] + addend).contiguous()
    return attn_res_ref([*sources[:-1], partial], proj_weight, mix_norm_weight, eps, norm_weight, norm_eps), partial
