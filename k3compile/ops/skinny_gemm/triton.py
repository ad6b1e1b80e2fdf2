"""Skinny GEMM in Triton: ``out[M, N] = a[M, K] @ w[N, K]^T (+ bias[N]) (+ residual[M, N])``.

Decode GEMMs have a handful of rows and a large weight, so the kernel is a weight stream: each
program owns a ``BLOCK_N`` slice of the output columns (all M rows at once) and, when there are too
few column tiles to fill the GPU, a ``1/SPLIT_K`` slice of K. Split-K partial sums go to an fp32
workspace and are summed in split order, in one launch (no memset, CUDA-graph safe) by either the last
split of the tile, which polls the others' partial slots (``poll``; the slots read empty between launches),
or the last program to arrive (an arrival counter per tile, rearmed by that program); or by a second small
kernel. Products run on tensor cores (``tl.dot``, M padded to 16) or, for a few rows, on CUDA cores
(broadcast multiply, one K reduction at the end: one row takes such a grid of 8-column tiles by default
where the tensor-core grid would split K, see ``FMA_ROW``).
Weight tiles, and optionally a's, may come by TMA. Accumulation is fp32 always; fp32 inputs use IEEE
products (no TF32). Any M <= ``MAX_M``, N and K; tails are masked.

With ``pdl`` (sm_90+) the kernel is launched with programmatic dependent launch: its programs may start
while the previous kernel finishes, and touch nothing another kernel may write or read (a, residual, out,
workspace, counters) before ``gdc_wait()``. Before it they may only prefetch weight lines into L2, or, when
the caller promises ``static_weight`` (no kernel writes the weight), load the first weight tiles. Every
program lets the next kernel in only after its own wait: the static-weight proof relies on that.

Runs on CUDA/ROCm tensors, and on CPU tensors under ``TRITON_INTERPRET=1`` (tests).
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

try:  # grid dependency control (PDL), Triton >= 3.4
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover
    gdc_launch_dependents = gdc_wait = None

from k3compile.ops.arrival_counters import PARTIAL_EMPTY as _EMPTY_WORD, arrival_counters, partial_slots
from k3compile.backends import is_rocm, Reason, sm_count, triton_can_run_on

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_M = 64  # beyond this the whole-M register tile spills; callers use cuBLAS there


@triton.jit
def _products(b_a, b_w, FMA: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """``b_a[BLOCK_M, k] @ b_w[BLOCK_N, k]^T`` in fp32 (one peeled tile; the loop keeps its own forms)."""
    if FMA:
        b_p = tl.sum(b_a.to(tl.float32)[:, None, :] * b_w.to(tl.float32)[None, :, :], axis=2)
    else:
        if UPCAST:
            b_a = b_a.to(tl.float32)
            b_w = b_w.to(tl.float32)
        b_p = tl.dot(b_a, tl.trans(b_w), input_precision=PRECISION)
    return b_p


@triton.jit
def _sum_partials(ws_ptr, o_m, o_n, m_out, M, N, SPLIT_K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  CACHE: tl.constexpr):
    """One tile's ``SPLIT_K`` fp32 partials, added in split order (both reductions, so they agree bit for
    bit). Loaded four at a time, so their L2 round trips overlap at the end of the kernel, where nothing
    hides them; a slot past ``SPLIT_K`` adds -0.0, which changes no value."""
    b_acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    p_ws = ws_ptr + o_m[:, None] * N + o_n[None, :]
    for s0 in range(0, SPLIT_K, 4):
        b_p0 = tl.load(p_ws + s0 * M * N, mask=m_out, other=-0.0, cache_modifier=CACHE)
        b_p1 = tl.load(p_ws + (s0 + 1) * M * N, mask=m_out & (s0 + 1 < SPLIT_K), other=-0.0, cache_modifier=CACHE)
        b_p2 = tl.load(p_ws + (s0 + 2) * M * N, mask=m_out & (s0 + 2 < SPLIT_K), other=-0.0, cache_modifier=CACHE)
        b_p3 = tl.load(p_ws + (s0 + 3) * M * N, mask=m_out & (s0 + 3 < SPLIT_K), other=-0.0, cache_modifier=CACHE)
        b_acc = (((b_acc + b_p0) + b_p1) + b_p2) + b_p3
    return b_acc


# A partial-sum word not written yet (``poll`` configs; ``arrival_counters.partial_slots`` hands them out)
PARTIAL_EMPTY = tl.constexpr(_EMPTY_WORD)


@triton.jit
def _publish(p, b_v, mask, PTX: tl.constexpr):
    """Strong (relaxed, gpu-scope) stores of the fp32 partial ``b_v``, which another program polls:
    ``st.relaxed`` on NVIDIA, an atomic exchange (an L2 atomic per word) where no PTX runs."""
    if PTX:
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.b32 p, $3, 0; @p st.relaxed.gpu.global.b32 [$1], $2; mov.u32 $0, 0; }",
            "=r,l,r,r", [p, b_v.to(tl.int32, bitcast=True), mask.to(tl.int32)], dtype=tl.int32, is_pure=False,
            pack=1)
    else:
        tl.atomic_xchg(p.to(tl.pointer_type(tl.int32)), b_v.to(tl.int32, bitcast=True), mask=mask, sem="relaxed",
                       scope="gpu")


@triton.jit
def _load_four(p, stride, m0, m1, m2, m3):
    """Four partial tiles ``stride`` apart (volatile: every poll reads L2 anew; -0.0 where masked), and
    whether any word of them still holds ``PARTIAL_EMPTY``."""
    b_p0 = tl.load(p, mask=m0, other=-0.0, volatile=True)
    b_p1 = tl.load(p + stride, mask=m1, other=-0.0, volatile=True)
    b_p2 = tl.load(p + 2 * stride, mask=m2, other=-0.0, volatile=True)
    b_p3 = tl.load(p + 3 * stride, mask=m3, other=-0.0, volatile=True)
    n_empty = ((b_p0.to(tl.int32, bitcast=True) == PARTIAL_EMPTY).to(tl.int32)
               + (b_p1.to(tl.int32, bitcast=True) == PARTIAL_EMPTY).to(tl.int32)
               + (b_p2.to(tl.int32, bitcast=True) == PARTIAL_EMPTY).to(tl.int32)
               + (b_p3.to(tl.int32, bitcast=True) == PARTIAL_EMPTY).to(tl.int32))
    return b_p0, b_p1, b_p2, b_p3, tl.sum(tl.sum(n_empty, axis=1), axis=0) > 0


@triton.jit
def _poll_partials(ws_ptr, o_m, o_n, m_out, M, N, N_PARTS, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The sum, in split order, of this tile's first ``N_PARTS`` partials, each read once all its words are
    written (read again while a word still holds ``PARTIAL_EMPTY``), four at a time so their L2 round trips
    overlap; the slots read are set back to empty for the next launch. A slot past
    ``N_PARTS`` adds -0.0, as in ``_sum_partials``, so both reductions agree bit for bit."""
    b_acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    b_empty = tl.full((BLOCK_M, BLOCK_N), PARTIAL_EMPTY, tl.int32).to(tl.float32, bitcast=True)
    p_ws = ws_ptr + o_m[:, None] * N + o_n[None, :]
    for s0 in range(0, N_PARTS, 4):
        m1 = m_out & (s0 + 1 < N_PARTS)
        m2 = m_out & (s0 + 2 < N_PARTS)
        m3 = m_out & (s0 + 3 < N_PARTS)
        b_p0, b_p1, b_p2, b_p3, empty = _load_four(p_ws + s0 * M * N, M * N, m_out, m1, m2, m3)
        while empty:
            b_p0, b_p1, b_p2, b_p3, empty = _load_four(p_ws + s0 * M * N, M * N, m_out, m1, m2, m3)
        b_acc = (((b_acc + b_p0) + b_p1) + b_p2) + b_p3
        tl.store(p_ws + s0 * M * N, b_empty, mask=m_out)
        tl.store(p_ws + (s0 + 1) * M * N, b_empty, mask=m1)
        tl.store(p_ws + (s0 + 2) * M * N, b_empty, mask=m2)
        tl.store(p_ws + (s0 + 3) * M * N, b_empty, mask=m3)
    return b_acc


