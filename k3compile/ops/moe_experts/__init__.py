"""The routed experts of a (latent) MoE layer, fused: ``k3::moe_experts`` (spec §6.2 step 3)."""
from __future__ import annotations

from typing import Optional

import torch

from .dispatch import MOE_EXPERTS
from .op import moe_experts_op  # noqa: F401  (registers k3::moe_experts)

__all__ = ["moe_experts", "MOE_EXPERTS"]


def moe_experts(z: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor,
                w2: torch.Tensor, w1_scale: Optional[torch.Tensor] = None, w3_scale: Optional[torch.Tensor] = None,
                w2_scale: Optional[torch.Tensor] = None, beta: Optional[float] = None,
                linear_beta: Optional[float] = None, *, backend: str = "auto", small_m_limit: int = 16) -> torch.Tensor:
    """Every token through its top-k experts (SiTU-GLU), combined with the router weights in fp32.

    Legend: M tokens, A experts per token, E experts, L latent width, I expert intermediate width (this rank's).

    Args:
        z: [M, L] latent input, bf16 / fp16 / fp32 (another float dtype runs the reference, recorded).
        experts: [M, A] integer expert ids in [0, E). An id outside that range is a ValueError on the reference
            path; the kernels never read out of bounds for it and return NaN for the tokens that hold it.
        weights: [M, A] router weights (fp32 in the model; the combine is fp32).
        w1, w3: [E, I, L] gate and up stacks, w2: [E, L, I] down stack, in z's dtype; or packed MXFP4: uint8 codes
            w1, w3 [E, I, L/2], w2 [E, L, I/2] (element 2j in the low nibble) with E8M0 scales
            w1_scale, w3_scale [E, I, L/32], w2_scale [E, L, I/32] (L and I multiples of 32).
        beta, linear_beta: SiTU-GLU's constants (K3: 4.0, 25.0); None: SiLU / an uncapped up projection.
        backend: "auto" | "cute" | "triton" | "reference" (``k3compile.backends``; ``dispatch.py`` decides).
        small_m_limit: up to this many rows the decode kernels run; above it the sorted (prefill) form.

    Nothing is mutated. Returns [M, L] in z's dtype:
    ``Σ_a weights[m, a] · w2[e] @ situ_glu(w1[e] @ z[m], w3[e] @ z[m])`` with e = experts[m, a], rounded where
    the model rounds (``reference.py``).

    Example::

        y_lat = moe_experts(z, experts, weights, ex.w1, ex.w3, ex.w2, beta=4.0, linear_beta=25.0)   # [M, 3584]
    """
    return torch.ops.k3.moe_experts(z, experts, weights, w1, w3, w2, w1_scale, w3_scale, w2_scale, beta,
                                    linear_beta, backend, small_m_limit)
