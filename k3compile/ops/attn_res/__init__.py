"""``k3compile.ops.attn_res``: a Block AttnRes mix, and the RMSNorm the layer puts after it, fused
(``k3::attn_res``); with the residual add that makes its last source, too (``k3::attn_res_add``)."""
from __future__ import annotations

from typing import Optional

import torch

from .dispatch import ATTN_RES, ATTN_RES_ADD
from .op import attn_res_add_op, attn_res_op

__all__ = ["attn_res", "attn_res_add", "ATTN_RES", "ATTN_RES_ADD"]


def attn_res(sources: list[torch.Tensor], proj_weight: torch.Tensor, mix_norm_weight: torch.Tensor, eps: float,
             norm_weight: Optional[torch.Tensor] = None, norm_eps: float = 1e-6,
             backend: str = "auto") -> torch.Tensor:
    """The softmax-over-depth mix of ``sources`` (``model/attn_res.py``), and ``norm_weight * rms_norm(mix)`` where
    ``norm_weight`` is given, in one kernel (in place of two Inductor reductions and their launches).

    Args:
        sources: S tensors [..., D] of one dtype: the completed block sums, then the current partial sum.
        proj_weight: the mix's pseudo-query projection, D values ([1, D]).
        mix_norm_weight: the mix's RMSNorm weight [D] (the query is ``mix_norm_weight * proj_weight``).
        eps: the mix's RMSNorm epsilon.
        norm_weight: the weight [D] of the RMSNorm applied to the mix, or None for the mix alone.
        norm_eps: that RMSNorm's epsilon.
        backend: "auto" | "triton" | "reference" (see ``k3compile.backends``).

    Returns:
        [..., D]: the mix in the sources' dtype, or the normalised mix in the dtype ``norm_weight * mix`` has.

    Example::

        h = attn_res([*blocks, prefix], layer.mlp_res_proj.weight, layer.mlp_res_norm.weight, 1e-6,
                     layer.post_attention_layernorm.weight, 1e-6)
    """
    return attn_res_op(sources, proj_weight, mix_norm_weight, eps, norm_weight, norm_eps, backend)


def attn_res_add(sources: list[torch.Tensor], addend: torch.Tensor, proj_weight: torch.Tensor,
                 mix_norm_weight: torch.Tensor, eps: float, norm_weight: Optional[torch.Tensor] = None,
                 norm_eps: float = 1e-6, backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`attn_res` whose last source is the layer's residual add ``sources[-1] + addend`` (the partial sum
    ``prefix + a``, ``model/modeling.py``), made in the same kernel and returned beside the mix.

    Args:
        sources, proj_weight, mix_norm_weight, eps, norm_weight, norm_eps, backend: as :func:`attn_res`, with
            ``sources[-1]`` the add's first operand.
        addend: the add's second operand, shaped as ``sources[-1]``, in its dtype.

    Returns:
        (the mix or its normalised row, as :func:`attn_res`; ``sources[-1] + addend`` [..., D] in the sources' dtype).

    Example::

        h, prefix = attn_res_add([*blocks, prefix], a, layer.mlp_res_proj.weight, layer.mlp_res_norm.weight, 1e-6,
                                 layer.post_attention_layernorm.weight, 1e-6)
    """
    return attn_res_add_op(sources, addend, proj_weight, mix_norm_weight, eps, norm_weight, norm_eps, backend)
