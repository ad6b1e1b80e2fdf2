"""Triton pieces both forms of the one-kernel tail share (``triton.py``'s grid, ``streamk.py``'s persistent
programs): the latent tile scaled by the norm weight, the product, the epilogue; PDL and TMA capability checks."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

try:  # grid dependency control (PDL), Triton >= 3.4
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover
    gdc_launch_dependents = gdc_wait = None

from k3compile.backends import triton_pdl_capable


@triton.jit
def _row_rstd(p_x, o_m, m_m, s_xm, s_xk, L, eps, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    b_ss = tl.zeros([BLOCK_M], dtype=tl.float32)
    for k0 in range(0, L, BLOCK_K):
        o_k = k0 + tl.arange(0, BLOCK_K)
        b_x = tl.load(p_x + o_m[:, None] * s_xm + o_k[None, :] * s_xk,
                      mask=m_m[:, None] & (o_k < L)[None, :], other=0.).to(tl.float32)
        b_ss += tl.sum(b_x * b_x, axis=1)
    return 1.0 / tl.sqrt(b_ss / L + eps)


@triton.jit
def _scale_by_norm_weight(b_x, b_g, b_rstd, PRENORM: tl.constexpr):
    """(A tile in the input dtype, fp32 squares of the raw latent) from a latent tile and its norm-weight slice."""
    b_g = b_g.to(tl.float32)
    b_xf = b_x.to(tl.float32)
    if PRENORM:
        b_h = ((b_xf * b_rstd[:, None]).to(b_x.dtype).to(tl.float32) * b_g).to(b_x.dtype)
    else:
        b_h = (b_xf * b_g).to(b_x.dtype)
    return b_h, b_xf * b_xf


@triton.jit
def _latent_tiles(p_x, p_g, o_m, m_m, o_k, m_k, s_xm, s_xk):
    """The raw latent tile [BLOCK_M, BLOCK_K] and its norm-weight slice (zeros past M and the K range)."""
    b_x = tl.load(p_x + o_m[:, None] * s_xm + o_k[None, :] * s_xk, mask=m_m[:, None] & m_k[None, :], other=0.)
    b_g = tl.load(p_g + o_k, mask=m_k, other=0.)
    return b_x, b_g


@triton.jit
def _scaled_latent(p_x, p_g, o_m, m_m, o_k, m_k, s_xm, s_xk, b_rstd, PRENORM: tl.constexpr):
    """One K tile of the GEMM's A operand and the squares of its raw latent (fp32, elementwise).

    A = x·g in the input dtype, the per-row rstd left to the accumulator; with PRENORM the model's
    rounding instead: normalise in fp32, round, scale by the weight, round."""
    b_x, b_g = _latent_tiles(p_x, p_g, o_m, m_m, o_k, m_k, s_xm, s_xk)
    return _scale_by_norm_weight(b_x, b_g, b_rstd, PRENORM)


@triton.jit
def _latent_tile(p_x, p_g, o_m, m_m, o_k, m_k, s_xm, s_xk, b_rstd, PRENORM: tl.constexpr):
    """:func:`_scaled_latent` with the squares summed per row (stream-K's units end at varying K)."""
    b_h, b_sq = _scaled_latent(p_x, p_g, o_m, m_m, o_k, m_k, s_xm, s_xk, b_rstd, PRENORM)
    return b_h, tl.sum(b_sq, axis=1)


@triton.jit
def _add_product(b_acc, b_h, b_w, SWAP_AB: tl.constexpr, IEEE_DOT: tl.constexpr, UPCAST_DOT: tl.constexpr):
    """``b_acc + b_h·b_wᵀ``, or with ``SWAP_AB`` ``b_acc + b_w·b_hᵀ`` (the accumulator transposed: the weight
    tile is then the MMA's wgmma-sized M side), in fp32; ``UPCAST_DOT`` feeds the dot fp32 operands."""
    if UPCAST_DOT:
        b_h = b_h.to(tl.float32)
        b_w = b_w.to(tl.float32)
    if SWAP_AB:
        if IEEE_DOT:
            b_p = tl.dot(b_w, tl.trans(b_h), input_precision="ieee")
        else:
            b_p = tl.dot(b_w, tl.trans(b_h))
    else:
        if IEEE_DOT:
            b_p = tl.dot(b_h, tl.trans(b_w), input_precision="ieee")
        else:
            b_p = tl.dot(b_h, tl.trans(b_w))
    return b_acc + b_p


@triton.jit
def _shared_tile(p_s, o_m, o_n, m_m, m_n, s_sm, s_sn):
    return tl.load(p_s + o_m[:, None] * s_sm + o_n[None, :] * s_sn, mask=m_m[:, None] & m_n[None, :], other=0.)


@triton.jit
def _tail_store(b_acc, b_ss, b_s, p_o, o_m, o_n, m_m, m_n, L, eps, s_om, s_on, PRENORM: tl.constexpr):
    """rstd (unless PRENORM applied it), plus the ``shared`` tile ``b_s``, one rounding, the store."""
    if not PRENORM:
        b_acc = b_acc * (1.0 / tl.sqrt(b_ss / L + eps))[:, None]
    b_o = b_acc + b_s.to(tl.float32)
    tl.store(p_o + o_m[:, None] * s_om + o_n[None, :] * s_on, b_o.to(p_o.dtype.element_ty),
             mask=m_m[:, None] & m_n[None, :])


@triton.jit
def _tail_epilogue(b_acc, b_ss, p_s, p_o, o_m, o_n, m_m, m_n, L, eps, s_sm, s_sn, s_om, s_on,
                   PRENORM: tl.constexpr):
    b_s = _shared_tile(p_s, o_m, o_n, m_m, m_n, s_sm, s_sn)
    _tail_store(b_acc, b_ss, b_s, p_o, o_m, o_n, m_m, m_n, L, eps, s_om, s_on, PRENORM)


pdl_capable = triton_pdl_capable   # read through this module: tests simulate a GPU by replacing it


def tma_capable(device: torch.device) -> bool:
    """TMA descriptors: on sm_90+ NVIDIA, and in the interpreter (tests); pointer loads on other GPUs (ROCm)."""
    return pdl_capable(device) or device.type == "cpu"


def _tma_layout_ok(w: torch.Tensor) -> bool:
    return (w.stride(1) == 1 and w.data_ptr() % 16 == 0 and (w.stride(0) * w.element_size()) % 16 == 0
            and w.shape[0] > 0 and w.shape[1] > 0)
