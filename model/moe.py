"""Latent mixture of experts (spec §6.2): route on the full hidden, run the experts in a narrower latent.

Shape legend: M tokens (B*T), D hidden, E experts, A active experts per token (top-k), L latent
(routed_expert_hidden_size), I expert intermediate (local to this TP rank).

Under TP the router, the latent down/up projections and the latent norm are replicated; each expert's w1/w3 are
column- and w2 row-sharded over I, so the rank's routed latent is a partial sum, as is the shared experts'
output. Both are all-reduced *before* the latent RMSNorm (which is not linear).
"""
from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from .layers import KimiMLP, RMSNorm, activation_betas, situ_glu
from .parallel import SINGLE, TPContext, all_reduce, mark_shard


def route(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, top_k: int, renormalize: bool,
          scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Sigmoid scores in fp32, top-k of (score + correction bias), weights from the unbiased scores.

    x [M, D], weight [E, D], bias [E] -> (weights [M, A] fp32, experts [M, A] int64).
    """
    scores = torch.sigmoid(F.linear(x.float(), weight.float()))           # [M, E]
    _, experts = torch.topk(scores + bias.float(), top_k, dim=-1)         # [M, A]
    weights = scores.gather(-1, experts)
    if renormalize:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return weights * scaling, experts


def experts_gathered(z: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, w1: torch.Tensor,
                     w3: torch.Tensor, w2: torch.Tensor, beta, linear_beta) -> torch.Tensor:
    """Each token through its own A experts (weights gathered by index; for few tokens, e.g. decode).

    z [M, L], experts/weights [M, A], w1/w3 [E, I, L], w2 [E, L, I] -> [M, L] (combined in fp32, cast to z's dtype).
    """
    zc = z[:, None, :, None]                                               # [M, 1, L, 1]
    gate = (w1[experts] @ zc).squeeze(-1)                                  # [M, A, I]
    up = (w3[experts] @ zc).squeeze(-1)
    h = situ_glu(gate, up, beta, linear_beta)
    y = (w2[experts] @ h[..., None]).squeeze(-1)                           # [M, A, L]
    return (y.float() * weights[..., None]).sum(1).to(z.dtype)


def experts_dense(z: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, w1: torch.Tensor,
                  w3: torch.Tensor, w2: torch.Tensor, beta, linear_beta) -> torch.Tensor:
    """Every token through every expert, unselected ones weighted 0 (for many tokens, e.g. prefill).

    Same arguments and result as :func:`experts_gathered`.
    """
    combine = torch.zeros(z.shape[0], w1.shape[0], dtype=torch.float32, device=z.device)
    combine = combine.scatter(1, experts, weights)                         # [M, E]
    gate = torch.einsum("ml,eil->emi", z, w1)                              # [E, M, I]
    up = torch.einsum("ml,eil->emi", z, w3)
    h = situ_glu(gate, up, beta, linear_beta)
    y = torch.einsum("emi,eli->eml", h, w2)                                # [E, M, L]
    return (y.float() * combine.t()[..., None]).sum(0).to(z.dtype)


class MoEGate(nn.Module):
    """Router weight [E, D] and the aux-loss-free correction bias [E] (fp32 in the checkpoint)."""

    def __init__(self, num_experts: int, hidden_size: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(num_experts))


_EXPERT_KEY = re.compile(r"^(\d+)\.(w1|w2|w3)\.weight$")


class Experts(nn.Module):
    """Routed experts as stacked weights w1, w3 [E, I, L] and w2 [E, L, I] (gathered by index), stored and
    loaded under the published per-expert names ``{e}.w1.weight`` [I, L] (state-dict hooks convert)."""

    def __init__(self, num_experts: int, latent: int, intermediate: int, tp: TPContext = SINGLE):
        super().__init__()
        I = tp.split(intermediate, "moe_intermediate_size")
        self.num_experts = num_experts
        self.w1 = mark_shard(nn.Parameter(torch.empty(num_experts, I, latent)), 1)
        self.w3 = mark_shard(nn.Parameter(torch.empty(num_experts, I, latent)), 1)
        self.w2 = mark_shard(nn.Parameter(torch.empty(num_experts, latent, I)), 2)
        self.register_state_dict_post_hook(_split_experts)
        self.register_load_state_dict_pre_hook(_stack_experts)


def _split_experts(module: Experts, state_dict: dict, prefix: str, local_metadata) -> None:
    for name in ("w1", "w2", "w3"):
        stacked = state_dict.pop(prefix + name)
        for e in range(module.num_experts):
            state_dict[f"{prefix}{e}.{name}.weight"] = stacked[e]


def _stack_experts(module: Experts, state_dict: dict, prefix: str, local_metadata, strict, missing_keys,
                   unexpected_keys, error_msgs) -> None:
    found: dict = {}
    for key in [k for k in state_dict if k.startswith(prefix)]:
        m = _EXPERT_KEY.match(key[len(prefix):])
        if m:
            found[(m.group(2), int(m.group(1)))] = state_dict.pop(key)
    for name in ("w1", "w2", "w3"):
        per_expert = [found.get((name, e)) for e in range(module.num_experts)]
        if all(t is not None for t in per_expert):
            state_dict[prefix + name] = torch.stack(per_expert)
        elif any(t is not None for t in per_expert):
            missing = [e for e, t in enumerate(per_expert) if t is None]
            error_msgs.append(f"{prefix}: experts {missing[:8]} lack {name}.weight")
    extra = [key for key in found if key[1] >= module.num_experts]
    if extra:
        error_msgs.append(f"{prefix}: checkpoint has experts beyond {module.num_experts}")


class KimiLatentMoE(nn.Module):
    """Router -> latent down-projection -> top-k SiTU-GLU experts -> fp32 combine -> (all-reduce) ->
    latent RMSNorm -> up-projection -> + shared experts."""

    def __init__(self, config, tp: TPContext = SINGLE):
        super().__init__()
        D, E = config.hidden_size, config.num_experts
        L = config.routed_expert_hidden_size or D
        self.tp = tp
        self.top_k, self.num_experts = config.num_experts_per_token, E
        self.renormalize, self.scaling = config.moe_renormalize, config.routed_scaling_factor
        self.beta, self.linear_beta = activation_betas(config)
        self.gate = MoEGate(E, D)
        self.latent = config.routed_expert_hidden_size is not None
        if self.latent:
            self.routed_expert_down_proj = nn.Linear(D, L, bias=False)
        self.experts = Experts(E, L, config.moe_intermediate_size, tp)
        if self.latent and config.latent_moe_use_norm:
            self.routed_expert_norm = RMSNorm(L, config.rms_norm_eps)
        if self.latent:
            self.routed_expert_up_proj = nn.Linear(L, D, bias=False)
        if config.num_shared_experts:
            self.shared_experts = KimiMLP(config, D, config.moe_intermediate_size * config.num_shared_experts,
                                          tp, reduce=False)

    def routed_latent(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, D] -> this rank's partial routed latent [M, L]."""
        weights, experts = route(x, self.gate.weight, self.gate.e_score_correction_bias, self.top_k,
                                 self.renormalize, self.scaling)
        z = self.routed_expert_down_proj(x) if self.latent else x          # [M, L]
        run = experts_gathered if x.shape[0] * self.top_k <= self.num_experts else experts_dense
        ex = self.experts
        return run(z, experts, weights, ex.w1, ex.w3, ex.w2, self.beta, self.linear_beta)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, T, D] -> [B, T, D]."""
        shape = x.shape
        x = x.reshape(-1, shape[-1])                                      # [M, D]
        y_lat = self.routed_latent(x)
        shared = self.shared_experts(x) if hasattr(self, "shared_experts") else None
        if self.tp.world > 1:
            y_lat = all_reduce(y_lat, self.tp)
            if shared is not None:
                shared = all_reduce(shared, self.tp)
        if hasattr(self, "routed_expert_norm"):
            y_lat = self.routed_expert_norm(y_lat)
        out = self.routed_expert_up_proj(y_lat) if self.latent else y_lat
        if shared is not None:
            out = out + shared
        return out.reshape(shape)
