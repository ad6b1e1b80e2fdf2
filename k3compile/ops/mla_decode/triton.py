"""Triton absorbed-MLA decode: split-KV over the valid prefix of the latent cache, all heads sharing each tile.

Three or four launches, their sizes fixed by shapes alone (CUDA-graph capturable; the valid length is read on the
device):

1. ``_per_head_matmul``: the query absorbed into the latent space, ``q_lat[b, t, h] = q_nope[b, t, h] @ w_k[h]``
   (``[B, T*H, Lk]`` in the cache dtype, as the model rounds it). Each program reads one slice of ``w_k`` once.
2. ``_mla_split``: grid (B, splits, row blocks). A program owns up to 64 query rows ``(t, h)`` of one sequence -- all
   heads of the rank for T x H <= 64 -- and one split of the keys ``[min(start_b, pos), pos + T)`` (its length on the
   device from ``pos`` and ``start``: programs past the valid length exit at once). It walks its split in tiles of
   ``block_s`` keys; each ``c_kv`` / ``k_pe`` tile is loaded once and serves every row twice: the scores
   ``q_lat c_kvᵀ + q_pe k_peᵀ`` and the latent output ``p c_kv``. Online softmax in fp32 (base 2, the scale folded
   in); the split's unnormalised output, running max and sum go to fp32 scratch. ``_mla_split_static`` is the same
   program with its shapes and strides compiled in (``TritonConfig.static_strides``).
3. Either ``_mla_combine`` (one program per block of rows x Lk chunk: the active splits' partials rescaled to their
   common max in one pass, the normalised latent output ``o_lat`` written) and ``_per_head_matmul`` again,
   ``out[b, t, h] = o_lat[b, t, h] @ w_v[h]ᵀ``; or, with ``TritonConfig.fused_readback`` (few query rows: one launch
   and one PDL hand-over fewer), ``_mla_combine_readback``: one program per (query row, ``Vd`` chunk) combines its
   row's partials over the whole ``Lk`` and reads it back through its slice of ``w_v``.

Rows of the cache outside the valid range are never loaded (masked loads), so the step's cost follows the valid
length, not the allocation. On sm_90+ the kernels launch with PDL: each waits for the kernel before it
(``griddepcontrol.wait``) before it reads what that kernel wrote and only then lets the next one start, so a
launch's latency hides under the previous kernel's tail. Before the wait a kernel may only
- prefetch lines into L2 (``prefetch.global.L2``: coherent, it orders nothing and returns nothing): the first kernel
  its ``w_k`` slice, the split kernel the first keys of its split, the read-back its ``w_v`` slice;
- and, in the kernels after the first (``early``), read the op's inputs (``pos``, ``start``, ``w_kv_b``) through L2:
  these were written before the op's first kernel began, and every kernel of ours lets the next one launch only
  after its own wait, so by the time the second starts, the first has passed its wait and every kernel before it
  has completed -- Inductor's kernels that load nothing and never wait included, by (P) in step 1 of
  k3compile/static_weights.py.
Runs on CUDA/ROCm, and on CPU tensors under ``TRITON_INTERPRET=1``.
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

from k3compile.backends import is_rocm, local_memory_budget, sm_count, triton_interpret, triton_pdl_capable

from .config import TritonConfig, default_config, fit_local_memory, row_block, split_count
from .triton_tiles import (  # noqa: F401  (the kernels' device helpers)
    _attend_tile, _combine_step, _dot, _load_rows, _pdl_enter, _prefetch_rows, _split_len, _split_range, _valid_range,
)

LOG2E = 1.4426950408889634
COMBINE_TILE = 32      # (rows x splits) the combine loads per step, each a [BLC] run of latent columns
COMBINE_CHUNK = 64     # latent columns a combine program owns (Lk 512: 8 programs a block of rows)
FUSED_SPLITS = 8       # splits the fused combine + read-back loads per step, each a whole [Lk] row
FUSED_VD = 16          # output columns a fused program reads back ([16, Lk] of w_v in registers)
MATMUL_BLOCK = 64      # the per-head products' K tile and widest N tile


@triton.jit
def _per_head_matmul(x, w, y, M, T, H, K, NOUT,
                     stride_xb, stride_xt, stride_xh, stride_xk,
                     stride_wh, stride_wk, stride_wn,
                     stride_yb, stride_yt, stride_yh, stride_yn,
                     BM: tl.constexpr, BK: tl.constexpr, BN: tl.constexpr, KP: tl.constexpr, UPCAST: tl.constexpr,
                     PDL: tl.constexpr, PREFETCH: tl.constexpr, W_K_CONTIG: tl.constexpr):
    """``y[b, t, h, :] = x[b, t, h, :] @ w[h]`` for rows ``b*T + t`` < M; ``w[h]`` is ``[K, NOUT]`` by its strides.
    Grid (H, NOUT tiles, row tiles): each program reads its ``[K, BN]`` slice of ``w[h]`` once for BM rows, pulled into
    L2 before the PDL wait (``PREFETCH``; ``W_K_CONTIG``: the slice's columns are runs of K elements, else its rows
    are runs of BN; ``KP``: K's power of two)."""
    i_h, i_n, i_m = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    o_n = i_n * BN + tl.arange(0, BN)
    m_n = o_n < NOUT
    p_w = w + i_h * stride_wh
    if PREFETCH:   # a weight slice into L2 while the previous kernel finishes (a prefetch reads nothing back)
        if W_K_CONTIG:
            _prefetch_rows(p_w, tl.minimum(o_n, NOUT - 1), m_n, stride_wn, stride_wk, K, KP)
        else:
            o_pk = tl.arange(0, KP)
            _prefetch_rows(p_w + i_n * BN * stride_wn, tl.minimum(o_pk, K - 1), o_pk < K, stride_wk, stride_wn,
                           tl.minimum(BN, NOUT - i_n * BN), BN)
    _pdl_enter(PDL)
    o_m = i_m * BM + tl.arange(0, BM)
    m_m = o_m < M
    i_b = (o_m // T).to(tl.int64)
    i_t = o_m % T
    p_x = x + i_b * stride_xb + i_t * stride_xt + i_h * stride_xh
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
def _split_program(q_lat, q_pe, c_kv, k_pe, pos, start, o_part, m_part, l_part,
                   T, H, N_SPLIT, min_tiles, qk_scale,
                   stride_pb, stride_pt, stride_ph, stride_pr,
                   stride_cb, stride_cs, stride_cl,
                   stride_kb, stride_ks, stride_kr,
                   LK: tl.constexpr, R: tl.constexpr, BM: tl.constexpr, BL: tl.constexpr, BR: tl.constexpr,
                   BS: tl.constexpr, PREFETCH: tl.constexpr, EARLY: tl.constexpr, HAS_START: tl.constexpr,
                   UPCAST: tl.constexpr, PDL: tl.constexpr, FULL_TILES: tl.constexpr):
    """Split ``i_sp`` of sequence ``i_b``'s valid keys against query rows ``i_m*BM ..`` (row = t*H + h). ``EARLY``:
    the valid range is read, and the split's first ``PREFETCH`` keys pulled into L2, before the PDL wait."""
    i_b, i_sp, i_m = tl.program_id(0).to(tl.int64), tl.program_id(1), tl.program_id(2)
    TH = T * H
    p_c = c_kv + i_b * stride_cb
    p_k = k_pe + i_b * stride_kb
    if EARLY:
        p, end, s0, s1 = _split_range(pos, start, i_b, i_sp, T, N_SPLIT, BS, min_tiles, HAS_START)
        if PREFETCH > 0:   # predicated, not branched: LLVM would duplicate the wait below into both paths
            o_pf = s0 + tl.arange(0, PREFETCH)
            m_pf = o_pf < s1                                         # none in a split past the valid keys
            o_pf = tl.minimum(o_pf, end - 1)
            _prefetch_rows(p_c, o_pf, m_pf, stride_cs, stride_cl, LK, BL)
            _prefetch_rows(p_k, o_pf, m_pf, stride_ks, stride_kr, R, BR)
    _pdl_enter(PDL)
    if not EARLY:
        p, end, s0, s1 = _split_range(pos, start, i_b, i_sp, T, N_SPLIT, BS, min_tiles, HAS_START)
    if s0 < end:
        o_m = i_m * BM + tl.arange(0, BM)
        m_m = o_m < TH
        i_t = o_m // H
        i_h = o_m % H
        o_l = tl.arange(0, BL)
        m_l = o_l < LK
        o_r = tl.arange(0, BR)
        m_r = o_r < R
        last = p + i_t                                                       # the last key query row sees
        if HAS_START:   # and its first: its row's start, or its own position before it (a padding query)
            lo = tl.minimum(tl.load(start + i_b).to(tl.int32), last)
        else:
            lo = last * 0
        b_q = tl.load(q_lat + (i_b * TH + o_m)[:, None] * LK + o_l[None, :], mask=m_m[:, None] & m_l[None, :],
                      other=0)
        p_qpe = q_pe + i_b * stride_pb + (i_t * stride_pt + i_h * stride_ph)[:, None] + o_r[None, :] * stride_pr
        b_qpe = tl.load(p_qpe, mask=m_m[:, None] & m_r[None, :], other=0)
        b_m = tl.full([BM], float("-inf"), tl.float32)
        b_l = tl.zeros([BM], dtype=tl.float32)
        b_acc = tl.zeros([BM, BL], dtype=tl.float32)
        s_tail = s0
        if FULL_TILES:   # the split's whole tiles unmasked, at offsets a thread keeps for every tile
            o_t = tl.arange(0, BS)
            s_tail = s0 + (s1 - s0) // BS * BS
            p_tc = p_c + s0.to(tl.int64) * stride_cs
            p_tk = p_k + s0.to(tl.int64) * stride_ks
            for s in range(s0, s_tail, BS):
                b_kv = _load_rows(p_tc, o_t, stride_cs, o_l, stride_cl, LK, BL)
                b_kp = _load_rows(p_tk, o_t, stride_ks, o_r, stride_kr, R, BR)
                b_m, b_l, b_acc = _attend_tile(b_q, b_qpe, b_kv, b_kp, s + o_t, s1, last, lo, b_m, b_l, b_acc,
                                               qk_scale, UPCAST)
                p_tc += BS * stride_cs
                p_tk += BS * stride_ks
        for s in range(s_tail, s1, BS):   # masked: the whole split, or (FULL_TILES) its partial last tile
            o_s = s + tl.arange(0, BS)
            m_s = o_s < s1
            b_kv = tl.load(p_c + o_s.to(tl.int64)[:, None] * stride_cs + o_l[None, :] * stride_cl,
                           mask=m_s[:, None] & m_l[None, :], other=0)
            b_kp = tl.load(p_k + o_s.to(tl.int64)[:, None] * stride_ks + o_r[None, :] * stride_kr,
                           mask=m_s[:, None] & m_r[None, :], other=0)
            b_m, b_l, b_acc = _attend_tile(b_q, b_qpe, b_kv, b_kp, o_s, s1, last, lo, b_m, b_l, b_acc, qk_scale,
                                           UPCAST)
        o_row = (i_b * N_SPLIT + i_sp) * TH + o_m
        tl.store(o_part + o_row[:, None] * LK + o_l[None, :], b_acc, mask=m_m[:, None] & m_l[None, :])
        tl.store(m_part + o_row, b_m, mask=m_m)
        tl.store(l_part + o_row, b_l, mask=m_m)


@triton.jit
def _mla_split(q_lat, q_pe, c_kv, k_pe, pos, start, o_part, m_part, l_part,
               T, H, N_SPLIT, min_tiles, qk_scale,
               stride_pb, stride_pt, stride_ph, stride_pr,
               stride_cb, stride_cs, stride_cl,
               stride_kb, stride_ks, stride_kr,
               LK: tl.constexpr, R: tl.constexpr, BM: tl.constexpr, BL: tl.constexpr, BR: tl.constexpr,
               BS: tl.constexpr, PREFETCH: tl.constexpr, EARLY: tl.constexpr, HAS_START: tl.constexpr,
               UPCAST: tl.constexpr, PDL: tl.constexpr, FULL_TILES: tl.constexpr):
    """``_split_program`` with shapes and strides as run-time arguments: one build serves every layout."""
    _split_program(q_lat, q_pe, c_kv, k_pe, pos, start, o_part, m_part, l_part, T, H, N_SPLIT, min_tiles, qk_scale,
                   stride_pb, stride_pt, stride_ph, stride_pr, stride_cb, stride_cs, stride_cl,
                   stride_kb, stride_ks, stride_kr, LK, R, BM, BL, BR, BS, PREFETCH, EARLY, HAS_START, UPCAST, PDL,
                   FULL_TILES)


@triton.jit
def _mla_split_static(q_lat, q_pe, c_kv, k_pe, pos, start, o_part, m_part, l_part,
                      T: tl.constexpr, H: tl.constexpr, N_SPLIT: tl.constexpr, min_tiles: tl.constexpr,
                      qk_scale: tl.constexpr,
                      stride_pb: tl.constexpr, stride_pt: tl.constexpr, stride_ph: tl.constexpr,
                      stride_pr: tl.constexpr,
                      stride_cb, stride_cs: tl.constexpr, stride_cl: tl.constexpr,
                      stride_kb, stride_ks: tl.constexpr, stride_kr: tl.constexpr,
                      LK: tl.constexpr, R: tl.constexpr, BM: tl.constexpr, BL: tl.constexpr, BR: tl.constexpr,
                      BS: tl.constexpr, PREFETCH: tl.constexpr, EARLY: tl.constexpr, HAS_START: tl.constexpr,
                      UPCAST: tl.constexpr, PDL: tl.constexpr, FULL_TILES: tl.constexpr):
    """``_split_program`` with every shape and stride but the batch strides (which follow the allocation) compiled
    in: a kernel parameter is a constant-memory load, and in a program that runs a few tiles each first use is a
    miss on its critical path. One build per layout of the cache and the query."""
    _split_program(q_lat, q_pe, c_kv, k_pe, pos, start, o_part, m_part, l_part, T, H, N_SPLIT, min_tiles, qk_scale,
                   stride_pb, stride_pt, stride_ph, stride_pr, stride_cb, stride_cs, stride_cl,
                   stride_kb, stride_ks, stride_kr, LK, R, BM, BL, BR, BS, PREFETCH, EARLY, HAS_START, UPCAST, PDL,
                   FULL_TILES)


@triton.jit
def _mla_combine(o_part, m_part, l_part, pos, start, o_lat, T, TH, ROWS, N_SPLIT, min_tiles,
                 LK: tl.constexpr, BRW: tl.constexpr, BSP: tl.constexpr, BLC: tl.constexpr, BS: tl.constexpr,
                 EARLY: tl.constexpr, HAS_START: tl.constexpr, PDL: tl.constexpr):
    """Rows ``i_r*BRW ..`` (row = b*T*H + t*H + h), latent columns ``i_c*BLC ..``: the active splits' partials
    rescaled to their common max and summed in one pass, ``BSP`` splits of ``BRW`` rows ([BRW, BSP, BLC]) a step."""
    i_r, i_c = tl.program_id(0), tl.program_id(1)
    o_r = i_r * BRW + tl.arange(0, BRW)
    m_r = o_r < ROWS
    i_b = o_r // TH
    if EARLY:
        p, first, end, n = _valid_range(pos, start, i_b, m_r, T, HAS_START)
    _pdl_enter(PDL)
    if not EARLY:
        p, first, end, n = _valid_range(pos, start, i_b, m_r, T, HAS_START)
    n_act = tl.where(m_r, tl.cdiv(n, _split_len(n, N_SPLIT, BS, min_tiles)), 0)      # [BRW]
    o_c = i_c * BLC + tl.arange(0, BLC)
    m_c = o_c < LK
    p_row = i_b.to(tl.int64) * N_SPLIT * TH + o_r % TH                                 # [BRW]: split 0's row
    b_max = tl.full([BRW], float("-inf"), tl.float32)
    b_den = tl.zeros([BRW], dtype=tl.float32)
    b_acc = tl.zeros([BRW, BLC], dtype=tl.float32)
    for sp0 in tl.range(0, tl.max(n_act, 0), BSP, num_stages=3):
        o_sp = sp0 + tl.arange(0, BSP)
        m_sp = o_sp[None, :] < n_act[:, None]                                          # [BRW, BSP]
        p_ml = p_row[:, None] + o_sp[None, :] * TH
        b_m = tl.load(m_part + p_ml, mask=m_sp, other=float("-inf"))
        b_l = tl.load(l_part + p_ml, mask=m_sp, other=0)
        b_o = tl.load(o_part + p_ml[:, :, None] * LK + o_c[None, None, :], mask=m_sp[:, :, None] & m_c[None, None, :],
                      other=0)
        b_max, b_den, b_acc = _combine_step(b_max, b_den, b_acc, b_m, b_l, b_o, 1)
    b_out = b_acc / tl.where(b_den > 0, b_den, 1.0)[:, None]
    tl.store(o_lat + o_r.to(tl.int64)[:, None] * LK + o_c[None, :], b_out.to(o_lat.dtype.element_ty),
             mask=m_r[:, None] & m_c[None, :])


@triton.jit
def _mla_combine_readback(o_part, m_part, l_part, pos, start, w_v, out, T, H, N_SPLIT, min_tiles, VD,
                          stride_wh, stride_wv, stride_wl, stride_ob, stride_ot, stride_oh, stride_ov,
                          LK: tl.constexpr, BL: tl.constexpr, BN: tl.constexpr, BSP: tl.constexpr, BS: tl.constexpr,
                          EARLY: tl.constexpr, HAS_START: tl.constexpr, PDL: tl.constexpr):
    """Query row ``i_r`` = b*T*H + t*H + h, output columns ``i_n*BN ..``: the row's active splits combined into its
    latent output over the whole ``Lk`` (``BSP`` splits a step), rounded to the weight's dtype as the model rounds
    ``o_lat``, and read back through ``w_v[h]``'s [BN, Lk] slice (loaded before the PDL wait with ``EARLY``)."""
    i_r, i_n = tl.program_id(0).to(tl.int64), tl.program_id(1)
    TH = T * H
    i_b = i_r // TH
    i_th = i_r % TH
    i_t = i_th // H
    i_h = i_th % H
    o_n = i_n * BN + tl.arange(0, BN)
    m_n = o_n < VD
    o_l = tl.arange(0, BL)
    m_l = o_l < LK
    p_w = w_v + i_h * stride_wh + o_n[:, None] * stride_wv + o_l[None, :] * stride_wl
    if EARLY:
        p, first, end, n = _valid_range(pos, start, i_b, i_b >= 0, T, HAS_START)
        b_w = tl.load(p_w, mask=m_n[:, None] & m_l[None, :], other=0, cache_modifier=".cg")
    _pdl_enter(PDL)
    if not EARLY:
        p, first, end, n = _valid_range(pos, start, i_b, i_b >= 0, T, HAS_START)
        b_w = tl.load(p_w, mask=m_n[:, None] & m_l[None, :], other=0)
    n_act = tl.cdiv(n, _split_len(n, N_SPLIT, BS, min_tiles))
    p_row = (i_b * N_SPLIT) * TH + i_th
    b_max = tl.max(tl.full([BSP], float("-inf"), tl.float32), 0)
    b_den = tl.sum(tl.zeros([BSP], dtype=tl.float32), 0)
    b_acc = tl.zeros([BL], dtype=tl.float32)
    for sp0 in tl.range(0, n_act, BSP, num_stages=3):
        o_sp = sp0 + tl.arange(0, BSP)
        m_sp = o_sp < n_act
        p_ml = p_row + o_sp * TH
        b_m = tl.load(m_part + p_ml, mask=m_sp, other=float("-inf"))
        b_l = tl.load(l_part + p_ml, mask=m_sp, other=0)
        b_o = tl.load(o_part + p_ml[:, None] * LK + o_l[None, :], mask=m_sp[:, None] & m_l[None, :], other=0)
        b_max, b_den, b_acc = _combine_step(b_max, b_den, b_acc, b_m, b_l, b_o, 0)
    b_lat = (b_acc / tl.where(b_den > 0, b_den, 1.0)).to(w_v.dtype.element_ty).to(tl.float32)
    b_out = tl.sum(b_w.to(tl.float32) * b_lat[None, :], 1)                          # [BN]
    tl.store(out + i_b * stride_ob + i_t * stride_ot + i_h * stride_oh + o_n * stride_ov,
             b_out.to(out.dtype.element_ty), mask=m_n)


def _empty(*shape: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Every buffer the kernels write (scratch and output) comes from here, so a test can poison them all with NaN."""
    return torch.empty(*shape, dtype=dtype, device=device)


def _rows_contiguous(c_kv: torch.Tensor, k_pe: torch.Tensor) -> bool:
    return c_kv.stride(-1) == 1 and k_pe.stride(-1) == 1


def _upcast(dtype: torch.dtype) -> bool:
    return dtype != torch.float32 and triton_interpret()


pdl_capable = triton_pdl_capable   # read through this module: tests simulate a GPU by replacing it


def _launch(pdl: bool) -> dict:
    return dict(PDL=pdl, launch_pdl=True) if pdl else dict(PDL=False)


def per_head_matmul(x: torch.Tensor, w: torch.Tensor, y: torch.Tensor, pdl: bool = False, sms: int = 0) -> None:
    """``y[b, t, h] = x[b, t, h] @ w[h]`` for x ``[B, T, H, K]``, w ``[H, K, NOUT]``, y ``[B, T, H, NOUT]``. Output
    tiles narrow from 64 to 16 columns until the grid covers ``sms`` (each program then streams less of w: the
    product is bound by the weight read at few rows). Under PDL each program pulls its w slice into L2 before its
    wait where one of w's last two dimensions is contiguous."""
    B, T, H, K = x.shape
    NOUT = w.shape[-1]
    M = B * T
    BM = max(16, min(64, triton.next_power_of_2(M)))
    BN = MATMUL_BLOCK
    while BN > 16 and H * triton.cdiv(NOUT, BN) * triton.cdiv(M, BM) < sms:
        BN //= 2
    grid = (H, triton.cdiv(NOUT, BN), triton.cdiv(M, BM))
    prefetch = pdl and (w.stride(1) == 1 or w.stride(2) == 1)
    _per_head_matmul[grid](x, w, y, M, T, H, K, NOUT, *x.stride(), *w.stride(), *y.stride(),
                           BM=BM, BK=MATMUL_BLOCK, BN=BN, KP=triton.next_power_of_2(K), UPCAST=_upcast(w.dtype),
                           PREFETCH=prefetch, W_K_CONTIG=w.stride(1) == 1, num_warps=4, **_launch(pdl))


def mla_decode_triton(q_nope: torch.Tensor, q_pe: torch.Tensor, c_kv: torch.Tensor, k_pe: torch.Tensor,
                      w_kv_b: torch.Tensor, pos: torch.Tensor, scale: float, start: Optional[torch.Tensor] = None,
                      config: Optional[TritonConfig] = None) -> torch.Tensor:
    """See ``k3compile.ops.mla_decode.mla_decode``; ``config`` lays out the kernels (``dispatch.py`` picks it;
    None: ``config.default_config``)."""
    B, T, H, N = q_nope.shape
    S, LK = c_kv.shape[1:]
    R = k_pe.shape[-1]
    VD = w_kv_b.shape[1] - N
    TH = T * H
    dtype = c_kv.dtype
    config = fit_local_memory(config or default_config(TH, B), TH, LK, R, c_kv.element_size(),
                              local_memory_budget(c_kv.device))
    pdl = config.pdl and pdl_capable(c_kv.device)
    early = pdl   # the op's inputs read before the later kernels' waits (module docstring)
    sms = sm_count(c_kv.device)
    # Triton launches on the current device: make it the tensors' (TP ranks, a model on cuda:1)
    on_device = torch.cuda.device(c_kv.device) if c_kv.device.type == "cuda" else contextlib.nullcontext()
    with on_device:
        w_k = w_kv_b[:, :N]                                               # [H, N, Lk]
        w_v = w_kv_b[:, N:]                                               # [H, Vd, Lk]
        q_lat = _empty(B, T, H, LK, dtype=dtype, device=c_kv.device)
        per_head_matmul(q_nope, w_k, q_lat, pdl, sms)

        BM = row_block(TH)
        row_blocks = triton.cdiv(TH, BM)
        n_split = split_count(B, row_blocks, S, sms, config)
        o_part = _empty(B, n_split, TH, LK, dtype=torch.float32, device=c_kv.device)
        m_part = _empty(B, n_split, TH, dtype=torch.float32, device=c_kv.device)
        l_part = _empty(B, n_split, TH, dtype=torch.float32, device=c_kv.device)
        has_start = start is not None
        start_arg = start if has_start else pos
        BL = triton.next_power_of_2(LK)
        shared = dict(BS=config.block_s, EARLY=early, HAS_START=has_start)
        regs = dict(maxnreg=config.maxnreg) if config.maxnreg and c_kv.device.type == "cuda" and not is_rocm() else {}
        # the compiled-in shapes only where the cache rows are contiguous (K3's layout): any other layout runs the
        # general kernel rather than a build per stride
        split = _mla_split_static if config.static_strides and _rows_contiguous(c_kv, k_pe) else _mla_split
        split[(B, n_split, row_blocks)](
            q_lat, q_pe, c_kv, k_pe, pos, start_arg, o_part, m_part, l_part, T, H, n_split, config.min_split_tiles,
            scale * LOG2E, *q_pe.stride(), *c_kv.stride(), *k_pe.stride(),
            LK=LK, R=R, BM=BM, BL=BL, BR=max(16, triton.next_power_of_2(R)),
            PREFETCH=config.prefetch_tiles * config.block_s if early else 0, UPCAST=_upcast(dtype),
            FULL_TILES=config.full_tiles, num_warps=config.num_warps, num_stages=config.num_stages, **regs, **shared,
            **_launch(pdl))

        out = _empty(B, T, H, VD, dtype=q_nope.dtype, device=c_kv.device)
        if config.fused_readback:
            _mla_combine_readback[(B * TH, triton.cdiv(VD, FUSED_VD))](
                o_part, m_part, l_part, pos, start_arg, w_v, out, T, H, n_split, config.min_split_tiles, VD,
                *w_v.stride(), *out.stride(), LK=LK, BL=BL, BN=FUSED_VD, BSP=FUSED_SPLITS, num_warps=4,
                num_stages=2, **shared, **_launch(pdl))
            return out
        o_lat = _empty(B, T, H, LK, dtype=w_kv_b.dtype, device=c_kv.device)
        BSP = min(COMBINE_TILE, triton.next_power_of_2(n_split))
        BRW = min(COMBINE_TILE // BSP, triton.next_power_of_2(B * TH))
        _mla_combine[(triton.cdiv(B * TH, BRW), triton.cdiv(LK, COMBINE_CHUNK))](
            o_part, m_part, l_part, pos, start_arg, o_lat, T, TH, B * TH, n_split, config.min_split_tiles,
            LK=LK, BRW=BRW, BSP=BSP, BLC=min(COMBINE_CHUNK, BL), num_warps=4, num_stages=3, **shared,
            **_launch(pdl))
        per_head_matmul(o_lat, w_v.transpose(1, 2), out, pdl, sms)
    return out
