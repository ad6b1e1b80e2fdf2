"""Plain-PyTorch KDA decode step: the ground truth of ``k3::kda_decode`` (``model/kda.py``'s step, one token).

Shape legend: B batch, H query/key heads, HV value heads (HV % H == 0; K3 has HV == H), K key head dim,
V value head dim, W short-conv width (4). Projections arrive flattened over heads:
q, k ``[B, H*K]``, v ``[B, HV*V]``.

Every step is written as the spec states it, in fp32, with the same roundings as the model: the
short-conv output is cast back to the activation dtype before it is normalised, and the output is
cast to the dtype of ``v``. States are updated in place.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F


def short_conv_decode_ref(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """One step of the causal depthwise conv + SiLU. x ``[B, C]``, conv_state ``[B, C, W-1]`` (mutated),
    weight ``[C, 1, W]``; returns ``[B, C]`` in x's dtype."""
    window = torch.cat([conv_state.float(), x.float()[..., None]], dim=-1)      # [B, C, W]
    y = F.silu((window * weight[:, 0].float()).sum(-1))
    conv_state.copy_(window[..., 1:])
    return y.to(x.dtype)


def kda_gate_ref(f: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
                 lower_bound: Optional[float], heads: int) -> torch.Tensor:
    """Log-space forget gate ``[B, HV, K]`` (fp32) from f ``[B, HV*K]``."""
    B = f.shape[0]
    x = (f.float() + dt_bias.float()).view(B, heads, -1)
    a = A_log.float().exp()[None, :, None]
    if lower_bound is None:
        return -a * F.softplus(x)                      # Kimi Linear
    return lower_bound * torch.sigmoid(a * x)          # K3 "safe gate"


def l2_normalize_ref(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    x = x.float()
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def kda_decode_ref(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    conv_state_q: torch.Tensor, conv_state_k: torch.Tensor, conv_state_v: torch.Tensor,
    conv_weight_q: torch.Tensor, conv_weight_k: torch.Tensor, conv_weight_v: torch.Tensor,
    f: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, lower_bound: Optional[float],
    beta_logits: torch.Tensor, out_gate: torch.Tensor, o_norm_weight: torch.Tensor,
    state: torch.Tensor, eps: float,
) -> torch.Tensor:
    """The whole decode step; see ``k3compile.ops.kda_decode.kda_decode`` for the argument list."""
    B, HV, V, K = state.shape
    H = q.shape[-1] // K
    out_dtype = v.dtype

    q = short_conv_decode_ref(q, conv_state_q, conv_weight_q)
    k = short_conv_decode_ref(k, conv_state_k, conv_weight_k)
    v = short_conv_decode_ref(v, conv_state_v, conv_weight_v)

    g = kda_gate_ref(f, A_log, dt_bias, lower_bound, HV)                        # [B, HV, K]
    beta = torch.sigmoid(beta_logits.float())                                  # [B, HV]
    q = l2_normalize_ref(q.view(B, H, K)) * K ** -0.5
    k = l2_normalize_ref(k.view(B, H, K))
    # grouped value heads: value head hv reads query/key head hv // (HV // H)
    q = q.repeat_interleave(HV // H, dim=1)                                    # [B, HV, K]
    k = k.repeat_interleave(HV // H, dim=1)
    v = v.float().view(B, HV, V)

    S = state * g.exp()[:, :, None, :]                                         # [B, HV, V, K]
    u = beta[..., None] * (v - (S * k[:, :, None, :]).sum(-1))                 # [B, HV, V]
    S = S + u[..., None] * k[:, :, None, :]
    o = (S * q[:, :, None, :]).sum(-1)                                         # [B, HV, V]
    state.copy_(S)

    o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + eps)
    o = o * o_norm_weight.float() * torch.sigmoid(out_gate.float().view(B, HV, V))
    return o.reshape(B, HV * V).to(out_dtype)
