"""Stream-K form of the one-kernel Triton tail (``TailConfig(stream_k=True)``): persistent programs.

The split-K grid of ``triton.py`` gives every program a short run (a few K blocks of one column tile):
each program starts with an empty load pipeline, and 2-3 waves of such programs leave the HBM stream
idle at every program boundary (measured on the H200: ≥ 19 µs for a 12 µs weight). Here the work is
the flat list of (column tile, K block) units, ``U = ceil(D / BLOCK_N) · ceil(L / BLOCK_K)``, cut into
``P`` equal contiguous ranges, one per program (``P`` = SMs × ``ctas_per_sm``, one wave). A program
walks its range in one loop, so the software pipeline stays full across column tiles; where its range
leaves a tile (or ends) it writes that tile's partial ``acc`` and ``ss`` to an fp32 workspace. A second
small kernel adds each tile's partials (from the programs that touched it) and applies rstd, the
shared add and the cast, like ``triton._tail_reduce``.

Program ``p`` owns units ``[p·U // P, (p+1)·U // P)``; the program that owns unit ``u`` is
``((u + 1)·P - 1) // U`` (P ≤ U, so no program is empty). A tile's partial from program ``p`` goes to
slot ``p - first_program(tile)`` of that tile's ``MAX_SEG`` slots.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .triton import _latent_tile, _row_rstd, _tail_epilogue


def plan(n_tiles: int, k_blocks: int, programs: int) -> tuple[int, int, int]:
    """(units U, programs P, partial slots per tile MAX_SEG) for this grid."""
    units = n_tiles * k_blocks
    programs = max(1, min(programs, units))
    # a tile's K blocks meet at most k_blocks // (U // P) programs whole, plus one partial at each end
    max_seg = k_blocks // (units // programs) + 2
    return units, programs, min(max_seg, programs)


@triton.jit
def _owner(u, U, P):
    return ((u + 1) * P - 1) // U


@triton.jit(do_not_specialize=["M"])
def _tail_streamk_kernel(
    p_x, p_g, p_w, w_desc, p_ws, p_ss,
    M, D, L, U, KB, P, MAX_SEG, eps,
    s_xm, s_xk, s_wn, s_wk,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PRENORM: tl.constexpr, IEEE_DOT: tl.constexpr, UPCAST_DOT: tl.constexpr, TMA: tl.constexpr,
):
    pid = tl.program_id(0)
    u_lo = (pid * U) // P
    u_hi = ((pid + 1) * U) // P
    o_m = tl.arange(0, BLOCK_M)
    m_m = o_m < M
    o_nn = tl.arange(0, BLOCK_N)
    if PRENORM:
        b_rstd = _row_rstd(p_x, o_m, m_m, s_xm, s_xk, L, eps, BLOCK_M, BLOCK_K)
    else:
        b_rstd = tl.zeros([BLOCK_M], dtype=tl.float32)   # unused: rstd scales the accumulator instead
    b_ss = tl.zeros([BLOCK_M], dtype=tl.float32)
    b_acc_t = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)   # outᵀ tile: the weight is the MMA's M side
    for u in range(u_lo, u_hi):
        i_t = u // KB
        i_kb = u - i_t * KB
        o_n = i_t * BLOCK_N + o_nn
        o_k = i_kb * BLOCK_K + tl.arange(0, BLOCK_K)
        m_k = o_k < L
        b_h, b_ss_k = _latent_tile(p_x, p_g, o_m, m_m, o_k, m_k, s_xm, s_xk, b_rstd, PRENORM)
        b_ss += b_ss_k
        if TMA:   # a tensor-memory-accelerator copy of the tile (zero-filled past D and L)
            b_w = w_desc.load([i_t * BLOCK_N, i_kb * BLOCK_K])
        else:
            b_w = tl.load(p_w + o_n[:, None].to(tl.int64) * s_wn + o_k[None, :] * s_wk,
                          mask=(o_n < D)[:, None] & m_k[None, :], other=0., eviction_policy="evict_first")
        if UPCAST_DOT:
            b_h = b_h.to(tl.float32)
            b_w = b_w.to(tl.float32)
        if IEEE_DOT:
            b_acc_t += tl.dot(b_w, tl.trans(b_h), input_precision="ieee")
        else:
            b_acc_t += tl.dot(b_w, tl.trans(b_h))
        if (i_kb == KB - 1) | (u == u_hi - 1):
            # this program leaves the tile: its partial to the tile's slot, then start the next tile
            row = i_t * MAX_SEG + pid - _owner(i_t * KB, U, P)
            tl.store(p_ws + (row * BLOCK_M + o_m[None, :]) * BLOCK_N + o_nn[:, None], b_acc_t,
                     mask=m_m[None, :])
            tl.store(p_ss + row * BLOCK_M + o_m, b_ss)
            b_acc_t = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
            b_ss = tl.zeros([BLOCK_M], dtype=tl.float32)


@triton.jit(do_not_specialize=["M"])
def _tail_streamk_reduce_kernel(
    p_ws, p_ss, p_s, p_o, M, D, L, U, KB, P, MAX_SEG, eps, s_sm, s_sn, s_om, s_on,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRENORM: tl.constexpr,
):
    i_t = tl.program_id(0)
    o_m = tl.arange(0, BLOCK_M)
    o_nn = tl.arange(0, BLOCK_N)
    o_n = i_t * BLOCK_N + o_nn
    m_m = o_m < M
    first = _owner(i_t * KB, U, P)
    count = _owner(i_t * KB + KB - 1, U, P) - first + 1
    b_acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    b_ss = tl.zeros([BLOCK_M], dtype=tl.float32)
    for j in range(count):
        row = i_t * MAX_SEG + j
        b_acc += tl.load(p_ws + (row * BLOCK_M + o_m[:, None]) * BLOCK_N + o_nn[None, :],
                         mask=m_m[:, None], other=0.)
        b_ss += tl.load(p_ss + row * BLOCK_M + o_m)
    _tail_epilogue(b_acc, b_ss, p_s, p_o, o_m, o_n, m_m, o_n < D, L, eps, s_sm, s_sn, s_om, s_on, PRENORM)
