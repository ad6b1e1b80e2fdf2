"""Kimi Delta Attention (spec §5.1): short convolutions, a per-channel forget gate, the delta rule.

Shape legend: B batch, T tokens, D hidden, H heads (local to this TP rank), K = V = head_dim, P = H*K,
W = conv kernel (4), C = prefill chunk length, n = number of chunks.
State per layer: conv_state_{q,k,v} [B, P, W-1] (model dtype) and recurrent_state [B, H, V, K] fp32
(V-first: S maps a key to a value), all updated in place.

The decode step (T == 1) is a chain of small module-level functions in plain torch ops; the compiler's KDA
patterns match exactly these forms. Prefill runs the same recurrence chunk-wise and leaves the states exactly
where T decode steps would.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from .layers import RMSNorm, column_linear, row_linear
from .parallel import SINGLE, TPContext, all_reduce, mark_shard


# -- decode step -----------------------------------------------------------------------------------------------
def short_conv_decode(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [B, P], conv_state [B, P, W-1] (updated), weight [P, 1, W] -> silu(causal depthwise conv) [B, P]."""
    window = torch.cat([conv_state, x[..., None]], dim=-1)                # [B, P, W]
    y = F.silu((window.float() * weight[:, 0].float()).sum(-1)).to(x.dtype)
    conv_state.copy_(window[..., 1:])
    return y


def kda_gate_lower_bound(f: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
                         lower_bound: float) -> torch.Tensor:
    """K3's bounded log-decay: lb * sigmoid(exp(A_log)[h] * (f + dt_bias)), in (lb, 0). f [..., H, K] -> fp32."""
    H, K = f.shape[-2:]
    a = torch.exp(A_log.float())[:, None]                                  # [H, 1]
    return lower_bound * torch.sigmoid(a * (f.float() + dt_bias.float().reshape(H, K)))


def kda_gate_softplus(f: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor) -> torch.Tensor:
    """Kimi Linear's log-decay: -exp(A_log)[h] * softplus(f + dt_bias). f [..., H, K] -> fp32."""
    H, K = f.shape[-2:]
    a = torch.exp(A_log.float())[:, None]
    return -a * F.softplus(f.float() + dt_bias.float().reshape(H, K))


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x * rsqrt(sum(x^2) + eps) over the last dim, in fp32."""
    xf = x.float()
    return xf * torch.rsqrt(xf.pow(2).sum(-1, keepdim=True) + eps)


def kda_recurrent_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                       state: torch.Tensor) -> torch.Tensor:
    """One delta-rule step, fp32. q, k, g [B, H, K], v [B, H, V], beta [B, H], state [B, H, V, K] (updated).

    S <- S * exp(g) (decay each key column); u = beta * (v - S k); S <- S + u k^T; o = S q.
    """
    S = state * torch.exp(g)[:, :, None, :]
    u = beta[..., None] * (v - (S @ k[..., None]).squeeze(-1))
    S = S + u[..., None] * k[:, :, None, :]
    o = (S @ q[..., None]).squeeze(-1)                                     # [B, H, V]
    state.copy_(S)
    return o


def gated_rms_norm(o: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """o [B, H, V] -> o * rsqrt(mean(o^2) + eps) * w * sigmoid(gate), in fp32, cast to gate's (model) dtype."""
    of = o.float()
    y = of * torch.rsqrt(of.pow(2).mean(-1, keepdim=True) + eps) * weight.float() * torch.sigmoid(gate.float())
    return y.to(gate.dtype)


