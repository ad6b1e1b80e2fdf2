"""Plain-PyTorch absorbed MLA decode: the ground truth of ``k3::mla_decode`` (``model/mla.py`` ``mla_attend``).

Shape legend: B batch, T new tokens, H heads (local to this TP rank), S cache allocation, N = qk_nope_head_dim,
R = qk_rope_head_dim, Vd = v_head_dim, Lk = kv_lora_rank.

In fp32 throughout: the query absorbed into the latent space, scores against c_kv and k_pe, the mask, the softmax,
the latent output and its projection through w_v; the result is cast to q_nope's dtype. Key s of row b is visible
to query t iff ``min(start[b], pos + t) <= s <= pos + t`` (``start`` None: 0): a row's keys start at its first real
position, and a query before it (a left-padding query of a prompt) sees its own key only, as the model's
``mla_attend`` with ``start`` has it. Cache rows no query sees are never read (zeroed before use), so whatever they
hold cannot reach the output.
"""
from __future__ import annotations

from typing import Optional

import torch


def valid_keys(pos: torch.Tensor, start: Optional[torch.Tensor], B: int, T: int, S: int) -> torch.Tensor:
    """[B, T, S] bool: key s visible to query t of row b."""
    s = torch.arange(S, device=pos.device)
    query_pos = pos + torch.arange(T, device=pos.device)                       # [T]
    visible = s[None, None, :] <= query_pos[None, :, None]                      # [1, T, S]
    if start is not None:
        first = torch.minimum(start[:, None], query_pos[None, :])               # [B, T]
        visible = visible & (s[None, None, :] >= first[..., None])
    return visible.expand(B, T, S)


def mla_decode_ref(q_nope: torch.Tensor, q_pe: torch.Tensor, c_kv: torch.Tensor, k_pe: torch.Tensor,
                   w_kv_b: torch.Tensor, pos: torch.Tensor, scale: float,
                   start: Optional[torch.Tensor] = None) -> torch.Tensor:
    """See ``k3compile.ops.mla_decode.mla_decode`` for the arguments; returns ``[B, T, H, Vd]``."""
    B, T, H, N = q_nope.shape
    S = c_kv.shape[1]
    visible = valid_keys(pos, start, B, T, S)                                   # [B, T, S]
    read = visible.any(1)                                                       # [B, S]: rows of the cache used
    c = c_kv.float().masked_fill(~read[..., None], 0)                          # [B, S, Lk]
    kp = k_pe.float().masked_fill(~read[..., None], 0)                         # [B, S, R]
    w = w_kv_b.float()
    w_k, w_v = w[:, :N], w[:, N:]                                               # [H, N, Lk], [H, Vd, Lk]
    q_lat = torch.einsum("bthn,hnl->bthl", q_nope.float(), w_k)                 # [B, T, H, Lk]
    scores = torch.einsum("bthl,bsl->bhts", q_lat, c) + torch.einsum("bthr,bsr->bhts", q_pe.float(), kp)
    scores = (scores * scale).masked_fill(~visible[:, None], float("-inf"))     # [B, H, T, S]
    probs = torch.softmax(scores, dim=-1)                                       # every query sees its own key
    o_lat = torch.einsum("bhts,bsl->bthl", probs, c)                            # [B, T, H, Lk]
    return torch.einsum("bthl,hvl->bthv", o_lat, w_v).to(q_nope.dtype).contiguous()   # the fake's layout
