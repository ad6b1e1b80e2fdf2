"""``k3::latent_moe_tail``: schema, fake and input checks; ``dispatch.py`` picks what runs.

    out = RMSNorm_eps(latent) · norm_weight @ up_weightᵀ + shared

``static_weight`` (set by ``k3compile.static_weights`` where the graph proves that no kernel which may still run
writes ``up_weight``) lets the kernels stream ``up_weight`` before their PDL wait. A launch detail: the choice of
implementation is the same either way; the reference ignores it.
"""
from __future__ import annotations

import torch

from . import dispatch
from .triton_config import MAX_BLOCK_M


def check_inputs(latent: torch.Tensor, shared: torch.Tensor, norm_weight: torch.Tensor,
                 up_weight: torch.Tensor, small_m_limit: int) -> None:
    """Shapes, dtypes and devices that no implementation could compute: a clear ValueError.

    ``torch._check_value`` keeps the checks valid on symbolic sizes in the fake implementation.
    """
    torch._check_value(latent.dim() == 2, lambda: f"latent must be [M, L], got shape {tuple(latent.shape)}")
    torch._check_value(shared.dim() == 2, lambda: f"shared must be [M, D], got shape {tuple(shared.shape)}")
    torch._check_value(norm_weight.dim() == 1,
                       lambda: f"norm_weight must be [L], got shape {tuple(norm_weight.shape)}")
    torch._check_value(up_weight.dim() == 2, lambda: f"up_weight must be [D, L], got shape {tuple(up_weight.shape)}")
    m, l = latent.shape
    d = up_weight.shape[0]
    torch._check_value(norm_weight.shape[0] == l,
                       lambda: f"norm_weight has {norm_weight.shape[0]} elements, latent width L={l}")
    torch._check_value(up_weight.shape[1] == l,
                       lambda: f"up_weight is {tuple(up_weight.shape)}, expected [D, L={l}]")
    torch._check_value(shared.shape[0] == m and shared.shape[1] == d,
                       lambda: f"shared is {tuple(shared.shape)}, expected [M={m}, D={d}]")
    dtypes = {latent.dtype, shared.dtype, norm_weight.dtype, up_weight.dtype}
    torch._check_value(len(dtypes) == 1 and latent.dtype.is_floating_point,
                       lambda: f"latent, shared, norm_weight, up_weight need one floating dtype, got "
                               f"{[str(t.dtype) for t in (latent, shared, norm_weight, up_weight)]}")
    devices = {latent.device, shared.device, norm_weight.device, up_weight.device}
    torch._check_value(len(devices) == 1, lambda: f"inputs on several devices: {sorted(map(str, devices))}")
    torch._check_value(small_m_limit >= 1, lambda: f"small_m_limit must be >= 1, got {small_m_limit}")


@torch.library.custom_op("k3::latent_moe_tail", mutates_args=())
def latent_moe_tail_op(latent: torch.Tensor, shared: torch.Tensor, norm_weight: torch.Tensor,
                       up_weight: torch.Tensor, eps: float, backend: str = "auto",
                       small_m_limit: int = MAX_BLOCK_M, static_weight: bool = False) -> torch.Tensor:
    check_inputs(latent, shared, norm_weight, up_weight, small_m_limit)
    fn = dispatch.select(backend, small_m_limit, latent, shared, norm_weight, up_weight, eps)
    limit = min(small_m_limit, MAX_BLOCK_M)
    # the proof leans on latent's producer having run in this graph: an empty latent may have launched nothing
    if static_weight and latent.shape[0] > 0:
        return fn(latent, shared, norm_weight, up_weight, eps, limit, static_weight=True)
    return fn(latent, shared, norm_weight, up_weight, eps, limit)


@latent_moe_tail_op.register_fake
def _(latent, shared, norm_weight, up_weight, eps, backend="auto", small_m_limit=MAX_BLOCK_M, static_weight=False):
    check_inputs(latent, shared, norm_weight, up_weight, small_m_limit)
    return latent.new_empty((latent.shape[0], up_weight.shape[0]))
