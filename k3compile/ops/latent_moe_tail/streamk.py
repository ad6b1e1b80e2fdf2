"""Stream-K form of the one-kernel Triton tail (``TailConfig(stream_k=True)``): persistent programs.

The split-K grid of ``triton.py`` gives every program a short run (a few K blocks of one column tile):
each program starts with an empty load pipeline, and 2-3 waves of such programs leave the HBM stream
idle at every program boundary (measured on the H200: ≥ 19 µs for a 12 µs weight). Here the work is
the flat list of (column tile, K block) units, ``U = ceil(D / BLOCK_N) · ceil(L / BLOCK_K)``, cut into
``P`` equal contiguous ranges, one per program (``P`` = SMs × ``ctas_per_sm``, one wave). A program
walks its range in one loop, so the software pipeline stays full across column tiles; where its range
leaves a tile (or ends) it writes that tile's partial ``acc`` and ``ss`` to an fp32 workspace. The tile's
partials (from the programs that touched it) are then added, rstd applied, ``shared`` added and the sum
cast, either by the last of those programs to get there (``reduce="last"``: one launch, an arrival
counter per tile that this program resets) or by a second small kernel (``reduce="kernel"``).

PDL (``TailConfig.pdl`` or ``static_weight``, sm_90+): the kernels are launched with programmatic
dependent launch and wait (``gdc_wait``) before touching anything another kernel may write or read
(latent, shared, workspace, counters, out). Before the wait only the weight is touched: an L2 prefetch of
the program's first tile, or with ``static_weight`` (no kernel writes it: the caller proved it) the
tile itself. Each kernel lets the next one launch only after its own wait (the static-weight proof
needs that of every PDL kernel).

Program ``p`` owns units ``[p·U // P, (p+1)·U // P)``; the program that owns unit ``u`` is
``((u + 1)·P - 1) // U`` (P ≤ U, so no program is empty). A tile's partial from program ``p`` goes to
slot ``p - first_program(tile)`` of that tile's ``MAX_SEG`` slots.
"""
from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from k3compile.backends import sm_count
from k3compile.ops.arrival_counters import arrival_counters

from .triton_config import MAX_BLOCK_M
from .triton_tiles import (_add_product, _latent_tile, _row_rstd, _tail_epilogue, _tma_layout_ok, gdc_launch_dependents,
                           gdc_wait, pdl_capable, tma_capable)


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


@triton.jit
def _weight_tile(p_w, w_desc, u, KB, D, L, s_wn, s_wk, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 TMA: tl.constexpr):
    """The [BLOCK_N, BLOCK_K] weight tile of unit ``u`` (zeros past D and L)."""
    i_t = u // KB
    i_kb = u - i_t * KB
    if TMA:   # a tensor-memory-accelerator copy of the tile (zero-filled past D and L)
        b_w = w_desc.load([i_t * BLOCK_N, i_kb * BLOCK_K])
    else:
        o_n = i_t * BLOCK_N + tl.arange(0, BLOCK_N)
        o_k = i_kb * BLOCK_K + tl.arange(0, BLOCK_K)
        b_w = tl.load(p_w + o_n[:, None].to(tl.int64) * s_wn + o_k[None, :] * s_wk,
                      mask=(o_n < D)[:, None] & (o_k < L)[None, :], other=0., eviction_policy="evict_first")
    return b_w


