"""Configurations of the CuTe skinny GEMM kernels (``mma.py``: mma.sync, ``wgmma.py``: warpgroup MMA).

Frozen, keyword-only dataclasses: a configuration is a compile-time constant of its kernel (one compiled variant
per configuration), and its ``tag()`` names it in tables, logs and cache files. Nothing here imports cutlass: the
dispatch reads configurations on any machine. The measured picks live in ``ops/<op>/tables/<gpu>.json``; the
heuristics for shapes no table lists beside each op (``ops/skinny_gemm/cute_config.py``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

VEC = 8                       # elements per 16-byte load: K and the row strides are multiples of it
SMEM_LIMIT = 227 * 1024       # sm_90 dynamic shared memory per block
SMEM_PER_SM = 228 * 1024      # sm_90 shared memory per SM (1 KB of it reserved per resident block)
MAX_THREADS = 1024
K_STEP = 32                   # K one mma.sync warp covers per step (4 lanes x 8 elements of a weight row)


@dataclass(frozen=True, kw_only=True)
class MmaConfig:
    """The mma.sync kernel (``mma.py``): a block of ``warps_n x warps_k`` warps; each warp owns ``row_groups``
    groups of 8 weight rows and a K slice, ``unroll`` K-steps of 32 per chunk."""
    row_groups: int = 1      # groups of 8 weight rows per warp
    warps_n: int = 1         # warps splitting the block's rows
    warps_k: int = 4         # warps splitting K inside the block (their partial sums meet in shared memory)
    unroll: int = 4          # K-steps of loads issued before the MMAs
    prefetch: bool = True    # L2-prefetch the first weight chunk before the PDL wait
    stages: int = 1          # >1: the weight streamed by cp.async through a per-warp ring of this many chunks
    split_k: int = 1         # >1: a cluster of this many blocks splits K; partial sums meet through DSMEM
    early: bool = False      # PDL: let the next kernel launch right after our own wait, not after the K loop
    l2_kb: int = 0           # >0: before the wait, bulk-prefetch up to this many KB of the block's weight into L2
    a_ring: bool = False     # (stages > 1) A rides the cp.async ring with the weight, not plain loads
    a_l1: bool = False       # keep A in L1 (ring copies .ca, plain loads evict_last; register weight loads evict_first)
    trigger_first: bool = False  # PDL, static weight only: the next kernel may launch as soon as our blocks start

    def __post_init__(self):
        if self.row_groups < 1 or self.warps_n < 1 or self.warps_k < 1 or self.unroll < 1:
            raise ValueError(f"bad config {self}")
        if self.stages < 1 or not 1 <= self.split_k <= 8:  # a portable cluster holds <= 8 blocks
            raise ValueError(f"bad config {self}")
        if self.l2_kb < 0 or (self.a_ring and self.stages == 1):
            raise ValueError(f"bad config {self}")
        if self.threads > MAX_THREADS:
            raise ValueError(f"{self} needs {self.threads} threads > {MAX_THREADS}")

    @property
    def block_n(self) -> int:
        """Weight rows (output columns) per block."""
        return 8 * self.row_groups * self.warps_n

    @property
    def threads(self) -> int:
        return 32 * self.warps_n * self.warps_k

    def smem_bytes(self, m: int = 16) -> int:
        """The K-warps' fp32 partial sums [warps_k, block_n, 16], plus the cp.async rings: the weight's (per warp)
        and, with ``a_ring``, A's (per warp; one 16-byte vector per lane and step, two above M = 8)."""
        if self.stages == 1:
            return 4 * self.warps_k * self.block_n * 16 + 128
        ring = self.stages * self.row_groups * self.unroll * 512 * self.warps_n * self.warps_k
        if self.a_ring:
            ring += self.stages * self.unroll * (2 if m > 8 else 1) * 512 * self.warps_n * self.warps_k
        return 4 * self.warps_k * self.block_n * 16 + ring + 128  # + alignment slack

    def tag(self) -> str:
        return (f"rg{self.row_groups}-wn{self.warps_n}-wk{self.warps_k}-u{self.unroll}"
                + ("" if self.prefetch else "-nopf") + (f"-s{self.stages}" if self.stages > 1 else "")
                + (f"-c{self.split_k}" if self.split_k > 1 else "") + ("-e" if self.early else "")
                + (f"-l{self.l2_kb}" if self.l2_kb else "") + ("-a" if self.a_ring else "")
                + ("-ca" if self.a_l1 else "") + ("-tf" if self.trigger_first else ""))


