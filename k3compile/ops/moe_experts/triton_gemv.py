"""A GEMV form of the routed experts' gate/up product for MXFP4 weights at a few tokens (M <= 4): no MMA, each
program's whole weight slab loaded at once (no software pipeline to rely on: every byte of it is in flight
together), converted in registers and multiplied in fp32.

Program (slot, row block): the decode form's expert (``triton_tiles._my_expert``: the program runs where its pair is
the first of its expert), ``ROWS`` rows of w1 and the same rows of w3 over the whole latent width L, as
[2·ROWS, groups, 16] code bytes (a thread reads 16-byte words: one MXFP4 group of 32 values) and [2·ROWS, groups]
scale bytes, groups padded to a power of two and masked. Each code nibble becomes an fp16 bit pattern (sign to bit
15, the three magnitude bits to bits 11:9: exactly E2M1 · 2^-14, subnormals included), converted to fp32 and
multiplied by z's even / odd columns (fp32); each group's sum is scaled once (2^14 · 2^(s - 127), exact powers of
two), then summed over the groups. SiTU-GLU in the epilogue with the model's roundings, as ``triton.py``'s gate/up
kernel: ``h [P, I]``, which its down kernel consumes.

``MODE`` (diagnostics, ``benchmarks/moe_mxfp4_diag.py``): 0 loads only (codes, scales and z summed as integers, one
value stored per program), 1 loads and the conversion without the product, 2 the product (the op's form).
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .triton_tiles import _chunk_pairs, _e8m0, _my_expert, _situ_glu, gdc_launch_dependents, gdc_wait


@triton.jit
def _e2m1_f16(c):
    """E2M1 codes (int32, 0..15 in the low nibble; bit 3 the sign) -> fp32 value · 2^-14, via fp16 bits."""
    bits = ((c & 7) << 9) | ((c & 8) << 12)
    return bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit(do_not_specialize=["M"])
def _gate_up_gemv_kernel(
    p_z, p_ids, p_w1, p_w3, p_s1, p_s3, p_h, p_sink,
    M, A, E, I, L, beta, linear_beta,
    s_zm, s_1e, s_1i, s_3e, s_3i, s_s1e, s_s1i, s_s3e, s_s3i, s_hp,
    BLOCK_M: tl.constexpr, BLOCK_A: tl.constexpr, ROWS: tl.constexpr, GROUPS: tl.constexpr,
    HAS_BETA: tl.constexpr, HAS_LINEAR_BETA: tl.constexpr, PDL: tl.constexpr, MODE: tl.constexpr,
):
    """Codes and scales contiguous along L (column stride 1, checked by the host); GROUPS: L/32 rounded up to a
    power of two."""
    slot = tl.program_id(0)
    i_r = tl.program_id(1)
    if PDL:
        gdc_wait()
        gdc_launch_dependents()   # after our own wait (static_weights.py, step 1)
    e, runs, start, chunks, count = _my_expert(p_ids, p_ids, slot, M, A, False, BLOCK_M, BLOCK_A)
    valid = (e >= 0) & (e < E)
    if runs & valid:
        e64 = e.to(tl.int64)
        o_r = tl.arange(0, 2 * ROWS)
        o_i = i_r * ROWS + o_r % ROWS
        m_r = o_i < I
        up = o_r >= ROWS
        p_wr = tl.where(up, p_w3 + e64 * s_3e + o_i * s_3i, p_w1 + e64 * s_1e + o_i * s_1i)
        p_sr = tl.where(up, p_s3 + e64 * s_s3e + o_i * s_s3i, p_s1 + e64 * s_s1e + o_i * s_s1i)
        o_g = tl.arange(0, GROUPS)
        m_g = m_r[:, None] & (o_g < L // 32)[None, :]
        o_b = tl.arange(0, 16)
        b_c = tl.load(p_wr[:, None, None] + (o_g[None, :, None] * 16 + o_b[None, None, :]), mask=m_g[:, :, None],
                      other=0, eviction_policy="evict_first")                           # [2R, G, 16] uint8
        b_s = tl.load(p_sr[:, None] + o_g[None, :], mask=m_g, other=127, eviction_policy="evict_first")
        dtype = p_z.dtype.element_ty
        o_k = o_g[:, None] * 32 + tl.arange(0, 32)[None, :]
        m_k = (o_g < L // 32)[:, None]
        if MODE == 0:
            z0 = tl.load(p_z + o_k, mask=m_k, other=0.).to(tl.float32)
            total = tl.sum(tl.sum(b_c.to(tl.int32), axis=2) + b_s.to(tl.int32), axis=1)
            tl.store(p_sink + slot * tl.num_programs(1) + i_r, tl.sum(total, axis=0) + tl.sum(tl.sum(z0, 1), 0))
        elif MODE == 1:
            c = b_c.to(tl.int32)
            v = _e2m1_f16(c) + _e2m1_f16(c >> 4)
            tl.store(p_sink + slot * tl.num_programs(1) + i_r, tl.sum(tl.sum(tl.sum(v, 2) * _e8m0(b_s), 1), 0))
        else:
            c = b_c.to(tl.int32)
            w_lo = _e2m1_f16(c)                  # elements 2j
            w_hi = _e2m1_f16(c >> 4)             # elements 2j + 1
            f_s = _e8m0(b_s) * 16384.0           # [2R, G]: the group's scale and the 2^14 the fp16 bits left out
            o_t = tl.arange(0, BLOCK_M)
            for c_ in range(0, chunks):   # one chunk unless a token holds the expert twice
                pairs, m_j = _chunk_pairs(p_ids, p_ids, e, start, c_, count, M, A, False, BLOCK_M, BLOCK_A)
                acc = tl.zeros([BLOCK_M, 2 * ROWS], dtype=tl.float32)
                for t in tl.static_range(BLOCK_M):
                    b_z = tl.load(p_z + t * s_zm + o_k, mask=m_k & (t < M), other=0.).to(tl.float32)  # [G, 32]
                    z_e, z_o = tl.split(tl.reshape(b_z, (GROUPS, 16, 2)))
                    g = tl.sum(w_lo * z_e[None, :, :] + w_hi * z_o[None, :, :], axis=2)             # [2R, G]
                    acc = tl.where((o_t == t)[:, None], tl.sum(g * f_s, axis=1)[None, :], acc)
                # rows of acc are tokens, columns the stacked w1 / w3 rows: split into gate and up
                gate, up_ = tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, ROWS)), (0, 2, 1)))
                gate = gate.to(dtype).to(tl.float32)
                up_ = up_.to(dtype).to(tl.float32)
                b_h = _situ_glu(gate, up_, beta, linear_beta, HAS_BETA, HAS_LINEAR_BETA)
                o_ih = i_r * ROWS + tl.arange(0, ROWS)
                p_hi = p_h + pairs[:, None].to(tl.int64) * s_hp + o_ih[None, :]
                tl.store(p_hi, b_h.to(dtype), mask=m_j[:, None] & (o_ih < I)[None, :])


GEMV_MAX_M = 4   # tokens a program multiplies in turn (each one more pass over the converted weights)


def gate_up_gemv(z: torch.Tensor, experts: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, s1: torch.Tensor,
                 s3: torch.Tensor, beta: Optional[float], linear_beta: Optional[float], *, rows: int = 4,
                 num_warps: int = 4, pdl: bool = False, mode: int = 2, h: Optional[torch.Tensor] = None,
                 sink: Optional[torch.Tensor] = None) -> torch.Tensor:
    """h [M·A, I] in z's dtype (SiTU-GLU of the gate and up products, as ``triton.py``'s gate/up kernel) for MXFP4
    w1 / w3 (codes [E, I, L/2], scales [E, I, L/32], contiguous along L); M <= ``GEMV_MAX_M``. ``mode`` < 2
    (diagnostics) writes one float per program into ``sink`` instead."""
    m, l = z.shape
    a = experts.shape[1]
    e_count, i_width = w1.shape[0], w1.shape[1]
    if m > GEMV_MAX_M:
        raise ValueError(f"gate_up_gemv: M={m} > {GEMV_MAX_M}")
    if l % 32 or any(t.stride(-1) != 1 for t in (w1, w3, s1, s3)) or z.stride(1) != 1:
        raise ValueError("gate_up_gemv: L a multiple of 32, codes / scales / z contiguous along L")
    if rows < 1 or rows & (rows - 1):
        raise ValueError(f"gate_up_gemv: rows={rows}, a power of two")
    ids = experts.reshape(-1).contiguous()
    if h is None:
        h = torch.empty((m * a, i_width), dtype=z.dtype, device=z.device)
    grid = (m * a, triton.cdiv(i_width, rows))
    if sink is None:
        sink = torch.empty(grid[0] * grid[1], dtype=torch.float32, device=z.device)
    _gate_up_gemv_kernel[grid](
        z, ids, w1, w3, s1, s3, h, sink, m, a, e_count, i_width, l,
        beta if beta is not None else 1.0, linear_beta if linear_beta is not None else 1.0,
        z.stride(0), w1.stride(0), w1.stride(1), w3.stride(0), w3.stride(1), s1.stride(0), s1.stride(1),
        s3.stride(0), s3.stride(1), h.stride(0),
        BLOCK_M=triton.next_power_of_2(m), BLOCK_A=triton.next_power_of_2(a), ROWS=rows,
        GROUPS=triton.next_power_of_2(l // 32), HAS_BETA=beta is not None, HAS_LINEAR_BETA=linear_beta is not None,
        PDL=pdl, MODE=mode, num_warps=num_warps, num_stages=1)
    return h
