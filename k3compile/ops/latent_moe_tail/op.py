"""``k3::latent_moe_tail``: schema, fake, input checks and dispatch to an implementation.

    out = RMSNorm_eps(latent) · norm_weight @ up_weightᵀ + shared

Up to ``small_m_limit`` rows (≤ 16) the ``triton`` implementation runs: a Triton RMSNorm kernel, then
``k3::skinny_gemm`` with ``shared`` as its residual (``split.py``; the GEMM's own CuTe / Triton / cuBLAS
choice is recorded under ``skinny_gemm``). The single-kernel Triton tail (``triton.py``) is used only
where it is measured faster: nowhere yet (:data:`FUSED_KERNEL_FASTER_ON` is empty; on an H200 it took
50 µs against 22 µs for unfused ``torch.compile``). CuTe: no tail of its own, recorded as a fallback.
Above the limit, or for a dtype the kernels lack, the plain PyTorch ``reference`` (norm + ``addmm``)
runs; each choice with its reason is recorded in ``LATENT_MOE_TAIL``.
"""
from __future__ import annotations

import torch

from k3compile.backends import Impl, OpImpls, register_op_impls

from .reference import latent_moe_tail_unfused
from .split import latent_moe_tail_split
from .triton import MAX_BLOCK_M, latent_moe_tail_triton, triton_available, triton_supports

# GPU names (``torch.cuda.get_device_name``) where benchmarks/moe_tail.py measured the single fused
# kernel faster than norm + skinny GEMM. Empty: on the H200 the skinny GEMM streams the weight faster.
FUSED_KERNEL_FASTER_ON: frozenset[str] = frozenset()


def _fused_kernel_faster(latent: torch.Tensor) -> bool:
    return (bool(FUSED_KERNEL_FASTER_ON) and latent.device.type == "cuda"
            and torch.cuda.get_device_name(latent.device) in FUSED_KERNEL_FASTER_ON)


def _tail_triton(latent, shared, norm_weight, up_weight, eps, backend, small_m_limit):
    if _fused_kernel_faster(latent):
        return latent_moe_tail_triton(latent, shared, norm_weight, up_weight, eps)
    return latent_moe_tail_split(latent, shared, norm_weight, up_weight, eps, backend, small_m_limit)


def _tail_reference(latent, shared, norm_weight, up_weight, eps, backend, small_m_limit):
    return latent_moe_tail_unfused(latent, shared, norm_weight, up_weight, eps)


LATENT_MOE_TAIL = register_op_impls(OpImpls(
    "latent_moe_tail",
    reference=Impl(_tail_reference),
    triton=Impl(_tail_triton, available=triton_available, supports=triton_supports),
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


@torch.library.custom_op("k3::latent_moe_tail", mutates_args=())
def latent_moe_tail_op(latent: torch.Tensor, shared: torch.Tensor, norm_weight: torch.Tensor,
                       up_weight: torch.Tensor, eps: float, backend: str = "auto",
                       small_m_limit: int = MAX_BLOCK_M) -> torch.Tensor:
    check_inputs(latent, shared, norm_weight, up_weight, small_m_limit)
    m, limit = latent.shape[0], min(small_m_limit, MAX_BLOCK_M)
    # everything the predicates read, as the report prints it: "cuda:0 bfloat16 M<=16"
    rows = "M=0" if m == 0 else (f"M<={limit}" if m <= limit else f"M>{limit}")
    key = f"{latent.device} {str(latent.dtype).removeprefix('torch.')} {rows}" + ("" if latent.shape[1] else " L=0")
    fn = LATENT_MOE_TAIL.select(backend, key, latent, shared, norm_weight, up_weight, eps, small_m_limit)
    return fn(latent, shared, norm_weight, up_weight, eps, backend, limit)


@latent_moe_tail_op.register_fake
def _(latent, shared, norm_weight, up_weight, eps, backend="auto", small_m_limit=MAX_BLOCK_M):
    check_inputs(latent, shared, norm_weight, up_weight, small_m_limit)
    return latent.new_empty((latent.shape[0], up_weight.shape[0]))
