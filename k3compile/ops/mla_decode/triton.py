"""Triton absorbed-MLA decode: split-KV over the valid prefix of the latent cache, all heads sharing each tile.

Four launches, their sizes fixed by shapes alone (CUDA-graph capturable; the valid length is read on the device):

1. ``_per_head_matmul``: the query absorbed into the latent space, ``q_lat[b, t, h] = q_nope[b, t, h] @ w_k[h]``
   (``[B, T*H, Lk]`` in the cache dtype, as the model rounds it). Each program reads one tile of ``w_k`` once.
2. ``_mla_split``: grid (B, splits, row blocks). A program owns up to 64 query rows ``(t, h)`` of one sequence -- all
   heads of the rank for T x H <= 64 -- and one split of the keys ``[min(start_b, pos), pos + T)`` (its length on the
   device from ``pos`` and ``start``: programs past the valid length exit at once). It walks its split in tiles of
   ``block_s`` keys; each ``c_kv`` / ``k_pe`` tile is loaded once and serves every row twice: the scores
   ``q_lat c_kvᵀ + q_pe k_peᵀ`` and the latent output ``p c_kv``. Online softmax in fp32 (base 2, the scale folded
   in); the split's unnormalised output, running max and sum go to fp32 scratch.
3. ``_mla_combine``: one program per (query row, Lk chunk) rescales the active splits' partials to their common max
   (splits loaded as a [32, chunk] tile at a time) and writes the normalised latent output ``o_lat``.
4. ``_per_head_matmul`` again: ``out[b, t, h] = o_lat[b, t, h] @ w_v[h]ᵀ``.

Rows of the cache outside the valid range are never loaded (masked loads), so the step's cost follows the valid
length, not the allocation. On sm_90+ the four launch with PDL: each waits for the kernel before it
(``griddepcontrol.wait``) before it reads anything and only then lets the next one start, so a launch's latency
hides under the previous kernel's tail. Runs on CUDA/ROCm, and on CPU tensors under ``TRITON_INTERPRET=1``.
"""
from __future__ import annotations

import contextlib
from typing import Optional

import torch
import triton
import triton.language as tl

try:  # grid dependency control (PDL), Triton >= 3.4
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover
    gdc_launch_dependents = gdc_wait = None

from k3compile.backends import is_rocm, sm_count, triton_interpret

from .config import TritonConfig, default_config, row_block, split_count

LOG2E = 1.4426950408889634
SPLIT_TILE = 32        # splits the combine loads at once
COMBINE_CHUNK = 64     # latent columns a combine program owns (Lk 512: 8 programs a query row)
MATMUL_BLOCK = 64      # the per-head products' K and N tiles


