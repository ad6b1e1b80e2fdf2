"""``k3::latent_moe_tail``: schema, fake, input checks and dispatch to an implementation.

    out = RMSNorm_eps(latent) · norm_weight @ up_weightᵀ + shared

Up to ``small_m_limit`` rows (≤ 16), ``auto`` tries, recording each step down with its reason:

- ``cute`` (``cute.py``, imported on first use: CPU CI has no cutlass): a CuTe skinny GEMM with the norm
  fused. Under ``auto`` only where :func:`cute_profitable` says it was measured faster than the Triton
  tail; ``backend="cute"`` runs it wherever it can.
- ``triton``: the one-kernel Triton tail (``triton.py``, ``streamk.py``: norm and shared add fused)
  where :func:`.triton.fused_profitable` allows, else a Triton RMSNorm then the up-projection with
  ``shared`` added (``split.py``: ``k3::skinny_gemm``, the Triton skinny kernel started under the norm, or
  cuBLAS ``addmm``, as ``split.SPLIT_TUNED`` measured). Which of the two ran is recorded as
  ``triton-fused`` / ``triton-split`` beside the ``triton`` choice (a ``k3::skinny_gemm`` call records
  its own choice under ``skinny_gemm``).
- ``reference``: norm + ``addmm``; also above the limit and for dtypes the kernels lack.

Every choice is recorded in ``LATENT_MOE_TAIL`` (``k3compile.report`` prints it).

``static_weight`` (set by ``k3compile.static_weights`` where the graph proves that no kernel which may
still run writes ``up_weight``) lets the kernels stream ``up_weight`` before their PDL wait. A launch
detail: the choice and its key are the same either way; the reference ignores it.
"""
from __future__ import annotations

import importlib

import torch

from k3compile.backends import Impl, KernelModule, OpImpls, Reason, cute_can_run_on, register_op_impls

from .config import MAX_BLOCK_M, m_bucket
from .reference import latent_moe_tail_unfused

# Both import triton: loaded at the first call that may run them.
_TRITON, _SPLIT = KernelModule(f"{__package__}.triton"), KernelModule(f"{__package__}.split")
fused_profitable, latent_moe_tail_triton = _TRITON.fused_profitable, _TRITON.latent_moe_tail_triton
triton_available, triton_supports = _TRITON.predicate("triton_available"), _TRITON.predicate("triton_supports")
latent_moe_tail_split, split_config = _SPLIT.latent_moe_tail_split, _SPLIT.split_config

_CUTE_MODULE = "k3compile.ops.latent_moe_tail.cute"

# (M bucket, D, L) where the CuTe tail measured faster on one H200 than the op's Triton path there (same run, CUDA
# graphs, rotated weights, interleaved passes). Sixth and seventh sessions, the mma.sync form: M 1-4 (e.g. TAIL5's
# runs, medians of 3 captures: M=1 15.59 vs 16.72 µs, M=2 15.05 vs 16.34, M=4 15.62 vs 16.80), not M 8 (16.43 vs
# 15.31) nor M 16 (23.4 vs 19.8-20.0). Eighth session, the wgmma form with norm warps (latent_moe_tail/cute.py's
# tables): every M, see the comment above its tables.
CUTE_FASTER: frozenset[tuple[int, int, int]] = frozenset((m, 7168, 3584) for m in (1, 2, 4, 8, 16))


def _cute():
    """The CuTe tail module, imported on first use; a reason string when it does not import."""
    try:
        return importlib.import_module(_CUTE_MODULE)
    except Exception as e:
        return f"{_CUTE_MODULE} does not import ({type(e).__name__}: {e})"


def cute_profitable(latent: torch.Tensor, up_weight: torch.Tensor) -> Reason:
    """None where the CuTe tail was measured faster than the Triton tail (:data:`CUTE_FASTER`)."""
    m, l = latent.shape
    if (m_bucket(m), up_weight.shape[0], l) in CUTE_FASTER:
        return None
    return (f"not measured faster than the Triton tail at M<={m_bucket(m)} D={up_weight.shape[0]} L={l} "
            "(op.CUTE_FASTER)")


