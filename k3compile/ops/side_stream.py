"""The second stream of a device, for ops that run a latency-bound chain beside a product (``k3::route_beside``,
``k3::experts_beside``): :func:`beside` runs an op's side work there and its main work on the current stream, or
both in turn where :func:`in_turn_reason` says so.

One stream a device, shared by those ops: each queues its side work after a full wait on the current stream and
makes the current stream wait for the side one before it returns, so their uses never overlap. Every tensor the side
stream touches is made before its work is queued or on the side stream itself, and read on the current stream only
after the join: the caching allocator's stream bookkeeping holds without ``record_stream`` (a block the side stream
allocated returns to its pool, and its next use there follows another full wait on the current stream). Under
CUDA-graph capture the side stream joins the capture and is joined back before the op returns.
"""
from __future__ import annotations

import threading
from typing import Any, Callable, Optional

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


def beside(t: torch.Tensor, backend: str, side_work: Callable[[], Any], main_work: Callable[[], Any], impls,
           key, side_what: str, fn: Callable) -> tuple[Any, Any]:
    """``(side_work(), main_work())``: the first queued on the side stream after a full wait on the current one, the
    second on the current stream meanwhile, which then waits for the side stream; or both in turn where
    :func:`in_turn_reason` says so. The choice is recorded on ``impls`` (an op's ``OpImpls``) under ``key``."""
    why = in_turn_reason(t, backend)
    if why is not None:
        impls.select_fixed(backend, key, "in turn", why, fn)
        return side_work(), main_work()
    impls.select_fixed(backend, key, "two streams", f"{side_what} on a side stream", fn)
    main, side = torch.cuda.current_stream(t.device), side_stream(t.device)
    side.wait_stream(main)
    with torch.cuda.stream(side):
        side_out = side_work()
    main_out = main_work()
    main.wait_stream(side)
    return side_out, main_out
