"""The MXFP4 routed experts' decode-form products as mma.sync kernels (NVIDIA sm_90+), the codes read straight into
registers.

Two kernels: ``Mxfp4GateUpMma`` here, ``h = SiTU-GLU(w1[e] z, w3[e] z)``, and ``cute_down.Mxfp4DownMma``, ``partial =
round(w2[e] h) · router weight``, which shares this module's conversion and MMA steps. A block runs for pair ``p``
only if ``p`` is the first (token, slot) pair holding its expert, and then serves every token that chose that expert
at once (at most 8: the MMA's N). The MMA's 8 columns are either the call's tokens in blocks of 8 (M <= 8: one MMA a
step; M <= 16: two), or, ``compact``, only the tokens that chose the expert, found from the prologue's ids (about one
a block at K3's decode M: one MMA a step and one token's activations, whatever M). Compact blocks run for the first
pair of every eighth token holding the expert (token order), each serving its eight: a ninth token runs a second
block, in parallel.

Weights are the MMA's A operand (16 rows: gate/up stacks 8 rows of w1 over the same 8 rows of w3, so a lane holds
both halves of its SiTU-GLU; down takes 16 rows of w2), tokens its B operand (one column a token). A lane owns 16
contiguous code bytes (32 values, one E8M0 group) of each of its two rows per 128-wide K step: one 16-byte load a
row, no shared memory. A dot product may sum its K in any order, so the MMA's K slots are mapped onto those 32
values in the order the conversion produces them (``e2m1x8_bf16``: register k of a word holds elements k and k + 4)
and the activations are loaded contiguous and permuted the same way (``prmt``), once for all row groups.

Conversion (``e2m1_bits.py``; three integer instructions and one bf16x2 multiply a pair of values): each E2M1 code's
sign and magnitude bits are moved into a bf16 bit pattern worth value · 2^-126 (the magnitude's two exponent bits at
the bottom of bf16's exponent, its mantissa bit on top of bf16's mantissa: zero and 0.5 come out subnormal), then one
bf16x2 multiply by 2^(scale - 1) makes them value · 2^(scale - 127) exactly, as ``reference.dequantize_mxfp4`` rounds
them. A scale above 2^1 (byte > 128: never in a real checkpoint) needs a second multiply, a scale byte of 255 NaN: the
variants built with ``big_scales`` take it on every value (the host picks them unless it has seen every scale byte of
the call's weights at 128 or below; a warp-uniform branch around the multiply was predicated by ptxas into both paths,
costing more than the multiply).

PDL: both products wait before reading z / h or the ids. The gate/up kernel lets the down kernel launch right after
its wait; the down kernel finds its expert and prefetches its w2 rows into L2 before its own wait (the ids were
written before the gate/up kernel began: the argument of step 1 of k3compile/static_weights.py), so the w2 stream
overlaps the gate/up tail.

A kernel module: it imports cutlass at its top and is loaded only when a kernel is built (``cute.py``).
"""
# no `from __future__ import annotations`: the DSL evaluates the kernels' annotations
import cutlass
import cutlass.cute as cute
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

from k3compile.kernels.cute.asm import mma_16816
from k3compile.ops.moe_experts import e2m1_bits


_E2M1X8_PTX = e2m1_bits.e2m1x8_ptx()


@dsl_user_op
def e2m1x8_bf16(word, factor, *, loc=None, ip=None):
    """Eight E2M1 codes (element j in bits 4j..4j+3 of ``word``) -> four bf16x2, register k = (element k,
    element k + 4), each times the bf16x2 ``factor`` (see the module doc). The -0.0 addend keeps fma's result the
    product's."""
    res = llvm.inline_asm(
        llvm.StructType.get_literal([T.i32()] * 4),
        [word.ir_value(loc=loc, ip=ip), factor.ir_value(loc=loc, ip=ip)],
        _E2M1X8_PTX, "=r,=r,=r,=r,r,r",
        has_side_effects=False, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip,
    )
    return [cutlass.Int32(llvm.extractvalue(T.i32(), res, [i], loc=loc, ip=ip)) for i in range(4)]


@dsl_user_op
def top_bit(x, *, loc=None, ip=None):
    """The index of the highest set bit of a nonzero 32-bit ``x`` (PTX bfind)."""
    return cutlass.Int32(llvm.inline_asm(
        T.i32(), [x.ir_value(loc=loc, ip=ip)], "bfind.u32 $0, $1;", "=r,r",
        has_side_effects=False, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip,
    ))


