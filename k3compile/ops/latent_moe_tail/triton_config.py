"""The one-kernel Triton tail's compile-time knobs (``TailConfig``: ``triton.py``'s grid, ``streamk.py``'s
persistent form), its heuristic for a shape no table lists, and what it takes. Nothing here imports Triton."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

import torch

from k3compile.backends import stages_within

REDUCES = ("last", "kernel")
SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
MAX_BLOCK_M = 16   # one tensor-core tile of rows; the op's small-M limit may not exceed it


@dataclass(frozen=True, kw_only=True)
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


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    return 0 if n <= 0 else 1 << (n - 1).bit_length()   # as triton.next_power_of_2


# The form an H200 sweep found best for 16-bit tiles where nothing was measured: stream-K, 128 x 128 weight tiles
# through TMA, 8 warps, 4 stages, a second kernel reducing.
STREAM_K_TMA = TailConfig(block_n=128, block_k=128, num_warps=8, num_stages=4, reduce="kernel", stream_k=True,
                          tma=True)


def heuristic(m: int, d: int, l: int, dtype: torch.dtype, sm_count: int) -> TailConfig:
    """The configuration where no table lists one: 16-bit on a GPU, ``STREAM_K_TMA``; fp32 (tiles twice the bytes) a
    split-K grid of 64-column tiles to ~2 programs per SM, 3 stages. ``sm_count`` 0 (the interpreter): no split,
    fewer programs."""
    if sm_count and dtype != torch.float32:
        return for_dtype(STREAM_K_TMA, dtype)
    block_k = 128 if l >= 128 else max(16, next_power_of_2(l))
    block_n = 64 if d >= 64 or not sm_count else max(16, next_power_of_2(d))
    split_k = 1
    if sm_count:
        want = max(1, (2 * sm_count) // cdiv(d, block_n))
        split_k = max(1, min(want, cdiv(l, block_k) // 4, 16))
    return TailConfig(block_n=block_n, block_k=block_k, split_k=split_k, num_warps=4, num_stages=3,
                      reduce="last", prenorm=dtype == torch.float16)


def for_dtype(cfg: TailConfig, dtype: torch.dtype) -> TailConfig:
    """fp16 normalises each row before the dot (``prenorm``): x·g of an unnormalised latent can overflow fp16."""
    return dataclasses.replace(cfg, prenorm=True) if dtype == torch.float16 else cfg


def fit_local_memory(cfg: TailConfig, element_size: int, budget: int) -> TailConfig:
    """``cfg`` with its pipeline no deeper than ``budget`` bytes of shared memory hold (``backends.stages_within``:
    a [MAX_BLOCK_M + block_n, block_k] stage): gfx9's 64 KiB of LDS takes two stages of ``STREAM_K_TMA``'s 128 x 128
    tiles through pointers (four: 100 KiB, refused at launch), two of the fp32 grid's 64 x 128 (three: 72 KiB)."""
    stages = stages_within(budget, (MAX_BLOCK_M + cfg.block_n) * cfg.block_k * element_size, 0, cfg.num_stages)
    return cfg if stages == cfg.num_stages else dataclasses.replace(cfg, num_stages=stages)


def supports(latent, shared, norm_weight, up_weight, eps, small_m_limit=MAX_BLOCK_M) -> Optional[str]:
    """None if the one-kernel tail takes these tensors, else why not."""
    dtypes = {latent.dtype, shared.dtype, norm_weight.dtype, up_weight.dtype}
    if len(dtypes) != 1:
        return f"mixed dtypes {sorted(str(d) for d in dtypes)} (the kernel takes one dtype)"
    if latent.dtype not in SUPPORTED_DTYPES:
        return f"dtype {latent.dtype} (kernel has {[str(d) for d in SUPPORTED_DTYPES]})"
    m = latent.shape[0]
    if m > min(small_m_limit, MAX_BLOCK_M):
        return f"M > {min(small_m_limit, MAX_BLOCK_M)}, the small-M limit (norm + addmm is faster there)"
    if m == 0 or latent.shape[1] == 0:
        return "empty input"
    return None
