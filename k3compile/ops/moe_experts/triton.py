"""Triton kernels for the routed experts: each selected expert's weights streamed once for all its tokens.

Shape legend: M tokens, A experts per token, P = M·A (token, slot) pairs, E experts, L latent, I intermediate.

Three kernels, launched back to back with PDL on sm_90+:

1. ``_gate_up_kernel``, program (slot, i-tile): finds its expert and the pairs that chose it, then for
   ``BLOCK_M`` of those pairs at a time streams ``w1[e]`` and ``w3[e]`` rows ``[BLOCK_I, L]`` once and takes
   both products with the pairs' z rows (gathered, ``tl.dot``, fp32); SiTU-GLU in the epilogue, with the
   model's roundings (gate and up rounded to z's dtype, h rounded too): ``h [P, I]``.
2. ``_down_kernel``, program (slot, n-tile): the same expert and pairs; ``w2[e]`` rows ``[BLOCK_N, I]`` once,
   ``y = h @ w2ᵀ`` rounded to z's dtype, times the router weight (fp32): ``partial [P, L]``.
3. ``_combine_kernel``, program (token, n-tile): the token's A partials in slot order, one [A, BLOCK_N] load, fp32
   sum, cast: ``out [M, L]``. (The last of a token's pairs summing them in the down kernel, behind arrival
   counters, measured 1.7x slower at M = 1 and 1.8x at M = 16 on the H200: docs/tuning/moe_experts.md.)

How a program finds its expert's pairs (CUDA-graph capturable: no host sync, no data-dependent allocation):

- decode (M ≤ small_m_limit and ≤ 16): grid (P, tiles); program ``p`` reads the [M, A] ids; it runs only if pair
  p is the first pair of its expert (token, then slot order); its rows are the tokens, each masked unless it chose
  the expert (a token holding it twice takes a second round);
- prefill: the pairs sorted by expert on the device (``torch.sort`` + ``searchsorted``: ``order`` and
  ``offsets [E + 1]``); grid (E, tiles); program ``e`` reads its pairs ``order[offsets[e]:offsets[e + 1]]``.

Every pair is covered by exactly one program, whatever the ids (duplicates within a token, every token on one
expert). An id outside [0, E) reads no weight: its pairs' partials are NaN, so those tokens come out NaN.

Other forms of the same math (``config.MoeConfig`` picks; ``benchmarks/moe_experts.py`` measures them):

- ``weight_rows`` (``ROWS``): the gate/up and down kernels take the weights as the products' rows
  (acc [weight rows, tokens] = w · zᵀ: the weights fill the MMA's 64-row side, a wgmma on sm_90, where the tokens
  left 15 of 16 rows empty at M = 1); gate/up stacks ``BLOCK_I`` rows of w1 over the same rows of w3 in one tile;
  z is loaded contiguous and (MXFP4) split into even and odd columns in registers, so every load of the K loop
  pipelines (cp.async);
- ``down_by_token`` (decode): ``triton_token._down_token_kernel`` does the down product and the combine, a program
  per (token, n-tile) streaming the token's A experts in slot order: no partials and no third launch;
- ``split_l`` (decode): the gate/up grid gets a third axis, slices of L (at M = 1, 16 experts x 12 i-tiles fill
  192 programs, under two a GPU of 132 SMs: the slices put more programs, and bytes, in flight); each slice stores its
  fp32 gate and up sums (``ws [S, P, 2, I]``) and counts itself in at its (slot, i-tile)'s arrival counter
  (``k3compile/ops/arrival_counters.py``: zero between launches, no memset, CUDA-graph safe); the last to arrive sums
  the slices in slice order (the same result every run), applies SiTU-GLU and stores h, which the down kernel reads
  as before. No extra launch;
- ``gemv`` (decode): both products as fp32 broadcast multiplies summed on the CUDA cores instead of ``tl.dot``, the
  tokens padded to a power of two from 1 (``tl.dot`` takes 16 rows, 15 of them empty at M = 1).

MXFP4 weights: codes and scales are loaded as bytes and dequantised in registers to z's dtype, exactly as
``model/moe.py`` dequantises them, before the products: interleaved into one tile (``triton_tiles._mxfp4_tile``), or
as even and odd columns (``_mxfp4_halves``; on an NVIDIA GPU in bf16 through byte lookups in PTX, ``E2M1_BF16_PTX``;
in the weight rows form by bit moves, ``E2M1_BF16_BITS_PTX``), or left to Triton's ``tl.dot_scaled``
(``MoeConfig.mxfp4_dot_scaled``, a GPU only: the interpreter lacks it).

PDL (sm_90+): the gate/up kernel waits before reading anything and lets the down kernel launch after its loop;
the down kernel reads the ids, the router weights and its first ``w2`` tile before its wait (the gate/up kernel
triggers only after its own wait, so every kernel before it has completed: only ``h`` is the gate/up kernel's),
and lets the next kernel launch after its loop. ``trigger_early``: each kernel triggers right after its own wait
instead, so the next kernel's programs are resident (and the down kernel's first w2 tile loaded) while this one
streams; still after the wait, so the argument above holds.
"""
from __future__ import annotations

