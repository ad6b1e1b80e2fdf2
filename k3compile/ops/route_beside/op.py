"""``k3::route_beside``: schema, checks and fake; ``dispatch.py`` decides where the routing runs."""
from __future__ import annotations

from typing import Optional

import torch

from k3compile.ops.moe_route.op import check_bias_and_top_k

from . import dispatch


def check_route_beside_args(a: torch.Tensor, router_w: torch.Tensor, bias: torch.Tensor, top_k: int,
                            w: torch.Tensor) -> None:
    """Raise ``ValueError`` on what the op cannot take (the two products' and the routing's own checks run
    again when they are called)."""
    if a.dim() != 2 or router_w.dim() != 2 or w.dim() != 2:
        raise ValueError(f"k3::route_beside: a, router_w and w must be 2-D, got {tuple(a.shape)}, "
                         f"{tuple(router_w.shape)} and {tuple(w.shape)}")
    if router_w.shape[1] != a.shape[1] or w.shape[1] != a.shape[1]:
        raise ValueError(f"k3::route_beside: a{tuple(a.shape)}, router_w{tuple(router_w.shape)} and "
                         f"w{tuple(w.shape)} disagree on K")
    if router_w.dtype != a.dtype or w.dtype != a.dtype:
        raise ValueError(f"k3::route_beside: router_w {router_w.dtype} and w {w.dtype} must be a's dtype {a.dtype}")
    check_bias_and_top_k("k3::route_beside", bias, router_w.shape[0], top_k)
    if bias.device != a.device:
        raise ValueError(f"k3::route_beside: bias on {bias.device}, a on {a.device}")


@torch.library.custom_op("k3::route_beside", mutates_args=())
def route_beside_op(a: torch.Tensor, router_w: torch.Tensor, bias: torch.Tensor, top_k: int,
                    renorm_eps: Optional[float], scaling: float, w: torch.Tensor, backend: str = "auto",
                    route_backend: str = "auto", m_limit: int = 16, router_static_weight: bool = False,
                    router_trigger_first: bool = True, static_weight: bool = False,
                    trigger_first: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    check_route_beside_args(a, router_w, bias, top_k, w)
    return dispatch.run(a, router_w, bias, top_k, renorm_eps, scaling, w, backend, route_backend, m_limit,
                        router_static_weight, router_trigger_first, static_weight, trigger_first)


@route_beside_op.register_fake
def _(a, router_w, bias, top_k, renorm_eps, scaling, w, backend="auto", route_backend="auto", m_limit=16,
      router_static_weight=False, router_trigger_first=True, static_weight=False, trigger_first=True):
    check_route_beside_args(a, router_w, bias, top_k, w)
    m = a.shape[0]
    return (a.new_empty(m, top_k, dtype=torch.float32), a.new_empty(m, top_k, dtype=torch.int64),
            a.new_empty(m, w.shape[0]))
