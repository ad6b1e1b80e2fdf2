"""The Triton skinny GEMM's compile-time knobs (``TritonConfig``) and its heuristic for a shape no table lists.

Read off the H200 sweeps (``docs/tuning/skinny_gemm.md``); the residency arithmetic is sm_90's. Nothing here
imports Triton: the dispatch reads it on any machine.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

import torch

from k3compile.backends import stages_within

MAX_M = 64          # beyond this the kernel's whole-M register tile spills; callers use cuBLAS there
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclass(frozen=True, kw_only=True)
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


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    return 0 if n <= 0 else 1 << (n - 1).bit_length()   # as triton.next_power_of_2


# Residency on sm_90: 228 KB of shared memory per SM, 1 KB of it reserved per resident program; shared memory is
# what bounds these programs (40-72 registers at 2 or 4 warps leave room for 14+).
SMEM_PER_SM = 228 * 1024
SMEM_RESERVED_PER_PROGRAM = 1024
IN_FLIGHT_PER_SM = 48 * 1024   # weight bytes in flight per SM that kept HBM streaming (82-84% of the copy ceiling)
MAX_STAGES = 8
MIN_PER_SM = (1.5, 2.5)        # programs per SM below which a grid streamed worse: unsplit, split
# Split grids: the last split polls the others' partials (no counter, no fence) and the next product is let in
# after our K loop, prefetching its first 2 weight lines a row into L2: 0-1.5 points each, 1-4 points together.
POLLED_TAIL = dict(poll=True, early_trigger=False, prefetch_lines=2)
# One row: CUDA-core products over 8-column tiles, a and w by TMA, no K split (the tensor-core grid's split-K
# reduction cost 8-9% at 3584 / 4608 x 7168, M = 1). block_m and num_stages are set per product.
FMA_ROW = TritonConfig(block_m=1, block_n=8, block_k=256, split_k=1, num_warps=4, num_stages=4, fma=True, tma=True,
                       a_tma=True, pdl=True, prefetch_lines=0, early_trigger=True)
FMA_ROWS_MAX_M = 1             # two rows run the split grid with POLLED_TAIL 1.2-2.2 points faster
FMA_ROW_RESIDENT = 12          # FMA_ROW programs one H200 SM holds at M = 1 (40 registers x 128 threads)
FMA_ROW_MIN_PER_SM = 3         # measured at 3.4 and 4.4 programs per SM; thinner grids keep the tensor-core pick


def resident_per_sm(config: TritonConfig, element_size: int = 2) -> int:
    """Programs of ``config`` one sm_90 SM holds at once: Triton's pipeline keeps ``num_stages - 1``
    [BLOCK_M + BLOCK_N, BLOCK_K] tiles in shared memory (the driver's occupancy calculator agrees: 9 / 6 / 4
    programs at 3 / 4 / 5 stages of 16+32 x 128 bf16)."""
    ring = ((config.num_stages or 3) - 1) * (config.block_m + config.block_n) * config.block_k * element_size
    return SMEM_PER_SM // (ring + 16 + SMEM_RESERVED_PER_PROGRAM)


def heuristic(m: int, n: int, k: int, sm_count: int) -> TritonConfig:
    """The configuration for (M, N, K) on a GPU of ``sm_count`` SMs; 0 means no GPU (the interpreter): the whole M in
    one tensor-core tile, no split, fewer, larger programs."""
    if not sm_count:
        block_m = max(16, next_power_of_2(m))
        block_k = min(128 if block_m <= 16 else 64, max(16, next_power_of_2(k)))
        return TritonConfig(block_m=block_m, block_n=max(16, min(64, next_power_of_2(n))), block_k=block_k,
                            split_k=1)
    cfg = _dot_heuristic(m, n, k, sm_count)
    programs = cdiv(n, FMA_ROW.block_n)
    if m <= FMA_ROWS_MAX_M and cfg.tma and cfg.split_k > 1 and programs >= FMA_ROW_MIN_PER_SM * sm_count and \
            2 * cdiv(programs, sm_count) <= FMA_ROW_RESIDENT:
        tile_bytes = FMA_ROW.block_n * FMA_ROW.block_k * 2
        stages = cdiv(IN_FLIGHT_PER_SM, int(programs / sm_count * tile_bytes)) + 1
        return dataclasses.replace(FMA_ROW, block_m=next_power_of_2(m), num_stages=max(3, min(stages, 5)))
    return cfg


def _dot_heuristic(m: int, n: int, k: int, sm_count: int) -> TritonConfig:
    """32-column tiles, partials summed in one launch, TMA weight tiles for products of at least 2048 x 2048; without
    TMA or past 16 rows, K split until the grid holds ~4 programs per SM, never below 7 K blocks per split.

    With TMA and M <= 16 (the decode products): PDL with the next product let in right after our wait, in the grid
    that costs least: the fewest K splits such that
    - there are ``MIN_PER_SM`` programs per SM (unsplit / split),
    - our programs and the next product's all fit on the SMs together (2 x per-SM count <= residency: the early
      trigger then overlaps; past that it lost 20-35%),
    - the pipeline depth puts ``IN_FLIGHT_PER_SM`` of weight tiles in flight per SM.
    A split grid then runs ``POLLED_TAIL``. Where no split fits, the plain 4-per-SM split at the default depth, the
    trigger after the K loop unless both grids fit. Two warps per program: 1-3% faster than four."""
    block_m = max(16, next_power_of_2(m))
    block_k = 128 if block_m <= 16 else 64
    block_n = 32
    n_tiles = cdiv(n, block_n)
    k_blocks = cdiv(k, block_k)
    tma = n >= 2048 and k >= 2048
    split_4 = max(1, min(round(4 * sm_count / n_tiles), k_blocks // 7, 32))
    if not (tma and block_m == 16):
        return TritonConfig(block_m=block_m, block_n=block_n, block_k=block_k, split_k=split_4, one_launch=True,
                            tma=tma)
    tile_bytes = block_n * block_k * 2
    for split_k in range(1, min(k_blocks // 7, 32) + 1):
        per_sm = n_tiles * split_k / sm_count
        if cdiv(k_blocks, cdiv(k_blocks, split_k)) != split_k or per_sm < MIN_PER_SM[split_k > 1]:
            continue  # not a split the kernel runs (K slices are whole blocks), or too few programs
        stages = max(3, min(MAX_STAGES, cdiv(IN_FLIGHT_PER_SM, int(per_sm * tile_bytes)) + 1))
        stages = min(stages, k_blocks // split_k)
        cfg = TritonConfig(block_m=block_m, block_n=block_n, block_k=block_k, split_k=split_k, num_warps=2,
                           num_stages=stages, one_launch=True, tma=True, pdl=True, prefetch_lines=0,
                           early_trigger=True)
        if 2 * cdiv(n_tiles * split_k, sm_count) <= resident_per_sm(cfg):
            return dataclasses.replace(cfg, **POLLED_TAIL) if split_k > 1 else cfg
    split_k = cdiv(k_blocks, cdiv(k_blocks, split_4))
    cfg = TritonConfig(block_m=block_m, block_n=block_n, block_k=block_k, split_k=split_k, one_launch=True, tma=True,
                       pdl=True, prefetch_lines=0)
    return dataclasses.replace(cfg, early_trigger=2 * cdiv(n_tiles * split_k, sm_count) <= resident_per_sm(cfg))


def for_dtype(cfg: TritonConfig, element_size: int) -> TritonConfig:
    """``cfg`` for operands of ``element_size`` bytes: the pipeline depths and early triggers are sized for 16-bit
    tiles; fp32 tiles take twice the shared memory, so fewer programs stay resident: the default depth, and the next
    product let in only after the K loop."""
    if cfg.early_trigger and element_size > 2:
        return dataclasses.replace(cfg, early_trigger=False, num_stages=None)
    return cfg


def fit_local_memory(cfg: TritonConfig, element_size: int, budget: int) -> TritonConfig:
    """``cfg`` with its pipeline no deeper than ``budget`` bytes of shared memory hold (``backends.stages_within``:
    [BLOCK_M + BLOCK_N, BLOCK_K] tiles a stage; the target's default depth counted as 3): gfx9's 64 KiB of LDS takes
    two fp32 stages of the 2048 x 2048+ grid, not the three (72 KiB) AMD's compiler would otherwise refuse at launch."""
    stages = cfg.num_stages or 3
    fit = stages_within(budget, (cfg.block_m + cfg.block_n) * cfg.block_k * element_size, 0, stages)
    return cfg if fit == stages else dataclasses.replace(cfg, num_stages=fit)


def supports(a, w, bias=None, residual=None, out_dtype=None) -> Optional[str]:
    """None if the kernel takes these operands (any strides and offsets), else why not. ``out_dtype``: None (a's
    dtype) or float32 (the fp32 sums of 16-bit operands; residual then fp32)."""
    if a.dim() != 2 or w.dim() != 2:
        return f"needs 2-D a and w, got {a.dim()}-D and {w.dim()}-D"
    if a.dtype not in SUPPORTED_DTYPES:
        return f"dtype {a.dtype} not in {SUPPORTED_DTYPES}"
    out = out_dtype or a.dtype
    if out not in (a.dtype, torch.float32):
        return f"output dtype {out} for {a.dtype} operands"
    for name, t, dtype in (("w", w, a.dtype), ("bias", bias, a.dtype), ("residual", residual, out)):
        if t is not None and t.dtype != dtype:
            return f"{name} dtype {t.dtype} != {dtype}"
    if a.shape[0] > MAX_M:
        return f"M={a.shape[0]} > {MAX_M}"
    return None
