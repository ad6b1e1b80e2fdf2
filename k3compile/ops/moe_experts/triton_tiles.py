"""The device helpers of the routed experts' Triton kernels (``triton.py``, ``triton_token.py``): weight tiles (float,
or MXFP4 codes and E8M0 scales dequantised in registers: ``_mxfp4_tile`` interleaved, ``_mxfp4_halves`` as even and
odd columns, through the PTX byte lookup ``E2M1_BF16_PTX`` in bf16 on a GPU, or as stored for ``tl.dot_scaled``;
the weight rows form's tiles ``_rows_tiles`` / ``_mxfp4_rows``, through the bit-move PTX ``E2M1_BF16_BITS_PTX``),
activation tiles, the products, SiTU-GLU, how a program finds its expert's pairs, and PDL's two calls."""
from __future__ import annotations

import triton
import triton.language as tl

try:  # grid dependency control (PDL), Triton >= 3.4; the kernels of triton.py and triton_token.py import it from here
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait  # noqa: F401
except ImportError:  # pragma: no cover
    gdc_launch_dependents = gdc_wait = None


@triton.jit
def _tanh(x):
    # tanh(x) = 2σ(2x) − 1 (no libdevice in the interpreter); absolute error ~1e-7 near 0
    return 2.0 * tl.sigmoid(2.0 * x) - 1.0


@triton.jit
def _situ_glu(gate, up, beta, linear_beta, HAS_BETA: tl.constexpr, HAS_LINEAR_BETA: tl.constexpr):
    """fp32 SiTU-GLU: beta·tanh(gate/beta)·σ(gate) · linear_beta·tanh(up/linear_beta) (model/layers.py)."""
    if HAS_BETA:
        act = beta * _tanh(gate / beta) * tl.sigmoid(gate)
    else:
        act = gate * tl.sigmoid(gate)
    if HAS_LINEAR_BETA:
        up = linear_beta * _tanh(up / linear_beta)
    return act * up


@triton.jit
def _e2m1(c):
    """E2M1 codes (int32, 0..15; bit 3 the sign) -> fp32: magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6 built as bits."""
    mag = c & 7
    # mag >= 2: exponent (mag >> 1) - 1 and mantissa bit (mag & 1) land where fp32 keeps them; 1 -> 0.5; 0 -> 0
    bits = tl.where(mag >= 2, (mag << 22) + 0x3F000000, mag * 0x3F000000)
    return (bits | ((c & 8) << 28)).to(tl.float32, bitcast=True)


@triton.jit
def _e8m0(s):
    """E8M0 scale bytes -> fp32 2^(s - 127); 0 -> 2^-127 (subnormal), 255 (E8M0 NaN) -> NaN."""
    si = s.to(tl.int32)
    f = (si << 23).to(tl.float32, bitcast=True)
    f = tl.where(si == 0, 5.877471754111438e-39, f)
    return tl.where(si == 255, float("nan"), f)


