"""Which implementation of ``k3::attn_res`` (and of ``k3::attn_res_add``, its last source a residual add) runs: the
Triton kernel (``triton.py``) wherever it can run and takes the shapes (up to ``MAX_SOURCES`` sources, rows up to
``MAX_D`` values: one program holds a row), else the reference. No table: one program a row at every M. Nothing here
imports Triton: the kernel module loads on first use."""
from __future__ import annotations

from k3compile.backends import Impl, OpImpls, Reason, register_op_impls, triton_can_run_on, triton_interpret
from k3compile.kernel_module import KernelModule

from .reference import attn_res_add_ref, attn_res_ref

_TRITON = KernelModule(f"{__package__}.triton")   # imports Triton

MAX_SOURCES = 16   # a pointer argument each; K3 mixes at most ceil(93 / 12) + 1 = 9
MAX_D = 16384      # the row in registers: 32 fp32 a thread per live vector at 16 warps


def _triton_available(sources, proj_weight, mix_norm_weight, eps, norm_weight, norm_eps) -> Reason:
    return triton_can_run_on(*sources, proj_weight, mix_norm_weight, norm_weight) or _TRITON.reason()


def _triton_supports(sources, *args) -> Reason:
    if len(sources) > MAX_SOURCES or sources[0].shape[-1] > MAX_D:
        return (f"{len(sources)} sources of {sources[0].shape[-1]} values: at most {MAX_SOURCES} of {MAX_D} "
                "(one program a row)")
    return None


def _paired() -> bool:
    """A source's two sums in one reduction (the GPU's pick, ``docs/tuning/attn_res.md``), but under Triton's
    interpreter, which runs a reduction's custom combine in Python element by element (the micro K3's prefill took
    32.5 s paired, 13.4 s with the two plain sums)."""
    return not triton_interpret()


def _triton(*args):
    return _TRITON.attn_res_triton(*args, paired=_paired())


def _triton_add_available(sources, addend, *rest) -> Reason:
    return _triton_available(sources, *rest) or triton_can_run_on(addend)


def _triton_add(*args):
    return _TRITON.attn_res_add_triton(*args, paired=_paired())


ATTN_RES = register_op_impls(OpImpls(
    "attn_res",
    reference=Impl(attn_res_ref),
    triton=Impl(_triton, available=_triton_available, supports=_triton_supports),
))
ATTN_RES_ADD = register_op_impls(OpImpls(
    "attn_res_add",
    reference=Impl(attn_res_add_ref),
    triton=Impl(_triton_add, available=_triton_add_available, supports=_triton_supports),
))


def key(sources, norm_weight) -> tuple:
    """(device type, details): what decides the choice and the kernel's specialisation."""
    details = (f"S={len(sources)}", f"D={sources[0].shape[-1]}", str(sources[0].dtype).replace("torch.", ""),
               "normed" if norm_weight is not None else "mix")
    return (sources[0].device.type, details)


def select(backend: str, *args):
    """The implementation to run for the op's arguments (``fn(*args)``), its choice recorded."""
    sources, _, _, _, norm_weight, _ = args
    return ATTN_RES.select(backend, key(sources, norm_weight), *args)


def select_add(backend: str, *args):
    """As :func:`select`, for ``k3::attn_res_add`` (``args`` with the addend after the sources)."""
    sources, _, _, _, _, norm_weight, _ = args
    return ATTN_RES_ADD.select(backend, key(sources, norm_weight), *args)
