"""The mma.sync skinny GEMM kernel (NVIDIA sm_90+): ``C = A · Wᵀ (+ bias) (+ residual)``, M <= 16.

Every lane takes 16 bytes of one weight row per K-step (4 lanes cover 32 consecutive K of a row, a warp covers 8
rows) and feeds them to two ``mma.sync.m16n8k16`` as the B operand, A padded to 16 rows. Any order of K inside a
step gives the same dot product, so A is loaded in the same permuted order, also as 16-byte vectors: no shuffles
and no ldmatrix. The weight reaches registers directly (``stages == 1``) or through a per-warp cp.async ring in
shared memory (``mma_ring.py``); with ``a_l1`` A stays in L1, where the SM's other blocks read it again.

A block is ``warps_n x warps_k`` warps: ``warps_k`` split K inside the block (their partial sums meet in shared
memory); ``split_k > 1`` also splits K across a cluster, whose blocks each reduce their share of the outputs by
reading the others' partial sums through distributed shared memory (no workspace, no counter: CUDA-graph safe).

PDL: before its ``griddepcontrol.wait`` a block may bulk-prefetch the first ``l2_kb`` KB of its weight into L2
(coherent with the previous kernel's stores, so safe for any weight), and under ``static_weight`` also fill its
ring. ``early`` lets the next kernel launch right after our wait instead of after the K loop; ``trigger_first`` with
a static weight, as our blocks start (``launch_next_first``; ``k3compile/static_weights.py`` says why that is safe).

With ``norm_eps`` (the latent-MoE tail) A is scaled by the norm weight g as it is loaded, its rows' sums of squares
accumulate beside, and the epilogue multiplies by ``rsqrt(ss / K + eps)``.

A kernel module: it imports cutlass at its top and is loaded only when a kernel is built (``compile.py``).
"""
# no `from __future__ import annotations`: the DSL evaluates the kernels' annotations
from typing import Optional

import cutlass
import cutlass.cute as cute

from k3compile.kernels.cute.asm import dsmem_sum_f32, mma_16816, prefetch_bulk_l2
from k3compile.kernels.cute.configs import MmaConfig
from k3compile.kernels.cute.mma_ring import RingMainLoop


class MmaSkinnyGemm(RingMainLoop):
    """C[M, N] = A[M, K] · B[N, K]ᵀ (+ bias[N]) (+ R[M, N]); M, dtype and tiling fixed. The cp.async ring main
    loop and A's paths are inherited (``mma_ring.py``)."""

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
        mC[m, n] = s.to(mC.element_type)

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
                s = dsmem_sum_f32((red.iterator + (nl * 16 + m)).toint(), KS)
                if cutlass.const_expr(self.norm):
                    sq = dsmem_sum_f32((ssm.iterator + m).toint(), KS)
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
