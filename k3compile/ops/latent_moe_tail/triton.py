"""One Triton kernel for the latent-MoE tail at small M: RMSNorm + skinny up-projection + shared add.

The [D, L] up-projection weight (7168×3584 bf16, 51 MB) is the whole cost, so the kernel is a weight
stream: program ``(i_n, i_k)`` owns ``BLOCK_N`` output columns for all M (≤ 16) rows and a
``1/SPLIT_K`` slice of the latent width L, so the grid holds several programs per SM and each weight
byte is read once. The per-row rstd factors out of the dot product, so no program needs the whole
latent row:

    each program:   ss[m]    = Σ_{k in slice} x[m,k]²                         (fp32)
                    acc[m,n] = Σ_{k in slice} (x[m,k]·g[k]) · W[n,k]           (tensor cores, fp32)
    reduction:      out[m,n] = (Σ_slices acc) · rsqrt(Σ_slices ss / L + eps) + shared[m,n]

With ``SPLIT_K > 1`` the partial ``acc`` and ``ss`` go to an fp32 workspace and the reduction is done
either by the last program of each column tile to arrive (``reduce="last"``: an arrival counter per
tile that the last program resets to 0, so a CUDA graph can replay the kernel) or by a second small
kernel (``reduce="kernel"``). ``TailConfig(stream_k=True)`` runs the same math as persistent programs
over a flat list of (tile, K block) units instead (``streamk.py``), the weight optionally through TMA.
On sm_90+ the split-K grid can take its weight, latent and norm-weight tiles through TMA (the pipeliner
then loads all three ahead: pointer loads of the latent, which feed the dot only through the scaling by g,
were waited for in every iteration) and run under PDL (``TailConfig``: early trigger, peeled first tile).

Which form runs where, and whether the one kernel beats the split path (``split.py``), is measured:
``tables/<gpu>.json``, read by ``dispatch.py``.

Rounding: ``x·g`` is rounded to the input dtype before the dot (the model rounds ``x·rstd`` then
``·g``; the difference is within the dtype's tolerance). In fp16 that product of an *unnormalised*
latent could overflow, so fp16 defaults to ``PRENORM=True``: each program first computes the full
row's rstd (the latent is M·L elements, a few KB, served from L2) and feeds ``(x·rstd)·g`` to the dot
rounded exactly as the model does.
"""
from __future__ import annotations

import contextlib
from typing import Optional

import torch
import triton
import triton.language as tl

from k3compile.backends import local_memory_budget, sm_count, triton_interpret
from k3compile.ops.arrival_counters import arrival_counters

from . import streamk, triton_config
from .triton_config import MAX_BLOCK_M, TailConfig
from .triton_tiles import (_add_product, _latent_tiles, _row_rstd, _scale_by_norm_weight, _shared_tile,
                           _tail_epilogue, _tail_store, _tma_layout_ok, gdc_launch_dependents, gdc_wait, pdl_capable,
                           tma_capable)


