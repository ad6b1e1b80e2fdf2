"""Arrival counters for single-launch split-K kernels (``skinny_gemm``, ``latent_moe_tail``).

The programs that share an output tile each add their partial sum to a workspace and bump the tile's
int32 counter; the last to arrive reduces and sets the counter back to zero. Counters are therefore
zero between launches, so one buffer serves every call and every CUDA-graph replay without a memset.

- Each launch takes the next of :data:`RING` slots of its device's buffer: kernels that overlap (PDL,
  a second stream) get different counters unless ``RING`` launches are in flight at once.
- Buffers are made outside CUDA-graph capture only (memory zeroed inside a capture is zeroed on replay
  alone); a first call inside a capture gets None, and the kernel falls back to its two-launch form.
- Buffers live as long as the process: a captured graph holds their address, so one is never freed,
  only outgrown by a larger one.
"""
from __future__ import annotations

import threading
from typing import Optional

import torch

RING = 64
MIN_COUNTERS = 256

_BUFFERS: dict[torch.device, torch.Tensor] = {}   # device -> [RING, n] int32, the newest
_OUTGROWN: list[torch.Tensor] = []                 # kept alive for graphs that captured them
_NEXT_SLOT: dict[torch.device, int] = {}
_LOCK = threading.Lock()


def arrival_counters(device: torch.device, n: int) -> Optional[torch.Tensor]:
    """``n`` zeroed int32 counters on ``device``, or None while a CUDA graph is being captured and no
    buffer that large exists yet."""
    device = torch.device(device)
    with _LOCK:
        buf = _BUFFERS.get(device)
        if buf is None or buf.shape[1] < n:
            if _capturing(device):
                return None
            if buf is not None:
                _OUTGROWN.append(buf)
            buf = _BUFFERS[device] = _zeros_outside_graph_pools((RING, max(n, MIN_COUNTERS)), device)
        slot = _NEXT_SLOT.get(device, 0)
        _NEXT_SLOT[device] = (slot + 1) % RING
    return buf[slot, :n]


def all_zero() -> bool:
    """Whether every counter of every buffer is back at zero (tests: each launch must rearm its own)."""
    return all(not b.any() for b in (*_BUFFERS.values(), *_OUTGROWN))


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _zeros_outside_graph_pools(shape: tuple, device: torch.device) -> torch.Tensor:
    """Zeroed int32s from the ordinary allocator. Inductor's CUDA-graph trees route every allocation of
    the warming-up thread into their private pool and fail on a live block they do not own, so a buffer
    kept for good is made on a thread of its own."""
    made = []
    worker = threading.Thread(target=lambda: made.append(torch.zeros(shape, dtype=torch.int32, device=device)))
    worker.start()
    worker.join()
    if not made:
        raise RuntimeError(f"could not allocate split-K arrival counters on {device}")
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # zeroed on that thread's stream: done before any use here
    return made[0]
