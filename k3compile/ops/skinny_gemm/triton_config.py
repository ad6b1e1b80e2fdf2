"""Compile-time knobs of the Triton skinny GEMM (``triton.py``) and how they are chosen per (M, N, K): the
rules read off the H200 measurements (``_dot_heuristic``, ``FMA_ROW``, ``POLLED_TAIL``), a table of measured
exceptions, and the residency arithmetic both rest on. Nothing here launches a kernel."""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Optional

import triton


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