@triton.jit(do_not_specialize=["M"])   # one compiled kernel for every M <= 16
def _latent_moe_tail_kernel(
    p_x, p_s, p_g, p_w, w_desc, x_desc, g_desc, p_o, p_ws, p_ss, p_cnt,
    M, D, L, K_PER_SPLIT, eps,
    s_xm, s_xk, s_sm, s_sn, s_wn, s_wk, s_om, s_on,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    LAST_REDUCES: tl.constexpr, SWAP_AB: tl.constexpr, PRENORM: tl.constexpr,
    IEEE_DOT: tl.constexpr, UPCAST_DOT: tl.constexpr, TMA: tl.constexpr,
    PDL: tl.constexpr, EARLY_TRIGGER: tl.constexpr, PRELOAD: tl.constexpr, RING: tl.constexpr,
    LATENT_TMA: tl.constexpr,
):
    # the K slices of one column tile are neighbours in launch order: they finish close together,
    # so the last-arrival reductions spread over the run instead of piling up at its end
    pid = tl.program_id(0)
    i_n = pid // SPLIT_K
    i_k = pid % SPLIT_K
    o_m = tl.arange(0, BLOCK_M)
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_m = o_m < M
    m_n = o_n < D
    k_lo = i_k * K_PER_SPLIT
    k_hi = tl.minimum(k_lo + K_PER_SPLIT, L)
    p_w_rows = p_w + o_n[:, None].to(tl.int64) * s_wn   # D·L may pass 2**31

    k_loop = k_lo
    if PRELOAD:
        # the caller promised a static weight: the first tile is read before the wait (PDL)
        b_w0 = _split_weight_tile(p_w_rows, w_desc, i_n, k_lo, k_hi, m_n, s_wk, BLOCK_N, BLOCK_K, TMA)
        k_loop = k_lo + BLOCK_K
    if PDL and not RING:
        gdc_wait()   # everything but the weight: latent, shared, workspace, counters, out
        if EARLY_TRIGGER:
            # the next kernel may launch now (a one-wave grid: its waiting programs take no slot ours need).
            # After our own wait, never before: the static-weight proof needs that of every PDL kernel.
            gdc_launch_dependents()

    if SPLIT_K == 1 and not RING:
        # this program writes its tile: its `shared` rows now (after the wait: the previous kernel may write
        # them), the round trip hidden under the loop; after it, it cost 0.36 µs of 15.6 (H200, M = 16)
        b_s = _shared_tile(p_s, o_m, o_n, m_m, m_n, s_sm, s_sn)
    if PRENORM:
        b_rstd = _row_rstd(p_x, o_m, m_m, s_xm, s_xk, L, eps, BLOCK_M, BLOCK_K)
    else:
        b_rstd = tl.zeros([BLOCK_M], dtype=tl.float32)   # unused: rstd scales the accumulator instead
    # squares summed elementwise, rows reduced once after the loop: a reduction across the warps in every
    # iteration (shared memory, barriers) held the weight pipeline up; so did x·xᵀ on the tensor cores
    # (its diagonal: +0.37 µs at M = 16)
    b_sq = tl.zeros([BLOCK_M, BLOCK_K], dtype=tl.float32)
    if SWAP_AB:
        b_acc_t = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        b_acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_loop, k_hi, BLOCK_K):
        o_k = k0 + tl.arange(0, BLOCK_K)
        m_k = o_k < k_hi
        b_w = _split_weight_tile(p_w_rows, w_desc, i_n, k0, k_hi, m_n, s_wk, BLOCK_N, BLOCK_K, TMA)
        if RING:
            # The wait sits in the loop, and the latent's and norm weight's addresses depend on it: the
            # pipeliner may then issue only the weight tiles of its prologue before the wait (a load whose
            # address does not depend on the wait may be hoisted above one placed before the loop, too).
            # Waiting and triggering again are no-ops.
            tok = _wait_token()
            if EARLY_TRIGGER:
                gdc_launch_dependents()
            b_x, b_g = _latent_tiles(p_x + tok, p_g + tok, o_m, m_m, o_k, m_k, s_xm, s_xk)
        elif LATENT_TMA:
            # the latent and norm weight tiles by TMA too: the pipeliner loads them ahead with the weight's
            # (pointer loads that do not feed the dot directly were waited for in every iteration)
            b_x = x_desc.load([0, k0])
            b_g = g_desc.load([0, k0])
        else:
            b_x, b_g = _latent_tiles(p_x, p_g, o_m, m_m, o_k, m_k, s_xm, s_xk)
        b_h, b_sq_k = _scale_by_norm_weight(b_x, b_g, b_rstd, PRENORM)
        b_sq += b_sq_k
        if SWAP_AB:
            b_acc_t = _add_product(b_acc_t, b_h, b_w, True, IEEE_DOT, UPCAST_DOT)
        else:
            b_acc = _add_product(b_acc, b_h, b_w, False, IEEE_DOT, UPCAST_DOT)
    if SWAP_AB:
        b_acc = tl.trans(b_acc_t)
    if PRELOAD:   # the peeled first tile, after the loop: the loop's first loads are not held up by it
        o_k = k_lo + tl.arange(0, BLOCK_K)
        b_x, b_g = _latent_tiles(p_x, p_g, o_m, m_m, o_k, o_k < k_hi, s_xm, s_xk)
        b_h, b_sq_k = _scale_by_norm_weight(b_x, b_g, b_rstd, PRENORM)
        b_sq += b_sq_k
        b_acc = _add_product(b_acc, b_h, b_w0, False, IEEE_DOT, UPCAST_DOT)
    b_ss = tl.sum(b_sq, axis=1)
    if PDL:
        if RING:
            gdc_wait()   # (a no-op: the loop ran at least once) before any store
        if not EARLY_TRIGGER or RING:
            gdc_launch_dependents()   # after our own wait (see above)

    if SPLIT_K == 1:
        if RING:   # the wait was in the loop: only now may `shared` be read
            b_s = _shared_tile(p_s, o_m, o_n, m_m, m_n, s_sm, s_sn)
        _tail_store(b_acc, b_ss, b_s, p_o, o_m, o_n, m_m, m_n, L, eps, s_om, s_on, PRENORM)
    else:
        # partials: acc to ws[i_k, m, n], ss to ss_ws[i_n, i_k, m] (each tile's own copy, so the
        # tile's last program reads only what its own slices wrote)
        m_o = m_m[:, None] & m_n[None, :]
        tl.store(p_ws + (i_k * M + o_m[:, None]) * D + o_n[None, :], b_acc, mask=m_o)
        tl.store(p_ss + (i_n * SPLIT_K + i_k) * BLOCK_M + o_m, b_ss)
        if LAST_REDUCES:
            # every thread's partials are written before the counter moves (release); the last
            # arrival reads the others' through L2 (acquire, .cg) and puts the counter back to 0
            tl.debug_barrier()
            arrived = tl.atomic_add(p_cnt + i_n, 1, sem="acq_rel", scope="gpu")
            if arrived == SPLIT_K - 1:
                _tail_reduce(p_ws, p_ss, p_s, p_o, i_n, o_m, o_n, m_m, m_n, M, D, L, eps,
                             s_sm, s_sn, s_om, s_on, BLOCK_M, BLOCK_N, SPLIT_K, PRENORM)
                tl.atomic_xchg(p_cnt + i_n, 0, sem="relaxed", scope="gpu")


