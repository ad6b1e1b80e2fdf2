"""Work division of the CuTe skinny GEMM, per (M, N, K): a measured table and a heuristic.

The kernel (``cute.py``) computes ``C[M, N] = A[M, K] · W[N, K]ᵀ`` with one warp-level tensor-core
tile of 16 (M, padded) × 8 (weight rows) × 32 (K, two m16n8k16 steps) per step. A thread block is
``warps_n × warps_k`` warps: ``warps_n`` split the block's weight rows, ``warps_k`` split K inside
the block (their partial sums meet in shared memory), so no global workspace and no second kernel
are needed. ``split_k > 1`` also splits K across a thread-block cluster of that many blocks (more
blocks and bytes in flight when N gives few row blocks); their partial sums meet through distributed
shared memory, again with no workspace, counter or second kernel (CUDA-graph safe by construction). Each warp owns ``row_groups`` groups of 8 weight rows and handles ``unroll`` K-steps per
chunk. With ``stages == 1`` the weight goes straight to registers (128-bit loads); with ``stages > 1``
it is streamed by cp.async through a per-warp shared-memory ring, which keeps more bytes in flight
(ptxas interleaves register loads with the MMAs to save registers). On the dispatch's path (no weight
copy before the PDL wait) the H200 sweep picked the ring for K = 7168 and registers (4 K-warps × 4
steps) for K ≤ 3584 at N = 7168.

Nothing here imports cutlass: the dispatch reads this table on any machine.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

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

    def __post_init__(self):
        if self.row_groups < 1 or self.warps_n < 1 or self.warps_k < 1 or self.unroll < 1:
            raise ValueError(f"bad config {self}")
        if self.stages < 1 or self.split_k not in (1, 2, 4, 8):  # a portable cluster holds ≤ 8 blocks
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

    def smem_bytes(self) -> int:
        """fp32 partial sums of every K-warp [warps_k, block_n, 16], plus the cp.async ring."""
        ring = 0 if self.stages == 1 else self.stages * self.row_groups * self.unroll * 512 * self.warps_n * self.warps_k
        return 4 * self.warps_k * self.block_n * 16 + ring + 128  # + alignment slack

    def tag(self) -> str:
        return (f"rg{self.row_groups}-wn{self.warps_n}-wk{self.warps_k}-u{self.unroll}"
                + ("" if self.prefetch else "-nopf") + (f"-s{self.stages}" if self.stages > 1 else "")
                + (f"-c{self.split_k}" if self.split_k > 1 else ""))


# Measured on one H200 (bf16, 2026-11-30, copy ceiling 4.222 TB/s): ``benchmarks/skinny_gemm.py --sweep
# --no-triton`` (results: benchmarks/results/skinny_gemm_h200_sweep2.json), timing the path the dispatch
# runs (``static_weight=False``: only an L2 prefetch of the weight before the PDL wait).
# (M bucket, N, K) -> the fastest configuration, or None where cuBLAS was faster or within 3% (the
# dispatch then leaves the product to cuBLAS). Shapes not listed use `heuristic`.
TABLE: dict[tuple[int, int, int], Optional[SkinnyConfig]] = {
    (1, 4608, 7168): SkinnyConfig(1, 1, 8, 2, stages=3),  # 18.80 µs vs cuBLAS 21.44
    (2, 4608, 7168): SkinnyConfig(1, 1, 8, 2, stages=3),  # 18.02 µs vs cuBLAS 21.37
    (4, 4608, 7168): SkinnyConfig(1, 1, 8, 2, stages=3),  # 18.24 µs vs cuBLAS 21.62
    (8, 4608, 7168): SkinnyConfig(1, 1, 8, 2, stages=3),  # 19.08 µs vs cuBLAS 21.74
    (16, 4608, 7168): None,  # cuBLAS 21.53 µs <= CuTe 25.90 µs
    (1, 1536, 7168): SkinnyConfig(1, 1, 8, 2, stages=3),  # 7.90 µs vs cuBLAS 10.84
    (2, 1536, 7168): SkinnyConfig(1, 1, 16, 1, stages=4),  # 8.09 µs vs cuBLAS 11.02
    (4, 1536, 7168): SkinnyConfig(1, 1, 16, 1, stages=4, split_k=2),  # 9.58 µs vs cuBLAS 10.92
    (8, 1536, 7168): SkinnyConfig(1, 1, 8, 2, stages=3),  # 10.31 µs vs cuBLAS 10.91
    (16, 1536, 7168): None,  # CuTe 10.97 µs is within 3% of cuBLAS 11.12 µs
    (1, 2112, 7168): SkinnyConfig(1, 1, 8, 2, stages=3),  # 9.35 µs vs cuBLAS 13.24
    (2, 2112, 7168): SkinnyConfig(1, 1, 16, 1, stages=4),  # 10.06 µs vs cuBLAS 13.31
    (4, 2112, 7168): SkinnyConfig(1, 1, 8, 2, stages=3),  # 10.64 µs vs cuBLAS 13.55
    (8, 2112, 7168): SkinnyConfig(1, 1, 8, 2, stages=3),  # 11.44 µs vs cuBLAS 13.36
    (16, 2112, 7168): SkinnyConfig(1, 1, 8, 2, stages=3, split_k=2),  # 12.06 µs vs cuBLAS 13.75
    (1, 2304, 1536): SkinnyConfig(1, 1, 8, 4),  # 4.20 µs vs cuBLAS 5.39
    (2, 2304, 1536): SkinnyConfig(1, 1, 8, 2, stages=3),  # 4.19 µs vs cuBLAS 5.39
    (4, 2304, 1536): SkinnyConfig(1, 1, 8, 2, stages=3),  # 4.25 µs vs cuBLAS 5.40
    (8, 2304, 1536): SkinnyConfig(1, 1, 8, 2, stages=3),  # 4.55 µs vs cuBLAS 5.43
    (16, 2304, 1536): SkinnyConfig(1, 1, 8, 4),  # 4.50 µs vs cuBLAS 5.47
    (1, 896, 7168): SkinnyConfig(1, 1, 8, 2, stages=3),  # 6.73 µs vs cuBLAS 8.98
    (2, 896, 7168): SkinnyConfig(1, 1, 16, 1, stages=4),  # 6.66 µs vs cuBLAS 8.89
    (4, 896, 7168): SkinnyConfig(1, 1, 8, 2, stages=3, split_k=2),  # 6.81 µs vs cuBLAS 9.03
    (8, 896, 7168): SkinnyConfig(1, 1, 8, 2, stages=4, split_k=2),  # 7.59 µs vs cuBLAS 8.91
    (16, 896, 7168): SkinnyConfig(1, 1, 16, 1, stages=4, split_k=2),  # 7.76 µs vs cuBLAS 9.15
    (1, 3584, 7168): SkinnyConfig(1, 1, 8, 2, stages=3),  # 14.36 µs vs cuBLAS 17.35
    (2, 3584, 7168): SkinnyConfig(1, 1, 8, 2, stages=3),  # 14.35 µs vs cuBLAS 17.39
    (4, 3584, 7168): SkinnyConfig(1, 1, 8, 2, stages=3),  # 14.78 µs vs cuBLAS 17.51
    (8, 3584, 7168): SkinnyConfig(1, 1, 8, 2, stages=3),  # 15.43 µs vs cuBLAS 17.59
    (16, 3584, 7168): None,  # cuBLAS 17.82 µs <= CuTe 18.28 µs
    (1, 7168, 3584): SkinnyConfig(1, 1, 4, 4),  # 14.83 µs vs cuBLAS 17.77
    (2, 7168, 3584): SkinnyConfig(1, 1, 4, 4),  # 14.97 µs vs cuBLAS 17.55
    (4, 7168, 3584): SkinnyConfig(1, 1, 4, 4),  # 15.26 µs vs cuBLAS 18.41
    (8, 7168, 3584): SkinnyConfig(1, 1, 4, 4),  # 15.54 µs vs cuBLAS 17.79
    (16, 7168, 3584): None,  # cuBLAS 15.07 µs <= CuTe 16.80 µs
    (1, 7168, 1536): SkinnyConfig(1, 1, 4, 4),  # 7.63 µs vs cuBLAS 8.25
    (2, 7168, 1536): SkinnyConfig(1, 1, 4, 4),  # 7.71 µs vs cuBLAS 8.15
    (4, 7168, 1536): SkinnyConfig(1, 1, 4, 4),  # 7.79 µs vs cuBLAS 8.20
    (8, 7168, 1536): SkinnyConfig(1, 1, 4, 4),  # 7.95 µs vs cuBLAS 8.25
    (16, 7168, 1536): None,  # cuBLAS 8.38 µs <= CuTe 8.83 µs
    (1, 7168, 768): SkinnyConfig(1, 1, 4, 4),  # 5.09 µs vs cuBLAS 5.47
    (2, 7168, 768): SkinnyConfig(1, 1, 4, 4),  # 5.13 µs vs cuBLAS 5.46
    (4, 7168, 768): SkinnyConfig(1, 1, 4, 4),  # 5.19 µs vs cuBLAS 5.48
    (8, 7168, 768): SkinnyConfig(1, 1, 4, 4),  # 5.02 µs vs cuBLAS 5.56
    (16, 7168, 768): SkinnyConfig(1, 1, 4, 4),  # 5.34 µs vs cuBLAS 5.58
    (1, 20480, 7168): SkinnyConfig(1, 1, 8, 2, stages=3),  # 69.48 µs vs cuBLAS 78.81
    (2, 20480, 7168): SkinnyConfig(1, 1, 8, 2, stages=3),  # 71.01 µs vs cuBLAS 77.03
    (4, 20480, 7168): SkinnyConfig(1, 1, 8, 2, stages=3),  # 71.93 µs vs cuBLAS 76.64
    (8, 20480, 7168): SkinnyConfig(1, 1, 8, 2, stages=3),  # 74.26 µs vs cuBLAS 79.14
    (16, 20480, 7168): None,  # cuBLAS 75.24 µs <= CuTe 84.77 µs
}


def m_bucket(m: int) -> int:
    """The M the table is keyed by (the kernel itself is compiled per exact M)."""
    for b in (1, 2, 4, 8, 16):
        if m <= b:
            return b
    raise ValueError(f"M={m} > 16 is not a skinny GEMM")


def heuristic(m: int, n: int, k: int) -> SkinnyConfig:
    """A configuration for a shape the table does not list, read off the H200 sweep.

    One 8-row group per warp. Long K: the weight through a cp.async ring (8 K-warps × 2 steps × 3
    stages), split over a cluster of 2 blocks when N is small (few row blocks must still fill the SMs
    and keep enough bytes in flight). Short K: straight to registers, 4 K-warps × 4 steps. K-warps are
    halved while a warp would get no chunk.
    """
    split_k = 1
    if k >= 4096:
        warps_k, unroll, stages = 8, 2, 3
        if n <= 1024:
            split_k = 2
    else:
        warps_k, unroll, stages = 4, 4, 1
    chunks = k // (K_STEP * unroll)
    while warps_k > 1 and chunks < warps_k * split_k:
        warps_k //= 2
    return SkinnyConfig(row_groups=1, warps_n=1, warps_k=warps_k, unroll=unroll, stages=stages, split_k=split_k)


def cublas_preferred(m: int, n: int, k: int) -> bool:
    """True where the H200 measurements found cuBLAS faster than (or within 3% of) the CuTe kernel."""
    return choose(m, n, k) is None


def choose(m: int, n: int, k: int) -> Optional[SkinnyConfig]:
    """The configuration for this shape; None when cuBLAS is the better choice (measured)."""
    key = (m_bucket(m), n, k)
    if key in TABLE:
        return TABLE[key]
    return heuristic(m, n, k)
