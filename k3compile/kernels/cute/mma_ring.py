"""The cp.async ring main loop of the mma.sync skinny GEMM (``mma.py``) and A's ways into the MMA fragments.

``MmaSkinnyGemm`` inherits these methods; they read its attributes (the configuration, M, dtype) and call its
``load_vec``, ``mma_step`` and ``wait_previous``. The weight streams through a per-warp ring of ``stages`` chunks
(cp.async, 16 bytes a lane); A reaches the MMA's A fragment in the weight's permuted K order by plain loads per warp
and chunk (``load_a``; with the fused norm, ``norm_a_step`` scales it by g), or with ``a_ring`` riding each warp's
ring beside its weight (``copy_a_chunk``).

A kernel module: it imports cutlass at its top and is loaded only when a kernel is built (``compile.py``).
"""
# no `from __future__ import annotations`: the DSL evaluates the kernels' annotations
import cutlass
import cutlass.cute as cute


class RingMainLoop:
    """Methods of ``MmaSkinnyGemm``: the cp.async ring main loop and A's paths (see the module doc)."""

    @cute.jit
    def load_a(self, gA: cute.Tensor, gG, m_lo, m_hi, kv0, rA: cute.Tensor, ss: cute.Tensor):
        """A for one chunk, in the same permuted K order as the weight (rows >= 8 only if M > 8)."""
        for u in cutlass.range_constexpr(self.unroll):
            self.load_a_step(gA, gG, m_lo, m_hi, kv0 + 4 * u, rA, u, ss)

    @cute.jit
    def load_a_step(self, gA: cute.Tensor, gG, m_lo, m_hi, kv, rA: cute.Tensor, u: cutlass.Constexpr,
                    ss: cute.Tensor):
        """One 16-byte vector of A's rows m_lo (and m_hi) at vector index kv into rA[:, 2u(+1)].

        With the norm fused: ss += x², and x becomes x·g rounded to the input dtype (the MMA's operand).
        """
        self.load_vec(gA[m_lo, (None, kv)], rA[None, 2 * u], self.evict_a)
        if cutlass.const_expr(self.m > 8):
            self.load_vec(gA[m_hi, (None, kv)], rA[None, 2 * u + 1], self.evict_a)
        self.norm_a_step(gG, kv, rA, u, ss)

    @cute.jit
    def norm_a_step(self, gG, kv, rA: cute.Tensor, u: cutlass.Constexpr, ss: cute.Tensor):
        """With the norm fused, on A's vectors rA[:, 2u(+1)] at vector index kv: ss += x², x <- x·g."""
        if cutlass.const_expr(self.norm):
            rG = cute.make_rmem_tensor((8,), self.dtype)
            self.load_vec(gG[((None, kv),)], rG, self.evict_a)  # the norm weight: re-read like A
            vg = rG.load().to(cutlass.Float32)
            for h in cutlass.range_constexpr(2 if self.m > 8 else 1):
                x = rA[None, 2 * u + h].load().to(cutlass.Float32)
                ss[h] = ss[h] + (x * x).reduce(cute.ReductionOp.ADD, cutlass.Float32(0.0), 0)
                rA[None, 2 * u + h].store((x * vg).to(self.dtype))

    @cute.jit
    def main_loop_cp_async(self, gA: cute.Tensor, gB: cute.Tensor, gG, rows, m_lo, m_hi, t, lane, warp, wk,
                           n_full, acc: cute.Tensor, rA: cute.Tensor, rB: cute.Tensor,
                           rA32: cute.Tensor, rB32: cute.Tensor, ss: cute.Tensor, smem):
        """Full chunks with the weight streamed by cp.async through a per-warp ring of S stages.

        Loads in flight then cost shared memory, not registers. With ``static_weight`` (a parameter no kernel
        writes) the first S-1 stages are issued before ``griddepcontrol.wait``, overlapping the previous kernel's
        tail (PDL); otherwise only an L2 prefetch is. Every lane reads back only the 16-byte slots it wrote itself,
        so no barrier is needed, only ``cp.async.wait_group``.
        """
        RG: cutlass.Constexpr = self.rg
        U: cutlass.Constexpr = self.unroll
        S: cutlass.Constexpr = self.stages
        WK: cutlass.Constexpr = self.wk * self.ks  # wk is the warp's K slice among the cluster's
        NW: cutlass.Constexpr = self.wn * self.wk
        CHV: cutlass.Constexpr = 4 * self.unroll  # 16-byte vectors per chunk along K
        MA: cutlass.Constexpr = 2 if self.m > 8 else 1  # A rows per lane: m_lo (and m_hi)
        g = lane // 4
        # [8 elements, lane, slot, stage, warp]: a warp's 32 lanes read 512 contiguous bytes
        sW = smem.allocate_tensor(self.dtype, cute.make_layout((8, 32, RG * U, S, NW)), byte_alignment=16)
        sA = None
        if cutlass.const_expr(self.a_ring):  # one A ring per warp
            sA = smem.allocate_tensor(self.dtype, cute.make_layout((8, 32, MA * U, S, NW)), byte_alignment=16)
        atom = cute.make_copy_atom(
            cute.nvgpu.cpasync.CopyG2SOp(cache_mode=cute.nvgpu.cpasync.LoadCacheMode.GLOBAL),
            self.dtype, num_bits_per_copy=128)
        count = (cutlass.max(n_full - wk, 0) + WK - 1) // WK  # chunks of this warp

        if cutlass.const_expr(not self.static_weight):
            # the weight may be the previous kernel's output: only warm L2 (coherent) before the wait; the copies
            # into shared memory start after it
            if cutlass.const_expr(self.prefetch and self.l2_kb == 0):
                for st in cutlass.range_constexpr(S - 1):
                    if st < count:
                        self.copy_w_chunk(atom, gB, rows, (wk + st * WK) * CHV + t, sW, lane, st, warp, True)
            self.wait_previous()

        for st in cutlass.range_constexpr(S - 1):
            if st < count:
                kv0 = (wk + st * WK) * CHV + t
                self.copy_w_chunk(atom, gB, rows, kv0, sW, lane, st, warp, False)
                if cutlass.const_expr(self.a_ring and not self.static_weight):
                    self.copy_a_chunk(atom, gA, g, kv0, sA, lane, st, warp)
            cute.arch.cp_async_commit_group()

        if cutlass.const_expr(self.static_weight):
            # PDL: the prologue above overlapped the previous kernel's tail; A may be its output
            self.wait_previous()
            if cutlass.const_expr(self.a_ring):
                # A of the prologue's chunks in one go, then wait for all of it (one round trip; the weight stages,
                # issued before the wait, have usually landed by now)
                for st in cutlass.range_constexpr(S - 1):
                    if st < count:
                        self.copy_a_chunk(atom, gA, g, (wk + st * WK) * CHV + t, sA, lane, st, warp)
                cute.arch.cp_async_commit_group()
                cute.arch.cp_async_wait_group(0)

        for i in cutlass.range(0, count, 1, unroll=1):
            self.ring_step(i, count, gA, gB, gG, rows, m_lo, m_hi, t, lane, warp, wk, sW, sA, atom,
                           acc, rA, rB, rA32, rB32, ss)
        cute.arch.cp_async_wait_group(0)

    @cute.jit
    def ring_step(self, i, count, gA: cute.Tensor, gB: cute.Tensor, gG, rows, m_lo, m_hi, t, lane, warp, wk,
                  sW: cute.Tensor, sA, atom, acc: cute.Tensor, rA: cute.Tensor, rB: cute.Tensor,
                  rA32: cute.Tensor, rB32: cute.Tensor, ss: cute.Tensor):
        """Chunk i of the ring: issue chunk i + S - 1's copies, then A (plain loads, or from the ring), wait for
        chunk i, MMAs."""
        RG: cutlass.Constexpr = self.rg
        U: cutlass.Constexpr = self.unroll
        S: cutlass.Constexpr = self.stages
        WK: cutlass.Constexpr = self.wk * self.ks
        CHV: cutlass.Constexpr = 4 * self.unroll
        MA: cutlass.Constexpr = 2 if self.m > 8 else 1
        g = lane // 4
        nxt = i + S - 1
        if nxt < count:
            kvn = (wk + nxt * WK) * CHV + t
            stn = nxt % S
            self.copy_w_chunk(atom, gB, rows, kvn, sW, lane, stn, warp, False)
            if cutlass.const_expr(self.a_ring):
                self.copy_a_chunk(atom, gA, g, kvn, sA, lane, stn, warp)
        cute.arch.cp_async_commit_group()
        kvi = (wk + i * WK) * CHV + t
        if cutlass.const_expr(not self.a_ring):
            self.load_a(gA, gG, m_lo, m_hi, kvi, rA, ss)
        cute.arch.cp_async_wait_group(S - 1)  # chunk i has landed
        cur = i % S
        for slot in cutlass.range_constexpr(RG * U):
            cute.autovec_copy(sW[None, lane, slot, cur, warp], rB[None, slot])
        if cutlass.const_expr(self.a_ring):
            for u in cutlass.range_constexpr(U):
                for h in cutlass.range_constexpr(MA):
                    cute.autovec_copy(sA[None, lane, u * MA + h, cur, warp], rA[None, 2 * u + h])
                self.norm_a_step(gG, kvi + 4 * u, rA, u, ss)
        for u in cutlass.range_constexpr(U):
            self.mma_step(acc, rA32, rB32, u, u, U)

    @cute.jit
    def copy_w_chunk(self, atom, gB: cute.Tensor, rows, kv0, sW: cute.Tensor, lane, st, warp,
                     l2_only: cutlass.Constexpr):
        """cp.async of this lane's weight vectors of one chunk (vector index kv0 along K, each of its row groups)
        into ring stage st; with ``l2_only`` an L2 prefetch of the same vectors instead."""
        U: cutlass.Constexpr = self.unroll
        for u in cutlass.range_constexpr(U):
            for r in cutlass.range_constexpr(self.rg):
                src = gB[rows[r], (None, kv0 + 4 * u)]
                if cutlass.const_expr(l2_only):
                    cute.arch.prefetch(src.iterator.llvm_ptr, cache_level="L2")
                else:
                    cute.copy(atom, cute.make_tensor(src.iterator.align(16), src.layout),
                              sW[None, lane, r * U + u, st, warp])

    @cute.jit
    def copy_a_chunk(self, atom, gA: cute.Tensor, g, kv0, sA: cute.Tensor, lane, st, warp):
        """cp.async of this lane's A vectors of one chunk (rows g, and g + 8 above M = 8) into the ring; the same
        lane of the warp reads them back. Lanes of rows past M copy nothing: their slots hold stale bytes, which only
        reach MMA rows that are never stored (the copies of a clamped row would all hit the same bytes, and such
        cp.async serialise)."""
        MA: cutlass.Constexpr = 2 if self.m > 8 else 1
        if cutlass.const_expr(self.a_l1):  # A is re-read by every block of the SM: keep it in L1
            atom = cute.make_copy_atom(
                cute.nvgpu.cpasync.CopyG2SOp(cache_mode=cute.nvgpu.cpasync.LoadCacheMode.ALWAYS),
                self.dtype, num_bits_per_copy=128)
        for u in cutlass.range_constexpr(self.unroll):
            for h in cutlass.range_constexpr(MA):
                if g + 8 * h < self.m:
                    src = gA[g + 8 * h, (None, kv0 + 4 * u)]
                    cute.copy(atom, cute.make_tensor(src.iterator.align(16), src.layout),
                              sA[None, lane, u * MA + h, st, warp])
