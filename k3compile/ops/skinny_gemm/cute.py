"""The skinny GEMM as a CuTe DSL kernel (NVIDIA sm_90+): ``C = A · Wᵀ (+ bias) (+ residual)``.

a: [M, K] (M ≤ 16), w: [N, K], bias: [N] or None, residual: [M, N] or None, all bf16 or all fp16,
fp32 accumulation, one rounding at the end (the same as ``reference.py``). One kernel is compiled per
(dtype, M, configuration, bias?, residual?, static weight?); N, K and the row strides are run-time
values. Compiled kernels are kept in memory and exported to an on-disk cache (``cute_compile.py``),
launched through TVM-FFI on the current torch stream (so they can be captured in CUDA graphs), with
programmatic dependent launch.

How it streams the weight: every lane takes 16 bytes of one weight row per K-step (4 lanes cover 32
consecutive K of a row, a warp covers 8 rows) and feeds them to two ``mma.sync.m16n8k16`` as the B
operand, A padded to 16 rows. Any order of K inside a step gives the same dot product, so A is loaded
in the same permuted order, also as 16-byte vectors: no shuffles and no ldmatrix. The weight reaches
registers either directly or through a per-warp cp.async ring in shared memory (``config.stages``; the
ring's main loop and A's ways into the MMA fragment -- plain loads, ``a_pipe``, ``a_ring``, ``a_share`` --
are in ``cute_ring.py``); with ``config.a_l1`` A is kept in L1, where the other blocks of the SM read it again.
Above M = 4 A's traffic past L1 is what makes larger M slower. See ``config.py`` for the work division (split-K
inside the block and across a cluster, rows per warp).

Hiding the fixed cost of a launch under the previous product (PDL): before its ``griddepcontrol.wait`` a
block may bulk-prefetch the first ``config.l2_kb`` KB of its weight into L2 (``cp.async.bulk.prefetch``,
one instruction per row; L2 is coherent with the previous kernel's stores, so any weight may be
prefetched), and under ``static_weight`` also fill its cp.async ring. With ``config.early`` it lets the
next kernel launch right after its own wait instead of after its K loop, so the next product's blocks
can settle on the SMs beside ours and start their own prefetch while ours still streams; with
``config.trigger_first`` and a static weight, as its blocks start (see ``launch_next_first``).

Split-K across a cluster (``config.split_k``): the blocks of a cluster take interleaved K chunks of the
same rows, fold their K-warps in shared memory, and after a cluster barrier each block reduces its
share of the outputs by reading the others' partial sums through distributed shared memory; a second
barrier keeps every block's shared memory alive until it has been read. No workspace, no counter.

The latent-MoE tail (``k3compile/ops/latent_moe_tail/cute.py``) compiles the same kernel with an
RMSNorm of A fused in (``norm_eps``): A is scaled by the norm weight as it is loaded, its rows' sums of
squares accumulate beside, and the epilogue multiplies by ``rsqrt(ss / K + eps)``.

cutlass is imported only inside functions: CI has no CuTe DSL and must still import this module.
"""
# no `from __future__ import annotations`: the DSL evaluates the kernels' annotations
import functools
from typing import Optional

import torch

from k3compile.kernels.cute.configs import VEC, KernelConfig, MmaConfig, WgmmaConfig
from k3compile.ops.skinny_gemm.cute_compile import compile_kernel

MAX_M = 16
_DTYPES = (torch.bfloat16, torch.float16)


# --------------------------------------------------------------------------------------------------
# predicates (no cutlass needed)

