"""``k3::kda_prefill``: schema, shape checks and fake; ``dispatch.py`` picks what runs.

One mutating op for the delta-rule recurrence over a whole prompt: ``state`` enters as the state before
the first token and leaves as the state after the last, in place, ready for ``k3::kda_decode``.
"""
from __future__ import annotations

import torch
from torch.fx.experimental.symbolic_shapes import guard_or_true

from . import dispatch

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _same(a, b) -> bool:
    # symbolic sizes (fake tensors in a traced graph) are compared without adding a guard
    return bool(guard_or_true(a == b))


def check_kda_prefill_args(q, k, v, g, beta, state, chunk_size) -> tuple[int, int, int, int, int]:
    """Raise ``ValueError`` on inconsistent shapes or dtypes; return (B, T, H, K, V)."""
    if q.dim() != 4:
        raise ValueError(f"kda_prefill: q must be [B, T, H, K], got shape {tuple(q.shape)}")
    B, T, H, K = q.shape
    if v.dim() != 4 or not all(_same(a, b) for a, b in zip(v.shape[:3], (B, T, H))):
        raise ValueError(f"kda_prefill: v must be [B={B}, T={T}, H={H}, V], got {tuple(v.shape)}")
    V = v.shape[3]
    expect = {"k": (k, (B, T, H, K)), "g": (g, (B, T, H, K)), "beta": (beta, (B, T, H)),
              "state": (state, (B, H, V, K))}
    for name, (t, shape) in expect.items():
        if t.dim() != len(shape) or not all(_same(a, b) for a, b in zip(t.shape, shape)):
            raise ValueError(f"kda_prefill: {name} must have shape {shape}, got {tuple(t.shape)}")
    for name, t in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        if t.dtype not in _FLOAT_DTYPES:
            raise ValueError(f"kda_prefill: {name} dtype {t.dtype} is not a float type")
    if state.dtype != torch.float32:
        raise ValueError(f"kda_prefill: the recurrent state must be fp32, got {state.dtype}")
    if chunk_size < 1:
        raise ValueError(f"kda_prefill: chunk_size must be >= 1, got {chunk_size}")
    return B, T, H, K, V


@torch.library.custom_op("k3::kda_prefill", mutates_args=("state",))
def kda_prefill_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                   state: torch.Tensor, chunk_size: int, backend: str) -> torch.Tensor:
    args = (q, k, v, g, beta, state, chunk_size)
    check_kda_prefill_args(*args)
    o = dispatch.select(backend, *args)(*args)
    return o.contiguous()   # the reference's o is a strided slice; the fake promises packed rows


@kda_prefill_op.register_fake
def _(q, k, v, g, beta, state, chunk_size, backend):
    B, T, H, K, V = check_kda_prefill_args(q, k, v, g, beta, state, chunk_size)
    return q.new_empty(B, T, H, V, dtype=torch.float32)