@dsl_user_op
def mul_bf16x2(x, factor, *, loc=None, ip=None):
    """x · factor, both bf16x2 in 32-bit registers."""
    return cutlass.Int32(llvm.inline_asm(
        T.i32(), [x.ir_value(loc=loc, ip=ip), factor.ir_value(loc=loc, ip=ip)],
        "{ .reg .b32 nz; mov.b32 nz, 0x80008000; fma.rn.bf16x2 $0, $1, $2, nz; }", "=r,r,r",
        has_side_effects=False, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip,
    ))


@dsl_user_op
def prmt(a, b, selector: int, *, loc=None, ip=None):
    """The bytes of {b, a} that ``selector`` picks (PTX prmt)."""
    return cutlass.Int32(llvm.inline_asm(
        T.i32(), [a.ir_value(loc=loc, ip=ip), b.ir_value(loc=loc, ip=ip)],
        f"prmt.b32 $0, $1, $2, {selector:#x};", "=r,r,r",
        has_side_effects=False, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip,
    ))


@cute.jit
def permuted_pairs(rX32: cute.Tensor, col0: cutlass.Constexpr):
    """The 16 bf16x2 of 4 vectors of 8 activations (rX32[:, col0 .. col0 + 3]) in the conversion's order: pair k of a
    vector = (element k, element k + 4)."""
    out = []
    for j in cutlass.range_constexpr(4):
        x0 = rX32[0, col0 + j]
        x1 = rX32[1, col0 + j]
        x2 = rX32[2, col0 + j]
        x3 = rX32[3, col0 + j]
        out.append(prmt(x0, x2, 0x5410))
        out.append(prmt(x0, x2, 0x7632))
        out.append(prmt(x1, x3, 0x5410))
        out.append(prmt(x1, x3, 0x7632))
    return out


