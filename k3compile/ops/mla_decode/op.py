"""``k3::mla_decode``: schema, input checks, fake, and the call into ``dispatch.py``.

One functional op for the absorbed MLA attention of a decode step (``model/mla.py`` ``mla_attend``): it reads the
latent cache (written before it by the model's own ``index_copy``) and mutates nothing.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch.fx.experimental.symbolic_shapes import guard_or_true

from .config import decode_dtype_ok
from .dispatch import MLA_DECODE, dispatch_key


def _same(a, b) -> bool:
    # symbolic sizes (fake tensors in a traced graph) are compared without adding a guard
    return bool(guard_or_true(a == b))


def check_mla_decode_args(q_nope, q_pe, c_kv, k_pe, w_kv_b, pos, start) -> tuple[int, ...]:
    """Raise ``ValueError`` on inputs no implementation could compute; return (B, T, H, N, R, Vd, S, Lk)."""
    if q_nope.dim() != 4 or q_pe.dim() != 4 or c_kv.dim() != 3 or k_pe.dim() != 3 or w_kv_b.dim() != 3:
        raise ValueError("mla_decode: q_nope [B, T, H, N], q_pe [B, T, H, R], c_kv [B, S, Lk], k_pe [B, S, R], "
                         f"w_kv_b [H, N + Vd, Lk] expected, got {tuple(q_nope.shape)}, {tuple(q_pe.shape)}, "
                         f"{tuple(c_kv.shape)}, {tuple(k_pe.shape)}, {tuple(w_kv_b.shape)}")
    B, T, H, N = q_nope.shape
    S, Lk = c_kv.shape[1:]
    R = q_pe.shape[-1]
    Vd = w_kv_b.shape[1] - N
    expect = {"q_pe": (q_pe, (B, T, H, R)), "c_kv": (c_kv, (B, S, Lk)), "k_pe": (k_pe, (B, S, R)),
              "w_kv_b": (w_kv_b, (H, N + Vd, Lk))}
    for name, (t, shape) in expect.items():
        if not all(_same(a, b) for a, b in zip(t.shape, shape)):
            raise ValueError(f"mla_decode: {name} must have shape {shape} (from q_nope {tuple(q_nope.shape)}, c_kv "
                             f"{tuple(c_kv.shape)}, q_pe {tuple(q_pe.shape)}), got {tuple(t.shape)}")
    if not guard_or_true(Vd > 0):
        raise ValueError(f"mla_decode: w_kv_b [H, N + Vd, Lk] has {w_kv_b.shape[1]} rows, not more than N={N}")
    for name, t in (("q_nope", q_nope), ("q_pe", q_pe), ("c_kv", c_kv), ("k_pe", k_pe), ("w_kv_b", w_kv_b)):
        if not decode_dtype_ok(t.dtype):
            raise ValueError(f"mla_decode: {name} dtype {t.dtype} is not fp32, bf16 or fp16")
    if pos.dim() != 0 or pos.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"mla_decode: pos must be a 0-dim int64/int32 tensor, got {pos.dtype} {tuple(pos.shape)}")
    if start is not None and (start.dim() != 1 or not _same(start.shape[0], B)
                              or start.dtype not in (torch.int64, torch.int32)):
        raise ValueError(f"mla_decode: start must be [B={B}] int64/int32, got {start.dtype} {tuple(start.shape)}")
    tensors = [q_nope, q_pe, c_kv, k_pe, w_kv_b, pos] + ([start] if start is not None else [])
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise ValueError(f"mla_decode: inputs on several devices: {sorted(map(str, devices))}")
    return B, T, H, N, R, Vd, S, Lk


@torch.library.custom_op("k3::mla_decode", mutates_args=())
def mla_decode_op(q_nope: torch.Tensor, q_pe: torch.Tensor, c_kv: torch.Tensor, k_pe: torch.Tensor,
                  w_kv_b: torch.Tensor, pos: torch.Tensor, scale: float, start: Optional[torch.Tensor] = None,
                  backend: str = "auto") -> torch.Tensor:
    args = (q_nope, q_pe, c_kv, k_pe, w_kv_b, pos, scale, start)
    check_mla_decode_args(q_nope, q_pe, c_kv, k_pe, w_kv_b, pos, start)
    return MLA_DECODE.select(backend, dispatch_key(*args), *args)(*args)


@mla_decode_op.register_fake
def _(q_nope, q_pe, c_kv, k_pe, w_kv_b, pos, scale, start=None, backend="auto"):
    B, T, H, N, R, Vd, S, Lk = check_mla_decode_args(q_nope, q_pe, c_kv, k_pe, w_kv_b, pos, start)
    return q_nope.new_empty(B, T, H, Vd)
