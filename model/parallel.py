"""Tensor parallelism: which rank holds which slice, and the all-reduce the captured graph shows.

Modules are built with their *local* shapes (a column-parallel projection holds ``out / tp`` rows, a row-parallel
one ``in / tp`` columns). Each sharded parameter carries ``tp_dim`` (the dimension cut into ``tp`` equal,
contiguous pieces; rank r holds piece r); unmarked parameters are replicated. Loading slices full tensors with
:func:`shard_tensor`. The collectives are ``torch.distributed._functional_collectives``' (``all_reduce``, and
``all_gather_tensor`` for the vocabulary-split logits), so they appear in the graph torch.compile captures
(``_c10d_functional.all_reduce`` / ``all_gather_into_tensor`` + ``wait_tensor``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass(frozen=True)
class TPContext:
    """Rank, world size and the process-group name of one tensor-parallel group."""
    rank: int = 0
    world: int = 1
    group_name: Optional[str] = None

    @classmethod
    def from_group(cls, group=None) -> "TPContext":
        import torch.distributed as dist
        group = group if group is not None else dist.group.WORLD
        return cls(rank=dist.get_rank(group), world=dist.get_world_size(group), group_name=group.group_name)

    def split(self, size: int, what: str = "size") -> int:
        """This rank's share of ``size`` (which must divide evenly)."""
        if size % self.world:
            raise ValueError(f"{what} {size} does not split over tensor-parallel size {self.world}")
        return size // self.world


SINGLE = TPContext()


def all_reduce(x: torch.Tensor, tp: TPContext) -> torch.Tensor:
    """Sum over the tensor-parallel group (identity without TP)."""
    if tp.world == 1:
        return x
    from torch.distributed import _functional_collectives as funcol
    return funcol.all_reduce(x, "sum", tp.group_name)


def all_gather(x: torch.Tensor, tp: TPContext, dim: int = -1) -> torch.Tensor:
    """The group's pieces of ``x`` concatenated along ``dim``, rank r's piece r-th (identity without TP)."""
    if tp.world == 1:
        return x
    from torch.distributed import _functional_collectives as funcol
    gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor   # the name before torch 2.13
    # gathered along dim 0, then rearranged here: for another dim torch 2.11's funcol calls a helper Dynamo refuses
    # to trace (``torch._utils._maybe_view_chunk_cat``), which broke compiling the vocabulary-split logits
    d = dim % x.dim()
    pieces = gather(x.contiguous(), 0, tp.group_name)                  # [world * x.shape[0], ...]
    if d == 0:
        return pieces
    return pieces.view(-1, *x.shape).movedim(0, d).flatten(d, d + 1)


def mark_shard(param: torch.nn.Parameter, dim: int) -> torch.nn.Parameter:
    """Record that ``param`` is the ``dim``-slice of a full tensor split over the TP group."""
    param.tp_dim = dim
    return param


def shard_tensor(full: torch.Tensor, dim: Optional[int], tp: TPContext) -> torch.Tensor:
    """Rank ``tp.rank``'s contiguous piece of ``full`` along ``dim`` (``full`` itself when replicated)."""
    if dim is None or tp.world == 1:
        return full
    size = full.shape[dim]
    if size % tp.world:
        raise ValueError(f"cannot split dim {dim} of shape {tuple(full.shape)} over {tp.world} ranks")
    return full.narrow(dim, tp.rank * (size // tp.world), size // tp.world)