class Mxfp4GateUpMma:
    """The gate/up product, M <= 16 tokens (blocks of 8: one MMA each), bf16 activations, MXFP4 weights: ``fn(z [M, L],
    ids [M·A], weights (unused), w1, w3 [E, I, L/2], s1, s3 [E, I, L/32], h [M·A, I])``. Block ``(p, r)``:
    ``row_groups`` groups of 8 rows of w1 and w3 from ``r · 8 · row_groups``, K split over ``warps_k`` warps (their
    sums meet in shared memory), ``unroll`` steps of loads in flight a warp (``prefetch``: a chunk of ``unroll`` steps
    loaded while the chunk before it converts and multiplies)."""

    def __init__(self, m: int, a: int, warps_k: int, row_groups: int, unroll: int, beta, linear_beta,
                 big_scales: bool, prefetch: bool = False, scan_unrolled: bool = False, compact: bool = False):
        assert 1 <= m <= 16 and (scan_unrolled or not compact)
        self.prefetch = prefetch   # two chunks' registers: the next chunk's loads in flight while one converts
        self.scan_unrolled = scan_unrolled   # every id of the scan loaded before any compare: one round trip
        self.compact = compact   # the MMA's columns: the expert's tokens only (module doc)
        self.m, self.a = m, a
        self.nb = 1 if m <= 8 or compact else 2   # blocks of 8 tokens: one MMA (N = 8) each
        self.big_scales = big_scales
        self.wk, self.rg, self.unroll = warps_k, row_groups, unroll
        self.threads = 32 * warps_k
        self.rows_per_group = 8   # of w1, and the same of w3
        self.beta, self.linear_beta = beta, linear_beta
        self.smem = 4 * 4 * 32 * row_groups * warps_k * self.nb   # the K-warps' accumulators, fp32

    @cute.jit
    def __call__(self, mX: cute.Tensor, mIds: cute.Tensor, mWts: cute.Tensor, mW0: cute.Tensor, mW1: cute.Tensor,
                 mS0: cute.Tensor, mS1: cute.Tensor, mOut: cute.Tensor, stream):
        n = mW0.shape[1]
        per_block = self.rows_per_group * self.rg
        self.kernel(mX, mIds, mWts, mW0, mW1, mS0, mS1, mOut).launch(
            grid=[mIds.shape[0], (n + per_block - 1) // per_block, 1],
            block=[self.threads, 1, 1],
            smem=self.smem,
            stream=stream,
            use_pdl=True,
        )

    @cute.jit
    def pair_ids(self, mIds: cute.Tensor, lane):
        """This lane's ids of pairs lane, lane + 32, ... of all M·A, in their low 32 bits (indices clamped in range, so
        that no load is conditional): the unrolled scan's one round trip of loads."""
        pairs: cutlass.Constexpr = self.m * self.a
        ids = []
        for j in cutlass.range_constexpr((pairs + 31) // 32):
            ids.append(mIds[cutlass.min(lane + 32 * j, pairs - 1)].to(cutlass.Int32))
        return ids

    @cute.jit
    def first_of_expert(self, mIds: cute.Tensor, p, e, lane, ids: list, lo=0):
        """Whether no pair before ``p`` (from pair ``lo``: ``scan_unrolled`` only) holds expert ``e`` (the warp's
        lanes split the scan). ``scan_unrolled``: the compares on ``pair_ids``' ids (``ids``), instead of a loop of
        loads, one round trip per 32 pairs; either way the ids compared in their low 32 bits."""
        seen = cutlass.Int32(0)
        if cutlass.const_expr(self.scan_unrolled):
            pairs: cutlass.Constexpr = self.m * self.a
            for j in cutlass.range_constexpr((pairs + 31) // 32):
                if (lane + 32 * j < p) & (lane + 32 * j >= lo) & (ids[j] == e):
                    seen = cutlass.Int32(1)
        else:
            for q in cutlass.range(lane, p, 32, unroll=1):
                if mIds[q].to(cutlass.Int32) == e:
                    seen = cutlass.Int32(1)
        return cute.arch.vote_any_sync(seen != 0) == cutlass.Boolean(False)

    @cute.jit
    def tokens_of_expert(self, e, lane, ids: list):
        """``(tokens, slots)``: the tokens with a pair holding ``e`` as a bit mask (bit t: token t), and each token's
        slots holding it (``slots[t]``, bit a: pair t·A + a), from ``pair_ids``' ids: each round's ballot gives 32
        pairs' bits, and token t's pairs are bits t·A .. t·A + A - 1 of those rounds."""
        pairs: cutlass.Constexpr = self.m * self.a
        hits = []
        for j in cutlass.range_constexpr((pairs + 31) // 32):
            hits.append(cute.arch.vote_ballot_sync((ids[j] == e) & (lane + 32 * j < pairs)))
        tokens = cutlass.Int32(0)
        slots = []
        for tok in cutlass.range_constexpr(self.m):
            hit = cutlass.Int32(0)
            for j in cutlass.range_constexpr(tok * self.a // 32, (tok * self.a + self.a - 1) // 32 + 1):
                lo = max(tok * self.a, 32 * j) - 32 * j   # round j's first bit of the token
                width = min(tok * self.a + self.a, 32 * j + 32) - 32 * j - lo
                # masked after the (arithmetic) shift: the sign's copies never reach the kept bits
                part = (hits[j] >> lo) & (-1 if width == 32 else (1 << width) - 1)
                hit = hit | (part << (32 * j + lo - tok * self.a))
            slots.append(hit)
            if hit != 0:
                tokens = tokens | (1 << tok)
        return tokens, slots

    @cute.jit
    def nth_token(self, tokens, k, default):
        """The token of ``tokens``' set bit number ``k`` (from 0, lowest first); ``default`` where fewer are set."""
        res = default
        seen = cutlass.Int32(0)
        for i in cutlass.range_constexpr(self.m):
            bit = (tokens >> i) & 1
            if (bit != 0) & (seen == k):
                res = cutlass.Int32(i)
            seen = seen + bit
        return res

    @cute.jit
    def compact_block(self, mIds: cute.Tensor, p, e, lane, ids: list):
        """``(run, tokens, slots, rank)`` of a compact block: it runs where ``p`` is its token's first pair holding
        ``e`` and that token's rank among the expert's tokens (``tokens``, ``slots``: ``tokens_of_expert``) is a
        multiple of 8: the block serves ranks ``rank .. rank + 7``."""
        tokens, slots = self.tokens_of_expert(e, lane, ids)
        tp = p // self.a
        rank = cute.arch.popc(tokens & ((cutlass.Int32(1) << tp) - 1))
        run = self.first_of_expert(mIds, p, e, lane, ids, tp * self.a) & (rank % 8 == 0)
        return run, tokens, slots, rank

    @cute.jit
    def columns(self, tokens, slots: list, rank, g, t):
        """The tokens of ranks ``rank ..`` for lane (g, t): its B column's token (the first's where column g is past
        the expert's tokens: the same row, loaded at once with it), and its two stored columns' tokens (M where
        none) with their slots holding the expert (0 where none)."""
        first = self.nth_token(tokens, rank, cutlass.Int32(self.m))
        col = self.nth_token(tokens, rank + g, first)
        outs = [self.nth_token(tokens, rank + 2 * t + x, cutlass.Int32(self.m)) for x in range(2)]
        masks = []
        for x in cutlass.range_constexpr(2):
            mask = cutlass.Int32(0)
            for i in cutlass.range_constexpr(self.m):
                if outs[x] == i:
                    mask = slots[i]
            masks.append(mask)
        return col, outs, masks

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mIds: cute.Tensor, mWts: cute.Tensor, mW0: cute.Tensor, mW1: cute.Tensor,
               mS0: cute.Tensor, mS1: cute.Tensor, mOut: cute.Tensor):
        RG: cutlass.Constexpr = self.rg
        tidx, _, _ = cute.arch.thread_idx()
        p, rb, _ = cute.arch.block_idx()
        wk = tidx // 32
        lane = tidx % 32
        g = lane // 4
        t = lane % 4
        E = mW0.shape[0]
        N = mW0.shape[1]
        K = mX.shape[1]
        n0 = rb * (self.rows_per_group * RG)

        # z and the ids are the previous kernels' outputs: nothing is read before the wait
        cute.arch.griddepcontrol_wait()
        cute.arch.griddepcontrol_launch_dependents()   # the down kernel settles and warms L2 (module doc)
        e = mIds[p].to(cutlass.Int32)
        valid = (e >= 0) & (e < E)
        ec = cutlass.max(cutlass.min(e, E - 1), 0)
        if cutlass.const_expr(self.compact):
            run, tokens, slots, rank = self.compact_block(mIds, p, e, lane, self.pair_ids(mIds, lane))
            run = valid & run
        elif cutlass.const_expr(self.scan_unrolled):   # its loads are in range whatever e is: issued beside e's
            run = valid & self.first_of_expert(mIds, p, e, lane, self.pair_ids(mIds, lane))
        else:
            run = valid
            if valid:
                run = self.first_of_expert(mIds, p, e, lane, [])
        if run:
            if cutlass.const_expr(self.compact):
                col, outs, masks = self.columns(tokens, slots, rank, g, t)
                self.product(mX, mIds, mW0, mW1, mS0, mS1, mOut, ec, n0, wk, lane, g, t, N, K, [col], [outs],
                             [masks])
            else:
                cols = [cutlass.min(8 * b + g, self.m - 1) for b in range(self.nb)]   # past M: a copy, never stored
                outs = [[8 * b + 2 * t + x for x in range(2)] for b in range(self.nb)]
                self.product(mX, mIds, mW0, mW1, mS0, mS1, mOut, ec, n0, wk, lane, g, t, N, K, cols, outs, [])

    @cute.jit
    def product(self, mX: cute.Tensor, mIds: cute.Tensor, mW0: cute.Tensor, mW1: cute.Tensor, mS0: cute.Tensor,
                mS1: cute.Tensor, mOut: cute.Tensor, e, n0, wk, lane, g, t, N, K, cols: list, outs: list,
                masks: list):
        """Rows ``n0 ..`` of expert ``e`` against block b's tokens: lane (g, t) loads token ``cols[b]``'s z (its B
        column g) and stores h of tokens ``outs[b]`` (its columns 2t, 2t + 1; M: none) into their slots holding
        ``e``: ``masks[b]``'s bits where given (``compact``), else found by reading the ids."""
        RG: cutlass.Constexpr = self.rg
        U: cutlass.Constexpr = self.unroll
        WK: cutlass.Constexpr = self.wk
        NB: cutlass.Constexpr = self.nb

        # the A rows of row group r: 0..7 the rows of w1, 8..15 the same rows of w3; past N clamped, never stored
        rows0 = []
        rows1 = []
        for r in cutlass.range_constexpr(RG):
            rows0.append(cutlass.min(n0 + r * 8 + g, N - 1))
            rows1.append(cutlass.min(n0 + r * 8 + g, N - 1))

        # the rows this lane reads, as [(16 bytes / 8 values), vector] tensors: their addresses computed once
        gW0 = cute.logical_divide(mW0, (None, None, 16))   # [E, rows, (16 bytes, K/32)]
        gW1 = cute.logical_divide(mW1, (None, None, 16))
        codes = []
        scales = []
        for r in cutlass.range_constexpr(RG):
            codes.append(gW0[e, rows0[r], None])
            codes.append(gW1[e, rows1[r], None])
            scales.append(mS0[e, rows0[r], None])
            scales.append(mS1[e, rows1[r], None])
        # column g's z for each block b of 8 columns ([(8 values, K/8)])
        xs = []
        for b in cutlass.range_constexpr(NB):
            xs.append(cute.logical_divide(mX, (None, 8))[cols[b], None])

        SL: cutlass.Constexpr = 2 * U if self.prefetch else U   # step slots in registers: one chunk, or two
        acc = cute.make_rmem_tensor((4, RG, U, NB), cutlass.Float32)
        acc.fill(0.0)
        rW = cute.make_rmem_tensor((16, 2 * RG * SL), cutlass.Uint8)   # codes: [bytes, (row half, group, slot)]
        rW32 = cute.recast_tensor(rW, cutlass.Int32)                    # [4 words, ...]
        rX = cute.make_rmem_tensor((8, 4 * SL * NB), mX.element_type)  # activations: 4 vectors of 8 a slot a block
        rX32 = cute.recast_tensor(rX, cutlass.Int32)                    # [4 pairs, ...]
        rS = cute.make_rmem_tensor((2 * RG * SL,), cutlass.Int32)       # scale bytes
        rD = cute.make_rmem_tensor((16, 2), cutlass.Int32)              # one row group's dequantised step

        # whole chunks of U steps inside K: every load of a chunk issued before its first conversion
        n_full = K // (128 * U)
        if cutlass.const_expr(self.prefetch):
            # the warp's chunks wk, wk + WK, ..., last in pairs (slots 0..U-1, then U..2U-1), each chunk's loads
            # issued before the chunk ahead of it converts. No load is conditional (a conditional one would be sunk
            # to its use, after the conversion it should overlap): the pair loop runs where both chunks exist, the
            # load ahead of the last pair is clamped to the last chunk, and an odd chunk out converts after the loop
            last = wk + (n_full - 1 - wk) // WK * WK
            if wk < n_full:
                self.load_chunk(codes, scales, xs, wk, t, 0, rW, rX, rS)
            for c in cutlass.range(wk, last, 2 * WK, unroll=1):   # c + WK <= last
                self.load_chunk(codes, scales, xs, c + WK, t, U, rW, rX, rS)
                self.mma_steps(rW32, rX32, rS, rD, acc, U, 0)
                self.load_chunk(codes, scales, xs, cutlass.min(c + 2 * WK, last), t, 0, rW, rX, rS)
                self.mma_steps(rW32, rX32, rS, rD, acc, U, U)
            if wk < n_full:
                if (last - wk) // WK % 2 == 0:   # an odd count of chunks: the last one is in slots 0..U-1
                    self.mma_steps(rW32, rX32, rS, rD, acc, U, 0)
        else:
            for c in cutlass.range(wk, n_full, WK, unroll=1):
                self.load_chunk(codes, scales, xs, c, t, 0, rW, rX, rS)
                self.mma_steps(rW32, rX32, rS, rD, acc, U, 0)
        # the steps after them one at a time, lanes past K reading nothing (zero codes and activations)
        for st in cutlass.range(n_full * U + wk, (K + 127) // 128, WK, unroll=1):
            k0 = st * 128 + 32 * t
            rW32.fill(0)
            rX32.fill(0)
            rS.fill(127)
            if k0 < K:
                self.load_step(codes, scales, xs, k0, 0, rW, rX, rS)
            self.mma_steps(rW32, rX32, rS, rD, acc, 1, 0)

        # the K-warps' sums meet in shared memory: red[warp, row group, value, lane]
        smem = cutlass.memory.SmemAllocator()
        red = smem.allocate_tensor(cutlass.Float32, cute.make_layout((WK, RG, NB, 4, 32)), byte_alignment=16)
        for r in cutlass.range_constexpr(RG):
            for b in cutlass.range_constexpr(NB):
                for i in cutlass.range_constexpr(4):
                    s = acc[i, r, 0, b]
                    for u in cutlass.range_constexpr(1, U):
                        s = s + acc[i, r, u, b]
                    red[wk, r, b, i, lane] = s
        cute.arch.sync_threads()
        if wk == 0:
            for r in cutlass.range_constexpr(RG):
                for b in cutlass.range_constexpr(NB):
                    c = []
                    for i in cutlass.range_constexpr(4):
                        s = red[0, r, b, i, lane]
                        for q in cutlass.range_constexpr(1, WK):
                            s = s + red[q, r, b, i, lane]
                        c.append(s)
                    # lane (g, t) holds rows g (c0, c1) and g + 8 (c2, c3) for columns 2t and 2t + 1
                    for x in cutlass.range_constexpr(2):
                        self.store_h(mIds, mOut, e, outs[b][x], n0 + r * 8 + g, N, c[x], c[2 + x],
                                     masks[b][x] if len(masks) else None)

    @cute.jit
    def load_step(self, codes: list, scales: list, xs: list, k0, u: cutlass.Constexpr, rW: cute.Tensor,
                  rX: cute.Tensor, rS: cute.Tensor):
        """This lane's step at K = k0 into slot u: 16 code bytes and the scale of each of its rows, 32 activations of
        each of its tokens."""
        for q in cutlass.range_constexpr(2 * self.rg):
            slot = u * 2 * self.rg + q
            v = codes[q][((None, k0 // 32),)]
            cute.autovec_copy(cute.make_tensor(v.iterator.align(16), v.layout), rW[None, slot])
            rS[slot] = scales[q][k0 // 32].to(cutlass.Int32)
        for b in cutlass.range_constexpr(self.nb):
            for j in cutlass.range_constexpr(4):
                v = xs[b][((None, k0 // 8 + j),)]
                cute.autovec_copy(cute.make_tensor(v.iterator.align(16), v.layout),
                                  rX[None, (u * self.nb + b) * 4 + j])

    @cute.jit
    def load_chunk(self, codes: list, scales: list, xs: list, c, t, slot0: cutlass.Constexpr, rW: cute.Tensor,
                   rX: cute.Tensor, rS: cute.Tensor):
        """Chunk c's ``unroll`` steps (all inside K) into slots slot0 ...: every load issued, none waited for."""
        for u in cutlass.range_constexpr(self.unroll):
            self.load_step(codes, scales, xs, (c * self.unroll + u) * 128 + 32 * t, slot0 + u, rW, rX, rS)

    @cute.jit
    def mma_steps(self, rW32: cute.Tensor, rX32: cute.Tensor, rS: cute.Tensor, rD: cute.Tensor, acc: cute.Tensor,
                  n: cutlass.Constexpr, slot0: cutlass.Constexpr):
        """Slots slot0 .. slot0 + n - 1 into accumulators 0 .. n - 1 (``big_scales``: with the second multiply; see
        the module doc)."""
        for u in cutlass.range_constexpr(n):
            self.mma_step(rW32, rX32, rS, rD, acc, slot0 + u, u, self.big_scales)

    @cute.jit
    def mma_step(self, rW32: cute.Tensor, rX32: cute.Tensor, rS: cute.Tensor, rD: cute.Tensor, acc: cute.Tensor,
                 u: cutlass.Constexpr, a: cutlass.Constexpr, exact: cutlass.Constexpr):
        """The 8 MMAs of slot u for each row group and block of 8 tokens, into accumulator a: activations permuted
        as the codes convert (pair k of a vector = elements k and k + 4), the A fragment's rows g / g + 8 from row
        halves 0 / 1."""
        xp = []   # xp[b]: block b's 16 bf16x2
        for b in cutlass.range_constexpr(self.nb):
            xp.append(permuted_pairs(rX32, (u * self.nb + b) * 4))
        for r in cutlass.range_constexpr(self.rg):
            self.group_mmas(rW32, rS, (u * self.rg + r) * 2, rD, xp, acc[None, r, a, None], exact)

    @cute.jit
    def group_mmas(self, rW32: cute.Tensor, rS: cute.Tensor, slot0: cutlass.Constexpr, rD: cute.Tensor, xp: list,
                   acc: cute.Tensor, exact: cutlass.Constexpr, mmas: cutlass.Constexpr = 8):
        """One row group's step (both kernels): its row halves (slots ``slot0``, ``slot0 + 1``) dequantised into rD,
        then its 8 MMAs against each block b of 8 tokens (``xp[b]``: the block's 16 bf16x2), into ``acc[:, b]``;
        ``mmas`` 4: a half step (each lane's first 16 values only)."""
        for h in cutlass.range_constexpr(2):   # rD[:, h]: row half h's 16 bf16x2
            self.dequantize(rW32, rS[slot0 + h], slot0 + h, rD, h, exact, mmas // 2)
        for j in cutlass.range_constexpr(mmas):
            a = (rD[2 * j, 0], rD[2 * j, 1], rD[2 * j + 1, 0], rD[2 * j + 1, 1])
            for b in cutlass.range_constexpr(len(xp)):
                d = mma_16816(a, (xp[b][2 * j], xp[b][2 * j + 1]), (acc[0, b], acc[1, b], acc[2, b], acc[3, b]),
                              False)
                for i in cutlass.range_constexpr(4):
                    acc[i, b] = d[i]

    @cute.jit
    def dequantize(self, rW32: cute.Tensor, s, slot: cutlass.Constexpr, rD: cute.Tensor, h: cutlass.Constexpr,
                   exact: cutlass.Constexpr, words: cutlass.Constexpr = 4):
        """The 32 values (``words`` 2: the first 16) of one row's step slot as 16 (8) bf16x2 into rD[:, h] (word by
        word, ``e2m1x8_bf16``'s order), times 2^(s - 127): 2^(min(s, 128) - 1) with the conversion, and with
        ``exact`` 2^(max(s, 128) - 128) after it (255: NaN)."""
        # bf16x2 bits of 2^(min(s, 128) - 1): the biased exponent min(s, 128) + 126 in both halves (one imad)
        f = cutlass.min(s, 128) * 0x00800080 + 126 * 0x00800080
        for q in cutlass.range_constexpr(words):
            four = e2m1x8_bf16(rW32[q, slot], f)
            for k in cutlass.range_constexpr(4):
                rD[4 * q + k, h] = four[k]
        if cutlass.const_expr(exact):
            f2 = cutlass.max(s, 128) * 0x00800080 - 0x00800080     # 2^(s - 128), 1 where s <= 128
            if s == 255:
                f2 = cutlass.Int32(0x7FC07FC0)
            for q in cutlass.range_constexpr(4 * words):
                rD[q, h] = mul_bf16x2(rD[q, h], f2)

    @cute.jit
    def store_h(self, mIds: cute.Tensor, mH: cute.Tensor, e, tok, i, N, gate, up, mask):
        """h = SiTU-GLU(gate, up) of token ``tok`` at column ``i``, into every pair of the token holding ``e`` (the
        slots of ``mask``'s bits where given); the model rounds gate, up and h to the activations' dtype
        (reference.py)."""
        if tok < self.m:
            if i < N:
                dt = mH.element_type
                gt = gate.to(dt).to(cutlass.Float32)
                upv = up.to(dt).to(cutlass.Float32)
                act = gt * self.sigmoid(gt)
                if cutlass.const_expr(self.beta is not None):
                    act = cutlass.Float32(self.beta) * self.tanh(gt / cutlass.Float32(self.beta)) * self.sigmoid(gt)
                if cutlass.const_expr(self.linear_beta is not None):
                    upv = cutlass.Float32(self.linear_beta) * self.tanh(upv / cutlass.Float32(self.linear_beta))
                hv = (act * upv).to(dt)
                if cutlass.const_expr(mask is None):
                    for a in cutlass.range_constexpr(self.a):
                        if mIds[tok * self.a + a].to(cutlass.Int32) == e:
                            mH[tok * self.a + a, i] = hv
                else:
                    left = mask
                    while left != 0:
                        a = top_bit(left)
                        mH[tok * self.a + a, i] = hv
                        left = left ^ (cutlass.Int32(1) << a)

    @cute.jit
    def sigmoid(self, x):
        return cutlass.Float32(1.0) / (cutlass.Float32(1.0) + cute.math.exp(-x))

    @cute.jit
    def tanh(self, x):
        return cute.math.tanh(x)
