"""The warpgroup-MMA (wgmma) skinny GEMM kernel (NVIDIA sm_90+): ``C = A · Wᵀ (+ bias) (+ residual)``, M <= 16.

One warpgroup streams a block's weight rows (wgmma's M side) through a TMA + mbarrier ring against A (wgmma's N side,
8 or 16 rows) and keeps the fp32 accumulator tile in registers; the blocks of a split-K cluster sum their partial tiles
through distributed shared memory in the epilogue (read after a cluster barrier, or pushed from registers to their
owners: ``push_partials``), which adds bias / residual and stores C. Options (see ``WgmmaConfig``): a producer warp,
L2 eviction hints, the PDL trigger's place, the static-weight early requests, the pushes' owners, the register tiles.

With ``reg_stages`` R the MMA warps copy a block's first R weight tiles from the ring to registers (ldmatrix) as
they land, before the PDL wait, and free their slots at once, so the producer warp requests the rest of the share
into them before the wait too; the R tiles' MMAs then take the weight from registers (RS wgmma). A ring of S slots so
holds a share of S + R tiles in less shared memory, and A's share gets resident tiles of its own (as the norm's).

With ``norm_eps`` (the latent-MoE tail: ``C = rsqrt(mean(A², K) + eps) · ((A·g) · Wᵀ) + R``) the ring carries only
the weight. The block's whole K share of A is brought by TMA right after the PDL wait, one barrier per tile, and kept
resident. Warps of their own (the norm warps, 8 elements of a 128-wide tile a thread) scale each tile in place by g
as it lands (rounded to A's dtype, as the model's norm output is), sum the raw squares per row, and release the tile
to the MMA warps through a second barrier. So the MMA warps only ever wait for a tile, never do its arithmetic (when
they did it, one tile ahead in the K loop, the tail ran 2-6 µs behind the plain GEMM at M 8-16). The epilogue
scales the fp32 sums by each row's ``rsqrt(ss / K + eps)`` before bias / residual.

Why a second kernel: the mma.sync kernel (``mma.py``) loads A's fragment per warp, so above M = 4 A's traffic past
L1 sets its speed; here A's [16, block_k] chunk reaches shared memory by TMA once per block and stage, whatever M is
(swap-AB: the weight tile is wgmma's M side, A its N side, rows >= M zero-filled by TMA).

A kernel module: it imports cutlass at its top and is loaded only when a kernel is built (``compile.py``).
"""
# no `from __future__ import annotations`: the DSL evaluates the kernels' annotations
from typing import Optional

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils as utils
import cutlass.utils.hopper_helpers as sm90

from k3compile.kernels.cute.asm import dsmem_sum_f32, st_async_v4_f32
from k3compile.kernels.cute.configs import WgmmaConfig, m_pad, push_slot

# L2 cache-policy operands of the TMA loads (the encodings CUTLASS's CacheHintSm90 names)
EVICT_FIRST_POLICY = 0x12F0000000000000
EVICT_LAST_POLICY = 0x14F0000000000000