# The predicates get (latent, shared, norm_weight, up_weight, eps, small_m_limit).

def _cute_available(latent, shared, norm_weight, up_weight, eps, small_m_limit) -> Reason:
    reason = cute_can_run_on(latent, shared, norm_weight, up_weight)
    if reason is not None:
        return reason
    mod = _cute()
    return mod if isinstance(mod, str) else mod.available(latent, shared, norm_weight, up_weight, eps)


def _cute_supports(latent, shared, norm_weight, up_weight, eps, small_m_limit) -> Reason:
    reason = triton_supports(latent, shared, norm_weight, up_weight, eps, small_m_limit)  # M, dtype, empty
    if reason is None:
        reason = _cute().supports(latent, shared, norm_weight, up_weight, eps)
    return reason


def _cute_profitable(latent, shared, norm_weight, up_weight, eps, small_m_limit) -> Reason:
    return cute_profitable(latent, up_weight)


def _triton_available(latent, shared, norm_weight, up_weight, eps, small_m_limit) -> Reason:
    return triton_available(latent, shared, norm_weight, up_weight)


def _triton_supports(latent, shared, norm_weight, up_weight, eps, small_m_limit) -> Reason:
    return triton_supports(latent, shared, norm_weight, up_weight, eps, small_m_limit)


def _tail_cute(latent, shared, norm_weight, up_weight, eps, backend, small_m_limit, key, static_weight=False):
    return _cute().latent_moe_tail_cute(latent, shared, norm_weight, up_weight, eps, static_weight=static_weight)


def _tail_triton(latent, shared, norm_weight, up_weight, eps, backend, small_m_limit, key, static_weight=False):
    # one kernel or two: measured with and without static weight (triton.TUNED_STATIC); recorded per label
    why_not = fused_profitable(latent, up_weight, static_weight=static_weight)
    if why_not is None:
        fn = LATENT_MOE_TAIL.select_fixed(backend, key, "triton-fused", "one kernel: norm, up-projection, shared add",
                                          _fused)
    else:
        how = split_config(latent.shape[0], up_weight.shape[0], latent.shape[1], latent.dtype,
                           latent.device.type == "cuda").tag()
        fn = LATENT_MOE_TAIL.select_fixed(backend, key, "triton-split", f"norm + GEMM ({how}): {why_not}", _split)
    return fn(latent, shared, norm_weight, up_weight, eps, backend, small_m_limit, static_weight)


def _fused(latent, shared, norm_weight, up_weight, eps, backend, small_m_limit, static_weight):
    return latent_moe_tail_triton(latent, shared, norm_weight, up_weight, eps, static_weight=static_weight)


def _split(latent, shared, norm_weight, up_weight, eps, backend, small_m_limit, static_weight):
    return latent_moe_tail_split(latent, shared, norm_weight, up_weight, eps, backend, small_m_limit,
                                 static_weight=static_weight)


def _tail_reference(latent, shared, norm_weight, up_weight, eps, backend, small_m_limit, key, static_weight=False):
    return latent_moe_tail_unfused(latent, shared, norm_weight, up_weight, eps)   # no PDL: nothing to stream early


LATENT_MOE_TAIL = register_op_impls(OpImpls(
    "latent_moe_tail",
    reference=Impl(_tail_reference),
    triton=Impl(_tail_triton, available=_triton_available, supports=_triton_supports),
    cute=Impl(_tail_cute, available=_cute_available, supports=_cute_supports, profitable=_cute_profitable),
))


