"""The fused latent-MoE tail: ``RMSNorm(latent) @ up_weightᵀ + shared`` (the end of ``model/moe.py``'s latent MoE)."""
from __future__ import annotations

import torch

from .dispatch import LATENT_MOE_TAIL
from .op import latent_moe_tail_op  # noqa: F401  (registers k3::latent_moe_tail)

__all__ = ["latent_moe_tail", "LATENT_MOE_TAIL"]


def latent_moe_tail(latent: torch.Tensor, shared: torch.Tensor, norm_weight: torch.Tensor,
                    up_weight: torch.Tensor, eps: float = 1e-5, *, backend: str = "auto",
                    small_m_limit: int = 16) -> torch.Tensor:
    """The tail of a K3 latent-MoE layer. Up to ``small_m_limit`` rows one kernel streams the
    up-projection weight with the norm and the shared add fused (CuTe or Triton), or a Triton RMSNorm
    then the skinny GEMM where that measured faster (``split.py``); ``dispatch.py`` chooses and records
    the choice and its reason.

    Args:
        latent: [M, L] combined routed-expert output in the latent (already all-reduced under TP).
        shared: [M, D] shared-experts output (already all-reduced under TP).
        norm_weight: [L] weight of the latent ``KimiRMSNorm``.
        up_weight: [D, L] latent up-projection (``nn.Linear(L, D, bias=False).weight``).
        eps: RMSNorm epsilon (K3: 1e-5).
        backend: "auto" | "cute" | "triton" | "reference" (see ``k3compile.backends``).
        small_m_limit: the kernels run up to this many rows (at most 16); above it, norm + ``addmm``.

    All four tensors share one floating dtype and one device; nothing is mutated.
    The kernel covers bf16, fp16 and fp32; another dtype runs the reference (recorded).

    Returns:
        [M, D] in the inputs' dtype.

    Example::

        out = latent_moe_tail(y_lat, shared, norm.weight, up_proj.weight, 1e-5)   # [M, 7168]
    """
    return torch.ops.k3.latent_moe_tail(latent, shared, norm_weight, up_weight, eps, backend, small_m_limit)
