"""Which implementation of ``k3::kda_decode`` runs: the Triton kernel (``triton.py``) wherever it can run and takes
the shapes (``triton_config.supports``; it is measured ahead of fla's recurrent kernel at every decode shape), else
the reference. The kernel's layout per shape is ``triton_config.default_config``. Nothing here imports Triton: the
kernel module loads on first use (``KernelModule``; where it does not import, ``available`` says why)."""
from __future__ import annotations

from k3compile.backends import Impl, OpImpls, Reason, register_op_impls, triton_can_run_on
from k3compile.kernel_module import KernelModule

from . import triton_config
from .reference import kda_decode_ref

_TRITON = KernelModule(f"{__package__}.triton")   # imports Triton

def _triton_available(*args) -> Reason:
    return triton_can_run_on(*(a for a in args if hasattr(a, "device"))) or _TRITON.reason()


def _triton(*args):
    return _TRITON.kda_decode_triton(*args)


KDA_DECODE = register_op_impls(OpImpls(
    "kda_decode",
    reference=Impl(kda_decode_ref),
    triton=Impl(_triton, available=_triton_available, supports=triton_config.supports),
))


def key(q, v, state, conv_weight_q, lower_bound, conv_state_q, fits_kernel: bool) -> tuple:
    """(device type, details): a 2-tuple, so the report prints the details as they are. The contiguity the kernel
    needs is part of it (``fits_kernel``): a strided call must not reuse a "triton" choice."""
    B, HV, V, K = state.shape
    details = (q.dtype, v.dtype, conv_state_q.dtype, f"H={q.shape[1] // K}", f"HV={HV}", f"K={K}", f"V={V}",
               f"W={conv_weight_q.shape[-1]}", "lower_bound" if lower_bound is not None else "softplus",
               "fits kernel" if fits_kernel else "outside kernel limits")
    return (q.device.type, details)


def select(backend: str, *args):
    """The implementation to run for the op's arguments (``fn(*args)``), its choice recorded."""
    q, k, v, conv_state_q, conv_state_k, conv_state_v, conv_weight_q = args[:7]
    lower_bound, state = args[12], args[16]
    fits = triton_config.supports(*args) is None
    return KDA_DECODE.select(backend, key(q, v, state, conv_weight_q, lower_bound, conv_state_q, fits), *args)
