"""Small building blocks: KimiRMSNorm, SiTU-GLU, the SiTU-GLU MLP, tensor-parallel linears, the embedding and the
output head split by vocabulary.

Shape legend: M tokens (B*T flattened), D hidden, I intermediate (local to this TP rank), V vocabulary, Vr = V / tp.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .parallel import SINGLE, TPContext, all_gather, all_reduce, mark_shard


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """KimiRMSNorm: normalise in fp32, cast back to x's dtype, then multiply by the weight."""
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def situ(x: torch.Tensor, beta: float) -> torch.Tensor:
    """SiTU: a soft-capped SiLU, beta * tanh(x / beta) * sigmoid(x) (bounded by beta)."""
    return beta * torch.tanh(x / beta) * torch.sigmoid(x)


def situ_glu(gate: torch.Tensor, up: torch.Tensor, beta: float, linear_beta) -> torch.Tensor:
    """SiTU-GLU in fp32, cast back: situ_beta(gate) * linear_beta * tanh(up / linear_beta).

    ``beta=None`` means plain SiLU (Kimi Linear); ``linear_beta=None`` leaves ``up`` uncapped.
    """
    g, u = gate.float(), up.float()
    act = F.silu(g) if beta is None else situ(g, beta)
    if linear_beta is not None:
        u = linear_beta * torch.tanh(u / linear_beta)
    return (act * u).to(gate.dtype)


def activation_betas(config) -> tuple:
    """(beta, linear_beta) of the configured GLU activation."""
    if config.hidden_act == "situ":
        return config.activation_situ_beta, config.activation_situ_linear_beta
    return None, None


def column_linear(in_features: int, out_features: int, tp: TPContext, what: str = "out_features") -> nn.Linear:
    """Linear whose output rows are split over the TP group (bias-free, like every K3 projection)."""
    lin = nn.Linear(in_features, tp.split(out_features, what), bias=False)
    mark_shard(lin.weight, 0)
    return lin


def row_linear(in_features: int, out_features: int, tp: TPContext, what: str = "in_features") -> nn.Linear:
    """Linear whose input columns are split over the TP group; its output is a partial sum."""
    lin = nn.Linear(tp.split(in_features, what), out_features, bias=False)
    mark_shard(lin.weight, 1)
    return lin


class KimiMLP(nn.Module):
    """down(SiTU-GLU(gate(x), up(x))): the dense layer-0 FFN and the shared experts.

    Under TP gate/up are column- and down row-parallel; ``reduce=False`` returns the rank's partial sum (the latent
    MoE reduces it together with the routed latent).
    """

    def __init__(self, config, hidden_size: int, intermediate_size: int, tp: TPContext = SINGLE,
                 reduce: bool = True):
        super().__init__()
        self.tp, self.reduce = tp, reduce
        self.beta, self.linear_beta = activation_betas(config)
        self.gate_proj = column_linear(hidden_size, intermediate_size, tp, "intermediate_size")
        self.up_proj = column_linear(hidden_size, intermediate_size, tp, "intermediate_size")
        self.down_proj = row_linear(intermediate_size, hidden_size, tp, "intermediate_size")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.down_proj(situ_glu(self.gate_proj(x), self.up_proj(x), self.beta, self.linear_beta))
        return all_reduce(y, self.tp) if self.reduce else y


class VocabParallelEmbedding(nn.Module):
    """The token embedding [V, D] split by vocabulary over the TP group (as serving engines split it): rank r holds
    rows r·Vr .. (r+1)·Vr - 1 (``weight`` [Vr, D], sharded on dim 0; the vocabulary must split evenly: K3's 163840
    does over every power of two up to 2^15, so nothing is padded). Each rank looks up the ids it holds, zeros the
    others, and the all-reduce adds the one row each token has (exact: the other ranks add zeros). Without TP a
    plain lookup. ``num_embeddings`` is the whole vocabulary."""

    def __init__(self, num_embeddings: int, embedding_dim: int, tp: TPContext = SINGLE):
        super().__init__()
        self.tp, self.num_embeddings = tp, num_embeddings
        rows = tp.split(num_embeddings, "vocab_size")
        self.vocab_start = tp.rank * rows
        self.weight = mark_shard(nn.Parameter(torch.empty(rows, embedding_dim)), 0)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [...] int64 in [0, V) -> [..., D]."""
        if self.tp.world == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.vocab_start
        held = (local >= 0) & (local < self.weight.shape[0])
        rows = F.embedding(torch.where(held, local, 0), self.weight)
        return all_reduce(torch.where(held[..., None], rows, 0), self.tp)


class VocabParallelHead(nn.Module):
    """The output projection [V, D] split by vocabulary (column-parallel, ``weight`` [Vr, D] sharded on dim 0): each
    rank's logits for the rows it holds, all-gathered along the vocabulary, so every rank returns all V logits
    [..., V]. Without TP a plain bias-free linear."""

    def __init__(self, hidden_size: int, vocab_size: int, tp: TPContext = SINGLE):
        super().__init__()
        self.tp = tp
        self.weight = mark_shard(nn.Parameter(torch.empty(tp.split(vocab_size, "vocab_size"), hidden_size)), 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., D] -> logits [..., V]."""
        return all_gather(F.linear(x, self.weight), self.tp, dim=-1)
