"""``k3compile.ops.kda_prefill``: the KDA recurrence over a prompt, state in place (``k3::kda_prefill``)."""
from __future__ import annotations

import torch

from .dispatch import KDA_PREFILL
from .op import kda_prefill_op

__all__ = ["kda_prefill", "KDA_PREFILL"]


def kda_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                state: torch.Tensor, chunk_size: int = 16, backend: str = "auto") -> torch.Tensor:
    """The delta-rule recurrence over T tokens (``model/kda.py``'s chunked form), updating the state in place.

    Legend: B batch, T tokens, H heads, K key head dim, V value head dim.

    Args:
        q: ``[B, T, H, K]``, L2-normalised and scaled by K^-0.5 (the kernel applies no scale).
        k: ``[B, T, H, K]``, L2-normalised.
        v: ``[B, T, H, V]``.
        g: ``[B, T, H, K]``, the per-token log-decay (<= 0).
        beta: ``[B, T, H]``, post-sigmoid.
        state: ``[B, H, V, K]`` fp32, V-first (the decode op's layout). **Mutated**: enters as the state before
            token 0, leaves as the state after token T-1.
        chunk_size: the reference's chunk length (``kda_chunked``'s); fla chooses its own.
        backend: "auto" | "triton" (fla's ``chunk_kda``) | "reference" (see ``k3compile.backends``).

    Returns:
        o ``[B, T, H, V]`` fp32: o_t = S_t q_t.

    Limits: fla runs on CUDA tensors with K, V <= 256; anything else runs the reference (recorded).

    Example::

        o = kda_prefill(q, k, v, g, beta, S)      # then kda_decode(..., state=S, ...) continues
    """
    return kda_prefill_op(q, k, v, g, beta, state, chunk_size, backend)