# -- prefill ---------------------------------------------------------------------------------------------------
def short_conv_prefill(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [B, T, P], conv_state [B, P, W-1] (updated; the inputs before x), weight [P, 1, W] -> [B, T, P]."""
    window = torch.cat([conv_state, x.transpose(1, 2)], dim=-1)           # [B, P, W-1+T]
    y = F.conv1d(window.float(), weight.float(), groups=weight.shape[0])  # [B, P, T]
    conv_state.copy_(window[..., window.shape[-1] - conv_state.shape[-1]:])
    return F.silu(y).transpose(1, 2).to(x.dtype)


def kda_chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                state: torch.Tensor, chunk_size: int = 16) -> torch.Tensor:
    """The delta-rule recurrence over T tokens, chunk-wise, fp32; equal to T calls of :func:`kda_recurrent_step`.

    q, k, g [B, T, H, K], v [B, T, H, V], beta [B, T, H], state [B, H, V, K] (updated) -> o [B, T, H, V].

    Within a chunk, with Gam the cumulative log-decay from the chunk start and S0 the state before it, the
    effective values u_t = beta_t (v_t - S_{t-1} diag(exp g_t) k_t) solve the unit-lower-triangular system
    (I + A) U = beta (V - (exp(Gam) * K) S0^T),  A[t, j] = beta_t sum_d k_t k_j exp(Gam_t - Gam_j), j < t;
    then S_t = S0 diag(exp Gam_t) + sum_{j<=t} u_j (k_j exp(Gam_t - Gam_j))^T gives outputs and the end state.
    Only the S0 terms run sequentially over chunks. Padding tokens (k = v = beta = g = 0) leave S unchanged.
    """
    B, T, H, K = k.shape
    V = v.shape[-1]
    C = chunk_size
    n = math.ceil(T / C)
    pad = n * C - T
    q, k, v, g, beta = (t.float() for t in (q, k, v, g, beta))
    if pad:
        q, k, v, g = (F.pad(t, (0, 0, 0, 0, 0, pad)) for t in (q, k, v, g))
        beta = F.pad(beta, (0, 0, 0, pad))

    def chunks(t):  # [B, nC, H, X] -> [B, H, n, C, X]
        return t.reshape(B, n, C, H, -1).permute(0, 3, 1, 2, 4)

    q, k, v, g = chunks(q), chunks(k), chunks(v), chunks(g)
    beta = beta.reshape(B, n, C, H).permute(0, 3, 1, 2)                   # [B, H, n, C]
    gam = g.cumsum(-2)                                                     # [B, H, n, C, K]

    causal = torch.ones(C, C, dtype=torch.bool, device=k.device).tril()
    strict = causal.tril(-1)
    diff = gam[..., :, None, :] - gam[..., None, :, :]                     # [B, H, n, C(t), C(j), K]
    decay = torch.exp(diff.masked_fill(~causal[:, :, None], float("-inf")))
    A = (k[..., :, None, :] * k[..., None, :, :] * decay).sum(-1) * beta[..., None]
    eye = torch.eye(C, dtype=k.dtype, device=k.device)
    tri = eye + A.masked_fill(~strict, 0.0)                                # [B, H, n, C, C]
    u0 = torch.linalg.solve_triangular(tri, beta[..., None] * v, upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(tri, beta[..., None] * torch.exp(gam) * k, upper=False, unitriangular=True)
    qk = (q[..., :, None, :] * k[..., None, :, :] * decay).sum(-1)         # [B, H, n, C, C], j <= t
    q_decayed = torch.exp(gam) * q
    k_to_end = torch.exp(gam[..., -1:, :] - gam) * k                       # [B, H, n, C, K]
    end_decay = torch.exp(gam[..., -1, :])                                 # [B, H, n, K]

    S = state.float()
    outs = []
    for i in range(n):
        St = S.transpose(-1, -2)                                           # [B, H, K, V]
        u = u0[:, :, i] - w[:, :, i] @ St                                  # [B, H, C, V]
        outs.append(q_decayed[:, :, i] @ St + qk[:, :, i] @ u)
        S = S * end_decay[:, :, i, None, :] + u.transpose(-1, -2) @ k_to_end[:, :, i]
    state.copy_(S)
    o = torch.stack(outs, dim=2)                                           # [B, H, n, C, V]
    return o.permute(0, 2, 3, 1, 4).reshape(B, n * C, H, V)[:, :T]


# -- the layer -------------------------------------------------------------------------------------------------
class ShortConv(nn.Module):
    """Holds a depthwise causal conv weight [P, 1, W] under the published name ``*_conv1d.weight``."""

    def __init__(self, channels: int, kernel_size: int):
        super().__init__()
        self.weight = mark_shard(nn.Parameter(torch.empty(channels, 1, kernel_size)), 0)


class KimiDeltaAttention(nn.Module):
    def __init__(self, config, layer_idx: int, tp: TPContext = SINGLE):
        super().__init__()
        lac = config.linear_attn_config
        D, heads, K = config.hidden_size, lac["num_heads"], lac["head_dim"]
        self.tp, self.layer_idx = tp, layer_idx
        self.num_heads, self.head_dim = tp.split(heads, "KDA num_heads"), K
        P = heads * K
        W = lac.get("short_conv_kernel_size", 4)
        self.lower_bound = lac.get("gate_lower_bound")
        self.eps = config.rms_norm_eps
        self.q_proj = column_linear(D, P, tp)
        self.k_proj = column_linear(D, P, tp)
        self.v_proj = column_linear(D, P, tp)
        self.q_conv1d = ShortConv(P // tp.world, W)
        self.k_conv1d = ShortConv(P // tp.world, W)
        self.v_conv1d = ShortConv(P // tp.world, W)
        self.f_a_proj = nn.Linear(D, K, bias=False)
        self.f_b_proj = column_linear(K, P, tp)
        self.b_proj = column_linear(D, heads, tp)
        self.A_log = mark_shard(nn.Parameter(torch.empty(self.num_heads)), 0)
        self.dt_bias = mark_shard(nn.Parameter(torch.empty(P // tp.world)), 0)
        self.full_rank_gate = lac.get("use_full_rank_gate", True)
        if self.full_rank_gate:
            self.g_proj = column_linear(D, P, tp)
        else:  # Kimi Linear 48B: low-rank output gate
            self.g_a_proj = nn.Linear(D, K, bias=False)
            self.g_b_proj = column_linear(K, P, tp)
        self.o_norm = RMSNorm(K, config.rms_norm_eps)  # its weight, in the sigmoid-gated norm
        self.o_proj = row_linear(P, D, tp)

    def gate(self, f: torch.Tensor) -> torch.Tensor:
        if self.lower_bound is not None:
            return kda_gate_lower_bound(f, self.A_log, self.dt_bias, self.lower_bound)
        return kda_gate_softplus(f, self.A_log, self.dt_bias)

    def output_gate(self, x: torch.Tensor) -> torch.Tensor:
        return self.g_proj(x) if self.full_rank_gate else self.g_b_proj(self.g_a_proj(x))

    def forward(self, x: torch.Tensor, state, valid: Optional[torch.Tensor] = None) -> torch.Tensor:
        """x [B, T, D], state: a ``KDAState`` (updated in place), valid: None or [B, T] bool, False at left
        padding (a prefill's only: a decode step's token is never padding) -> [B, T, D]."""
        if x.shape[1] == 1:
            y = self.decode(x[:, 0], state)[:, None]
        else:
            y = self.prefill(x, state, valid)
        return all_reduce(y, self.tp)

    def decode(self, x: torch.Tensor, state) -> torch.Tensor:
        """x [B, D] -> [B, D] (this rank's partial sum under TP)."""
        B, H, K = x.shape[0], self.num_heads, self.head_dim
        q = short_conv_decode(self.q_proj(x), state.conv_q, self.q_conv1d.weight)          # [B, P]
        k = short_conv_decode(self.k_proj(x), state.conv_k, self.k_conv1d.weight)
        v = short_conv_decode(self.v_proj(x), state.conv_v, self.v_conv1d.weight)
        g = self.gate(self.f_b_proj(self.f_a_proj(x)).reshape(B, H, K))                     # [B, H, K] fp32
        beta = torch.sigmoid(self.b_proj(x).float())                                        # [B, H]
        q = l2_normalize(q.reshape(B, H, K)) * K ** -0.5
        k = l2_normalize(k.reshape(B, H, K))
        o = kda_recurrent_step(q, k, v.reshape(B, H, K).float(), g, beta, state.recurrent)  # [B, H, V]
        o = gated_rms_norm(o, self.output_gate(x).reshape(B, H, K), self.o_norm.weight, self.eps)
        return self.o_proj(o.reshape(B, H * K))

    def prefill(self, x: torch.Tensor, state, valid: Optional[torch.Tensor] = None) -> torch.Tensor:
        """x [B, T, D] -> [B, T, D] (this rank's partial sum under TP).

        valid [B, T] (left padding False): the projected q/k/v inputs of padding are zeroed before the short
        convolutions, so a row's first tokens see the zeros a fresh sequence sees, and at padding k =
        silu(conv(0)) = 0 and v = 0: the delta rule leaves the (zero) recurrent state exactly zero."""
        B, T = x.shape[:2]
        H, K = self.num_heads, self.head_dim

        def conv(proj: nn.Linear, conv_state: torch.Tensor, short_conv: ShortConv) -> torch.Tensor:  # [B, T, P]
            y = proj(x)
            if valid is not None:
                y = torch.where(valid[..., None], y, 0)
            return short_conv_prefill(y, conv_state, short_conv.weight)

        q = conv(self.q_proj, state.conv_q, self.q_conv1d)
        k = conv(self.k_proj, state.conv_k, self.k_conv1d)
        v = conv(self.v_proj, state.conv_v, self.v_conv1d)
        g = self.gate(self.f_b_proj(self.f_a_proj(x)).reshape(B, T, H, K))                  # [B, T, H, K]
        beta = torch.sigmoid(self.b_proj(x).float())                                        # [B, T, H]
        q = l2_normalize(q.reshape(B, T, H, K)) * K ** -0.5
        k = l2_normalize(k.reshape(B, T, H, K))
        o = kda_chunked(q, k, v.reshape(B, T, H, K), g, beta, state.recurrent)             # [B, T, H, V]
        o = gated_rms_norm(o, self.output_gate(x).reshape(B, T, H, K), self.o_norm.weight, self.eps)
        return self.o_proj(o.reshape(B, T, H * K))
