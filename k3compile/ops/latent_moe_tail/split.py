"""The latent-MoE tail as two kernels: a Triton RMSNorm, then ``k3::skinny_gemm`` with the shared add.

    normed = KimiRMSNorm(latent)                       # [M, L], one small Triton kernel
    out    = skinny_gemm(normed, up_weight, residual=shared)   # CuTe -> Triton -> cuBLAS, recorded

The up-projection weight (7168×3584 bf16, 51 MB) dominates: the skinny-GEMM op streams it at 73-81% of
the copy ceiling on an H200. The norm writes M·L elements (a few KB), so splitting it off costs one
launch, not bandwidth: 19.1 / 19.6 / 19.8 µs at M = 1 / 4 / 16 on an H200, against 18.0 / 18.5 / 20.1 µs
for the one-kernel Triton tail (``triton.py``, stream-K). The op runs this path wherever no one-kernel
form was measured faster (``triton.TUNED``, ``op.CUTE_FASTER``).

The norm rounds as the model does: normalise in fp32, cast to the activation dtype, multiply by the
weight in that dtype (``reference.kimi_rms_norm``); the GEMM accumulates in fp32 and adds ``shared``
before its single rounding.
"""
from __future__ import annotations

import contextlib
from typing import Optional

import torch
import triton
import triton.language as tl

MAX_NORM_BLOCK = 8192   # one tile covers K3's latent (3584); wider rows loop


@triton.jit
def _kimi_rms_norm_kernel(p_x, p_g, p_y, L, eps, s_xm, s_xk, s_ym, s_yk, BLOCK: tl.constexpr):
    # one program per row: the row's sum of squares, then the scaled row
    i_m = tl.program_id(0).to(tl.int64)
    p_x += i_m * s_xm
    p_y += i_m * s_ym
    b_ss = tl.zeros([BLOCK], dtype=tl.float32)
    for k0 in range(0, L, BLOCK):
        o_k = k0 + tl.arange(0, BLOCK)
        b_x = tl.load(p_x + o_k * s_xk, mask=o_k < L, other=0.).to(tl.float32)
        b_ss += b_x * b_x
    b_rstd = tl.rsqrt(tl.sum(b_ss, axis=0) / L + eps)
    for k0 in range(0, L, BLOCK):
        o_k = k0 + tl.arange(0, BLOCK)
        m_k = o_k < L
        b_x = tl.load(p_x + o_k * s_xk, mask=m_k, other=0.)
        b_g = tl.load(p_g + o_k, mask=m_k, other=0.)
        # the model's rounding: normalised value in the activation dtype, then times the weight
        b_n = (b_x.to(tl.float32) * b_rstd).to(b_x.dtype)
        b_y = (b_n.to(tl.float32) * b_g.to(tl.float32)).to(b_x.dtype)
        tl.store(p_y + o_k * s_yk, b_y, mask=m_k)


def kimi_rms_norm_triton(latent: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                         out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``KimiRMSNorm`` of ``latent`` [M, L] with weight [L] (one dtype); ``out`` [M, L] unless given."""
    m, l = latent.shape
    if out is None:
        out = torch.empty((m, l), dtype=latent.dtype, device=latent.device)
    if m == 0 or l == 0:
        return out
    if not norm_weight.is_contiguous():
        norm_weight = norm_weight.contiguous()
    block = min(MAX_NORM_BLOCK, triton.next_power_of_2(l))
    # Triton launches on the current device: make it the tensors' (TP ranks, a model on cuda:1)
    on_device = torch.cuda.device(latent.device) if latent.device.type == "cuda" else contextlib.nullcontext()
    with on_device:
        _kimi_rms_norm_kernel[(m,)](
            latent, norm_weight, out, l, float(eps),
            latent.stride(0), latent.stride(1), out.stride(0), out.stride(1),
            BLOCK=block, num_warps=8 if block >= 4096 else 4,
        )
    return out


def latent_moe_tail_split(latent: torch.Tensor, shared: torch.Tensor, norm_weight: torch.Tensor,
                          up_weight: torch.Tensor, eps: float, backend: str = "auto",
                          m_limit: int = 16, static_weight: bool = False) -> torch.Tensor:
    """Triton norm, then ``k3::skinny_gemm(normed, up_weight, None, shared, backend, m_limit)``: the
    skinny-GEMM op picks CuTe, Triton or cuBLAS and records its choice under ``skinny_gemm``.

    ``static_weight`` (the caller proved no kernel writes ``up_weight``) goes on to the GEMM: its
    activation is the norm kernel's output, a kernel of this same call, as the proof requires."""
    from k3compile.ops.skinny_gemm import skinny_gemm_op  # noqa: PLC0415  (an op package of its own)

    normed = kimi_rms_norm_triton(latent, norm_weight, eps)
    if static_weight:
        return skinny_gemm_op(normed, up_weight, None, shared, backend, m_limit, static_weight=True)
    return skinny_gemm_op(normed, up_weight, None, shared, backend, m_limit)
