"""Plain-PyTorch routing tail: the ground truth of ``k3::moe_route`` (``model/moe.py`` ``route`` after the router's
product; K3 spec: sigmoid scores, top-k of score + correction bias, weights from the unbiased scores, renormalised,
times the routed scaling factor)."""
from __future__ import annotations

from typing import Optional

import torch


def moe_route_ref(logits: torch.Tensor, bias: torch.Tensor, top_k: int, renorm_eps: Optional[float],
                  scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [M, E] fp32, bias [E] fp32 -> (weights [M, top_k] fp32, experts [M, top_k] int64), experts in
    descending order of score + bias. ``renorm_eps``: None leaves the weights unnormalised."""
    scores = torch.sigmoid(logits.float())
    experts = torch.topk(scores + bias.float(), top_k, dim=-1).indices
    weights = scores.gather(-1, experts)
    if renorm_eps is not None:
        weights = weights / (weights.sum(-1, keepdim=True) + renorm_eps)
    return weights * scaling, experts
