"""``k3compile.ops.route_beside``: a MoE layer's routing beside another product of its input (``k3::route_beside``)."""
from __future__ import annotations

from typing import Optional

import torch

from .dispatch import ROUTE_BESIDE
from .op import route_beside_op
from .reference import route_beside_ref

__all__ = ["route_beside", "route_beside_ref", "ROUTE_BESIDE"]


def route_beside(a: torch.Tensor, router_w: torch.Tensor, bias: torch.Tensor, top_k: int, w: torch.Tensor,
                 renorm_eps: Optional[float] = 1e-20, scaling: float = 1.0, backend: str = "auto",
                 route_backend: str = "auto", m_limit: int = 16) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The router's product of ``a`` and its routing (``k3::moe_route``), and the product ``a @ w.T``: the routing on a
    second stream of the device while the product runs (``dispatch.py``).

    Args:
        a: the layer's input ``[M, K]``, 16-bit or fp32.
        router_w: the router's weight ``[E, K]``, a's dtype; its product is taken in fp32, as the model takes it.
        bias: the score-correction bias ``[E]`` fp32.
        top_k, renorm_eps, scaling: as ``k3compile.ops.moe_route.moe_route`` takes them.
        w: the other product's weight ``[N, K]``, a's dtype.
        backend: the products' backend (``k3::skinny_gemm``'s); route_backend: the routing's; m_limit: the products'
            small-M limit.

    Returns:
        ``(weights [M, top_k] fp32, experts [M, top_k] int64, a @ w.T [M, N])``.

    Example::

        weights, experts, latent = route_beside(x, gate.weight, gate.bias, 16, down.weight, scaling=2.5)
    """
    return route_beside_op(a, router_w, bias, top_k, renorm_eps, scaling, w, backend, route_backend, m_limit)
