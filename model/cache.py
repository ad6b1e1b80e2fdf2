"""Static-shape inference state, updated in place so that every decode step runs the same compiled graph.

Shape legend: B batch, S max length, P = H*K (KDA width local to this TP rank), W conv kernel,
Lk kv_lora_rank, R qk_rope_head_dim.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import torch


@dataclass
class KDAState:
    conv_q: torch.Tensor          # [B, P, W-1] model dtype: the last W-1 projected inputs
    conv_k: torch.Tensor
    conv_v: torch.Tensor
    recurrent: torch.Tensor       # [B, H, V, K] fp32

    def tensors(self):
        return (self.conv_q, self.conv_k, self.conv_v, self.recurrent)


@dataclass
class MLAState:
    c_kv: torch.Tensor            # [B, S, Lk] normalised latent KV
    k_pe: torch.Tensor            # [B, S, R] the un-rotated shared key part

    def tensors(self):
        return (self.c_kv, self.k_pe)


class KimiK3Cache:
    """Per-layer KDA / MLA state plus ``pos``, a 0-dim int64 tensor: how many tokens are already in the cache
    (a tensor, not a Python int, so that advancing it does not change what torch.compile guards on), and
    ``start``: None, or for a left-padded batch each row's first real position [B] int64 (its padding count).

    Padding positions stay out of the state: the KDA layers zero their projected inputs there (the short
    convolutions then see the zeros a fresh sequence sees, and the recurrent state stays exactly zero), and
    the MLA layers hide cache keys before ``start`` (``model/mla.py: mla_attend``). A batch without padding
    keeps ``start`` None, and its graphs hold no padding op at all."""

    def __init__(self, layers: list, pos: torch.Tensor, max_len: int, start: Optional[torch.Tensor] = None):
        self.layers = layers
        self.pos = pos
        self.max_len = max_len
        self.start = None
        self.set_start(start)
        # The compiled step mutates these in place. Static addresses let CUDA graphs
        # (mode="reduce-overhead") keep that mutation inside the graph instead of skipping
        # it; unguarded, so a new cache re-records a graph rather than recompiling.
        for t in self.tensors():
            torch._dynamo.mark_static_address(t)

    def tensors(self):
        """Every state tensor, ``pos`` last."""
        return [t for state in self.layers for t in state.tensors()] + [self.pos]

    @classmethod
    def allocate(cls, text_model, batch: int, max_len: int, dtype: Optional[torch.dtype] = None,
                 device: Optional[Union[str, torch.device]] = None) -> "KimiK3Cache":
        """Zeroed state for ``batch`` sequences of up to ``max_len`` tokens for every layer of ``text_model``."""
        ref = text_model.embed_tokens.weight
        dtype = dtype or ref.dtype
        device = device if device is not None else ref.device
        layers = []
        for layer in text_model.layers:
            attn = layer.self_attn
            if layer.is_mla:
                layers.append(MLAState(
                    c_kv=torch.zeros(batch, max_len, attn.kv_lora_rank, dtype=dtype, device=device),
                    k_pe=torch.zeros(batch, max_len, attn.rope, dtype=dtype, device=device)))
            else:
                P, W = attn.q_conv1d.weight.shape[0], attn.q_conv1d.weight.shape[-1]
                H, K = attn.num_heads, attn.head_dim
                layers.append(KDAState(
                    *(torch.zeros(batch, P, W - 1, dtype=dtype, device=device) for _ in range(3)),
                    recurrent=torch.zeros(batch, H, K, K, dtype=torch.float32, device=device)))
        return cls(layers, torch.zeros((), dtype=torch.long, device=device), max_len)

    @property
    def batch_size(self) -> int:
        return self.layers[0].tensors()[0].shape[0]

    def set_start(self, start: Optional[torch.Tensor]) -> None:
        """Before the first token: ``start`` [B] int64, row b's tokens begin at position start[b] (the
        positions before it are left padding), or None when no row is padded."""
        if start is not None:
            if start.shape != (self.batch_size,) or start.dtype != torch.long:
                raise ValueError(f"start must be a [{self.batch_size}] int64 tensor, got {start.dtype} "
                                 f"{list(start.shape)}")
        self.start = start

    def reset(self) -> None:
        """An empty cache again (no tokens, no padding)."""
        for t in self.tensors():
            t.zero_()
        self.start = None