import contextlib
from typing import Optional

import torch
import triton
import triton.language as tl

from k3compile.backends import Reason, is_rocm, triton_pdl_capable
from k3compile.ops.arrival_counters import arrival_counters

from .config import MoeConfig, decode_form, default_config, table, tuned_config  # noqa: F401
from .triton_down import _combine_kernel, _down_kernel
from .triton_tiles import (_act_rows, _act_tiles, _chunk_pairs, _dot2, _glu_store, _my_expert, _rows_tiles,
                           _weight_tiles, gdc_launch_dependents, gdc_wait)
from .triton_token import _down_token_kernel

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


pdl_capable = triton_pdl_capable   # read through this module: tests simulate a GPU by replacing it


# --- kernels ----------------------------------------------------------------------------------------------

@triton.jit(do_not_specialize=["M"])
def _gate_up_kernel(
    p_z, p_ids, p_order, p_offsets, p_w1, p_w3, p_s1, p_s3, p_h, p_ws, p_cnt,
    M, A, E, I, L, STEPS, beta, linear_beta,
    s_zm, s_zl, s_1e, s_1i, s_1l, s_3e, s_3i, s_3l, s_s1e, s_s1i, s_s1l, s_s3e, s_s3i, s_s3l, s_hp,
    BLOCK_M: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_A: tl.constexpr,
    SORTED: tl.constexpr, MXFP4: tl.constexpr, HALVES: tl.constexpr, ASM: tl.constexpr, DOTS: tl.constexpr,
    X_FMT: tl.constexpr, HAS_BETA: tl.constexpr, HAS_LINEAR_BETA: tl.constexpr, IEEE: tl.constexpr,
    UPCAST: tl.constexpr, PDL: tl.constexpr, EARLY: tl.constexpr, EVEN_K: tl.constexpr, ROWS: tl.constexpr,
    SPLIT: tl.constexpr, FMA: tl.constexpr,
):
    """ROWS (``MoeConfig.weight_rows``): ``BLOCK_I`` rows of w1 above the same rows of w3 in one [2·BLOCK_I,
    BLOCK_L] tile, acc [2·BLOCK_I, BLOCK_M] = w · zᵀ split into gate and up after the loop; w1 and w3 then share
    their column strides (``s_1l``, scales ``s_s1l``; the host checks).

    SPLIT > 1 (``MoeConfig.split_l``, decode form): program (slot, i-tile, slice) takes ``STEPS`` steps of L from
    slice·STEPS·BLOCK_L on and stores its fp32 gate and up sums in ``ws [SPLIT, P, 2, I]``; the last of the SPLIT
    programs of its (slot, i-tile) to arrive at counter ``p_cnt[slot, i-tile]`` sums the slices in order, applies
    SiTU-GLU, stores h and sets the counter back to 0. FMA (``MoeConfig.gemv``): products on the CUDA cores."""
    slot = tl.program_id(0)
    i_i = tl.program_id(1)
    if PDL:
        gdc_wait()   # z, the ids and the router weights are the previous kernels' outputs
        if EARLY:
            gdc_launch_dependents()   # after our own wait (static_weights.py, step 1)
    e, runs, start, chunks, count = _my_expert(p_ids, p_offsets, slot, M, A, SORTED, BLOCK_M, BLOCK_A)
    valid = (e >= 0) & (e < E)
    if runs & valid:
        o_i = i_i * BLOCK_I + tl.arange(0, BLOCK_I)
        m_i = o_i < I
        e64 = e.to(tl.int64)   # E·I·L may pass 2**31
        # this program's slice of L: SPLIT > 1, whole steps from l_lo on (EVEN_K's masks and alignments hold); the
        # weight and z pointers start there and the loop runs from 0 (a loop from a per-program start kept ~70 more
        # registers a thread live, sm_90 bf16)
        if SPLIT > 1:
            i_s = tl.program_id(2)
            l_lo = i_s * STEPS * BLOCK_L
            l_len = tl.minimum(STEPS * BLOCK_L, L - l_lo)
        else:
            l_lo = 0
            l_len = L
        if MXFP4:
            c_lo = l_lo // 2   # two codes a byte
        else:
            c_lo = l_lo
        p_w1e = p_w1 + e64 * s_1e + c_lo * s_1l
        p_w3e = p_w3 + e64 * s_3e + c_lo * s_3l
        p_s1e = p_s1 + e64 * s_s1e + (l_lo // 32) * s_s1l
        p_s3e = p_s3 + e64 * s_s3e + (l_lo // 32) * s_s3l
        if ROWS:   # each stacked row's first code (element) and scale
            o_r = tl.arange(0, 2 * BLOCK_I)
            o_ir = i_i * BLOCK_I + o_r % BLOCK_I
            p_wr = tl.where(o_r >= BLOCK_I, p_w3e + o_ir * s_3i, p_w1e + o_ir * s_1i)
            p_sr = tl.where(o_r >= BLOCK_I, p_s3e + o_ir * s_s3i, p_s1e + o_ir * s_s1i)
        dtype = p_z.dtype.element_ty
        for c in range(0, chunks):   # one chunk unless more than BLOCK_M pairs chose e
            pairs, m_j = _chunk_pairs(p_ids, p_order, e, start, c, count, M, A, SORTED, BLOCK_M, BLOCK_A)
            p_zj = p_z + l_lo * s_zl + (pairs // A)[:, None] * s_zm
            m_z = m_j[:, None]
            acc_g = tl.zeros([BLOCK_M, BLOCK_I], dtype=tl.float32)
            acc_u = tl.zeros([BLOCK_M, BLOCK_I], dtype=tl.float32)
            acc = tl.zeros([2 * BLOCK_I, BLOCK_M], dtype=tl.float32)
            for l0 in range(0, l_len, BLOCK_L):
                if ROWS:
                    b_wa, b_wb = _rows_tiles(p_wr, p_sr, o_ir < I, l0, l_len, s_1l, s_s1l, 2 * BLOCK_I, BLOCK_L, MXFP4,
                                             ASM, dtype, EVEN_K)
                    b_za, b_zb = _act_rows(p_zj, m_z, l0, l_len, s_zl, BLOCK_M, BLOCK_L, MXFP4, EVEN_K)
                    acc = _dot2(acc, b_wa, b_wb, b_za, b_zb, MXFP4, False, X_FMT, IEEE, UPCAST, FMA)   # acc + w · zᵀ
                else:
                    b_w1a, b_w1b = _weight_tiles(p_w1e, p_s1e, o_i, m_i, l0, l_len, s_1i, s_1l, s_s1i, s_s1l,
                                                 BLOCK_I, BLOCK_L, MXFP4, HALVES, ASM, DOTS, dtype, EVEN_K)
                    b_w3a, b_w3b = _weight_tiles(p_w3e, p_s3e, o_i, m_i, l0, l_len, s_3i, s_3l, s_s3i, s_s3l,
                                                 BLOCK_I, BLOCK_L, MXFP4, HALVES, ASM, DOTS, dtype, EVEN_K)
                    b_za, b_zb = _act_tiles(p_zj, m_z, l0, l_len, s_zl, BLOCK_L, HALVES)
                    acc_g = _dot2(acc_g, b_za, b_zb, b_w1a, b_w1b, HALVES, DOTS, X_FMT, IEEE, UPCAST, FMA)
                    acc_u = _dot2(acc_u, b_za, b_zb, b_w3a, b_w3b, HALVES, DOTS, X_FMT, IEEE, UPCAST, FMA)
            if PDL and not EARLY:
                gdc_launch_dependents()   # after our own wait (static_weights.py, step 1); again is a no-op
            # the model rounds both products, then h, to z's dtype (model/moe.py experts_gathered). ROWS keeps the
            # products' orientation to the store ([BLOCK_I, BLOCK_M]): a transpose of acc would let Triton swap the
            # product's operands back
            if ROWS:
                acc_g, acc_u = tl.split(tl.permute(tl.reshape(acc, (2, BLOCK_I, BLOCK_M)), (1, 2, 0)))
                o_p = pairs[None, :].to(tl.int64)
                o_ii = o_i[:, None]
                m_hi = m_j[None, :] & m_i[:, None]
            else:
                o_p = pairs[:, None].to(tl.int64)
                o_ii = o_i[None, :]
                m_hi = m_j[:, None] & m_i[None, :]
            if SPLIT > 1:
                p_wsi = p_ws + (i_s * M * A + o_p) * (2 * I) + o_ii
                tl.store(p_wsi, acc_g, mask=m_hi)
                tl.store(p_wsi + I, acc_u, mask=m_hi)
            else:
                _glu_store(acc_g, acc_u, p_h + o_p * s_hp + o_ii, m_hi, beta, linear_beta, HAS_BETA, HAS_LINEAR_BETA)
        if SPLIT > 1:
            # every thread's partials are written before the arrival is published (release); the last of the SPLIT
            # programs reads them all through L2 (acquire, .cg: never a stale L1 line), in slice order
            tl.debug_barrier()
            p_c = p_cnt + slot * tl.num_programs(1) + i_i
            arrived = tl.atomic_add(p_c, 1, sem="acq_rel", scope="gpu")
            tl.debug_barrier()
            if arrived == SPLIT - 1:
                for c in range(0, chunks):
                    pairs, m_j = _chunk_pairs(p_ids, p_order, e, start, c, count, M, A, SORTED, BLOCK_M, BLOCK_A)
                    o_p = pairs[:, None].to(tl.int64)
                    m_hi = m_j[:, None] & m_i[None, :]
                    acc_g = tl.zeros([BLOCK_M, BLOCK_I], dtype=tl.float32)
                    acc_u = tl.zeros([BLOCK_M, BLOCK_I], dtype=tl.float32)
                    for s in tl.static_range(SPLIT):
                        p_wsi = p_ws + (s * M * A + o_p) * (2 * I) + o_i[None, :]
                        acc_g += tl.load(p_wsi, mask=m_hi, other=0., cache_modifier=".cg")
                        acc_u += tl.load(p_wsi + I, mask=m_hi, other=0., cache_modifier=".cg")
                    _glu_store(acc_g, acc_u, p_h + o_p * s_hp + o_i[None, :], m_hi, beta, linear_beta, HAS_BETA,
                               HAS_LINEAR_BETA)
                tl.atomic_xchg(p_c, 0, sem="relaxed", scope="gpu")   # ready for the next launch


# --- host side --------------------------------------------------------------------------------------------

def supports(z, experts, weights, w1, w3, w2, w1_scale) -> Reason:
    if z.dtype not in SUPPORTED_DTYPES:
        return f"dtype {z.dtype} (the kernels take {[str(d) for d in SUPPORTED_DTYPES]})"
    if z.shape[0] == 0 or experts.shape[1] == 0:
        return "no tokens or no experts per token"
    return None


def _sorted_pairs(experts: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(order [P] int32: pair indices sorted by expert, stable; offsets [E + 1] int32: expert e's pairs are
    order[offsets[e]:offsets[e + 1]]). Ids outside [0, E) sort last and belong to no expert. Static shapes, no
    host sync: capturable."""
    flat = experts.reshape(-1)
    keys = torch.where((flat >= 0) & (flat < num_experts), flat, num_experts).to(torch.int32)
    sorted_keys, order = torch.sort(keys, stable=True)
    bounds = torch.arange(num_experts + 1, dtype=torch.int32, device=experts.device)
    offsets = torch.searchsorted(sorted_keys, bounds).to(torch.int32)
    return order.to(torch.int32), offsets


def _strides3(t: Optional[torch.Tensor]) -> tuple:
    return tuple(t.stride()) if t is not None else (0, 0, 0)


def _rows_fit(w1, w3, w1_scale, w3_scale) -> bool:
    """The stacked gate/up tile reads w1 and w3 rows with one column stride (and one for their scales)."""
    return w1.stride(2) == w3.stride(2) and (w1_scale is None or w1_scale.stride(2) == w3_scale.stride(2))


def _split_l(l: int, block_l: int, split_l: int) -> tuple[int, int]:
    """(slices, steps of ``block_l`` each) for the gate/up programs' split of L into at most ``split_l`` slices:
    whole steps each, none empty (3584 columns in steps of 256 over 8 asked: 7 slices of 2 steps)."""
    n_steps = triton.cdiv(l, block_l)
    steps = triton.cdiv(n_steps, max(1, split_l))
    return triton.cdiv(n_steps, steps), steps


def _pow2_dividing(n: int, cap: int = 16) -> int:
    p = 1
    while p < cap and n % (2 * p) == 0:
        p *= 2
    return p


def moe_experts_triton(z: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, w1: torch.Tensor,
                       w3: torch.Tensor, w2: torch.Tensor, w1_scale: Optional[torch.Tensor] = None,
                       w3_scale: Optional[torch.Tensor] = None, w2_scale: Optional[torch.Tensor] = None,
                       beta: Optional[float] = None, linear_beta: Optional[float] = None, *,
                       small_m_limit: int = 16, config: Optional[MoeConfig] = None,
                       out: Optional[torch.Tensor] = None, only: Optional[str] = None) -> torch.Tensor:
    """The routed experts by the kernels above (shapes as ``k3::moe_experts``; inputs checked by the op).

    ``out`` [M, L] is allocated unless given (tests pass a NaN-poisoned one). ``only`` ("gate_up", "down",
    "combine"): launch that kernel alone on uninitialised buffers (timing)."""
    m, l = z.shape
    a = experts.shape[1]
    e_count, i_width = w1.shape[0], w1.shape[1]
    mxfp4 = w1_scale is not None
    if out is None:
        out = torch.empty((m, l), dtype=z.dtype, device=z.device)
    if m == 0 or l == 0:
        return out
    np_ = m * a
    on_gpu = z.device.type == "cuda"
    if config is None:
        config = tuned_config(table(z.device), m, z.dtype, mxfp4, i_width, l) or default_config(m, z.dtype, mxfp4,
                                                                                               on_gpu)
    ids = experts.reshape(-1)
    ids = ids if ids.is_contiguous() else ids.contiguous()
    wts = weights.reshape(-1)
    wts = wts if wts.is_contiguous() else wts.contiguous()
    sorted_form = not decode_form(m, a, small_m_limit)
    if sorted_form:
        order, offsets = _sorted_pairs(experts, e_count)
        slots = e_count
    else:
        order = offsets = ids   # unused
        slots = np_
    gemv = config.gemv and not sorted_form
    if sorted_form:
        block_m = config.block_m
    else:   # a row per token: tl.dot takes 16 rows at least, the CUDA-core products any power of two
        block_m = triton.next_power_of_2(m) if gemv else max(16, triton.next_power_of_2(m))
    block_a = triton.next_power_of_2(a)
    h = torch.empty((np_, i_width), dtype=z.dtype, device=z.device)
    i_tiles = triton.cdiv(i_width, config.block_i)
    split, steps = _split_l(l, config.block_l, 1 if sorted_form else config.split_l)
    if split > 1:   # fp32 partial sums of gate and up, the arrival counters their last slice reads them behind
        ws = torch.empty((split, np_, 2, i_width), dtype=torch.float32, device=z.device)
        counters = arrival_counters(z.device, slots * i_tiles)
        if counters is None:   # a first call inside a CUDA-graph capture: zeroed by the graph itself, every replay
            counters = torch.zeros(slots * i_tiles, dtype=torch.int32, device=z.device)
    else:
        ws, counters = h, ids   # unused
    by_token = config.down_by_token and not sorted_form   # the down kernel sums each token itself: no partials
    part = torch.empty((0 if by_token else np_, l), dtype=torch.float32, device=z.device)
    n_tiles = triton.cdiv(l, config.block_n)
    pdl = pdl_capable(z.device)
    # Triton 3.7's interpreter computes 16-bit tl.dot wrongly: fp32 operands there (16-bit products are exact in fp32)
    upcast = not on_gpu and z.dtype != torch.float32
    ieee = z.dtype == torch.float32 or upcast
    s1, s3, s2 = (w1_scale, w3_scale, w2_scale) if mxfp4 else (w1, w3, w2)   # placeholders when float
    ss1, ss3, ss2 = (_strides3(w1_scale), _strides3(w3_scale), _strides3(w2_scale)) if mxfp4 else ((0, 0, 0),) * 3
    launch = dict(launch_pdl=True) if pdl else {}
    nvidia = on_gpu and not is_rocm()   # maxnreg is an NVIDIA option (Triton raises on it elsewhere)
    regs_up = dict(maxnreg=config.maxnreg_up) if nvidia and config.maxnreg_up else {}
    regs_down = dict(maxnreg=config.maxnreg_down) if nvidia and config.maxnreg_down else {}
    rows = config.weight_rows and _rows_fit(w1, w3, w1_scale, w3_scale)
    # Triton's scaled product: bf16 / fp16 z on a GPU (the interpreter lacks it: there the halves below)
    dots = mxfp4 and config.mxfp4_dot_scaled and on_gpu and z.dtype != torch.float32 and not rows and not gemv
    halves = mxfp4 and not dots and (config.mxfp4_halves or config.mxfp4_dot_scaled or rows or by_token)
    # the PTX conversions: bf16 on an NVIDIA GPU (the interpreter runs no inline assembly)
    asm = halves and config.mxfp4_asm and on_gpu and not is_rocm() and z.dtype == torch.bfloat16
    x_fmt = "bf16" if z.dtype == torch.bfloat16 else "fp16"
    common = dict(MXFP4=mxfp4, ASM=asm, IEEE=ieee, UPCAST=upcast, PDL=pdl, EARLY=pdl and config.trigger_early)
    # w2's scale rows are I/32 bytes apart (12 at K3 TP=8): the kernels load them as words where they are aligned
    s_align = _pow2_dividing(ss2[1]) if mxfp4 and on_gpu else 1
    on_device = torch.cuda.device(z.device) if on_gpu else contextlib.nullcontext()
    with on_device:
        if only in (None, "gate_up"):
            _gate_up_kernel[(slots, i_tiles, split)](
                z, ids, order, offsets, w1, w3, s1, s3, h, ws, counters,
                m, a, e_count, i_width, l, steps if split > 1 else 1, float(beta or 0.0), float(linear_beta or 0.0),
                z.stride(0), z.stride(1), *w1.stride(), *w3.stride(), *ss1, *ss3, h.stride(0),
                BLOCK_M=block_m, BLOCK_I=config.block_i, BLOCK_L=config.block_l, BLOCK_A=block_a,
                SORTED=sorted_form, HALVES=halves, DOTS=dots, X_FMT=x_fmt, HAS_BETA=beta is not None,
                HAS_LINEAR_BETA=linear_beta is not None, EVEN_K=(dots or rows) and l % config.block_l == 0,
                ROWS=rows, SPLIT=split, FMA=gemv, num_warps=config.warps_up, num_stages=config.stages_up, **common,
                **launch, **regs_up,
            )
        if only in (None, "down") and by_token:
            _down_token_kernel[(m, n_tiles)](
                h, ids, wts, w2, s2, out,
                m, a, e_count, i_width, l,
                *w2.stride(), *ss2, h.stride(0), out.stride(0), out.stride(1),
                BLOCK_N=config.block_n, BLOCK_K=config.block_k, BLOCK_A=block_a, S_ALIGN=s_align,
                EVEN_K=i_width % config.block_k == 0, num_warps=config.warps_down, num_stages=config.stages_down,
                **common, **launch, **regs_down,
            )
        elif only in (None, "down"):
            _down_kernel[(slots, n_tiles)](
                h, ids, order, offsets, wts, w2, s2, part,
                m, a, e_count, i_width, l,
                *w2.stride(), *ss2, h.stride(0),
                BLOCK_M=block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, BLOCK_A=block_a,
                SORTED=sorted_form, HALVES=halves, DOTS=dots, X_FMT=x_fmt, PRELOAD=config.preload,
                EVEN_K=(dots or rows) and i_width % config.block_k == 0, ROWS=rows, S_ALIGN=s_align, FMA=gemv,
                num_warps=config.warps_down, num_stages=config.stages_down, **common, **launch, **regs_down,
            )
        if only in (None, "combine") and not by_token:
            _combine_kernel[(m, n_tiles)](
                part, ids, out, m, a, e_count, l, out.stride(0), out.stride(1),
                BLOCK_N=config.block_n, BLOCK_A=block_a, PDL=pdl, num_warps=4, **launch,
            )
    return out