@triton.jit
def _wait_token():
    """``griddepcontrol.wait`` returning 0, to be added to the addresses that must not be read before it."""
    return tl.inline_asm_elementwise("griddepcontrol.wait; mov.u32 $0, 0;", "=r", [], dtype=tl.int32,
                                     is_pure=False, pack=1)


@triton.jit
def _split_weight_tile(p_w_rows, w_desc, i_n, k0, k_hi, m_n, s_wk, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       TMA: tl.constexpr):
    """The [BLOCK_N, BLOCK_K] weight tile at column ``k0`` of column tile ``i_n`` (zeros past D and k_hi;
    through TMA: zeros past D and L, and the latent tile's zeros past k_hi cancel the rest)."""
    if TMA:
        b_w = w_desc.load([i_n * BLOCK_N, k0])
    else:
        o_k = k0 + tl.arange(0, BLOCK_K)
        # each weight byte is read once: keep it from pushing the latent and the partials out of L2
        b_w = tl.load(p_w_rows + o_k[None, :] * s_wk, mask=m_n[:, None] & (o_k < k_hi)[None, :], other=0.,
                      eviction_policy="evict_first")
    return b_w


@triton.jit
def _tail_reduce(p_ws, p_ss, p_s, p_o, i_n, o_m, o_n, m_m, m_n, M, D, L, eps, s_sm, s_sn, s_om, s_on,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT_K: tl.constexpr, PRENORM: tl.constexpr):
    m_o = m_m[:, None] & m_n[None, :]
    b_acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    b_ss = tl.zeros([BLOCK_M], dtype=tl.float32)
    for s in range(SPLIT_K):
        b_acc += tl.load(p_ws + (s * M + o_m[:, None]) * D + o_n[None, :], mask=m_o, other=0.,
                         cache_modifier=".cg")
        b_ss += tl.load(p_ss + (i_n * SPLIT_K + s) * BLOCK_M + o_m, cache_modifier=".cg")
    _tail_epilogue(b_acc, b_ss, p_s, p_o, o_m, o_n, m_m, m_n, L, eps, s_sm, s_sn, s_om, s_on, PRENORM)


@triton.jit(do_not_specialize=["M"])
def _tail_reduce_kernel(
    p_ws, p_ss, p_s, p_o, M, D, L, eps, s_sm, s_sn, s_om, s_on,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT_K: tl.constexpr, PRENORM: tl.constexpr,
):
    i_n = tl.program_id(0)
    o_m = tl.arange(0, BLOCK_M)
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    _tail_reduce(p_ws, p_ss, p_s, p_o, i_n, o_m, o_n, o_m < M, o_n < D, M, D, L, eps,
                 s_sm, s_sn, s_om, s_on, BLOCK_M, BLOCK_N, SPLIT_K, PRENORM)