class WgmmaSkinnyGemm:
    """C[M, N] = A[M, K] · W[N, K]ᵀ (+ bias[N]) (+ R[M, N]), weight rows on wgmma's M side; with ``norm_eps``
    C = rsqrt(mean(A², K) + eps) · ((A·g) · Wᵀ) + R."""

    def __init__(self, dtype, m: int, cfg: WgmmaConfig, has_bias: bool, has_res: bool, static_weight: bool,
                 norm_eps: Optional[float] = None):
        self.dtype = dtype
        self.m = m
        self.mp = m_pad(m)
        self.bn, self.bk, self.stages, self.ks = cfg.block_n, cfg.block_k, cfg.stages, cfg.split_k
        self.pw, self.hints, self.early, self.mma_trigger = (cfg.producer_warp, cfg.evict_hints, cfg.early,
                                                              cfg.mma_trigger)
        self.has_bias, self.has_res = has_bias, has_res
        self.static_weight = static_weight and cfg.early_w
        # PDL: the next kernel may launch as our blocks start, only where the weight is proven static
        # (static_weights.py says why that is safe); a block's first trigger counts, later ones do nothing
        self.trigger_first = cfg.trigger_first and static_weight
        self.push = cfg.push_partials and cfg.split_k > 1
        self.owners = cfg.push_owners()
        if self.push and norm_eps is not None:
            raise ValueError("push_partials: the fused-norm tail sums its row norms across the cluster by reads")
        self.norm = norm_eps is not None
        self.eps = 0.0 if norm_eps is None else float(norm_eps)
        # warps 0-3 the MMA warpgroup, (norm) the norm warps, then (pw) the producer warp. A norm thread takes 8
        # elements of a 128-wide tile: with 16 it fell behind the weight stream (M16 17.1 µs against 13.4 at M8)
        self.norm_warps = (self.mp * self.bk // (8 * 32) if self.bk == 128 else 4) if self.norm else 0
        self.prod_warp = 4 + self.norm_warps if self.pw else 0
        self.threads = 128 + 32 * self.norm_warps + (32 if self.pw else 0)
        self.reg = cfg.reg_stages
        if self.reg and self.norm:
            raise ValueError("reg_stages: not with the fused norm (its norm warps scale A in place)")
        # (norm, reg_stages) A's K share stays resident, so the ring carries only the weight
        self.sep_a = self.norm or self.reg > 0
        self.a_tiles = cfg.norm_a_tiles(m) if self.norm else cfg.a_tiles()
        self.a_bars = (2 if self.norm else 1) * self.a_tiles if self.sep_a else 1   # barriers of A's resident tiles
        self.tx_bytes = (self.bn + (0 if self.sep_a else self.mp)) * self.bk * dtype.width // 8
        # outputs a thread stores: q·threads + tidx + j·threads·ks, j < iters (the epilogue's order)
        self.iters = -(-(self.bn * m) // (self.threads * self.ks))
        self.recv_slots = cfg.push_slots(m) if self.push else 0   # (push_partials) the receive buffer
        self.red_slots = cfg.red_slots(m)                          # the partial tile (none with push_partials)

    @cute.jit
    def __call__(self, mA: cute.Tensor, mW: cute.Tensor, mC: cute.Tensor, mBias, mRes, mG, stream):
        # mG: the norm weight [K] (norm_eps), else None
        tile = (self.bn, self.mp, self.bk)
        kmajor = utils.LayoutEnum.ROW_MAJOR  # both operands K-major
        self.w_layout = sm90.make_smem_layout_a(kmajor, tile, self.dtype, self.stages)
        self.a_layout = sm90.make_smem_layout_b(kmajor, tile, self.dtype, self.a_tiles)
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
            red: cute.struct.Align[cute.struct.MemRange[cutlass.Float32, self.red_slots], 16]
            # (norm) per resident A tile: landed (TMA), scaled; the block's share of g; the rows' sums of squares.
            # (reg_stages) per resident A tile: landed
            a_bars: cute.struct.MemRange[cutlass.Int64, self.a_bars]
            sG: cute.struct.Align[cute.struct.MemRange[self.dtype, self.a_tiles * self.bk if self.norm else 8], 16]
            ssq: cute.struct.Align[cute.struct.MemRange[cutlass.Float32, 16], 16]
            # (push_partials) the other blocks' fragments of our outputs, [rank, quarter, thread of the group, 4]
            # (configs.push_slot), and their mbarrier
            recv: cute.struct.Align[cute.struct.MemRange[cutlass.Float32, max(4, self.recv_slots)], 16]
            recv_bar: cute.struct.MemRange[cutlass.Int64, 1]

        self.storage = Storage
        n = mW.shape[0]
        gx = (n + self.bn - 1) // self.bn * self.ks
        self.kernel(tma_w, gW, tma_a, gA, mC, mBias, mRes, mG, tiled_mma, self.w_layout, self.a_layout).launch(
            grid=[gx, 1, 1], block=[self.threads, 1, 1], cluster=[self.ks, 1, 1],
            smem=Storage.size_in_bytes(), stream=stream, use_pdl=True)

    @cute.kernel
    def kernel(self, tma_w: cute.CopyAtom, gW_full: cute.Tensor, tma_a: cute.CopyAtom, gA_full: cute.Tensor,
               mC: cute.Tensor, mBias, mRes, mG, tiled_mma: cute.TiledMma, w_layout: cute.ComposedLayout,
               a_layout: cute.ComposedLayout):
        BN: cutlass.Constexpr = self.bn
        BK: cutlass.Constexpr = self.bk
        MP: cutlass.Constexpr = self.mp
        KS: cutlass.Constexpr = self.ks
        S: cutlass.Constexpr = self.stages
        PROD: cutlass.Constexpr = self.prod_warp  # the warp that issues the TMA loads
        AT: cutlass.Constexpr = self.a_tiles
        if cutlass.const_expr(self.trigger_first):
            cute.arch.griddepcontrol_launch_dependents()
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
        a_landed = st.a_bars.data_ptr()        # (norm, reg_stages) tile t: a_landed + t; (norm) a_scaled + t
        a_scaled = a_landed + AT
        if cutlass.const_expr(self.push):
            if tidx == 0:  # one arrival: ours, with the bytes the other blocks will push
                cute.arch.mbarrier_init(st.recv_bar.data_ptr(), 1)
                cute.arch.mbarrier_init_fence()
        if cutlass.const_expr(self.sep_a):
            if tidx == 0:  # initialised before the pipeline's own fence and barrier
                for t in cutlass.range_constexpr(AT):
                    cute.arch.mbarrier_init(a_landed + t, 1)
                    if cutlass.const_expr(self.norm):
                        cute.arch.mbarrier_init(a_scaled + t, 32 * self.norm_warps)  # every norm thread arrives
        pipe = pipeline.PipelineTmaAsync.create(
            barrier_storage=st.bars.data_ptr(), num_stages=S,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 4),  # one arrive per MMA warp
            tx_count=self.tx_bytes)
        if cutlass.const_expr(self.push):
            # the cluster's blocks are running and their mbarriers initialised once every block has arrived here;
            # the matching wait sits just before the pushes, so this barrier hides under the K loop
            cute.arch.cluster_arrive()
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
        # the odd k16 steps accumulate apart: two independent wgmma chains, summed after the K loop (1-3% faster
        # than one at M 1-16)
        acc_odd = cute.make_rmem_tensor(thr.partition_shape_C((BN, MP)), cutlass.Float32)
        acc_odd.fill(0.0)

        # this block's contiguous share of the K tiles
        K = gW_full.shape[1]
        kt = cute.size(gW, mode=[2])
        k_lo = q * kt // KS
        count = (q + 1) * kt // KS - k_lo
        # (reg_stages) the MMA warps free the first R slots before the wait, so S + R tiles go out before it
        pre = cutlass.min(S + self.reg, count)

        prod = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, S)
        if warp == PROD:
            if cutlass.const_expr(self.static_weight):
                # no kernel writes W: its first tiles are requested before waiting on the previous kernel
                for i in cutlass.range(pre, unroll=1):
                    pipe.producer_acquire(prod)
                    self.copy_w(tma, k_lo + i, prod.index, pipe.producer_get_barrier(prod))
                    prod.advance()
                self.wait_previous()
                if cutlass.const_expr(self.norm):
                    for i in cutlass.range(pre + S, unroll=1):
                        self.load_a_tile(tma, k_lo, i, count, a_landed)
                elif cutlass.const_expr(self.reg):
                    for i in cutlass.range(count, unroll=1):   # the whole share (the host checks it fits)
                        self.load_a_tile(tma, k_lo, i, count, a_landed)
                else:
                    fill = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, S)
                    for i in cutlass.range(pre, unroll=1):
                        self.copy_a(tma, k_lo + i, fill.index, pipe.producer_get_barrier(fill))
                        fill.advance()
            else:
                self.wait_previous()
                if cutlass.const_expr(self.norm):
                    self.load_a_tile(tma, k_lo, 0, count, a_landed)   # the first MMA's, ahead of the weight
                if cutlass.const_expr(self.reg):
                    for i in cutlass.range(count, unroll=1):
                        self.load_a_tile(tma, k_lo, i, count, a_landed)
                for i in cutlass.range(pre, unroll=1):
                    self.load_stage(pipe, prod, tma, k_lo + i)
                    prod.advance()
                if cutlass.const_expr(self.norm):
                    for i in cutlass.range(1, pre + S, unroll=1):
                        self.load_a_tile(tma, k_lo, i, count, a_landed)
            if cutlass.const_expr(self.pw):
                for i in cutlass.range(pre, count, unroll=1):
                    self.load_stage(pipe, prod, tma, k_lo + i)
                    if cutlass.const_expr(self.norm):
                        self.load_a_tile(tma, k_lo, i + S, count, a_landed)
                    prod.advance()
        elif cutlass.const_expr(not self.reg):
            self.wait_previous()   # (reg_stages) the MMA warps wait once their register tiles are loaded

        ssq = cute.make_tensor(st.ssq.data_ptr(), cute.make_layout((16,)))
        if cutlass.const_expr(self.norm):
            if warp >= 4 and warp < 4 + self.norm_warps:
                sG = st.sG.get_tensor(cute.make_layout((AT * BK,)))
                self.norm_warps_run(mG, sG, sA, ssq, a_landed, a_scaled, k_lo * BK, count, K, tidx - 128)

        if warp < 4:
            read = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, S)
            release = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, S)
            kblocks = cute.size(tCrW, mode=[2])
            tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True)
            if cutlass.const_expr(self.reg):
                self.mma_reg_stages(sW, tCrA, acc, acc_odd, pipe, read, release, a_landed, tidx)
            for i in cutlass.range(self.reg, count, unroll=1):
                pipe.consumer_wait(read)
                a_tile = read.index
                if cutlass.const_expr(self.norm):
                    a_tile = i  # the resident A's i-th tile, once the norm warps have scaled it
                    cute.arch.mbarrier_wait(a_scaled + i, 0)
                if cutlass.const_expr(self.reg):
                    a_tile = i
                    cute.arch.mbarrier_wait(a_landed + i, 0)
                cute.nvgpu.warpgroup.fence()
                for kb in cutlass.range_constexpr(kblocks):
                    chain = acc if kb % 2 == 0 else acc_odd
                    cute.gemm(tiled_mma, chain, tCrW[(None, None, kb, read.index)],
                              tCrA[(None, None, kb, a_tile)], chain)
                cute.nvgpu.warpgroup.commit_group()
                # the previous stage's MMAs are done once at most this one is pending: free its slot
                cute.nvgpu.warpgroup.wait_group(1)
                read.advance()
                if i > self.reg:   # (reg_stages) the register tiles' slots were freed as they were copied
                    pipe.consumer_release(release)
                    release.advance()
                    if cutlass.const_expr(not self.pw):
                        # refill the slot just freed (never the one this step reads: warp 0 would wait on itself)
                        if warp == 0:
                            if prod.count < count:
                                self.load_stage(pipe, prod, tma, k_lo + prod.count)
                                if cutlass.const_expr(self.norm):
                                    self.load_a_tile(tma, k_lo, prod.count + S, count, a_landed)
                                prod.advance()
            cute.nvgpu.warpgroup.wait_group(0)
            for j in cutlass.range_constexpr(cute.size(acc)):
                acc[j] = acc[j] + acc_odd[j]
        if cutlass.const_expr(not self.early):
            # our reads of the previous kernel's outputs are done: the next kernel may launch (the block's first
            # call counts: with ``mma_trigger`` the MMA warps', else whichever warp gets here first)
            if cutlass.const_expr(self.mma_trigger):
                if warp < 4:
                    cute.arch.griddepcontrol_launch_dependents()
            else:
                cute.arch.griddepcontrol_launch_dependents()

        if cutlass.const_expr(self.push):
            if warp < 4:
                recv = cute.make_tensor(st.recv.data_ptr(), cute.make_layout((self.recv_slots,)))
                self.epilogue_pushed(acc, thr, mC, mBias, mRes, recv, st.recv_bar.data_ptr(), tidx, q, rb * BN)
        else:
            # partial tile -> shared memory [BN, MP] fp32 (row n_local, column m; rows padded by one word so the
            # epilogue's reads along n hit distinct banks)
            red = cute.make_tensor(st.red.data_ptr(), cute.make_layout((BN, MP), stride=(MP + 1, 1)))
            if warp < 4:
                tCred = thr.partition_C(red)
                for j in cutlass.range_constexpr(cute.size(acc)):
                    tCred[j] = acc[j]
            self.epilogue(mC, mBias, mRes, red, ssq, tidx, q, rb * BN, K)

    @cute.jit
    def mma_reg_stages(self, sW: cute.Tensor, tCrA: cute.Tensor, acc: cute.Tensor, acc_odd: cute.Tensor, pipe,
                       read, release, a_landed, tidx):
        """(reg_stages, the MMA warps) Copy the block's first R weight tiles from their ring slots to registers
        (ldmatrix) as they land and free each slot at once, so the producer refills it before the PDL wait; then
        wait, and run their MMAs with the weight from registers (RS wgmma) against A's resident tiles 0..R-1."""
        R: cutlass.Constexpr = self.reg
        tiled_rs = sm90.make_trivial_tiled_mma(
            self.dtype, self.dtype, cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.K,
            cutlass.Float32, (1, 1, 1), tiler_mn=(64, self.mp), a_source=cute.nvgpu.warpgroup.OperandSource.RMEM)
        tiled_rs.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True)
        thr_rs = tiled_rs.get_slice(tidx % 128)
        ldsm = cute.make_tiled_copy_A(
            cute.make_copy_atom(cute.nvgpu.warp.LdMatrix8x8x16bOp(False, 4), self.dtype), tiled_rs)
        thr_ld = ldsm.get_slice(tidx % 128)
        tWs = thr_ld.partition_S(sW)
        tiles = []
        for j in cutlass.range_constexpr(R):
            tiles.append(tiled_rs.make_fragment_A(thr_rs.partition_A(sW[(None, None, 0)])))
        for j in cutlass.range_constexpr(R):
            pipe.consumer_wait(read)
            cute.copy(ldsm, tWs[(None, None, None, read.index)], thr_ld.retile(tiles[j]))
            read.advance()
            pipe.consumer_release(release)   # the arrive orders our ldmatrix reads before the refill
            release.advance()
        self.wait_previous()
        for j in cutlass.range_constexpr(R):
            cute.arch.mbarrier_wait(a_landed + j, 0)
            cute.nvgpu.warpgroup.fence()
            for kb in cutlass.range_constexpr(cute.size(tiles[j], mode=[2])):
                chain = acc if kb % 2 == 0 else acc_odd
                cute.gemm(tiled_rs, chain, tiles[j][(None, None, kb)], tCrA[(None, None, kb, j)], chain)
            cute.nvgpu.warpgroup.commit_group()

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
        # the weight is read once: do not let it push A out of L2
        self.tma_copy(tma_w, tWg[(None, k)], tWs[(None, stage)], bar, EVICT_FIRST_POLICY)

    @cute.jit
    def copy_a(self, tma, k, stage, bar):
        _, _, _, tma_a, tAg, tAs = tma
        self.tma_copy(tma_a, tAg[(None, k)], tAs[(None, stage)], bar, EVICT_LAST_POLICY)  # every block reads A

    @cute.jit
    def tma_copy(self, atom, src, dst, bar, policy: cutlass.Constexpr):
        """One TMA copy onto barrier ``bar``, with the L2 policy ``policy`` where the configuration asks for hints."""
        if cutlass.const_expr(self.hints):
            cute.copy(atom, src, dst, tma_bar_ptr=bar, cache_policy=cutlass.Int64(policy))
        else:
            cute.copy(atom, src, dst, tma_bar_ptr=bar)

    @cute.jit
    def load_stage(self, pipe, prod, tma, k):
        pipe.producer_acquire(prod)
        bar = pipe.producer_get_barrier(prod)
        self.copy_w(tma, k, prod.index, bar)
        if cutlass.const_expr(not self.sep_a):
            self.copy_a(tma, k, prod.index, bar)

    @cute.jit
    def load_a_tile(self, tma, k_lo, i, count, a_landed):
        """(norm, reg_stages) Request tile i of the block's K share of A (if i < count) into resident slot i, on
        barrier a_landed + i. (norm) Tile i goes out with the weight's tile i - stages, so A's traffic is spread
        over the stream as in the ring (the whole share at once, 112 blocks × 114 KB from L2 at M16, held the weight
        stream back ~3 µs) and each tile is scaled well before its MMA."""
        if i < count:
            with cute.arch.elect_one():
                cute.arch.mbarrier_arrive_and_expect_tx(a_landed + i, self.mp * self.bk * self.dtype.width // 8)
            self.copy_a(tma, k_lo + i, i, a_landed + i)

    @cute.jit
    def norm_warps_run(self, mG: cute.Tensor, sG: cute.Tensor, sA: cute.Tensor, ssq: cute.Tensor, a_landed,
                       a_scaled, k0, count, K, t):
        """(norm) The norm warps (thread t of NT): copy the block's share of g to shared memory, then scale each
        resident A tile in place as it lands and release it; finally each row's Σx² into ssq[row]."""
        BK: cutlass.Constexpr = self.bk
        NT: cutlass.Constexpr = 32 * self.norm_warps
        EPT: cutlass.Constexpr = self.mp * BK // NT   # elements of a tile per thread: one row, EPT along K
        TPR: cutlass.Constexpr = BK // EPT             # threads per row (adjacent lanes of one warp)
        # g[k0 : k0 + count·BK] (zeros past K) in 16-byte pieces, every load issued before the first store;
        # K % 8 == 0 (supports), so a piece is all in or all out
        PIECES: cutlass.Constexpr = -(-self.a_tiles * BK // (NT * 8))
        span = count * BK
        gp = cute.make_rmem_tensor((8, PIECES), self.dtype)
        gp.fill(0.0)
        mG8 = cute.logical_divide(mG, (8,))
        for p in cutlass.range_constexpr(PIECES):
            j = (p * NT + t) * 8
            if j < span and k0 + j < K:
                src = mG8[((None, (k0 + j) // 8),)]
                cute.autovec_copy(cute.make_tensor(src.iterator.align(16), src.layout), gp[(None, p)])
        sG8 = cute.logical_divide(sG, (8,))
        for p in cutlass.range_constexpr(PIECES):
            j = (p * NT + t) * 8
            if j < span:
                dst = sG8[((None, j // 8),)]
                cute.autovec_copy(gp[(None, p)], cute.make_tensor(dst.iterator.align(16), dst.layout))
        cute.arch.barrier(barrier_id=1, number_of_threads=NT)
        r = t // TPR
        kc = (t % TPR) * EPT
        ss = cutlass.Float32(0.0)
        # 16-byte shared-memory accesses (the swizzle keeps 8 aligned elements of a row together): 2-byte ones
        # cost 8x the wavefronts, enough at M16 to contend with the ring's TMA writes and wgmma reads
        vec = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.dtype,
                                  num_bits_per_copy=min(128, EPT * self.dtype.width))
        rows = cute.make_tiled_copy_tv(vec, cute.make_layout((self.mp, TPR), stride=(TPR, 1)),
                                       cute.make_layout((1, EPT)))
        mine = rows.get_slice(t)
        xv = cute.make_fragment_like(mine.partition_S(sA[(None, None, 0)]))
        gv = cute.make_fragment_like(xv)
        gflat = cute.make_tensor(gv.iterator, cute.make_layout((EPT,)))
        sGv = cute.logical_divide(sG, (EPT,))
        for i in cutlass.range(count, unroll=1):
            cute.arch.mbarrier_wait(a_landed + i, 0)
            tile = sA[(None, None, i)]
            cute.copy(rows, mine.partition_S(tile), xv)
            gi = sGv[((None, (i * BK + kc) // EPT),)]
            cute.autovec_copy(cute.make_tensor(gi.iterator.align(EPT * self.dtype.width // 8), gi.layout), gflat)
            x = xv.load().to(cutlass.Float32)
            ss = ss + (x * x).reduce(cute.ReductionOp.ADD, 0.0, reduction_profile=0)
            xv.store((x * gv.load().to(cutlass.Float32)).to(self.dtype))
            cute.copy(rows, xv, mine.partition_D(tile))
            # our generic-proxy stores, visible to the MMA warps' wgmma (async proxy), then the release
            cute.arch.fence_proxy("async.shared", space="cta")
            cute.arch.mbarrier_arrive(a_scaled + i)
        off = TPR // 2
        while cutlass.const_expr(off >= 1):
            ss = ss + cute.arch.shuffle_sync_bfly(ss, offset=off)
            off = off // 2
        if t % TPR == 0:
            ssq[r] = ss

    @cute.jit
    def epilogue(self, mC: cute.Tensor, mBias, mRes, red: cute.Tensor, ssq: cute.Tensor, tidx, q, n0, K):
        """Sum the cluster's partial tiles (this block: outputs q, q + KS, ... in C's row-major order) and store;
        (norm) the rows' Σx² are summed over the cluster the same way."""
        M: cutlass.Constexpr = self.m
        BN: cutlass.Constexpr = self.bn
        KS: cutlass.Constexpr = self.ks
        NT: cutlass.Constexpr = self.threads
        N = mC.shape[1]
        if cutlass.const_expr(self.has_bias or self.has_res):
            # this thread's outputs: q·NT + tidx + j·NT·KS in C's row-major order over the block's [M, BN]
            ITER: cutlass.Constexpr = self.iters
            bv = cute.make_rmem_tensor((ITER,), cutlass.Float32)
            rv = cute.make_rmem_tensor((ITER,), cutlass.Float32)
            self.load_bias_residual(bv, rv, mBias, mRes, tidx, q, n0, N)
            self.partials_ready()
            for j in cutlass.range_constexpr(ITER):
                idx = q * NT + tidx + j * NT * KS
                if idx < BN * M:
                    self.store_output(mC, red, ssq, idx, n0, N, K, bv[j], rv[j])
        else:
            # a runtime loop: the unrolled form of the branch above measured 0.1-0.25 µs slower here (A/B, H200)
            self.partials_ready()
            for idx in cutlass.range(q * NT + tidx, BN * M, NT * KS, unroll=1):
                self.store_output(mC, red, ssq, idx, n0, N, K, cutlass.Float32(0.0), cutlass.Float32(0.0))
        if cutlass.const_expr(KS > 1):
            # keep our shared memory alive until every block of the cluster has read it
            cute.arch.cluster_arrive_relaxed()
            cute.arch.cluster_wait()

    @cute.jit
    def load_bias_residual(self, bv: cute.Tensor, rv: cute.Tensor, mBias, mRes, tidx, q, n0, N):
        """bias and residual of this thread's outputs (q·threads + tidx + j·threads·ks of the block's [M, BN], j <
        iters) into bv / rv, all issued together before the cluster's partials are summed: one memory latency
        (loaded inside the store loop they cost one each, ~2 µs at M16); zeros where there is none."""
        M: cutlass.Constexpr = self.m
        BN: cutlass.Constexpr = self.bn
        KS: cutlass.Constexpr = self.ks
        NT: cutlass.Constexpr = self.threads
        for j in cutlass.range_constexpr(self.iters):
            idx = q * NT + tidx + j * NT * KS
            n = n0 + idx % BN
            bv[j] = cutlass.Float32(0.0)
            rv[j] = cutlass.Float32(0.0)
            if idx < BN * M and n < N:
                if cutlass.const_expr(self.has_bias):
                    bv[j] = mBias[n].to(cutlass.Float32)
                if cutlass.const_expr(self.has_res):
                    rv[j] = mRes[idx // BN, n].to(cutlass.Float32)

    @cute.jit
    def epilogue_pushed(self, acc: cute.Tensor, thr, mC: cute.Tensor, mBias, mRes, recv: cute.Tensor, recv_bar,
                        tidx, q, n0):
        """(push_partials; the MMA warpgroup) Thread t's accumulator fragment covers the same F outputs in every
        block of the cluster, and block owner(t) = t·R // 128 (R = ``push_owners``) sums them: every other block's
        thread t sends it theirs straight from registers (16-byte ``st.async`` into its ``recv``, counted on its
        mbarrier), its own thread t adds what arrived (in rank order) to its own fragment, then bias / residual,
        and stores. No partial tile in shared memory, no block barrier, one way through the cluster; blocks R and
        up only push, and exit."""
        M: cutlass.Constexpr = self.m
        KS: cutlass.Constexpr = self.ks
        R: cutlass.Constexpr = self.owners
        F: cutlass.Constexpr = cute.size(acc)
        G: cutlass.Constexpr = -(-128 // R)   # threads per owner, at most
        N = mC.shape[1]
        owner = tidx * R // 128
        first = (owner * 128 + R - 1) // R   # the owner's first thread
        tl = tidx - first
        # (n_local, m) of each fragment element
        coord = thr.partition_C(cute.make_identity_tensor((self.bn, self.mp)))
        mine = owner == q
        extra = cute.make_rmem_tensor((F,), cutlass.Float32)
        if mine:
            # bias and residual of our outputs, issued before anything waits: one memory latency, under the pushes
            for f in cutlass.range_constexpr(F):
                extra[f] = cutlass.Float32(0.0)
                c = coord[f]
                n = n0 + c[0]
                if c[1] < M and n < N:
                    if cutlass.const_expr(self.has_bias):
                        extra[f] = extra[f] + mBias[n].to(cutlass.Float32)
                    if cutlass.const_expr(self.has_res):
                        extra[f] = extra[f] + mRes[c[1], n].to(cutlass.Float32)
        cute.arch.cluster_wait()   # every block of the cluster runs, its mbarrier initialised (kernel start)
        if not mine:
            bar = recv_bar.toint()
            for v in cutlass.range_constexpr(F // 4):
                slot = recv.iterator + push_slot(q, v, tl, G, F)   # ours, at the same address in the owner's
                st_async_v4_f32(slot.toint(), acc[4 * v], acc[4 * v + 1], acc[4 * v + 2], acc[4 * v + 3], owner,
                                bar)
        # an owner group may share its warp with pushers: every lane of the warp has pushed before any spins on
        # the mbarrier below (a spinning lane must not keep its warp's pushers, and so the cluster, waiting)
        cute.arch.sync_warp()
        if mine:
            if tl == 0:
                # one arrival (ours) and the bytes the other KS - 1 blocks send our group's threads
                group = ((owner + 1) * 128 + R - 1) // R - first
                cute.arch.mbarrier_arrive_and_expect_tx(recv_bar, group * (F * 4 * (KS - 1)))
            cute.arch.mbarrier_wait(recv_bar, 0)
            # every slot read before the first add (our own, never written, is read and skipped): one latency
            got = cute.make_rmem_tensor((4, F // 4, KS), cutlass.Float32)
            for r in cutlass.range_constexpr(KS):
                for v in cutlass.range_constexpr(F // 4):
                    src = recv.iterator + push_slot(r, v, tl, G, F)
                    cute.autovec_copy(cute.make_tensor(src.align(16), cute.make_layout((4,))), got[(None, v, r)])
            for r in cutlass.range_constexpr(KS):
                if r != q:
                    for f in cutlass.range_constexpr(F):
                        acc[f] = acc[f] + got[f % 4, f // 4, r]
            if cutlass.const_expr(self.has_bias or self.has_res):
                for f in cutlass.range_constexpr(F):
                    acc[f] = acc[f] + extra[f]
            if cutlass.const_expr(G % 32 == 0):
                self.store_owned(acc, coord, mC, recv, q, tl, first, n0)
            else:   # an owner group that shares warps with another: 2-byte stores from the fragments
                for f in cutlass.range_constexpr(F):
                    c = coord[f]
                    n = n0 + c[0]
                    if c[1] < M and n < N:
                        mC[c[1], n] = acc[f].to(mC.element_type)

    @cute.jit
    def store_owned(self, acc: cute.Tensor, coord: cute.Tensor, mC: cute.Tensor, recv: cute.Tensor, q, tl, first,
                    n0):
        """(push_partials, an owner group of whole warps) Stage the group's outputs (acc, bias / residual added) in
        C's dtype in our own rank's receive slots (nobody pushes there; they hold the group's fragments in fp32, so
        any C dtype fits) as [m, the group's n], then store them along n in 16-byte pieces: whole 32-byte segments
        of C (the fragments' 2-byte stores wrote half segments and cost 0.6-2.8% at M16). A C row not 16-byte
        aligned, or the N tail, takes element stores."""
        M: cutlass.Constexpr = self.m
        MP: cutlass.Constexpr = self.mp
        G: cutlass.Constexpr = 128 // self.owners
        NW: cutlass.Constexpr = G // 32                   # the group's warps: 16 rows of each m64 tile apiece
        ROWW: cutlass.Constexpr = self.bn // 64 * 16 * NW   # the group's n per row of C
        EP: cutlass.Constexpr = 128 // mC.element_type.width   # C elements per 16-byte piece
        VPR: cutlass.Constexpr = ROWW // EP                # 16-byte pieces per row
        V: cutlass.Constexpr = MP * VPR
        w0 = first // 32
        stage = cute.recast_ptr(recv.iterator + push_slot(q, 0, 0, G, cute.size(acc)), dtype=mC.element_type)
        sT = cute.make_tensor(stage, cute.make_layout((MP, ROWW), stride=(ROWW, 1)))
        for f in cutlass.range_constexpr(cute.size(acc)):
            c = coord[f]
            sT[c[1], c[0] // 64 * (16 * NW) + c[0] % 64 - 16 * w0] = acc[f].to(mC.element_type)
        cute.arch.barrier(barrier_id=2, number_of_threads=G)   # the group's warps only (1: the norm warps')
        N = mC.shape[1]
        ldc = mC.layout.stride[0]
        aligned = mC.iterator.toint() % 16 == 0 and ldc % EP == 0
        for i in cutlass.range_constexpr(-(-V // G)):
            idx = tl + i * G
            if idx < V:
                m = idx // VPR
                col = idx % VPR * EP
                n = n0 + col // (16 * NW) * 64 + 16 * w0 + col % (16 * NW)
                if m < M:
                    if aligned and n + EP <= N:
                        src = cute.make_tensor((sT.iterator + m * ROWW + col).align(16), cute.make_layout((EP,)))
                        dst = cute.make_tensor((mC.iterator + m * ldc + n).align(16), cute.make_layout((EP,)))
                        cute.autovec_copy(src, dst)
                    else:
                        for e in cutlass.range_constexpr(EP):
                            if n + e < N:
                                mC[m, n + e] = sT[m, col + e]

    @cute.jit
    def partials_ready(self):
        """Every block's partial tile (and, norm, row sums) written: the cluster's, or this block's."""
        if cutlass.const_expr(self.ks > 1):
            cute.arch.fence_acq_rel_cluster()
            cute.arch.cluster_arrive_relaxed()
            cute.arch.cluster_wait()
        else:
            cute.arch.sync_threads()

    @cute.jit
    def store_output(self, mC: cute.Tensor, red: cute.Tensor, ssq: cute.Tensor, idx, n0, N, K, b, r):
        """C's output idx of the block ([M, BN] row-major): the cluster's partial sums (norm: times the row's
        rsqrt(mean(x²) + eps)), + bias b, + residual r, one rounding."""
        MP: cutlass.Constexpr = self.mp
        KS: cutlass.Constexpr = self.ks
        m = idx // self.bn
        nl = idx % self.bn
        n = n0 + nl
        if n < N:
            s = cutlass.Float32(0.0)
            sq = cutlass.Float32(0.0)
            if cutlass.const_expr(KS > 1):
                s = dsmem_sum_f32((red.iterator + (nl * (MP + 1) + m)).toint(), KS)
                if cutlass.const_expr(self.norm):
                    sq = dsmem_sum_f32((ssq.iterator + m).toint(), KS)
            else:
                s = red[nl, m]
                if cutlass.const_expr(self.norm):
                    sq = ssq[m]
            if cutlass.const_expr(self.norm):
                s = s * cute.math.rsqrt(sq / cutlass.Float32(K) + self.eps)
            if cutlass.const_expr(self.has_bias):
                s = s + b
            if cutlass.const_expr(self.has_res):
                s = s + r
            mC[m, n] = s.to(mC.element_type)
