"""The skinny GEMM in plain PyTorch: the ground truth every kernel is tested against."""
from __future__ import annotations

from typing import Optional

import torch


def skinny_gemm_reference(
    a: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor] = None,
    residual: Optional[torch.Tensor] = None, out_dtype: Optional[torch.dtype] = None,
) -> torch.Tensor:
    """``out = a @ w.T + bias + residual``, accumulated in (at least) fp32, returned in ``out_dtype`` (default
    ``a.dtype``).

    a: [M, K], w: [N, K], bias: [N] or None, residual: [M, N] or None. With ``out_dtype=torch.float32`` on 16-bit
    operands this is ``linear(a.float(), w.float(), bias.float()) + residual.float()``: the products of the upcast
    values, never rounded to 16 bits.
    """
    acc = torch.promote_types(a.dtype, torch.float32)
    out = a.to(acc) @ w.to(acc).T
    if bias is not None:
        out = out + bias.to(acc)
    if residual is not None:
        out = out + residual.to(acc)
    return out.to(out_dtype or a.dtype)
