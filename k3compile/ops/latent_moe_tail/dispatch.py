"""Which implementation of ``k3::latent_moe_tail`` runs, and with which configuration: the one place that decides.

Order (``backends.OpImpls``), up to the small-M limit:

- ``cute``: one CuTe kernel, the skinny GEMM with the norm fused (``cute.py``; bf16);
- ``triton``: one Triton kernel, norm, up-projection and shared add (``triton.py``, ``streamk.py``);
- ``aten`` (OpImpls' name for the path a kernel measured slower yields to): the split path, a Triton RMSNorm then
  the up-projection by the skinny GEMM's own pick (``split.py``);
- ``reference``: norm + ``addmm`` in PyTorch, above the limit and wherever neither kernel can run.

Profitability, under ``backend="auto"`` on a GPU: this GPU's table (``tables/<gpu>.json``) lists, per (dtype, M
bucket, D = N, L = K, static weight), the one-kernel forms measured faster than the split path, in the order to
try them: CuTe where it comes first, Triton where it is listed (its grid form only on sm_90+, where it was
measured with TMA). A shape the table does not list, and every shape on a GPU of an architecture with no table
(``tables.table_path``: ROCm's gfx942), takes the split path. On the CPU (the Triton interpreter) the
Triton kernel always runs. A forced backend runs the kernel it names wherever it can.

Configuration: the table's, else a heuristic: CuTe the skinny GEMM's mma.sync pick for this product (its table's
wgmma entries were measured without the norm warps, and their stages leave the resident A no room), Triton
``triton_config.heuristic``.

Nothing here imports Triton or cutlass: the kernel modules load on first use (``KernelModule``), and where one does
not import, the implementation's ``available`` says why (recorded as the fallback's reason; the split path is
yielded to only where it can run).
"""
from __future__ import annotations

import functools
import os
from typing import Optional

import torch

from k3compile import tables
from k3compile.call_sites import stand_in
from k3compile.backends import (Impl, OpImpls, Reason, cute_can_run_on, register_op_impls, sm90_nvidia, sm_count,
                                triton_can_run_on)
from k3compile.kernel_module import KernelModule
from k3compile.kernels.cute import compile as cute_kernels
from k3compile.kernels.cute.configs import KernelConfig, MmaConfig, WgmmaConfig
from k3compile.ops.skinny_gemm import cute_config as gemm_heuristics
from k3compile.ops.skinny_gemm import dispatch as gemm_dispatch

from . import cute, triton_config
from .reference import latent_moe_tail_unfused
from .triton_config import MAX_BLOCK_M, TailConfig

KERNELS = {"cute": {"cute_mma": MmaConfig, "cute_wgmma": WgmmaConfig}, "triton": {"triton_tail": TailConfig}}
KERNEL_OF = {MmaConfig: "cute_mma", WgmmaConfig: "cute_wgmma", TailConfig: "triton_tail"}
_TRITON, _SPLIT = KernelModule(f"{__package__}.triton"), KernelModule(f"{__package__}.split")   # both import Triton


@functools.cache
def table_for(device_name: str, arch: str = tables.FALLBACK_ARCH) -> Optional[tables.Table]:
    """The table of the GPU of this name (``torch.cuda.get_device_name``) and architecture, else the fallback GPU's
    where it is of that architecture, else None."""
    return tables.load_for(os.path.dirname(os.path.abspath(__file__)), device_name, arch, KERNELS)


@functools.cache
def _cuda_table(index: int) -> Optional[tables.Table]:
    return table_for(torch.cuda.get_device_name(index), tables.gpu_arch(index))


def table_of(device: torch.device) -> Optional[tables.Table]:
    return _cuda_table(device.index or 0) if device.type == "cuda" else None


