"""The second stream of a device, for ops that run a latency-bound chain beside a product (``k3::route_beside``,
``k3::experts_beside``), and when such an op runs its chains in turn instead.

One stream a device, shared by those ops: each queues its side work after a full wait on the current stream and
makes the current stream wait for the side one before it returns, so their uses never overlap. Every tensor the side
stream touches is made before its work is queued or on the side stream itself, and read on the current stream only
after the join: the caching allocator's stream bookkeeping holds without ``record_stream`` (a block the side stream
allocated returns to its pool, and its next use there follows another full wait on the current stream). Under
CUDA-graph capture the side stream joins the capture and is joined back before the op returns.
"""
from __future__ import annotations

import threading
from typing import Optional

import torch

from k3compile import kernel_cache

_SIDE: dict[torch.device, torch.cuda.Stream] = {}
_SIDE_LOCK = threading.Lock()


def side_stream(device: torch.device) -> torch.cuda.Stream:
    """The side stream of ``device`` (one a device, made at first use)."""
    with _SIDE_LOCK:
        stream = _SIDE.get(device)
        if stream is None:
            stream = _SIDE[device] = torch.cuda.Stream(device)
        return stream


def in_turn_reason(t: torch.Tensor, backend: str) -> Optional[str]:
    """Why an op on ``t`` (its first operand) runs its chains in turn on the current stream, or None for two
    streams: tensors not on a CUDA (or ROCm) device, ``backend="reference"``, no rows, a dry run
    (``k3compile/triton_ahead.py``: nothing launches)."""
    if t.device.type != "cuda":
        return f"{t.device.type} tensors: no second stream"
    if backend == "reference":
        return "backend='reference' requested"
    if t.shape[0] == 0:
        return "no rows"
    if kernel_cache.is_dry_running():
        return "a dry run launches nothing"
    return None