@triton.jit
def _dot(a, b, dtype: tl.constexpr, UPCAST: tl.constexpr):
    """``a @ b`` (fp32 accumulate) of operands rounded to ``dtype``. ``UPCAST``: the interpreter (triton 3.7)
    multiplies 16-bit dot operands wrongly, so they go in as fp32 (exact products: the GPU kernel's rounding)."""
    a = a.to(dtype)
    b = b.to(dtype)
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    elif dtype == tl.float32:   # fp32 inputs keep fp32 products (tf32 would round them to 10 bits)
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def _pdl_enter(PDL: tl.constexpr):
    """Under PDL: wait for the previous kernel (its writes visible), then let the next one launch. Nothing may be
    read before the wait; the trigger after it keeps every k3 kernel's order (k3compile/static_weights.py)."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


@triton.jit
def _split_len(n, N_SPLIT, BS: tl.constexpr, MIN_TILES: tl.constexpr):
    """Keys per split for a valid length ``n`` >= 0: an equal share of ``N_SPLIT`` splits, in whole tiles, at least
    ``MIN_TILES`` tiles. Splits ``[0, cdiv(n, len))`` are active; the split and combine kernels agree through this."""
    return tl.maximum(tl.cdiv(tl.cdiv(n, N_SPLIT), BS), MIN_TILES) * BS


@triton.jit
def _valid_range(pos, start, i_b, T, HAS_START: tl.constexpr):
    """(first key, end, length) of the keys some query of row ``i_b`` sees: ``[min(start_b, pos), pos + T)``."""
    p = tl.load(pos).to(tl.int32)          # positions fit 32 bits; 64-bit loop bounds would not pipeline
    if HAS_START:
        first = tl.minimum(tl.load(start + i_b).to(tl.int32), p)
    else:
        first = p * 0
    return first, p + T, p + T - first


@triton.jit
def _per_head_matmul(x, w, y, M, T, H, K, NOUT,
                     stride_xb, stride_xt, stride_xh, stride_xk,
                     stride_wh, stride_wk, stride_wn,
                     stride_yb, stride_yt, stride_yh, stride_yn,
                     BM: tl.constexpr, BK: tl.constexpr, BN: tl.constexpr, UPCAST: tl.constexpr,
                     PDL: tl.constexpr):
    """``y[b, t, h, :] = x[b, t, h, :] @ w[h]`` for rows ``b*T + t`` < M; ``w[h]`` is ``[K, NOUT]`` by its strides.
    Grid (H, NOUT tiles, row tiles): each program reads its ``[K, BN]`` slice of ``w[h]`` once for BM rows."""
    _pdl_enter(PDL)
    i_h, i_n, i_m = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    o_m = i_m * BM + tl.arange(0, BM)
    m_m = o_m < M
    i_b = (o_m // T).to(tl.int64)
    i_t = o_m % T
    o_n = i_n * BN + tl.arange(0, BN)
    m_n = o_n < NOUT
    p_x = x + i_b * stride_xb + i_t * stride_xt + i_h * stride_xh
    p_w = w + i_h * stride_wh
    b_acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, K, BK):
        o_k = k0 + tl.arange(0, BK)
        m_k = o_k < K
        b_w = tl.load(p_w + o_k[:, None] * stride_wk + o_n[None, :] * stride_wn, mask=m_k[:, None] & m_n[None, :],
                      other=0)
        b_x = tl.load(p_x[:, None] + o_k[None, :] * stride_xk, mask=m_m[:, None] & m_k[None, :], other=0)
        b_acc += _dot(b_x, b_w, b_w.dtype, UPCAST)
    p_y = y + i_b * stride_yb + i_t * stride_yt + i_h * stride_yh
    tl.store(p_y[:, None] + o_n[None, :] * stride_yn, b_acc.to(y.dtype.element_ty), mask=m_m[:, None] & m_n[None, :])


@triton.jit
def _mla_split(q_lat, q_pe, c_kv, k_pe, pos, start, o_part, m_part, l_part,
               T, H, N_SPLIT, qk_scale,
               stride_pb, stride_pt, stride_ph, stride_pr,
               stride_cb, stride_cs, stride_cl,
               stride_kb, stride_ks, stride_kr,
               LK: tl.constexpr, R: tl.constexpr, BM: tl.constexpr, BL: tl.constexpr, BR: tl.constexpr,
               BS: tl.constexpr, MIN_TILES: tl.constexpr, HAS_START: tl.constexpr, UPCAST: tl.constexpr,
               PDL: tl.constexpr):
    """Split ``i_sp`` of sequence ``i_b``'s valid keys against query rows ``i_m*BM ..`` (row = t*H + h)."""
    _pdl_enter(PDL)
    i_b, i_sp, i_m = tl.program_id(0).to(tl.int64), tl.program_id(1), tl.program_id(2)
    TH = T * H
    first, end, n = _valid_range(pos, start, i_b, T, HAS_START)
    split = _split_len(n, N_SPLIT, BS, MIN_TILES)
    s0 = first + i_sp * split
    if s0 < end:
        s1 = tl.minimum(s0 + split, end)
        o_m = i_m * BM + tl.arange(0, BM)
        m_m = o_m < TH
        i_t = o_m // H
        i_h = o_m % H
        o_l = tl.arange(0, BL)
        m_l = o_l < LK
        o_r = tl.arange(0, BR)
        m_r = o_r < R
        last = tl.load(pos).to(tl.int32) + i_t                               # the last key query row sees
        if HAS_START:   # and its first: its row's start, or its own position before it (a padding query)
            lo = tl.minimum(tl.load(start + i_b).to(tl.int32), last)
        else:
            lo = last * 0
        b_q = tl.load(q_lat + (i_b * TH + o_m)[:, None] * LK + o_l[None, :], mask=m_m[:, None] & m_l[None, :],
                      other=0)
        p_qpe = q_pe + i_b * stride_pb + (i_t * stride_pt + i_h * stride_ph)[:, None] + o_r[None, :] * stride_pr
        b_qpe = tl.load(p_qpe, mask=m_m[:, None] & m_r[None, :], other=0)
        p_c = c_kv + i_b * stride_cb
        p_k = k_pe + i_b * stride_kb
        b_m = tl.full([BM], float("-inf"), tl.float32)
        b_l = tl.zeros([BM], dtype=tl.float32)
        b_acc = tl.zeros([BM, BL], dtype=tl.float32)
        for s in range(s0, s1, BS):
            o_s = s + tl.arange(0, BS)
            m_s = o_s < s1
            b_kv = tl.load(p_c + o_s.to(tl.int64)[:, None] * stride_cs + o_l[None, :] * stride_cl,
                           mask=m_s[:, None] & m_l[None, :], other=0)
            b_kp = tl.load(p_k + o_s.to(tl.int64)[:, None] * stride_ks + o_r[None, :] * stride_kr,
                           mask=m_s[:, None] & m_r[None, :], other=0)
            b_qk = _dot(b_q, tl.trans(b_kv), b_kv.dtype, UPCAST) + _dot(b_qpe, tl.trans(b_kp), b_kv.dtype, UPCAST)
            m_vis = m_s[None, :] & (o_s[None, :] <= last[:, None]) & (o_s[None, :] >= lo[:, None])
            b_qk = tl.where(m_vis, b_qk * qk_scale, float("-inf"))
            b_m_new = tl.maximum(b_m, tl.max(b_qk, 1))
            b_m_use = tl.where(b_m_new == float("-inf"), 0.0, b_m_new)   # no key seen yet: no -inf - -inf
            b_alpha = tl.exp2(b_m - b_m_use)
            b_p = tl.exp2(b_qk - b_m_use[:, None])
            b_l = b_l * b_alpha + tl.sum(b_p, 1)
            b_acc = b_acc * b_alpha[:, None] + _dot(b_p, b_kv, b_kv.dtype, UPCAST)
            b_m = b_m_new
        o_row = (i_b * N_SPLIT + i_sp) * TH + o_m
        tl.store(o_part + o_row[:, None] * LK + o_l[None, :], b_acc, mask=m_m[:, None] & m_l[None, :])
        tl.store(m_part + o_row, b_m, mask=m_m)
        tl.store(l_part + o_row, b_l, mask=m_m)