@triton.jit
def _prefetch_tile(p_w, u, KB, D, L, s_wn, s_wk, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Unit ``u``'s weight tile into L2, one prefetch per 128-byte line (rows and columns clamped)."""
    i_t = u // KB
    LINE: tl.constexpr = 1024 // p_w.dtype.element_ty.primitive_bitwidth   # elements per 128-byte line
    N_LINES: tl.constexpr = max(1, BLOCK_K // LINE)
    o_pn = tl.minimum(i_t * BLOCK_N + tl.arange(0, BLOCK_N), D - 1)
    o_pk = tl.minimum((u - i_t * KB) * BLOCK_K + tl.arange(0, N_LINES) * LINE, L - 1)
    p_pf = p_w + o_pn[:, None].to(tl.int64) * s_wn + o_pk[None, :] * s_wk
    tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [p_pf], dtype=tl.int32,
                              is_pure=False, pack=1)


@triton.jit
def _unit(u, b_w, b_acc_t, b_ss, b_rstd, pid, u_hi, p_x, p_g, p_ws, p_ss, o_m, m_m, o_nn,
          L, U, KB, P, MAX_SEG, s_xm, s_xk,
          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
          PRENORM: tl.constexpr, IEEE_DOT: tl.constexpr, UPCAST_DOT: tl.constexpr):
    """Unit ``u`` (its weight tile ``b_w`` loaded) into the running partial; where the program leaves
    the column tile, the partial goes to the tile's slot and starts again from zero."""
    i_t = u // KB
    i_kb = u - i_t * KB
    o_k = i_kb * BLOCK_K + tl.arange(0, BLOCK_K)
    b_h, b_ss_k = _latent_tile(p_x, p_g, o_m, m_m, o_k, o_k < L, s_xm, s_xk, b_rstd, PRENORM)
    b_ss += b_ss_k
    b_acc_t = _add_product(b_acc_t, b_h, b_w, True, IEEE_DOT, UPCAST_DOT)
    if (i_kb == KB - 1) | (u == u_hi - 1):
        row = i_t * MAX_SEG + pid - _owner(i_t * KB, U, P)
        tl.store(p_ws + (row * BLOCK_M + o_m[None, :]) * BLOCK_N + o_nn[:, None], b_acc_t, mask=m_m[None, :])
        tl.store(p_ss + row * BLOCK_M + o_m, b_ss)
        b_acc_t = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        b_ss = tl.zeros([BLOCK_M], dtype=tl.float32)
    return b_acc_t, b_ss


@triton.jit(do_not_specialize=["M"])
def _tail_streamk_kernel(
    p_x, p_g, p_w, w_desc, p_ws, p_ss, p_s, p_o, p_cnt,
    M, D, L, U, KB, P, MAX_SEG, eps,
    s_xm, s_xk, s_wn, s_wk, s_sm, s_sn, s_om, s_on,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PRENORM: tl.constexpr, IEEE_DOT: tl.constexpr, UPCAST_DOT: tl.constexpr, TMA: tl.constexpr,
    PDL: tl.constexpr, STATIC_W: tl.constexpr, ONE_LAUNCH: tl.constexpr, PDL_TILES: tl.constexpr,
):
    pid = tl.program_id(0)
    u_lo = (pid * U) // P
    u_hi = ((pid + 1) * U) // P
    o_m = tl.arange(0, BLOCK_M)
    m_m = o_m < M
    o_nn = tl.arange(0, BLOCK_N)
    # Before the PDL wait (the previous kernel may still run): only the weight, the first PDL_TILES tiles
    # of this program's run. STATIC_W (the caller promises no kernel writes it) loads the first tile
    # outright; the others (all of them without STATIC_W) are only prefetched into L2, which stays
    # coherent with any write still to come.
    if STATIC_W:
        b_w0 = _weight_tile(p_w, w_desc, u_lo, KB, D, L, s_wn, s_wk, BLOCK_N, BLOCK_K, TMA)
    if PDL:
        for j in tl.static_range(1 if STATIC_W else 0, PDL_TILES):
            _prefetch_tile(p_w, tl.minimum(u_lo + j, u_hi - 1), KB, D, L, s_wn, s_wk, BLOCK_N, BLOCK_K)
    if PDL:
        gdc_wait()   # the latent, the workspace (the previous call's reduction reads it) and all stores
    if PRENORM:
        b_rstd = _row_rstd(p_x, o_m, m_m, s_xm, s_xk, L, eps, BLOCK_M, BLOCK_K)
    else:
        b_rstd = tl.zeros([BLOCK_M], dtype=tl.float32)   # unused: rstd scales the accumulator instead
    b_ss = tl.zeros([BLOCK_M], dtype=tl.float32)
    b_acc_t = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)   # outᵀ tile: the weight is the MMA's M side
    u_first = u_lo
    if STATIC_W:
        b_acc_t, b_ss = _unit(u_lo, b_w0, b_acc_t, b_ss, b_rstd, pid, u_hi, p_x, p_g, p_ws, p_ss, o_m, m_m,
                              o_nn, L, U, KB, P, MAX_SEG, s_xm, s_xk,
                              BLOCK_M, BLOCK_N, BLOCK_K, PRENORM, IEEE_DOT, UPCAST_DOT)
        u_first = u_lo + 1
    for u in range(u_first, u_hi):
        b_w = _weight_tile(p_w, w_desc, u, KB, D, L, s_wn, s_wk, BLOCK_N, BLOCK_K, TMA)
        b_acc_t, b_ss = _unit(u, b_w, b_acc_t, b_ss, b_rstd, pid, u_hi, p_x, p_g, p_ws, p_ss, o_m, m_m,
                              o_nn, L, U, KB, P, MAX_SEG, s_xm, s_xk,
                              BLOCK_M, BLOCK_N, BLOCK_K, PRENORM, IEEE_DOT, UPCAST_DOT)
    if ONE_LAUNCH:
        # After the loop (a reduction inside it stops Triton from pipelining the weight loads): for each
        # tile this program touched, the last of the tile's programs to arrive reduces it and puts the
        # tile's counter back to 0 for the next launch. Every thread's partials are written before the
        # counter moves (release); the last arrival reads the others' through L2 (acquire, .cg).
        tl.debug_barrier()
        for i_t in range(u_lo // KB, (u_hi - 1) // KB + 1):
            n_progs = _owner(i_t * KB + KB - 1, U, P) - _owner(i_t * KB, U, P) + 1
            arrived = tl.atomic_add(p_cnt + i_t, 1, sem="acq_rel", scope="gpu")
            if arrived == n_progs - 1:
                _reduce_tile(p_ws, p_ss, p_s, p_o, i_t, M, D, L, U, KB, P, MAX_SEG, eps, s_sm, s_sn, s_om, s_on,
                             BLOCK_M, BLOCK_N, PRENORM)
                tl.atomic_xchg(p_cnt + i_t, 0, sem="relaxed", scope="gpu")
    if PDL:
        # Only now, after our own wait and the K loop: a kernel that starts early may stream a static
        # weight before its wait, and the proof that no kernel still running writes that weight
        # (k3compile's static-weight pass) needs every PDL kernel to trigger after its own wait.
        gdc_launch_dependents()


@triton.jit
def _reduce_tile(p_ws, p_ss, p_s, p_o, i_t, M, D, L, U, KB, P, MAX_SEG, eps, s_sm, s_sn, s_om, s_on,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRENORM: tl.constexpr):
    """Column tile ``i_t``: the partials of the programs that touched it (through L2: some were written by
    other programs of the same launch), then rstd, the shared add and the cast."""
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
                         mask=m_m[:, None], other=0., cache_modifier=".cg")
        b_ss += tl.load(p_ss + row * BLOCK_M + o_m, cache_modifier=".cg")
    _tail_epilogue(b_acc, b_ss, p_s, p_o, o_m, o_n, m_m, o_n < D, L, eps, s_sm, s_sn, s_om, s_on, PRENORM)


