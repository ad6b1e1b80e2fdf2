"""Work division of the CuTe skinny GEMM, per (M, N, K): a measured table and a heuristic.

The kernel (``cute.py``) computes ``C[M, N] = A[M, K] · W[N, K]ᵀ`` with one warp-level tensor-core
tile of 16 (M, padded) × 8 (weight rows) × 32 (K, two m16n8k16 steps) per step. A thread block is
``warps_n × warps_k`` warps: ``warps_n`` split the block's weight rows, ``warps_k`` split K inside
the block (their partial sums meet in shared memory), so no global workspace and no second kernel
are needed. Each warp owns ``row_groups`` groups of 8 weight rows and handles ``unroll`` K-steps per
chunk. With ``stages == 1`` the weight goes straight to registers (128-bit loads); with ``stages > 1``
it is streamed by cp.async through a per-warp shared-memory ring, which keeps far more bytes in flight
(the H200 sweep's winners all use it: ptxas interleaves register loads with the MMAs to save registers).

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

    def __post_init__(self):
        if self.row_groups < 1 or self.warps_n < 1 or self.warps_k < 1 or self.unroll < 1:
            raise ValueError(f"bad config {self}")
        if self.stages < 1:
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
                + ("" if self.prefetch else "-nopf") + (f"-s{self.stages}" if self.stages > 1 else ""))


# Measured on one H200 (benchmarks/skinny_gemm.py --sweep, bf16, 2026-11-30, copy ceiling 4.245 TB/s):
# (M bucket, N, K) -> the fastest configuration, or None where cuBLAS was faster or within 3% (the
# dispatch then leaves the product to cuBLAS). Shapes not listed use `heuristic`.
TABLE: dict[tuple[int, int, int], Optional[SkinnyConfig]] = {
    (1, 4608, 7168): SkinnyConfig(1, 1, 8, 2, stages=3),  # 18.01 µs vs cuBLAS 21.49
    (2, 4608, 7168): SkinnyConfig(1, 1, 8, 2, stages=3),  # 18.16 µs vs cuBLAS 21.48
    (4, 4608, 7168): SkinnyConfig(1, 1, 8, 2, stages=3),  # 18.05 µs vs cuBLAS 21.76
    (8, 4608, 7168): SkinnyConfig(1, 1, 8, 2, stages=3),  # 18.96 µs vs cuBLAS 21.93
    (16, 4608, 7168): None,  # CuTe 21.34 µs is within 3% of cuBLAS 21.90 µs
    (1, 1536, 7168): SkinnyConfig(1, 1, 8, 2, stages=3),  # 7.66 µs vs cuBLAS 10.76
    (2, 1536, 7168): SkinnyConfig(1, 1, 8, 2, stages=3),  # 7.79 µs vs cuBLAS 11.00
    (4, 1536, 7168): SkinnyConfig(1, 1, 8, 2, stages=3),  # 8.19 µs vs cuBLAS 10.79
    (8, 1536, 7168): SkinnyConfig(1, 1, 8, 2, stages=3),  # 8.36 µs vs cuBLAS 10.87
    (16, 1536, 7168): None,  # cuBLAS 11.05 µs <= CuTe 11.17 µs
    (1, 2112, 7168): SkinnyConfig(1, 1, 8, 2, stages=3),  # 8.98 µs vs cuBLAS 13.85
    (2, 2112, 7168): SkinnyConfig(1, 1, 8, 2, stages=3),  # 9.20 µs vs cuBLAS 13.89
    (4, 2112, 7168): SkinnyConfig(1, 1, 8, 2, stages=3),  # 9.50 µs vs cuBLAS 13.76
    (8, 2112, 7168): SkinnyConfig(1, 1, 8, 2, stages=3),  # 9.85 µs vs cuBLAS 13.84
    (16, 2112, 7168): SkinnyConfig(1, 1, 8, 2, stages=3),  # 12.72 µs vs cuBLAS 14.12
    (1, 2304, 1536): SkinnyConfig(1, 1, 4, 2, stages=4),  # 3.72 µs vs cuBLAS 5.40
    (2, 2304, 1536): SkinnyConfig(1, 1, 8, 2, stages=3),  # 3.97 µs vs cuBLAS 5.41
    (4, 2304, 1536): SkinnyConfig(1, 1, 8, 2, stages=3),  # 4.02 µs vs cuBLAS 5.43
    (8, 2304, 1536): SkinnyConfig(1, 1, 8, 2, stages=3),  # 4.18 µs vs cuBLAS 5.44
    (16, 2304, 1536): SkinnyConfig(1, 1, 4, 2, stages=4),  # 4.78 µs vs cuBLAS 5.47
    (1, 896, 7168): SkinnyConfig(1, 1, 16, 1, stages=4),  # 6.36 µs vs cuBLAS 9.13
    (2, 896, 7168): SkinnyConfig(1, 1, 16, 1, stages=4),  # 6.43 µs vs cuBLAS 9.00
    (4, 896, 7168): SkinnyConfig(1, 1, 16, 1, stages=4),  # 6.55 µs vs cuBLAS 9.06
    (8, 896, 7168): SkinnyConfig(1, 1, 8, 2, stages=3),  # 6.86 µs vs cuBLAS 9.05
    (16, 896, 7168): SkinnyConfig(1, 1, 16, 1, stages=4),  # 8.78 µs vs cuBLAS 9.20
    (1, 3584, 7168): SkinnyConfig(1, 1, 8, 2, stages=3),  # 13.99 µs vs cuBLAS 18.39
    (2, 3584, 7168): SkinnyConfig(1, 1, 8, 2, stages=3),  # 14.25 µs vs cuBLAS 18.31
    (4, 3584, 7168): SkinnyConfig(1, 1, 8, 2, stages=3),  # 14.76 µs vs cuBLAS 18.32
    (8, 3584, 7168): SkinnyConfig(1, 1, 8, 2, stages=3),  # 15.26 µs vs cuBLAS 18.36
    (16, 3584, 7168): SkinnyConfig(1, 1, 8, 4),  # 17.58 µs vs cuBLAS 18.51
    (1, 7168, 3584): SkinnyConfig(1, 1, 4, 2, stages=4),  # 14.15 µs vs cuBLAS 18.12
    (2, 7168, 3584): SkinnyConfig(2, 1, 4, 2, stages=4),  # 14.24 µs vs cuBLAS 18.36
    (4, 7168, 3584): SkinnyConfig(2, 1, 4, 2, stages=4),  # 14.62 µs vs cuBLAS 18.49
    (8, 7168, 3584): SkinnyConfig(2, 1, 4, 2, stages=4),  # 15.25 µs vs cuBLAS 18.42
    (16, 7168, 3584): None,  # cuBLAS 15.59 µs <= CuTe 17.39 µs
    (1, 7168, 1536): SkinnyConfig(2, 1, 4, 2, stages=4),  # 7.54 µs vs cuBLAS 8.38
    (2, 7168, 1536): SkinnyConfig(1, 1, 4, 2, stages=4),  # 7.28 µs vs cuBLAS 8.22
    (4, 7168, 1536): SkinnyConfig(2, 1, 4, 2, stages=4),  # 7.58 µs vs cuBLAS 8.31
    (8, 7168, 1536): SkinnyConfig(2, 1, 4, 2, stages=4),  # 7.71 µs vs cuBLAS 8.33
    (16, 7168, 1536): None,  # cuBLAS 8.42 µs <= CuTe 8.68 µs
    (1, 7168, 768): SkinnyConfig(1, 1, 8, 2, stages=3),  # 4.94 µs vs cuBLAS 5.49
    (2, 7168, 768): SkinnyConfig(2, 1, 4, 2, stages=4),  # 4.56 µs vs cuBLAS 5.47
    (4, 7168, 768): SkinnyConfig(2, 1, 4, 2, stages=4),  # 5.07 µs vs cuBLAS 5.50
    (8, 7168, 768): SkinnyConfig(1, 1, 4, 4),  # 5.28 µs vs cuBLAS 5.58
    (16, 7168, 768): None,  # cuBLAS 5.60 µs <= CuTe 5.60 µs
    (1, 20480, 7168): SkinnyConfig(1, 1, 8, 2, stages=3),  # 68.87 µs vs cuBLAS 80.47
    (2, 20480, 7168): SkinnyConfig(1, 1, 8, 2, stages=3),  # 69.45 µs vs cuBLAS 79.77
    (4, 20480, 7168): SkinnyConfig(1, 1, 4, 2, stages=4),  # 73.52 µs vs cuBLAS 80.41
    (8, 20480, 7168): SkinnyConfig(1, 1, 4, 2, stages=4),  # 75.04 µs vs cuBLAS 82.46
    (16, 20480, 7168): None,  # CuTe 79.57 µs is within 3% of cuBLAS 81.58 µs
}


def m_bucket(m: int) -> int:
    """The M the table is keyed by (the kernel itself is compiled per exact M)."""
    for b in (1, 2, 4, 8, 16):
        if m <= b:
            return b
    raise ValueError(f"M={m} > 16 is not a skinny GEMM")


def heuristic(m: int, n: int, k: int) -> SkinnyConfig:
    """A configuration for a shape the table does not list, read off the H200 sweep.

    The sweep's winners all stream the weight through cp.async (loads in flight cost shared memory,
    not registers) with one 8-row group per warp: 8 K-warps × 2 steps × 3 stages for long K, 16
    K-warps × 1 step × 4 stages when N is small (few row groups must still fill the SMs), and 4
    K-warps × 2 steps × 4 stages for short K. K-warps are halved while a warp would get no chunk.
    """
    if k >= 4096:
        warps_k, unroll, stages = (16, 1, 4) if n <= 1024 else (8, 2, 3)
    else:
        warps_k, unroll, stages = 4, 2, 4
    chunks = k // (K_STEP * unroll)
    while warps_k > 1 and chunks < warps_k:
        warps_k //= 2
    return SkinnyConfig(row_groups=1, warps_n=1, warps_k=warps_k, unroll=unroll, stages=stages)


def cublas_preferred(m: int, n: int, k: int) -> bool:
    """True where the H200 measurements found cuBLAS faster than (or within 3% of) the CuTe kernel."""
    return choose(m, n, k) is None


def choose(m: int, n: int, k: int) -> Optional[SkinnyConfig]:
    """The configuration for this shape; None when cuBLAS is the better choice (measured)."""
    key = (m_bucket(m), n, k)
    if key in TABLE:
        return TABLE[key]
    return heuristic(m, n, k)
