"""The routed experts' down product (partials per pair, the router weight applied) and the combine over the top-k, in
Triton, launched by ``triton.py`` after its gate/up kernel (its docstring has the forms, the grids and the PDL order)."""
from __future__ import annotations

import triton
import triton.language as tl

from .triton_tiles import _chunk_pairs, _down_step, _my_expert, _w2_tiles, gdc_launch_dependents, gdc_wait


@triton.jit(do_not_specialize=["M"])
def _down_kernel(
    p_h, p_ids, p_order, p_offsets, p_wts, p_w2, p_s2, p_part,
    M, A, E, I, L,
    s_2e, s_2l, s_2i, s_s2e, s_s2l, s_s2i, s_hp,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_A: tl.constexpr,
    SORTED: tl.constexpr, MXFP4: tl.constexpr, HALVES: tl.constexpr, ASM: tl.constexpr, DOTS: tl.constexpr,
    X_FMT: tl.constexpr, PRELOAD: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr, PDL: tl.constexpr,
    EARLY: tl.constexpr, EVEN_K: tl.constexpr, ROWS: tl.constexpr, S_ALIGN: tl.constexpr, FMA: tl.constexpr,
):
    """ROWS: w2's rows as the product's rows, acc [BLOCK_N, BLOCK_M] = w2 · hᵀ. ``S_ALIGN``: a power of two dividing
    the scales' row stride (so the scale bytes load as words)."""
    slot = tl.program_id(0)
    i_n = tl.program_id(1)
    # the ids, offsets, router weights and w2 are inputs of the op: the gate/up kernel before us triggered after
    # its own wait, so whatever wrote them has completed. Only h (and the partials) need our wait.
    e, runs, start, chunks, count = _my_expert(p_ids, p_offsets, slot, M, A, SORTED, BLOCK_M, BLOCK_A)
    if runs:
        valid = (e >= 0) & (e < E)
        e64 = tl.where(valid, e, 0).to(tl.int64)
        p_w2e = p_w2 + e64 * s_2e
        p_s2e = p_s2 + e64 * s_s2e
        if S_ALIGN > 1:   # the host checked S_ALIGN divides it; spelled so Triton's alignment analysis sees it
            s_s2l = (s_s2l // S_ALIGN) * S_ALIGN
        o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
        m_n = (o_n < L) & valid
        dtype = p_h.dtype.element_ty
        if PRELOAD:
            b_w0a, b_w0b = _w2_tiles(p_w2e, p_s2e, o_n, m_n, 0, I, s_2l, s_2i, s_s2l, s_s2i, BLOCK_N, BLOCK_K, MXFP4,
                                     HALVES, ASM, DOTS, dtype, EVEN_K, ROWS)
        if PDL:
            gdc_wait()
            if EARLY:
                gdc_launch_dependents()   # after our own wait
        for c in range(0, chunks):
            pairs, m_j = _chunk_pairs(p_ids, p_order, e, start, c, count, M, A, SORTED, BLOCK_M, BLOCK_A)
            p_hj = p_h + pairs[:, None].to(tl.int64) * s_hp
            m_hj = m_j[:, None] & valid   # an invalid expert wrote no h
            if ROWS:
                acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
            else:
                acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            k_start = BLOCK_K if PRELOAD else 0
            for k0 in range(k_start, I, BLOCK_K):
                b_wa, b_wb = _w2_tiles(p_w2e, p_s2e, o_n, m_n, k0, I, s_2l, s_2i, s_s2l, s_s2i, BLOCK_N, BLOCK_K,
                                       MXFP4, HALVES, ASM, DOTS, dtype, EVEN_K, ROWS)
                acc = _down_step(acc, b_wa, b_wb, p_hj, m_hj, k0, I, BLOCK_M, BLOCK_K, MXFP4, HALVES, DOTS, X_FMT,
                                 IEEE, UPCAST, EVEN_K, ROWS, FMA)
            if PRELOAD:
                acc = _down_step(acc, b_w0a, b_w0b, p_hj, m_hj, 0, I, BLOCK_M, BLOCK_K, MXFP4, HALVES, DOTS, X_FMT,
                                 IEEE, UPCAST, EVEN_K, ROWS, FMA)
            if PDL and not EARLY:
                gdc_launch_dependents()   # after our own wait
            # y rounded to z's dtype as the model's product is, then weighted in fp32; ROWS stores [BLOCK_N, BLOCK_M]
            # as the product left it (see _gate_up_kernel)
            wts = tl.load(p_wts + pairs, mask=m_j, other=0.).to(tl.float32)
            o_nn = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
            if ROWS:
                y = acc.to(dtype).to(tl.float32) * wts[None, :]
                p_o = p_part + pairs[None, :].to(tl.int64) * L + o_nn[:, None]
                m_o = m_j[None, :] & (o_nn < L)[:, None]
            else:
                y = acc.to(dtype).to(tl.float32) * wts[:, None]
                p_o = p_part + pairs[:, None].to(tl.int64) * L + o_nn[None, :]
                m_o = m_j[:, None] & (o_nn < L)[None, :]
            y = tl.where(valid, y, float("nan"))   # an id outside [0, E): the token comes out NaN
            tl.store(p_o, y, mask=m_o)


@triton.jit(do_not_specialize=["M"])
def _combine_kernel(p_part, p_ids, p_out, M, A, E, L, s_om, s_ol, BLOCK_N: tl.constexpr, BLOCK_A: tl.constexpr,
                    PDL: tl.constexpr):
    """out[m, n-tile] = Σ_a partial[m·A + a] in slot order (fp32, [A, BLOCK_N] in one load), NaN where an id of the
    token is outside [0, E) (the sorted form leaves such pairs' partials unwritten; the decode form NaN ones)."""
    m = tl.program_id(0)
    i_n = tl.program_id(1)
    if PDL:
        gdc_wait()
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_n = o_n < L
    o_a = tl.arange(0, BLOCK_A)
    m_a = o_a < A
    ids = tl.load(p_ids + m * A + o_a, mask=m_a, other=0)
    bad = tl.sum((m_a & ((ids < 0) | (ids >= E))).to(tl.int32), axis=0) > 0
    parts = tl.load(p_part + (m * A + o_a)[:, None].to(tl.int64) * L + o_n[None, :], mask=m_a[:, None] & m_n[None, :],
                    other=0.)
    total = tl.where(bad, float("nan"), tl.sum(parts, axis=0))
    if PDL:
        gdc_launch_dependents()
    tl.store(p_out + m * s_om + o_n * s_ol, total.to(p_out.dtype.element_ty), mask=m_n)
