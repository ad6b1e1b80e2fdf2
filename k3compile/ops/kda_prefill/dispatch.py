"""Which implementation of ``k3::kda_prefill`` runs: fla's ``chunk_kda`` (``triton.py``) on a GPU wherever it takes
the shapes, else the reference's chunked recurrence. Nothing here imports fla or Triton."""
from __future__ import annotations

from k3compile.backends import Impl, OpImpls, register_op_impls

from .reference import kda_prefill_ref
from .triton import fla_available, fla_supports, kda_prefill_fla

KDA_PREFILL = register_op_impls(OpImpls(
    "kda_prefill",
    reference=Impl(kda_prefill_ref),
    triton=Impl(kda_prefill_fla, available=fla_available, supports=fla_supports),
))


def key(q, v, state, chunk_size) -> tuple:
    """(device type, details): what the predicates read (device, head dims, dtypes)."""
    B, T, H, K = q.shape
    return (q.device.type, (q.dtype, v.dtype, f"H={H}", f"K={K}", f"V={v.shape[-1]}", f"C={chunk_size}",
                            "empty" if B * T == 0 else "tokens"))


def select(backend: str, q, k, v, g, beta, state, chunk_size):
    """The implementation to run for the op's arguments, its choice recorded."""
    return KDA_PREFILL.select(backend, key(q, v, state, chunk_size), q, k, v, g, beta, state, chunk_size)