@triton.jit
def _mxfp4_tile(p_codes, p_scales, o_r, m_r, k0, K, s_cr, s_ck, s_sr, s_sk, R: tl.constexpr, BK: tl.constexpr,
                DTYPE: tl.constexpr):
    """Rows ``o_r`` x logical columns [k0, k0 + BK) of an MXFP4 matrix (codes [rows, K/2], scales [rows, K/32])
    dequantised to DTYPE: E2M1(code) · 2^(scale - 127), zeros outside the rows and K."""
    o_b = k0 // 2 + tl.arange(0, BK // 2)
    b_c = tl.load(p_codes + o_r[:, None] * s_cr + o_b[None, :] * s_ck, mask=m_r[:, None] & (o_b < K // 2)[None, :],
                  other=0, eviction_policy="evict_first").to(tl.int32)
    b_v = tl.reshape(tl.join(_e2m1(b_c & 15), _e2m1(b_c >> 4)), (R, BK))          # element 2j low, 2j+1 high
    o_g = k0 // 32 + tl.arange(0, BK // 32)
    b_s = tl.load(p_scales + o_r[:, None] * s_sr + o_g[None, :] * s_sk, mask=m_r[:, None] & (o_g < K // 32)[None, :],
                  other=127, eviction_policy="evict_first")
    b_v = tl.reshape(tl.reshape(b_v, (R, BK // 32, 32)) * _e8m0(b_s)[:, :, None], (R, BK))
    return b_v.to(DTYPE)


# E2M1 -> bf16 for four code bytes at once (``_mxfp4_halves`` with ASM), sm_80+ PTX. Inputs: $4 four code bytes,
# $5 / $6 the bf16 scales of elements 0-1 / 2-3; outputs: $0 / $1 the low nibbles' values (elements 0-1 / 2-3),
# $2 / $3 the high nibbles'. Per half: the four 3-bit magnitudes gathered into one selector (and, shift, or, prmt),
# two byte lookups (prmt) into the bf16 magnitudes' high and low bytes (0, .5, 1, 1.5, 2, 3, 4, 6: high bytes
# 00 3F 3F 3F 40 40 40 40, low bytes 00 00 80 C0 00 40 80 C0), each sign bit moved to bit 7 of its high byte, the
# bytes interleaved into bf16 pairs (prmt), then times the scale (fma with -0: exact, a power of two).
# tests/ops/test_moe_experts.py emulates these steps on every byte; the GPU tests run them.
_E2M1_HALF = """and.b32 m, x, 0x07070707;
shr.b32 u, m, 4;
or.b32 u, u, m;
prmt.b32 sel, u, u, 0x0020;
prmt.b32 hb, th0, th1, sel;
prmt.b32 lb, tl0, tl1, sel;
shl.b32 sg, x, 4;
and.b32 sg, sg, 0x80808080;
or.b32 hb, hb, sg;
prmt.b32 r0, lb, hb, 0x5140;
prmt.b32 r1, lb, hb, 0x7362;
fma.rn.bf16x2 {out0}, r0, $5, nz;
fma.rn.bf16x2 {out1}, r1, $6, nz;
"""
E2M1_BF16_PTX = ("""
{
.reg .b32 x, m, u, sel, hb, lb, sg, r0, r1, th0, th1, tl0, tl1, nz;
mov.b32 th0, 0x3F3F3F00;
mov.b32 th1, 0x40404040;
mov.b32 tl0, 0xC0800000;
mov.b32 tl1, 0xC0804000;
mov.b32 nz, 0x80008000;
mov.b32 x, $4;
""" + _E2M1_HALF.format(out0="$0", out1="$1") + "shr.b32 x, x, 4;\n" + _E2M1_HALF.format(out0="$2", out1="$3")
                 + "}\n")
E2M1_BF16_ASM = tl.constexpr(E2M1_BF16_PTX)   # a jit function reads globals only as constexpr

# E2M1 -> bf16 for two code bytes by bit moves (``_mxfp4_rows`` with ASM), sm_80+ PTX. Inputs: $2 two code bytes (low
# 16 bits), $3 the bf16 scale twice; outputs: $0 the low nibbles' values (elements 0 and 2), $1 the high nibbles'
# (1 and 3). The bytes spread to [0, b0, 0, b1] (prmt); each nibble's sign lands on bit 15 / 31 of a bf16 pair and
# its three magnitude bits on bits 8:6 / 24:22 (shifts and masks): a bf16 of exponent field e and mantissa m,
# 2^(e-127)·(1 + m/2) or, for e = 0, the subnormal m·2^-127, i.e. the E2M1 value times 2^-126; times 2^126 (bf16
# 0x7E80) gives it exactly, times the scale (a power of two) rounds nothing: each fma with -0 keeps -0 and NaN.
# The shifts are spelled as multiplies (mul.hi by 2^26 is >> 6), which ptxas issues on the FMA pipe: of the 13
# instructions left for four values, 5 use the integer pipe (prmt, 4 lop3), the one an MXFP4 GEMV saturates (the
# byte lookup above: 27 for eight values, its inputs assembled from two loads where the dot operand layout gives a
# thread two contiguous bytes). tests/ops/test_moe_experts.py emulates it.
E2M1_BF16_BITS_PTX = """
{
.reg .b32 q, t, a, b, k, nz, z0;
mov.b32 z0, 0;
mov.b32 k, 0x7E807E80;
mov.b32 nz, 0x80008000;
prmt.b32 q, $2, z0, 0x1404;
mul.hi.u32 t, q, 0x04000000;
and.b32 t, t, 0x01C001C0;
and.b32 a, q, 0x80008000;
or.b32 a, a, t;
mul.hi.u32 t, q, 0x40000000;
and.b32 t, t, 0x01C001C0;
mul.lo.u32 b, q, 16;
and.b32 b, b, 0x80008000;
or.b32 b, b, t;
fma.rn.bf16x2 a, a, k, nz;
fma.rn.bf16x2 b, b, k, nz;
fma.rn.bf16x2 $1, a, $3, nz;
fma.rn.bf16x2 $0, b, $3, nz;
}
"""
E2M1_BF16_BITS = tl.constexpr(E2M1_BF16_BITS_PTX)


@triton.jit
def _e8m0_bf16(s):
    """E8M0 scale bytes -> bf16 2^(s - 127), exactly: bits s << 7; 0 -> 2^-127 (0x0040, subnormal), 255 -> NaN."""
    si = s.to(tl.int32)
    bits = tl.where(si == 0, 0x40, tl.where(si == 255, 0x7FC0, si << 7))
    return bits.to(tl.int16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _mxfp4_halves(p_codes, p_scales, o_r, m_r, k0, K, s_cr, s_ck, s_sr, s_sk, R: tl.constexpr, BK: tl.constexpr,
                  DTYPE: tl.constexpr, ASM: tl.constexpr):
    """The even and the odd logical columns of rows ``o_r`` x [k0, k0 + BK) of an MXFP4 matrix, [R, BK/2] each in
    DTYPE (``_mxfp4_rows``). ASM (bf16, a GPU): byte lookups in PTX (``E2M1_BF16_ASM``)."""
    return _mxfp4_rows(p_codes + o_r * s_cr, p_scales + o_r * s_sr, m_r, k0, K, s_ck, s_sk, R, BK, DTYPE, ASM, False,
                       False)


@triton.jit
def _mxfp4_raw(p_codes, p_scales, o_r, m_r, k0, K, s_cr, s_ck, s_sr, s_sk, BK: tl.constexpr, EVEN_K: tl.constexpr):
    """Rows ``o_r`` x logical columns [k0, k0 + BK) of an MXFP4 matrix as stored: codes [R, BK/2], scales [R, BK/32].
    EVEN_K (BK divides K): row-constant masks, so the scale bytes load as words (and pipeline)."""
    o_b = k0 // 2 + tl.arange(0, BK // 2)
    o_g = k0 // 32 + tl.arange(0, BK // 32)
    if EVEN_K:
        m_c = tl.broadcast_to(m_r[:, None], (o_r.shape[0], BK // 2))
        m_s = tl.broadcast_to(m_r[:, None], (o_r.shape[0], BK // 32))
    else:
        m_c = m_r[:, None] & (o_b < K // 2)[None, :]
        m_s = m_r[:, None] & (o_g < K // 32)[None, :]
    b_c = tl.load(p_codes + o_r[:, None] * s_cr + o_b[None, :] * s_ck, mask=m_c, other=0, eviction_policy="evict_first")
    b_s = tl.load(p_scales + o_r[:, None] * s_sr + o_g[None, :] * s_sk, mask=m_s, other=127,
                  eviction_policy="evict_first")
    return b_c, b_s


@triton.jit
def _weight_tiles(p_w, p_s, o_r, m_r, k0, K, s_wr, s_wk, s_sr, s_sk, R: tl.constexpr, BK: tl.constexpr,
                  MXFP4: tl.constexpr, HALVES: tl.constexpr, ASM: tl.constexpr, DOTS: tl.constexpr,
                  DTYPE: tl.constexpr, EVEN_K: tl.constexpr = False):
    """DOTS: an MXFP4 tile as stored (codes, scales) for ``tl.dot_scaled``; HALVES: its even and odd columns
    dequantised (``_mxfp4_halves``); else the whole tile in DTYPE, twice."""
    if DOTS:
        return _mxfp4_raw(p_w, p_s, o_r, m_r, k0, K, s_wr, s_wk, s_sr, s_sk, BK, EVEN_K)
    elif HALVES:
        return _mxfp4_halves(p_w, p_s, o_r, m_r, k0, K, s_wr, s_wk, s_sr, s_sk, R, BK, DTYPE, ASM)
    else:
        b_w = _weight_tile(p_w, p_s, o_r, m_r, k0, K, s_wr, s_wk, s_sr, s_sk, R, BK, MXFP4, DTYPE)
        return b_w, b_w


@triton.jit
def _act_tiles(p_rows, m_rows, k0, K, s_k, BK: tl.constexpr, HALVES: tl.constexpr):
    """Activation rows ``p_rows`` (pointers [BLOCK_M, 1]) over columns [k0, k0 + BK): the whole tile twice, or
    (HALVES) its even and its odd columns."""
    if HALVES:
        o_h = k0 + 2 * tl.arange(0, BK // 2)
        m_h = m_rows & (o_h < K)[None, :]
        return (tl.load(p_rows + o_h[None, :] * s_k, mask=m_h, other=0.),
                tl.load(p_rows + (o_h + 1)[None, :] * s_k, mask=m_h, other=0.))
    else:
        o_k = k0 + tl.arange(0, BK)
        b_x = tl.load(p_rows + o_k[None, :] * s_k, mask=m_rows & (o_k < K)[None, :], other=0.)
        return b_x, b_x


@triton.jit
def _dot2(acc, b_xa, b_xb, b_wa, b_wb, HALVES: tl.constexpr, DOTS: tl.constexpr, X_FMT: tl.constexpr,
          IEEE: tl.constexpr, UPCAST: tl.constexpr, FMA: tl.constexpr = False):
    """``acc + x·wᵀ``: one product, or (HALVES) the even columns' plus the odd columns', or (DOTS) Triton's scaled
    product of x (format X_FMT) with MXFP4 codes ``b_wa`` and E8M0 scales ``b_wb``. FMA: on the CUDA cores."""
    if DOTS:
        acc = tl.dot_scaled(b_xa, None, X_FMT, tl.trans(b_wa), b_wb, "e2m1", acc=acc)
    else:
        acc = _dot(acc, b_xa, b_wa, IEEE, UPCAST, FMA)
        if HALVES:
            acc = _dot(acc, b_xb, b_wb, IEEE, UPCAST, FMA)
    return acc


@triton.jit
def _weight_tile(p_w, p_s, o_r, m_r, k0, K, s_wr, s_wk, s_sr, s_sk, R: tl.constexpr, BK: tl.constexpr,
                 MXFP4: tl.constexpr, DTYPE: tl.constexpr):
    """Rows ``o_r`` x columns [k0, k0 + BK) of one expert's matrix in DTYPE (float, or MXFP4 dequantised)."""
    if MXFP4:
        return _mxfp4_tile(p_w, p_s, o_r, m_r, k0, K, s_wr, s_wk, s_sr, s_sk, R, BK, DTYPE)
    else:
        o_k = k0 + tl.arange(0, BK)
        # each weight byte is read once: keep it from pushing z, h and the partials out of L2
        return tl.load(p_w + o_r[:, None] * s_wr + o_k[None, :] * s_wk, mask=m_r[:, None] & (o_k < K)[None, :],
                       other=0., eviction_policy="evict_first")


@triton.jit
def _dot(acc, b_x, b_w, IEEE: tl.constexpr, UPCAST: tl.constexpr, FMA: tl.constexpr = False):
    """``acc + b_x · b_wᵀ`` in fp32 (UPCAST: fp32 operands, for the interpreter's 16-bit dot). FMA: as fp32 broadcast
    multiplies summed over K on the CUDA cores (any row counts: no tl.dot minimum of 16)."""
    if FMA:
        return acc + tl.sum(b_x.to(tl.float32)[:, None, :] * b_w.to(tl.float32)[None, :, :], axis=2)
    if UPCAST:
        b_x = b_x.to(tl.float32)
        b_w = b_w.to(tl.float32)
    if IEEE:
        return acc + tl.dot(b_x, tl.trans(b_w), input_precision="ieee")
    else:
        return acc + tl.dot(b_x, tl.trans(b_w))


@triton.jit
def _token_ids(p_ids, M, A, BLOCK_M: tl.constexpr, BLOCK_A: tl.constexpr):
    """Decode: the ids as a [BLOCK_M tokens, BLOCK_A slots] tile, and which entries exist."""
    o_t = tl.arange(0, BLOCK_M)
    o_a = tl.arange(0, BLOCK_A)
    m_ta = (o_t < M)[:, None] & (o_a < A)[None, :]
    return tl.load(p_ids + o_t[:, None] * A + o_a[None, :], mask=m_ta, other=0), m_ta, o_t, o_a


@triton.jit
def _my_expert(p_ids, p_offsets, slot, M, A, SORTED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_A: tl.constexpr):
    """(expert id, whether this program runs, its first pair's position in ``order`` and pair count (sorted), its
    row chunks).

    Decode: slot is a pair; the program runs where that pair is the first of its expert (in token, then slot
    order); a row is a token, and a chunk takes each token's next pair on the expert (one chunk unless a token
    holds the expert twice). Sorted: slot is an expert; it runs where some pair chose it; a chunk is BLOCK_M of
    its pairs."""
    if SORTED:
        start = tl.load(p_offsets + slot)
        count = tl.load(p_offsets + slot + 1) - start
        return slot, count > 0, start, tl.cdiv(count, BLOCK_M), count
    else:
        ids, m_ta, o_t, o_a = _token_ids(p_ids, M, A, BLOCK_M, BLOCK_A)
        e = tl.load(p_ids + slot)
        same = (ids == e) & m_ta
        t0 = slot // A
        earlier = (o_t[:, None] < t0) | ((o_t[:, None] == t0) & (o_a[None, :] < slot - t0 * A))
        first = tl.sum((same & earlier).to(tl.int32)) == 0
        return e, first, 0, tl.max(tl.sum(same.to(tl.int32), axis=1), axis=0), 0


@triton.jit
def _chunk_pairs(p_ids, p_order, e, start, c, count_rows, M, A, SORTED: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_A: tl.constexpr):
    """The pair index of each row of chunk ``c`` of expert ``e`` and which rows exist (``count_rows``: sorted, its
    pair count). Decode: row t is token t's (c+1)-th pair on e."""
    if SORTED:
        o_j = c * BLOCK_M + tl.arange(0, BLOCK_M)
        m_j = o_j < count_rows
        return tl.load(p_order + start + o_j, mask=m_j, other=0), m_j
    else:
        ids, m_ta, o_t, o_a = _token_ids(p_ids, M, A, BLOCK_M, BLOCK_A)
        same = (ids == e) & m_ta
        nth = same & (tl.cumsum(same.to(tl.int32), axis=1) == c + 1)
        slot_of = tl.sum(tl.where(nth, o_a[None, :], 0), axis=1)
        return o_t * A + slot_of, tl.sum(nth.to(tl.int32), axis=1) > 0


@triton.jit
def _mxfp4_rows(p_wr, p_sr, m_r, k0, K, s_wk, s_sk, R: tl.constexpr, BK: tl.constexpr, DTYPE: tl.constexpr,
                ASM: tl.constexpr, EVEN_K: tl.constexpr, BITS: tl.constexpr):
    """The even and odd logical columns of [k0, k0 + BK) of MXFP4 rows (``p_wr`` / ``p_sr``: each row's first code
    / scale byte, [R]), [R, BK/2] each in DTYPE; codes [R, groups, 16] and scales [R, groups] as stored, so both
    loads are contiguous per row, each group's scale broadcasting without reshaping the codes. ASM (bf16, a GPU):
    in PTX, by bit moves on code byte pairs (BITS, ``E2M1_BF16_BITS``) or byte lookups on four bytes
    (``E2M1_BF16_ASM``). EVEN_K (BK divides K): masks constant along a row, so the scale bytes load as words and
    pipeline."""
    G: tl.constexpr = BK // 32
    o_g = k0 // 32 + tl.arange(0, G)
    if EVEN_K:
        m_g = tl.broadcast_to(m_r[:, None], (R, G))
    else:
        m_g = m_r[:, None] & (o_g < K // 32)[None, :]
    o_b = o_g[None, :, None] * 16 + tl.arange(0, 16)[None, None, :]
    b_c = tl.load(p_wr[:, None, None] + o_b * s_wk, mask=m_g[:, :, None], other=0,
                  eviction_policy="evict_first")                                      # [R, G, 16] uint8
    b_s = tl.load(p_sr[:, None] + o_g[None, :] * s_sk, mask=m_g, other=127, eviction_policy="evict_first")
    if ASM:
        b_sb = tl.broadcast_to(_e8m0_bf16(b_s)[:, :, None], (R, G, 16))
        if BITS:
            lo, hi = tl.inline_asm_elementwise(E2M1_BF16_BITS, "=r,=r,r,r", [b_c, b_sb],
                                               dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=2)
        else:
            lo, hi = tl.inline_asm_elementwise(E2M1_BF16_ASM, "=r,=r,=r,=r,r,r,r", [b_c, b_sb],
                                               dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)
        return tl.reshape(lo, (R, BK // 2)), tl.reshape(hi, (R, BK // 2))
    else:
        b_ci = b_c.to(tl.int32)
        b_f = _e8m0(b_s)[:, :, None]
        lo = tl.reshape(_e2m1(b_ci & 15) * b_f, (R, BK // 2))
        hi = tl.reshape(_e2m1(b_ci >> 4) * b_f, (R, BK // 2))
        return lo.to(DTYPE), hi.to(DTYPE)


@triton.jit
def _rows_tiles(p_wr, p_sr, m_r, k0, K, s_wk, s_sk, R: tl.constexpr, BK: tl.constexpr, MXFP4: tl.constexpr,
                ASM: tl.constexpr, DTYPE: tl.constexpr, EVEN_K: tl.constexpr):
    """Rows (each row's first element at ``p_wr``) x columns [k0, k0 + BK): MXFP4 as even/odd halves
    (``_mxfp4_rows``), float weights as one tile, twice."""
    if MXFP4:
        return _mxfp4_rows(p_wr, p_sr, m_r, k0, K, s_wk, s_sk, R, BK, DTYPE, ASM, EVEN_K, True)
    else:
        o_k = k0 + tl.arange(0, BK)
        m_w = m_r[:, None] if EVEN_K else m_r[:, None] & (o_k < K)[None, :]
        b_w = tl.load(p_wr[:, None] + o_k[None, :] * s_wk, mask=m_w, other=0., eviction_policy="evict_first")
        return b_w, b_w


@triton.jit
def _act_rows(p_rows, m_rows, k0, K, s_k, BM: tl.constexpr, BK: tl.constexpr, HALVES: tl.constexpr,
              EVEN_K: tl.constexpr):
    """Activation rows (pointers [BM, 1]) over columns [k0, k0 + BK), loaded contiguous (the load pipelines); with
    HALVES split into the even and the odd columns in registers."""
    o_k = k0 + tl.arange(0, BK)
    m_x = m_rows if EVEN_K else m_rows & (o_k < K)[None, :]
    b_x = tl.load(p_rows + o_k[None, :] * s_k, mask=m_x, other=0.)
    if HALVES:
        return tl.split(tl.reshape(b_x, (BM, BK // 2, 2)))
    else:
        return b_x, b_x


@triton.jit
def _w2_tiles(p_w2e, p_s2e, o_n, m_n, k0, I, s_2l, s_2i, s_s2l, s_s2i, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
              MXFP4: tl.constexpr, HALVES: tl.constexpr, ASM: tl.constexpr, DOTS: tl.constexpr, DTYPE: tl.constexpr,
              EVEN_K: tl.constexpr, ROWS: tl.constexpr):
    """w2[e] rows ``o_n`` x columns [k0, k0 + BLOCK_K) as the down product takes them (``_rows_tiles`` for ROWS,
    else ``_weight_tiles``)."""
    if ROWS:
        return _rows_tiles(p_w2e + o_n * s_2l, p_s2e + o_n * s_s2l, m_n, k0, I, s_2i, s_s2i, BLOCK_N, BLOCK_K, MXFP4,
                           ASM, DTYPE, EVEN_K)
    else:
        return _weight_tiles(p_w2e, p_s2e, o_n, m_n, k0, I, s_2l, s_2i, s_s2l, s_s2i, BLOCK_N, BLOCK_K, MXFP4, HALVES,
                             ASM, DOTS, DTYPE, EVEN_K)


@triton.jit
def _down_step(acc, b_wa, b_wb, p_hj, m_hj, k0, I, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
               MXFP4: tl.constexpr, HALVES: tl.constexpr, DOTS: tl.constexpr, X_FMT: tl.constexpr,
               IEEE: tl.constexpr, UPCAST: tl.constexpr, EVEN_K: tl.constexpr, ROWS: tl.constexpr,
               FMA: tl.constexpr = False):
    """``acc`` plus the product of one w2 step with the pairs' h columns [k0, k0 + BLOCK_K): [BLOCK_N, BLOCK_M]
    (ROWS) or [BLOCK_M, BLOCK_N]."""
    if ROWS:
        b_ha, b_hb = _act_rows(p_hj, m_hj, k0, I, 1, BLOCK_M, BLOCK_K, MXFP4, EVEN_K)
        return _dot2(acc, b_wa, b_wb, b_ha, b_hb, MXFP4, False, X_FMT, IEEE, UPCAST, FMA)   # acc + w · hᵀ
    else:
        b_ha, b_hb = _act_tiles(p_hj, m_hj, k0, I, 1, BLOCK_K, HALVES)
        return _dot2(acc, b_ha, b_hb, b_wa, b_wb, HALVES, DOTS, X_FMT, IEEE, UPCAST, FMA)


@triton.jit
def _glu_store(acc_g, acc_u, p_hi, m_hi, beta, linear_beta, HAS_BETA: tl.constexpr, HAS_LINEAR_BETA: tl.constexpr):
    """h = SiTU-GLU(gate, up) stored at ``p_hi`` in h's dtype, with the model's roundings (model/moe.py
    experts_gathered): both fp32 products, then h, rounded to that dtype."""
    dtype = p_hi.dtype.element_ty
    gate = acc_g.to(dtype).to(tl.float32)
    up = acc_u.to(dtype).to(tl.float32)
    tl.store(p_hi, _situ_glu(gate, up, beta, linear_beta, HAS_BETA, HAS_LINEAR_BETA).to(dtype), mask=m_hi)

