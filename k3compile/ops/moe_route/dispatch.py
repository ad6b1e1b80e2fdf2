"""Which implementation of ``k3::moe_route`` runs: the Triton kernel (``triton.py``) wherever it can run and takes
the shapes (E up to ``MAX_EXPERTS``, top-k up to ``MAX_TOP_K``: one program holds a row), else the reference. No
table: one program a row at every M (the row is a few KB). Nothing here imports Triton: the kernel module loads on
first use (``KernelModule``; where it does not import, ``available`` says why)."""
from __future__ import annotations

from k3compile.backends import Impl, OpImpls, Reason, register_op_impls, triton_can_run_on
from k3compile.kernel_module import KernelModule

from .reference import moe_route_ref

_TRITON = KernelModule(f"{__package__}.triton")   # imports Triton

MAX_EXPERTS = 8192   # the row in registers: 32 KB of fp32 keys a program
MAX_TOP_K = 64


def _triton_available(logits, bias, *args) -> Reason:
    return triton_can_run_on(logits, bias) or _TRITON.reason()


def _triton_supports(logits, bias, top_k, renorm_eps, scaling) -> Reason:
    if logits.shape[1] > MAX_EXPERTS or top_k > MAX_TOP_K:
        return f"E={logits.shape[1]} > {MAX_EXPERTS} or top_k={top_k} > {MAX_TOP_K} (one program a row)"
    return None


def _triton(*args):
    return _TRITON.moe_route_triton(*args)


MOE_ROUTE = register_op_impls(OpImpls(
    "moe_route",
    reference=Impl(moe_route_ref),
    triton=Impl(_triton, available=_triton_available, supports=_triton_supports),
))


def key(logits, top_k, renorm_eps) -> tuple:
    """(device type, details): what decides the choice and the kernel's specialisation."""
    details = (f"E={logits.shape[1]}", f"top_k={top_k}", "renormalised" if renorm_eps is not None else "raw")
    return (logits.device.type, details)


def select(backend: str, *args):
    """The implementation to run for the op's arguments (``fn(*args)``), its choice recorded."""
    logits, _, top_k, renorm_eps, _ = args
    return MOE_ROUTE.select(backend, key(logits, top_k, renorm_eps), *args)
