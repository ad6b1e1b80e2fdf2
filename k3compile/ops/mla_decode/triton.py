"""Triton absorbed-MLA decode: split-KV over the valid prefix of the latent cache, all heads sharing each tile.

One to four launches (``TritonConfig.form``), their sizes fixed by shapes alone (CUDA-graph capturable; the valid
length is read on the device). The chain (``form="chain"``, three or four launches):

1. ``_per_head_matmul``: the query absorbed into the latent space, ``q_lat[b, t, h] = q_nope[b, t, h] @ w_k[h]``
   (``[B, T*H, Lk]`` in the cache dtype, as the model rounds it). Each program reads one slice of ``w_k`` once.
2. ``_mla_split``: grid (B, splits, row blocks). A program owns up to 64 query rows ``(t, h)`` of one sequence -- all
   heads of the rank for T x H <= 64 -- and one split of the keys ``[min(start_b, pos), pos + T)`` (its length on the
   device from ``pos`` and ``start``: programs past the valid length exit at once). It walks its split in tiles of
   ``block_s`` keys; each ``c_kv`` / ``k_pe`` tile is loaded once and serves every row twice: the scores
   ``q_lat c_kvᵀ + q_pe k_peᵀ`` and the latent output ``p c_kv``. Online softmax in fp32 (base 2, the scale folded
   in); the split's unnormalised output, running max and sum go to fp32 scratch.
3. Either ``_mla_combine`` (one program per block of rows x Lk chunk: the active splits' partials rescaled to their
   common max in one pass, the normalised latent output ``o_lat`` written) and ``_per_head_matmul`` again,
   ``out[b, t, h] = o_lat[b, t, h] @ w_v[h]ᵀ``; or, with ``TritonConfig.fused_readback`` (few query rows: one launch
   and one PDL hand-over fewer), ``_mla_combine_readback``: one program per (query row, ``Vd`` chunk) combines its
   row's partials over the whole ``Lk`` and reads it back through its slice of ``w_v``.

The other forms (T x H <= ``FORM_ROWS``) take kernel boundaries off the step's critical path with arrival counters
(``k3compile/ops/arrival_counters.py``: zero between launches, every launch leaves them zero), never by waiting on
another program: each split program writes its partial, then counts itself in (``atomic_add``, acq_rel, GPU scope,
after a barrier); the last of a sequence's active splits to arrive combines the partials (``_reduce_on_arrival``:
in groups of about sqrt(splits) where one group's partials would pass ``config.COMBINE_BYTES``, the last of each
group combining it, the last group the groups') and sets the counter back to zero.
- ``last`` (three launches): the absorption, ``_mla_split`` with ``LAST`` (its last program writes ``o_lat``), the
  read-back.
- ``one`` (one launch): ``_mla_one``, grid (B, splits, head groups). A program holds the rows of ``group_heads``
  heads: it absorbs their queries itself (their ``w_k`` slices, pulled into L2 before the PDL wait), streams its
  split, and the last to arrive combines and reads the rows back through their heads' ``w_v``. Every head group
  reads the cache tiles (from L2 after the first): cheap at short lengths, not at long ones.
- ``hybrid`` (three launches, one at work on a short step): ``_mla_one`` does the whole step where the valid keys end
  at or before ``short_keys``; past that its programs of split 0 only absorb their rows into ``q_lat``, and the
  ``last`` form's split and read-back kernels (``SKIP``: they exit at once on a short step, after their PDL wait)
  do the rest.

Rows of the cache outside the valid range are never loaded (masked loads), so the step's cost follows the valid
length, not the allocation. On sm_90+ the kernels launch with PDL: each waits for the kernel before it
(``griddepcontrol.wait``) before it reads what that kernel wrote and only then lets the next one start, so a
launch's latency hides under the previous kernel's tail. Before the wait a kernel may only
- prefetch lines into L2 (``prefetch.global.L2``: coherent, it orders nothing and returns nothing): the first kernel
  its ``w_k`` slice (``_mla_one``: its share of its heads' ``w_kv_b`` rows), the split kernel the first keys of its
  split, the read-back its ``w_v`` slice;
- and, in the kernels after the first (``early``), read the op's inputs (``pos``, ``start``, ``w_kv_b``) through L2:
  these were written before the op's first kernel began, and every kernel of ours lets the next one launch only
  after its own wait, so by the time the second starts, every kernel before the first has completed -- provided
  every PDL kernel before ours also waits before it triggers, as k3compile/static_weights.py assumes: not while
  Inductor's own PDL codegen is on (``early_reads_safe``).
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

from k3compile.backends import is_rocm, local_memory_budget, sm_count, triton_interpret
from k3compile.ops.arrival_counters import arrival_counters

from .config import TritonConfig, arrival_group, default_config, fit_local_memory, row_block, split_count
from .triton_tiles import (  # noqa: F401  (the kernels' device helpers)
    _absorb_heads, _combine_into, _combine_step, _dot, _pdl_enter, _prefetch_rows, _readback_rows, _reduce_on_arrival,
    _split_len, _split_range, _store_partial, _stream, _valid_range,
)

LOG2E = 1.4426950408889634
COMBINE_TILE = 32      # (rows x splits) the combine loads per step, each a [BLC] run of latent columns
COMBINE_CHUNK = 64     # latent columns a combine program owns (Lk 512: 8 programs a block of rows)
FUSED_SPLITS = 8       # splits the fused combine + read-back loads per step, each a whole [Lk] row
FUSED_VD = 16          # output columns a fused program reads back ([16, Lk] of w_v in registers)
MATMUL_BLOCK = 64      # the per-head products' K tile and widest N tile
ABSORB_BLOCK = 32      # of N, a step of the one-launch kernel's absorption ([32, Lk] of w_k)
LAST_CHUNK = 128       # latent columns the last program combines (and reads back) a step: [rows, 128] fp32 a slot
LAST_SLOTS = 16        # partial slots the last program weighs a step (their maxima and sums)
# Query rows (T x H) up to which the forms other than the chain run: one block of 16 rows a program. At 64 rows
# (T 4 at 12 heads) the last-arrival combine and the one-launch kernel spill on sm_90a (ptxas, K3's widths).
FORM_ROWS = 16


@triton.jit
def _per_head_matmul(x, w, y, pos, M, T, H, K, NOUT, short_keys,
                     stride_xb, stride_xt, stride_xh, stride_xk,
                     stride_wh, stride_wk, stride_wn,
                     stride_yb, stride_yt, stride_yh, stride_yn,
                     BM: tl.constexpr, BK: tl.constexpr, BN: tl.constexpr, KP: tl.constexpr, UPCAST: tl.constexpr,
                     PDL: tl.constexpr, PREFETCH: tl.constexpr, W_K_CONTIG: tl.constexpr, SKIP: tl.constexpr = False,
                     EARLY: tl.constexpr = False):
    """``y[b, t, h, :] = x[b, t, h, :] @ w[h]`` for rows ``b*T + t`` < M; ``w[h]`` is ``[K, NOUT]`` by its strides.
    Grid (H, NOUT tiles, row tiles): each program reads its ``[K, BN]`` slice of ``w[h]`` once for BM rows, pulled into
    L2 before the PDL wait (``PREFETCH``; ``W_K_CONTIG``: the slice's columns are runs of K elements, else its rows
    are runs of BN; ``KP``: K's power of two). ``SKIP``: nothing to do where the step's keys end (``pos + T``) at or
    before ``short_keys`` (read before the wait with ``EARLY``)."""
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
    if SKIP and EARLY:
        go = tl.load(pos, cache_modifier=".cg").to(tl.int32) + T > short_keys
    _pdl_enter(PDL)
    if SKIP:
        if not EARLY:
            go = tl.load(pos, cache_modifier=".cg").to(tl.int32) + T > short_keys
        if go:
            _per_head_tile(x, p_w, y, i_h, i_m, o_n, m_n, M, T, K, stride_xb, stride_xt, stride_xh, stride_xk,
                           stride_wk, stride_wn, stride_yb, stride_yt, stride_yh, stride_yn, BM, BK, BN, UPCAST)
    else:
        _per_head_tile(x, p_w, y, i_h, i_m, o_n, m_n, M, T, K, stride_xb, stride_xt, stride_xh, stride_xk,
                       stride_wk, stride_wn, stride_yb, stride_yt, stride_yh, stride_yn, BM, BK, BN, UPCAST)


@triton.jit
def _per_head_tile(x, p_w, y, i_h, i_m, o_n, m_n, M, T, K, stride_xb, stride_xt, stride_xh, stride_xk,
                   stride_wk, stride_wn, stride_yb, stride_yt, stride_yh, stride_yn,
                   BM: tl.constexpr, BK: tl.constexpr, BN: tl.constexpr, UPCAST: tl.constexpr):
    """Row tile ``i_m`` of head ``i_h`` of ``_per_head_matmul`` (output columns ``o_n``; ``p_w``: ``w[h]``)."""
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
def _mla_split(q_lat, q_pe, c_kv, k_pe, pos, start, o_part, m_part, l_part, counters, o_lat,
               T, H, N_SPLIT, min_tiles, qk_scale, G, short_keys,
               stride_pb, stride_pt, stride_ph, stride_pr,
               stride_cb, stride_cs, stride_cl,
               stride_kb, stride_ks, stride_kr,
               LK: tl.constexpr, R: tl.constexpr, BM: tl.constexpr, BL: tl.constexpr, BR: tl.constexpr,
               BS: tl.constexpr, PREFETCH: tl.constexpr, EARLY: tl.constexpr, HAS_START: tl.constexpr,
               UPCAST: tl.constexpr, PDL: tl.constexpr, LAST: tl.constexpr = False, SKIP: tl.constexpr = False,
               BLC: tl.constexpr = 128, BSP: tl.constexpr = 16, STAGES_C: tl.constexpr = 2):
    """Split ``i_sp`` of sequence ``i_b``'s valid keys against query rows ``i_m*BM ..`` (row = t*H + h). ``EARLY``:
    the valid range is read, and the split's first ``PREFETCH`` keys pulled into L2, before the PDL wait. ``LAST``:
    the last split of the (sequence, row block) to arrive combines the partials (``_reduce_on_arrival``, counters
    ``counters[(i_b * row blocks + i_m) * (1 + cdiv(N_SPLIT, G))..]``) and writes the rows' latent output to
    ``o_lat`` (w_kv_b's dtype). ``SKIP``: nothing to do where the valid keys end at or before ``short_keys`` (the
    one-launch kernel did it all)."""
    i_b, i_sp, i_m = tl.program_id(0).to(tl.int64), tl.program_id(1), tl.program_id(2)
    TH = T * H
    p_c = c_kv + i_b * stride_cb
    p_k = k_pe + i_b * stride_kb
    if EARLY:
        p, end, s0, s1, n_act = _split_range(pos, start, i_b, i_sp, T, N_SPLIT, BS, min_tiles, HAS_START)
        if PREFETCH > 0:   # predicated, not branched: LLVM would duplicate the wait below into both paths
            o_pf = s0 + tl.arange(0, PREFETCH)
            m_pf = o_pf < s1                                         # none in a split past the valid keys
            if SKIP:
                m_pf = m_pf & (end > short_keys)
            o_pf = tl.minimum(o_pf, end - 1)
            _prefetch_rows(p_c, o_pf, m_pf, stride_cs, stride_cl, LK, BL)
            _prefetch_rows(p_k, o_pf, m_pf, stride_ks, stride_kr, R, BR)
    _pdl_enter(PDL)
    if not EARLY:
        p, end, s0, s1, n_act = _split_range(pos, start, i_b, i_sp, T, N_SPLIT, BS, min_tiles, HAS_START)
    go = s0 < end
    if SKIP:
        go = go & (end > short_keys)
    if go:
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
        b_m, b_l, b_acc = _stream(b_q, b_qpe, p_c, p_k, s0, s1, last, lo, qk_scale, stride_cs, stride_cl,
                                  stride_ks, stride_kr, LK, R, BM, BL, BR, BS, UPCAST)
        if LAST:   # a sequence's scratch: its splits' slots, then one a group of them (_reduce_on_arrival)
            n_slots = N_SPLIT + tl.cdiv(N_SPLIT, G)
        else:
            n_slots = N_SPLIT
        p_row = i_b * n_slots * TH + o_m                                     # slot 0's scratch rows
        _store_partial(o_part, m_part, l_part, p_row + i_sp * TH, m_m, b_m, b_l, b_acc, LK, BL)
        if LAST:
            p_cnt = counters + (i_b * tl.num_programs(2) + i_m) * (1 + tl.cdiv(N_SPLIT, G))
            done, first, count, b_max, b_den = _reduce_on_arrival(
                o_part, m_part, l_part, p_cnt, p_row, m_m, i_sp, n_act, N_SPLIT, G, TH, LK, BM, BLC, BSP, STAGES_C)
            if done > 0:
                _combine_into(o_lat, (i_b * TH + o_m) * LK, o_part, m_part, p_row, m_m, first, count, b_max,
                              1.0 / tl.where(b_den > 0, b_den, 1.0), TH, LK, BM, BLC, STAGES_C)


@triton.jit
def _mla_one(q_nope, q_pe, c_kv, k_pe, w_kv_b, pos, start, q_lat, o_part, m_part, l_part, counters, o_lat, out,
             T, H, N, VD, N_SPLIT, min_tiles, qk_scale, G, short_keys,
             stride_qb, stride_qt, stride_qh, stride_qn,
             stride_pb, stride_pt, stride_ph, stride_pr,
             stride_cb, stride_cs, stride_cl,
             stride_kb, stride_ks, stride_kr,
             stride_wh, stride_wr, stride_wl,
             stride_ob, stride_ot, stride_oh, stride_ov,
             LK: tl.constexpr, R: tl.constexpr, HG: tl.constexpr, BM: tl.constexpr, BL: tl.constexpr,
             BR: tl.constexpr, BS: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BLC: tl.constexpr,
             BSP: tl.constexpr, PREFETCH: tl.constexpr, PREFETCH_W: tl.constexpr, HAS_START: tl.constexpr,
             UPCAST: tl.constexpr, PDL: tl.constexpr, HYBRID: tl.constexpr, STAGES_C: tl.constexpr,
             STAGES_R: tl.constexpr):
    """The whole step in one launch for heads ``i_g*HG ..`` of sequence ``i_b`` (rows t*HG + hh, at most BM), split
    ``i_sp`` of its valid keys: the program absorbs its rows' queries itself (``HG`` slices of w_k, from L2), streams
    its split, writes its partial, and the last split of (sequence, head group) to arrive combines them and reads
    the output back through its heads' w_v (``_reduce_on_arrival``; counters ``counters[(i_b * groups + i_g) *
    (1 + cdiv(N_SPLIT, G))..]``). The cache tiles are read by every head group (from L2 after the first).
    ``HYBRID``: only where the valid keys end at or before ``short_keys``; past it the programs of split 0 absorb
    their rows into ``q_lat`` and the split, combine and read-back kernels that follow do the rest. Before the PDL
    wait (``PREFETCH_W``): the program's share of its heads' w_kv_b rows into L2, nothing else (the first kernel of
    the op); after it, the split's first ``PREFETCH`` keys into L2 while the program absorbs."""
    i_b, i_sp, i_g = tl.program_id(0).to(tl.int64), tl.program_id(1), tl.program_id(2)
    TH = T * H
    h0 = i_g * HG
    if PREFETCH_W > 0:   # the group's [HG, N + VD] rows of w_kv_b, shared out over the group's B x N_SPLIT programs
        o_w = i_b * N_SPLIT + i_sp + tl.num_programs(0) * N_SPLIT * tl.arange(0, PREFETCH_W)
        m_w = (o_w < HG * (N + VD)) & (h0 + o_w // (N + VD) < H)
        o_w = tl.minimum(o_w, HG * (N + VD) - 1)
        _prefetch_rows(w_kv_b, (h0 + o_w // (N + VD)) * stride_wh + (o_w % (N + VD)) * stride_wr, m_w, 1,
                       stride_wl, LK, BL)
    _pdl_enter(PDL)
    p, end, s0, s1, n_act = _split_range(pos, start, i_b, i_sp, T, N_SPLIT, BS, min_tiles, HAS_START)
    o_r = tl.arange(0, BM)
    i_t = o_r // HG
    hh_r = o_r % HG
    i_h = h0 + hh_r
    m_m = (i_t < T) & (i_h < H)
    o_m = i_t * H + i_h                                                      # rows of the [B, T, H] layout
    p_qn = i_b * stride_qb + i_t * stride_qt + i_h * stride_qh
    run = s0 < end                      # this program's split holds valid keys, and the step is its to do
    if HYBRID:
        run = run & (end <= short_keys)
        work = run | (i_sp == 0)        # past short_keys the programs of split 0 absorb their rows for the split kernel
    else:
        work = run
    if work:
        if PREFETCH > 0:   # the split's first keys into L2 while the query is absorbed
            o_pf = s0 + tl.arange(0, PREFETCH)
            m_pf = (o_pf < s1) & run
            o_pf = tl.minimum(o_pf, end - 1)
            _prefetch_rows(c_kv + i_b * stride_cb, o_pf, m_pf, stride_cs, stride_cl, LK, BL)
            _prefetch_rows(k_pe + i_b * stride_kb, o_pf, m_pf, stride_ks, stride_kr, R, BR)
        b_q = _absorb_heads(q_nope, w_kv_b, p_qn, hh_r, m_m, h0, H, N, stride_qn, stride_wh, stride_wr, stride_wl,
                            LK, HG, BM, BL, BK, UPCAST).to(c_kv.dtype.element_ty)   # rounded as the model rounds
        if HYBRID:
            if end > short_keys:
                o_l = tl.arange(0, BL)
                tl.store(q_lat + (i_b * TH + o_m)[:, None] * LK + o_l[None, :], b_q,
                         mask=m_m[:, None] & (o_l < LK)[None, :])
        if run:
            o_pr = tl.arange(0, BR)
            p_qpe = q_pe + i_b * stride_pb + (i_t * stride_pt + i_h * stride_ph)[:, None] + o_pr[None, :] * stride_pr
            b_qpe = tl.load(p_qpe, mask=m_m[:, None] & (o_pr < R)[None, :], other=0)
            last = p + i_t
            if HAS_START:
                lo = tl.minimum(tl.load(start + i_b).to(tl.int32), last)
            else:
                lo = last * 0
            b_m, b_l, b_acc = _stream(b_q, b_qpe, c_kv + i_b * stride_cb, k_pe + i_b * stride_kb, s0, s1, last, lo,
                                      qk_scale, stride_cs, stride_cl, stride_ks, stride_kr, LK, R, BM, BL, BR, BS,
                                      UPCAST)
            p_row = i_b * (N_SPLIT + tl.cdiv(N_SPLIT, G)) * TH + o_m             # the splits' slots, then the groups'
            _store_partial(o_part, m_part, l_part, p_row + i_sp * TH, m_m, b_m, b_l, b_acc, LK, BL)
            p_cnt = counters + (i_b * tl.num_programs(2) + i_g) * (1 + tl.cdiv(N_SPLIT, G))
            done, first, count, b_max, b_den = _reduce_on_arrival(
                o_part, m_part, l_part, p_cnt, p_row, m_m, i_sp, n_act, N_SPLIT, G, TH, LK, BM, BLC, BSP, STAGES_C)
            if done > 0:   # the rows' latent output to o_lat, then read back through their heads' w_v
                p_lat = (i_b * TH + o_m) * LK
                _combine_into(o_lat, p_lat, o_part, m_part, p_row, m_m, first, count, b_max,
                              1.0 / tl.where(b_den > 0, b_den, 1.0), TH, LK, BM, BLC, STAGES_C)
                tl.debug_barrier()   # every thread's o_lat stores before any thread reads them back
                _readback_rows(o_lat, p_lat, w_kv_b + N * stride_wr, out,
                               i_b * stride_ob + i_t * stride_ot + i_h * stride_oh, hh_r, m_m, h0, H, VD, stride_wh,
                               stride_wr, stride_wl, stride_ov, LK, HG, BM, BLC, BV, UPCAST, STAGES_R)


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


def _upcast(dtype: torch.dtype) -> bool:
    return dtype != torch.float32 and triton_interpret()


def pdl_capable(device: torch.device) -> bool:
    """Programmatic dependent launch: an NVIDIA GPU of compute capability 9.0+ and a Triton that has it."""
    return (device.type == "cuda" and gdc_wait is not None and not is_rocm()
            and torch.cuda.get_device_capability(device)[0] >= 9)


def early_reads_safe() -> bool:
    """Whether the kernels after the first may read the op's inputs before their PDL wait: every PDL kernel in the
    stream must let the next launch only after its own wait. Inductor's own PDL codegen breaks that (a kernel that
    loads nothing may trigger without waiting; k3compile/static_weights.py), so not while it is on."""
    try:
        from torch._inductor import config as inductor_config
    except ImportError:  # pragma: no cover
        return True
    return not getattr(inductor_config.triton, "enable_pdl", False)


def _launch(pdl: bool) -> dict:
    return dict(PDL=pdl, launch_pdl=True) if pdl else dict(PDL=False)


def per_head_matmul(x: torch.Tensor, w: torch.Tensor, y: torch.Tensor, pdl: bool = False, sms: int = 0,
                    skip: Optional[tuple] = None, early: bool = False) -> None:
    """``y[b, t, h] = x[b, t, h] @ w[h]`` for x ``[B, T, H, K]``, w ``[H, K, NOUT]``, y ``[B, T, H, NOUT]``. Output
    tiles narrow from 64 to 16 columns until the grid covers ``sms`` (each program then streams less of w: the
    product is bound by the weight read at few rows). Under PDL each program pulls its w slice into L2 before its
    wait where one of w's last two dimensions is contiguous. ``skip`` = (pos, short_keys): nothing is computed where
    ``pos + T <= short_keys`` (pos read before the wait with ``early``)."""
    B, T, H, K = x.shape
    NOUT = w.shape[-1]
    M = B * T
    BM = max(16, min(64, triton.next_power_of_2(M)))
    BN = MATMUL_BLOCK
    while BN > 16 and H * triton.cdiv(NOUT, BN) * triton.cdiv(M, BM) < sms:
        BN //= 2
    grid = (H, triton.cdiv(NOUT, BN), triton.cdiv(M, BM))
    prefetch = pdl and (w.stride(1) == 1 or w.stride(2) == 1)
    pos, short_keys = skip if skip is not None else (y, 0)
    _per_head_matmul[grid](x, w, y, pos, M, T, H, K, NOUT, short_keys, *x.stride(), *w.stride(), *y.stride(),
                           BM=BM, BK=MATMUL_BLOCK, BN=BN, KP=triton.next_power_of_2(K), UPCAST=_upcast(w.dtype),
                           PREFETCH=prefetch, W_K_CONTIG=w.stride(1) == 1, SKIP=skip is not None, EARLY=early,
                           num_warps=4, **_launch(pdl))


def _partials(B: int, n_split: int, TH: int, LK: int, device: torch.device) -> tuple:
    """fp32 scratch of ``n_split`` slots: (outputs [B, n_split, TH, Lk], maxima and sums [B, n_split, TH])."""
    return (_empty(B, n_split, TH, LK, dtype=torch.float32, device=device),
            _empty(B, n_split, TH, dtype=torch.float32, device=device),
            _empty(B, n_split, TH, dtype=torch.float32, device=device))


def _counters(device: torch.device, n: int) -> torch.Tensor:
    """``n`` int32 arrival counters, zero, each launch leaving them zero (``arrival_counters``); on a first call
    inside a CUDA-graph capture, zeros of the graph's own (zeroed again at every replay)."""
    counters = arrival_counters(device, n)
    return counters if counters is not None else torch.zeros(n, dtype=torch.int32, device=device)


def _stages(step_bytes: int, device: torch.device) -> int:
    """Pipeline depth of the last program's loops (the combine: a [rows, LAST_CHUNK] fp32 tile of a partial a step;
    the read-back: o_lat's [rows, LAST_CHUNK] and w_v's [LAST_CHUNK, Vd] a step), in shared memory the stream no
    longer uses: as many steps as a third of it holds, up to 6 (each step one L2 round trip)."""
    return max(1, min(6, local_memory_budget(device) // 3 // step_bytes)) if step_bytes else 1


def mla_decode_triton(q_nope: torch.Tensor, q_pe: torch.Tensor, c_kv: torch.Tensor, k_pe: torch.Tensor,
                      w_kv_b: torch.Tensor, pos: torch.Tensor, scale: float, start: Optional[torch.Tensor] = None,
                      config: Optional[TritonConfig] = None) -> torch.Tensor:
    """See ``k3compile.ops.mla_decode.mla_decode``; ``config`` lays out the kernels (``dispatch.py`` picks it;
    None: ``config.default_config``). ``config.form`` cuts the step into launches (``config.TritonConfig``); where
    T x H passes ``FORM_ROWS`` the chain runs whatever the form."""
    B, T, H, N = q_nope.shape
    S, LK = c_kv.shape[1:]
    R = k_pe.shape[-1]
    VD = w_kv_b.shape[1] - N
    TH = T * H
    dtype = c_kv.dtype
    device = c_kv.device
    config = fit_local_memory(config or default_config(TH, B), TH, LK, R, c_kv.element_size(),
                              local_memory_budget(device))
    form = config.form if TH <= FORM_ROWS else "chain"
    pdl = config.pdl and pdl_capable(device)
    early = pdl and early_reads_safe()
    sms = sm_count(device)
    has_start = start is not None
    start_arg = start if has_start else pos
    BL = triton.next_power_of_2(LK)
    BR = max(16, triton.next_power_of_2(R))
    hybrid = form == "hybrid"
    # Triton launches on the current device: make it the tensors' (TP ranks, a model on cuda:1)
    on_device = torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
    with on_device:
        w_k = w_kv_b[:, :N]                                               # [H, N, Lk]
        w_v = w_kv_b[:, N:]                                               # [H, Vd, Lk]
        q_lat = _empty(B, T, H, LK, dtype=dtype, device=device)
        o_lat = _empty(B, T, H, LK, dtype=w_kv_b.dtype, device=device)
        out = _empty(B, T, H, VD, dtype=q_nope.dtype, device=device)
        BM = row_block(TH)
        row_blocks = triton.cdiv(TH, BM)
        n_split = split_count(B, row_blocks, S, sms, config)
        G = arrival_group(n_split, min(TH, BM) * LK * 4)
        n_cnt = B * row_blocks * (1 + triton.cdiv(n_split, G)) if form != "chain" else 0
        if form in ("one", "hybrid"):
            HG = min(config.group_heads, H)
            groups = triton.cdiv(H, HG)
            n_split1 = split_count(B, groups, S, sms, config)
            G1 = arrival_group(n_split1, T * HG * LK * 4)
            n_cnt1 = B * groups * (1 + triton.cdiv(n_split1, G1))
            counters = _counters(device, n_cnt1 + n_cnt)
            BM1 = row_block(T * HG)
            prefetch_w = triton.next_power_of_2(triton.cdiv(HG * (N + VD), B * n_split1)) if pdl else 0
            _mla_one[(B, n_split1, groups)](
                q_nope, q_pe, c_kv, k_pe, w_kv_b, pos, start_arg, q_lat,
                *_partials(B, n_split1 + triton.cdiv(n_split1, G1), TH, LK, device),   # splits, then groups
                counters, o_lat, out, T, H, N, VD, n_split1, config.min_split_tiles, scale * LOG2E, G1,
                config.short_keys,
                *q_nope.stride(), *q_pe.stride(), *c_kv.stride(), *k_pe.stride(), *w_kv_b.stride(), *out.stride(),
                LK=LK, R=R, HG=HG, BM=BM1, BL=BL, BR=BR, BS=config.block_s, BK=ABSORB_BLOCK,
                BV=triton.next_power_of_2(VD), BLC=min(LAST_CHUNK, BL), BSP=LAST_SLOTS,
                PREFETCH=config.prefetch_tiles * config.block_s if pdl else 0, PREFETCH_W=prefetch_w,
                HAS_START=has_start, UPCAST=_upcast(dtype), HYBRID=hybrid,
                STAGES_C=_stages(BM1 * LAST_CHUNK * 4, device),
                STAGES_R=_stages((BM1 + VD) * LAST_CHUNK * 2, device),
                num_warps=config.num_warps, num_stages=config.num_stages, **_launch(pdl))
            if not hybrid:
                return out
            counters = counters[n_cnt1:]
        else:
            per_head_matmul(q_nope, w_k, q_lat, pdl, sms)
            counters = _counters(device, n_cnt) if n_cnt else q_lat

        o_part, m_part, l_part = _partials(B, n_split + (triton.cdiv(n_split, G) if form != "chain" else 0), TH, LK,
                                           device)
        shared = dict(BS=config.block_s, EARLY=early, HAS_START=has_start)
        _mla_split[(B, n_split, row_blocks)](
            q_lat, q_pe, c_kv, k_pe, pos, start_arg, o_part, m_part, l_part, counters, o_lat, T, H, n_split,
            config.min_split_tiles, scale * LOG2E, G, config.short_keys, *q_pe.stride(), *c_kv.stride(),
            *k_pe.stride(), LK=LK, R=R, BM=BM, BL=BL, BR=BR,
            PREFETCH=config.prefetch_tiles * config.block_s if early else 0, UPCAST=_upcast(dtype),
            LAST=form != "chain", SKIP=hybrid, BLC=min(LAST_CHUNK, BL), BSP=LAST_SLOTS,
            STAGES_C=_stages(BM * LAST_CHUNK * 4, device),
            num_warps=config.num_warps, num_stages=config.num_stages, **shared, **_launch(pdl))
        if form != "chain":
            per_head_matmul(o_lat, w_v.transpose(1, 2), out, pdl, sms, (pos, config.short_keys) if hybrid else None,
                            early)
            return out
        if config.fused_readback:
            _mla_combine_readback[(B * TH, triton.cdiv(VD, FUSED_VD))](
                o_part, m_part, l_part, pos, start_arg, w_v, out, T, H, n_split, config.min_split_tiles, VD,
                *w_v.stride(), *out.stride(), LK=LK, BL=BL, BN=FUSED_VD, BSP=FUSED_SPLITS, num_warps=4,
                num_stages=2, **shared, **_launch(pdl))
            return out
        BSP = min(COMBINE_TILE, triton.next_power_of_2(n_split))
        BRW = min(COMBINE_TILE // BSP, triton.next_power_of_2(B * TH))
        _mla_combine[(triton.cdiv(B * TH, BRW), triton.cdiv(LK, COMBINE_CHUNK))](
            o_part, m_part, l_part, pos, start_arg, o_lat, T, TH, B * TH, n_split, config.min_split_tiles,
            LK=LK, BRW=BRW, BSP=BSP, BLC=min(COMBINE_CHUNK, BL), num_warps=4, num_stages=3, **shared,
            **_launch(pdl))
        per_head_matmul(o_lat, w_v.transpose(1, 2), out, pdl, sms)
    return out
