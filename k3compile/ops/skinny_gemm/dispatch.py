"""Which implementation of ``k3::skinny_gemm`` runs, and with which configuration: the one place that decides.

Order (``backends.OpImpls``): the CuTe kernels (``cute.py``), the Triton kernel (``triton.py``), then cuBLAS
(``torch.nn.functional.linear``, OpImpls' ``aten``) where a kernel of ours can run but loses, the reference where
none can run. Rows above ``m_limit`` go to cuBLAS.

Profitability, under ``backend="auto"`` on a GPU: this GPU's table (``tables/<gpu>.json``, else the H200's on a GPU
of its architecture, ``tables.table_path``) lists, per (dtype, M bucket, N, K, static weight), the kernels measured
faster than cuBLAS in the order to try them. CuTe runs where it comes first in that order, Triton where it is
listed. A shape the table does not list takes CuTe (never measured behind cuBLAS there), then Triton where
``triton_beats_cublas``. A GPU of an architecture with no measurements (ROCm's gfx942, NVIDIA's sm_100) runs the
vendor BLAS (cuBLAS / hipBLASLt, through ``linear``) but for the large weights where the Triton kernel led cuBLAS
on the H200 at every M (``unmeasured_order``). The Triton interpreter (CPU tensors) runs the Triton kernel.

Configuration: the table's for the implementation that runs, else its heuristic (``cute_config.heuristic``,
``triton_config.heuristic``). The Triton configurations of a table hold on GPUs of its SM count only (the grids
are sized by it). ``static_weight`` may change the configuration, never the implementation: the choice is cached
before the op knows it.

A fp32 output of 16-bit operands (``out_dtype``, the rewrite of ``linear(x.float(), w.float())``): the 16-bit
shape's kernel and configuration (the main loop and its fp32 sums are the same; only C's stores widen), and a kernel
of ours wherever one runs, table or not: what it replaces is the upcast product (a cast kernel writes the weight in
fp32, then an fp32 GEMM reads it back: three times the weight bytes our kernels stream), not the 16-bit cuBLAS GEMM
the table was measured against. CuTe where the order puts it first, else the Triton kernel. Rows above ``m_limit``
(and a GPU with neither) run that upcast product, the graph's own math.

Nothing here imports Triton or cutlass: the kernel modules load on first use (``KernelModule``), and where one does
not import, the implementation's ``available`` says why (recorded as the fallback's reason).
"""
from __future__ import annotations

import dataclasses

import functools
import os
from typing import Any, Callable, NamedTuple, Optional

import torch

from k3compile import tables
from k3compile.backends import (Impl, OpImpls, Reason, cute_can_run_on, register_op_impls, sm_count,
                                triton_can_run_on)
from k3compile.kernel_module import KernelModule
from k3compile.kernels.cute import compile as cute_kernels
from k3compile.kernels.cute.configs import KernelConfig, MmaConfig, WgmmaConfig

from . import cute, cute_config, triton_config
from .reference import skinny_gemm_reference
from .triton_config import TritonConfig

# the table's implementations, in the order tried, and the configurations each may run
KERNELS = {"cute": {"cute_mma": MmaConfig, "cute_wgmma": WgmmaConfig}, "triton": {"triton_gemm": TritonConfig}}
KERNEL_OF = {MmaConfig: "cute_mma", WgmmaConfig: "cute_wgmma", TritonConfig: "triton_gemm"}
_TRITON = KernelModule(f"{__package__}.triton")   # imports Triton


# Unmeasured architectures: the Triton kernel for 16-bit weights of at least this many elements (32 MiB), where it
# streamed at 98-101% of the copy ceiling on the H200 and led cuBLAS by x1.07-1.27 at every M; below it (2304 x 1536:
# x0.77, 7168 x 1536: x0.91) and in fp32 (never measured against the vendor BLAS) the vendor BLAS runs.
# benchmarks/results/skinny_gemm_triton_defaults_h200.log
UNMEASURED_TRITON_MIN_WEIGHT = 1 << 24


def unmeasured_order(dtype: torch.dtype, n: int, k: int) -> tuple[str, ...]:
    """The kernels to try, ahead of the vendor BLAS, on a GPU whose architecture has no table."""
    big = dtype in (torch.float16, torch.bfloat16) and n * k >= UNMEASURED_TRITON_MIN_WEIGHT
    return ("triton",) if big else ()


def triton_beats_cublas(m: int, n: int, k: int) -> bool:
    """Where a table lists nothing: the Triton kernel measured ahead of cuBLAS on the H200 at N >= 2048 with K >=
    4096 (3-25%), K >= 3072 with M <= 8 (20-25% at 7168 x 3584), or N >= 7168 with K >= 2048 (10% at 7168 x 2048);
    behind or on par elsewhere (7168 x 1536: -10%; 896 x 7168: +2-4%)."""
    return n >= 2048 and (k >= 4096 or (k >= 3072 and m <= 8) or (n >= 7168 and k >= 2048 and m <= 16))


# --------------------------------------------------------------------------------------------------
# the table of the GPU a tensor lives on

