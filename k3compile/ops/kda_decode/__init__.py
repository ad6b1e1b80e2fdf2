"""``k3compile.ops.kda_decode``: the fused, in-place KDA decode step (``k3::kda_decode``)."""
from __future__ import annotations

from typing import Optional

import torch

from .dispatch import KDA_DECODE
from .op import kda_decode_op

__all__ = ["kda_decode", "KDA_DECODE"]


def kda_decode(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    conv_state_q: torch.Tensor, conv_state_k: torch.Tensor, conv_state_v: torch.Tensor,
    conv_weight_q: torch.Tensor, conv_weight_k: torch.Tensor, conv_weight_v: torch.Tensor,
    f: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, lower_bound: Optional[float],
    beta_logits: torch.Tensor, out_gate: torch.Tensor, o_norm_weight: torch.Tensor,
    state: torch.Tensor, eps: float = 1e-5, backend: str = "auto",
) -> torch.Tensor:
    """One KDA decode step (one token per sequence), fused, updating the states in place.

    Legend: B batch, H query/key heads, HV value heads (HV % H == 0; value head hv reads q/k head
    hv // (HV // H)), K key head dim, V value head dim, W short-conv width.

    Args:
        q, k: raw projections ``[B, H*K]``; v: ``[B, HV*V]`` (bf16/fp16/fp32; last dim contiguous).
        conv_state_q, conv_state_k: ``[B, H*K, W-1]``; conv_state_v: ``[B, HV*V, W-1]``. **Mutated**: the
            new input is shifted in (oldest column first).
        conv_weight_q, conv_weight_k: ``[H*K, 1, W]``; conv_weight_v: ``[HV*V, 1, W]`` (depthwise, no bias).
        f: forget-gate pre-activation ``[B, HV*K]``; A_log ``[HV]``; dt_bias ``[HV*K]``.
        lower_bound: K3's gate ``lb·σ(exp(A_log)·(f + dt_bias))`` (e.g. -5.0); ``None`` selects Kimi
            Linear's ``-exp(A_log)·softplus(f + dt_bias)``.
        beta_logits: ``[B, HV]``, β = σ(beta_logits).
        out_gate: ``[B, HV*V]``, the output gate G (sigmoid inside).
        o_norm_weight: ``[V]``, the per-head RMSNorm weight.
        state: ``[B, HV, V, K]`` fp32, V-first. **Mutated**.
        eps: RMSNorm epsilon of the output norm.
        backend: "auto" | "cute" | "triton" | "reference" (see ``k3compile.backends``).

    Returns:
        ``[B, HV*V]`` in v's dtype: GatedRMSNorm_sigmoid(S q, G) per head.

    Limits: the Triton kernel takes K, V <= 128 and W <= 8; anything else runs the reference (recorded).

    Example::

        o = kda_decode(q, k, v, cq, ck, cv, wq, wk, wv, f, A_log, dt_bias, -5.0, b, g, w, S, 1e-5)
    """
    return kda_decode_op(q, k, v, conv_state_q, conv_state_k, conv_state_v, conv_weight_q, conv_weight_k,
                         conv_weight_v, f, A_log, dt_bias, lower_bound, beta_logits, out_gate, o_norm_weight,
                         state, eps, backend)
