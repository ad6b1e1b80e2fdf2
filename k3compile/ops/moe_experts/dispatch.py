"""Which implementation of ``k3::moe_experts`` runs, in one place: the order and the profitability rule.

Order (``k3compile.backends``): ``cute`` for MXFP4 weights, bf16 activations and at most 8 tokens on sm_90+
(``cute.py``: the decode form's products as mma.sync kernels), then ``triton`` on a GPU (or CPU tensors under
``TRITON_INTERPRET=1``), else the ``reference``. The Triton implementation has two forms, picked by M
(``config.decode_form``): up to ``small_m_limit`` rows (at most 16) the decode kernels, which find their expert's
tokens themselves; above, the same kernels over pairs sorted by expert (prefill).

Profitable: everywhere, except where the measured table of this GPU (``tables/<gpu>.json``, written by
``benchmarks/moe_experts.py --table``) lists the dense form through cuBLAS (``aten``: every token through every
expert, as ``model/moe.py`` ``experts_dense`` writes it) as faster for the shape. Without a table nothing is
passed over.

Nothing here imports Triton: the kernel module loads on first use (``KernelModule``; where it does not import,
``available`` says why).
"""
from __future__ import annotations

from typing import Optional

import torch

from k3compile.backends import Impl, OpImpls, Reason, cute_can_run_on, register_op_impls, triton_can_run_on
from k3compile.kernel_module import KernelModule

from . import cute

from .config import decode_form, table
from .reference import moe_experts_ref

_TRITON = KernelModule(f"{__package__}.triton")   # imports Triton


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def weight_format(w1_scale) -> str:
    return "mxfp4" if w1_scale is not None else "float"


def dense_faster(z, experts, w1, w1_scale, small_m_limit) -> Reason:
    """None where the table measured the Triton kernels faster or has no entry; else why the dense form wins.

    Entries: ``{"dtype", "format", "E", "I", "L", "A", "dense_from_m"}``: from that many rows on, the dense form
    through cuBLAS measured faster than the sorted (prefill) kernels."""
    m, l = z.shape
    for entry in table(z.device).get("dense", []):
        if (entry["dtype"], entry["format"], entry["E"], entry["I"], entry["L"], entry["A"]) == (
                _dtype_name(z.dtype), weight_format(w1_scale), w1.shape[0], w1.shape[1], l, experts.shape[1]):
            if m > small_m_limit and m >= entry["dense_from_m"]:
                return f"the dense form through cuBLAS measured faster from M={entry['dense_from_m']} (tables)"
    return None


# The predicates get (z, experts, weights, w1, w3, w2, w1_scale, w3_scale, w2_scale, small_m_limit).

def _triton_available(z, experts, weights, w1, w3, w2, w1_scale, w3_scale, w2_scale, small_m_limit) -> Reason:
    return triton_can_run_on(z, experts, weights, w1, w3, w2, w1_scale, w3_scale, w2_scale) or _TRITON.reason()


def _triton_supports(z, experts, weights, w1, w3, w2, w1_scale, w3_scale, w2_scale, small_m_limit) -> Reason:
    return _TRITON.supports(z, experts, weights, w1, w3, w2, w1_scale)


def _triton_profitable(z, experts, weights, w1, w3, w2, w1_scale, w3_scale, w2_scale, small_m_limit) -> Reason:
    if w1_scale is not None:
        return None   # the dense form would dequantise every expert: never measured faster
    return dense_faster(z, experts, w1, w1_scale, small_m_limit)


def _cute_available(z, experts, weights, w1, w3, w2, w1_scale, w3_scale, w2_scale, small_m_limit) -> Reason:
    return cute_can_run_on(z, w1, w3, w2) or cute.unavailable()


def _cute_supports(z, experts, weights, w1, w3, w2, w1_scale, w3_scale, w2_scale, small_m_limit) -> Reason:
    return cute.supports(z, experts, weights, w1, w3, w2, w1_scale, w3_scale, w2_scale, small_m_limit)


def _cute_kernels(z, experts, weights, w1, w3, w2, w1_scale, w3_scale, w2_scale, small_m_limit, beta=None,
                  linear_beta=None) -> list:
    # the variants without the second scale multiply: planning cannot read the scales, a real checkpoint needs none
    # (a call whose scales do builds the exact ones at its first call)
    return cute.kernels(z, experts, w1, beta, linear_beta, big=False)


def _run_cute(z, experts, weights, w1, w3, w2, w1_scale, w3_scale, w2_scale, beta, linear_beta, small_m_limit):
    return cute.moe_experts_cute(z, experts, weights, w1, w3, w2, w1_scale, w3_scale, w2_scale, beta, linear_beta)