@triton.jit
def _mla_combine(o_part, m_part, l_part, pos, start, o_lat, T, TH, N_SPLIT,
                 LK: tl.constexpr, BSP: tl.constexpr, BLC: tl.constexpr, BS: tl.constexpr, MIN_TILES: tl.constexpr,
                 HAS_START: tl.constexpr, PDL: tl.constexpr):
    """Row ``i_r`` = b*T*H + t*H + h, latent columns ``i_c*BLC ..``: the active splits' partials rescaled to their
    common max and summed (a split where the row saw no key holds max -inf and sum 0, and weighs nothing)."""
    _pdl_enter(PDL)
    i_r, i_c = tl.program_id(0).to(tl.int64), tl.program_id(1)
    i_b = i_r // TH
    i_th = i_r % TH
    first, end, n = _valid_range(pos, start, i_b, T, HAS_START)
    n_act = tl.cdiv(n, _split_len(n, N_SPLIT, BS, MIN_TILES))
    o_c = i_c * BLC + tl.arange(0, BLC)
    m_c = o_c < LK
    p_row = (i_b * N_SPLIT) * TH + i_th
    b_max = tl.max(tl.full([BSP], float("-inf"), tl.float32), 0)
    for sp0 in range(0, n_act, BSP):
        o_sp = sp0 + tl.arange(0, BSP)
        b_mv = tl.load(m_part + p_row + o_sp * TH, mask=o_sp < n_act, other=float("-inf"))
        b_max = tl.maximum(b_max, tl.max(b_mv, 0))
    b_max = tl.where(b_max == float("-inf"), 0.0, b_max)
    b_acc = tl.zeros([BLC], dtype=tl.float32)
    b_den = tl.sum(tl.zeros([BSP], dtype=tl.float32), 0)
    for sp0 in range(0, n_act, BSP):
        o_sp = sp0 + tl.arange(0, BSP)
        m_sp = o_sp < n_act
        b_w = tl.exp2(tl.load(m_part + p_row + o_sp * TH, mask=m_sp, other=float("-inf")) - b_max)
        b_den += tl.sum(b_w * tl.load(l_part + p_row + o_sp * TH, mask=m_sp, other=0), 0)
        b_o = tl.load(o_part + (p_row + o_sp * TH)[:, None] * LK + o_c[None, :], mask=m_sp[:, None] & m_c[None, :],
                      other=0)
        b_acc += tl.sum(b_w[:, None] * b_o, 0)
    b_out = b_acc / tl.where(b_den > 0, b_den, 1.0)
    tl.store(o_lat + i_r * LK + o_c, b_out.to(o_lat.dtype.element_ty), mask=m_c)


