"""Small building blocks: KimiRMSNorm, SiTU-GLU, the SiTU-GLU MLP, tensor-parallel linears.

Shape legend: M tokens (B*T flattened), D hidden, I intermediate (local to this TP rank).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .parallel import SINGLE, TPContext, all_reduce, mark_shard


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
