"""Helpers the test suite (and GPU benchmarks' correctness checks) share."""
import torch


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """‖out − ref‖ / ‖ref‖ in float64. A NaN anywhere in ``out`` fails: an unwritten (NaN-poisoned) element or
    bad math must never pass as a large-but-finite error."""
    assert not torch.isnan(out).any(), "NaN in the output (unwritten element or bad math)"
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()
