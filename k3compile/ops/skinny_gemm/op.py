"""``k3::skinny_gemm``: schema, fake implementation and input checks; ``dispatch.py`` picks what runs.

The pattern pass bakes ``backend`` and ``m_limit`` into the graph. ``static_weight`` (set by
``k3compile.static_weights`` where the graph proves that no kernel which may still run writes ``w``) lets the CuTe
and Triton kernels stream ``w`` before their PDL wait, and the CuTe configurations with ``trigger_first`` let the
next kernel launch before their own wait, unless ``trigger_first=False`` (set by the proof under Inductor's PDL
codegen, whose kernels read before their wait what a kernel two back wrote). A caller passing ``static_weight`` by
hand vouches for what that proof shows: no kernel still running writes ``w``, counting back through every static
call before this one to the last kernel that was not one, and this call's ``a`` is made by a kernel launched after
that kernel (static_weights.py, step 1). Both are launch details: the choice of implementation is the same either
way; the reference and cuBLAS ignore them.

``out_dtype``: None (the output in ``a.dtype``) or ``torch.float32`` with 16-bit ``a`` and ``w``: the fp32 sums of
the exact products, never rounded to 16 bits -- ``linear(a.float(), w.float())`` without the cast of ``w`` (the
pass ``patterns/upcast_matmul.py`` rewrites to it). Bias is then of ``a``'s dtype, residual fp32.
"""
from __future__ import annotations

from typing import Optional

import torch

from . import dispatch


def _check(a, w, bias, residual, out_dtype=None) -> None:
    if a.dim() != 2 or w.dim() != 2:
        raise ValueError(f"k3::skinny_gemm: a and w must be 2-D, got {tuple(a.shape)} and {tuple(w.shape)}")
    m, k = a.shape
    n = w.shape[0]
    if w.shape[1] != k:
        raise ValueError(f"k3::skinny_gemm: a{tuple(a.shape)} and w{tuple(w.shape)} disagree on K")
    if bias is not None and tuple(bias.shape) != (n,):
        raise ValueError(f"k3::skinny_gemm: bias{tuple(bias.shape)} must be [{n}]")
    if residual is not None and tuple(residual.shape) != (m, n):
        raise ValueError(f"k3::skinny_gemm: residual{tuple(residual.shape)} must be [{m}, {n}]")
    for name, t in (("w", w), ("bias", bias)):
        if t is not None and t.dtype != a.dtype:
            raise ValueError(f"k3::skinny_gemm: {name} dtype {t.dtype} != a dtype {a.dtype}")
    if out_dtype is not None and out_dtype != a.dtype and not (
            out_dtype == torch.float32 and a.dtype in (torch.bfloat16, torch.float16)):
        raise ValueError(f"k3::skinny_gemm: out_dtype {out_dtype} for {a.dtype} operands: only a 16-bit product "
                         "may ask for a float32 output")
    out = out_dtype or a.dtype
    if residual is not None and residual.dtype != out:
        raise ValueError(f"k3::skinny_gemm: residual dtype {residual.dtype} != output dtype {out}")


@torch.library.custom_op("k3::skinny_gemm", mutates_args=())
def skinny_gemm_op(
    a: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor] = None,
    residual: Optional[torch.Tensor] = None, backend: str = "auto", m_limit: int = 16,
    static_weight: bool = False, out_dtype: Optional[torch.dtype] = None, trigger_first: bool = True,
) -> torch.Tensor:
    _check(a, w, bias, residual, out_dtype)
    out_dtype = None if out_dtype == a.dtype else out_dtype
    fn = dispatch.select(backend, m_limit, a, w, bias, residual, out_dtype)
    # the proof leans on a's producer having run in this graph: an empty a may have launched nothing
    if static_weight and a.shape[0] > 0:
        return fn(a, w, bias, residual, out_dtype, static_weight=True, trigger_first=trigger_first)
    return fn(a, w, bias, residual, out_dtype)


@skinny_gemm_op.register_fake
def _(a, w, bias=None, residual=None, backend="auto", m_limit=16, static_weight=False, out_dtype=None,
      trigger_first=True):
    _check(a, w, bias, residual, out_dtype)
    return a.new_empty((a.shape[0], w.shape[0]), dtype=out_dtype or a.dtype)
