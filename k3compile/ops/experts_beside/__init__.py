"""``k3compile.ops.experts_beside``: a latent MoE layer's routed experts beside its shared experts
(``k3::experts_beside``)."""
from __future__ import annotations

from typing import Optional

import torch

from .dispatch import EXPERTS_BESIDE
from .op import experts_beside_op
from .reference import experts_beside_ref

__all__ = ["experts_beside", "experts_beside_ref", "EXPERTS_BESIDE"]


def experts_beside(z: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, w1: torch.Tensor,
                   w3: torch.Tensor, w2: torch.Tensor, x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor,
                   w_down: torch.Tensor, w1_scale: Optional[torch.Tensor] = None,
                   w3_scale: Optional[torch.Tensor] = None, w2_scale: Optional[torch.Tensor] = None,
                   beta: Optional[float] = None, linear_beta: Optional[float] = None,
                   shared_beta: Optional[float] = None, shared_linear_beta: Optional[float] = None, *,
                   experts_backend: str = "auto", small_m_limit: int = 16, backend: str = "auto", m_limit: int = 16
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """A MoE layer's routed experts (``k3compile.ops.moe_experts.moe_experts``) and its shared experts' chain
    ``down(situ_glu(gate(x), up(x)))``, the routed experts on a second stream of the device while the chain runs
    (``dispatch.py``).

    Args:
        z, experts, weights, w1, w3, w2, w1_scale, w3_scale, w2_scale, beta, linear_beta: the routed experts' inputs,
            as ``moe_experts`` takes them; experts_backend, small_m_limit: its backend and small-M limit.
        x: the layer's input ``[M, D]``, fp32 / bf16 / fp16; w_gate, w_up ``[I, D]`` and w_down ``[D', I]``: the shared
            experts' weights, x's dtype; shared_beta, shared_linear_beta: their SiTU-GLU's constants (None: SiLU / up
            uncapped).
        backend, m_limit: the shared products' backend and small-M limit (``k3::skinny_gemm``'s).

    Returns:
        ``(routed [M, L] in z's dtype, shared [M, D'] in x's dtype)``.

    Example::

        y_lat, y_shared = experts_beside(z, ids, w, ex.w1, ex.w3, ex.w2, x, mlp.gate_proj.weight,
                                         mlp.up_proj.weight, mlp.down_proj.weight, ex.w1_scale, ex.w3_scale,
                                         ex.w2_scale, 4.0, 25.0, 4.0, 25.0)
    """
    return experts_beside_op(z, experts, weights, w1, w3, w2, w1_scale, w3_scale, w2_scale, beta, linear_beta,
                             experts_backend, small_m_limit, x, w_gate, w_up, w_down, shared_beta, shared_linear_beta,
                             backend, m_limit)
