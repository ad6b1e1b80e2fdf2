"""The MXFP4 routed experts' down product as an mma.sync kernel (NVIDIA sm_90+): ``partial = round(w2[e] h) · router
weight``, the codes read straight into registers and converted as the gate/up kernel does (``cute_gate_up.py``, whose
module doc says how the lanes, the MMA's operands and the conversion fit together).

A kernel module: it imports cutlass at its top and is loaded only when a kernel is built (``cute.py``).
"""
# no `from __future__ import annotations`: the DSL evaluates the kernels' annotations
import cutlass
import cutlass.cute as cute

from k3compile.kernels.cute.asm import prefetch_bulk_l2
from k3compile.ops.moe_experts.cute_gate_up import Mxfp4GateUpMma, permuted_pairs, top_bit


class Mxfp4DownMma(Mxfp4GateUpMma):
    """The down product with the B operand held: block ``(p, s)`` takes w2's rows ``[s·R, (s + 1)·R)``,
    R = 16 · ``row_groups`` · ``warps`` · ``groups``, its warps taking ``row_groups`` groups of 16 rows at a time in
    turn. K = I is short (384 at K3 TP 8): each warp loads h's rows for the whole of it once (``n_steps`` steps of
    64, taken two at a time: a lane owns 32 values of a step of 128, or 16 of a last half step), permuted to the
    conversion's order, and every group of rows reuses them; the rows past I are zeros. The partials go straight
    from the MMA's registers to each pair of the token holding the expert (a bit mask of its slots, built once).
    ``compact``: the B columns are the expert's tokens only, as in the gate/up kernel; ``ahead``: see ``rows``."""

    def __init__(self, m: int, a: int, warps: int, row_groups: int, groups: int, n_steps: int, big_scales: bool,
                 scan_unrolled: bool = False, compact: bool = False, ahead: bool = False):
        super().__init__(m, a, 1, row_groups, n_steps, None, None, big_scales, scan_unrolled=scan_unrolled,
                         compact=compact)
        # K in steps of 128, the last a half step of 64 where 64 more cover K (I 192 at TP 16: no third of the MMAs
        # and conversions on lanes past K)
        self.wn, self.groups, self.ns, self.half = warps, groups, (n_steps + 1) // 2, n_steps % 2 == 1
        self.ahead = ahead   # two groups' code registers: the next group's loads in flight while one multiplies
        self.threads = 32 * warps
        self.rows_per_block = 16 * row_groups * warps * groups

    @cute.jit
    def __call__(self, mX: cute.Tensor, mIds: cute.Tensor, mWts: cute.Tensor, mW0: cute.Tensor, mW1: cute.Tensor,
                 mS0: cute.Tensor, mS1: cute.Tensor, mOut: cute.Tensor, stream):
        n = mW0.shape[1]
        self.kernel(mX, mIds, mWts, mW0, mW1, mS0, mS1, mOut).launch(
            grid=[mIds.shape[0], (n + self.rows_per_block - 1) // self.rows_per_block, 1],
            block=[self.threads, 1, 1],
            stream=stream,
            use_pdl=True,
        )

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mIds: cute.Tensor, mWts: cute.Tensor, mW0: cute.Tensor, mW1: cute.Tensor,
               mS0: cute.Tensor, mS1: cute.Tensor, mOut: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        p, sb, _ = cute.arch.block_idx()
        E = mW0.shape[0]
        N = mW0.shape[1]
        K = mX.shape[1]
        n0 = sb * self.rows_per_block
        e = mIds[p].to(cutlass.Int32)   # written before the op's first kernel began (module doc)
        valid = (e >= 0) & (e < E)
        ec = cutlass.max(cutlass.min(e, E - 1), 0)
        # before the wait: warm L2 with the block's rows of w2, one bulk prefetch a row (coherent: any weight may)
        if valid:
            for i in cutlass.range(tidx, self.rows_per_block, self.threads, unroll=1):
                if n0 + i < N:
                    prefetch_bulk_l2(mW0[ec, n0 + i, None].iterator.toint(), cutlass.Int32(K // 2))
        lane = tidx % 32
        g = lane // 4
        t = lane % 4
        if cutlass.const_expr(self.compact):
            # the ids, too, were written before the op began: the whole scan (one round trip) before the wait
            run, tokens, slots, rank = self.compact_block(mIds, p, e, lane, self.pair_ids(mIds, lane))
            run = valid & run
            cute.arch.griddepcontrol_wait()
        elif cutlass.const_expr(self.scan_unrolled):
            run = valid & self.first_of_expert(mIds, p, e, lane, self.pair_ids(mIds, lane))
            cute.arch.griddepcontrol_wait()
        else:
            cute.arch.griddepcontrol_wait()
            run = valid
            if valid:
                run = self.first_of_expert(mIds, p, e, lane, [])
        if run:
            if cutlass.const_expr(self.compact):
                col, outs, masks = self.columns(tokens, slots, rank, g, t)
                self.rows(mX, mIds, mWts, mW0, mS0, mOut, p, ec, n0, tidx // 32, lane, N, K, [col], [outs], [masks])
            else:
                cols = [8 * b + g for b in range(self.nb)]   # past M: h_row gives a copy, never stored
                outs = [[8 * b + 2 * t + x for x in range(2)] for b in range(self.nb)]
                self.rows(mX, mIds, mWts, mW0, mS0, mOut, p, ec, n0, tidx // 32, lane, N, K, cols, outs, [])
        cute.arch.griddepcontrol_launch_dependents()

    @cute.jit
    def rows(self, mX: cute.Tensor, mIds: cute.Tensor, mWts: cute.Tensor, mW: cute.Tensor, mS: cute.Tensor,
             mOut: cute.Tensor, p, e, n0, wn, lane, N, K, cols: list, outs: list, masks: list):
        """The block's rows of w2 against block b's tokens: lane (g, t) loads token ``cols[b]``'s row of h (its B
        column g) and stores the partials of tokens ``outs[b]`` (its columns 2t, 2t + 1; M: none) into their slots
        holding ``e``: ``masks[b]``'s bits where given (``compact``), else found by reading the ids. ``ahead``: group
        0's codes are loaded with h, and each group's loads are issued before the group ahead of it multiplies."""
        RG: cutlass.Constexpr = self.rg
        NS: cutlass.Constexpr = self.ns
        NB: cutlass.Constexpr = self.nb
        BUFS: cutlass.Constexpr = 2 if self.ahead else 1
        g = lane // 4
        t = lane % 4
        # B: column g's row of h over the whole K for each block b of 8 columns, in the conversion's order (16
        # bf16x2 a step and block: rXp[:, st * NB + b])
        rX = cute.make_rmem_tensor((8, 4 * NS * NB), mX.element_type)
        rX32 = cute.recast_tensor(rX, cutlass.Int32)
        rX32.fill(0)
        for b in cutlass.range_constexpr(NB):
            xs = cute.logical_divide(mX, (None, 8))[self.h_row(mIds, p, e, cols[b]), None]
            for st in cutlass.range_constexpr(NS):
                k0 = self.lane_k(st, t)
                if k0 < K:
                    for j in cutlass.range_constexpr(2 if self.half_step(st) else 4):
                        v = xs[((None, k0 // 8 + j),)]
                        cute.autovec_copy(cute.make_tensor(v.iterator.align(16), v.layout),
                                          rX[None, (st * NB + b) * 4 + j])
        gW = cute.logical_divide(mW, (None, None, 16))
        gW8 = cute.logical_divide(mW, (None, None, 8))
        rW = cute.make_rmem_tensor((16, 2 * RG * NS * BUFS), cutlass.Uint8)   # [bytes, (row half, group, step, buf)]
        rW32 = cute.recast_tensor(rW, cutlass.Int32)
        rS = cute.make_rmem_tensor((2 * RG * NS * BUFS,), cutlass.Int32)
        if cutlass.const_expr(self.ahead):   # group 0's codes on their way while h's rows arrive and permute
            self.load_group(gW, gW8, mS, e, n0 + wn * 16 * RG, N, K, t, g, rW, rS, 0)
        rXp = cute.make_rmem_tensor((16, NS * NB), cutlass.Int32)
        for c in cutlass.range_constexpr(NS * NB):
            pairs = permuted_pairs(rX32, c * 4)
            for q in cutlass.range_constexpr(16):
                rXp[q, c] = pairs[q]
        # the slots of the tokens of columns 2t and 2t + 1 holding e, as bit masks: slots[2b + x]
        slots = []
        for b in cutlass.range_constexpr(NB):
            for x in cutlass.range_constexpr(2):
                mask = cutlass.Int32(0)
                if cutlass.const_expr(len(masks)):
                    mask = masks[b][x]
                else:
                    tok = outs[b][x]
                    if tok < self.m:
                        for a in cutlass.range_constexpr(self.a):
                            if mIds[tok * self.a + a].to(cutlass.Int32) == e:
                                mask = mask | (cutlass.Int32(1) << a)   # an Int32 at A = 32: 1 << 31 is not one
                slots.append(mask)

        rD = cute.make_rmem_tensor((16, 2), cutlass.Int32)
        acc = cute.make_rmem_tensor((4, RG, NB), cutlass.Float32)
        if cutlass.const_expr(self.ahead):
            for j in cutlass.range_constexpr(self.groups):
                if cutlass.const_expr(j + 1 < self.groups):
                    ahead = n0 + ((j + 1) * self.wn + wn) * 16 * RG
                    self.load_group(gW, gW8, mS, e, ahead, N, K, t, g, rW, rS, (j + 1) % 2)
                base = n0 + (j * self.wn + wn) * 16 * RG
                if base < N:
                    self.group_rows(mWts, mOut, rW32, rS, rD, rXp, acc, slots, outs, base, N, g, j % 2)
        else:
            for j in cutlass.range(self.groups, unroll=1):
                base = n0 + (j * self.wn + wn) * 16 * RG
                if base < N:
                    self.load_group(gW, gW8, mS, e, base, N, K, t, g, rW, rS, 0)
                    self.group_rows(mWts, mOut, rW32, rS, rD, rXp, acc, slots, outs, base, N, g, 0)

    @cute.jit
    def load_group(self, gW: cute.Tensor, gW8: cute.Tensor, mS: cute.Tensor, e, base, N, K, t, g, rW: cute.Tensor,
                   rS: cute.Tensor, buf: cutlass.Constexpr):
        """The codes and scales of this lane's rows of the group at ``base`` (past N: row N - 1, never stored) over
        every step of K into buffer ``buf``, every load issued, none waited for. A lane past K (the last step's, where
        128 does not divide K) reads its row's last group instead, whose values meet h's zeros there; the variant
        exact for any scale (a product could be inf · 0 there) reads nothing and zero codes."""
        RG: cutlass.Constexpr = self.rg
        NS: cutlass.Constexpr = self.ns
        clamp: cutlass.Constexpr = self.ahead and not self.big_scales
        rW32 = cute.recast_tensor(rW, cutlass.Int32)
        if cutlass.const_expr(not self.ahead):   # one buffer
            rW32.fill(0)
            rS.fill(127)
        elif cutlass.const_expr(not clamp):   # this buffer's slots only: the other one's loads are in flight
            for slot in cutlass.range_constexpr(buf * 2 * RG * NS, (buf + 1) * 2 * RG * NS):
                for w in cutlass.range_constexpr(4):
                    rW32[w, slot] = 0
                rS[slot] = 127
        for r in cutlass.range_constexpr(RG):
            for h in cutlass.range_constexpr(2):
                row = cutlass.min(base + r * 16 + 8 * h + g, N - 1)
                scales = mS[e, row, None]
                for st in cutlass.range_constexpr(NS):
                    k0 = self.lane_k(st, t)
                    slot = ((buf * NS + st) * RG + r) * 2 + h
                    if cutlass.const_expr(clamp):
                        kc = cutlass.min(k0, K - (16 if self.half_step(st) else 32))
                        self.load_codes(gW, gW8, e, row, kc, st, rW, slot)
                        rS[slot] = scales[kc // 32].to(cutlass.Int32)
                    elif k0 < K:
                        self.load_codes(gW, gW8, e, row, k0, st, rW, slot)
                        rS[slot] = scales[k0 // 32].to(cutlass.Int32)

    @cute.jit
    def group_rows(self, mWts: cute.Tensor, mOut: cute.Tensor, rW32: cute.Tensor, rS: cute.Tensor, rD: cute.Tensor,
                   rXp: cute.Tensor, acc: cute.Tensor, slots: list, outs: list, base, N, g, buf: cutlass.Constexpr):
        """The group at ``base`` from buffer ``buf``: its MMAs over every step, then its partials stored. Lane (g, t)
        holds rows g (acc 0, 1) and g + 8 (acc 2, 3) of each group of 16, columns 2t and 2t + 1."""
        RG: cutlass.Constexpr = self.rg
        NS: cutlass.Constexpr = self.ns
        NB: cutlass.Constexpr = self.nb
        acc.fill(0.0)
        for st in cutlass.range_constexpr(NS):
            xp = [[rXp[q, st * NB + b] for q in range(16)] for b in range(NB)]
            for r in cutlass.range_constexpr(RG):
                self.group_mmas(rW32, rS, ((buf * NS + st) * RG + r) * 2, rD, xp, acc[None, r, None], self.big_scales,
                                4 if self.half_step(st) else 8)
        for r in cutlass.range_constexpr(RG):
            for b in cutlass.range_constexpr(NB):
                for x in cutlass.range_constexpr(2):
                    m = slots[2 * b + x]
                    self.store_rows(mWts, mOut, m, outs[b][x], base + r * 16 + g, N, acc[x, r, b])
                    self.store_rows(mWts, mOut, m, outs[b][x], base + r * 16 + 8 + g, N, acc[2 + x, r, b])

    def half_step(self, st: int) -> bool:
        return self.half and st == self.ns - 1

    def lane_k(self, st: int, t):
        """The first of lane t's values of step ``st``: 32 a lane, or 16 in a half step."""
        return st * 128 + (16 if self.half_step(st) else 32) * t

    @cute.jit
    def load_codes(self, gW: cute.Tensor, gW8: cute.Tensor, e, row, k0, st: cutlass.Constexpr, rW: cute.Tensor,
                   slot: cutlass.Constexpr):
        """Lane's codes of ``row`` from value k0 on into ``rW[:, slot]``: 16 bytes, or 8 (the first half) in a half
        step."""
        if cutlass.const_expr(self.half_step(st)):
            v = gW8[e, row, None][((None, k0 // 16),)]
            cute.autovec_copy(cute.make_tensor(v.iterator.align(8), v.layout),
                              cute.logical_divide(rW[None, slot], (8,))[((None, 0),)])
        else:
            v = gW[e, row, None][((None, k0 // 32),)]
            cute.autovec_copy(cute.make_tensor(v.iterator.align(16), v.layout), rW[None, slot])

    @cute.jit
    def h_row(self, mIds: cute.Tensor, p, e, tok):
        """h's row of token ``tok``'s first pair holding ``e`` (``p`` where the token holds none: its column is never
        stored)."""
        row = p
        for a in cutlass.range_constexpr(self.a - 1, -1, -1):
            if tok < self.m:
                if mIds[tok * self.a + a].to(cutlass.Int32) == e:
                    row = tok * self.a + a
        return row

    @cute.jit
    def store_rows(self, mWts: cute.Tensor, mPart: cute.Tensor, mask, tok, n, N, y):
        """partial[q, n] = y rounded to the activations' dtype (the model rounds the down product) times the router
        weight of pair q, for each slot of token ``tok`` in ``mask``."""
        if n < N:
            yr = y.to(cutlass.BFloat16).to(cutlass.Float32)
            left = mask
            while left != 0:
                a = top_bit(left)
                q = tok * self.a + a
                mPart[q, n] = yr * mWts[q].to(cutlass.Float32)
                left = left ^ (cutlass.Int32(1) << a)