@dataclass(frozen=True, kw_only=True)
class WgmmaConfig:
    """The warpgroup-MMA kernel (``wgmma.py``): ``block_n`` weight rows a block on wgmma's M side, A on its N side,
    both through one TMA ring of ``stages`` slots of ``block_k``; ``split_k`` blocks of a cluster split K."""
    block_n: int = 64   # weight rows per block: 64 (one m64 wgmma tile) or 128 (two)
    block_k: int = 64   # K per ring slot (64 = one 128-byte swizzle row of bf16)
    stages: int = 8     # ring slots in shared memory (a weight tile and, unless resident, an A tile each)
    split_k: int = 1    # blocks per cluster splitting K (1-16)
    producer_warp: bool = False  # a fifth warp issues the TMA loads, so refills never wait behind the MMAs
    evict_hints: bool = False    # TMA L2 policies: the weight (read once) evict-first, A (read by every block) evict-last
    early: bool = False          # PDL: let the next kernel launch right after our wait, not after our K loop
    mma_trigger: bool = False    # PDL: only the MMA warps let the next kernel launch, after their K loop (a block's
    #                              first trigger counts: otherwise the producer or norm warps', stages earlier)
    early_w: bool = True         # static weight: request the first weight tiles before the PDL wait (False: never)
    trigger_first: bool = False  # PDL, static weight only: the next kernel may launch as soon as our blocks start
    push_partials: bool = False  # (split_k > 1) each block sends the owners of its outputs its partial sums
    #                              (st.async into their shared memory) instead of a cluster barrier and remote reads
    owners: int = 0              # (push_partials) blocks 0..owners-1 own the outputs; the others push and exit. 0: all
    reg_stages: int = 0          # (producer warp) a block's first K tiles go from the ring to registers before the PDL
    #                              wait and their slots take the next tiles: a share of stages + reg_stages tiles in
    #                              ``stages`` slots; A gets resident tiles of its own (``share_fits``)

    def tag(self) -> str:
        return (f"wg-n{self.block_n}-k{self.block_k}-s{self.stages}-c{self.split_k}"
                + ("-pw" if self.producer_warp else "") + ("-h" if self.evict_hints else "")
                + ("-e" if self.early else "") + ("-tm" if self.mma_trigger else "")
                + ("" if self.early_w else "-nw") + ("-pp" if self.push_partials else "")
                + (f"-o{self.owners}" if self.owners else "")
                + ("-tf" if self.trigger_first else "") + (f"-r{self.reg_stages}" if self.reg_stages else ""))

    def invalid(self) -> Optional[str]:
        """None when the kernel can be built with this configuration, else why not."""
        if self.block_n not in (64, 128):
            return f"block_n={self.block_n}: must be 64 or 128 (wgmma M tiles)"
        if self.block_k not in (64, 128):
            return f"block_k={self.block_k}: must be 64 or 128"
        if not 2 <= self.stages <= 16:
            return f"stages={self.stages}: must be 2..16"
        if not 1 <= self.split_k <= 16:
            return f"split_k={self.split_k}: must be 1..16 (a cluster above 8 is non-portable: sm_90 allows 16)"
        if self.push_partials and self.split_k == 1:
            return "push_partials: a single block has no partial sums to send (split_k=1)"
        if self.owners and not (self.push_partials and 1 <= self.owners <= self.split_k):
            return f"owners={self.owners}: push_partials only, 1..split_k"
        if self.early and self.mma_trigger:
            return "early and mma_trigger: the next kernel launches after our wait or after our K loop, not both"
        if self.reg_stages and not (self.producer_warp and 1 <= self.reg_stages <= 8):
            return (f"reg_stages={self.reg_stages}: 1..8, with a producer warp (the MMA warps free the slots it "
                    "refills before the wait)")
        if self.smem_bytes(16) > SMEM_LIMIT:
            return f"needs {self.smem_bytes(16)} B of shared memory > {SMEM_LIMIT}"
        return None

    def smem_bytes(self, m: int, norm: bool = False) -> int:
        """Dynamic shared memory of one block at this M (2-byte elements): barriers, the ring (1 KB aligned), the
        partial tile (rows padded by one word); ``norm`` (the fused tail): the ring carries only the weight, and A's
        resident tiles, their two barriers each and the block's share of g come on top; ``reg_stages``: A's resident
        tiles, a barrier each, instead of A's place in the ring."""
        if self.reg_stages and not norm:
            return self._weight_ring_and_rest(m) + self.a_tiles() * (m_pad(m) * self.block_k * 2 + 8)
        if not norm:
            return self._weight_ring_and_rest(m) + self.stages * m_pad(m) * self.block_k * 2   # A rides the ring
        return self._weight_ring_and_rest(m) + self.norm_a_tiles(m) * self._norm_per_tile(m)

    def _weight_ring_and_rest(self, m: int) -> int:
        """The weight's ring slots, the partial tile, the barriers and alignment around them; (push_partials) the
        other blocks' partials of our outputs."""
        return (1024 + self.stages * self.block_n * self.block_k * 2 + 1024
                + (self.red_slots(m) + self.push_slots(m)) * 4 + 1024)

    def red_slots(self, m: int) -> int:
        """fp32 slots of the partial tile in shared memory, [block_n, M padded + 1]; with push_partials the
        fragments go from registers to the owners (a 4-slot stub)."""
        return 4 if self.push_partials else self.block_n * (m_pad(m) + 1)

    def push_owners(self) -> int:
        """(push_partials) how many of the cluster's blocks own outputs: ``owners``, else all."""
        return self.owners or self.split_k

    def push_slots(self, m: int) -> int:
        """(push_partials) fp32 slots of a block's receive buffer, [rank, fragment quarter, thread of its group, 4]:
        the MMA warpgroup's 128 threads fall into ``push_owners()`` groups of at most ceil(128 / owners), and a
        thread's fragment is block_n * M padded / 128 floats (4, 8 or 16); 0 without it."""
        if not self.push_partials:
            return 0
        return self.split_k * -(-128 // self.push_owners()) * (self.block_n * m_pad(m) // 128)

    def _norm_per_tile(self, m: int) -> int:
        return m_pad(m) * self.block_k * 2 + self.block_k * 2 + 16   # A tile, g, two barriers

    def norm_a_tiles(self, m: int) -> int:
        """(fused tail) K tiles of A a block keeps resident: what shared memory leaves beside the ring, at most 64;
        a block's K share must fit (``norm_fits``)."""
        return max(0, min(64, (SMEM_LIMIT - self._weight_ring_and_rest(m)) // self._norm_per_tile(m)))

    def norm_fits(self, m: int, k: int) -> bool:
        """(fused tail) Whether a block's K share of A fits its resident tiles."""
        tiles = -(-k // self.block_k)
        return -(-tiles // self.split_k) <= self.norm_a_tiles(m)

    def a_tiles(self) -> int:
        """A's K tiles in a block's shared memory (outside the fused norm): its ring slots, or (reg_stages) its whole
        share, resident."""
        return self.stages + self.reg_stages

    def share_fits(self, k: int) -> bool:
        """Whether every block's K share suits the kernel at this K: with ``reg_stages``, at least that many tiles
        (each register tile is waited for) and at most ``a_tiles()`` (A's resident slots)."""
        if not self.reg_stages:
            return True
        tiles = -(-k // self.block_k)
        return tiles // self.split_k >= self.reg_stages and -(-tiles // self.split_k) <= self.a_tiles()

    def blocks(self, n: int) -> int:
        return -(-n // self.block_n) * self.split_k


KernelConfig = Union[MmaConfig, WgmmaConfig]   # which CuTe kernel runs, and how it divides the work


def m_pad(m: int) -> int:
    """wgmma's N side: A's rows padded to 8 or 16."""
    return 8 if m <= 8 else 16


def push_slot(rank, quarter, thread, group: int, frag: int):
    """(push_partials) Offset in floats, in an owner's receive buffer, of the ``quarter``-th 4 floats of the fragment
    (``frag`` floats) that thread ``thread`` of an owner group (``group`` threads at most) of cluster rank ``rank``
    sends. The buffer is [rank, quarter, thread, 4], so one st.async of a warp writes contiguous bytes
    (docs/tuning/skinny_gemm.md: [rank, thread, fragment] left 32-byte segments half written). Plain arithmetic:
    the kernel calls it on its run-time values."""
    return ((rank * (frag // 4) + quarter) * group + thread) * 4