def supports(a, w, bias=None, residual=None) -> Optional[str]:
    """None when the kernel handles these shapes/dtypes/strides, else the reason."""
    if a.dim() != 2 or w.dim() != 2:
        return f"needs 2-D a and w, got {a.dim()}-D and {w.dim()}-D"
    m, k = a.shape
    n, kw = w.shape
    if kw != k:
        return f"K mismatch: a is [{m}, {k}], w is [{n}, {kw}]"
    if not 1 <= m <= MAX_M:
        return f"M={m} outside 1..{MAX_M}"
    if n < 1 or k < 1:
        return f"empty product (N={n}, K={k})"
    if a.dtype not in _DTYPES or w.dtype != a.dtype:
        return f"dtypes {a.dtype}/{w.dtype}: needs bf16 or fp16, both the same"
    if k % VEC:
        return f"K={k} not a multiple of {VEC} (128-bit loads)"
    for name, t in (("a", a), ("w", w)):
        if t.stride(1) != 1 or t.stride(0) % VEC or t.data_ptr() % 16:
            return f"{name} must be row-major with 16-byte aligned rows (strides {t.stride()})"
    if bias is not None:
        if bias.shape != (n,) or bias.dtype != a.dtype or bias.stride(0) != 1:
            return f"bias must be a contiguous [{n}] {a.dtype} tensor"
    if residual is not None:
        if residual.shape != (m, n) or residual.dtype != a.dtype or residual.stride(1) != 1:
            return f"residual must be a row-major [{m}, {n}] {a.dtype} tensor"
    return None


# --------------------------------------------------------------------------------------------------
# the kernel (built lazily: defining it needs cutlass)

