"""``k3::all_reduce_(buf!, reduce_op, group_name)``: an in-place all-reduce issued on the caller's stream.

Inductor lowers the functional collective ``_c10d_functional.all_reduce`` + ``wait_tensor`` to an NCCL
call on the process group's internal stream, forked from and joined back to the compute stream; inside a
CUDA graph that fork and join cost 2-3.5 µs a layer (``docs/tuning/all_reduce.md``). The latent-MoE tail pass
emits this op for its merged all-reduce, whose result the next kernel needs at once: there is nothing for a
side stream to overlap.

The op mutates ``buf`` (a buffer the graph owns: the pass hands it the fresh concatenation) and returns
nothing; readers read ``buf`` after it.
"""
from __future__ import annotations

import torch

# functional-collective reduce-op names -> torch.distributed.ReduceOp attributes
REDUCE_OPS = {"sum": "SUM", "avg": "AVG", "product": "PRODUCT", "min": "MIN", "max": "MAX"}


@torch.library.custom_op("k3::all_reduce_", mutates_args=("buf",))
def all_reduce_(buf: torch.Tensor, reduce_op: str, group_name: str) -> None:
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _resolve_process_group

    if reduce_op not in REDUCE_OPS:
        raise ValueError(f"k3::all_reduce_: reduce_op {reduce_op!r} is not one of {sorted(REDUCE_OPS)}")
    dist.all_reduce(buf, op=getattr(dist.ReduceOp, REDUCE_OPS[reduce_op]),
                    group=_resolve_process_group(group_name), async_op=False)


@all_reduce_.register_fake
def _(buf, reduce_op, group_name):
    return None


__all__ = ["all_reduce_", "REDUCE_OPS"]
