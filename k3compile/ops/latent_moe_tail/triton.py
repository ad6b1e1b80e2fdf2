"""Triton kernel of the fused latent-MoE tail for small M: RMSNorm + skinny up-projection + shared add.

The op does not pick it by default: on an H200 it streamed the 51 MB weight at 50 µs where norm +
``k3::skinny_gemm`` (``split.py``) reaches ~18 µs; ``op.FUSED_KERNEL_FASTER_ON`` lists the GPUs where it
measures faster (none yet). Kept for that, for ``benchmarks/moe_tail.py`` and as a tested kernel.

One program owns ``BLOCK_N`` output columns for all M (≤ 16) rows and walks the latent width L in
``BLOCK_K`` steps, so the [D, L] up-projection weight is streamed from memory exactly once:

    for each k-tile:  ss[m]  += Σ_k x[m,k]²                      (fp32)
                      acc[m,n] += Σ_k (x[m,k]·g[k]) · W[n,k]      (tensor cores, fp32 accumulate)
    out[m,n] = acc[m,n] · rsqrt(ss[m]/L + eps) + shared[m,n]

The per-row rstd factors out of the dot product, so no program needs a pass of its own over the
latent (``PRENORM=False``). ``x·g`` is rounded to the input dtype before the dot; in fp16 that product
of an *unnormalised* latent could overflow, so fp16 defaults to ``PRENORM=True``: a first loop over the
latent row computes rstd (the latent is M·L elements, a few KB, served from L2) and the main loop
feeds ``(x·rstd)·g`` to the dot as the model rounds it.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from k3compile.backends import Reason, triton_can_run_on, triton_interpret

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
MAX_BLOCK_M = 16   # one tensor-core tile of rows; the op's small-M limit may not exceed it


@dataclass(frozen=True)
class TailConfig:
    """Compile-time knobs of the kernel (swept by ``benchmarks/moe_tail.py --sweep``)."""
    block_n: int = 32
    block_k: int = 128
    num_warps: int = 4
    num_stages: int = 4
    prenorm: bool = False


def default_config(m: int, d: int, l: int, dtype: torch.dtype) -> TailConfig:
    """Heuristic: enough column tiles to cover every SM of an H200 (D=7168 → 224 programs)."""
    block_k = 128 if l >= 128 else max(16, triton.next_power_of_2(l))
    return TailConfig(block_n=32, block_k=block_k, num_warps=4, num_stages=4,
                      prenorm=dtype == torch.float16)


@triton.jit
def _latent_moe_tail_kernel(
    p_x, p_s, p_g, p_w, p_o,
    M, D, L, eps,
    s_xm, s_xk, s_sm, s_sn, s_wn, s_wk, s_om, s_on,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PRENORM: tl.constexpr, IEEE_DOT: tl.constexpr, UPCAST_DOT: tl.constexpr,
):
    i_n = tl.program_id(0)
    o_m = tl.arange(0, BLOCK_M)
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_m = o_m < M
    m_n = o_n < D

    if PRENORM:
        b_ss = tl.zeros([BLOCK_M], dtype=tl.float32)
        for k0 in range(0, L, BLOCK_K):
            o_k = k0 + tl.arange(0, BLOCK_K)
            m_x = m_m[:, None] & (o_k < L)[None, :]
            b_x = tl.load(p_x + o_m[:, None] * s_xm + o_k[None, :] * s_xk, mask=m_x, other=0.).to(tl.float32)
            b_ss += tl.sum(b_x * b_x, axis=1)
        b_rstd = 1.0 / tl.sqrt(b_ss / L + eps)
    else:
        b_ss = tl.zeros([BLOCK_M], dtype=tl.float32)

    b_acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, L, BLOCK_K):
        o_k = k0 + tl.arange(0, BLOCK_K)
        m_k = o_k < L
        b_x = tl.load(p_x + o_m[:, None] * s_xm + o_k[None, :] * s_xk,
                      mask=m_m[:, None] & m_k[None, :], other=0.)
        b_g = tl.load(p_g + o_k, mask=m_k, other=0.)
        if PRENORM:
            # The model's rounding: normalise in fp32, round, scale by the weight, round.
            b_h = (b_x.to(tl.float32) * b_rstd[:, None]).to(b_x.dtype)
            b_h = (b_h.to(tl.float32) * b_g.to(tl.float32)).to(b_x.dtype)
        else:
            b_xf = b_x.to(tl.float32)
            b_ss += tl.sum(b_xf * b_xf, axis=1)
            b_h = (b_xf * b_g.to(tl.float32)).to(b_x.dtype)
        b_w = tl.load(p_w + o_n[:, None].to(tl.int64) * s_wn + o_k[None, :] * s_wk,   # D·L may pass 2**31
                      mask=m_n[:, None] & m_k[None, :], other=0.)
        if UPCAST_DOT:
            b_acc += tl.dot(b_h.to(tl.float32), tl.trans(b_w.to(tl.float32)))
        elif IEEE_DOT:
            b_acc += tl.dot(b_h, tl.trans(b_w), input_precision="ieee")
        else:
            b_acc += tl.dot(b_h, tl.trans(b_w))

    if not PRENORM:
        b_acc = b_acc * (1.0 / tl.sqrt(b_ss / L + eps))[:, None]
    m_o = m_m[:, None] & m_n[None, :]
    b_s = tl.load(p_s + o_m[:, None] * s_sm + o_n[None, :] * s_sn, mask=m_o, other=0.)
    b_o = b_acc + b_s.to(tl.float32)
    tl.store(p_o + o_m[:, None] * s_om + o_n[None, :] * s_on, b_o.to(p_o.dtype.element_ty), mask=m_o)


def triton_available(latent, shared, norm_weight, up_weight, *rest) -> Reason:
    return triton_can_run_on(latent, shared, norm_weight, up_weight)


def triton_supports(latent, shared, norm_weight, up_weight, eps, small_m_limit=MAX_BLOCK_M) -> Reason:
    dtypes = {latent.dtype, shared.dtype, norm_weight.dtype, up_weight.dtype}
    if len(dtypes) != 1:
        return f"mixed dtypes {sorted(str(d) for d in dtypes)} (the kernel takes one dtype)"
    if latent.dtype not in SUPPORTED_DTYPES:
        return f"dtype {latent.dtype} (kernel has {[str(d) for d in SUPPORTED_DTYPES]})"
    m = latent.shape[0]
    if m > min(small_m_limit, MAX_BLOCK_M):
        return f"M > {min(small_m_limit, MAX_BLOCK_M)}, the small-M limit (norm + addmm is faster there)"
    if m == 0 or latent.shape[1] == 0:
        return "empty input"
    return None


def latent_moe_tail_triton(latent: torch.Tensor, shared: torch.Tensor, norm_weight: torch.Tensor,
                           up_weight: torch.Tensor, eps: float,
                           config: Optional[TailConfig] = None,
                           out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Launch the fused kernel: one program per ``block_n`` columns; ``out`` [M, D] is allocated
    unless given (tests pass a NaN-poisoned one)."""
    m, l = latent.shape
    d = up_weight.shape[0]
    cfg = config or default_config(m, d, l, latent.dtype)
    if out is None:
        out = torch.empty((m, d), dtype=latent.dtype, device=latent.device)
    if not norm_weight.is_contiguous():
        norm_weight = norm_weight.contiguous()
    grid = (triton.cdiv(d, cfg.block_n),)
    # Triton launches on the current device: make it the tensors' (TP ranks, a model on cuda:1)
    on_device = torch.cuda.device(latent.device) if latent.device.type == "cuda" else contextlib.nullcontext()
    with on_device:
        _latent_moe_tail_kernel[grid](
            latent, shared, norm_weight, up_weight, out,
            m, d, l, float(eps),
            latent.stride(0), latent.stride(1), shared.stride(0), shared.stride(1),
            up_weight.stride(0), up_weight.stride(1), out.stride(0), out.stride(1),
            BLOCK_M=MAX_BLOCK_M, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
            PRENORM=cfg.prenorm, IEEE_DOT=latent.dtype == torch.float32,
            # The interpreter (triton 3.7) multiplies bf16 dot operands as raw integers: give it
            # fp32 (bf16 products are exact in fp32, so the rounding is the GPU kernel's).
            UPCAST_DOT=latent.dtype == torch.bfloat16 and triton_interpret(),
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )
    return out