class Gpu(NamedTuple):
    table: Optional[tables.Table]   # None: no measurements for this GPU's architecture (or no GPU)
    sms: int                         # 0: no GPU (the Triton interpreter)
    arch: str = ""                   # "sm_90", "gfx942"


@functools.cache
def table_for(device_name: str, arch: str = tables.FALLBACK_ARCH) -> Optional[tables.Table]:
    """The table of the GPU of this name (``torch.cuda.get_device_name``) and architecture, else the fallback GPU's
    where it is of that architecture, else None."""
    return tables.load_for(os.path.dirname(os.path.abspath(__file__)), device_name, arch, KERNELS)


@functools.cache
def _cuda_gpu(index: int) -> Gpu:
    arch = tables.gpu_arch(index)
    return Gpu(table_for(torch.cuda.get_device_name(index), arch), sm_count(torch.device("cuda", index)), arch)


def gpu_of(device: torch.device) -> Gpu:
    return _cuda_gpu(device.index or 0) if device.type == "cuda" else Gpu(None, 0)


def _dtype(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def order(dtype: torch.dtype, m: int, n: int, k: int, table: Optional[tables.Table]) -> tuple[str, ...]:
    """The kernels that beat cuBLAS at this shape, in the order to try them: the table's, else the rule's; with no
    table (an architecture nothing was measured on), ``unmeasured_order``'s."""
    if table is None:
        return unmeasured_order(dtype, n, k)
    pick = table.get(_dtype(dtype), m, n, k, False) if m <= 16 else None
    if pick is not None:
        return pick.order
    return ("cute", "triton") if triton_beats_cublas(m, n, k) else ("cute",)


def cute_config_for(dtype: torch.dtype, m: int, n: int, k: int, static_weight: bool,
                table: Optional[tables.Table]) -> KernelConfig:
    """The CuTe configuration (and with it the kernel: mma.sync or wgmma) for this product."""
    pick = table.get(_dtype(dtype), m, n, k, static_weight) if table is not None else None
    if pick is not None and "cute" in pick.configs:
        return pick.configs["cute"]
    return cute_config.heuristic(m, n, k, static_weight)


def triton_config_for(dtype: torch.dtype, m: int, n: int, k: int, gpu: Gpu) -> TritonConfig:
    """The Triton configuration for this product on this GPU (``static_weight`` changes nothing: loading weight
    tiles before the PDL wait measured slower)."""
    cfg = None
    if gpu.table is not None and gpu.table.sms == gpu.sms and m <= 16:
        pick = gpu.table.get(_dtype(dtype), m, n, k, False)
        cfg = pick.configs.get("triton") if pick is not None else None
    cfg = cfg or triton_config.heuristic(m, n, k, gpu.sms)
    return triton_config.for_dtype(cfg, torch.empty((), dtype=dtype).element_size())


# --------------------------------------------------------------------------------------------------
# the predicates (None: yes; else the reason) and the implementations

def _measured(impl: str, a, w) -> Reason:
    """None where the order lets ``impl`` run (CuTe: first; Triton: listed), else which path measured faster."""
    m, k = a.shape
    n = w.shape[0]
    g = gpu_of(a.device)
    if not g.sms:
        return None   # the interpreter
    kernels = order(a.dtype, m, n, k, g.table)
    if (kernels[:1] == ("cute",)) if impl == "cute" else ("triton" in kernels):
        return None
    if g.table is None:
        return (f"no measurements for {g.arch}: the vendor BLAS for M={m} N={n} K={k} {_dtype(a.dtype)} (the Triton "
                "kernel only for 16-bit weights >= 32 MiB, where it led cuBLAS on the H200: "
                "dispatch.unmeasured_order)")
    faster = "the Triton kernel" if impl == "cute" and "triton" in kernels else "cuBLAS"
    listed = g.table.get(_dtype(a.dtype), m, n, k, False) is not None
    return (f"{faster} measured faster for M={m} N={n} K={k} "
            + (f"({g.table.label()})" if listed else "(dispatch.triton_beats_cublas)"))


# Every predicate and implementation takes (a, w, bias, residual, out_dtype); out_dtype None: a's dtype.

def _cute_available(a, w, bias, residual, out_dtype=None) -> Reason:
    return cute_can_run_on(a, w, bias, residual) or cute_kernels.unavailable()


def _triton_available(a, w, bias, residual, out_dtype=None) -> Reason:
    return triton_can_run_on(a, w, bias, residual) or _TRITON.reason()


def _cute_profitable(a, w, bias, residual, out_dtype=None) -> Reason:
    return _measured("cute", a, w)


def _triton_profitable(a, w, bias, residual, out_dtype=None) -> Reason:
    if out_dtype is not None:
        return None   # against the upcast product, not the table's 16-bit cuBLAS (module doc)
    return _measured("triton", a, w)


def _cute_config(a, w, static_weight: bool, trigger_first: bool = True) -> KernelConfig:
    m, k = a.shape
    cfg = cute_config_for(a.dtype, m, w.shape[0], k, static_weight, gpu_of(a.device).table)
    if not trigger_first and cfg.trigger_first:   # the same tiles, the next kernel launched after our wait
        cfg = dataclasses.replace(cfg, trigger_first=False)
    return cfg


def _cute(a, w, bias, residual, out_dtype=None, static_weight=False, trigger_first=True):
    return cute.skinny_gemm_cute(a, w, bias, residual, _cute_config(a, w, static_weight, trigger_first),
                                 static_weight=static_weight, out_dtype=out_dtype)


def _cute_kernels(a, w, bias, residual, out_dtype=None, static_weight=False, trigger_first=True) -> list:
    return cute.kernels(a, w, bias, residual, _cute_config(a, w, static_weight, trigger_first), static_weight,
                        out_dtype)


def _triton(a, w, bias, residual, out_dtype=None, static_weight=False, trigger_first=True):
    m, k = a.shape
    cfg = triton_config_for(a.dtype, m, w.shape[0], k, gpu_of(a.device))
    return _TRITON.skinny_gemm_triton(a, w, bias, residual, config=cfg, static_weight=static_weight,
                                      out_dtype=out_dtype)


def _reference(a, w, bias, residual, out_dtype=None, static_weight=False, trigger_first=True):
    return skinny_gemm_reference(a, w, bias, residual, out_dtype)   # no PDL: nothing to stream early


def _cublas(a, w, bias, residual, out_dtype=None, static_weight=False, trigger_first=True):
    """cuBLAS on a GPU, rounded as eager ``linear`` + ``add``; a fp32 output of 16-bit operands as the graph had
    it before the rewrite: the operands upcast, then the fp32 product."""
    if out_dtype is not None:
        a, w, bias = (t if t is None else t.to(out_dtype) for t in (a, w, bias))
    out = torch.nn.functional.linear(a, w, bias)
    return out if residual is None else out.add_(residual)


def kernels(a, w, bias=None, residual=None, backend: str = "auto", m_limit: int = 16, static_weight: bool = False,
            out_dtype: Optional[torch.dtype] = None, trigger_first: bool = True) -> list:
    """The kernels a call of ``k3::skinny_gemm`` with these arguments (``op.py``'s) builds at its first call: those of
    the implementation ``select`` picks, at the configuration it runs (``k3compile/precompile.py`` builds them
    ahead)."""
    out_dtype = None if out_dtype == a.dtype else out_dtype
    if a.shape[0] > m_limit:
        return []
    return SKINNY_GEMM.kernels(backend, key(a, w, bias, residual, out_dtype), (a, w, bias, residual, out_dtype),
                               static_weight=static_weight and a.shape[0] > 0, trigger_first=trigger_first)


SKINNY_GEMM = register_op_impls(OpImpls(
    "skinny_gemm",
    reference=Impl(_reference),
    triton=Impl(_triton, _triton_available, triton_config.supports, _triton_profitable),
    cute=Impl(_cute, _cute_available, cute.supports, _cute_profitable, kernels=_cute_kernels),
    aten=Impl(_cublas),
    plan=kernels,
))


def _layout(t: Optional[torch.Tensor]):
    # what the predicates read: strides and 16-byte alignment of the base address
    return None if t is None else (tuple(t.stride()), t.data_ptr() % 16 == 0)


def key(a, w, bias, residual, out_dtype=None) -> tuple:
    """Everything the predicates read (``static_weight`` never changes the choice)."""
    return (a.dtype, a.device.type, tuple(a.shape), w.shape[0],
            _layout(a), _layout(w), _layout(bias), _layout(residual), out_dtype)


def select(backend: str, m_limit: int, a, w, bias, residual, out_dtype=None) -> Callable[..., Any]:
    """The implementation to run (``fn(a, w, bias, residual, out_dtype, static_weight=...)``), its choice
    recorded. ``out_dtype``: None (a's dtype) or float32 for 16-bit operands (``op.py``)."""
    k_ = key(a, w, bias, residual, out_dtype)
    if a.shape[0] > m_limit:
        return SKINNY_GEMM.select_fixed(backend, k_, "aten",
                                        f"M={a.shape[0]} > m_limit={m_limit}: torch.addmm (cuBLAS on GPU)", _cublas)
    return SKINNY_GEMM.select(backend, k_, a, w, bias, residual, out_dtype)


def run_auto(a, w, bias=None, residual=None, static_weight: bool = False) -> torch.Tensor:
    """``a @ wᵀ + bias + residual`` by the implementation ``backend="auto"`` picks for these operands (decided as
    the op decides, once per key, not recorded): the GEMM of an op whose own implementation composes this one
    (the latent-MoE tail's split path, which that op's dispatch records)."""
    impl = SKINNY_GEMM.decide_once("auto", key(a, w, bias, residual), (a, w, bias, residual))
    return SKINNY_GEMM.impl(impl).fn(a, w, bias, residual, static_weight=static_weight)


def auto_kernels(a, w, bias=None, residual=None, static_weight: bool = False) -> list:
    """The kernels ``run_auto`` builds at its first call with these operands."""
    return SKINNY_GEMM.kernels("auto", key(a, w, bias, residual), (a, w, bias, residual), static_weight=static_weight)
