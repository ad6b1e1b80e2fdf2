"""Plain-PyTorch KDA prefill: the ground truth of ``k3::kda_prefill``.

The chunked form is the model's own :func:`k3compile.model.kda.kda_chunked` (the function the
``kda_prefill`` pass proves a graph equal to), so the reference path reproduces the unfused graph
exactly. :func:`kda_sequential_ref` is the token-by-token recurrence both must equal (tests).

Shape legend: B batch, T tokens, H heads, K key head dim, V value head dim.
"""
from __future__ import annotations

import torch

from k3compile.model.kda import kda_chunked, kda_recurrent_step


def kda_prefill_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                    state: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """q, k, g ``[B, T, H, K]``, v ``[B, T, H, V]``, beta ``[B, T, H]``, state ``[B, H, V, K]`` fp32 (updated)
    -> o ``[B, T, H, V]`` fp32."""
    return kda_chunked(q, k, v, g, beta, state, chunk_size=chunk_size)


def kda_sequential_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                       state: torch.Tensor) -> torch.Tensor:
    """T decode steps of the delta rule, one token at a time (same arguments, no chunks)."""
    outs = [kda_recurrent_step(q[:, t].float(), k[:, t].float(), v[:, t].float(), g[:, t].float(),
                               beta[:, t].float(), state) for t in range(q.shape[1])]
    return torch.stack(outs, dim=1)