def _empty(*shape: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Every buffer the kernels write (scratch and output) comes from here, so a test can poison them all with NaN."""
    return torch.empty(*shape, dtype=dtype, device=device)


def _upcast(dtype: torch.dtype) -> bool:
    return dtype != torch.float32 and triton_interpret()


def pdl_capable(device: torch.device) -> bool:
    """Programmatic dependent launch: an NVIDIA GPU of compute capability 9.0+ and a Triton that has it."""
    return (device.type == "cuda" and gdc_wait is not None and not is_rocm()
            and torch.cuda.get_device_capability(device)[0] >= 9)


def _launch(pdl: bool) -> dict:
    return dict(PDL=pdl, launch_pdl=True) if pdl else dict(PDL=False)


def per_head_matmul(x: torch.Tensor, w: torch.Tensor, y: torch.Tensor, pdl: bool = False) -> None:
    """``y[b, t, h] = x[b, t, h] @ w[h]`` for x ``[B, T, H, K]``, w ``[H, K, NOUT]``, y ``[B, T, H, NOUT]``."""
    B, T, H, K = x.shape
    NOUT = w.shape[-1]
    M = B * T
    BM = max(16, min(64, triton.next_power_of_2(M)))
    grid = (H, triton.cdiv(NOUT, MATMUL_BLOCK), triton.cdiv(M, BM))
    _per_head_matmul[grid](x, w, y, M, T, H, K, NOUT, *x.stride(), *w.stride(), *y.stride(),
                           BM=BM, BK=MATMUL_BLOCK, BN=MATMUL_BLOCK, UPCAST=_upcast(w.dtype), num_warps=4,
                           **_launch(pdl))


def mla_decode_triton(q_nope: torch.Tensor, q_pe: torch.Tensor, c_kv: torch.Tensor, k_pe: torch.Tensor,
                      w_kv_b: torch.Tensor, pos: torch.Tensor, scale: float, start: Optional[torch.Tensor] = None,
                      config: Optional[TritonConfig] = None) -> torch.Tensor:
    """See ``k3compile.ops.mla_decode.mla_decode``; ``config`` lays out the split kernel (``dispatch.py`` picks it;
    None: ``config.default_config``)."""
    B, T, H, N = q_nope.shape
    S, LK = c_kv.shape[1:]
    R = k_pe.shape[-1]
    VD = w_kv_b.shape[1] - N
    TH = T * H
    dtype = c_kv.dtype
    config = config or default_config(TH)
    pdl = config.pdl and pdl_capable(c_kv.device)
    # Triton launches on the current device: make it the tensors' (TP ranks, a model on cuda:1)
    on_device = torch.cuda.device(c_kv.device) if c_kv.device.type == "cuda" else contextlib.nullcontext()
    with on_device:
        w_k = w_kv_b[:, :N]                                               # [H, N, Lk]
        w_vt = w_kv_b[:, N:].transpose(1, 2)                              # [H, Lk, Vd]
        q_lat = _empty(B, T, H, LK, dtype=dtype, device=c_kv.device)
        per_head_matmul(q_nope, w_k, q_lat, pdl)

        BM = row_block(TH)
        row_blocks = triton.cdiv(TH, BM)
        n_split = split_count(B, row_blocks, S, sm_count(c_kv.device), config)
        o_part = _empty(B, n_split, TH, LK, dtype=torch.float32, device=c_kv.device)
        m_part = _empty(B, n_split, TH, dtype=torch.float32, device=c_kv.device)
        l_part = _empty(B, n_split, TH, dtype=torch.float32, device=c_kv.device)
        has_start = start is not None
        start_arg = start if has_start else pos
        _mla_split[(B, n_split, row_blocks)](
            q_lat, q_pe, c_kv, k_pe, pos, start_arg, o_part, m_part, l_part, T, H, n_split, scale * LOG2E,
            *q_pe.stride(), *c_kv.stride(), *k_pe.stride(),
            LK=LK, R=R, BM=BM, BL=triton.next_power_of_2(LK), BR=max(16, triton.next_power_of_2(R)), BS=config.block_s,
            MIN_TILES=config.min_split_tiles, HAS_START=has_start, UPCAST=_upcast(dtype),
            num_warps=config.num_warps, num_stages=config.num_stages, **_launch(pdl))

        o_lat = _empty(B, T, H, LK, dtype=w_kv_b.dtype, device=c_kv.device)
        _mla_combine[(B * TH, triton.cdiv(LK, COMBINE_CHUNK))](
            o_part, m_part, l_part, pos, start_arg, o_lat, T, TH, n_split,
            LK=LK, BSP=SPLIT_TILE, BLC=min(COMBINE_CHUNK, triton.next_power_of_2(LK)), BS=config.block_s,
            MIN_TILES=config.min_split_tiles, HAS_START=has_start, num_warps=4, **_launch(pdl))

        out = _empty(B, T, H, VD, dtype=q_nope.dtype, device=c_kv.device)
        per_head_matmul(o_lat, w_vt, out, pdl)
    return out