def latent_moe_tail_triton(latent: torch.Tensor, shared: torch.Tensor, norm_weight: torch.Tensor,
                           up_weight: torch.Tensor, eps: float,
                           config: Optional[TailConfig] = None,
                           out: Optional[torch.Tensor] = None, static_weight: bool = False) -> torch.Tensor:
    """The fused tail in one launch (two with ``reduce="kernel"``); ``out`` [M, D] is
    allocated unless given (tests pass a NaN-poisoned one). M ≤ 16, one dtype (bf16 / fp16 / fp32);
    ``config``: the dispatch's (``dispatch.triton_config``), else the heuristic's (``triton_config.heuristic``).

    ``static_weight=True`` promises that no kernel writes ``up_weight`` (a parameter; k3compile's
    static-weight pass proves it in the graph): the stream-K form then loads each program's first weight
    tile before its PDL wait, overlapping the previous kernel's tail (launched with PDL on sm_90+; in the
    interpreter only the load order changes). The split-K grid form loads its first tile before the wait
    where the configuration asks for it (``preload`` with ``pdl``)."""
    m, l = latent.shape
    d = up_weight.shape[0]
    if m > MAX_BLOCK_M:
        raise ValueError(f"latent_moe_tail_triton: M={m} > {MAX_BLOCK_M}")
    if config is None:
        config = triton_config.heuristic(m, d, l, latent.dtype, sm_count(latent.device))
    if out is None:
        out = torch.empty((m, d), dtype=latent.dtype, device=latent.device)
    if m == 0 or d == 0:
        return out
    if not norm_weight.is_contiguous():
        norm_weight = norm_weight.contiguous()
    upcast = latent.dtype != torch.float32 and triton_interpret()
    config = triton_config.fit_local_memory(config, latent.element_size(), local_memory_budget(latent.device))
    if config.stream_k:
        return streamk.launch_stream_k(latent, shared, norm_weight, up_weight, eps, config, out, upcast, static_weight)
    k_per_split = triton.cdiv(triton.cdiv(l, config.split_k), config.block_k) * config.block_k
    split_k = max(1, triton.cdiv(l, k_per_split))
    n_tiles = triton.cdiv(d, config.block_n)
    counters = None
    if split_k > 1:
        ws = torch.empty((split_k, m, d), dtype=torch.float32, device=latent.device)
        ss = torch.empty((n_tiles, split_k, MAX_BLOCK_M), dtype=torch.float32, device=latent.device)
        if config.reduce == "last":
            counters = arrival_counters(latent.device, n_tiles)
    else:
        ws = ss = out
    last_reduces = split_k > 1 and counters is not None
    strides = (shared.stride(0), shared.stride(1), out.stride(0), out.stride(1))
    on_gpu = pdl_capable(latent.device)   # sm_90+ NVIDIA: TMA and PDL
    w_desc = x_desc = g_desc = up_weight
    # TMA on sm_90+, and in the interpreter (tests); pointer loads on other GPUs and where the layout forbids it
    tma = config.tma and tma_capable(latent.device) and _tma_layout_ok(up_weight)
    if tma:
        from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: PLC0415

        w_desc = TensorDescriptor.from_tensor(up_weight, [config.block_n, config.block_k])
    pdl = config.pdl and on_gpu
    # the peeled tile: wherever the caller promised a static weight (off the GPU only the order changes)
    preload = config.preload and config.pdl and static_weight
    # the weight ring before the wait: a static weight, on the GPU (the interpreter has no PDL), prenorm's
    # row pass reads the latent before the loop
    ring = config.ring and pdl and static_weight and not config.prenorm and not preload
    # the latent and norm weight by TMA as well (not with the ring: their loads must wait in the loop)
    latent_tma = tma and not ring and _tma_layout_ok(latent) and _tma_layout_ok(norm_weight.view(1, l))
    if latent_tma:
        x_desc = TensorDescriptor.from_tensor(latent, [MAX_BLOCK_M, config.block_k])
        g_desc = TensorDescriptor.from_tensor(norm_weight.view(1, l), [1, config.block_k])
    # Triton launches on the current device: make it the tensors' (TP ranks, a model on cuda:1)
    on_device = torch.cuda.device(latent.device) if latent.device.type == "cuda" else contextlib.nullcontext()
    with on_device:
        _latent_moe_tail_kernel[(n_tiles * split_k,)](
            latent, shared, norm_weight, up_weight, w_desc, x_desc, g_desc, out, ws, ss,
            counters if last_reduces else out,
            m, d, l, k_per_split, float(eps),
            latent.stride(0), latent.stride(1), shared.stride(0), shared.stride(1),
            up_weight.stride(0), up_weight.stride(1), out.stride(0), out.stride(1),
            BLOCK_M=MAX_BLOCK_M, BLOCK_N=config.block_n, BLOCK_K=config.block_k, SPLIT_K=split_k,
            LAST_REDUCES=last_reduces, SWAP_AB=config.swap_ab, PRENORM=config.prenorm,
            # The interpreter (triton 3.7) multiplies 16-bit dot operands wrongly: give it fp32
            # (16-bit products are exact in fp32, so the rounding is the GPU kernel's).
            IEEE_DOT=latent.dtype == torch.float32 or upcast, UPCAST_DOT=upcast, TMA=tma,
            PDL=pdl, EARLY_TRIGGER=config.early_trigger, PRELOAD=preload, RING=ring, LATENT_TMA=latent_tma,
            num_warps=config.num_warps, num_stages=config.num_stages, **(dict(launch_pdl=True) if pdl else {}),
        )
        if split_k > 1 and not last_reduces:
            _tail_reduce_kernel[(n_tiles,)](
                ws, ss, shared, out, m, d, l, float(eps), *strides,
                BLOCK_M=MAX_BLOCK_M, BLOCK_N=config.block_n, SPLIT_K=split_k, PRENORM=config.prenorm,
                num_warps=4,
            )
    return out
