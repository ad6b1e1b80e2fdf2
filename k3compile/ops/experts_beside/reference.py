"""Plain-PyTorch ground truth of ``k3::experts_beside``: the routed experts (``k3::moe_experts``' reference) and the
shared experts' chain as the model computes it (``model/layers.py`` ``KimiMLP`` without its all-reduce)."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from k3compile.ops.moe_experts.reference import _situ_glu, moe_experts_ref


def situ_glu_ref(gate: torch.Tensor, up: torch.Tensor, beta: Optional[float], linear_beta: Optional[float]
                 ) -> torch.Tensor:
    """SiTU-GLU in fp32, rounded once to gate's dtype (``model/layers.py`` ``situ_glu``; ``beta=None``: SiLU,
    ``linear_beta=None``: up uncapped)."""
    return _situ_glu(gate.float(), up.float(), beta, linear_beta).to(gate.dtype)


def shared_mlp_ref(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor,
                   beta: Optional[float], linear_beta: Optional[float]) -> torch.Tensor:
    """x [M, D] -> ``down(situ_glu(gate(x), up(x)))`` [M, w_down rows], each product rounded to x's dtype."""
    return F.linear(situ_glu_ref(F.linear(x, w_gate), F.linear(x, w_up), beta, linear_beta), w_down)


def experts_beside_ref(z, experts, weights, w1, w3, w2, w1_scale, w3_scale, w2_scale, beta, linear_beta, x, w_gate,
                       w_up, w_down, shared_beta, shared_linear_beta) -> tuple[torch.Tensor, torch.Tensor]:
    """(the routed experts' combine [M, L] in z's dtype, the shared experts' output [M, D] in x's dtype)."""
    return (moe_experts_ref(z, experts, weights, w1, w3, w2, w1_scale, w3_scale, w2_scale, beta, linear_beta),
            shared_mlp_ref(x, w_gate, w_up, w_down, shared_beta, shared_linear_beta))
