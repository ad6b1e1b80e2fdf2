"""``k3::kda_decode``: schema, shape checks and fake; ``dispatch.py`` picks what runs.

One mutating op for the whole KDA decode step, so the state is streamed once and the compiled graph
holds no copy of it: ``conv_state_q/k/v`` and ``state`` are updated in place.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch.fx.experimental.symbolic_shapes import guard_or_true

from . import dispatch

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _same_size(a, b) -> bool:
    # symbolic batch sizes (fake tensors in a traced graph) are compared without adding a guard
    return bool(guard_or_true(a == b))


def check_kda_decode_args(q, k, v, conv_state_q, conv_state_k, conv_state_v, conv_weight_q, conv_weight_k,
                          conv_weight_v, f, A_log, dt_bias, beta_logits, out_gate, o_norm_weight,
                          state) -> tuple[int, int, int, int, int, int]:
    """Raise ``ValueError`` on inconsistent shapes; return (B, H, HV, K, V, W)."""
    if state.dim() != 4:
        raise ValueError(f"state must be [B, HV, V, K], got shape {tuple(state.shape)}")
    B, HV, V, K = state.shape
    if q.dim() != 2 or not _same_size(q.shape[0], B) or q.shape[1] % K:
        raise ValueError(f"q must be [B={B}, H*K] with K={K}, got {tuple(q.shape)}")
    H = q.shape[1] // K
    if H == 0 or HV % H:
        raise ValueError(f"value heads HV={HV} must be a positive multiple of query/key heads H={H}")
    W = conv_weight_q.shape[-1]
    expect = {
        "k": (k, (B, H * K)), "v": (v, (B, HV * V)),
        "conv_state_q": (conv_state_q, (B, H * K, W - 1)), "conv_state_k": (conv_state_k, (B, H * K, W - 1)),
        "conv_state_v": (conv_state_v, (B, HV * V, W - 1)),
        "conv_weight_q": (conv_weight_q, (H * K, 1, W)), "conv_weight_k": (conv_weight_k, (H * K, 1, W)),
        "conv_weight_v": (conv_weight_v, (HV * V, 1, W)),
        "f": (f, (B, HV * K)), "A_log": (A_log, (HV,)), "dt_bias": (dt_bias, (HV * K,)),
        "beta_logits": (beta_logits, (B, HV)), "out_gate": (out_gate, (B, HV * V)),
        "o_norm_weight": (o_norm_weight, (V,)),
    }
    for name, (t, shape) in expect.items():
        if len(t.shape) != len(shape) or not all(_same_size(a, b) for a, b in zip(t.shape, shape)):
            raise ValueError(f"kda_decode: {name} must have shape {shape}, got {tuple(t.shape)}")
    for name, t in (("q", q), ("k", k), ("v", v), ("state", state)):
        if t.dtype not in _FLOAT_DTYPES:
            raise ValueError(f"kda_decode: {name} dtype {t.dtype} is not a float type")
    if state.dtype != torch.float32:
        raise ValueError(f"kda_decode: the recurrent state must be fp32, got {state.dtype}")
    return B, H, HV, K, V, W


@torch.library.custom_op("k3::kda_decode", mutates_args=("conv_state_q", "conv_state_k", "conv_state_v", "state"))
def kda_decode_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    conv_state_q: torch.Tensor, conv_state_k: torch.Tensor, conv_state_v: torch.Tensor,
    conv_weight_q: torch.Tensor, conv_weight_k: torch.Tensor, conv_weight_v: torch.Tensor,
    f: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, lower_bound: Optional[float],
    beta_logits: torch.Tensor, out_gate: torch.Tensor, o_norm_weight: torch.Tensor,
    state: torch.Tensor, eps: float, backend: str,
) -> torch.Tensor:
    args = (q, k, v, conv_state_q, conv_state_k, conv_state_v, conv_weight_q, conv_weight_k, conv_weight_v,
            f, A_log, dt_bias, lower_bound, beta_logits, out_gate, o_norm_weight, state, eps)
    check_kda_decode_args(*args[:12], *args[13:17])
    return dispatch.select(backend, *args)(*args)


@kda_decode_op.register_fake
def _(q, k, v, conv_state_q, conv_state_k, conv_state_v, conv_weight_q, conv_weight_k, conv_weight_v,
      f, A_log, dt_bias, lower_bound, beta_logits, out_gate, o_norm_weight, state, eps, backend):
    B, H, HV, K, V, W = check_kda_decode_args(
        q, k, v, conv_state_q, conv_state_k, conv_state_v, conv_weight_q, conv_weight_k, conv_weight_v,
        f, A_log, dt_bias, beta_logits, out_gate, o_norm_weight, state)
    return v.new_empty(B, HV * V)
