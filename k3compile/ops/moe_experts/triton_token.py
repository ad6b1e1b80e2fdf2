"""The routed experts' down product and combine in one Triton kernel (``MoeConfig.down_by_token``, decode form),
launched by ``triton.py`` after its gate/up kernel."""
from __future__ import annotations

import triton
import triton.language as tl

from .triton_tiles import _act_rows, _dot2, _rows_tiles, gdc_launch_dependents, gdc_wait


@triton.jit(do_not_specialize=["M"])
def _down_token_kernel(
    p_h, p_ids, p_wts, p_w2, p_s2, p_out,
    M, A, E, I, L,
    s_2e, s_2l, s_2i, s_s2e, s_s2l, s_s2i, s_hp, s_om, s_ol,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_A: tl.constexpr, MXFP4: tl.constexpr, ASM: tl.constexpr,
    S_ALIGN: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr, PDL: tl.constexpr, EARLY: tl.constexpr,
    EVEN_K: tl.constexpr,
):
    """Decode form, the down product and the combine in one kernel (``MoeConfig.down_by_token``): program (token m,
    n-tile) streams w2[e] rows [BLOCK_N, I] for each of the token's A slots in slot order, one flat loop over
    (slot, k step) so the pipeline never drains between slots; acc [BLOCK_N, 16] = w2 · hᵀ with the pair's h row in
    column 0 (the other 15 masked to zero), y rounded to z's dtype, weighted in fp32 and added to the token's sum,
    which is stored once: no partials, no combine kernel, the same fixed order on every run. A token's experts are
    read once for that token (tokens sharing an expert read it again; at M = 1 none do). A token holding an id
    outside [0, E) comes out NaN, reading no weight for it."""
    m = tl.program_id(0)
    i_n = tl.program_id(1)
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_n = o_n < L
    row0 = (tl.arange(0, 16) == 0)[:, None]   # h's rows in the product: this pair's in row 0
    k_steps = tl.cdiv(I, BLOCK_K)
    if S_ALIGN > 1:   # the host checked S_ALIGN divides it; spelled so Triton's alignment analysis sees it
        s_s2l = (s_s2l // S_ALIGN) * S_ALIGN
    dtype = p_h.dtype.element_ty
    # the token's router weights in registers (a load in the loop would wait out its latency every slot: only loads
    # feeding the product pipeline); ids and weights are inputs of the op, readable before the wait
    o_a = tl.arange(0, BLOCK_A)
    wts = tl.load(p_wts + m * A + o_a, mask=o_a < A, other=0.).to(tl.float32)
    if PDL:
        gdc_wait()   # h is the gate/up kernel's output
        if EARLY:
            gdc_launch_dependents()   # after our own wait
    acc = tl.zeros([BLOCK_N, 16], dtype=tl.float32)
    total = tl.zeros([BLOCK_N, 16], dtype=tl.float32)
    bad = m < 0
    for it in range(0, A * k_steps):
        a = it // k_steps
        k0 = (it - a * k_steps) * BLOCK_K
        pair = m * A + a
        e = tl.load(p_ids + pair)
        valid = (e >= 0) & (e < E)
        e64 = tl.where(valid, e, 0).to(tl.int64)
        b_wa, b_wb = _rows_tiles(p_w2 + e64 * s_2e + o_n * s_2l, p_s2 + e64 * s_s2e + o_n * s_s2l, m_n & valid, k0, I,
                                 s_2i, s_s2i, BLOCK_N, BLOCK_K, MXFP4, ASM, dtype, EVEN_K)
        b_ha, b_hb = _act_rows(p_h + pair.to(tl.int64) * s_hp + tl.zeros([16, 1], dtype=tl.int32), row0 & valid, k0,
                               I, 1, 16, BLOCK_K, MXFP4, EVEN_K)
        acc = _dot2(acc, b_wa, b_wb, b_ha, b_hb, MXFP4, False, "bf16", IEEE, UPCAST)   # acc + w2 · hᵀ
        # the slot's last step: y rounded to z's dtype as the model's product is, weighted in fp32, summed in order
        last = k0 + BLOCK_K >= I
        wt = tl.sum(tl.where(o_a == a, wts, 0.), axis=0)
        total = tl.where(last, total + acc.to(dtype).to(tl.float32) * wt, total)
        acc = tl.where(last, 0., acc)
        bad = bad | (valid == 0)
    if PDL and not EARLY:
        gdc_launch_dependents()   # after our own wait
    out = tl.where(bad, float("nan"), tl.sum(total, axis=1))   # column 0 only is non-zero
    tl.store(p_out + m * s_om + o_n * s_ol, out.to(p_out.dtype.element_ty), mask=m_n)
