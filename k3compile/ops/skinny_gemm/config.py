"""Work division of the CuTe skinny GEMM, per (M, N, K): a measured table and a heuristic.

The kernel (``cute.py``) computes ``C[M, N] = A[M, K] · W[N, K]ᵀ`` with one warp-level tensor-core
tile of 16 (M, padded) × 8 (weight rows) × 32 (K, two m16n8k16 steps) per step. A thread block is
``warps_n × warps_k`` warps: ``warps_n`` split the block's weight rows, ``warps_k`` split K inside
the block (their partial sums meet in shared memory), so no global workspace and no second kernel
are needed. ``split_k > 1`` also splits K across a thread-block cluster of that many blocks (more
blocks and bytes in flight when N gives few row blocks); their partial sums meet through distributed
shared memory, again with no workspace, counter or second kernel (CUDA-graph safe by construction).
Each warp owns ``row_groups`` groups of 8 weight rows and handles ``unroll`` K-steps per chunk. With
``stages == 1`` the weight goes straight to registers (128-bit loads); with ``stages > 1`` it is
streamed by cp.async through a per-warp shared-memory ring, which keeps more bytes in flight
(``a_ring``: A's rows ride the same ring; ``a_pipe``: A's plain loads run one chunk ahead in registers).
A's bytes read from L2 per weight byte are M / block_n (every block reads all of A's K share), so larger
``row_groups`` with a split-K cluster keeping the block count cut that traffic at larger M; so does
``warps_n > 1`` with ``a_share`` (one A ring per K slice, filled once by its ``warps_n`` warps together, where
``a_ring`` alone gives each warp its own copy) without the registers that more row groups per warp cost.
Above M = 8 the second A row per lane lifts the 8-K-warp ring configuration from 42 to 62 registers: 4 instead
of 5 blocks of 256 threads per SM, and 4608x7168's 576 blocks no longer fit in one wave (34 µs against 19 at
M = 8); a ptxas register cap (min_blocks_per_mp 5) brought it to 26 µs, still behind rg2 in a split-K cluster.

Where M = 8..16 goes (cute5's timing-only variants, benchmarks/results/skinny_gemm_h200_cute5_*): with every chunk
loading the same A vectors (L1 hits, the same instructions) M = 16 ran as fast as with no A loads at all, 3584x7168
14.9 µs against 18.3, 1536x7168 7.3 against 11.2, the fused-norm tail 16.0 against 24.1: the slope is A's traffic
past L1 (each block reads all of its K share of A, M/8 of the weight's bytes per row group), not the MMAs or the
norm's arithmetic. ``a_l1`` keeps A in L1 for the other blocks of the SM (A's ring copies cp.async.ca, plain A
loads L1::evict_last, the register path's weight loads L1::evict_first): 2-12% on the a_ring picks of the small-N
shapes at M 1-16 (cute5 runs 3-4), nothing measurable on plain A loads (already L1-cached; a larger L1 carveout did
not help either).

Reading A past L1 once per block (cute6's runs 1-3: benchmarks/results/skinny_gemm_h200_cute6_sweep{1,2,3}.*): an
``a_span`` option staged each K slice's A in a shared double buffer of 2-4 chunks a half, copied once by the slice's
warps_n warps (cp.async, the MMA's permuted order, one barrier of them per span) and read by all of them and their
row groups. It was correct (GPU tests) but never a pick. With warps_n 2-8 and split-K clusters (A's bytes M / 16..64
of the weight's) it lost 0.5-4 µs to the picks at M 4 as much as at M 16 (3584x7168 M16 19.4 against 18.6), so
those block shapes stream the weight worse than they save on A; it came first only where nothing of ours is close
(the fused-norm tail M16 23.6-24.0 against 24.1-24.4, the Triton tail 15.4; 20480x7168 M16 81.8 against 87.9,
Triton 71.0). With warps_n 1 its wins (1536x7168 M16 9.38 against 10.57) were the rg2-wn1-wk8 shape's, which with A
through the ring measured 9.26 (7.67 at M 8 with a_l1). It was removed. The wgmma kernel (``cute_wgmma.py``), whose
A chunk reaches shared memory by TMA once per block, is what now leads at M 8/16 on the big shapes.

Hiding a launch under the previous product (programmatic dependent launch): ``l2_kb`` bulk-prefetches
the first KB of each block's weight into L2 before the wait, ``early`` lets the next kernel launch right
after our own wait. On the H200 both pay where the weight is small (≤ ~12 MB: the whole of it is
prefetched while the previous product runs); for big weights a 2 KB-per-row prefetch is a small gain and
the early trigger mostly a loss (the next kernel's waiting blocks crowd the SMs: a timeline of 4608x7168 with it
showed this grid's 576 blocks spread 1 to 6 per SM, a 6-8 µs tail; benchmarks/results/skinny_gemm_h200_cute4_probe.json).

``trigger_first`` (both kernels; a static weight only, else it does nothing) lets the next kernel launch as our blocks
start, before our own wait, so several products' weights stream at once. A Triton probe that only reads each weight
once (benchmarks/probe_weight_stream.py; benchmarks/results/probe_weight_stream_h200.log) ran back to back at 96-104%
of the copy ceiling on 11-30 MB with its trigger first and its loads before the wait, against 46-61% (11-13 MB) and
73-87% (22-30 MB) with the trigger after its wait, where ``early`` puts it. The GEMMs gain less: after the wait each block
still loads A, runs its MMAs, sums the split-K partials and stores, a chain that no overlap hides (the router stays near
4.8 µs for a 3.05 µs floor). The gain is largest where a block holds its whole weight share before the wait (7168x768,
96 KB rings on 112 blocks: 4.13 -> 3.22 µs); grids of ~100 KB blocks two to an SM lose with it (2112x7168 M8/16).

What that chain costs (benchmarks/results/skinny_gemm_h200_s10_chain_diag.log, timing-only variants of the wgmma
picks): in the router's split-K cluster (8 blocks) the reduction through distributed shared memory took 0.85 µs at
M1 and 1.3 µs at M8 of 4.8 / 5.5, the MMAs 0.3, A's loads after the wait 0.15; in 7168x768's single blocks A's loads
after the wait took 0.7 of 3.5 µs. ``push_partials`` (the wgmma kernel, ``cute_wgmma.py``) replaces the reduction's
barriers and remote loads by one-way pushes: the router went to 4.36-4.66 µs at M1-8 with a static weight (4.76-5.38
before), 1536x7168 to 6.1-6.4 (6.9-7.4), and every split-K wgmma pick gained 2-15% (.scratch/s10 run 6;
benchmarks/results/skinny_gemm_h200_s10_push.log). With the reduction cheap, split-K also pays where K is short (run 7:
7168x768 and 7168x1536 in clusters of 2, blocks of 48-96 KB that hold their whole share, several to an SM) and
2112x7168 takes clusters of 3 (8.2-8.7 µs against 8.8-9.0).

The eleventh session made the pushes leave from the accumulator registers (each thread's fragment in 16-byte
``st.async``, no partial tile in shared memory, no block barrier) and found what the tenth session's scalar pushes had
by accident: at M1-2 the router's outputs all fell to the cluster's first block, so the seven others pushed and
exited, and their SMs took the next product's blocks. With every block owning an eighth the router ran 4.6-5.3 µs
(4.4-5.0 before); ``owners`` gives the outputs to the first one or two blocks and lets the rest exit once pushed:
4.26-4.40 µs at M1-8 and 4.78 at M16 (cuBLAS 8.7-8.9), and every push pick with a static weight gained 2-10%
(.scratch/s11 runs 2-3; benchmarks/results/skinny_gemm_h200_s11_owners.log). The owners' receive buffer grows as
they get fewer (split_k · ⌈128 / owners⌉ · fragment floats), and where that leaves one block to an SM instead of two
(1536x7168 M16, 7168x1536 M1-4) more owners win. Clusters of 12-16 blocks (non-portable, 56-80 KB blocks two or three
to an SM) measured 4.5-4.6 µs at M1-8 and 5.6-6.1 at M16 (run 1).

The twelfth session timed the router's M16 chain (timing-only variants; benchmarks/results/skinny_gemm_h200_s12.log):
the pushes cost 0.30 µs at M16 and 0.09 at M8, because an 8-float fragment (M16, or block_n 128) was laid out
[rank, thread, 8], so each st.async of a warp wrote half of every 32-byte segment. Laid out [rank, quarter, thread, 4]
(``cute_wgmma.push_slot``) the router's M16 went from 4.71 to 4.52 µs, and the 8-float push picks gained 0.6-2.7%.
The owners' outputs, staged in shared memory and stored in 16-byte pieces (``store_owned``: whole 32-byte segments of
C, where the fragments' 2-byte stores wrote halves), gained 0.6-2.8% more at M16. What is left at M16 is the latency
of A's 28 KB per block, requested from L2 right after the wait (0.38 µs; 0.29 of it went when a probe requested A
before the wait), and the MMAs (0.31 µs, by instruction count: 56 m64 k16 steps a block). Neither register-sourced
MMAs with 3-6 stages of the weight copied to registers before the wait, nor two MMA warpgroups, nor 3-4 stage rings
(two blocks to an SM), nor clusters of 7 paid.

The thirteenth session found what held the router: a block's ring (its whole 114 KB share, A beside it) left one
block to an SM, so the next product's block on that SM could not start streaming until ours had run its whole chain
after the wait; the period was the stream plus the chain. ``reg_stages`` copies a block's first R weight tiles from
the ring to registers (ldmatrix, before the wait) and frees their slots, so a ring of 3-4 slots holds a share of 7
tiles and two blocks fit an SM (A's share gets resident tiles of its own). The router went from 4.14-4.49 µs to
3.39-3.86 at M1-16 (x2.3-2.5 of cuBLAS), and every shape whose share fits gained 5-15%: 1536x7168, 7168x1536 and
7168x768; 2304x1536 left the mma.sync kernel (2.8-4.4 µs to 2.4-2.6). Where the share does not fit (2112x7168 in
clusters of 8: 264 blocks fill both slots of every SM) it lost (.scratch/s13 runs 1-4, benchmarks/results/
skinny_gemm_h200_s13.log). At M16 four register tiles (97 KB)
ran 4.55-4.58 µs against three's 3.82-3.86, on 1536x7168 8.4 against 5.95. The likely cause (arithmetic, not measured):
ptxas gives that variant 170 registers, 176 a thread once rounded; an SM's registers are four sub-partitions of 16384,
and two blocks of five warps put three warps on one of them, 3 · 176 · 32 = 16896 > 16384, so the second block does
not fit. At M1 four tiles take 162 (168 rounded: 16128 fits) and won; three tiles at M16 take 138.

A table entry names the kernel as well as its configuration: a ``SkinnyConfig`` runs ``cute.py``'s mma.sync
kernel, a ``WgmmaConfig`` (``cute_wgmma.py``) the warpgroup-MMA kernel; both sit behind the op's one "cute" backend
(``cute.skinny_gemm_cute``, ``cute.profitable``, ``cute.warmup`` and ``cute_compile.compile_kernel`` follow the
entry's type). ``heuristic`` names the mma.sync kernel; with a static weight, ``register_tile_heuristic`` names the
wgmma kernel with register tiles where a block's share fits (``choose``).

Nothing here imports cutlass: the dispatch reads this table on any machine.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional, Union

from k3compile.ops.skinny_gemm.cute_wgmma import WgmmaConfig  # cutlass-free, like this module

MAX_THREADS = 1024
K_STEP = 32  # K elements one warp covers per MMA step (4 lanes × 8 elements per weight row)


@dataclass(frozen=True)
class SkinnyConfig:
    row_groups: int = 1   # groups of 8 weight rows per warp
    warps_n: int = 1      # warps splitting the block's rows
    warps_k: int = 4      # warps splitting K inside the block
    unroll: int = 4       # K-steps of loads issued before the MMAs
    prefetch: bool = True  # L2-prefetch the first weight chunk before waiting on the previous kernel (PDL)
    stages: int = 1       # >1: weight streamed by cp.async through this many shared-memory stages per warp
    split_k: int = 1      # >1: a cluster of this many blocks splits K; partial sums meet through DSMEM
    early: bool = False   # PDL: let the next kernel launch right after our own wait, not after the K loop
    l2_kb: int = 0        # >0: before the wait, bulk-prefetch up to this many KB of the block's weight into L2
    a_ring: bool = False  # (stages > 1) A rides the cp.async ring with the weight, not plain loads
    a_pipe: bool = False  # (stages > 1, not a_ring) A's plain loads run one chunk ahead, in registers
    a_share: bool = False  # (a_ring) one A ring per K slice, shared by its warps_n warps: A read once per block
    a_l1: bool = False    # keep A in L1 (ring copies .ca, plain loads evict_last; register weight loads evict_first)
    trigger_first: bool = False  # PDL, static weight only: the next kernel may launch as soon as our blocks start

    def __post_init__(self):
        if self.row_groups < 1 or self.warps_n < 1 or self.warps_k < 1 or self.unroll < 1:
            raise ValueError(f"bad config {self}")
        if self.stages < 1 or not 1 <= self.split_k <= 8:  # a portable cluster holds ≤ 8 blocks
            raise ValueError(f"bad config {self}")
        if self.l2_kb < 0 or (self.a_ring and self.stages == 1):
            raise ValueError(f"bad config {self}")
        if self.a_pipe and (self.stages == 1 or self.a_ring):
            raise ValueError(f"bad config {self}")
        if self.a_share and (not self.a_ring or self.warps_k > 15):  # one named barrier (1..15) per K slice
            raise ValueError(f"bad config {self}")
        if self.threads > MAX_THREADS:
            raise ValueError(f"{self} needs {self.threads} threads > {MAX_THREADS}")

    @property
    def block_n(self) -> int:
        """Weight rows (output columns) per thread block."""
        return 8 * self.row_groups * self.warps_n

    @property
    def threads(self) -> int:
        return 32 * self.warps_n * self.warps_k

    def smem_bytes(self, m: int = 16) -> int:
        """fp32 partial sums of every K-warp [warps_k, block_n, 16], plus the cp.async rings: the weight's (per
        warp) and A's (per warp, or per K slice with ``a_share``; one 16-byte vector per lane and step, two
        above M = 8)."""
        if self.stages == 1:
            return 4 * self.warps_k * self.block_n * 16 + 128
        ring = self.stages * self.row_groups * self.unroll * 512 * self.warps_n * self.warps_k
        if self.a_ring:
            a_rings = self.warps_k * (1 if self.a_share else self.warps_n)
            ring += self.stages * self.unroll * (2 if m > 8 else 1) * 512 * a_rings
        return 4 * self.warps_k * self.block_n * 16 + ring + 128  # + alignment slack

    def tag(self) -> str:
        return (f"rg{self.row_groups}-wn{self.warps_n}-wk{self.warps_k}-u{self.unroll}"
                + ("" if self.prefetch else "-nopf") + (f"-s{self.stages}" if self.stages > 1 else "")
                + (f"-c{self.split_k}" if self.split_k > 1 else "") + ("-e" if self.early else "")
                + (f"-l{self.l2_kb}" if self.l2_kb else "") + ("-a" if self.a_ring else "")
                + ("-sh" if self.a_share else "") + ("-ca" if self.a_l1 else "") + ("-p" if self.a_pipe else "")
                + ("-tf" if self.trigger_first else ""))


KernelConfig = Union[SkinnyConfig, WgmmaConfig]  # a table entry: which CuTe kernel, and how it divides the work
_H = dict(evict_hints=True)  # WgmmaConfig: TMA L2 hints (the weight evict-first, A evict-last)
_PH = dict(producer_warp=True, evict_hints=True)  # ... and a producer warp issuing the TMA loads
_HF, _PHF = dict(_H, trigger_first=True), dict(_PH, trigger_first=True)  # ... and (static weight) the trigger first
_PPH, _PPHF = dict(_PH, push_partials=True), dict(_PHF, push_partials=True)  # ... split-K partials pushed to their owner
_O1, _O2 = dict(owners=1), dict(owners=2)  # ... owned by the cluster's first block(s), the others exit once pushed


# Measured on one H200 (bf16, 2026-11-30, fourth session, copy ceilings 4.218-4.244 TB/s): sweeps of
# .scratch/cute3/variants{,2,4}.py (results: benchmarks/results/skinny_gemm_h200_cute3_sweep{1,2}.json.xz and _sweep4.json),
# back-to-back products in CUDA graphs with rotated weights; each configuration's time is the mean of sweeps 1
# and 2 that timed it, and entries marked "(sweep 4)" replaced the pick where A through the ring (a_ring) beat
# it by > 3% in sweep 4. (M bucket, N, K) -> the fastest configuration with static weight off, or None where
# cuBLAS was faster or within 3% with static weight off or on (the dispatch then leaves the product to cuBLAS).
# Entries marked "(c4 rN)" come from the fifth session's tuning run N (benchmarks/results/
# skinny_gemm_h200_cute4_sweepN.{json,log}: each point's candidates timed in two interleaved passes beside the pick
# of that time); "(c5 rN)" from the sixth session's run N, the same way (benchmarks/results/
# skinny_gemm_h200_cute5_sweepN.{json.xz,log}). "(wg rN)": the wgmma kernel in WG6's tuning run N of the seventh
# session (its bench logs), "(c6 r3)" cute6's run 3 (benchmarks/results/skinny_gemm_h200_cute6_sweep3.*), each against
# the op (k3::skinny_gemm's own CuTe / Triton / cuBLAS pick) or Triton and cuBLAS of the same run; cute6's run 4
# (skinny_gemm_h200_cute6_check.*, the benchmark on the final table) confirmed them. Shapes not listed use
# `heuristic`.
TABLE: dict[tuple[int, int, int], Optional[KernelConfig]] = {
    (1, 20480, 7168): SkinnyConfig(1, 1, 8, 2, stages=3, early=True, l2_kb=16),  # 70.86 µs vs cuBLAS 81.98
    (2, 20480, 7168): SkinnyConfig(1, 1, 8, 2, stages=3, early=True, l2_kb=16),  # 71.51 µs vs cuBLAS 79.44
    (4, 20480, 7168): SkinnyConfig(1, 1, 8, 2, stages=3, early=True, l2_kb=16),  # 71.99 µs vs cuBLAS 78.45
    (8, 20480, 7168): SkinnyConfig(1, 1, 8, 2, stages=3, early=True, l2_kb=16),  # 75.69 µs vs cuBLAS 82.37
    (16, 20480, 7168): None,  # cuBLAS 79.02 µs vs CuTe 87.62 (static 84.26)
    (1, 7168, 3584): WgmmaConfig(64, 128, 6, 1, **_H),  # 13.52 µs vs op 14.58 (wg r2)
    (2, 7168, 3584): WgmmaConfig(64, 128, 6, 1, **_H),  # 13.54 µs vs op 14.81 (wg r2)
    (4, 7168, 3584): WgmmaConfig(64, 128, 6, 1, **_H),  # 13.60 µs vs op 15.09 (wg r2)
    (8, 7168, 3584): WgmmaConfig(64, 128, 6, 1, **_H),  # 13.62 µs vs op 14.59 (Triton) (wg r2)
    (16, 7168, 3584): WgmmaConfig(64, 128, 6, 1, **_H),  # 13.51 µs vs op 14.43 (Triton) (wg r2)
    (1, 1536, 7168): SkinnyConfig(1, 1, 8, 2, stages=3, l2_kb=16, a_ring=True, a_l1=True),  # 7.15 µs vs 7.58 (c5 r4)
    (2, 1536, 7168): SkinnyConfig(1, 1, 8, 2, stages=3, l2_kb=16, a_ring=True, a_l1=True),  # 7.32 µs vs 7.81 (c5 r4)
    (1, 7168, 1536): SkinnyConfig(1, 1, 4, 4),  # 7.68 µs vs cuBLAS 8.29
    (2, 7168, 1536): SkinnyConfig(1, 1, 4, 4),  # 7.75 µs vs cuBLAS 8.35
    (4, 7168, 1536): SkinnyConfig(1, 1, 4, 4),  # 7.88 µs vs cuBLAS 8.41
    (8, 7168, 1536): WgmmaConfig(64, 64, 8, 1, **_H),  # 7.18 µs vs op 8.25 (wg r3)
    (16, 7168, 1536): WgmmaConfig(64, 64, 8, 1, **_H),  # 7.17 µs vs op 8.66 (wg r3)
    (1, 7168, 768): SkinnyConfig(1, 1, 4, 4, early=True, l2_kb=12),  # 4.46 µs vs cuBLAS 5.53
    (2, 7168, 768): SkinnyConfig(1, 1, 4, 4, early=True, l2_kb=12),  # 4.48 µs vs cuBLAS 5.53
    (4, 7168, 768): SkinnyConfig(1, 1, 4, 4, early=True, l2_kb=12),  # 4.51 µs vs cuBLAS 5.56
    (8, 7168, 768): SkinnyConfig(1, 1, 4, 4, early=True, l2_kb=12),  # 4.56 µs vs cuBLAS 5.62
    (16, 7168, 768): WgmmaConfig(64, 64, 6, 1, **_H),  # 4.78 µs vs op 5.01 (wg r3)
    (1, 2304, 1536): SkinnyConfig(1, 1, 8, 2, stages=3, early=True, l2_kb=24),  # 3.51 µs vs cuBLAS 5.40
    (2, 2304, 1536): SkinnyConfig(1, 1, 8, 2, stages=3, early=True, l2_kb=24),  # 3.64 µs vs cuBLAS 5.42
    (4, 2304, 1536): SkinnyConfig(1, 1, 8, 2, stages=3, early=True, l2_kb=24),  # 3.81 µs vs cuBLAS 5.43
    (8, 2304, 1536): SkinnyConfig(1, 1, 4, 4, early=True, l2_kb=24),  # 3.93 µs vs cuBLAS 5.44
    (16, 2304, 1536): SkinnyConfig(1, 1, 4, 4, early=True, l2_kb=24),  # 4.43 µs vs cuBLAS 5.51
    # The tenth session's push_partials (split-K partials sent to their owner block, no cluster barrier; run 6 of
    # .scratch/s10, benchmarks/results/skinny_gemm_h200_s10_push.log): µs against the entry it replaced, same run
    **{(m, 896, 7168): WgmmaConfig(64, 128, 6, 8, **_PPH) for m in (1, 2, 4, 8, 16)},  # 4.97 / 4.96 / 5.02 / 5.13 /
    #                                                                       5.18 vs 5.15 / 5.33 / 5.43 / 5.76 / 6.37
    **{(m, 1536, 7168): WgmmaConfig(64, 128, 4, 8, **_PPH) for m in (4, 8, 16)},  # 7.27 / 7.41 / 7.63 vs 7.57 / 7.62 /
    #                                                                              9.84
    # the eleventh session's owners (run 2 of .scratch/s11, benchmarks/results/skinny_gemm_h200_s11_owners.log): M4
    # 7.29 µs vs 7.69 with every block an owner (M16 8.17 vs 8.18)
    **{(m, 1536, 7168): WgmmaConfig(64, 128, 4, 8, **_PPH, **_O2) for m in (4, 8)},
    **{(m, 2112, 7168): WgmmaConfig(64, 128, 7, 2, **_PPH) for m in (1, 2, 4, 8, 16)},  # 9.14 / 9.18 / 9.21 / 9.22 /
    #                                                                       9.40 vs 9.29 / 9.54 / 10.66 / 11.55 / 10.86
    **{(m, 3584, 7168): WgmmaConfig(128, 64, 8, 4, **_PPH) for m in (1, 2, 4, 8, 16)},  # 13.94 / 13.98 / 14.05 /
    #                                                               14.39 / 14.42 vs 14.21 / 14.35 / 14.55 / 14.87 / 16.02
    **{(m, 4608, 7168): WgmmaConfig(128, 64, 10, 3, **_PPH) for m in (1, 2, 4, 8, 16)},  # 17.80 / 17.96 / 18.12 /
    #                                                               18.12 / 18.56 vs 18.15 / 18.32 / 18.67 / 18.98 / 20.32
}


# Where a proven-static weight (``static_weight=True``) measured faster with another configuration (same sweeps:
# > 2% in sweeps 1-2, > 3% in sweep 4).
TABLE_STATIC: dict[tuple[int, int, int], KernelConfig] = {
    # (2304x1536 M16: SkinnyConfig(1, 1, 8, 2, stages=3, early=True, l2_kb=24), 4.36 µs vs 4.59, c5 r2; replaced by
    # the register-tile entry at the end)
    # the wgmma kernel, static weight (wg r2-r3; c6 r3): where it differs from TABLE's entry
    # 7168x3584: the weight requested after the PDL wait (early_w=False) measured faster, 13.5-13.6 µs (with it
    # 14.0-14.1) vs op+st 13.88-14.42
    **{(m, 7168, 3584): WgmmaConfig(64, 128, 6, 1, early_w=False, **_H) for m in (1, 2, 4, 8)},
    # The tenth session's trigger_first (the next product may launch as our blocks start; static weight only), from
    # its tuning runs 1-4 (benchmarks/results/skinny_gemm_h200_s10_sweeps.log): µs, the mean of the runs that timed
    # the pick, against the entry it replaced in the same runs (those entries: the c4-c6 and wg picks of the earlier
    # sessions, or TABLE's)
    # (7168x768 M 1 / 2, a ring holding the block's whole 96 KB share, 112 blocks: 3.22 / 3.38 µs, r1-r4, with
    # WgmmaConfig(64, 64, 12, 1, **_HF) / (64, 128, 6, 1, **_PHF); 7168x1536 M 8 / 16: WgmmaConfig(64, 128, 6, 1,
    # **_HF), 6.43 / 6.44 µs vs 7.13, r3-r4; 2304x1536 M 1-8: SkinnyConfig(1, 1, 8, 2, stages=4, a_ring=True,
    # a_l1=True, trigger_first=True), 2.83 / 2.95 / 3.13 / 3.58 µs vs 3.44 / 3.36 / 3.77 / 3.88, r3-r4; the
    # register-tile entries at the end replace them all)
    (16, 7168, 3584): WgmmaConfig(64, 128, 6, 1, **_HF),   # 13.09 µs vs 13.51 (r2-r4)
    # push_partials with the trigger first (run 6, as TABLE's): µs against the entry it replaced, same run
    # (tenth session, scalar pushes: 4.36 / 4.46 / 4.51 / 4.66 / 5.00 vs 4.76 / 4.94 / 5.04 / 5.38 / 6.05); the
    # eleventh session's fragment pushes with owners (run 2 of .scratch/s11, benchmarks/results/
    # skinny_gemm_h200_s11_owners.log; µs against the same configuration with every block an owner, same run):
    # 4.27 / 4.34 / 4.38 / 4.41 / 4.79 vs 4.69 / 4.77 / 4.80 / 4.82 / 5.27; the twelfth session's push layout: M16 4.52
    # vs 4.71 (skinny_gemm_h200_s12.log, run 2)
    # (the router's entries are replaced by the thirteenth session's register tiles at the end)
    # (tenth: 6.13 / 6.10 / 6.24 / 6.39 / 7.05 vs 6.88 / 7.19 / 7.19 / 7.37 / 8.37); owners=2 at M 1 / 4: 6.04 / 6.16
    # vs 6.54 / 6.65; at M16 it measured 8.92 against 7.28 (its receive buffer leaves one block to an SM, not two)
    # (tenth: 12.74 / 12.90 / 13.34 / 13.46 / 13.56 vs 13.23 / 13.33 / 13.68 / 14.17 / 14.17); owners=2 at M 1 / 4 /
    # 16: 13.27 / 13.35 / 13.85 vs 13.60 / 13.75 / 14.21
    **{(m, 3584, 7168): WgmmaConfig(128, 64, 8, 4, **_PPHF, **_O2) for m in (1, 2, 4, 8, 16)},
    # (tenth: 16.28 / 16.58 / 16.79 / 16.99 / 17.41 vs 16.77 / 16.86 / 17.26 / 17.66 / 18.62); owners=1 at M 1 / 4 /
    # 16: 16.36 / 16.56 / 16.99 vs 16.74 / 17.17 / 17.44
    **{(m, 4608, 7168): WgmmaConfig(128, 64, 10, 3, **_PPHF, **_O1) for m in (1, 2, 4, 8, 16)},
    # run 7: with the partials pushed, split-K pays on the short-K shapes too (small blocks holding their whole
    # share, several to an SM), and 2112x7168 takes a cluster of 3 (99 blocks); µs against the picks of runs 1-6
    # (owners=1, s11 run 2: M 4 / 16 3.40 / 3.71 vs 3.41 / 3.76)
    # (7168x768 M 4 / 8 / 16: WgmmaConfig(64, 128, 3, 2, ..., push_partials, owners=1), 3.44 / 3.44 / 3.67 vs 3.57 /
    # 3.58 / 3.92; 7168x1536 M 1-4: WgmmaConfig(64, 128, 6, 2, **_PPHF), 6.00 / 5.95 / 6.17 vs 6.19 / 6.21 / 6.41,
    # where owners=1 measured 7.05 / 7.22 at M 1 / 4: its receive buffer left one block to an SM; all replaced below)
    # (tenth: 8.17 / 8.21 / 8.40 / 8.50 / 8.73 vs 8.78 / 8.80 / 8.95 / 8.78 / 8.99); owners=1 at M 1 / 4 / 16: 8.23 /
    # 8.35 / 8.77 vs 8.57 / 8.64 / 8.95
    **{(m, 2112, 7168): WgmmaConfig(64, 128, 7, 3, **_PPHF, **_O1) for m in (1, 2, 4, 8, 16)},
    # The thirteenth session's register tiles (``reg_stages``): a block's first R weight tiles go to registers before
    # the PDL wait and their slots take the rest of its share, so the block holds its whole share in ~60-110 KB of
    # shared memory and two fit an SM: the next product's blocks then stream their weight beside ours while ours
    # finish (.scratch/s13 runs 1-4, benchmarks/results/skinny_gemm_h200_s13.log; µs, the mean of the runs that
    # timed the pick, against the entry above it replaced, same runs)
    **{(m, 896, 7168): WgmmaConfig(64, 128, 3, 8, reg_stages=4, **_PPHF, owners=4) for m in (1, 2, 4, 8)},
    #                                                   3.39 / 3.45 / 3.45 / 3.56 vs 4.14 / 4.18 / 4.21 / 4.32
    (16, 896, 7168): WgmmaConfig(64, 128, 4, 8, reg_stages=3, **_PPHF, **_O2),   # 3.84 vs 4.48
    (1, 1536, 7168): WgmmaConfig(64, 128, 3, 8, reg_stages=4, **_PPHF, **_O2),   # 5.57 vs 5.97
    **{(m, 1536, 7168): WgmmaConfig(64, 128, 4, 8, reg_stages=3, **_PPHF, **_O2) for m in (2, 4)},  # 5.51 / 5.58
    #                                                                                                vs 5.96 / 5.99
    (8, 1536, 7168): WgmmaConfig(64, 128, 3, 8, reg_stages=4, **_PPHF, **_O2),   # 5.61 vs 6.12
    (16, 1536, 7168): WgmmaConfig(64, 128, 4, 8, reg_stages=3, **_PPHF, **_O2),  # 5.96 vs 7.00
    **{(m, 7168, 1536): WgmmaConfig(64, 128, 2, 2, reg_stages=4, **_PPHF) for m in (1, 2, 8)},  # M 1 / 8: 5.59 /
    #                                                                                            5.59 vs 6.05 / 6.38
    (4, 7168, 1536): WgmmaConfig(64, 128, 2, 2, reg_stages=4, **_PPHF, **_O1),   # 5.62 vs 6.12
    (16, 7168, 1536): WgmmaConfig(64, 128, 3, 2, reg_stages=3, **_PPHF),         # 6.00 vs 6.50
    **{(m, 7168, 768): WgmmaConfig(64, 64, 3, 2, reg_stages=3, **_PPHF, **_O1) for m in (1, 2, 16)},  # 2.98 / 2.99
    #                                                                                    / 3.20 vs 3.17 / 3.18 / 3.54
    **{(m, 7168, 768): WgmmaConfig(64, 128, 2, 2, reg_stages=1, **_PPHF, **_O1) for m in (4, 8)},  # 3.02 / 2.93
    #                                                                                               vs 3.41 / 3.39
    # 2304x1536 (7 MB) leaves the mma.sync kernel with a static weight (runs 3-4; µs against its entries above)
    **{(m, 2304, 1536): WgmmaConfig(64, 64, 3, 4, reg_stages=3, **_PPHF, **_O2) for m in (1, 2, 4, 8)},  # 2.41 /
    #                                                                   2.41 / 2.46 / 2.41 vs 2.78 / 2.95 / 3.11 / 3.53
    (16, 2304, 1536): WgmmaConfig(64, 128, 3, 2, reg_stages=3, **_PPHF),   # 2.62 vs 4.35
}


# Where the Triton kernel (``triton.py``, its own defaults) beat the configuration above by more than 3% in the
# same run (H200, cute4's run 3: benchmarks/results/skinny_gemm_h200_cute4_sweep3.*, µs Triton vs CuTe, static off / on):
# 7168x3584 M8 14.65 vs 15.79 / 14.70 vs 15.76; 20480x7168 M 1/2/4/8
# 69.1/68.9/69.6/71.0 vs 70.6/71.1/72.2/76.2 (static 69.1/69.0/70.3/70.3 vs 70.0/70.7/72.5/75.9). Elsewhere the CuTe
# pick was ahead or within 3% (7168x3584 M 1-4: 14.6-14.9 vs Triton 14.2-14.5, static 13.8-14.2 vs 14.3-14.6).
# 4608x7168 M16 (c5 r2, r3): Triton 20.1-20.3 vs CuTe 20.9-21.1 (static 20.7-21.0), cuBLAS 22.0-22.1;
# 7168x3584 M8 (c5 r4): Triton 15.0 vs CuTe 15.7 (static 15.3).
# The dispatch then takes Triton (``cute.profitable``).
# 7168x3584 M8 and 4608x7168 M16 left it in the seventh session: the wgmma kernel's entries beat or tie Triton there.
TRITON_AHEAD: frozenset[tuple[int, int, int]] = frozenset([(m, 20480, 7168) for m in (1, 2, 4, 8)])

def m_bucket(m: int) -> int:
    """The M the table is keyed by (the kernel itself is compiled per exact M)."""
    for b in (1, 2, 4, 8, 16):
        if m <= b:
            return b
    raise ValueError(f"M={m} > 16 is not a skinny GEMM")


def heuristic(m: int, n: int, k: int, static_weight: bool = False) -> SkinnyConfig:
    """A configuration for a shape the table does not list, read off the H200 sweeps.

    One 8-row group per warp. Long K: the weight through a cp.async ring (8 K-warps × 2 steps × 3
    stages) with the first 2 KB of each row pulled into L2 before the PDL wait; when N is small, split
    over a cluster of 2 blocks (few row blocks must still fill the SMs) that prefetch their whole share
    into L2 and let the next kernel in early. Short K: straight to registers, 4 K-warps × 4 steps; a
    small weight (≤ 12 MB) is prefetched whole into L2 with the early trigger, so the next product's
    weight streams while this one finishes. K-warps are halved while a warp would get no chunk.
    ``static_weight`` does not change the pick (the sweeps found the same winners, or near).
    """
    row_kb = k * 2 * 8 // 1024  # one 8-row group's whole K, in KB
    split_k, early, l2_kb = 1, False, 0
    if k >= 4096:
        warps_k, unroll, stages, l2_kb = 8, 2, 3, 16
        if n <= 1024:
            split_k, early, l2_kb = 2, True, row_kb // 2
    else:
        warps_k, unroll, stages = 4, 4, 1
        if n * k * 2 <= 12e6:
            early, l2_kb = True, row_kb
    chunks = k // (K_STEP * unroll)
    while warps_k > 1 and chunks < warps_k * split_k:
        warps_k //= 2
    return SkinnyConfig(row_groups=1, warps_n=1, warps_k=warps_k, unroll=unroll, stages=stages, split_k=split_k,
                        early=early, l2_kb=l2_kb)


@functools.lru_cache(maxsize=4096)   # choose() runs it on every dispatch of an unlisted static shape: ~9 µs a call
def register_tile_heuristic(m: int, n: int, k: int, sms: int = 132) -> Optional[WgmmaConfig]:
    """(static weight) The wgmma kernel with register tiles for a shape the tables do not list, where a block can
    hold its whole K share with two blocks to an SM; None elsewhere. Read off the thirteenth session's picks:

    - row tiles of 64; the most split-K blocks (a cluster of 1, 2, 4 or 8) that keep at most 1.7 blocks an SM (2112x7168's
      264 blocks, two on every SM, left the next product nowhere to go and lost) and a share of at least 3 tiles
      of 128, at most 8;
    - a share of 5-8 tiles of 128: R = share - 2 register tiles, at most 4 (3 above M = 8: four need 176 registers
      there, too many for two blocks); a share of 3-4: tiles of 64, half of them in registers;
    - the partials pushed to 2 owners in clusters of 4-8 (every block owns in clusters of 2-3);
    - only weights of 4 MB or more (nothing smaller was measured), and only where two blocks fit an SM.

    On eight shapes no table lists (.scratch/s13 run 6, benchmarks/results/skinny_gemm_h200_s13.log; 384-7168 x
    1024-7168, 4-28 MB) it ran 1.3-2.1x faster than ``heuristic``'s pick and x1.4-3.3 of cuBLAS at M 1 / 8 / 16; it
    gives nothing for 7168x2048 at M16 (two blocks do not fit), where ``heuristic``'s pick ran x0.95 of cuBLAS."""
    if n * k * 2 < 4e6:
        return None
    rows, kt = -(-n // 64), -(-k // 128)
    splits = [s for s in (1, 2, 4, 8) if rows * s <= 1.7 * sms and 3 <= -(-kt // s) <= 8]
    if not splits:
        return None
    split = max(splits)
    share = -(-kt // split)
    if share >= 5:
        bk, reg = 128, min(share - 2, 4 if m <= 8 else 3)
    else:
        bk, share = 64, -(-(-(-k // 64)) // split)
        reg = share // 2
    cfg = WgmmaConfig(64, bk, share - reg, split, producer_warp=True, evict_hints=True, trigger_first=True,
                      push_partials=split > 1, owners=2 if split >= 4 else 0, reg_stages=reg)
    two_fit = cfg.smem_bytes(m) + 1024 <= 228 * 1024 // 2   # 1 KB of every block's shared memory is the system's
    return cfg if cfg.invalid() is None and cfg.share_fits(k) and two_fit else None


def cublas_preferred(m: int, n: int, k: int) -> bool:
    """True where the H200 measurements found cuBLAS faster than (or within 3% of) the CuTe kernel."""
    return choose(m, n, k) is None


def choose(m: int, n: int, k: int, static_weight: bool = False) -> Optional[KernelConfig]:
    """The configuration for this shape; None when cuBLAS is the better choice (measured).

    Whether cuBLAS wins is decided without ``static_weight`` (the op's dispatch does not see it); where
    the weight is proven static, ``TABLE_STATIC`` may name a different configuration, and a shape the tables do not
    list takes ``register_tile_heuristic``'s where it gives one."""
    key = (m_bucket(m), n, k)
    cfg = TABLE[key] if key in TABLE else heuristic(m, n, k, static_weight)
    if cfg is not None and static_weight:
        listed = key in TABLE or key in TABLE_STATIC
        cfg = TABLE_STATIC.get(key) or (None if listed else register_tile_heuristic(m, n, k)) or cfg
    return cfg
