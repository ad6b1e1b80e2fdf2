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
Weight tiles, and optionally a's, may come by TMA. Accumulation is fp32 always, and the output is stored in
its tensor's dtype (the operands' or fp32); fp32 inputs use IEEE products (no TF32). Any M <=
``triton_config.MAX_M``, N and K; tails are masked.

With ``pdl`` (sm_90+) the kernel is launched with programmatic dependent launch: its programs may start
while the previous kernel finishes, and touch nothing another kernel may write or read (a, residual, out,
workspace, counters) before ``gdc_wait()``. Before it they may only prefetch weight lines into L2, or, when
the caller promises ``static_weight`` (no kernel writes the weight), load the first weight tiles. Every
program lets the next kernel in only after its own wait: the static-weight proof relies on that.

Runs on CUDA/ROCm tensors, and on CPU tensors under ``TRITON_INTERPRET=1`` (tests).
"""
from __future__ import annotations

import contextlib
from typing import Optional

import torch
import triton
import triton.language as tl

try:  # grid dependency control (PDL), Triton >= 3.4
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover
    gdc_launch_dependents = gdc_wait = None

from k3compile.backends import is_rocm, local_memory_budget, sm90_nvidia, sm_count
from k3compile.ops.arrival_counters import PARTIAL_EMPTY as _EMPTY_WORD, arrival_counters, partial_slots

from . import triton_config
from .triton_config import TritonConfig, supports


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
def _load_four(p, stride, m0, m1, m2, m3, CACHE: tl.constexpr, POLL: tl.constexpr):
    """Four partial tiles ``stride`` apart (-0.0 where masked) and, with ``POLL``, whether any word of them
    still holds ``PARTIAL_EMPTY`` (the loads are then volatile: every poll reads L2 anew)."""
    b_p0 = tl.load(p, mask=m0, other=-0.0, cache_modifier=CACHE, volatile=POLL)
    b_p1 = tl.load(p + stride, mask=m1, other=-0.0, cache_modifier=CACHE, volatile=POLL)
    b_p2 = tl.load(p + 2 * stride, mask=m2, other=-0.0, cache_modifier=CACHE, volatile=POLL)
    b_p3 = tl.load(p + 3 * stride, mask=m3, other=-0.0, cache_modifier=CACHE, volatile=POLL)
    empty = False
    if POLL:
        n_empty = ((b_p0.to(tl.int32, bitcast=True) == PARTIAL_EMPTY).to(tl.int32)
                   + (b_p1.to(tl.int32, bitcast=True) == PARTIAL_EMPTY).to(tl.int32)
                   + (b_p2.to(tl.int32, bitcast=True) == PARTIAL_EMPTY).to(tl.int32)
                   + (b_p3.to(tl.int32, bitcast=True) == PARTIAL_EMPTY).to(tl.int32))
        empty = tl.sum(tl.sum(n_empty, axis=1), axis=0) > 0
    return b_p0, b_p1, b_p2, b_p3, empty


@triton.jit
def _sum_partials(ws_ptr, o_m, o_n, m_out, M, N, N_PARTS, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  CACHE: tl.constexpr, POLL: tl.constexpr):
    """The sum, in split order, of this tile's first ``N_PARTS`` fp32 partials (every reduction adds in that
    order, so all agree bit for bit). Loaded four at a time, so their L2 round trips overlap at the end of the
    kernel, where nothing hides them; a slot past ``N_PARTS`` adds -0.0, which changes no value. With ``POLL``
    each group of four is read again until none of its words holds ``PARTIAL_EMPTY``, and the slots read are
    set back to empty for the next launch."""
    b_acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    p_ws = ws_ptr + o_m[:, None] * N + o_n[None, :]
    for s0 in range(0, N_PARTS, 4):
        m1 = m_out & (s0 + 1 < N_PARTS)
        m2 = m_out & (s0 + 2 < N_PARTS)
        m3 = m_out & (s0 + 3 < N_PARTS)
        b_p0, b_p1, b_p2, b_p3, empty = _load_four(p_ws + s0 * M * N, M * N, m_out, m1, m2, m3, CACHE, POLL)
        if POLL:
            while empty:
                b_p0, b_p1, b_p2, b_p3, empty = _load_four(p_ws + s0 * M * N, M * N, m_out, m1, m2, m3, CACHE,
                                                           POLL)
            b_empty = tl.full((BLOCK_M, BLOCK_N), PARTIAL_EMPTY, tl.int32).to(tl.float32, bitcast=True)
            tl.store(p_ws + s0 * M * N, b_empty, mask=m_out)
            tl.store(p_ws + (s0 + 1) * M * N, b_empty, mask=m1)
            tl.store(p_ws + (s0 + 2) * M * N, b_empty, mask=m2)
            tl.store(p_ws + (s0 + 3) * M * N, b_empty, mask=m3)
        b_acc = (((b_acc + b_p0) + b_p1) + b_p2) + b_p3
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
                b_acc += _sum_partials(ws_ptr, o_m, o_n, m_out, M, N, SPLIT_K - 1, BLOCK_M, BLOCK_N, "", True)
            else:
                # .cg: read from L2, where the other programs' partials are, never a stale L1 line
                b_acc = _sum_partials(ws_ptr, o_m, o_n, m_out, M, N, SPLIT_K, BLOCK_M, BLOCK_N, ".cg", False)
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
    b_acc = _sum_partials(ws_ptr, o_m, o_n, m_out, M, N, SPLIT_K, BLOCK_M, BLOCK_N, "", False)
    if HAS_BIAS:
        b_acc += tl.load(bias_ptr + o_n, mask=m_n, other=0.0).to(tl.float32)[None, :]
    if HAS_RES:
        b_acc += tl.load(res_ptr + o_m[:, None] * stride_rm + o_n[None, :] * stride_rn,
                         mask=m_out, other=0.0).to(tl.float32)
    tl.store(out_ptr + o_m[:, None] * stride_om + o_n[None, :] * stride_on,
             b_acc.to(out_ptr.dtype.element_ty), mask=m_out)


def _descriptor(t: torch.Tensor, rows: int, cols: int):
    """A TMA descriptor of the 2-D ``t`` in [rows, cols] tiles, or None where TMA cannot read it (not an
    sm_90+ CUDA device, columns not unit-stride, a row stride or base not 16-byte aligned)."""
    if not sm90_nvidia(t.device):
        return None
    if t.stride(1) != 1 or (t.stride(0) * t.element_size()) % 16 or t.data_ptr() % 16:
        return None
    try:
        from triton.tools.tensor_descriptor import TensorDescriptor
    except ImportError:
        return None
    return TensorDescriptor.from_tensor(t, [rows, cols])


def skinny_gemm_triton(
    a: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor] = None,
    residual: Optional[torch.Tensor] = None, *, config: Optional[TritonConfig] = None,
    out: Optional[torch.Tensor] = None, static_weight: bool = False, out_dtype: Optional[torch.dtype] = None,
) -> torch.Tensor:
    """``a[M, K] @ w[N, K]^T + bias[N] + residual[M, N]`` -> new ``[M, N]`` tensor in ``out_dtype`` (default
    ``a.dtype``).

    a, w, bias, residual: same dtype (fp16 / bf16 / fp32), same device, any strides; M <= 64. ``out_dtype=float32``
    on 16-bit operands stores the fp32 accumulator unrounded (residual then fp32): ``linear(a.float(), w.float())``
    without the cast. ``config``: the dispatch's (``dispatch.triton_config_for``), else the heuristic's; ``out``
    ([M, N], out_dtype) receives the result instead of a new tensor (tests poison it with NaN first).
    ``static_weight=True`` promises that no kernel writes ``w`` (a parameter; the compiler proves it in the
    graph): a PDL launch then loads the first weight tiles before waiting on the previous kernel. It changes nothing where the config has no
    PDL. Example::

        out = skinny_gemm_triton(x, layer.weight, layer.bias, residual=h)
    """
    reason = supports(a, w, bias, residual, out_dtype)
    if reason is not None:
        raise ValueError(f"skinny_gemm_triton: {reason}")
    m, k = a.shape
    n = w.shape[0]
    if w.shape[1] != k or (bias is not None and bias.shape != (n,)) or (
            residual is not None and residual.shape != (m, n)):
        raise ValueError(f"skinny_gemm_triton: shapes a{tuple(a.shape)} w{tuple(w.shape)} "
                         f"bias{None if bias is None else tuple(bias.shape)} "
                         f"residual{None if residual is None else tuple(residual.shape)} do not agree")
    out_dtype = out_dtype or a.dtype
    if out is None:
        out = torch.empty((m, n), dtype=out_dtype, device=a.device)
    elif out.shape != (m, n) or out.dtype != out_dtype or out.device != a.device:
        raise ValueError(f"skinny_gemm_triton: out must be [{m}, {n}] {out_dtype} on {a.device}")
    if m == 0 or n == 0:
        return out
    if config is None:
        config = triton_config.for_dtype(triton_config.heuristic(m, n, k, sm_count(a.device)), a.element_size())
    elif config.block_m < m or config.block_m & (config.block_m - 1) or (not config.fma and config.block_m < 16):
        raise ValueError(f"skinny_gemm_triton: {config} cannot hold M={m} "
                         "(block_m: a power of 2 >= M, and >= 16 for tl.dot)")
    config = triton_config.fit_local_memory(config, a.element_size(), local_memory_budget(a.device))
    k_per_split = triton.cdiv(triton.cdiv(k, config.split_k), config.block_k) * config.block_k
    split_k = max(1, triton.cdiv(k, k_per_split)) if k else 1
    n_tiles = triton.cdiv(n, config.block_n)
    # Polled partials on NVIDIA only: there the polls are ld.volatile, read from L2; on AMD (gfx942) a volatile load
    # may be served by the compute unit's own L1, which other workgroups' stores never reach (a spin that may not
    # end). There the last program to arrive sums them, behind the arrival counter's acq_rel atomic.
    poll = split_k > 1 and config.one_launch and config.poll and not is_rocm()
    ws = partial_slots(a.device, (split_k - 1) * m * n) if poll else None
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
    pdl = config.pdl and sm90_nvidia(a.device) and gdc_wait is not None
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
