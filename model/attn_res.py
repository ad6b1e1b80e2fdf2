"""Block Attention Residuals (spec §7): the input of each sub-layer is a softmax-weighted sum over depth.

Shape legend: N stored blocks, B batch, T tokens, D hidden.
Sources are the N completed block sums plus the current partial sum ("prefix"). Each source is RMS-normalised
(no weight on the value itself), scored against one learned pseudo-query (norm weight * proj weight, fused into
one vector), the scores are softmaxed over depth, and the raw sources are mixed. All in fp32, cast back.
"""
from __future__ import annotations

import torch


def attn_res(prefix: torch.Tensor, blocks: list, proj_weight: torch.Tensor, norm_weight: torch.Tensor,
             eps: float) -> torch.Tensor:
    """prefix [B, T, D], blocks: N tensors [B, T, D], proj_weight [1, D], norm_weight [D] -> [B, T, D]."""
    sources = torch.stack([*blocks, prefix]).float()                          # [N+1, B, T, D]
    keys = sources * torch.rsqrt(sources.pow(2).mean(-1, keepdim=True) + eps)
    query = norm_weight.float() * proj_weight.float().reshape(-1)            # [D]
    scores = (keys * query).sum(-1)                                          # [N+1, B, T]
    alpha = torch.softmax(scores, dim=0)
    return (alpha[..., None] * sources).sum(0).to(prefix.dtype)
