"""How the Triton MLA decode lays out its grid: a frozen configuration and the split count it implies.

The split count is fixed on the host from shapes alone (batch, allocation, SMs), so the launch is the same at every
step and a CUDA graph can hold it; each program reads ``pos`` (and ``start``) on the device and derives the length
of its split from the valid length, so the splits share the valid prefix whatever it is, and splits past it exit.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TritonConfig:
    """block_s: keys per tile. min_split_tiles: the fewest tiles a split takes (fewer, longer splits where the valid
    prefix is short: less partial-result traffic and a shorter combine). programs_per_sm: the split count aims at
    about this many programs (splits x batch x row blocks) per SM. num_warps / num_stages: of the split kernel.
    pdl: the four kernels launch with PDL where the GPU has it (sm_90+)."""
    block_s: int = 32
    min_split_tiles: int = 4
    programs_per_sm: int = 2
    num_warps: int = 4
    num_stages: int = 2
    pdl: bool = True

    def to_json(self) -> dict:
        return dict(block_s=self.block_s, min_split_tiles=self.min_split_tiles, programs_per_sm=self.programs_per_sm,
                    num_warps=self.num_warps, num_stages=self.num_stages, pdl=self.pdl)


# Programs the split count aims at where the device has no SMs to count (CPU tensors under TRITON_INTERPRET=1):
# enough splits that the tests exercise the combine.
INTERPRETER_PROGRAMS = 8


def split_count(batch: int, row_blocks: int, alloc: int, sms: int, config: TritonConfig) -> int:
    """How many splits each (sequence, row block) gets: as many programs as fit the GPU at once (rounded down, so
    that equal lengths make one full wave, not a wave and a sliver), never more than the allocation holds splits
    of the minimum length."""
    target = config.programs_per_sm * sms if sms else INTERPRETER_PROGRAMS
    most = -(-alloc // (config.block_s * config.min_split_tiles))
    return max(1, min(most, target // (batch * row_blocks)))


def default_config(rows: int) -> TritonConfig:
    """Where no measured pick exists: 4 warps for 16 query rows, 8 above (a [64, Lk] fp32 accumulator needs two
    warpgroups; with one, ptxas spills: tests/ops/test_mla_decode.py compiles both for sm_90a)."""
    return TritonConfig() if row_block(rows) <= 16 else TritonConfig(num_warps=8)


def row_block(rows: int) -> int:
    """Query rows (T x H) per program: a power of two from 16 (the smallest tensor-core tile) to 64."""
    return max(16, min(64, 1 << max(0, rows - 1).bit_length()))


def decode_dtype_ok(dtype: torch.dtype) -> bool:
    return dtype in (torch.float32, torch.bfloat16, torch.float16)
