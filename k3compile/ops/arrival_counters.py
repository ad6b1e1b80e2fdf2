"""Arrival counters for single-launch split-K kernels (``skinny_gemm``, ``latent_moe_tail``).

The programs that share an output tile each add their partial sum to a workspace and bump the tile's
int32 counter; the last to arrive reduces and sets the counter back to zero. Counters are therefore
zero between launches, so one buffer serves every call and every CUDA-graph replay without a memset.

- Each launch takes the next of :data:`RING` slots of its device's buffer: kernels that overlap (PDL)
  get different counters unless ``RING`` launches are in flight at once. Where the ring comes round to a
  slot last taken on another stream, the current stream first waits for that one (:func:`_take_slot`), so
  launches on many streams never share a slot either. Graph replays are not covered: a captured launch
  keeps its slot, and replaying graphs on several streams at once that were captured ``RING`` launches
  apart would share one.
- Buffers are made outside CUDA-graph capture only (memory zeroed inside a capture is zeroed on replay
  alone); a first call inside a capture gets None, and the kernel falls back to its two-launch form.
- Buffers live as long as the process: a captured graph holds their address, so one is never freed,
  only outgrown by a larger one.

Partial slots (:func:`partial_slots`) follow the same rules for kernels whose last split polls the others'
fp32 partial sums instead of counting arrivals: every word reads :data:`PARTIAL_EMPTY` between launches
(the polling program empties what it read), so the slots, too, need no memset.
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
_OWNERS: dict[torch.device, list] = {}             # device -> the stream that took each slot last (None: unknown)
_LOCK = threading.Lock()


def arrival_counters(device: torch.device, n: int) -> Optional[torch.Tensor]:
    """``n`` zeroed int32 counters on ``device``, or None while a CUDA graph is being captured and no
    buffer that large exists yet."""
    return _take_slot(_BUFFERS, _OUTGROWN, _NEXT_SLOT, _OWNERS, RING, torch.device(device), n, MIN_COUNTERS, 0)


def _take_slot(buffers: dict, outgrown: list, next_slot: dict, owners: dict, ring: int, device: torch.device,
               n: int, min_width: int, value: int) -> Optional[torch.Tensor]:
    """The next of ``ring`` rows of ``device``'s int32 buffer (a larger one, every word ``value``, made when it
    is too narrow, the old one kept alive), its first ``n`` words; None where that would allocate inside a
    capture.

    A slot is free again once the launch that took it last has finished. On one stream that holds once
    ``ring`` later launches were made (PDL overlaps neighbours only); a launch on another stream may still be
    running, so the current stream waits for that stream's work first. A capture cannot wait on a stream
    outside it (and a graph replays on any stream): a slot taken while capturing has no known owner."""
    capturing = _capturing(device)
    with _LOCK:
        buf = buffers.get(device)
        if buf is None or buf.shape[1] < n:
            if capturing:
                return None
            if buf is not None:
                outgrown.append(buf)
            buf = buffers[device] = _int32s_outside_graph_pools((ring, max(n, min_width)), value, device)
        slot = next_slot.get(device, 0)
        next_slot[device] = (slot + 1) % ring
        stream = None if capturing else _current_stream(device)
        slot_owners = owners.setdefault(device, [None] * ring)
        last, slot_owners[slot] = slot_owners[slot], stream
    if stream is not None and last is not None and last != stream:
        stream.wait_stream(last)
    return buf[slot, :n]


def _current_stream(device: torch.device):
    """The stream a launch on ``device`` goes to, None where there are no streams (CPU)."""
    return torch.cuda.current_stream(device) if device.type == "cuda" else None


def all_zero() -> bool:
    """Whether every counter of every buffer is back at zero (tests: each launch must rearm its own)."""
    return all(not b.any() for b in (*_BUFFERS.values(), *_OUTGROWN))


# A partial-sum word not written yet: a NaN payload no arithmetic produces (the GPU's NaN results are
# canonical, 0x7FFFFFFF), so a written fp32 partial never equals it.
PARTIAL_EMPTY = 0x7FBADBAD
PARTIAL_RING = 8                 # fewer than RING: a row holds (splits - 1) x M x N words, not one per tile
MIN_PARTIAL_WORDS = 1 << 16

_PARTIALS: dict[torch.device, torch.Tensor] = {}   # device -> [PARTIAL_RING, n] int32, the newest
_PARTIALS_OUTGROWN: list[torch.Tensor] = []
_PARTIALS_NEXT: dict[torch.device, int] = {}
_PARTIALS_OWNERS: dict[torch.device, list] = {}


def partial_slots(device: torch.device, numel: int) -> Optional[torch.Tensor]:
    """``numel`` fp32 words on ``device``, all ``PARTIAL_EMPTY``, or None while a CUDA graph is being captured
    and no buffer that large exists yet (the caller then sums its partials behind an arrival counter)."""
    words = _take_slot(_PARTIALS, _PARTIALS_OUTGROWN, _PARTIALS_NEXT, _PARTIALS_OWNERS, PARTIAL_RING,
                       torch.device(device), numel, MIN_PARTIAL_WORDS, PARTIAL_EMPTY)
    return None if words is None else words.view(torch.float32)


def partials_all_empty() -> bool:
    """Whether every partial slot is back at PARTIAL_EMPTY (tests: each launch must empty what it used)."""
    return all(bool((b == PARTIAL_EMPTY).all()) for b in (*_PARTIALS.values(), *_PARTIALS_OUTGROWN))


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _int32s_outside_graph_pools(shape: tuple, value: int, device: torch.device) -> torch.Tensor:
    """int32s, all ``value``, from the ordinary allocator. Inductor's CUDA-graph trees route every allocation of
    the warming-up thread into their private pool and fail on a live block they do not own, so a buffer
    kept for good is made on a thread of its own."""
    made = []
    worker = threading.Thread(
        target=lambda: made.append(torch.full(shape, value, dtype=torch.int32, device=device)))
    worker.start()
    worker.join()
    if not made:
        raise RuntimeError(f"could not allocate split-K arrival counters or partial slots on {device}")
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # filled on that thread's stream: done before any use here
    return made[0]
