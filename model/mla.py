"""Gated NoPE multi-head latent attention (spec §5.2), in the absorbed form over a latent KV cache.

Shape legend: B batch, T new tokens, S cache length, D hidden, H heads (local to this TP rank),
N = qk_nope_head_dim, R = qk_rope_head_dim (never rotated: K3 is NoPE), Vd = v_head_dim, Lk = kv_lora_rank.
The cache holds the normalised latent c_kv [B, S, Lk] and k_pe [B, S, R]; new tokens are written at
positions pos .. pos+T-1 (pos a 0-dim tensor, so decode steps share one graph), keys are masked by position.
Absorbing kv_b_proj into the query and the output gives the same math as expanding k and v per head.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from .layers import RMSNorm, column_linear, row_linear
from .parallel import SINGLE, TPContext, all_reduce


def write_latent(cache: torch.Tensor, pos: torch.Tensor, new: torch.Tensor) -> None:
    """cache [B, S, X] <- new [B, T, X] at positions pos .. pos+T-1 (in place)."""
    index = pos + torch.arange(new.shape[1], device=new.device)
    cache.index_copy_(1, index, new)


def mla_attend(q_nope: torch.Tensor, q_pe: torch.Tensor, c_kv: torch.Tensor, k_pe: torch.Tensor,
               w_kv_b: torch.Tensor, pos: torch.Tensor, scale: float,
               start: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Causal attention of T new queries over the cache, absorbed. q_nope [B, T, H, N], q_pe [B, T, H, R],
    c_kv [B, S, Lk], k_pe [B, S, R], w_kv_b [H, N + Vd, Lk] -> [B, T, H, Vd].

    start [B] int64 (left padding, ``model/cache.py``): key s of row b is visible to query t iff
    start[b] <= s <= pos + t. A padding query of a prefill (pos + t < start[b]) would see no key, and its
    NaN would reach the cache through the next layers; it sees its own key instead (T == 1 is a decode step,
    whose token is never padding, so its mask is exactly the rule above)."""
    N = q_nope.shape[-1]
    T, S = q_nope.shape[1], c_kv.shape[1]
    w_k, w_v = w_kv_b[:, :N], w_kv_b[:, N:]                                 # [H, N, Lk], [H, Vd, Lk]
    q_lat = torch.einsum("bthn,hnl->bthl", q_nope, w_k)                     # [B, T, H, Lk]
    scores = torch.einsum("bthl,bsl->bhts", q_lat, c_kv) + torch.einsum("bthr,bsr->bhts", q_pe, k_pe)
    query_pos = pos + torch.arange(T, device=c_kv.device)                   # [T]
    key_pos = torch.arange(S, device=c_kv.device)
    visible = key_pos[None, :] <= query_pos[:, None]                        # [T, S]
    if start is not None:
        first = start[:, None, None]                                        # [B, 1, 1]
        if T > 1:
            first = torch.minimum(first, query_pos[None, :, None])          # [B, T, 1]
        visible = (visible & (key_pos >= first))[:, None]                   # [B, 1, T, S]
    scores = scores.float().mul(scale).masked_fill(~visible, float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(c_kv.dtype)                    # [B, H, T, S]
    o_lat = torch.einsum("bhts,bsl->bthl", probs, c_kv)                     # [B, T, H, Lk]
    return torch.einsum("bthl,hvl->bthv", o_lat, w_v)


class KimiMLAAttention(nn.Module):
    def __init__(self, config, layer_idx: int, tp: TPContext = SINGLE):
        super().__init__()
        D, heads = config.hidden_size, config.num_attention_heads
        self.tp, self.layer_idx = tp, layer_idx
        self.num_heads = tp.split(heads, "MLA num_attention_heads")
        self.nope, self.rope, self.v_dim = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
        self.kv_lora_rank = config.kv_lora_rank
        qk = self.nope + self.rope
        self.scale = qk ** -0.5
        lora_eps = getattr(config, "mla_lora_norm_eps", 1e-6)
        if config.q_lora_rank is not None:
            self.q_a_proj = nn.Linear(D, config.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(config.q_lora_rank, lora_eps)
            self.q_b_proj = column_linear(config.q_lora_rank, heads * qk, tp)
        else:
            self.q_proj = column_linear(D, heads * qk, tp)
        self.kv_a_proj_with_mqa = nn.Linear(D, self.kv_lora_rank + self.rope, bias=False)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, lora_eps)
        self.kv_b_proj = column_linear(self.kv_lora_rank, heads * (self.nope + self.v_dim), tp)
        self.use_output_gate = config.mla_use_output_gate
        if self.use_output_gate:
            self.g_proj = column_linear(D, heads * self.v_dim, tp)
        self.o_proj = row_linear(heads * self.v_dim, D, tp)

    def query(self, x: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "q_a_proj"):
            return self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        return self.q_proj(x)

    def forward(self, x: torch.Tensor, state, pos: torch.Tensor, start: Optional[torch.Tensor] = None) -> torch.Tensor:
        """x [B, T, D], state: an ``MLAState`` (new latents written in place), pos: 0-dim long,
        start: each row's first real position [B] or None (see :func:`mla_attend`) -> [B, T, D]."""
        B, T, _ = x.shape
        H = self.num_heads
        q = self.query(x).reshape(B, T, H, self.nope + self.rope)
        q_nope, q_pe = q[..., :self.nope], q[..., self.nope:]
        latent = self.kv_a_proj_with_mqa(x)                                    # [B, T, Lk + R]
        c_kv = self.kv_a_layernorm(latent[..., :self.kv_lora_rank])
        write_latent(state.c_kv, pos, c_kv)
        write_latent(state.k_pe, pos, latent[..., self.kv_lora_rank:])
        w_kv_b = self.kv_b_proj.weight.reshape(H, self.nope + self.v_dim, self.kv_lora_rank)
        o = mla_attend(q_nope, q_pe, state.c_kv, state.k_pe, w_kv_b, pos, self.scale, start)  # [B, T, H, Vd]
        if self.use_output_gate:
            o = o * torch.sigmoid(self.g_proj(x).reshape(B, T, H, self.v_dim))
        return all_reduce(self.o_proj(o.reshape(B, T, H * self.v_dim)), self.tp)