def _run_triton(z, experts, weights, w1, w3, w2, w1_scale, w3_scale, w2_scale, beta, linear_beta, small_m_limit):
    return _TRITON.moe_experts_triton(z, experts, weights, w1, w3, w2, w1_scale, w3_scale, w2_scale, beta,
                                      linear_beta, small_m_limit=small_m_limit)


def _run_reference(z, experts, weights, w1, w3, w2, w1_scale, w3_scale, w2_scale, beta, linear_beta, small_m_limit):
    return moe_experts_ref(z, experts, weights, w1, w3, w2, w1_scale, w3_scale, w2_scale, beta, linear_beta)


def moe_experts_dense(z, experts, weights, w1, w3, w2, beta, linear_beta) -> torch.Tensor:
    """Every token through every expert (cuBLAS batched GEMMs), unselected experts weighted 0: the model's
    ``experts_dense`` (float weights only). No host sync (it runs inside CUDA graphs): a token holding an id
    outside [0, E) comes out NaN, as from the kernels."""
    from .reference import _situ_glu

    num_experts = w1.shape[0]
    bad = ((experts < 0) | (experts >= num_experts)).any(-1, keepdim=True)       # [M, 1]
    combine = torch.zeros(z.shape[0], num_experts, dtype=torch.float32, device=z.device)
    combine = combine.scatter(1, experts.long().clamp(0, num_experts - 1), weights.float())   # [M, E]
    gate = torch.einsum("ml,eil->emi", z, w1)                                      # [E, M, I]
    up = torch.einsum("ml,eil->emi", z, w3)
    h = _situ_glu(gate.float(), up.float(), beta, linear_beta).to(z.dtype)
    y = torch.einsum("emi,eli->eml", h, w2)                                        # [E, M, L]
    out = (y.float() * combine.t()[..., None]).sum(0)
    return torch.where(bad, torch.nan, out).to(z.dtype)


def _run_dense(z, experts, weights, w1, w3, w2, w1_scale, w3_scale, w2_scale, beta, linear_beta, small_m_limit):
    return moe_experts_dense(z, experts, weights, w1, w3, w2, beta, linear_beta)


def kernels(z, experts, weights, w1, w3, w2, w1_scale, w3_scale, w2_scale, beta, linear_beta, backend: str = "auto",
            small_m_limit: int = 16) -> list:
    """The kernels a call of ``k3::moe_experts`` with these arguments (``op.py``'s) builds at its first call: the CuTe
    products where dispatch picks them (``k3compile/precompile.py`` builds them ahead); the Triton kernels JIT."""
    args = (z, experts, weights, w1, w3, w2, w1_scale, w3_scale, w2_scale, small_m_limit)
    return MOE_EXPERTS.kernels(backend, key(z, experts, weights, w1, w3, w2, w1_scale, small_m_limit), args,
                               beta=beta, linear_beta=linear_beta)


MOE_EXPERTS = register_op_impls(OpImpls(
    "moe_experts",
    reference=Impl(_run_reference),
    triton=Impl(_run_triton, _triton_available, _triton_supports, _triton_profitable),
    cute=Impl(_run_cute, _cute_available, _cute_supports, kernels=_cute_kernels),
    aten=Impl(_run_dense),   # the dense form through cuBLAS, where the table measured it faster
    plan=kernels,
))


def _layout(t) -> Optional[tuple]:
    # what the kernels read: unit stride on the last dimension (else a contiguous copy first)
    return None if t is None else (t.stride(-1) == 1,)


def key(z, experts, weights, w1, w3, w2, w1_scale, small_m_limit) -> tuple:
    """Everything the predicates read, as the report prints it."""
    m, l = z.shape
    form = "decode" if decode_form(m, experts.shape[1], small_m_limit) else "prefill"
    return (z.device.type, (_dtype_name(z.dtype), weight_format(w1_scale), form, f"M={m}", f"A={experts.shape[1]}",
                            f"E={w1.shape[0]}", f"I={w1.shape[1]}", f"L={l}",
                            *(("strided",) if not all(_layout(t)[0] for t in (z, w1, w3, w2)) else ())))


def choose(backend, z, experts, weights, w1, w3, w2, w1_scale, w3_scale, w2_scale, small_m_limit):
    """The implementation to run (recorded in ``MOE_EXPERTS`` under the call's key)."""
    k = key(z, experts, weights, w1, w3, w2, w1_scale, small_m_limit)
    return MOE_EXPERTS.select(backend, k, z, experts, weights, w1, w3, w2, w1_scale, w3_scale, w2_scale,
                              small_m_limit)
