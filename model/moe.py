"""Latent mixture of experts (spec §6.2): route on the full hidden, run the experts in a narrower latent.

Shape legend: M tokens (B*T), D hidden, E experts, A active experts per token (top-k), L latent
(routed_expert_hidden_size), I expert intermediate (local to this TP rank).

Under TP the router, the latent down/up projections and the latent norm are replicated; each expert's w1/w3 are
column- and w2 row-sharded over I, so the rank's routed latent is a partial sum, as is the shared experts'
output. Both are all-reduced *before* the latent RMSNorm (which is not linear).

The experts are held as float stacks or as the published MXFP4 (``Experts.packed``); each form has a gathered and
a dense function, and the MXFP4 ones dequantise only what they use (the selected experts, or a chunk of experts)
to the activations' dtype, then run the float math, so both forms give the same result on the same values.
"""
from __future__ import annotations

import re
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from .layers import KimiMLP, RMSNorm, activation_betas, situ_glu
from .mxfp4 import GROUP, dequantize_mxfp4, quantize_mxfp4
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


def _gathered(z: torch.Tensor, weights: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor, beta,
              linear_beta) -> torch.Tensor:
    """z [M, L], weights [M, A], each token's own experts w1/w3 [M, A, I, L], w2 [M, A, L, I] -> [M, L]."""
    zc = z[:, None, :, None]                                               # [M, 1, L, 1]
    gate = (w1 @ zc).squeeze(-1)                                           # [M, A, I]
    up = (w3 @ zc).squeeze(-1)
    h = situ_glu(gate, up, beta, linear_beta)
    y = (w2 @ h[..., None]).squeeze(-1)                                    # [M, A, L]
    return (y.float() * weights[..., None]).sum(1).to(z.dtype)


def experts_gathered(z: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, w1: torch.Tensor,
                     w3: torch.Tensor, w2: torch.Tensor, beta, linear_beta) -> torch.Tensor:
    """Each token through its own A experts (weights gathered by index; for few tokens, e.g. decode).

    z [M, L], experts/weights [M, A], w1/w3 [E, I, L], w2 [E, L, I] -> [M, L] (combined in fp32, cast to z's dtype).
    """
    return _gathered(z, weights, w1[experts], w3[experts], w2[experts], beta, linear_beta)


def experts_gathered_mxfp4(z: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, w1_packed: torch.Tensor,
                           w1_scale: torch.Tensor, w3_packed: torch.Tensor, w3_scale: torch.Tensor,
                           w2_packed: torch.Tensor, w2_scale: torch.Tensor, beta, linear_beta) -> torch.Tensor:
    """:func:`experts_gathered` on MXFP4 experts: the selected experts' codes and scales gathered by index,
    dequantised to z's dtype, then the same math (so the same result as the float form holding those values).

    w1/w3_packed [E, I, L/2], w1/w3_scale [E, I, L/32], w2_packed [E, L, I/2], w2_scale [E, L, I/32] (uint8).
    """
    w1 = dequantize_mxfp4(w1_packed[experts], w1_scale[experts], z.dtype)  # [M, A, I, L]
    w3 = dequantize_mxfp4(w3_packed[experts], w3_scale[experts], z.dtype)
    w2 = dequantize_mxfp4(w2_packed[experts], w2_scale[experts], z.dtype)  # [M, A, L, I]
    return _gathered(z, weights, w1, w3, w2, beta, linear_beta)


def _dense_outputs(z: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor, beta,
                   linear_beta) -> torch.Tensor:
    """Every token through each of the given experts: z [M, L], w1/w3 [E, I, L], w2 [E, L, I] -> y [E, M, L]."""
    gate = torch.einsum("ml,eil->emi", z, w1)                              # [E, M, I]
    up = torch.einsum("ml,eil->emi", z, w3)
    h = situ_glu(gate, up, beta, linear_beta)
    return torch.einsum("emi,eli->eml", h, w2)                             # [E, M, L]


