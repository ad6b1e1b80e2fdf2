"""``k3compile.ops.mla_decode``: absorbed MLA attention of a decode step over the valid prefix (``k3::mla_decode``)."""
from __future__ import annotations

from typing import Optional

import torch

from .dispatch import MLA_DECODE
from .op import mla_decode_op

__all__ = ["mla_decode", "MLA_DECODE"]


def mla_decode(q_nope: torch.Tensor, q_pe: torch.Tensor, c_kv: torch.Tensor, k_pe: torch.Tensor,
               w_kv_b: torch.Tensor, pos: torch.Tensor, scale: float, start: Optional[torch.Tensor] = None,
               backend: str = "auto") -> torch.Tensor:
    """Causal attention of T new queries over the latent cache, absorbed (``model/mla.py`` ``mla_attend``), reading
    only each row's valid keys (``[start[b], pos + T)``): the step's cost follows the valid length, not the allocation.

    Legend: B batch, T new tokens (a decode step: 1, or a few when verifying drafts), H heads of this TP rank,
    S cache allocation, N = qk_nope_head_dim, R = qk_rope_head_dim, Vd = v_head_dim, Lk = kv_lora_rank.

    Args:
        q_nope: ``[B, T, H, N]``; q_pe: ``[B, T, H, R]`` (any strides: slices of the query projection).
        c_kv: ``[B, S, Lk]`` normalised latent cache; k_pe: ``[B, S, R]``. The new tokens' latents are already
            written at ``pos .. pos + T - 1``. Not mutated.
        w_kv_b: ``[H, N + Vd, Lk]``, ``kv_b_proj.weight`` of the rank as heads: rows ``:N`` absorb the query,
            rows ``N:`` read the value back.
        pos: 0-dim int64 (or int32) tensor, on the inputs' device: how many tokens the cache held before this step.
        scale: the softmax scale (``(N + R) ** -0.5``).
        start: optional ``[B]`` int64 (or int32): row b's first valid key (left padding); None: 0.
        backend: "auto" | "triton" | "reference" (see ``k3compile.backends``).

    Key s of row b is visible to query t iff ``min(start[b], pos + t) <= s <= pos + t``: from the row's first real
    position, or, for a query before it (left padding in a prompt), its own key alone -- the model's rule
    (``model/mla.py``). All tensors share one device; q_nope, q_pe, c_kv, k_pe, w_kv_b are fp32, bf16 or fp16 (the
    kernel takes one dtype for all; mixed runs the reference).

    Returns:
        ``[B, T, H, Vd]`` in q_nope's dtype.

    Limits: the Triton kernel takes Lk <= 1024 and R <= 256; beyond, the reference runs (recorded).

    Example::

        o = mla_decode(q_nope, q_pe, cache.c_kv, cache.k_pe, w_kv_b, cache.pos, (128 + 64) ** -0.5)  # [B, 1, 12, 128]
    """
    return mla_decode_op(q_nope, q_pe, c_kv, k_pe, w_kv_b, pos, scale, start, backend)
