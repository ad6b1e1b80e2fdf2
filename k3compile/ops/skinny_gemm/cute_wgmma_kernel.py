"""The CuTe DSL kernel of ``cute_wgmma.py`` (the host side, configuration and compile cache live there).

One warpgroup streams a block's weight rows (wgmma's M side) through a TMA + mbarrier ring against A (wgmma's N side,
8 or 16 rows) and keeps the fp32 accumulator tile in registers; the blocks of a split-K cluster sum their partial tiles
through distributed shared memory in the epilogue, which adds bias / residual and stores C along N. Options (see
``WgmmaConfig``): a producer warp, L2 eviction hints, the early PDL trigger, the static-weight early requests.

cutlass is imported only inside ``kernel_class``: CI has no CuTe DSL.
"""
# no `from __future__ import annotations`: the DSL evaluates the kernels' annotations
import functools
from k3compile.ops.skinny_gemm.cute_wgmma import EVICT_FIRST_POLICY, EVICT_LAST_POLICY, WgmmaConfig, m_pad


@functools.cache
def kernel_class():
    import cutlass
    import cutlass.cute as cute
    import cutlass.pipeline as pipeline
    import cutlass.utils as utils
    import cutlass.utils.hopper_helpers as sm90
    from cutlass._mlir.dialects import llvm
    from cutlass.cutlass_dsl import T, dsl_user_op

    @dsl_user_op
    def dsmem_sum_f32(addr, ranks: int, *, loc=None, ip=None):
        """Sum, in rank order, of the fp32 at shared address ``addr`` in each of the cluster's blocks 0..ranks-1
        (every remote load issued before the first add: one round trip)."""
        regs = " ".join(f".reg .b32 ra{r}; .reg .f32 va{r};" for r in range(ranks))
        maps = " ".join(f"mapa.shared::cluster.u32 ra{r}, $1, {r};" for r in range(ranks))
        loads = " ".join(f"ld.shared::cluster.f32 va{r}, [ra{r}];" for r in range(ranks))
        adds = " ".join(f"add.rn.f32 $0, {'0f00000000' if r == 0 else '$0'}, va{r};" for r in range(ranks))
        res = llvm.inline_asm(
            T.f32(), [addr.ir_value(loc=loc, ip=ip)], "{ " + " ".join((regs, maps, loads, adds)) + " }",
            "=f,r", has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT,
            loc=loc, ip=ip,
        )
        return cutlass.Float32(res)

    class WgmmaSkinnyGemm:
        """C[M, N] = A[M, K] · W[N, K]ᵀ (+ bias[N]) (+ R[M, N]), weight rows on wgmma's M side."""

        def __init__(self, dtype, m: int, cfg: WgmmaConfig, has_bias: bool, has_res: bool, static_weight: bool):
            self.dtype = dtype
            self.m = m
            self.mp = m_pad(m)
            self.bn, self.bk, self.stages, self.ks = cfg.block_n, cfg.block_k, cfg.stages, cfg.split_k
            self.pw, self.hints, self.early = cfg.producer_warp, cfg.evict_hints, cfg.early
            self.has_bias, self.has_res = has_bias, has_res
            self.static_weight = static_weight and cfg.early_w
            self.threads = 160 if self.pw else 128  # the MMA warpgroup (+ the producer warp)
            self.tx_bytes = (self.bn + self.mp) * self.bk * dtype.width // 8

        @cute.jit
        def __call__(self, mA: cute.Tensor, mW: cute.Tensor, mC: cute.Tensor, mBias, mRes, mG, stream):
            # mG (a norm weight) is always None: the call is the mma.sync kernel's, whose fused-norm form this lacks
            tile = (self.bn, self.mp, self.bk)
            kmajor = utils.LayoutEnum.ROW_MAJOR  # both operands K-major
            self.w_layout = sm90.make_smem_layout_a(kmajor, tile, self.dtype, self.stages)
            self.a_layout = sm90.make_smem_layout_b(kmajor, tile, self.dtype, self.stages)
            tiled_mma = sm90.make_trivial_tiled_mma(
                self.dtype, self.dtype, cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.K,
                cutlass.Float32, (1, 1, 1), tiler_mn=(64, self.mp))
            op = cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp()
            w_one = cute.slice_(self.w_layout, (None, None, 0))
            a_one = cute.slice_(self.a_layout, (None, None, 0))
            tma_w, gW = cute.nvgpu.cpasync.make_tiled_tma_atom(op, mW, w_one, (self.bn, self.bk))
            tma_a, gA = cute.nvgpu.cpasync.make_tiled_tma_atom(op, mA, a_one, (self.mp, self.bk))

            @cute.struct
            class Storage:
                bars: cute.struct.MemRange[cutlass.Int64, self.stages * 2]
                sW: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(self.w_layout)], 1024]
                sA: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(self.a_layout)], 1024]
                red: cute.struct.Align[cute.struct.MemRange[cutlass.Float32, self.bn * (self.mp + 1)], 16]

            self.storage = Storage
            n = mW.shape[0]
            gx = (n + self.bn - 1) // self.bn * self.ks
            self.kernel(tma_w, gW, tma_a, gA, mC, mBias, mRes, tiled_mma, self.w_layout, self.a_layout).launch(
                grid=[gx, 1, 1], block=[self.threads, 1, 1], cluster=[self.ks, 1, 1],
                smem=Storage.size_in_bytes(), stream=stream, use_pdl=True)

        @cute.kernel
        def kernel(self, tma_w: cute.CopyAtom, gW_full: cute.Tensor, tma_a: cute.CopyAtom, gA_full: cute.Tensor,
                   mC: cute.Tensor, mBias, mRes, tiled_mma: cute.TiledMma, w_layout: cute.ComposedLayout,
                   a_layout: cute.ComposedLayout):
            BN: cutlass.Constexpr = self.bn
            BK: cutlass.Constexpr = self.bk
            MP: cutlass.Constexpr = self.mp
            KS: cutlass.Constexpr = self.ks
            S: cutlass.Constexpr = self.stages
            PROD: cutlass.Constexpr = 4 if self.pw else 0  # the warp that issues the TMA loads
            tidx, _, _ = cute.arch.thread_idx()
            warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
            bidx, _, _ = cute.arch.block_idx()
            q = bidx % KS       # rank in the split-K cluster (the cluster spans consecutive x)
            rb = bidx // KS     # row block
            if warp == PROD:
                cute.nvgpu.cpasync.prefetch_descriptor(tma_w)
                cute.nvgpu.cpasync.prefetch_descriptor(tma_a)

            smem = cutlass.utils.SmemAllocator()
            st = smem.allocate(self.storage)
            pipe = pipeline.PipelineTmaAsync.create(
                barrier_storage=st.bars.data_ptr(), num_stages=S,
                producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
                consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 4),  # one arrive per MMA warp
                tx_count=self.tx_bytes)
            sW = st.sW.get_tensor(w_layout.outer, swizzle=w_layout.inner)
            sA = st.sA.get_tensor(a_layout.outer, swizzle=a_layout.inner)

            # (BN, BK, k tiles) of this block's rows; (MP, BK, k tiles) of A
            gW = cute.local_tile(gW_full, (BN, BK), (rb, None))
            gA = cute.local_tile(gA_full, (MP, BK), (0, None))
            tWs, tWg = cute.nvgpu.cpasync.tma_partition(
                tma_w, 0, cute.make_layout(1), cute.group_modes(sW, 0, 2), cute.group_modes(gW, 0, 2))
            tAs, tAg = cute.nvgpu.cpasync.tma_partition(
                tma_a, 0, cute.make_layout(1), cute.group_modes(sA, 0, 2), cute.group_modes(gA, 0, 2))
            tma = (tma_w, tWg, tWs, tma_a, tAg, tAs)

            thr = tiled_mma.get_slice(tidx % 128)
            tCrW = tiled_mma.make_fragment_A(thr.partition_A(sW))
            tCrA = tiled_mma.make_fragment_B(thr.partition_B(sA))
            acc = cute.make_rmem_tensor(thr.partition_shape_C((BN, MP)), cutlass.Float32)
            acc.fill(0.0)

            # this block's contiguous share of the K tiles
            kt = cute.size(gW, mode=[2])
            k_lo = q * kt // KS
            count = (q + 1) * kt // KS - k_lo
            pre = cutlass.min(S, count)

            prod = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, S)
            if warp == PROD:
                if cutlass.const_expr(self.static_weight):
                    # no kernel writes W: its first tiles are requested before waiting on the previous kernel
                    for i in cutlass.range(pre, unroll=1):
                        pipe.producer_acquire(prod)
                        self.copy_w(tma, k_lo + i, prod.index, pipe.producer_get_barrier(prod))
                        prod.advance()
                    self.wait_previous()
                    fill = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, S)
                    for i in cutlass.range(pre, unroll=1):
                        self.copy_a(tma, k_lo + i, fill.index, pipe.producer_get_barrier(fill))
                        fill.advance()
                else:
                    self.wait_previous()
                    for i in cutlass.range(pre, unroll=1):
                        self.load_stage(pipe, prod, tma, k_lo + i)
                        prod.advance()
                if cutlass.const_expr(self.pw):
                    for i in cutlass.range(pre, count, unroll=1):
                        self.load_stage(pipe, prod, tma, k_lo + i)
                        prod.advance()
            else:
                self.wait_previous()

            if warp < 4:
                read = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, S)
                release = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, S)
                kblocks = cute.size(tCrW, mode=[2])
                tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True)
                for i in cutlass.range(count, unroll=1):
                    pipe.consumer_wait(read)
                    cute.nvgpu.warpgroup.fence()
                    for kb in cutlass.range(kblocks, unroll_full=True):
                        cute.gemm(tiled_mma, acc, tCrW[(None, None, kb, read.index)],
                                  tCrA[(None, None, kb, read.index)], acc)
                    cute.nvgpu.warpgroup.commit_group()
                    # the previous stage's MMAs are done once at most this one is pending: free its slot
                    cute.nvgpu.warpgroup.wait_group(1)
                    read.advance()
                    if i > 0:
                        pipe.consumer_release(release)
                        release.advance()
                        if cutlass.const_expr(not self.pw):
                            # refill the slot just freed (never the one this step reads: warp 0 would wait on itself)
                            if warp == 0:
                                if prod.count < count:
                                    self.load_stage(pipe, prod, tma, k_lo + prod.count)
                                    prod.advance()
                cute.nvgpu.warpgroup.wait_group(0)
            if cutlass.const_expr(not self.early):
                # our reads of the previous kernel's outputs are done: the next kernel may launch
                cute.arch.griddepcontrol_launch_dependents()

            # partial tile -> shared memory [BN, MP] fp32 (row n_local, column m; rows padded by one word so the
            # epilogue's reads along n hit distinct banks)
            red = cute.make_tensor(st.red.data_ptr(), cute.make_layout((BN, MP), stride=(MP + 1, 1)))
            if warp < 4:
                tCred = thr.partition_C(red)
                for j in cutlass.range_constexpr(cute.size(acc)):
                    tCred[j] = acc[j]
            self.epilogue(mC, mBias, mRes, red, tidx, q, rb * BN)

        @cute.jit
        def wait_previous(self):
            """PDL: wait for the previous kernel (its stores are then visible); with ``early`` let the next kernel
            launch now, so its blocks settle beside ours and (static weight) start streaming while ours drain.
            Triggering stays after our own wait: the static-weight proof relies on it."""
            cute.arch.griddepcontrol_wait()
            if cutlass.const_expr(self.early):
                cute.arch.griddepcontrol_launch_dependents()

        @cute.jit
        def copy_w(self, tma, k, stage, bar):
            tma_w, tWg, tWs, _, _, _ = tma
            if cutlass.const_expr(self.hints):  # the weight is read once: do not let it push A out of L2
                cute.copy(tma_w, tWg[(None, k)], tWs[(None, stage)], tma_bar_ptr=bar,
                          cache_policy=cutlass.Int64(EVICT_FIRST_POLICY))
            else:
                cute.copy(tma_w, tWg[(None, k)], tWs[(None, stage)], tma_bar_ptr=bar)

        @cute.jit
        def copy_a(self, tma, k, stage, bar):
            _, _, _, tma_a, tAg, tAs = tma
            if cutlass.const_expr(self.hints):  # every block reads A: keep it in L2
                cute.copy(tma_a, tAg[(None, k)], tAs[(None, stage)], tma_bar_ptr=bar,
                          cache_policy=cutlass.Int64(EVICT_LAST_POLICY))
            else:
                cute.copy(tma_a, tAg[(None, k)], tAs[(None, stage)], tma_bar_ptr=bar)

        @cute.jit
        def load_stage(self, pipe, prod, tma, k):
            pipe.producer_acquire(prod)
            bar = pipe.producer_get_barrier(prod)
            self.copy_w(tma, k, prod.index, bar)
            self.copy_a(tma, k, prod.index, bar)

        @cute.jit
        def epilogue(self, mC: cute.Tensor, mBias, mRes, red: cute.Tensor, tidx, q, n0):
            """Sum the cluster's partial tiles (this block: outputs q, q + KS, ... in C's row-major order) and store."""
            M: cutlass.Constexpr = self.m
            MP: cutlass.Constexpr = self.mp
            BN: cutlass.Constexpr = self.bn
            KS: cutlass.Constexpr = self.ks
            NT: cutlass.Constexpr = self.threads
            N = mC.shape[1]
            if cutlass.const_expr(KS > 1):
                cute.arch.fence_acq_rel_cluster()
                cute.arch.cluster_arrive_relaxed()
                cute.arch.cluster_wait()
            else:
                cute.arch.sync_threads()
            for idx in cutlass.range(q * NT + tidx, BN * M, NT * KS, unroll=1):
                m = idx // BN
                nl = idx % BN
                n = n0 + nl
                if n < N:
                    s = cutlass.Float32(0.0)
                    if cutlass.const_expr(KS > 1):
                        s = dsmem_sum_f32((red.iterator + (nl * (MP + 1) + m)).toint(), KS)
                    else:
                        s = red[nl, m]
                    if cutlass.const_expr(self.has_bias):
                        s = s + mBias[n].to(cutlass.Float32)
                    if cutlass.const_expr(self.has_res):
                        s = s + mRes[m, n].to(cutlass.Float32)
                    mC[m, n] = s.to(self.dtype)
            if cutlass.const_expr(KS > 1):
                # keep our shared memory alive until every block of the cluster has read it
                cute.arch.cluster_arrive_relaxed()
                cute.arch.cluster_wait()

    return WgmmaSkinnyGemm
