"""How the Triton MLA decode lays out its grid: a frozen configuration and the split count it implies.

The split count is fixed on the host from shapes alone (batch, allocation, SMs), so the launch is the same at every
step and a CUDA graph can hold it; each program reads ``pos`` (and ``start``) on the device and derives the length
of its split from the valid length, so the splits share the valid prefix whatever it is, and splits past it exit.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

import torch

from k3compile.backends import stages_within


@dataclass(frozen=True)
class TritonConfig:
    """block_s: keys per tile. min_split_tiles: the fewest tiles a split takes (fewer, longer splits where the valid
    prefix is short: less partial-result traffic and a shorter combine). programs_per_sm: the split count aims at
    about this many programs (splits x batch x row blocks) per SM. num_warps / num_stages: of the split kernel
    (``num_stages - 1`` tiles in flight a program). prefetch_tiles: tiles of its split a program pulls into L2 before
    its PDL wait. fused_readback: the combine and the read-back through w_v in one kernel (a program per query row
    and 16 output columns, each combining its row over the whole Lk: one launch fewer, partials read Vd/16 times).
    pdl: the kernels launch with PDL where the GPU has it (sm_90+). static_strides: where the cache rows are
    contiguous, the split kernel with its shapes, split count and strides compiled in, the batch strides aside (fewer
    kernel parameters to fetch; one build per batch size and layout). maxnreg: a register cap a thread of the split
    kernel (NVIDIA only; 0: none): 8 warps under 128 registers fit two programs an SM. max_splits: at most this many
    splits a (sequence, row block) (0: no cap): a grid no wider than the splits a short valid length keeps active.
    full_tiles: the split kernel streams its split's whole tiles without masks, at per-thread offsets fixed for
    every tile, and its partial last tile apart (fewer address and predicate instructions a tile)."""
    block_s: int = 32
    min_split_tiles: int = 4
    programs_per_sm: int = 2
    num_warps: int = 4
    num_stages: int = 3
    prefetch_tiles: int = 2
    fused_readback: bool = False
    pdl: bool = True
    static_strides: bool = False
    maxnreg: int = 0
    max_splits: int = 0
    full_tiles: bool = False

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


# Programs the split count aims at where the device has no SMs to count (CPU tensors under TRITON_INTERPRET=1):
# enough splits that the tests exercise the combine.
INTERPRETER_PROGRAMS = 8


def split_count(batch: int, row_blocks: int, alloc: int, sms: int, config: TritonConfig) -> int:
    """How many splits each (sequence, row block) gets: as many programs as fit the GPU at once (rounded down, so
    that equal lengths make one full wave, not a wave and a sliver), never more than the allocation holds splits
    of the minimum length."""
    target = config.programs_per_sm * sms if sms else INTERPRETER_PROGRAMS
    most = -(-alloc // (config.block_s * config.min_split_tiles))
    if config.max_splits:
        most = min(most, config.max_splits)
    return max(1, min(most, target // (batch * row_blocks)))


def default_config(rows: int, batch: Optional[int] = None) -> TritonConfig:
    """Where no measured pick exists (sm_90a figures from compiling the split kernel at K3's widths; a 32-key tile of
    c_kv and k_pe is 36 KB). 16 query rows: 4 warps, 3 stages -- 195 registers and 93 KB of shared memory, so two
    programs an SM keep four tiles in flight. 64 rows: 8 warps (a [64, Lk] fp32 accumulator needs two warpgroups;
    with one, ptxas spills), 4 stages -- 237 registers and 221 KB, one program an SM with three tiles in flight, so
    one program an SM in the split count. The fused combine + read-back for batch <= 2 (``batch`` None: not fused)."""
    fused = batch is not None and batch <= 2
    if row_block(rows) <= 16:
        return TritonConfig(fused_readback=fused)
    return TritonConfig(num_warps=8, num_stages=4, programs_per_sm=1, fused_readback=fused)


def fit_local_memory(config: TritonConfig, rows: int, lk: int, r: int, element_size: int,
                     budget: int) -> TritonConfig:
    """``config`` with the split kernel's pipeline no deeper than ``budget`` bytes of shared memory hold
    (``backends.stages_within``; a stage: a [block_s, Lk + R] tile of c_kv and k_pe, besides the query's [rows, R]):
    gfx9's 64 KiB of LDS takes two stages of K3's 36 KiB tiles (three: 72 KiB, refused at launch)."""
    stages = stages_within(budget, config.block_s * (lk + r) * element_size, row_block(rows) * r * element_size,
                           config.num_stages)
    return config if stages == config.num_stages else dataclasses.replace(config, num_stages=stages)


def row_block(rows: int) -> int:
    """Query rows (T x H) per program: a power of two from 16 (the smallest tensor-core tile) to 64."""
    return max(16, min(64, 1 << max(0, rows - 1).bit_length()))


def decode_dtype_ok(dtype: torch.dtype) -> bool:
    return dtype in (torch.float32, torch.bfloat16, torch.float16)
