"""Skinny GEMM: ``out[M, N] = a[M, K] @ w[N, K]^T (+ bias[N]) (+ residual[M, N])`` for decode-sized M."""
from __future__ import annotations

from typing import Optional

import torch

from .dispatch import SKINNY_GEMM
from .op import skinny_gemm_op

__all__ = ["skinny_gemm", "SKINNY_GEMM"]


def skinny_gemm(
    a: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor] = None,
    residual: Optional[torch.Tensor] = None, *, backend: str = "auto", m_limit: int = 16,
    out_dtype: Optional[torch.dtype] = None,
) -> torch.Tensor:
    """``a @ w.T + bias + residual`` through ``k3::skinny_gemm``; returns a new ``[M, N]`` tensor.

    a: [M, K]; w: [N, K] (an ``nn.Linear`` weight); bias: [N] or None; residual: [M, N] or None.
    All one dtype (fp16 / bf16 / fp32 for the kernels; other dtypes run the reference), one device;
    nothing is mutated. ``out_dtype=torch.float32`` on 16-bit operands returns the fp32 sums unrounded
    (``linear(a.float(), w.float(), bias.float())`` without casting ``w``; residual then fp32). Rows above
    ``m_limit`` run ``torch.addmm``. ``backend`` is "auto" | "cute" | "triton" | "reference" (see
    ``k3compile.backends``). Example::

        y = skinny_gemm(x, proj.weight, proj.bias, residual=h)   # x: [4, 7168], weight: [2048, 7168]
        logits = skinny_gemm(x, gate.weight, out_dtype=torch.float32)   # bf16 [4, 7168] x [896, 7168] -> fp32
    """
    return skinny_gemm_op(a, w, bias, residual, backend, m_limit, out_dtype=out_dtype)