@triton.jit
def _epilogue_operands(bias_ptr, res_ptr, o_m, o_n, m_m, m_n, stride_rm, stride_rn,
                       HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr):
    """bias[1, BLOCK_N] and residual[BLOCK_M, BLOCK_N] of this tile in fp32 (0 where absent)."""
    b_bias = tl.zeros((1, o_n.shape[0]), dtype=tl.float32)
    b_res = tl.zeros((o_m.shape[0], o_n.shape[0]), dtype=tl.float32)
    if HAS_BIAS:
        b_bias = tl.load(bias_ptr + o_n, mask=m_n, other=0.0).to(tl.float32)[None, :]
    if HAS_RES:
        b_res = tl.load(res_ptr + o_m[:, None] * stride_rm + o_n[None, :] * stride_rn,
                        mask=m_m[:, None] & m_n[None, :], other=0.0).to(tl.float32)
    return b_bias, b_res


@triton.jit
def _skinny_gemm_kernel(
    a_ptr, w_ptr, w_desc, a_desc, bias_ptr, res_ptr, out_ptr, ws_ptr, cnt_ptr,
    M, N, K, K_PER_SPLIT, SPLIT_K,
    stride_am, stride_ak, stride_wn, stride_wk, stride_rm, stride_rn, stride_om, stride_on,
    HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, SPLIT: tl.constexpr, ONE_LAUNCH: tl.constexpr,
    FMA: tl.constexpr, LOOP_STAGES: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, TMA: tl.constexpr,
    PDL: tl.constexpr, PREFETCH_LINES: tl.constexpr, PRE_K: tl.constexpr, EARLY_TRIGGER: tl.constexpr,
    A_TMA: tl.constexpr, POLL: tl.constexpr, PTX: tl.constexpr,
):
    i_n = tl.program_id(0)
    i_k = tl.program_id(1)
    o_m = tl.arange(0, BLOCK_M)
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_m = o_m < M
    m_n = o_n < N
    k_lo = i_k * K_PER_SPLIT
    k_hi = tl.minimum(k_lo + K_PER_SPLIT, K)
    # int64 row offsets: a weight of N*K elements may exceed 2**31
    p_a = a_ptr + o_m[:, None].to(tl.int64) * stride_am
    p_w = w_ptr + o_n[:, None].to(tl.int64) * stride_wn
    k_loop = k_lo
    if PRE_K > 0:
        # The caller promised that no kernel writes the weight (static_weight): its first PRE_K columns
        # are loaded now, before the wait below, while the previous kernel still runs (PDL).
        o_k0 = k_lo + tl.arange(0, PRE_K)
        b_w0 = tl.load(p_w + o_k0[None, :] * stride_wk, mask=m_n[:, None] & (o_k0 < k_hi)[None, :], other=0.0,
                       eviction_policy="evict_first")
        k_loop = k_lo + PRE_K
    if PDL:
        # Programmatic dependent launch: this grid started before the previous kernel finished. Everything
        # a previous kernel may write (a, residual) or read (out, workspace, counters) waits for it.
        if PREFETCH_LINES > 0:  # the weight depends on no kernel: its next lines are fetched into L2 meanwhile
            line = 1024 // w_ptr.dtype.element_ty.primitive_bitwidth  # elements per 128-byte line
            o_pk = tl.minimum(k_loop + tl.arange(0, PREFETCH_LINES) * line, K - 1)
            p_pf = w_ptr + tl.minimum(o_n, N - 1)[:, None].to(tl.int64) * stride_wn + o_pk[None, :] * stride_wk
            tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [p_pf], dtype=tl.int32,
                                      is_pure=False, pack=1)
        gdc_wait()
        if EARLY_TRIGGER:
            # Let the next kernel in now (only for a grid that runs as one wave: its waiting programs would
            # otherwise hold the slots our later programs need). Safe for static weights only because every
            # PDL kernel of ours triggers after its own gdc_wait(): the next one can start (and read its
            # weight early) only once the kernel before us has completed, so at most one kernel -- us --
            # still runs, and we never write a weight. Never move a trigger above a wait.
            gdc_launch_dependents()

    if not SPLIT:  # this program writes its tile: the epilogue's operands now, their latency hidden by the loop
        b_bias, b_res = _epilogue_operands(bias_ptr, res_ptr, o_m, o_n, m_m, m_n, stride_rm, stride_rn,
                                           HAS_BIAS, HAS_RES)
    if PRE_K > 0:  # a's columns of the peeled tiles, read now that they may be (summed after the loop)
        b_a0 = tl.load(p_a + o_k0[None, :] * stride_ak, mask=m_m[:, None] & (o_k0 < k_hi)[None, :], other=0.0)
    if FMA:
        # CUDA-core products for a few rows: a tensor-core tile would pad M to 16; K is summed once at the end
        b_acc3 = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K), dtype=tl.float32)
    else:
        b_acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # Triton software-pipelines the weight loads of a dot loop by itself; the fma loop only when told
    for k0 in tl.range(k_loop, k_hi, BLOCK_K, num_stages=LOOP_STAGES):
        o_k = k0 + tl.arange(0, BLOCK_K)
        m_k = o_k < k_hi
        if A_TMA:  # a's tile by TMA as well: rows past M and columns past K arrive as zeros
            b_a = a_desc.load([0, k0])
        else:
            b_a = tl.load(p_a + o_k[None, :] * stride_ak, mask=m_m[:, None] & m_k[None, :], other=0.0)
        if TMA:  # a tensor-memory-accelerator copy: zero fill past N and K, no address math
            b_w = w_desc.load([i_n * BLOCK_N, k0])
        else:  # the weight is read once: keep it from evicting what later kernels reuse
            b_w = tl.load(p_w + o_k[None, :] * stride_wk, mask=m_n[:, None] & m_k[None, :], other=0.0,
                          eviction_policy="evict_first")
        if FMA:
            b_acc3 += b_a.to(tl.float32)[:, None, :] * b_w.to(tl.float32)[None, :, :]
        else:
            if UPCAST:
                b_a = b_a.to(tl.float32)
                b_w = b_w.to(tl.float32)
            b_acc += tl.dot(b_a, tl.trans(b_w), input_precision=PRECISION)
    if FMA:
        b_acc = tl.sum(b_acc3, axis=2)
    if PRE_K > 0:  # after the loop: the loop's first loads are not held up by these products
        b_acc += _products(b_a0, b_w0, FMA, UPCAST, PRECISION)
    if PDL:
        if not EARLY_TRIGGER:
            # the next kernel may launch; it waits for our stores itself. (Static weights stay safe only
            # while every PDL kernel triggers after its own gdc_wait(), as this one does.)
            gdc_launch_dependents()

    m_out = m_m[:, None] & m_n[None, :]
    finish = not SPLIT
    if SPLIT and POLL:
        # The last split finishes the tile: the others publish their partials by value (strong stores into
        # slots that read PARTIAL_EMPTY until then) and it polls them. No counter, no fence: the end of the
        # kernel waits on fewer L2 round trips. The last split has the highest program ids, so the splits it
        # waits for were started before it (programs start in id order).
        finish = i_k == SPLIT_K - 1
        if i_k < SPLIT_K - 1:
            p_ws = ws_ptr + (i_k * M + o_m[:, None]) * N + o_n[None, :]
            _publish(p_ws, b_acc, m_out, PTX)
    elif SPLIT:
        p_ws = ws_ptr + (i_k * M + o_m[:, None]) * N + o_n[None, :]
        tl.store(p_ws, b_acc, mask=m_out)
        if ONE_LAUNCH:
            # the last of this column tile's SPLIT_K programs to arrive sums the partials (in split
            # order, so the result matches the two-launch path bit for bit) and rearms the counter
            tl.debug_barrier()  # every thread's partial is written before the arrival is published
            arrived = tl.atomic_add(cnt_ptr + i_n, 1, sem="acq_rel")
            finish = arrived == SPLIT_K - 1
    if finish:
        if SPLIT:
            # the epilogue's operands are requested first, so their round trips overlap the partials'
            b_bias, b_res = _epilogue_operands(bias_ptr, res_ptr, o_m, o_n, m_m, m_n, stride_rm, stride_rn,
                                               HAS_BIAS, HAS_RES)
            if POLL:
                b_acc = _poll_partials(ws_ptr, o_m, o_n, m_out, M, N, SPLIT_K - 1, BLOCK_M, BLOCK_N) + b_acc
            else:
                # .cg: read from L2, where the other programs' partials are, never a stale L1 line
                b_acc = _sum_partials(ws_ptr, o_m, o_n, m_out, M, N, SPLIT_K, BLOCK_M, BLOCK_N, ".cg")
                tl.atomic_xchg(cnt_ptr + i_n, 0)
        if HAS_BIAS:
            b_acc += b_bias
        if HAS_RES:
            b_acc += b_res
        p_o = out_ptr + o_m[:, None] * stride_om + o_n[None, :] * stride_on
        tl.store(p_o, b_acc.to(out_ptr.dtype.element_ty), mask=m_out)


