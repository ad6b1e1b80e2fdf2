"""``k3compile.ops.moe_route``: the MoE router's tail after its product, fused (``k3::moe_route``)."""
from __future__ import annotations

from typing import Optional

import torch

from .dispatch import MOE_ROUTE
from .op import moe_route_op

__all__ = ["moe_route", "MOE_ROUTE"]


def moe_route(logits: torch.Tensor, bias: torch.Tensor, top_k: int, renorm_eps: Optional[float] = 1e-20,
              scaling: float = 1.0, backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """Sigmoid scores, the top-k experts of score + bias, their unbiased scores renormalised and scaled, in one
    kernel (in place of a sigmoid, a top-k, a sort and a gather-and-normalise kernel).

    Args:
        logits: the router's product ``[M, E]`` fp32.
        bias: the score-correction bias ``[E]`` fp32 (it picks the experts, it is not in the weights).
        top_k: experts a token, 1 <= top_k <= E.
        renorm_eps: weights / (sum + renorm_eps); None: not renormalised.
        scaling: the routed scaling factor the weights are multiplied by.
        backend: "auto" | "triton" | "reference" (see ``k3compile.backends``).

    Returns:
        ``(weights [M, top_k] fp32, experts [M, top_k] int64)``, experts in descending order of score + bias (ties:
        the lower expert id first; a NaN key ranks above every number, as in ``torch.topk``).

    Example::

        weights, experts = moe_route(F.linear(x.float(), w.float()), bias, 16)
    """
    return moe_route_op(logits, bias, top_k, renorm_eps, scaling, backend)
