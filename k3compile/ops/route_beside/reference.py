"""Plain-PyTorch ground truth of ``k3::route_beside``: the model's router product and routing (``model/moe.py``
``route``), and the other product of the same input (the latent MoE's down-projection, ``model/moe.py``)."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from k3compile.ops.moe_route.reference import moe_route_ref


def route_beside_ref(a: torch.Tensor, router_w: torch.Tensor, bias: torch.Tensor, top_k: int,
                     renorm_eps: Optional[float], scaling: float, w: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """a [M, K], router_w [E, K], w [N, K] (one dtype), bias [E] fp32 -> (weights [M, top_k] fp32, experts
    [M, top_k] int64, ``a @ w.T`` [M, N] in a's dtype). The router's product is taken on the upcast operands, as the
    model takes it."""
    weights, experts = moe_route_ref(F.linear(a.float(), router_w.float()), bias, top_k, renorm_eps, scaling)
    return weights, experts, F.linear(a, w)
