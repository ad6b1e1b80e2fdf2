"""``k3::skinny_gemm``: schema, fake implementation and backend dispatch.

The pattern pass bakes ``backend`` and ``m_limit`` into the graph. At run time rows up to ``m_limit``
go to the implementation ``SKINNY_GEMM.select`` picks (cute / triton / reference, with recorded
fallbacks); more rows (possible only when M is symbolic) go to ``torch.addmm`` (cuBLAS on a GPU),
which is recorded too.

``static_weight`` (set by ``k3compile.static_weights`` where the graph proves that no kernel which may
still run writes ``w``) lets the CuTe and Triton kernels stream ``w`` before their PDL wait, and the CuTe
configurations with ``trigger_first`` let the next kernel launch before their own wait. A caller passing it by
hand vouches for what that proof shows: no kernel still running writes ``w``, counting back through every
static call before this one to the last kernel that was not one, and this call's ``a`` is made by a kernel
launched after that kernel (static_weights.py, step 1). It is a launch detail: the choice of kernel and its
key are the same either way; the reference and cuBLAS paths ignore it.
"""
from __future__ import annotations

import importlib
from typing import Optional

import torch

from k3compile.backends import Impl, KernelModule, OpImpls, Reason, cute_can_run_on, register_op_impls

from .reference import skinny_gemm_reference

triton_impl = KernelModule(f"{__package__}.triton")   # imports triton: loaded at the first call that may run it

_CUTE_MODULE = "k3compile.ops.skinny_gemm.cute"


def _cute():
    """The CuTe module, imported on first use only (CI has no cutlass); a reason string if absent."""
    try:
        return importlib.import_module(_CUTE_MODULE)
    except Exception as e:
        return f"{_CUTE_MODULE} does not import ({type(e).__name__}: {e})"


def _cute_available(a, w, bias, residual) -> Reason:
    reason = cute_can_run_on(a, w, bias, residual)
    if reason is not None:
        return reason
    mod = _cute()
    return mod if isinstance(mod, str) else mod.available(a, w, bias, residual)


def _cute_supports(a, w, bias, residual) -> Reason:
    return _cute().supports(a, w, bias, residual)


def _cute_profitable(a, w, bias, residual) -> Reason:
    return _cute().profitable(a, w, bias, residual)


def _cute_fn(a, w, bias, residual, static_weight=False):
    return _cute().skinny_gemm_cute(a, w, bias, residual, static_weight=static_weight)


def _triton_fn(a, w, bias, residual, static_weight=False):
    return triton_impl.skinny_gemm_triton(a, w, bias, residual, static_weight=static_weight)


def _reference(a, w, bias, residual, static_weight=False):
    return skinny_gemm_reference(a, w, bias, residual)   # no PDL: nothing to stream early


def _large_m(a, w, bias, residual, static_weight=False):
    """Rows above the skinny limit, or shapes our kernels lose on: the vendor GEMM, rounded exactly as eager ``linear + add``."""
    out = torch.nn.functional.linear(a, w, bias)
    return out if residual is None else out.add_(residual)


SKINNY_GEMM = register_op_impls(OpImpls(
    "skinny_gemm",
    reference=Impl(_reference),
    triton=Impl(_triton_fn, triton_impl.available, triton_impl.supports, triton_impl.profitable),
    cute=Impl(_cute_fn, _cute_available, _cute_supports, _cute_profitable),
    aten=Impl(_large_m),   # cuBLAS where the table says no kernel of ours is faster
))


def _check(a, w, bias, residual) -> None:
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
    for name, t in (("w", w), ("bias", bias), ("residual", residual)):
        if t is not None and t.dtype != a.dtype:
            raise ValueError(f"k3::skinny_gemm: {name} dtype {t.dtype} != a dtype {a.dtype}")


def _layout(t: Optional[torch.Tensor]):
    # what the kernels' predicates read: strides and 16-byte alignment of the base address
    return None if t is None else (tuple(t.stride()), t.data_ptr() % 16 == 0)


def _key(a, w, bias, residual):
    return (a.dtype, a.device.type, tuple(a.shape), w.shape[0],
            _layout(a), _layout(w), _layout(bias), _layout(residual))


@torch.library.custom_op("k3::skinny_gemm", mutates_args=())
def skinny_gemm_op(
    a: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor] = None,
    residual: Optional[torch.Tensor] = None, backend: str = "auto", m_limit: int = 16,
    static_weight: bool = False,
) -> torch.Tensor:
    _check(a, w, bias, residual)
    key = _key(a, w, bias, residual)   # without static_weight: it never changes the choice
    if a.shape[0] > m_limit:
        fn = SKINNY_GEMM.select_fixed(
            backend, key, "aten", f"M={a.shape[0]} > m_limit={m_limit}: torch.addmm (cuBLAS on GPU)", _large_m)
    else:
        fn = SKINNY_GEMM.select(backend, key, a, w, bias, residual)
    # the proof leans on a's producer having run in this graph: an empty a may have launched nothing
    if static_weight and a.shape[0] > 0:
        return fn(a, w, bias, residual, static_weight=True)
    return fn(a, w, bias, residual)


@skinny_gemm_op.register_fake
def _(a, w, bias=None, residual=None, backend="auto", m_limit=16, static_weight=False):
    _check(a, w, bias, residual)
    return a.new_empty((a.shape[0], w.shape[0]))
