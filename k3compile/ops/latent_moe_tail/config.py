"""Compile-time knobs of the one-kernel Triton tail (``triton.py``, ``streamk.py``) and the M buckets its
measured tables are keyed by."""
from __future__ import annotations

from dataclasses import dataclass

REDUCES = ("last", "kernel")
MAX_BLOCK_M = 16   # one tensor-core tile of rows; the op's small-M limit may not exceed it


@dataclass(frozen=True)
class TailConfig:
    """Compile-time knobs of the kernel (swept by ``benchmarks/moe_tail.py --sweep``).

    split_k: slices of L (programs per column tile); 1 = no workspace, the epilogue in the same program.
    reduce: with split_k > 1, "last" (last-arriving program, one launch) or "kernel" (a second launch).
    swap_ab: compute outᵀ = W·hᵀ (the weight tile is the MMA's M side: wgmma-sized on Hopper).
    prenorm: rstd of the whole row before the dot (fp16: keeps x·g from overflowing).
    stream_k: persistent programs, ``ctas_per_sm`` per SM, each a contiguous run of (tile, K block)
        units (``streamk.py``; split_k and swap_ab are then unused: it always swaps; ``reduce`` "last":
        the last program to leave a tile reduces it, one launch; "kernel": a second kernel reduces).
        On CPU (interpreter) ``ctas_per_sm`` is the program count.
        tma: stream-K loads the weight through a TMA descriptor where its layout allows (row-major,
        16-byte aligned base and rows), else through pointers as without it.
        pdl: stream-K on sm_90+: both kernels launched with programmatic dependent launch; before its
        wait the stream-K kernel prefetches its first ``pdl_tiles`` weight tiles into L2 (with
        ``static_weight`` it loads the first one). ``static_weight=True`` turns PDL on whatever this says.
    Split-K grid (``stream_k=False``), sm_90+: ``tma`` loads the weight tiles through a TMA descriptor, and
    the latent and norm-weight tiles too where their layout allows (so the pipeliner loads all three ahead);
    ``pdl`` launches it with PDL (the wait before the first latent load); ``early_trigger`` lets the next
    kernel launch right after that wait (for a grid that runs as one wave), else after the K loop;
    ``preload`` with ``static_weight``: each program's first weight tile is loaded before the wait;
    ``ring`` with ``static_weight`` (and not ``prenorm``): the wait moves into the K loop, so the weight tiles
    the software pipeliner loads ahead (its prologue) are issued before it.
    """
    block_n: int = 64
    block_k: int = 128
    split_k: int = 4
    num_warps: int = 4
    num_stages: int = 4
    reduce: str = "last"
    swap_ab: bool = False
    prenorm: bool = False
    stream_k: bool = False
    ctas_per_sm: int = 1
    tma: bool = False
    pdl: bool = False
    pdl_tiles: int = 1
    early_trigger: bool = False
    preload: bool = False
    ring: bool = False

    def __post_init__(self):
        if self.reduce not in REDUCES:
            raise ValueError(f"reduce must be one of {REDUCES}, got {self.reduce!r}")
        if self.split_k < 1 or self.block_n < 16 or self.block_k < 16 or self.ctas_per_sm < 1 or self.pdl_tiles < 1:
            raise ValueError(f"bad config {self}")

    def tag(self) -> str:
        if self.stream_k:
            return (f"sk{self.ctas_per_sm}-n{self.block_n}-k{self.block_k}-w{self.num_warps}-st{self.num_stages}"
                    + ("-1launch" if self.reduce == "last" else "") + ("-tma" if self.tma else "")
                    + (f"-pdl{self.pdl_tiles}" if self.pdl else "") + ("-pre" if self.prenorm else ""))
        return (f"n{self.block_n}-k{self.block_k}-s{self.split_k}-w{self.num_warps}-st{self.num_stages}"
                + (f"-{self.reduce}" if self.split_k > 1 else "") + ("-swap" if self.swap_ab else "")
                + ("-tma" if self.tma else "")
                + (f"-pdl{'e' if self.early_trigger else ''}{'p' if self.preload else ''}{'r' if self.ring else ''}"
                   if self.pdl else "")
                + ("-pre" if self.prenorm else ""))


def m_bucket(m: int) -> int:
    """The M the measured tables are keyed by (the kernel itself serves every M ≤ 16)."""
    for b in (1, 2, 4, 8, 16):
        if m <= b:
            return b
    return m