def _dtype(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def cute_config_for(dtype: torch.dtype, m: int, d: int, l: int, static_weight: bool,
                    table: Optional[tables.Table], gemm_table: Optional[tables.Table]) -> KernelConfig:
    """The CuTe tail's configuration: the table's where its block's share of the latent fits, else the skinny GEMM's
    mma.sync pick for [M, L] x [D, L]ᵀ."""
    pick = table.get(_dtype(dtype), m, d, l, static_weight) if table is not None else None
    cfg = pick.configs.get("cute") if pick is not None else None
    if cfg is not None and (isinstance(cfg, MmaConfig) or cfg.norm_fits(m, l)):
        return cfg
    cfg = gemm_dispatch.cute_config_for(dtype, m, d, l, False, gemm_table)
    return cfg if isinstance(cfg, MmaConfig) else gemm_heuristics.mma_heuristic(m, d, l)


def triton_config_for(dtype: torch.dtype, m: int, d: int, l: int, static_weight: bool,
                      table: Optional[tables.Table], sms: int) -> TailConfig:
    """The one-kernel Triton tail's configuration: the table's (on a GPU), else the heuristic's."""
    pick = table.get(_dtype(dtype), m, d, l, static_weight) if table is not None and sms else None
    cfg = pick.configs.get("triton") if pick is not None else None
    return triton_config.for_dtype(cfg, dtype) if cfg is not None else triton_config.heuristic(m, d, l, dtype, sms)


# --------------------------------------------------------------------------------------------------
# the predicates (None: yes; else the reason) get (latent, shared, norm_weight, up_weight, eps, small_m_limit)

def _cute_supports(latent, shared, norm_weight, up_weight, eps, small_m_limit) -> Reason:
    return (triton_config.supports(latent, shared, norm_weight, up_weight, eps, small_m_limit)   # M, dtypes, empty
            or cute.supports(latent, shared, norm_weight, up_weight, eps))


def _triton_supports(latent, shared, norm_weight, up_weight, eps, small_m_limit) -> Reason:
    return triton_config.supports(latent, shared, norm_weight, up_weight, eps, small_m_limit)


def _cute_available(latent, shared, norm_weight, up_weight, eps, small_m_limit) -> Reason:
    return cute_can_run_on(latent, shared, norm_weight, up_weight) or cute_kernels.unavailable()


def _triton_available(latent, shared, norm_weight, up_weight, eps, small_m_limit) -> Reason:
    return triton_can_run_on(latent, shared, norm_weight, up_weight) or _TRITON.reason()


def _split_available(latent, shared, norm_weight, up_weight, eps, small_m_limit) -> Reason:
    return triton_can_run_on(latent, shared, norm_weight, up_weight) or _SPLIT.reason()


def _pick(latent, up_weight) -> Optional[tables.Pick]:
    table = table_of(latent.device)
    m, l = latent.shape
    return table.get(_dtype(latent.dtype), m, up_weight.shape[0], l, False) if table is not None else None


def _cute_profitable(latent, shared, norm_weight, up_weight, eps, small_m_limit) -> Reason:
    pick = _pick(latent, up_weight)
    if pick is not None and pick.order[:1] == ("cute",):
        return None
    m, l = latent.shape
    return (f"not measured faster than the Triton tail at M<={tables.m_bucket(m)} D={up_weight.shape[0]} L={l} "
            f"({table_of(latent.device).label() if pick is not None else 'not in the table'})")


def _triton_profitable(latent, shared, norm_weight, up_weight, eps, small_m_limit) -> Reason:
    if latent.device.type != "cuda":
        return None   # the interpreter: the one kernel
    m, l = latent.shape
    d = up_weight.shape[0]
    key = f"{_dtype(latent.dtype)} M<={tables.m_bucket(m)} D={d} L={l}"
    pick = _pick(latent, up_weight)
    if pick is None:
        return f"the one-kernel tail is not measured for {key} (not in the table)"
    if "triton" not in pick.order:
        return f"the split path measured faster for {key} ({table_of(latent.device).label()})"
    cfg = pick.configs.get("triton")
    if cfg is not None and cfg.tma and not cfg.stream_k and not sm90_nvidia(latent.device):
        # the grid form was measured with its tiles by TMA; pointer loads of the latent stall every iteration
        return f"the measured one-kernel form for {key} needs TMA (an NVIDIA GPU of compute capability 9.0+)"
    return None


def _cute_config(latent, up_weight, static_weight: bool) -> KernelConfig:
    m, l = latent.shape
    return cute_config_for(latent.dtype, m, up_weight.shape[0], l, static_weight, table_of(latent.device),
                           gemm_dispatch.gpu_of(latent.device).table)


def _cute(latent, shared, norm_weight, up_weight, eps, small_m_limit, static_weight=False):
    cfg = _cute_config(latent, up_weight, static_weight)
    return cute.latent_moe_tail_cute(latent, shared, norm_weight, up_weight, eps, cfg, static_weight=static_weight)


def _cute_kernels(latent, shared, norm_weight, up_weight, eps, small_m_limit, static_weight=False) -> list:
    return cute.kernels(latent, up_weight, eps, _cute_config(latent, up_weight, static_weight), static_weight)


def _triton(latent, shared, norm_weight, up_weight, eps, small_m_limit, static_weight=False):
    m, l = latent.shape
    cfg = triton_config_for(latent.dtype, m, up_weight.shape[0], l, static_weight, table_of(latent.device),
                            sm_count(latent.device))
    return _TRITON.latent_moe_tail_triton(latent, shared, norm_weight, up_weight, eps, cfg, static_weight=static_weight)


def _split(latent, shared, norm_weight, up_weight, eps, small_m_limit, static_weight=False):
    return _SPLIT.latent_moe_tail_split(latent, shared, norm_weight, up_weight, eps)


def _split_kernels(latent, shared, norm_weight, up_weight, eps, small_m_limit, static_weight=False) -> list:
    """The up-projection's (``split.latent_moe_tail_split``: the skinny GEMM's pick on the norm's fresh [M, L] output,
    its weight static), as the skinny GEMM's own (a failed build makes that op pass over it); the norm is Triton's."""
    if latent.shape[0] == 0:
        return []
    normed = stand_in(latent.shape, latent.dtype, latent.device)
    return gemm_dispatch.auto_kernels(normed, up_weight, None, shared, static_weight=True)


def _reference(latent, shared, norm_weight, up_weight, eps, small_m_limit, static_weight=False):
    return latent_moe_tail_unfused(latent, shared, norm_weight, up_weight, eps)   # no PDL: nothing to stream early


def kernels(latent, shared, norm_weight, up_weight, eps, backend: str = "auto", small_m_limit: int = MAX_BLOCK_M,
            static_weight: bool = False) -> list:
    """The kernels a call of ``k3::latent_moe_tail`` with these arguments (``op.py``'s) builds at its first call: those
    of the implementation ``select`` picks, at the configuration it runs (``k3compile/precompile.py`` builds them
    ahead)."""
    limit = min(small_m_limit, MAX_BLOCK_M)
    return LATENT_MOE_TAIL.kernels(backend, key(latent, shared, norm_weight, up_weight, limit),
                                   (latent, shared, norm_weight, up_weight, eps, small_m_limit),
                                   static_weight=static_weight and latent.shape[0] > 0)


LATENT_MOE_TAIL = register_op_impls(OpImpls(
    "latent_moe_tail",
    reference=Impl(_reference),
    triton=Impl(_triton, _triton_available, _triton_supports, _triton_profitable),
    cute=Impl(_cute, _cute_available, _cute_supports, _cute_profitable, kernels=_cute_kernels),
    aten=Impl(_split, _split_available, kernels=_split_kernels),
    plan=kernels,
))


def _layout(t: torch.Tensor) -> str:
    # what the CuTe predicates read: row-major rows, 16-byte aligned base and row stride
    if t.stride(-1) == 1 and t.data_ptr() % 16 == 0 and (t.dim() == 1 or t.stride(0) % 8 == 0):
        return ""
    return f"{tuple(t.stride())}{'' if t.data_ptr() % 16 == 0 else '+unaligned'}"


def key(latent, shared, norm_weight, up_weight, limit) -> str:
    """Everything the predicates read, as the report prints it: "cuda:0 bfloat16 M=4 L=3584 D=7168"."""
    m, l = latent.shape
    if m > limit:
        return f"{latent.device} {_dtype(latent.dtype)} M>{limit}"
    k = f"{latent.device} {_dtype(latent.dtype)} M={m} L={l} D={up_weight.shape[0]}"
    layouts = [_layout(t) for t in (latent, shared, norm_weight, up_weight)]
    return k + (f" strides {layouts}" if any(layouts) else "")


def select(backend: str, small_m_limit: int, latent, shared, norm_weight, up_weight, eps):
    """The implementation to run (``fn(latent, shared, norm_weight, up_weight, eps, limit, static_weight=...)``),
    its choice recorded."""
    limit = min(small_m_limit, MAX_BLOCK_M)
    return LATENT_MOE_TAIL.select(backend, key(latent, shared, norm_weight, up_weight, limit),
                                  latent, shared, norm_weight, up_weight, eps, small_m_limit)