@functools.cache
def _kernel_class():
    import cutlass
    import cutlass.cute as cute
    from cutlass._mlir.dialects import llvm
    from cutlass.cutlass_dsl import T, dsl_user_op

    from k3compile.ops.skinny_gemm.cute_ring import ring_mixin

    @dsl_user_op
    def mma_16816(a, b, c, is_fp16: bool, *, loc=None, ip=None):
        """One m16n8k16 MMA: a = 4 packed 32-bit A registers, b = 2 B registers, c = 4 fp32."""
        ty = "f16" if is_fp16 else "bf16"
        res = llvm.inline_asm(
            llvm.StructType.get_literal([T.f32()] * 4),
            [x.ir_value(loc=loc, ip=ip) for x in (*a, *b, *c)],
            f"mma.sync.aligned.m16n8k16.row.col.f32.{ty}.{ty}.f32 "
            "{$0,$1,$2,$3}, {$4,$5,$6,$7}, {$8,$9}, {$10,$11,$12,$13};",
            "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f",
            has_side_effects=False, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT,
            loc=loc, ip=ip,
        )
        return [cutlass.Float32(llvm.extractvalue(T.f32(), res, [i], loc=loc, ip=ip)) for i in range(4)]

    @dsl_user_op
    def ld_dsmem_sum_f32(addr, ranks: int, *, loc=None, ip=None):
        """Sum over the cluster's blocks 0..ranks-1 of the fp32 at shared-memory address ``addr`` in each, added in
        rank order from 0.0: all the remote loads are issued before the first add, so they share one round trip."""
        regs = " ".join(f".reg .b32 ra{r}; .reg .f32 va{r};" for r in range(ranks))
        maps = " ".join(f"mapa.shared::cluster.u32 ra{r}, $1, {r};" for r in range(ranks))
        loads = " ".join(f"ld.shared::cluster.f32 va{r}, [ra{r}];" for r in range(ranks))
        adds = " ".join(f"add.rn.f32 $0, {'0f00000000' if r == 0 else '$0'}, va{r};" for r in range(ranks))
        res = llvm.inline_asm(
            T.f32(),
            [addr.ir_value(loc=loc, ip=ip)],
            "{ " + " ".join((regs, maps, loads, adds)) + " }",
            "=f,r",
            has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT,
            loc=loc, ip=ip,
        )
        return cutlass.Float32(res)

    @dsl_user_op
    def prefetch_bulk_l2(addr, nbytes, *, loc=None, ip=None):
        """``nbytes`` (a multiple of 16) of global memory from ``addr`` (16-byte aligned) into L2, one
        instruction (the TMA unit walks the range)."""
        llvm.inline_asm(
            None,
            [addr.ir_value(loc=loc, ip=ip), nbytes.ir_value(loc=loc, ip=ip)],
            "cp.async.bulk.prefetch.L2.global [$0], $1;",
            "l,r",
            has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT,
            loc=loc, ip=ip,
        )

    class SkinnyGemm(ring_mixin()):
        """C[M, N] = A[M, K] · B[N, K]ᵀ (+ bias[N]) (+ R[M, N]); M, dtype and tiling fixed. The cp.async ring main
        loop and A's paths are inherited (``cute_ring.py``)."""

        def __init__(self, dtype, m: int, cfg: MmaConfig, has_bias: bool, has_res: bool,
                     static_weight: bool, norm_eps: Optional[float] = None):
            self.dtype = dtype
            self.m = m
            self.rg, self.wn, self.wk, self.unroll = cfg.row_groups, cfg.warps_n, cfg.warps_k, cfg.unroll
            self.prefetch = cfg.prefetch
            self.static_weight = static_weight
            self.stages = cfg.stages
            self.block_n = cfg.block_n
            self.threads = cfg.threads
            self.a_ring = cfg.a_ring and cfg.stages > 1
            self.a_pipe = cfg.a_pipe and cfg.stages > 1 and not cfg.a_ring
            self.a_share = cfg.a_share and self.a_ring
            # a_l1: A (re-read by every block on an SM) stays in L1; the weight (read once) does not evict it
            self.a_l1 = cfg.a_l1
            self.evict_a = cute.nvgpu.CacheEvictionPriority.EVICT_LAST   # used only with a_l1 (load_vec)
            self.evict_w = cute.nvgpu.CacheEvictionPriority.EVICT_FIRST
            self.smem = cfg.smem_bytes(m)
            self.has_bias, self.has_res = has_bias, has_res
            self.is_fp16 = dtype is cutlass.Float16
            self.ks = cfg.split_k
            self.early = cfg.early
            self.trigger_first = cfg.trigger_first and static_weight   # see launch_next_first
            self.l2_kb = cfg.l2_kb
            # RMSNorm of A fused in (the latent-MoE tail): A is scaled by g as it is loaded, the rows'
            # sums of squares accumulate beside, and the epilogue applies rsqrt(ss / K + eps)
            self.norm = norm_eps is not None
            self.eps = 0.0 if norm_eps is None else float(norm_eps)
            if self.norm:  # the K-warps' sums of squares [warps_k, 16] fp32
                self.smem += 64 * self.wk + 16

        @cute.jit
        def __call__(self, mA: cute.Tensor, mB: cute.Tensor, mC: cute.Tensor,
                     mBias, mRes, mG, stream):
            n = mB.shape[0]
            gx = (n + self.block_n - 1) // self.block_n
            if cutlass.const_expr(self.ks > 1):
                self.kernel(mA, mB, mC, mBias, mRes, mG).launch(
                    grid=[gx, self.ks, 1],
                    block=[self.threads, 1, 1],
                    cluster=[1, self.ks, 1],
                    smem=self.smem,
                    stream=stream,
                    use_pdl=True,
                )
            else:
                self.kernel(mA, mB, mC, mBias, mRes, mG).launch(
                    grid=[gx, 1, 1],
                    block=[self.threads, 1, 1],
                    smem=self.smem,
                    stream=stream,
                    use_pdl=True,
                )

        @cute.jit
        def load_vec(self, src: cute.Tensor, dst: cute.Tensor, evict: cutlass.Constexpr = None):
            """One 16-byte vector; ``evict``: its L1 eviction priority where ``a_l1`` asks for one."""
            prio = cute.nvgpu.CacheEvictionPriority.EVICT_NORMAL
            if cutlass.const_expr(self.a_l1 and evict is not None):
                prio = evict
            cute.autovec_copy(cute.make_tensor(src.iterator.align(16), src.layout), dst, l1c_evict_priority=prio)

        @cute.kernel
        def kernel(self, mA: cute.Tensor, mB: cute.Tensor, mC: cute.Tensor, mBias, mRes, mG):
            WN: cutlass.Constexpr = self.wn
            WK: cutlass.Constexpr = self.wk
            BN: cutlass.Constexpr = self.block_n

            self.launch_next_first()
            tidx, _, _ = cute.arch.thread_idx()
            bidx, q, _ = cute.arch.block_idx()  # q: this block's rank in its split-K cluster
            warp = tidx // 32
            lane = tidx % 32
            g = lane // 4   # weight row inside the 8-row group; A row (and A row + 8)
            t = lane % 4    # which 8 of the 32 K of a step
            wn = warp % WN
            wk = warp // WN
            gk = q * WK + wk  # the warp's K slice among the cluster's GWK
            N = mB.shape[0]
            K = mB.shape[1]

            # [row, (8, K/8)]: one 16-byte vector per (row, vector index)
            gA = cute.logical_divide(mA, (None, 8))
            gB = cute.logical_divide(mB, (None, 8))
            gG = cute.logical_divide(mG, (8,)) if cutlass.const_expr(self.norm) else None

            smem = cutlass.memory.SmemAllocator()
            red = smem.allocate_tensor(
                cutlass.Float32, cute.make_layout((WK, BN, 16), stride=(BN * 16, 16, 1)), byte_alignment=16)
            ssm = None
            if cutlass.const_expr(self.norm):
                ssm = smem.allocate_tensor(cutlass.Float32, cute.make_layout((WK, 16), stride=(16, 1)),
                                           byte_alignment=16)
            self.row_block(gA, gB, gG, mC, mBias, mRes, red, ssm, smem, bidx * BN, tidx, q, warp, lane, g, t, wn, wk, gk,
                           N, K)

        @cute.jit
        def row_block(self, gA: cute.Tensor, gB: cute.Tensor, gG, mC: cute.Tensor, mBias, mRes, red: cute.Tensor,
                      ssm, smem, n0, tidx, q, warp, lane, g, t, wn, wk, gk, N, K):
            """The block's BN weight rows from n0: stream the weight, reduce the partial sums, store."""
            M: cutlass.Constexpr = self.m
            RG: cutlass.Constexpr = self.rg
            WK: cutlass.Constexpr = self.wk
            U: cutlass.Constexpr = self.unroll
            BN: cutlass.Constexpr = self.block_n
            NT: cutlass.Constexpr = self.threads
            CH: cutlass.Constexpr = 32 * self.unroll  # K elements per unrolled chunk
            S: cutlass.Constexpr = self.stages
            KS: cutlass.Constexpr = self.ks
            GWK: cutlass.Constexpr = self.wk * self.ks  # K-warps of the whole cluster

            # rows past N / M are clamped to a valid row: their results are never stored
            rows = []
            for r in cutlass.range_constexpr(RG):
                rows.append(cutlass.min(n0 + (wn * RG + r) * 8 + g, N - 1))
            m_lo = cutlass.min(g, M - 1)
            m_hi = cutlass.min(g + 8, M - 1)

            # one accumulator per unrolled step: independent MMA chains instead of one serial chain
            acc = cute.make_rmem_tensor((4, RG, U), cutlass.Float32)
            acc.fill(0.0)
            rB = cute.make_rmem_tensor((8, RG * U), self.dtype)
            rA = cute.make_rmem_tensor((8, 2 * U), self.dtype)
            rB32 = cute.recast_tensor(rB, cutlass.Int32)
            rA32 = cute.recast_tensor(rA, cutlass.Int32)
            ss = cute.make_rmem_tensor((2,), cutlass.Float32)  # rows m_lo, m_hi: sum of squares of raw A
            ss.fill(0.0)

            n_full = K // CH
            if cutlass.const_expr(self.l2_kb > 0):
                self.prefetch_weight_l2(gB, tidx, q, n0, N, K)
            if cutlass.const_expr(S > 1):
                self.main_loop_cp_async(gA, gB, gG, rows, m_lo, m_hi, t, lane, warp, gk, n_full,
                                        acc, rA, rB, rA32, rB32, ss, smem)
            else:
                if cutlass.const_expr(self.prefetch and self.l2_kb == 0):
                    # the weight does not depend on the previous kernel: start pulling it into L2 now
                    if gk < n_full:
                        for u in cutlass.range_constexpr(U):
                            for r in cutlass.range_constexpr(RG):
                                v = gB[rows[r], (None, gk * (CH // 8) + t + 4 * u)]
                                cute.arch.prefetch(v.iterator.llvm_ptr, cache_level="L2")

                # PDL: everything above overlaps the previous kernel's tail; A may be its output
                self.wait_previous()

                for j in cutlass.range(gk, n_full, GWK, unroll=1):
                    kv0 = j * (CH // 8) + t
                    for u in cutlass.range_constexpr(U):
                        for r in cutlass.range_constexpr(RG):
                            self.load_vec(gB[rows[r], (None, kv0 + 4 * u)], rB[None, r * U + u], self.evict_w)
                    self.load_a(gA, gG, m_lo, m_hi, kv0, rA, ss)
                    for u in cutlass.range_constexpr(U):
                        self.mma_step(acc, rA32, rB32, u, u, U)

            # K tail: single steps of 32, lanes past K contribute zeros
            n_steps = (K + 31) // 32
            for s in cutlass.range(n_full * U + gk, n_steps, GWK, unroll=1):
                kv = s * 4 + t
                rB.fill(0.0)
                rA.fill(0.0)
                if kv * 8 < K:
                    for r in cutlass.range_constexpr(RG):
                        self.load_vec(gB[rows[r], (None, kv)], rB[None, r * U], self.evict_w)
                    self.load_a_step(gA, gG, m_lo, m_hi, kv, rA, 0, ss)
                self.mma_step(acc, rA32, rB32, 0, 0, U)

            if cutlass.const_expr(not self.early):
                # the next kernel may start launching; it still waits for our stores (griddepcontrol.wait)
                cute.arch.griddepcontrol_launch_dependents()

            # partial sums of the K-warps meet in shared memory: red[wk, row in block, m]
            for r in cutlass.range_constexpr(RG):
                for u in cutlass.range_constexpr(1, U):
                    for i in cutlass.range_constexpr(4):
                        acc[i, r, 0] = acc[i, r, 0] + acc[i, r, u]
                nl = (wn * RG + r) * 8 + 2 * t
                red[wk, nl, g] = acc[0, r, 0]
                red[wk, nl + 1, g] = acc[1, r, 0]
                if cutlass.const_expr(M > 8):
                    red[wk, nl, g + 8] = acc[2, r, 0]
                    red[wk, nl + 1, g + 8] = acc[3, r, 0]
            if cutlass.const_expr(self.norm):
                # the 4 lanes of a row group hold one row's K slices; one lane per row writes (rows of
                # clamped lanes are duplicates; warps with wn > 0 load the same A as wn == 0)
                s_lo = cute.arch.warp_reduction(ss[0], lambda x, y: x + y, threads_in_group=4)
                s_hi = cute.arch.warp_reduction(ss[1], lambda x, y: x + y, threads_in_group=4)
                if wn == 0 and t == 0:
                    if g < M:
                        ssm[wk, g] = s_lo
                    if cutlass.const_expr(M > 8):
                        if g + 8 < M:
                            ssm[wk, g + 8] = s_hi
            cute.arch.sync_threads()

            if cutlass.const_expr(KS == 1):
                for idx in cutlass.range(tidx, BN * M, NT, unroll=1):
                    m = idx // BN
                    nl = idx % BN
                    n = n0 + nl
                    if n < N:
                        s = cutlass.Float32(0.0)
                        for w in cutlass.range_constexpr(WK):
                            s = s + red[w, nl, m]
                        if cutlass.const_expr(self.norm):
                            sq = cutlass.Float32(0.0)
                            for w in cutlass.range_constexpr(WK):
                                sq = sq + ssm[w, m]
                            s = s * cute.math.rsqrt(sq / cutlass.Float32(K) + self.eps)
                        self.store_out(mC, mBias, mRes, m, n, s)
            else:
                self.cluster_epilogue(mC, mBias, mRes, red, ssm, tidx, q, n0, N, K)

        @cute.jit
        def store_out(self, mC: cute.Tensor, mBias, mRes, m, n, s):
            if cutlass.const_expr(self.has_bias):
                s = s + mBias[n].to(cutlass.Float32)
            if cutlass.const_expr(self.has_res):
                s = s + mRes[m, n].to(cutlass.Float32)
            mC[m, n] = s.to(self.dtype)

        @cute.jit
        def cluster_epilogue(self, mC: cute.Tensor, mBias, mRes, red: cute.Tensor, ssm, tidx, q, n0, N, K):
            """Split-K across the blocks of a cluster: each block folds its K-warps into red[0], then
            block q reads the partials of every block through distributed shared memory for its share of
            the outputs. The second cluster barrier keeps every block's shared memory alive until read."""
            M: cutlass.Constexpr = self.m
            WK: cutlass.Constexpr = self.wk
            BN: cutlass.Constexpr = self.block_n
            NT: cutlass.Constexpr = self.threads
            KS: cutlass.Constexpr = self.ks
            for idx in cutlass.range(tidx, BN * M, NT, unroll=1):
                m = idx // BN
                nl = idx % BN
                s = cutlass.Float32(0.0)
                for w in cutlass.range_constexpr(WK):
                    s = s + red[w, nl, m]
                red[0, nl, m] = s
            if cutlass.const_expr(self.norm):
                if tidx < M:
                    sq = cutlass.Float32(0.0)
                    for w in cutlass.range_constexpr(WK):
                        sq = sq + ssm[w, tidx]
                    ssm[0, tidx] = sq
            # release our partials to the cluster, then wait for every block's (on sm_90a ptxas makes this
            # cluster-scope fence a MEMBAR.ALL.GPU, as it does for a releasing barrier.cluster.arrive)
            cute.arch.fence_acq_rel_cluster()
            cute.arch.cluster_arrive_relaxed()
            cute.arch.cluster_wait()
            for idx in cutlass.range(q * NT + tidx, BN * M, NT * KS, unroll=1):
                m = idx // BN
                nl = idx % BN
                n = n0 + nl
                if n < N:
                    s = ld_dsmem_sum_f32((red.iterator + (nl * 16 + m)).toint(), KS)
                    if cutlass.const_expr(self.norm):
                        sq = ld_dsmem_sum_f32((ssm.iterator + m).toint(), KS)
                        s = s * cute.math.rsqrt(sq / cutlass.Float32(K) + self.eps)
                    self.store_out(mC, mBias, mRes, m, n, s)
            # keep our shared memory alive until every block has read it: the remote loads above have returned
            # (their values are stored), so a relaxed arrive is enough and skips a second GPU-wide fence
            cute.arch.cluster_arrive_relaxed()
            cute.arch.cluster_wait()

        @cute.jit
        def launch_next_first(self):
            """PDL, ``trigger_first`` under ``static_weight``: let the next kernel launch as our blocks start (a
            block's first trigger counts; the later calls then do nothing), so that several products' weights are
            in flight at once (the next kernel's blocks settle beside ours and stream their weight before their
            wait). Only a call whose weight is proven static may do so: static_weights.py says why that is safe."""
            if cutlass.const_expr(self.trigger_first):
                cute.arch.griddepcontrol_launch_dependents()

        @cute.jit
        def wait_previous(self):
            """PDL: wait for the previous kernel (its stores are then visible); with ``early`` let the next
            kernel launch right away. Without ``trigger_first`` triggering stays after our own wait, so that a
            kernel of ours launched without a static weight never lets its successor in before then
            (k3compile/static_weights.py)."""
            cute.arch.griddepcontrol_wait()
            if cutlass.const_expr(self.early):
                cute.arch.griddepcontrol_launch_dependents()

        @cute.jit
        def prefetch_weight_l2(self, gB: cute.Tensor, tidx, q, n0, N, K):
            """Before the PDL wait: pull the first ``l2_kb`` KB of the block's weight into L2, one bulk
            prefetch per row. The cluster's blocks share rows, so block q takes the q-th part of the
            cluster's K prefix (L2 is coherent with the previous kernel's stores: safe for any weight)."""
            BN: cutlass.Constexpr = self.block_n
            PV: cutlass.Constexpr = max(1, self.l2_kb * 1024 // (BN * 16))  # 16-byte vectors per row per block
            if tidx < BN:
                n = n0 + tidx
                kv0 = q * PV
                nv = cutlass.min(K // 8 - kv0, PV)
                if n < N and nv > 0:
                    v = gB[n, (None, kv0)]
                    prefetch_bulk_l2(v.iterator.toint(), cutlass.Int32(nv * 16))

        @cute.jit
        def mma_step(self, acc: cute.Tensor, rA32: cute.Tensor, rB32: cute.Tensor,
                     u: cutlass.Constexpr, slot: cutlass.Constexpr, U: cutlass.Constexpr):
            """Two m16n8k16 MMAs per row group over the 32 K of step u (see the module doc)."""
            M: cutlass.Constexpr = self.m
            hi: cutlass.Constexpr = 2 * u + 1 if M > 8 else 2 * u  # rows 8..15: garbage when M ≤ 8
            for r in cutlass.range_constexpr(self.rg):
                for h in cutlass.range_constexpr(2):
                    a = (rA32[2 * h, 2 * u], rA32[2 * h, hi], rA32[2 * h + 1, 2 * u], rA32[2 * h + 1, hi])
                    b = (rB32[2 * h, r * U + u], rB32[2 * h + 1, r * U + u])
                    c = (acc[0, r, slot], acc[1, r, slot], acc[2, r, slot], acc[3, r, slot])
                    d = mma_16816(a, b, c, self.is_fp16)
                    for i in cutlass.range_constexpr(4):
                        acc[i, r, slot] = d[i]

    return SkinnyGemm


# --------------------------------------------------------------------------------------------------
# public entry points

def skinny_gemm_cute(a: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor], residual: Optional[torch.Tensor],
                     cfg: KernelConfig, out: Optional[torch.Tensor] = None, static_weight: bool = False) -> torch.Tensor:
    """``a @ w.T (+ bias) (+ residual)`` on the current CUDA stream; returns a new [M, N] tensor (or fills ``out``).

    a: [M, K] (M <= 16), w: [N, K], bias: [N], residual: [M, N]; bf16 or fp16; K % 8 == 0 (``supports``). ``cfg``
    names the kernel and its work division (``dispatch.cute_config`` gives the op's): an ``MmaConfig`` runs the
    mma.sync kernel, a ``WgmmaConfig`` the wgmma kernel. ``out``: a contiguous [M, N] tensor of a's dtype.
    ``static_weight=True`` promises that no kernel writes ``w`` (a module parameter): the kernel then starts
    streaming it before waiting on the previous kernel (PDL), which is unsafe otherwise; and with a ``trigger_first``
    configuration it lets the next kernel launch before its own wait (``op.py`` says what a caller vouches for).
    """
    m, k = a.shape
    n = w.shape[0]
    if isinstance(cfg, WgmmaConfig) and not cfg.share_fits(k):
        raise ValueError(f"{cfg.tag()}: a block's share of K={k} does not suit its register tiles / resident A "
                         f"({cfg.reg_stages}..{cfg.a_tiles()} tiles of {cfg.block_k})")
    fn = compile_kernel(a.dtype, m, cfg, bias is not None, residual is not None, static_weight)
    if out is None:
        out = torch.empty((m, n), dtype=a.dtype, device=a.device)
    fn(a, w, out, bias, residual, None)
    return out


def warmup(dtype: torch.dtype, m: int, cfg: KernelConfig, has_bias: bool = False, has_residual: bool = False,
           static_weight: bool = False) -> None:
    """Compile (or load) the variant a later call will use, so that CUDA-graph capture never compiles."""
    compile_kernel(dtype, m, cfg, has_bias, has_residual, static_weight)
