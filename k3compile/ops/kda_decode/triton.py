"""Triton KDA decode step: programs over (batch row, q/k head) pairs and V splits stream the fp32 states once.

For its head a program does: the three short-conv updates (+ SiLU), the gate, β, the q/k L2 norms, the
delta-rule update of its rows of the ``[V, K]`` state, the output ``o = S q`` and the sigmoid-gated RMSNorm
of ``o``. The delta rule is independent per V row (``u[v]``, ``S[v, :]`` and ``o[v]`` read only row v of S),
so a head's V rows are walked in tiles of ``BV`` rows with ``DEPTH`` tile loads in flight, and can be split
over ``NSPLIT`` programs. The whole 128 x 128 fp32 tile in one program leaves one 8-warp program per SM,
which serialises load, math and store (2x the state-traffic floor on the H200).

Keeping the state stream busy (what the layout choices are about):
- a head's small inputs (q/k/v and their conv windows, the gate, β, the output gate, the norm weight) are
  loaded in one batch before any store, so a head costs one round trip besides its state tiles; the v conv
  of all the program's rows is computed at once and each tile picks its rows out of registers;
- the outputs of all tiles stay in registers ([NT, BV]) until the head is complete, then are normalised;
- bytes in flight: a register queue of DEPTH tiles (the next loads issued before the current tile's math),
  or (``stages``) a tile loop that Triton pipelines through shared memory (cp.async): stages - 1 tiles in
  flight without holding them in registers, so more programs fit an SM (the winner with many heads);
- registers decide how many programs an SM holds (``max_registers`` caps them); ``programs_per_sm`` makes
  the grid persistent: each program walks an equal share of the heads and loads the next head's first
  tiles while it computes the current head's last ones (measured slower: kept as an option).

What a split costs, and how it is paid (few heads in flight: more programs than heads):
- the RMSNorm spans all V rows: each program writes its unnormalised ``o`` rows (fp32) and its partial
  sum of squares to scratch, then takes a ticket from a per-(row, head) counter; the last program to
  arrive normalises the whole head and resets the counter to 0 for the next call;
- every split reads the q/k conv states, so the shifted states are written only by that last program,
  after all the readers have taken their tickets (a single writer, no reader left behind);
- the v conv channels are split with the V rows: each program shifts only its own.

States are updated in place. With grouped value heads a program walks the HV/H value heads of its q/k
head as one stream. Runs on CUDA/ROCm, and on CPU tensors under ``TRITON_INTERPRET=1`` (CI; programs run
in order there, so the ticket logic and the persistent loop are exercised too).
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

try:  # grid dependency control (PDL), Triton >= 3.4
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover
    gdc_launch_dependents = gdc_wait = None

from k3compile.backends import is_rocm, sm_count, triton_pdl_capable
from k3compile.ops.arrival_counters import arrival_counters

from .triton_config import KernelConfig, default_config


@triton.jit
def _round_to(x, dtype: tl.constexpr):
    """fp32 ``x`` rounded to ``dtype`` (round-to-nearest-even), returned in that dtype.

    bf16 is rounded by hand: the Triton interpreter (CPU CI) truncates fp32 -> bf16 casts, which would
    make CI compare a different rounding than the GPU runs.
    """
    if dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        # NaN stays NaN (the add could carry a NaN's low mantissa bits into an infinity)
        return tl.where(x != x, x, bits.to(tl.float32, bitcast=True)).to(tl.bfloat16)
    else:
        return x.to(dtype)


@triton.jit
def _short_conv_read(p_x, p_state, p_w, o_c, m_c, W: tl.constexpr, BW: tl.constexpr):
    """(SiLU(Σ_j w[c, j] · window[c, j]), window) for window = [state[c, :], x[c]] as one [C, BW] tile
    (column W-1 holds x). The state is not touched: :func:`_short_conv_shift` stores the window back."""
    o_w = tl.arange(0, BW)
    b_x = tl.load(p_x + o_c, mask=m_c, other=0)
    p_win = p_state + o_c[:, None] * (W - 1) + o_w[None, :]
    b_win = tl.load(p_win, mask=m_c[:, None] & (o_w[None, :] < W - 1), other=0)
    b_win = tl.where(o_w[None, :] == W - 1, b_x[:, None], b_win)
    b_w = tl.load(p_w + o_c[:, None] * W + o_w[None, :], mask=m_c[:, None] & (o_w[None, :] < W), other=0)
    b_y = tl.sum(b_win.to(tl.float32) * b_w.to(tl.float32), 1)
    b_y = b_y * tl.sigmoid(b_y)
    # the model casts the conv output back to the activation dtype before normalising it
    return _round_to(b_y, b_x.dtype).to(tl.float32), b_win


@triton.jit
def _short_conv_shift(p_state, b_win, o_c, m_c, W: tl.constexpr, BW: tl.constexpr):
    """Store the window one column to the left: the oldest input drops out, x becomes the newest.

    The barrier separates every thread's loads of the state from any thread's stores: a tile element can
    be held by several threads (more threads than elements), and without it a fast warp could overwrite
    a state column that a slower warp has not read yet.
    """
    o_w = tl.arange(0, BW)
    tl.debug_barrier()
    tl.store(p_state + o_c[:, None] * (W - 1) + o_w[None, :] - 1, b_win.to(p_state.dtype.element_ty),
             mask=m_c[:, None] & (o_w[None, :] >= 1) & (o_w[None, :] < W))


@triton.jit
def _head_state_base(state, hw, H, stride_state, row0, G: tl.constexpr, V: tl.constexpr, K: tl.constexpr):
    """Where tile 0 of head ``hw`` = (batch row hw // H, q/k head hw % H) starts: its first value head's row
    row0 (a scalar pointer: a tile's pointer tensor is rebuilt at each use, not held across the walk)."""
    i_b = (hw // H).to(tl.int64)
    i_h = hw % H
    return state + i_b * stride_state + (i_h * G) * V * K + row0 * K


@triton.jit
def _load_state_tile(p_s0, row0, o_t, m_k, valid, j: tl.constexpr, NT: tl.constexpr, BV: tl.constexpr,
                     V: tl.constexpr, K: tl.constexpr, CHECK_VALID: tl.constexpr, LOAD_CG: tl.constexpr):
    """Tile j of a head's walk: value head j // NT of its group, rows (j % NT)·BV.. of its split. ``valid``
    (a scalar, read when CHECK_VALID) masks the whole tile: a prefetch past the last head loads nothing."""
    m = (row0 + (j % NT) * BV + o_t < V)[:, None] & m_k[None, :]
    if CHECK_VALID:
        m = m & valid
    p = p_s0 + ((j // NT) * V * K + (j % NT) * BV * K) + (o_t[:, None] * K + tl.arange(0, m_k.shape[0])[None, :])
    if LOAD_CG:   # straight from L2 (L1 would only be polluted); ptxas takes no eviction hint with .cg
        return tl.load(p, mask=m, other=0, cache_modifier=".cg")
    else:
        return tl.load(p, mask=m, other=0, eviction_policy="evict_first")


@triton.jit
def _value_head_inputs(v, conv_v, w_v, f, A_log, dt_bias, beta, gate, i_b, i_hv, row0, o_k, m_k,
                       stride_v, stride_cv, stride_f, stride_beta, stride_gate, lower_bound,
                       NT: tl.constexpr, BNT: tl.constexpr, BV: tl.constexpr, V: tl.constexpr, K: tl.constexpr,
                       W: tl.constexpr, BW: tl.constexpr, USE_LOWER_BOUND: tl.constexpr):
    """Everything a value head needs besides its state, loaded at once (one memory round trip, not one per
    tile): the v conv of this split's NT·BV rows as [BNT, BV] (BNT = next_pow2(NT); tile n in row n) and its
    window (shifted in later), the decay exp(g) [BK], β, and the sigmoid of the output gate as [BNT, BV]."""
    rows = row0 + tl.arange(0, BNT * BV)
    m_rows = (rows < V) & (rows < row0 + NT * BV)   # padded to BNT tiles: never another split's rows
    p_cv = conv_v + i_b * stride_cv + i_hv * V * (W - 1)
    b_v, b_win_v = _short_conv_read(v + i_b * stride_v + i_hv * V, p_cv, w_v + i_hv * V * W, rows, m_rows, W, BW)
    b_f = tl.load(f + i_b * stride_f + i_hv * K + o_k, mask=m_k, other=0).to(tl.float32)
    b_f += tl.load(dt_bias + i_hv * K + o_k, mask=m_k, other=0).to(tl.float32)
    b_a = tl.exp(tl.load(A_log + i_hv).to(tl.float32))
    if USE_LOWER_BOUND:
        b_g = lower_bound * tl.sigmoid(b_a * b_f)
    else:
        # softplus with torch's threshold (x > 20 -> x), written stably
        b_sp = tl.maximum(b_f, 0.0) + tl.log(1.0 + tl.exp(-tl.abs(b_f)))
        b_g = -b_a * tl.where(b_f > 20.0, b_f, b_sp)
    b_beta = tl.sigmoid(tl.load(beta + i_b * stride_beta + i_hv).to(tl.float32))
    b_gate = tl.load(gate + i_b * stride_gate + i_hv * V + rows, mask=m_rows, other=0).to(tl.float32)
    return (tl.reshape(b_v, (BNT, BV)), b_win_v, p_cv, rows, m_rows, tl.exp(b_g), b_beta,
            tl.sigmoid(tl.reshape(b_gate, (BNT, BV))))


@triton.jit
def _next_value_head(v, conv_v, w_v, f, A_log, dt_bias, beta, gate, i_b, i_hv, row0, o_k, m_k,
                     stride_v, stride_cv, stride_f, stride_beta, stride_gate, lower_bound,
                     NT: tl.constexpr, BNT: tl.constexpr, BV: tl.constexpr, V: tl.constexpr, K: tl.constexpr,
                     W: tl.constexpr, BW: tl.constexpr, USE_LOWER_BOUND: tl.constexpr):
    """A later value head of a group (grouped value heads): its inputs, with its v conv window shifted in
    at once (the first head's shift waits until the first state loads are issued)."""
    b_v2, b_win_v, p_cv, rows_v, m_rows_v, b_decay, b_beta, b_sgate2 = _value_head_inputs(
        v, conv_v, w_v, f, A_log, dt_bias, beta, gate, i_b, i_hv, row0, o_k, m_k,
        stride_v, stride_cv, stride_f, stride_beta, stride_gate, lower_bound, NT, BNT, BV, V, K, W, BW,
        USE_LOWER_BOUND)
    _short_conv_shift(p_cv, b_win_v, rows_v, m_rows_v, W, BW)
    return b_v2, rows_v, m_rows_v, b_decay, b_beta, b_sgate2


@triton.jit
def _finish_value_head(o, o_part, ss_part, b_o2, b_nw2, b_sgate2, rows_v, m_rows_v, i_b, i_hv, i_s, HV, stride_o, eps,
                       NSPLIT: tl.constexpr, BNT: tl.constexpr, BV: tl.constexpr, V: tl.constexpr):
    """A value head's outputs [BNT, BV] are complete (for this split): the gated RMSNorm when they are all
    here, else the unnormalised rows and their sum of squares to scratch for the head's last program."""
    o_v2 = tl.reshape(rows_v, (BNT, BV))
    m_v2 = tl.reshape(m_rows_v, (BNT, BV))
    if NSPLIT == 1:
        b_rstd = tl.rsqrt(tl.sum(b_o2 * b_o2) / V + eps)
        b_out = b_o2 * b_rstd * b_nw2 * b_sgate2
        tl.store(o + i_b * stride_o + i_hv * V + o_v2, _round_to(b_out, o.dtype.element_ty), mask=m_v2)
    else:
        tl.store(o_part + (i_b * HV + i_hv) * V + o_v2, b_o2, mask=m_v2)
        tl.store(ss_part + (i_b * HV + i_hv) * NSPLIT + i_s, tl.sum(b_o2 * b_o2))


@triton.jit
def _decode_head(
    q, k, v, conv_q, conv_k, conv_v, w_q, w_k, w_v,
    f, A_log, dt_bias, beta, gate, norm_w, state, o, o_part, ss_part, tickets,
    stride_q, stride_k, stride_v, stride_cq, stride_ck, stride_cv,
    stride_f, stride_beta, stride_gate, stride_state, stride_o,
    lower_bound, scale, eps, H, hw, hw_next, has_next, i_s, b_s1, b_s2, b_s3,
    G: tl.constexpr, K: tl.constexpr, V: tl.constexpr, W: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, BVH: tl.constexpr, BW: tl.constexpr,
    NSPLIT: tl.constexpr, NT: tl.constexpr, BNT: tl.constexpr, BS: tl.constexpr, DEPTH: tl.constexpr,
    USE_LOWER_BOUND: tl.constexpr,
    CROSS_HEAD: tl.constexpr, LOAD_CG: tl.constexpr, STORE_CS: tl.constexpr, STAGES: tl.constexpr,
):
    """One (batch row, q/k head) split: its G value heads' tiles, the first DEPTH already in flight
    (b_s1..b_s3). Returns the queue for head ``hw_next`` (CROSS_HEAD: its first tiles are loaded while
    this head's last ones are computed, so a persistent program's stream never drains between heads)."""
    i_b = (hw // H).to(tl.int64)
    i_h = hw % H
    HV = H * G
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    o_t = tl.arange(0, BV)
    o_nt = tl.arange(0, BNT)
    row0 = i_s * (NT * BV)
    p_s0 = _head_state_base(state, hw, H, stride_state, row0, G, V, K)
    if CROSS_HEAD:
        p_n0 = _head_state_base(state, hw_next, H, stride_state, row0, G, V, K)

    # Loads first, stores after: the compiler cannot prove the conv-state pointers disjoint from the other
    # inputs, so a load placed after a store would wait for it.
    p_cq = conv_q + i_b * stride_cq + i_h * K * (W - 1)
    p_ck = conv_k + i_b * stride_ck + i_h * K * (W - 1)
    b_q, b_win_q = _short_conv_read(q + i_b * stride_q + i_h * K, p_cq, w_q + i_h * K * W, o_k, m_k, W, BW)
    b_k, b_win_k = _short_conv_read(k + i_b * stride_k + i_h * K, p_ck, w_k + i_h * K * W, o_k, m_k, W, BW)
    b_v2, b_win_v, p_cv, rows_v, m_rows_v, b_decay, b_beta, b_sgate2 = _value_head_inputs(
        v, conv_v, w_v, f, A_log, dt_bias, beta, gate, i_b, i_h * G, row0, o_k, m_k,
        stride_v, stride_cv, stride_f, stride_beta, stride_gate, lower_bound, NT, BNT, BV, V, K, W, BW, USE_LOWER_BOUND)
    b_nw2 = tl.reshape(tl.load(norm_w + rows_v, mask=m_rows_v, other=0).to(tl.float32), (BNT, BV))
    if NSPLIT == 1:   # this program is the q/k conv states' only reader
        _short_conv_shift(p_cq, b_win_q, o_k, m_k, W, BW)
        _short_conv_shift(p_ck, b_win_k, o_k, m_k, W, BW)
    # the v conv channels of this split's rows belong to this program alone
    _short_conv_shift(p_cv, b_win_v, rows_v, m_rows_v, W, BW)
    b_q = b_q * tl.rsqrt(tl.sum(b_q * b_q) + 1e-6) * scale
    b_k = b_k * tl.rsqrt(tl.sum(b_k * b_k) + 1e-6)

    if STAGES > 0:
        # a loop over the tiles: Triton's pipeliner streams them into shared memory (cp.async), STAGES - 1
        # tiles in flight without holding them in registers
        for i_g in tl.static_range(G):
            i_hv = i_h * G + i_g
            if i_g > 0:   # the next value head of the group
                b_v2, rows_v, m_rows_v, b_decay, b_beta, b_sgate2 = _next_value_head(
                    v, conv_v, w_v, f, A_log, dt_bias, beta, gate, i_b, i_hv, row0, o_k, m_k,
                    stride_v, stride_cv, stride_f, stride_beta, stride_gate, lower_bound, NT, BNT, BV, V, K, W, BW,
                    USE_LOWER_BOUND)
            b_o2 = tl.zeros([BNT, BV], dtype=tl.float32)
            for i_t in tl.range(0, NT, num_stages=STAGES):
                m_v = row0 + i_t * BV + o_t < V
                p_t = p_s0 + (i_g * V * K + i_t * BV * K) + (o_t[:, None] * K + o_k[None, :])
                b_s = tl.load(p_t, mask=m_v[:, None] & m_k[None, :], other=0)
                b_v = tl.sum(tl.where(o_nt[:, None] == i_t, b_v2, 0.0), 0)
                b_s *= b_decay[None, :]
                b_u = b_beta * (b_v - tl.sum(b_s * b_k[None, :], 1))
                b_s += b_u[:, None] * b_k[None, :]
                b_o = tl.sum(b_s * b_q[None, :], 1)
                if STORE_CS:
                    tl.store(p_t, b_s, mask=m_v[:, None] & m_k[None, :], cache_modifier=".cs")
                else:
                    tl.store(p_t, b_s, mask=m_v[:, None] & m_k[None, :])
                b_o2 = tl.where(o_nt[:, None] == i_t, b_o[None, :], b_o2)
            _finish_value_head(o, o_part, ss_part, b_o2, b_nw2, b_sgate2, rows_v, m_rows_v, i_b, i_hv, i_s, HV,
                               stride_o, eps, NSPLIT, BNT, BV, V)
    else:
        b_o2 = tl.zeros([BNT, BV], dtype=tl.float32)   # the value head's outputs, tile i_t in row i_t
        for j in tl.static_range(G * NT):
            i_g = j // NT
            i_t = j % NT
            i_hv = i_h * G + i_g
            if i_t == 0 and i_g > 0:   # the next value head of the group
                b_v2, rows_v, m_rows_v, b_decay, b_beta, b_sgate2 = _next_value_head(
                    v, conv_v, w_v, f, A_log, dt_bias, beta, gate, i_b, i_hv, row0, o_k, m_k,
                    stride_v, stride_cv, stride_f, stride_beta, stride_gate, lower_bound, NT, BNT, BV, V, K, W, BW,
                    USE_LOWER_BOUND)
                b_o2 = tl.zeros([BNT, BV], dtype=tl.float32)
            b_v = tl.sum(tl.where(o_nt[:, None] == i_t, b_v2, 0.0), 0)

            # take this tile, move the queue up, and issue the load DEPTH tiles ahead (into the next head's
            # tiles when CROSS_HEAD; a tail without a next head leaves stale slots that are never read)
            b_s = b_s1
            if DEPTH >= 2:
                b_s1 = b_s2
            if DEPTH >= 3:
                b_s2 = b_s3
            if j + DEPTH < G * NT:
                b_next = _load_state_tile(p_s0, row0, o_t, m_k, has_next, j + DEPTH, NT, BV, V, K, False, LOAD_CG)
            elif CROSS_HEAD:
                b_next = _load_state_tile(p_n0, row0, o_t, m_k, has_next, j + DEPTH - G * NT, NT, BV, V, K, True,
                                          LOAD_CG)
            if j + DEPTH < G * NT or CROSS_HEAD:
                if DEPTH == 1:
                    b_s1 = b_next
                elif DEPTH == 2:
                    b_s2 = b_next
                else:
                    b_s3 = b_next

            # delta rule on the tile S [BV, K]
            b_s *= b_decay[None, :]
            b_u = b_beta * (b_v - tl.sum(b_s * b_k[None, :], 1))
            b_s += b_u[:, None] * b_k[None, :]
            b_o = tl.sum(b_s * b_q[None, :], 1)
            m_v = row0 + i_t * BV + o_t < V
            p_st = p_s0 + (i_g * V * K + i_t * BV * K) + (o_t[:, None] * K + o_k[None, :])
            if STORE_CS:   # streaming store: the line is not read again this step
                tl.store(p_st, b_s, mask=m_v[:, None] & m_k[None, :], cache_modifier=".cs")
            else:
                tl.store(p_st, b_s, mask=m_v[:, None] & m_k[None, :])
            b_o2 = tl.where(o_nt[:, None] == i_t, b_o[None, :], b_o2)

            if i_t == NT - 1:   # the value head's outputs are complete (for this split)
                _finish_value_head(o, o_part, ss_part, b_o2, b_nw2, b_sgate2, rows_v, m_rows_v, i_b, i_hv, i_s, HV,
                                   stride_o, eps, NSPLIT, BNT, BV, V)

    if NSPLIT > 1:
        # every thread's scratch stores happen before the ticket (release); the last arrival sees them all
        tl.debug_barrier()
        p_ticket = tickets + i_b * H + i_h
        is_last = tl.atomic_add(p_ticket, 1, sem="acq_rel") == NSPLIT - 1
        tl.debug_barrier()
        if is_last:
            tl.store(p_ticket, 0)   # ready for the next call
            # every split has read the q/k conv states by now: shift them, once
            _short_conv_shift(p_cq, b_win_q, o_k, m_k, W, BW)
            _short_conv_shift(p_ck, b_win_k, o_k, m_k, W, BW)
            o_vh = tl.arange(0, BVH)
            m_vh = o_vh < V
            o_sp = tl.arange(0, BS)
            b_nw_h = tl.load(norm_w + o_vh, mask=m_vh, other=0).to(tl.float32)
            for i_gh in tl.static_range(G):
                i_hv_h = i_h * G + i_gh
                # .cg: other programs wrote these; read them from L2, not a stale L1 line
                b_ss_all = tl.load(ss_part + (i_b * HV + i_hv_h) * NSPLIT + o_sp, mask=o_sp < NSPLIT, other=0,
                                   cache_modifier=".cg")
                b_o_h = tl.load(o_part + (i_b * HV + i_hv_h) * V + o_vh, mask=m_vh, other=0, cache_modifier=".cg")
                b_rstd_h = tl.rsqrt(tl.sum(b_ss_all) / V + eps)
                b_gate_h = tl.load(gate + i_b * stride_gate + i_hv_h * V + o_vh, mask=m_vh, other=0).to(tl.float32)
                b_out_h = b_o_h * b_rstd_h * b_nw_h * tl.sigmoid(b_gate_h)
                tl.store(o + i_b * stride_o + i_hv_h * V + o_vh, _round_to(b_out_h, o.dtype.element_ty), mask=m_vh)
    return b_s1, b_s2, b_s3


@triton.jit(do_not_specialize=["H", "n_heads", "stride_beta"])   # one binary for every batch and head count
def kda_decode_kernel(
    q, k, v, conv_q, conv_k, conv_v, w_q, w_k, w_v,
    f, A_log, dt_bias, beta, gate, norm_w, state, o, o_part, ss_part, tickets,
    stride_q, stride_k, stride_v, stride_cq, stride_ck, stride_cv,
    stride_f, stride_beta, stride_gate, stride_state, stride_o,
    lower_bound, scale, eps, H, n_heads,
    G: tl.constexpr, K: tl.constexpr, V: tl.constexpr, W: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, BVH: tl.constexpr, BW: tl.constexpr,
    NSPLIT: tl.constexpr, NT: tl.constexpr, BNT: tl.constexpr, BS: tl.constexpr, DEPTH: tl.constexpr,
    USE_LOWER_BOUND: tl.constexpr,
    PERSISTENT: tl.constexpr, LOAD_CG: tl.constexpr, STORE_CS: tl.constexpr, STAGES: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """Grid (P, NSPLIT) over the n_heads = B·H (batch row, q/k head) pairs, G = HV / H value heads each.
    P == n_heads: one head per program. PERSISTENT: program p walks heads p, p + P, ... as one tile stream.
    Split i_s owns V rows [i_s·NT·BV, (i_s+1)·NT·BV), walked in NT tiles of BV rows, DEPTH (1-3, at most
    G·NT) tile loads ahead in registers, or (STAGES > 0, not PERSISTENT) in a loop pipelined through shared
    memory. BVH = next_pow2(V) (the whole head, for the norm), BS = next_pow2(NSPLIT).
    o_part [B, HV, V] fp32 and ss_part [B, HV, NSPLIT] fp32 are scratch; tickets [B, H] int32 is all
    zero on entry and left all zero (used when NSPLIT > 1).
    PDL: launched before the products that make q/k/v finish; nothing is read before the wait, and the next
    kernel (the output projection) may launch right after it, to pull its weight while the states stream."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    pid = tl.program_id(0)
    i_s = tl.program_id(1)
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    o_t = tl.arange(0, BV)
    row0 = i_s * (NT * BV)
    # The first head's first tiles, issued before anything else (every later load is issued a tile ahead)
    p_s0 = _head_state_base(state, pid, H, stride_state, row0, G, V, K)
    if STAGES > 0:   # the tile loop prefetches for itself
        b_s1 = tl.zeros([BV, BK], dtype=tl.float32)
    else:
        b_s1 = _load_state_tile(p_s0, row0, o_t, m_k, True, 0, NT, BV, V, K, False, LOAD_CG)
    b_s2 = b_s1
    b_s3 = b_s1
    if DEPTH >= 2 and STAGES == 0:
        b_s2 = _load_state_tile(p_s0, row0, o_t, m_k, True, 1, NT, BV, V, K, False, LOAD_CG)
    if DEPTH >= 3 and STAGES == 0:
        b_s3 = _load_state_tile(p_s0, row0, o_t, m_k, True, 2, NT, BV, V, K, False, LOAD_CG)
    if PERSISTENT:
        P = tl.num_programs(0)
        for hw in range(pid, n_heads, P):
            b_s1, b_s2, b_s3 = _decode_head(
                q, k, v, conv_q, conv_k, conv_v, w_q, w_k, w_v, f, A_log, dt_bias, beta, gate, norm_w, state, o,
                o_part, ss_part, tickets, stride_q, stride_k, stride_v, stride_cq, stride_ck, stride_cv,
                stride_f, stride_beta, stride_gate, stride_state, stride_o, lower_bound, scale, eps, H,
                hw, hw + P, hw + P < n_heads, i_s, b_s1, b_s2, b_s3,
                G, K, V, W, BK, BV, BVH, BW, NSPLIT, NT, BNT, BS, DEPTH, USE_LOWER_BOUND, True, LOAD_CG, STORE_CS, 0)
    else:
        _decode_head(
            q, k, v, conv_q, conv_k, conv_v, w_q, w_k, w_v, f, A_log, dt_bias, beta, gate, norm_w, state, o,
            o_part, ss_part, tickets, stride_q, stride_k, stride_v, stride_cq, stride_ck, stride_cv,
            stride_f, stride_beta, stride_gate, stride_state, stride_o, lower_bound, scale, eps, H,
            pid, pid, False, i_s, b_s1, b_s2, b_s3,
            G, K, V, W, BK, BV, BVH, BW, NSPLIT, NT, BNT, BS, DEPTH, USE_LOWER_BOUND, False, LOAD_CG, STORE_CS, STAGES)


def kda_decode_triton(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    conv_state_q: torch.Tensor, conv_state_k: torch.Tensor, conv_state_v: torch.Tensor,
    conv_weight_q: torch.Tensor, conv_weight_k: torch.Tensor, conv_weight_v: torch.Tensor,
    f: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, lower_bound: Optional[float],
    beta_logits: torch.Tensor, out_gate: torch.Tensor, o_norm_weight: torch.Tensor,
    state: torch.Tensor, eps: float, num_warps: Optional[int] = None, out: Optional[torch.Tensor] = None,
    config: Optional[KernelConfig] = None, pdl: bool = True,
) -> torch.Tensor:
    """Launch the kernel; ``out`` (``[B, HV*V]``, v's dtype, row-contiguous) lets tests poison the output.
    ``config`` overrides the measured layout (``num_warps`` alone overrides its warps). ``pdl``: launched with
    programmatic dependent launch where the GPU has it (sm_90+ NVIDIA): in the decode step the output
    projection behind it then streams its weight into L2 while this kernel runs (a projection that follows a
    kernel without PDL took 7.9 µs at 7168 x 1536 against 5.2 for the weight at the copy ceiling)."""
    B, HV, V, K = state.shape
    H = q.shape[-1] // K
    W = conv_weight_q.shape[-1]
    o = torch.empty(B, HV * V, dtype=v.dtype, device=v.device) if out is None else out
    if B == 0:
        return o
    cfg = config or default_config(B, H, K, V)
    if num_warps:
        cfg = cfg._replace(num_warps=num_warps)
    splits = max(1, min(cfg.splits, V))
    per_split = triton.cdiv(V, splits)
    BV = min(triton.next_power_of_2(per_split), triton.next_power_of_2(cfg.rows))
    NT = triton.cdiv(per_split, BV)
    splits = triton.cdiv(V, NT * BV)   # no split left without rows
    G = HV // H
    n_heads = B * H
    programs = n_heads
    if cfg.programs_per_sm > 0 and splits == 1 and not cfg.stages:
        # equal shares: every program walks the same number of heads (no half-empty last wave); the
        # interpreter counts 2 "SMs", so the head loop still loops on CPU
        per_program = triton.cdiv(n_heads, (sm_count(v.device) or 2) * cfg.programs_per_sm)
        programs = triton.cdiv(n_heads, per_program)
    if splits == 1:
        o_part = ss_part = tickets = o   # unused
    else:
        o_part = torch.empty(B, HV, V, dtype=torch.float32, device=v.device)
        ss_part = torch.empty(B, HV, splits, dtype=torch.float32, device=v.device)
        tickets = arrival_counters(v.device, B * H)   # all zero; every launch leaves them zero
        if tickets is None:  # first launch inside a CUDA-graph capture: the graph zeroes its own
            tickets = torch.zeros(B * H, dtype=torch.int32, device=v.device)
    # a register cap is NVIDIA's option (Triton's HIP backend rejects the keyword)
    options = {"maxnreg": cfg.max_registers} if cfg.max_registers and v.device.type == "cuda" and not is_rocm() else {}
    pdl = pdl and triton_pdl_capable(v.device)
    if pdl:
        options["launch_pdl"] = True
    kda_decode_kernel[(programs, splits)](
        q, k, v, conv_state_q, conv_state_k, conv_state_v, conv_weight_q, conv_weight_k, conv_weight_v,
        f, A_log, dt_bias, beta_logits, out_gate, o_norm_weight, state, o, o_part, ss_part, tickets,
        q.stride(0), k.stride(0), v.stride(0),
        conv_state_q.stride(0), conv_state_k.stride(0), conv_state_v.stride(0),
        f.stride(0), beta_logits.stride(0), out_gate.stride(0), state.stride(0), o.stride(0),
        0.0 if lower_bound is None else float(lower_bound), K ** -0.5, float(eps), H, n_heads,
        G=G, K=K, V=V, W=W,
        BK=triton.next_power_of_2(K), BV=BV, BVH=triton.next_power_of_2(V), BW=triton.next_power_of_2(W),
        NSPLIT=splits, NT=NT, BNT=triton.next_power_of_2(NT), BS=triton.next_power_of_2(splits),
        DEPTH=max(1, min(cfg.depth, 3, G * NT)),
        USE_LOWER_BOUND=lower_bound is not None, PERSISTENT=programs < n_heads,
        LOAD_CG=bool(cfg.cg_loads), STORE_CS=bool(cfg.stream_stores), STAGES=cfg.stages,
        PDL=pdl, num_warps=cfg.num_warps, num_stages=max(1, cfg.stages), **options,
    )
    return o
