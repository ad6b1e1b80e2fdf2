"""``k3::attn_res`` and ``k3::attn_res_add``: schemas, checks and fakes; ``dispatch.py`` picks what runs."""
from __future__ import annotations

from typing import Optional

import torch
from torch.fx.experimental.symbolic_shapes import guard_or_true

from . import dispatch


def _sized(t: torch.Tensor, d) -> bool:
    return guard_or_true(t.numel() == d)


def check_attn_res_args(sources: list, proj_weight: torch.Tensor, mix_norm_weight: torch.Tensor,
                        norm_weight: Optional[torch.Tensor]) -> torch.dtype:
    """Raise ``ValueError`` on what the op cannot take; return the output's dtype."""
    if not sources:
        raise ValueError("attn_res: no sources")
    first = sources[0]
    if first.dim() < 1 or not first.dtype.is_floating_point:
        raise ValueError(f"attn_res: sources must be floating [..., D], got {tuple(first.shape)} {first.dtype}")
    for s in sources[1:]:
        same = s.dim() == first.dim() and all(guard_or_true(a == b) for a, b in zip(s.shape, first.shape))
        if not same or s.dtype != first.dtype or s.device != first.device:
            raise ValueError(f"attn_res: sources differ: {tuple(s.shape)} {s.dtype} {s.device} against "
                             f"{tuple(first.shape)} {first.dtype} {first.device}")
    d = first.shape[-1]
    weights = {"proj_weight": proj_weight, "mix_norm_weight": mix_norm_weight, "norm_weight": norm_weight}
    for name, w in weights.items():
        if w is None:
            continue
        if not (w.dtype.is_floating_point and _sized(w, d) and (w.dim() == 1 or name == "proj_weight")):
            raise ValueError(f"attn_res: {name} must hold D={d} floating values ([D]; [1, D] for proj_weight), "
                             f"got {tuple(w.shape)} {w.dtype}")
        if w.device != first.device:
            raise ValueError(f"attn_res: {name} on {w.device}, sources on {first.device}")
    return first.dtype if norm_weight is None else torch.promote_types(norm_weight.dtype, first.dtype)


@torch.library.custom_op("k3::attn_res", mutates_args=())
def attn_res_op(sources: list[torch.Tensor], proj_weight: torch.Tensor, mix_norm_weight: torch.Tensor, eps: float,
                norm_weight: Optional[torch.Tensor], norm_eps: float, backend: str) -> torch.Tensor:
    check_attn_res_args(sources, proj_weight, mix_norm_weight, norm_weight)
    args = (list(sources), proj_weight, mix_norm_weight, eps, norm_weight, norm_eps)
    return dispatch.select(backend, *args)(*args)


@attn_res_op.register_fake
def _(sources, proj_weight, mix_norm_weight, eps, norm_weight, norm_eps, backend):
    dtype = check_attn_res_args(sources, proj_weight, mix_norm_weight, norm_weight)
    return sources[0].new_empty(sources[0].shape, dtype=dtype)


def check_addend(sources: list, addend: torch.Tensor) -> None:
    """The residual addend of ``k3::attn_res_add``: the last source's shape, dtype and device (no broadcast, no
    promotion: the model's add of two activations)."""
    last = sources[-1]
    same = addend.dim() == last.dim() and all(guard_or_true(a == b) for a, b in zip(addend.shape, last.shape))
    if not same or addend.dtype != last.dtype or addend.device != last.device:
        raise ValueError(f"attn_res_add: the addend {tuple(addend.shape)} {addend.dtype} {addend.device} is not "
                         f"shaped as the last source {tuple(last.shape)} {last.dtype} {last.device}")


@torch.library.custom_op("k3::attn_res_add", mutates_args=())
def attn_res_add_op(sources: list[torch.Tensor], addend: torch.Tensor, proj_weight: torch.Tensor,
                    mix_norm_weight: torch.Tensor, eps: float, norm_weight: Optional[torch.Tensor], norm_eps: float,
                    backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    check_attn_res_args(sources, proj_weight, mix_norm_weight, norm_weight)
    check_addend(sources, addend)
    args = (list(sources), addend, proj_weight, mix_norm_weight, eps, norm_weight, norm_eps)
    return dispatch.select_add(backend, *args)(*args)


@attn_res_add_op.register_fake
def _(sources, addend, proj_weight, mix_norm_weight, eps, norm_weight, norm_eps, backend):
    dtype = check_attn_res_args(sources, proj_weight, mix_norm_weight, norm_weight)
    check_addend(sources, addend)
    last = sources[-1]
    return last.new_empty(last.shape, dtype=dtype), last.new_empty(last.shape)
