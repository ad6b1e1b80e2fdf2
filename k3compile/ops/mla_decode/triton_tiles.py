"""Device helpers of the Triton MLA decode kernels (``triton.py``): products, PDL entry, L2 prefetch, each split's
share of the valid keys, the stream of a split's keys, the splits' online combine step, and what the last program
to arrive does (combine the partials, per-head products through ``w_kv_b``)."""
from __future__ import annotations

import triton
import triton.language as tl

try:  # grid dependency control (PDL), Triton >= 3.4
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover
    gdc_launch_dependents = gdc_wait = None

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
    """Under PDL: wait for the previous kernel (its writes visible), then let the next one launch. Nothing the
    previous kernel wrote may be read before the wait; the trigger after it keeps every k3 kernel's order
    (k3compile/static_weights.py), which the early reads of the module docstring rest on."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


@triton.jit
def _prefetch_rows(p, o_row, m_row, stride_row, stride_col, width, BW: tl.constexpr):
    """Rows ``o_row`` where ``m_row`` (offsets inside the tensor even where masked) of ``p``, columns ``[0, width)``
    (at most ``BW``), into L2: one ``prefetch.global.L2`` per 128-byte line, predicated off for masked rows (a
    clamped row would send every masked lane's request to the same few lines, all to one L2 slice). GPU only (the
    interpreter has no inline assembly)."""
    LINE: tl.constexpr = 1024 // p.dtype.element_ty.primitive_bitwidth      # elements per line
    N_LINES: tl.constexpr = max(1, BW // LINE)
    o_col = tl.minimum(tl.arange(0, N_LINES) * LINE, width - 1)
    p_pf = p + o_row.to(tl.int64)[:, None] * stride_row + o_col[None, :] * stride_col
    m_pf = (m_row[:, None] & (o_col >= 0)[None, :]).to(tl.int32)
    tl.inline_asm_elementwise("{ .reg .pred %pf; setp.ne.b32 %pf, $2, 0; @%pf prefetch.global.L2 [$1]; }\n"
                              "mov.u32 $0, 0;", "=r,l,r", [p_pf, m_pf], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _split_len(n, N_SPLIT, BS: tl.constexpr, min_tiles):
    """Keys per split for a valid length ``n`` >= 0: an equal share of ``N_SPLIT`` splits, in whole tiles, at least
    ``min_tiles`` tiles. Splits ``[0, cdiv(n, len))`` are active; the split and combine kernels agree through this."""
    return tl.maximum(tl.cdiv(tl.cdiv(n, N_SPLIT), BS), min_tiles) * BS


@triton.jit
def _valid_range(pos, start, i_b, m_b, T, HAS_START: tl.constexpr):
    """(pos, first key, end, length) of the keys some query of row(s) ``i_b`` (where ``m_b``) sees:
    ``[min(start_b, pos), pos + T)``. Loaded from L2 (``.cg``): the kernels after the first read them before their
    PDL wait."""
    p = tl.load(pos, cache_modifier=".cg").to(tl.int32)   # positions fit 32 bits; 64-bit loop bounds would not pipeline
    if HAS_START:
        first = tl.minimum(tl.load(start + i_b, mask=m_b, other=0, cache_modifier=".cg").to(tl.int32), p)
    else:
        first = i_b.to(tl.int32) * 0
    return p, first, p + T, p + T - first


@triton.jit
def _split_range(pos, start, i_b, i_sp, T, N_SPLIT, BS: tl.constexpr, min_tiles, HAS_START: tl.constexpr):
    """(pos, end of row ``i_b``'s valid keys, first key and end of its split ``i_sp``, active splits of the row)."""
    p, first, end, n = _valid_range(pos, start, i_b, i_b >= 0, T, HAS_START)
    split = _split_len(n, N_SPLIT, BS, min_tiles)
    s0 = first + i_sp * split
    return p, end, s0, tl.minimum(s0 + split, end), tl.cdiv(n, split)


@triton.jit
def _stream(b_q, b_qpe, p_c, p_k, s0, s1, last, lo, qk_scale, stride_cs, stride_cl, stride_ks, stride_kr,
            LK: tl.constexpr, R: tl.constexpr, BM: tl.constexpr, BL: tl.constexpr, BR: tl.constexpr,
            BS: tl.constexpr, UPCAST: tl.constexpr):
    """Keys ``[s0, s1)`` of one sequence (``p_c`` / ``p_k``: its c_kv / k_pe) against query rows ``b_q`` [BM, Lk]
    (absorbed) and ``b_qpe`` [BM, R], in tiles of ``BS`` keys, each loaded once and used twice: the scores
    ``q_lat c_kvᵀ + q_pe k_peᵀ`` and the latent output ``p c_kv``. Row r sees keys ``lo[r] <= s <= last[r]``. Online
    softmax in fp32, base 2 (``qk_scale`` holds log2 e): returns the running max, sum and unnormalised output."""
    o_l = tl.arange(0, BL)
    m_l = o_l < LK
    o_r = tl.arange(0, BR)
    m_r = o_r < R
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
    return b_m, b_l, b_acc


@triton.jit
def _combine_step(b_max, b_den, b_acc, b_m, b_l, b_o, AXIS: tl.constexpr):
    """One step of the splits' online combine: partial maxima ``b_m`` / sums ``b_l`` / outputs ``b_o`` (splits
    along ``AXIS``) folded into the running max, denominator and output. A split where a row saw no key (max -inf,
    sum and output 0) and a masked one weigh nothing."""
    b_new = tl.maximum(b_max, tl.max(b_m, AXIS))
    b_use = tl.where(b_new == float("-inf"), 0.0, b_new)
    b_alpha = tl.exp2(b_max - b_use)
    b_w = tl.exp2(b_m - tl.expand_dims(b_use, AXIS))
    b_den = b_den * b_alpha + tl.sum(b_w * b_l, AXIS)
    b_acc = b_acc * tl.expand_dims(b_alpha, AXIS) + tl.sum(tl.expand_dims(b_w, AXIS + 1) * b_o, AXIS)
    return b_new, b_den, b_acc


@triton.jit
def _store_partial(o_part, m_part, l_part, o_row, m_rows, b_m, b_l, b_acc, LK: tl.constexpr, BL: tl.constexpr):
    """A split's (max, sum, unnormalised output) of rows ``o_row`` (fp32 scratch rows) where ``m_rows``."""
    o_l = tl.arange(0, BL)
    tl.store(o_part + o_row[:, None] * LK + o_l[None, :], b_acc, mask=m_rows[:, None] & (o_l < LK)[None, :])
    tl.store(m_part + o_row, b_m, mask=m_rows)
    tl.store(l_part + o_row, b_l, mask=m_rows)


@triton.jit
def _slot_weights(m_part, l_part, p_row, m_rows, first, count, TH, BM: tl.constexpr, BSP: tl.constexpr):
    """(max, sum) of rows ``p_row`` (slot 0's scratch rows; slot j at ``p_row + j * TH``) over partial slots
    ``first .. first + count - 1``, ``BSP`` slots a step. Read through L2 (``.cg``): other programs wrote them,
    behind the arrival counter's acquire."""
    b_max = tl.full([BM], float("-inf"), tl.float32)
    b_den = tl.zeros([BM], dtype=tl.float32)
    for j0 in range(0, count, BSP):
        o_j = j0 + tl.arange(0, BSP)
        p_j = p_row[:, None] + (first + o_j)[None, :] * TH
        m_j = m_rows[:, None] & (o_j < count)[None, :]
        b_m = tl.load(m_part + p_j, mask=m_j, other=float("-inf"), cache_modifier=".cg")
        b_l = tl.load(l_part + p_j, mask=m_j, other=0, cache_modifier=".cg")
        b_new = tl.maximum(b_max, tl.max(b_m, 1))
        b_use = tl.where(b_new == float("-inf"), 0.0, b_new)     # no key in any slot yet: no -inf - -inf
        b_den = b_den * tl.exp2(b_max - b_use) + tl.sum(b_l * tl.exp2(b_m - b_use[:, None]), 1)
        b_max = b_new
    return b_max, b_den


@triton.jit
def _combine_into(dst, p_dst, o_part, m_part, p_row, m_rows, first, count, b_max, b_scale, TH,
                  LK: tl.constexpr, BM: tl.constexpr, BLC: tl.constexpr, STAGES: tl.constexpr):
    """``dst[p_dst[r] + c] = b_scale[r] * sum_j exp2(m_j[r] - b_max[r]) o_j[r, c]`` over partial slots ``first ..
    first + count - 1`` (``b_max`` from ``_slot_weights``), in ``dst``'s dtype: one pipelined loop over (column
    chunk of ``BLC``, slot), each chunk stored when its last slot is in. A slot where a row saw no key (max -inf,
    output 0) and a masked row weigh nothing."""
    b_use = tl.where(b_max == float("-inf"), 0.0, b_max)
    b_acc = tl.zeros([BM, BLC], dtype=tl.float32)
    for i in tl.range(0, tl.cdiv(LK, BLC) * count, num_stages=STAGES):
        j = i % count
        o_c = (i // count) * BLC + tl.arange(0, BLC)
        m_o = m_rows[:, None] & (o_c < LK)[None, :]
        p_j = p_row + (first + j) * TH
        b_m = tl.load(m_part + p_j, mask=m_rows, other=float("-inf"), cache_modifier=".cg")
        b_o = tl.load(o_part + p_j[:, None] * LK + o_c[None, :], mask=m_o, other=0, cache_modifier=".cg")
        b_acc = tl.where(j == 0, 0.0, b_acc) + tl.exp2(b_m - b_use)[:, None] * b_o
        tl.store(dst + p_dst[:, None] + o_c[None, :], (b_acc * b_scale[:, None]).to(dst.dtype.element_ty),
                 mask=m_o & (j == count - 1))


@triton.jit
def _arrive(p_cnt, n):
    """Count this program in at ``p_cnt`` (int32, zero before the first arrival); True in the ``n``-th program to
    arrive, which sets the counter back to zero. The barrier before makes every thread's stores part of the
    release; the one after orders every thread's loads after the acquire."""
    tl.debug_barrier()
    ticket = tl.atomic_add(p_cnt, 1, sem="acq_rel", scope="gpu")
    tl.debug_barrier()
    last = ticket == n - 1
    if last:
        tl.atomic_xchg(p_cnt, 0, sem="relaxed", scope="gpu")
    return last


@triton.jit
def _reduce_on_arrival(o_part, m_part, l_part, p_cnt, p_row, m_rows, i_sp, n_act, N_SPLIT, G, TH,
                       LK: tl.constexpr, BM: tl.constexpr, BLC: tl.constexpr, BSP: tl.constexpr,
                       STAGES: tl.constexpr):
    """After this split wrote its partial (slot ``i_sp`` of rows ``p_row``). The active splits (``n_act``) arrive
    in groups of ``G`` (counter ``p_cnt[1 + i_sp // G]``); where there is one group, its last program holds the
    result; else the last of group k writes the group's combination to slot ``N_SPLIT + k`` and arrives at
    ``p_cnt[0]``, and the last of the groups holds the result. Returns (done, first, count, max, sum): ``done``
    (int32 0/1) in the program holding the result, which is slots ``first .. first + count - 1`` combined with that
    max and sum (``_combine_into`` writes it)."""
    k = i_sp // G
    n_grp = tl.cdiv(n_act, G)
    first = k * G
    count = tl.minimum(G, n_act - first)
    done = n_act * 0
    b_max = tl.full([BM], float("-inf"), tl.float32)
    b_den = tl.zeros([BM], dtype=tl.float32)
    if _arrive(p_cnt + 1 + k, count):
        b_max, b_den = _slot_weights(m_part, l_part, p_row, m_rows, first, count, TH, BM, BSP)
        if n_grp > 1:
            p_dst = p_row + (N_SPLIT + k) * TH
            tl.store(m_part + p_dst, b_max, mask=m_rows)
            tl.store(l_part + p_dst, b_den, mask=m_rows)
            _combine_into(o_part, p_dst * LK, o_part, m_part, p_row, m_rows, first, count, b_max,
                          tl.full([BM], 1.0, tl.float32), TH, LK, BM, BLC, STAGES)
            if _arrive(p_cnt, n_grp):
                first = N_SPLIT
                count = n_grp
                b_max, b_den = _slot_weights(m_part, l_part, p_row, m_rows, first, count, TH, BM, BSP)
                done = done + 1
        else:
            done = done + 1
    return done, first, count, b_max, b_den


@triton.jit
def _absorb_heads(q_nope, w_k, p_q, hh_r, m_rows, h0, H, N, stride_qn, stride_wh, stride_wn, stride_wl,
                  LK: tl.constexpr, HG: tl.constexpr, BM: tl.constexpr, BL: tl.constexpr, BK: tl.constexpr,
                  UPCAST: tl.constexpr):
    """``q_lat`` [BM, Lk] (fp32) of query rows whose heads are ``h0 + hh_r`` (``p_q``: each row's q_nope offset):
    ``q_nope[b, t, h] @ w_k[h]``, one head at a time (its rows' queries, the others zero) over ``BK`` of N a step."""
    o_l = tl.arange(0, BL)
    m_l = o_l < LK
    b_q = tl.zeros([BM, BL], dtype=tl.float32)
    for hh in range(0, HG):
        h = h0 + hh
        m_sel = m_rows & (hh_r == hh)
        p_w = w_k + h.to(tl.int64) * stride_wh
        for k0 in range(0, N, BK):
            o_k = k0 + tl.arange(0, BK)
            m_k = o_k < N
            b_x = tl.load(q_nope + p_q[:, None] + o_k[None, :] * stride_qn, mask=m_sel[:, None] & m_k[None, :],
                          other=0)
            b_w = tl.load(p_w + o_k[:, None] * stride_wn + o_l[None, :] * stride_wl,
                          mask=(m_k[:, None] & m_l[None, :]) & (h < H), other=0)
            b_q += _dot(b_x, b_w, b_w.dtype, UPCAST)
    return b_q


@triton.jit
def _readback_rows(o_lat, p_lat, w_v, out, p_o, hh_r, m_rows, h0, H, VD, stride_wh, stride_wv, stride_wl, stride_ov,
                   LK: tl.constexpr, HG: tl.constexpr, BM: tl.constexpr, BLC: tl.constexpr, BV: tl.constexpr,
                   UPCAST: tl.constexpr, STAGES: tl.constexpr):
    """``out[p_o[r] + v] = o_lat[p_lat[r]:] @ w_v[h]ᵀ`` for rows r of heads ``h = h0 + hh_r`` (o_lat in the weight's
    dtype, written by this program before a barrier): one pipelined loop over (head, ``BLC`` latent columns), each
    step that head's rows (the others zero) against ``[BLC, Vd]`` of its w_v."""
    o_v = tl.arange(0, BV)
    m_v = o_v < VD
    b_out = tl.zeros([BM, BV], dtype=tl.float32)
    NC: tl.constexpr = (LK + BLC - 1) // BLC
    for i in tl.range(0, HG * NC, num_stages=STAGES):
        hh = i // NC
        h = h0 + hh
        o_c = (i % NC) * BLC + tl.arange(0, BLC)
        m_c = o_c < LK
        b_a = tl.load(o_lat + p_lat[:, None] + o_c[None, :], mask=(m_rows & (hh_r == hh))[:, None] & m_c[None, :],
                      other=0, cache_modifier=".cg")
        b_w = tl.load(w_v + h.to(tl.int64) * stride_wh + o_c[:, None] * stride_wl + o_v[None, :] * stride_wv,
                      mask=(m_c[:, None] & m_v[None, :]) & (h < H), other=0)
        b_out += _dot(b_a, b_w, b_w.dtype, UPCAST)
    tl.store(out + p_o[:, None] + o_v[None, :] * stride_ov, b_out.to(out.dtype.element_ty),
             mask=m_rows[:, None] & m_v[None, :])