def _dense_combine(y: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """y [E, M, L] -> sum over experts weighted by the router (0 where not selected), in fp32 -> [M, L]."""
    combine = torch.zeros(z.shape[0], y.shape[0], dtype=torch.float32, device=z.device)
    combine = combine.scatter(1, experts, weights)                         # [M, E]
    return (y.float() * combine.t()[..., None]).sum(0).to(z.dtype)


def experts_dense(z: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, w1: torch.Tensor,
                  w3: torch.Tensor, w2: torch.Tensor, beta, linear_beta) -> torch.Tensor:
    """Every token through every expert, unselected ones weighted 0 (for many tokens, e.g. prefill).

    Same arguments and result as :func:`experts_gathered`.
    """
    return _dense_combine(_dense_outputs(z, w1, w3, w2, beta, linear_beta), experts, weights, z)


# Dequantised weights the dense MXFP4 form holds at once (K3's TP=8 rank in bf16: 65 experts a chunk).
DENSE_CHUNK_BYTES = 512 * 2 ** 20


def dense_chunk_experts(num_experts: int, latent: int, intermediate: int, dtype: torch.dtype,
                        budget: Optional[int] = None) -> int:
    """Experts a chunk of :func:`experts_dense_mxfp4` dequantises: as many as ``budget`` bytes hold (at least 1)."""
    per_expert = 3 * latent * intermediate * torch.empty((), dtype=dtype).element_size()
    return max(1, min(num_experts, (DENSE_CHUNK_BYTES if budget is None else budget) // per_expert))


def experts_dense_mxfp4(z: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, w1_packed: torch.Tensor,
                        w1_scale: torch.Tensor, w3_packed: torch.Tensor, w3_scale: torch.Tensor,
                        w2_packed: torch.Tensor, w2_scale: torch.Tensor, beta, linear_beta,
                        chunk: Optional[int] = None) -> torch.Tensor:
    """:func:`experts_dense` on MXFP4 experts (shapes as :func:`experts_gathered_mxfp4`), dequantising ``chunk``
    experts at a time (default: :func:`dense_chunk_experts`, never more than ``DENSE_CHUNK_BYTES`` of weights).

    Each chunk's per-expert outputs [chunk, M, L] are computed as the float form computes them and combined as it
    combines all of them, so the result is the float form's on the dequantised values wherever a batched product
    does not round differently for a batch of ``chunk`` experts than for all E: always with one chunk, and on the
    CPU at one thread (the tests); multi-threaded BLAS and GPU libraries may pick other kernels per batch size.
    """
    E, I, L = w1_packed.shape[0], w1_packed.shape[1], 2 * w1_packed.shape[2]
    chunk = chunk or dense_chunk_experts(E, L, I, z.dtype)
    ys = []
    for s in range(0, E, chunk):
        part = slice(s, s + chunk)
        w1 = dequantize_mxfp4(w1_packed[part], w1_scale[part], z.dtype)    # [chunk, I, L]
        w3 = dequantize_mxfp4(w3_packed[part], w3_scale[part], z.dtype)
        w2 = dequantize_mxfp4(w2_packed[part], w2_scale[part], z.dtype)    # [chunk, L, I]
        ys.append(_dense_outputs(z, w1, w3, w2, beta, linear_beta))
    y = ys[0] if len(ys) == 1 else torch.cat(ys)                           # [E, M, L]
    return _dense_combine(y, experts, weights, z)


class MoEGate(nn.Module):
    """Router weight [E, D] and the aux-loss-free correction bias [E] (fp32 in the checkpoint)."""

    def __init__(self, num_experts: int, hidden_size: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(num_experts))


# Experts' weight forms: "mxfp4" (packed) or a float dtype, by the names from_pretrained(experts=...) accepts.
EXPERT_FORMS = {"mxfp4": None, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "float16": torch.float16,
                "fp16": torch.float16, "float32": torch.float32, "fp32": torch.float32}
PROJECTIONS = ("w1", "w2", "w3")
TP_DIM = {"w1": 1, "w3": 1, "w2": 2}   # the dimension of the stacks TP splits (I), in both forms
# state-dict suffix of a per-expert tensor -> the stacked parameter's suffix
_PACKED_PARTS = {"weight_packed": "_packed", "weight_scale": "_scale"}
_EXPERT_KEY = re.compile(r"^(\d+)\.(w1|w2|w3)\.(weight|weight_packed|weight_scale)$")


def experts_dtype(form) -> Optional[torch.dtype]:
    """``"mxfp4"`` -> None (packed); a float form's name or a torch float dtype -> that dtype."""
    if isinstance(form, torch.dtype) and form.is_floating_point:
        return form
    if form not in EXPERT_FORMS:
        raise ValueError(f"experts={form!r}: expected one of {sorted(EXPERT_FORMS)} or a torch float dtype")
    return EXPERT_FORMS[form]


class Experts(nn.Module):
    """Routed experts as stacked weights, gathered by index. Two forms (``packed`` says which):

    - float: w1, w3 [E, I, L] and w2 [E, L, I];
    - MXFP4 (:mod:`.mxfp4`, as published): codes w1_packed, w3_packed [E, I, L/2], w2_packed [E, L, I/2] and E8M0
      scales w1_scale, w3_scale [E, I, L/32], w2_scale [E, L, I/32], uint8 parameters without gradient.

    Under TP both shard I: w1/w3 rows, w2 columns (for MXFP4, I/tp must then be a multiple of 32). State dicts use
    the published per-expert names ``{e}.w1.weight`` [I, L], or ``{e}.w1.weight_packed`` / ``weight_scale``
    (state-dict hooks convert). :meth:`to_mxfp4` / :meth:`to_float` convert in place.
    """

    def __init__(self, num_experts: int, latent: int, intermediate: int, tp: TPContext = SINGLE,
                 packed: bool = False):
        super().__init__()
        self.num_experts, self.latent = num_experts, latent
        self.intermediate = tp.split(intermediate, "moe_intermediate_size")
        self.tp_world = tp.world
        self.packed = False
        E, I, L = num_experts, self.intermediate, latent
        self.w1 = mark_shard(nn.Parameter(torch.empty(E, I, L)), TP_DIM["w1"])
        self.w3 = mark_shard(nn.Parameter(torch.empty(E, I, L)), TP_DIM["w3"])
        self.w2 = mark_shard(nn.Parameter(torch.empty(E, L, I)), TP_DIM["w2"])
        if packed:
            self.to_mxfp4(values=False)
        self.register_state_dict_post_hook(_split_experts)
        self.register_load_state_dict_pre_hook(_stack_experts)

    def param_names(self) -> tuple[str, ...]:
        """The stacked parameters of the current form."""
        if self.packed:
            return tuple(f"{w}{part}" for w in PROJECTIONS for part in ("_packed", "_scale"))
        return PROJECTIONS

    def check_mxfp4(self) -> None:
        """MXFP4 groups 32 input columns: L for w1/w3, this rank's I for w2."""
        if self.latent % GROUP:
            raise ValueError(f"MXFP4 experts need the latent width ({self.latent}) to be a multiple of {GROUP}")
        if self.intermediate % GROUP:
            raise ValueError(
                f"MXFP4 experts shard w2's columns (moe_intermediate_size / tp = {self.intermediate} at tp = "
                f"{self.tp_world}) in whole groups of {GROUP}: use a tensor-parallel size that leaves a multiple "
                f"of {GROUP}, or float experts")

    @torch.no_grad()
    def to_mxfp4(self, values: bool = True) -> "Experts":
        """Quantise the float stacks in place (exact for values MXFP4 holds). On meta, or with ``values=False``,
        only the shapes change (uninitialised codes and scales)."""
        if self.packed:
            return self
        self.check_mxfp4()
        for w in PROJECTIONS:
            full = self._parameters.pop(w)
            if full.is_meta or not values:
                E, R, C = full.shape
                codes = torch.empty(E, R, C // 2, dtype=torch.uint8, device=full.device)
                scale = torch.empty(E, R, C // GROUP, dtype=torch.uint8, device=full.device)
            else:
                codes, scale = quantize_mxfp4(full)
            for part, t in (("_packed", codes), ("_scale", scale)):
                self.register_parameter(w + part, mark_shard(nn.Parameter(t, requires_grad=False), TP_DIM[w]))
        self.packed = True
        return self

    @torch.no_grad()
    def to_float(self, dtype: torch.dtype) -> "Experts":
        """Dequantise in place to ``dtype`` (or cast the float stacks to it)."""
        for w in PROJECTIONS:
            if self.packed:
                codes, scale = self._parameters.pop(w + "_packed"), self._parameters.pop(w + "_scale")
                if codes.is_meta:
                    full = torch.empty(*codes.shape[:-1], 2 * codes.shape[-1], dtype=dtype, device="meta")
                else:
                    full = dequantize_mxfp4(codes, scale, dtype)
                self.register_parameter(w, mark_shard(nn.Parameter(full), TP_DIM[w]))
            else:
                getattr(self, w).data = getattr(self, w).data.to(dtype)
        self.packed = False
        return self


def _split_experts(module: Experts, state_dict: dict, prefix: str, local_metadata) -> None:
    for name in module.param_names():
        stacked = state_dict.pop(prefix + name)
        w, part = name[:2], name[2:]
        suffix = {"": "weight", "_packed": "weight_packed", "_scale": "weight_scale"}[part]
        for e in range(module.num_experts):
            state_dict[f"{prefix}{e}.{w}.{suffix}"] = stacked[e]


def _stack_experts(module: Experts, state_dict: dict, prefix: str, local_metadata, strict, missing_keys,
                   unexpected_keys, error_msgs) -> None:
    wanted = set(module.param_names())
    found: dict = {}
    for key in [k for k in state_dict if k.startswith(prefix)]:
        m = _EXPERT_KEY.match(key[len(prefix):])
        if m and m.group(2) + _PACKED_PARTS.get(m.group(3), "") in wanted:
            found[(m.group(2) + _PACKED_PARTS.get(m.group(3), ""), int(m.group(1)))] = state_dict.pop(key)
    for name in module.param_names():
        per_expert = [found.get((name, e)) for e in range(module.num_experts)]
        if all(t is not None for t in per_expert):
            state_dict[prefix + name] = torch.stack(per_expert)
        elif any(t is not None for t in per_expert):
            missing = [e for e, t in enumerate(per_expert) if t is None]
            error_msgs.append(f"{prefix}: experts {missing[:8]} lack {name}")
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
        gathered = x.shape[0] * self.top_k <= self.num_experts
        ex = self.experts
        if ex.packed:
            run = experts_gathered_mxfp4 if gathered else experts_dense_mxfp4
            return run(z, experts, weights, ex.w1_packed, ex.w1_scale, ex.w3_packed, ex.w3_scale, ex.w2_packed,
                       ex.w2_scale, self.beta, self.linear_beta)
        run = experts_gathered if gathered else experts_dense
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