@triton.jit
def _split_k_reduce_kernel(
    ws_ptr, bias_ptr, res_ptr, out_ptr,
    M, N, SPLIT_K, stride_rm, stride_rn, stride_om, stride_on,
    HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    i_n = tl.program_id(0)
    o_m = tl.arange(0, BLOCK_M)
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_n = o_n < N
    m_out = (o_m < M)[:, None] & m_n[None, :]
    b_acc = _sum_partials(ws_ptr, o_m, o_n, m_out, M, N, SPLIT_K, BLOCK_M, BLOCK_N, "")
    if HAS_BIAS:
        b_acc += tl.load(bias_ptr + o_n, mask=m_n, other=0.0).to(tl.float32)[None, :]
    if HAS_RES:
        b_acc += tl.load(res_ptr + o_m[:, None] * stride_rm + o_n[None, :] * stride_rn,
                         mask=m_out, other=0.0).to(tl.float32)
    tl.store(out_ptr + o_m[:, None] * stride_om + o_n[None, :] * stride_on,
             b_acc.to(out_ptr.dtype.element_ty), mask=m_out)


@dataclass(frozen=True)
class TritonConfig:
    block_m: int
    block_n: int
    block_k: int
    split_k: int
    num_warps: int = 4
    num_stages: Optional[int] = None  # None: Triton's default for the target
    one_launch: bool = False  # split-K partials summed by the last program to arrive, not a second kernel
    fma: bool = False         # CUDA-core products (block_m may then be < 16) instead of tl.dot
    tma: bool = False         # weight tiles by TMA descriptor (sm_90+; else, or when unaligned, plain loads)
    pdl: bool = False         # programmatic dependent launch (sm_90+): prefetch weight lines, then wait
    prefetch_lines: int = 8   # 128-byte lines of each weight row prefetched into L2 before the wait (pdl)
    preload: int = 0          # with pdl and static_weight=True: weight tiles (of block_k) loaded before the wait
    early_trigger: bool = False  # pdl: let the next kernel launch right after our wait, not after the K loop
    a_tma: bool = False       # with tma: a's [block_m, block_k] tiles by TMA too (where a is TMA-aligned)
    poll: bool = False        # one_launch: the last split polls the others' partials (no arrival counter)

    def __post_init__(self):
        if self.preload not in (0, 1, 2, 4) or self.prefetch_lines < 0 or (
                self.prefetch_lines & (self.prefetch_lines - 1)):
            raise ValueError(f"bad config {self}: preload must be 0, 1, 2 or 4 and prefetch_lines 0 or a power of 2")

    def tag(self) -> str:
        """A short name for tables and logs, e.g. ``dot-m16-n32-k128-s4x1-w4-std-tma-pdl8``, ``...-pdl0ep2``
        (no prefetch, early trigger, 2 tiles preloaded under static weights)."""
        pdl = (f"-pdl{self.prefetch_lines}{'e' if self.early_trigger else ''}"
               f"{f'p{self.preload}' if self.preload else ''}") if self.pdl else ""
        return (f"{'fma' if self.fma else 'dot'}-m{self.block_m}-n{self.block_n}-k{self.block_k}-s{self.split_k}"
                f"{'x1' if self.one_launch else ''}-w{self.num_warps}-st{self.num_stages or 'd'}"
                f"{'-tma' if self.tma else ''}{'-atma' if self.a_tma else ''}{pdl}{'-poll' if self.poll else ''}")


# Residency on sm_90 (H100/H200): 228 KB of shared memory per SM, 1 KB of it reserved per resident program.
# Shared memory is what bounds these programs (40-72 registers at 2 or 4 warps leave room for 14+).
SMEM_PER_SM = 228 * 1024
SMEM_RESERVED_PER_PROGRAM = 1024
# bytes of weight tiles each SM should have in flight to keep HBM streaming (H200: 1.7 programs/SM x 4 tiles of
# 8 KB ran at 82-84% of the copy ceiling at 7168 x 3584, 3.4/SM x 2 tiles at 73-76%, split-K being the difference)
IN_FLIGHT_PER_SM = 48 * 1024
MAX_STAGES = 8
# programs per SM below which a grid streamed worse (H200, M 1..16): unsplit 1.5 (7168 x 3584 at 1.7 per SM:
# 82-84%; 4608 / 3584 x 7168 at 1.1 / 0.85: 59-77%), split 2.5 (4608 x 7168 split 2 at 2.2 per SM and
# 3584 x 7168 split 2 at 1.7: ~1% behind split 3 at 3.3 / 2.5)
MIN_PER_SM = (1.5, 2.5)


def resident_per_sm(config: TritonConfig, element_size: int = 2) -> int:
    """Programs of ``config`` that one sm_90 SM holds at once: Triton's pipeline keeps ``num_stages - 1``
    [BLOCK_M + BLOCK_N, BLOCK_K] tiles (a's and w's) in shared memory (H200: 9 / 6 / 4 programs at 3 / 4 / 5
    stages of 16+32 x 128 bf16, as the driver's occupancy calculator says)."""
    ring = ((config.num_stages or 3) - 1) * (config.block_m + config.block_n) * config.block_k * element_size
    return SMEM_PER_SM // (ring + 16 + SMEM_RESERVED_PER_PROGRAM)


# The split grids' tail (H200, benchmarks/results/skinny_gemm_triton_tail_h200.log): per-program clocks showed
# the kernel ending 1.6-1.7 us after the last K loop ended (the last-arrival reduction's L2 round trips; with
# the reduction skipped, 0.03 us and 84-88% of the copy ceiling). Polled partials (``poll``: no counter, no
# fence) cut that to 1.2-1.3 us; letting the next product in after our K loop (not at our start) and having
# it prefetch its first 2 weight lines per row into L2 meanwhile keeps HBM busy during the rest. Together
# (last run, interleaved): 4608 x 7168 M = 2/4/8/16 84.8/83.6/81.7/79.1% of the ceiling (the counter grid
# with the early trigger 80.9/80.1/79.2/77.8%), 3584 x 7168 81.6/80.8/78.5/76.1% (78.3/77.4/76.4/75.6%).
# Each alone gained 0-1.5 points; 1 or 4 lines, or one stage more, were 0.2-2.7% slower; the prefetch with
# the counter lost 4-11%. 2112 x 7168 (the table's split 4) was +4.5% at M = 1 but -3.7% at M = 16: kept.
POLLED_TAIL = dict(poll=True, early_trigger=False, prefetch_lines=2)

# One row: CUDA-core products over 8-column tiles, a and w by TMA, no K split (``FMA_ROW``, block_m = M).
# Where the tensor-core grid has to split K, its last-arrival reduction (partial store, arrival, partial
# loads: ~1.4 us of L2 round trips at the end of the kernel) cost 8-9% (H200, 3584 / 4608 x 7168: the split-3
# grid with the reduction skipped ran 85.6 / 87.5% of the copy ceiling, with it 77.3 / 80.8%); this grid has
# none. Measured (benchmarks/results/skinny_gemm_triton_{splitcost,fma,fma_rows,fma_settle}_h200.log, four runs):
# M = 1: 3584 x 7168 80.4-82.9% vs 75.8-77.7%, 4608 x 7168 85.0-86.5% vs 80.3-81.0%; M = 2: 75.8-79.0% vs
# 75.6-77.0%, 79.7-82.1% vs 78.3-80.1%. Four rows lost 10-40% (registers: the [M, 8, 256] fp32 accumulator).
# Its depth follows IN_FLIGHT_PER_SM like the tensor-core grids': 5 stages at 3584 x 7168 (3.4 programs per SM;
# 0.2-1.2 points ahead of 4), 4 at 4608 x 7168 (4.4 per SM; 0.3-0.9 ahead of 5). Since the split grids' tail
# got shorter (POLLED_TAIL), two rows run those instead (1.2-2.2 points ahead at 4608 / 3584 x 7168, two
# runs); one row stays here (4 points ahead).
FMA_ROW = TritonConfig(1, 8, 256, 1, num_warps=4, num_stages=4, fma=True, tma=True, a_tma=True, pdl=True,
                       prefetch_lines=0, early_trigger=True)  # (block_m and num_stages set per product)
FMA_ROWS_MAX_M = 1
# FMA_ROW programs one H200 SM holds at M = 1 (40 registers x 128 threads bound them; 9 at M = 2, 56 registers:
# the driver's counts). Its grid must fit about twice (ours and the next product's, as for the tensor-core
# grids): at 7168 x 3584 (896 programs, 7 per SM) it ran 57 / 64% of the ceiling (M = 1 / 2) against the
# unsplit tensor-core grid's 82%; 4608 x 7168 (5 per SM) won at both. It was measured at 3.4 and 4.4
# programs per SM; thinner grids keep the tensor-core pick.
FMA_ROW_RESIDENT = 12
FMA_ROW_MIN_PER_SM = 3


def _heuristic(m: int, n: int, k: int, sm_count: int) -> TritonConfig:
    """The tensor-core pick (``_dot_heuristic``), except for up to ``FMA_ROWS_MAX_M`` rows where that splits K:
    ``FMA_ROW`` (block_m = M, deep enough for ``IN_FLIGHT_PER_SM``) where its grid and the next product's fit
    on the SMs together."""
    cfg = _dot_heuristic(m, n, k, sm_count)
    programs = triton.cdiv(n, FMA_ROW.block_n)
    if m <= FMA_ROWS_MAX_M and cfg.tma and cfg.split_k > 1 and programs >= FMA_ROW_MIN_PER_SM * sm_count and \
            2 * triton.cdiv(programs, sm_count) <= FMA_ROW_RESIDENT:
        tile_bytes = FMA_ROW.block_n * FMA_ROW.block_k * 2
        stages = triton.cdiv(IN_FLIGHT_PER_SM, int(programs / sm_count * tile_bytes)) + 1
        return dataclasses.replace(FMA_ROW, block_m=triton.next_power_of_2(m), num_stages=max(3, min(stages, 5)))
    return cfg


def _dot_heuristic(m: int, n: int, k: int, sm_count: int) -> TritonConfig:
    """Read off the H200 sweeps (benchmarks/results/skinny_gemm_triton_{sweep,pdl,variants,coresident,settled}_h200
    .log): 32-column tiles, partials summed in one launch, TMA weight tiles for products of at least
    2048 x 2048; without TMA or past 16 rows, K split until the grid holds ~4 programs per SM, never below
    7 K blocks per split (shorter loops lost more than the wider grid gained).

    With TMA and M <= 16 (the decode products): programmatic dependent launch with the next product let in
    right after our wait (early trigger), in the grid that costs least: the fewest K splits (each split
    costs the partial sums and a less even finish: 7168 x 3584 ran 82-84% of the copy ceiling unsplit
    with 4 tiles in flight per program, 73-76% split in two with 2) such that
    - there are ``MIN_PER_SM`` programs per SM (unsplit / split),
    - our programs and the next product's all fit on the SMs together (2 x per-SM count <= residency: the
      early trigger then overlaps; past that it lost 20-35%, the waiting programs holding slots we need),
    - the pipeline depth (num_stages) puts ``IN_FLIGHT_PER_SM`` of weight tiles in flight per SM.
    A split grid then runs ``POLLED_TAIL``. Where no split fits, the plain 4-per-SM split at the default depth,
    the trigger after the K loop unless both grids fit (20480 x 7168, 640 column tiles: after). Two warps per
    program: 1-3% faster than four at every such point measured."""
    block_m = max(16, triton.next_power_of_2(m))
    block_k = 128 if block_m <= 16 else 64
    block_n = 32
    n_tiles = triton.cdiv(n, block_n)
    k_blocks = triton.cdiv(k, block_k)
    tma = n >= 2048 and k >= 2048
    split_4 = max(1, min(round(4 * sm_count / n_tiles), k_blocks // 7, 32))
    if not (tma and block_m == 16):
        return TritonConfig(block_m, block_n, block_k, split_4, one_launch=True, tma=tma)
    tile_bytes = block_n * block_k * 2
    for split_k in range(1, min(k_blocks // 7, 32) + 1):
        per_sm = n_tiles * split_k / sm_count
        if triton.cdiv(k_blocks, triton.cdiv(k_blocks, split_k)) != split_k or per_sm < MIN_PER_SM[split_k > 1]:
            continue  # not a split the kernel runs (K slices are whole blocks), or too few programs
        stages = max(3, min(MAX_STAGES, triton.cdiv(IN_FLIGHT_PER_SM, int(per_sm * tile_bytes)) + 1))
        stages = min(stages, k_blocks // split_k)
        cfg = TritonConfig(block_m, block_n, block_k, split_k, num_warps=2, num_stages=stages, one_launch=True,
                           tma=True, pdl=True, prefetch_lines=0, early_trigger=True)
        if 2 * triton.cdiv(n_tiles * split_k, sm_count) <= resident_per_sm(cfg):
            return dataclasses.replace(cfg, **POLLED_TAIL) if split_k > 1 else cfg
    split_k = triton.cdiv(k_blocks, triton.cdiv(k_blocks, split_4))
    cfg = TritonConfig(block_m, block_n, block_k, split_k, one_launch=True, tma=True, pdl=True, prefetch_lines=0)
    return dataclasses.replace(cfg, early_trigger=2 * triton.cdiv(n_tiles * split_k, sm_count) <= resident_per_sm(cfg))


# Measured on one H200 (132 SMs; benchmarks/results/skinny_gemm_triton_{sweep,pdl}_h200.log, bf16, graph-timed with
# the weight rotated out of L2, copy ceiling 4.22 TB/s): (M bucket, N, K) -> the fastest configuration, listed
# only where it beat the heuristic's by about the run-to-run noise (1 point) or more; elsewhere (896..20480 x
# 1536..7168, M = 1..16) the heuristic's pick was the winner or within 0.6 points of it.
TABLE_SMS = 132
_N2112_S4 = TritonConfig(16, 32, 128, 4, num_warps=2, num_stages=4, one_launch=True, tma=True, pdl=True,
                         prefetch_lines=0, early_trigger=True)
TABLE: dict[tuple[int, int, int], TritonConfig] = {
    (8, 20480, 7168): TritonConfig(16, 64, 128, 1, one_launch=True, tma=True),  # 69.07 us 100.9% (heur. 99.6%)
    (16, 20480, 7168): TritonConfig(16, 64, 128, 1, one_launch=True),  # 70.13 us 99.5% (heuristic 98.8%)
    # 2112 x 7168 (skinny_gemm_triton_{coresident,settled}_h200.log, M 1 / 16): split 4 at 2 per SM, 66.4 / 64.3%
    # of the ceiling; the heuristic's split 5 at 2.5 per SM 65.8 / 62.5%
    **{(b, 2112, 7168): _N2112_S4 for b in (1, 2, 4, 8, 16)},
}


def _m_bucket(m: int) -> Optional[int]:
    return next((b for b in (1, 2, 4, 8, 16) if m <= b), None)


@functools.lru_cache(maxsize=4096)
def choose_config(m: int, n: int, k: int, sm_count: int, static_weight: bool = False) -> TritonConfig:
    """The measured table on an H200 (for M up to 16), else the heuristic. ``sm_count`` 0 means no GPU
    (the interpreter): whole M in one tensor-core tile, no split, fewer, larger programs.

    ``static_weight`` picks the same configuration: loading weight tiles before the PDL wait (``preload``)
    measured 0.5-2 us slower than PDL with the early trigger alone at every >= 32 MB shape and M (H200,
    benchmarks/results/skinny_gemm_triton_pdl_h200.log: the held tiles cost registers, fewer programs stay
    resident); so did requesting the pipeline's first tiles before the wait (the wait moved into the K loop,
    a then loaded outside the pipeline: 4-70% slower, skinny_gemm_triton_variants_h200.log, "S-ring")."""
    if not sm_count:
        block_m = max(16, triton.next_power_of_2(m))
        block_k = min(128 if block_m <= 16 else 64, max(16, triton.next_power_of_2(k)))
        return TritonConfig(block_m, max(16, min(64, triton.next_power_of_2(n))), block_k, 1)
    bucket = _m_bucket(m)
    if sm_count == TABLE_SMS and bucket is not None and (bucket, n, k) in TABLE:
        return TABLE[(bucket, n, k)]
    return _heuristic(m, n, k, sm_count)


@functools.cache
def _sm90_cuda(device: torch.device) -> bool:
    """An NVIDIA GPU of compute capability 9.0 or newer (TMA, programmatic dependent launch)."""
    return device.type == "cuda" and not is_rocm() and torch.cuda.get_device_capability(device)[0] >= 9


def _descriptor(t: torch.Tensor, rows: int, cols: int):
    """A TMA descriptor of the 2-D ``t`` in [rows, cols] tiles, or None where TMA cannot read it (not an
    sm_90+ CUDA device, columns not unit-stride, a row stride or base not 16-byte aligned)."""
    if not _sm90_cuda(t.device):
        return None
    if t.stride(1) != 1 or (t.stride(0) * t.element_size()) % 16 or t.data_ptr() % 16:
        return None
    try:
        from triton.tools.tensor_descriptor import TensorDescriptor
    except ImportError:
        return None
    return TensorDescriptor.from_tensor(t, [rows, cols])


def supports(a, w, bias=None, residual=None) -> Reason:
    """None if the kernel handles these operands, else why not (any strides and offsets are fine)."""
    if a.dim() != 2 or w.dim() != 2:
        return f"needs 2-D a and w, got {a.dim()}-D and {w.dim()}-D"
    if a.dtype not in SUPPORTED_DTYPES:
        return f"dtype {a.dtype} not in {SUPPORTED_DTYPES}"
    for name, t in (("w", w), ("bias", bias), ("residual", residual)):
        if t is not None and t.dtype != a.dtype:
            return f"{name} dtype {t.dtype} != a dtype {a.dtype}"
    if a.shape[0] > MAX_M:
        return f"M={a.shape[0]} > {MAX_M}"
    return None


def profitable(a, w, bias=None, residual=None) -> Reason:
    """None where the kernel beats cuBLAS by more than the noise, else the reason. Measured on the H200
    (graph-timed, the configs ``choose_config`` picks; benchmarks/results/skinny_gemm_triton_sweep_h200.log
    at M = 1, 4, 16, skinny_gemm_triton_pdl_h200.log and skinny_gemm_triton_{coresident,settled}_h200.log
    at M = 1..16): ahead by 3-25% for N >= 2048 and K >= 4096 (2112, 3584, 4608, 20480 x 7168), by 20-25%
    for 7168 x 3584 at M <= 8 and 7% at M = 16, by 10% for 7168 x 2048 (M 1, 16); behind at 7168 x 1536
    (-10%); on par at 896 x 7168 (+2-4%). ROCm has no measurement and no CuTe: Triton stays the path
    there, as it does for CPU tensors under the interpreter."""
    if a.device.type != "cuda" or is_rocm():
        return None
    m = a.shape[0]
    n, k = w.shape
    if n >= 2048 and (k >= 4096 or (k >= 3072 and m <= 8) or (n >= 7168 and k >= 2048 and m <= 16)):
        return None
    return (f"cuBLAS measured as fast or faster for M={m} N={n} K={k} (Triton wins at N >= 2048 and "
            "K >= 4096, K >= 3072 with M <= 8, or N >= 7168 and K >= 2048 with M <= 16, on the H200)")


def available(a, w, bias=None, residual=None) -> Reason:
    return triton_can_run_on(a, w, bias, residual)


def skinny_gemm_triton(
    a: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor] = None,
    residual: Optional[torch.Tensor] = None, *, config: Optional[TritonConfig] = None,
    out: Optional[torch.Tensor] = None, static_weight: bool = False,
) -> torch.Tensor:
    """``a[M, K] @ w[N, K]^T + bias[N] + residual[M, N]`` -> new ``[M, N]`` tensor in ``a.dtype``.

    a, w, bias, residual: same dtype (fp16 / bf16 / fp32), same device, any strides; M <= 64.
    ``config`` overrides the heuristic (tests, benchmarks); ``out`` ([M, N], a.dtype) receives the
    result instead of a new tensor (tests poison it with NaN first). ``static_weight=True`` promises that
    no kernel writes ``w`` (a parameter; the compiler proves it in the graph): a PDL launch then loads the
    first weight tiles before waiting on the previous kernel. It changes nothing where the config has no
    PDL. Example::

        out = skinny_gemm_triton(x, layer.weight, layer.bias, residual=h)
    """
    reason = supports(a, w, bias, residual)
    if reason is not None:
        raise ValueError(f"skinny_gemm_triton: {reason}")
    m, k = a.shape
    n = w.shape[0]
    if w.shape[1] != k or (bias is not None and bias.shape != (n,)) or (
            residual is not None and residual.shape != (m, n)):
        raise ValueError(f"skinny_gemm_triton: shapes a{tuple(a.shape)} w{tuple(w.shape)} "
                         f"bias{None if bias is None else tuple(bias.shape)} "
                         f"residual{None if residual is None else tuple(residual.shape)} do not agree")
    if out is None:
        out = torch.empty((m, n), dtype=a.dtype, device=a.device)
    elif out.shape != (m, n) or out.dtype != a.dtype or out.device != a.device:
        raise ValueError(f"skinny_gemm_triton: out must be [{m}, {n}] {a.dtype} on {a.device}")
    if m == 0 or n == 0:
        return out
    if config is None:
        config = choose_config(m, n, k, sm_count(a.device), static_weight)
        if config.early_trigger and a.element_size() > 2:
            # sized for 16-bit tiles; fp32 tiles take twice the shared memory, so fewer programs stay
            # resident: the default depth, and the next product let in only after the K loop
            config = dataclasses.replace(config, early_trigger=False, num_stages=None)
    elif config.block_m < m or config.block_m & (config.block_m - 1) or (not config.fma and config.block_m < 16):
        raise ValueError(f"skinny_gemm_triton: {config} cannot hold M={m} "
                         "(block_m: a power of 2 >= M, and >= 16 for tl.dot)")
    k_per_split = triton.cdiv(triton.cdiv(k, config.split_k), config.block_k) * config.block_k
    split_k = max(1, triton.cdiv(k, k_per_split)) if k else 1
    n_tiles = triton.cdiv(n, config.block_n)
    ws = partial_slots(a.device, (split_k - 1) * m * n) if split_k > 1 and config.one_launch and config.poll else None
    poll = ws is not None
    if not poll:
        ws = torch.empty((split_k, m, n), dtype=torch.float32, device=a.device) if split_k > 1 else out
    counters = arrival_counters(a.device, n_tiles) if split_k > 1 and config.one_launch and not poll else None
    one_launch = poll or counters is not None
    res = residual if residual is not None else out
    r_strides = (res.stride(0), res.stride(1))
    # Triton 3.7's interpreter computes 16-bit tl.dot wrongly; fp32 products of 16-bit inputs
    # are exact, so upcasting there gives the same result the GPU's 16-bit MMA does.
    upcast = a.device.type == "cpu" and a.dtype != torch.float32
    flags = dict(HAS_BIAS=bias is not None, HAS_RES=residual is not None)
    tuning = dict(num_warps=config.num_warps)
    if config.num_stages is not None:
        tuning["num_stages"] = config.num_stages
    w_desc = _descriptor(w, config.block_n, config.block_k) if config.tma else None
    a_desc = _descriptor(a, config.block_m, config.block_k) if w_desc is not None and config.a_tma else None
    pdl = config.pdl and _sm90_cuda(a.device) and gdc_wait is not None
    if pdl:
        tuning["launch_pdl"] = True
    with torch.cuda.device(a.device) if a.device.type == "cuda" else contextlib.nullcontext():
        _skinny_gemm_kernel[(n_tiles, split_k)](
            a, w, w_desc if w_desc is not None else w, a_desc if a_desc is not None else a,
            bias if bias is not None else out, res, out, ws,
            counters if counters is not None else ws,
            m, n, k, k_per_split, split_k,
            a.stride(0), a.stride(1), w.stride(0), w.stride(1), *r_strides,
            out.stride(0), out.stride(1),
            SPLIT=split_k > 1, ONE_LAUNCH=one_launch, FMA=config.fma,
            LOOP_STAGES=(config.num_stages or 3) if config.fma and a.device.type == "cuda" else None,
            # fp32: IEEE products (no TF32); 16-bit: the target's default (ROCm rejects "tf32")
            PRECISION="ieee" if a.dtype == torch.float32 or upcast else None, UPCAST=upcast,
            BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, TMA=w_desc is not None,
            PDL=pdl, PREFETCH_LINES=config.prefetch_lines, EARLY_TRIGGER=config.early_trigger,
            A_TMA=a_desc is not None, POLL=poll, PTX=a.device.type == "cuda" and not is_rocm(),
            # peeled first tiles (static weights under a pdl config; off the GPU too, where only the wait is gone)
            PRE_K=config.preload * config.block_k if static_weight and config.pdl else 0,
            **tuning, **flags,
        )
        if split_k > 1 and not one_launch:
            _split_k_reduce_kernel[(n_tiles,)](
                ws, bias if bias is not None else out, res, out,
                m, n, split_k, *r_strides, out.stride(0), out.stride(1),
                BLOCK_M=config.block_m, BLOCK_N=config.block_n, num_warps=config.num_warps, **flags,
            )
    return out
