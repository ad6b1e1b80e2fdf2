"""Device helpers of the Triton MLA decode kernels (``triton.py``): products, PDL entry, L2 prefetch, each split's
share of the valid keys, and the splits' online combine step."""
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
def _load_rows(p, r, stride_r, o_col, stride_col, width, BW: tl.constexpr):
    """Rows ``r`` of ``p``, columns ``o_col`` (``[BW]``), masked to ``[0, width)`` only where ``width`` < ``BW``.
    Offsets in 64 bits (a strided cache's may pass 2**31; the loop they serve keeps them in registers)."""
    p_rows = p + r.to(tl.int64)[:, None] * stride_r + o_col.to(tl.int64)[None, :] * stride_col
    if width == BW:
        return tl.load(p_rows)
    else:
        return tl.load(p_rows, mask=(o_col < width)[None, :], other=0)


@triton.jit
def _attend_tile(b_q, b_qpe, b_kv, b_kp, o_s, s1, last, lo, b_m, b_l, b_acc, qk_scale, UPCAST: tl.constexpr):
    """One tile of keys ``o_s`` (``< s1``: in the split; ``b_kv`` / ``b_kp`` their c_kv / k_pe rows) folded into a
    split's online softmax (base 2, the scale folded in): each query row sees the keys in ``[lo, last]``."""
    b_qk = _dot(b_q, tl.trans(b_kv), b_kv.dtype, UPCAST) + _dot(b_qpe, tl.trans(b_kp), b_kv.dtype, UPCAST)
    m_vis = (o_s < s1)[None, :] & (o_s[None, :] <= last[:, None]) & (o_s[None, :] >= lo[:, None])
    b_qk = tl.where(m_vis, b_qk * qk_scale, float("-inf"))
    b_m_new = tl.maximum(b_m, tl.max(b_qk, 1))
    b_m_use = tl.where(b_m_new == float("-inf"), 0.0, b_m_new)   # no key seen yet: no -inf - -inf
    b_alpha = tl.exp2(b_m - b_m_use)
    b_p = tl.exp2(b_qk - b_m_use[:, None])
    b_l = b_l * b_alpha + tl.sum(b_p, 1)
    b_acc = b_acc * b_alpha[:, None] + _dot(b_p, b_kv, b_kv.dtype, UPCAST)
    return b_m_new, b_l, b_acc


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
    """(pos, end of row ``i_b``'s valid keys, first key and end of its split ``i_sp``)."""
    p, first, end, n = _valid_range(pos, start, i_b, i_b >= 0, T, HAS_START)
    split = _split_len(n, N_SPLIT, BS, min_tiles)
    s0 = first + i_sp * split
    return p, end, s0, tl.minimum(s0 + split, end)


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