@triton.jit(do_not_specialize=["M"])
def _tail_streamk_reduce_kernel(
    p_ws, p_ss, p_s, p_o, M, D, L, U, KB, P, MAX_SEG, eps, s_sm, s_sn, s_om, s_on,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRENORM: tl.constexpr, PDL: tl.constexpr,
):
    if PDL:
        gdc_wait()   # the partials are the stream-K kernel's output
        gdc_launch_dependents()   # after our own wait (see the stream-K kernel)
    _reduce_tile(p_ws, p_ss, p_s, p_o, tl.program_id(0), M, D, L, U, KB, P, MAX_SEG, eps, s_sm, s_sn, s_om, s_on,
                 BLOCK_M, BLOCK_N, PRENORM)


def launch_stream_k(latent, shared, norm_weight, up_weight, eps, config, out, upcast, static_weight):
    """The stream-K form (``config.stream_k``) of ``triton.latent_moe_tail_triton``, into ``out``."""
    m, l = latent.shape
    d = up_weight.shape[0]
    n_tiles = triton.cdiv(d, config.block_n)
    k_blocks = triton.cdiv(l, config.block_k)
    sms = max(1, sm_count(latent.device))   # the interpreter: one "SM"
    units, programs, max_seg = plan(n_tiles, k_blocks, sms * config.ctas_per_sm)
    slots = n_tiles * max_seg * MAX_BLOCK_M   # per tile, max_seg partials of [16, block_n]
    ws = torch.empty((slots * config.block_n,), dtype=torch.float32, device=latent.device)
    ss = torch.empty((slots,), dtype=torch.float32, device=latent.device)
    # one launch: the last program to leave a tile reduces it (None inside a first capture: two launches)
    counters = arrival_counters(latent.device, n_tiles) if config.reduce == "last" else None
    grid_args = (units, k_blocks, programs, max_seg, float(eps))
    w_desc = up_weight
    tma = config.tma and tma_capable(latent.device) and _tma_layout_ok(up_weight)
    if tma:
        from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: PLC0415

        w_desc = TensorDescriptor.from_tensor(up_weight, [config.block_n, config.block_k])
    pdl = (config.pdl or static_weight) and pdl_capable(latent.device)
    launch = dict(launch_pdl=True) if pdl else {}
    on_device = torch.cuda.device(latent.device) if latent.device.type == "cuda" else contextlib.nullcontext()
    with on_device:
        _tail_streamk_kernel[(programs,)](
            latent, norm_weight, up_weight, w_desc, ws, ss, shared, out, counters if counters is not None else ss,
            m, d, l, *grid_args,
            latent.stride(0), latent.stride(1), up_weight.stride(0), up_weight.stride(1),
            shared.stride(0), shared.stride(1), out.stride(0), out.stride(1),
            BLOCK_M=MAX_BLOCK_M, BLOCK_N=config.block_n, BLOCK_K=config.block_k, PRENORM=config.prenorm,
            IEEE_DOT=latent.dtype == torch.float32 or upcast, UPCAST_DOT=upcast, TMA=tma,
            PDL=pdl, STATIC_W=static_weight, ONE_LAUNCH=counters is not None, PDL_TILES=config.pdl_tiles,
            num_warps=config.num_warps, num_stages=config.num_stages, **launch,
        )
        if counters is not None:
            return out
        _tail_streamk_reduce_kernel[(n_tiles,)](
            ws, ss, shared, out, m, d, l, *grid_args,
            shared.stride(0), shared.stride(1), out.stride(0), out.stride(1),
            BLOCK_M=MAX_BLOCK_M, BLOCK_N=config.block_n, PRENORM=config.prenorm, PDL=pdl, num_warps=4, **launch,
        )
    return out
