"""The shared arrival-counter buffers of the single-launch split-K kernels (k3compile/ops/arrival_counters.py)."""
import torch

from k3compile.ops import arrival_counters


def test_slots_rotate_and_start_zeroed(monkeypatch):
    monkeypatch.setattr(arrival_counters, "_BUFFERS", {})
    monkeypatch.setattr(arrival_counters, "_NEXT_SLOT", {})
    cpu = torch.device("cpu")
    slots = [arrival_counters.arrival_counters(cpu, 10) for _ in range(arrival_counters.RING + 1)]
    assert all(s.numel() == 10 and not s.any() for s in slots)
    ptrs = [s.data_ptr() for s in slots]
    assert len(set(ptrs[:-1])) == arrival_counters.RING      # overlapping launches get distinct counters
    assert ptrs[-1] == ptrs[0]                               # then the ring wraps


def test_buffers_grow_outside_capture_only_and_are_never_freed(monkeypatch):
    monkeypatch.setattr(arrival_counters, "_BUFFERS", {})
    monkeypatch.setattr(arrival_counters, "_OUTGROWN", [])
    cpu = torch.device("cpu")
    small = arrival_counters.arrival_counters(cpu, 10)
    big = arrival_counters.arrival_counters(cpu, 5000)
    assert big.numel() == 5000 and not big.any()
    assert len(arrival_counters._OUTGROWN) == 1 and arrival_counters._OUTGROWN[0].data_ptr() <= small.data_ptr()
    monkeypatch.setattr(arrival_counters, "_capturing", lambda device: True)
    assert arrival_counters.arrival_counters(cpu, 4000) is not None    # fits: no allocation needed
    assert arrival_counters.arrival_counters(cpu, 9000) is None        # would allocate inside a capture
    assert arrival_counters.all_zero()