def check_inputs(latent: torch.Tensor, shared: torch.Tensor, norm_weight: torch.Tensor,
                 up_weight: torch.Tensor, small_m_limit: int) -> None:
    """Shapes, dtypes and devices that no implementation could compute: a clear ValueError.

    ``torch._check_value`` keeps the checks valid on symbolic sizes in the fake implementation.
    """
    torch._check_value(latent.dim() == 2, lambda: f"latent must be [M, L], got shape {tuple(latent.shape)}")
    torch._check_value(shared.dim() == 2, lambda: f"shared must be [M, D], got shape {tuple(shared.shape)}")
    torch._check_value(norm_weight.dim() == 1,
                       lambda: f"norm_weight must be [L], got shape {tuple(norm_weight.shape)}")
    torch._check_value(up_weight.dim() == 2, lambda: f"up_weight must be [D, L], got shape {tuple(up_weight.shape)}")
    m, l = latent.shape
    d = up_weight.shape[0]
    torch._check_value(norm_weight.shape[0] == l,
                       lambda: f"norm_weight has {norm_weight.shape[0]} elements, latent width L={l}")
    torch._check_value(up_weight.shape[1] == l,
                       lambda: f"up_weight is {tuple(up_weight.shape)}, expected [D, L={l}]")
    torch._check_value(shared.shape[0] == m and shared.shape[1] == d,
                       lambda: f"shared is {tuple(shared.shape)}, expected [M={m}, D={d}]")
    dtypes = {latent.dtype, shared.dtype, norm_weight.dtype, up_weight.dtype}
    torch._check_value(len(dtypes) == 1 and latent.dtype.is_floating_point,
                       lambda: f"latent, shared, norm_weight, up_weight need one floating dtype, got "
                               f"{[str(t.dtype) for t in (latent, shared, norm_weight, up_weight)]}")
    devices = {latent.device, shared.device, norm_weight.device, up_weight.device}
    torch._check_value(len(devices) == 1, lambda: f"inputs on several devices: {sorted(map(str, devices))}")
    torch._check_value(small_m_limit >= 1, lambda: f"small_m_limit must be >= 1, got {small_m_limit}")


def _layout(t: torch.Tensor) -> str:
    # what the CuTe predicates read: row-major rows, 16-byte aligned base and row stride
    if t.stride(-1) == 1 and t.data_ptr() % 16 == 0 and (t.dim() == 1 or t.stride(0) % 8 == 0):
        return ""
    return f"{tuple(t.stride())}{'' if t.data_ptr() % 16 == 0 else '+unaligned'}"


def _key(latent, shared, norm_weight, up_weight, limit) -> str:
    """Everything the predicates read, as the report prints it: "cuda:0 bfloat16 M=4 L=3584 D=7168"."""
    m, l = latent.shape
    if m > limit:
        return f"{latent.device} {str(latent.dtype).removeprefix('torch.')} M>{limit}"
    key = f"{latent.device} {str(latent.dtype).removeprefix('torch.')} M={m} L={l} D={up_weight.shape[0]}"
    layouts = [_layout(t) for t in (latent, shared, norm_weight, up_weight)]
    return key + (f" strides {layouts}" if any(layouts) else "")


@torch.library.custom_op("k3::latent_moe_tail", mutates_args=())
def latent_moe_tail_op(latent: torch.Tensor, shared: torch.Tensor, norm_weight: torch.Tensor,
                       up_weight: torch.Tensor, eps: float, backend: str = "auto",
                       small_m_limit: int = MAX_BLOCK_M, static_weight: bool = False) -> torch.Tensor:
    check_inputs(latent, shared, norm_weight, up_weight, small_m_limit)
    limit = min(small_m_limit, MAX_BLOCK_M)
    key = _key(latent, shared, norm_weight, up_weight, limit)   # without static_weight: it never changes the choice
    fn = LATENT_MOE_TAIL.select(backend, key, latent, shared, norm_weight, up_weight, eps, small_m_limit)
    # the proof leans on latent's producer having run in this graph: an empty latent may have launched nothing
    if static_weight and latent.shape[0] > 0:
        return fn(latent, shared, norm_weight, up_weight, eps, backend, limit, key, static_weight=True)
    return fn(latent, shared, norm_weight, up_weight, eps, backend, limit, key)


@latent_moe_tail_op.register_fake
def _(latent, shared, norm_weight, up_weight, eps, backend="auto", small_m_limit=MAX_BLOCK_M, static_weight=False):
    check_inputs(latent, shared, norm_weight, up_weight, small_m_limit)
    return latent.new_empty((latent.shape[0], up_weight.shape[0]))
