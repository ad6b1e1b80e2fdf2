"""``k3::moe_route``: schema, checks and fake; ``dispatch.py`` picks what runs."""
from __future__ import annotations

from typing import Optional

import torch
from torch.fx.experimental.symbolic_shapes import guard_or_true

from . import dispatch


def check_moe_route_args(logits: torch.Tensor, bias: torch.Tensor, top_k: int) -> tuple:
    """Raise ``ValueError`` on what the op cannot take; return (M, E)."""
    if logits.dim() != 2 or logits.dtype != torch.float32:
        raise ValueError(f"moe_route: logits must be [M, E] fp32, got {tuple(logits.shape)} {logits.dtype}")
    m, e = logits.shape
    check_bias_and_top_k("moe_route", bias, e, top_k)
    if bias.device != logits.device:
        raise ValueError(f"moe_route: bias on {bias.device}, logits on {logits.device}")
    return m, e


def check_bias_and_top_k(op: str, bias: torch.Tensor, e, top_k: int) -> None:
    """Raise ``ValueError`` (naming ``op``) unless bias is [E] fp32 and 1 <= top_k <= E."""
    if bias.dim() != 1 or not guard_or_true(bias.shape[0] == e) or bias.dtype != torch.float32:
        raise ValueError(f"{op}: bias must be [E={e}] fp32, got {tuple(bias.shape)} {bias.dtype}")
    if not 1 <= top_k <= e:
        raise ValueError(f"{op}: top_k must be in [1, E={e}], got {top_k}")


@torch.library.custom_op("k3::moe_route", mutates_args=())
def moe_route_op(logits: torch.Tensor, bias: torch.Tensor, top_k: int, renorm_eps: Optional[float],
                 scaling: float, backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    check_moe_route_args(logits, bias, top_k)
    args = (logits, bias, top_k, renorm_eps, scaling)
    return dispatch.select(backend, *args)(*args)


@moe_route_op.register_fake
def _(logits, bias, top_k, renorm_eps, scaling, backend):
    m, _ = check_moe_route_args(logits, bias, top_k)
    return logits.new_empty(m, top_k), logits.new_empty(m, top_k, dtype=torch.int64)
