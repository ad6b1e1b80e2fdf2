"""Triton KDA decode step: one program per (batch row, q/k head) streams its heads' fp32 states once.

Each program does, for its head: the three short-conv updates (+ SiLU) on the channels it reads, the
gate, β, the q/k L2 norms, the delta-rule update of the ``[V, K]`` state tile held in registers, the
output ``o = S q`` and the sigmoid-gated RMSNorm of ``o`` (a program owns all V rows of its head, so the
norm needs no cross-program reduction). States are updated in place. With grouped value heads a program
loops over the HV/H value heads of its q/k head, so each conv state has exactly one reader and writer.

Runs on CUDA/ROCm, and on CPU tensors under ``TRITON_INTERPRET=1`` (CI).
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from k3compile.backends import Reason, triton_can_run_on

# A [V, K] fp32 tile lives in registers; beyond 128 x 128 it spills (and needs a V-split we do not have).
MAX_HEAD_DIM = 128
MAX_CONV_WIDTH = 8


@triton.jit
def _round_to(x, dtype: tl.constexpr):
    """fp32 ``x`` rounded to ``dtype`` (round-to-nearest-even), returned in that dtype.

    bf16 is rounded by hand: the Triton interpreter (CPU CI) truncates fp32 -> bf16 casts, which would
    make CI compare a different rounding than the GPU runs.
    """
    if dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        # NaN stays NaN (the add could carry a NaN's low mantissa bits into an infinity)
        return tl.where(x != x, x, bits.to(tl.float32, bitcast=True)).to(tl.bfloat16)
    else:
        return x.to(dtype)


@triton.jit
def _short_conv_step(p_x, p_state, p_w, o_c, m_c, W: tl.constexpr, BW: tl.constexpr):
    """SiLU(Σ_j w[c, j] · window[c, j]) for window = [state[c, :], x[c]]; shifts x into the state.

    The window is one [C, BW] tile (column W-1 holds x); the new state is the same tile stored one column
    to the left. A barrier separates every thread's loads from any thread's stores: a tile element can be
    held by several threads (more threads than elements), and without it a fast warp could overwrite a
    state column that a slower warp has not read yet.
    """
    o_w = tl.arange(0, BW)
    b_x = tl.load(p_x + o_c, mask=m_c, other=0)
    p_win = p_state + o_c[:, None] * (W - 1) + o_w[None, :]
    b_win = tl.load(p_win, mask=m_c[:, None] & (o_w[None, :] < W - 1), other=0)
    b_win = tl.where(o_w[None, :] == W - 1, b_x[:, None], b_win)
    b_w = tl.load(p_w + o_c[:, None] * W + o_w[None, :], mask=m_c[:, None] & (o_w[None, :] < W), other=0)
    b_y = tl.sum(b_win.to(tl.float32) * b_w.to(tl.float32), 1)
    tl.debug_barrier()
    tl.store(p_win - 1, b_win.to(p_state.dtype.element_ty),
             mask=m_c[:, None] & (o_w[None, :] >= 1) & (o_w[None, :] < W))
    b_y = b_y * tl.sigmoid(b_y)
    # the model casts the conv output back to the activation dtype before normalising it
    return _round_to(b_y, b_x.dtype).to(tl.float32)


@triton.jit
def kda_decode_kernel(
    q, k, v, conv_q, conv_k, conv_v, w_q, w_k, w_v,
    f, A_log, dt_bias, beta, gate, norm_w, state, o,
    stride_q, stride_k, stride_v, stride_cq, stride_ck, stride_cv,
    stride_f, stride_beta, stride_gate, stride_state, stride_o,
    lower_bound, scale, eps,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, W: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, BW: tl.constexpr, USE_LOWER_BOUND: tl.constexpr,
):
    i_b = tl.program_id(0).to(tl.int64)
    i_h = tl.program_id(1)

    o_k = tl.arange(0, BK)
    o_v = tl.arange(0, BV)
    m_k = o_k < K
    m_v = o_v < V
    m_s = m_v[:, None] & m_k[None, :]
    # Issue the first state tile's load before any conv-state store: the compiler cannot prove the
    # pointers disjoint, so a load placed after a store would wait for it (and for the conv math).
    p_s = state + i_b * stride_state + (i_h * (HV // H)) * V * K + o_v[:, None] * K + o_k[None, :]
    b_s_next = tl.load(p_s, mask=m_s, other=0, eviction_policy="evict_first")

    b_q = _short_conv_step(q + i_b * stride_q + i_h * K, conv_q + i_b * stride_cq + i_h * K * (W - 1),
                           w_q + i_h * K * W, o_k, m_k, W, BW)
    b_k = _short_conv_step(k + i_b * stride_k + i_h * K, conv_k + i_b * stride_ck + i_h * K * (W - 1),
                           w_k + i_h * K * W, o_k, m_k, W, BW)
    b_q = b_q * tl.rsqrt(tl.sum(b_q * b_q) + 1e-6) * scale
    b_k = b_k * tl.rsqrt(tl.sum(b_k * b_k) + 1e-6)
    b_nw = tl.load(norm_w + o_v, mask=m_v, other=0).to(tl.float32)

    # The program owns every value head of its q/k head (grouped value heads), so the q/k conv states
    # are shifted exactly once and no other program reads them.
    for i_g in tl.static_range(HV // H):
        i_hv = i_h * (HV // H) + i_g
        b_v = _short_conv_step(v + i_b * stride_v + i_hv * V, conv_v + i_b * stride_cv + i_hv * V * (W - 1),
                               w_v + i_hv * V * W, o_v, m_v, W, BW)

        b_f = tl.load(f + i_b * stride_f + i_hv * K + o_k, mask=m_k, other=0).to(tl.float32)
        b_f += tl.load(dt_bias + i_hv * K + o_k, mask=m_k, other=0).to(tl.float32)
        b_a = tl.exp(tl.load(A_log + i_hv).to(tl.float32))
        if USE_LOWER_BOUND:
            b_g = lower_bound * tl.sigmoid(b_a * b_f)
        else:
            # softplus with torch's threshold (x > 20 -> x), written stably
            b_sp = tl.maximum(b_f, 0.0) + tl.log(1.0 + tl.exp(-tl.abs(b_f)))
            b_g = -b_a * tl.where(b_f > 20.0, b_f, b_sp)
        b_beta = tl.sigmoid(tl.load(beta + i_b * stride_beta + i_hv).to(tl.float32))

        # delta rule on the V-first state tile S [V, K]; prefetch the next value head's tile
        b_s = b_s_next
        p_s = state + i_b * stride_state + i_hv * V * K + o_v[:, None] * K + o_k[None, :]
        if i_g + 1 < HV // H:
            b_s_next = tl.load(p_s + V * K, mask=m_s, other=0, eviction_policy="evict_first")
        b_s *= tl.exp(b_g)[None, :]
        b_u = b_beta * (b_v - tl.sum(b_s * b_k[None, :], 1))
        b_s += b_u[:, None] * b_k[None, :]
        b_o = tl.sum(b_s * b_q[None, :], 1)
        tl.store(p_s, b_s, mask=m_s)

        # sigmoid-gated RMSNorm over the head's V outputs
        b_rstd = tl.rsqrt(tl.sum(b_o * b_o) / V + eps)
        b_gate = tl.load(gate + i_b * stride_gate + i_hv * V + o_v, mask=m_v, other=0).to(tl.float32)
        b_out = b_o * b_rstd * b_nw * tl.sigmoid(b_gate)
        tl.store(o + i_b * stride_o + i_hv * V + o_v, _round_to(b_out, o.dtype.element_ty), mask=m_v)


def default_num_warps(K: int, V: int) -> int:
    """Warps per program. A 128 x 128 fp32 state tile compiles (sm_90, ptxas) to ~204 registers a thread at
    4 warps and ~181 at 8. Measured on the H200 (benchmarks/results/kda_decode_warps_h200.json, B 64/256 x
    H 12/96): 8 warps run 1.6-1.7x faster than 4 and 7% faster than 16 at every size, 2.0-2.2x the
    state-traffic floor; small tiles keep 4."""
    if K * V < 64 * 128:
        return 4
    return 8


def triton_available(*args) -> Reason:
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    return triton_can_run_on(*tensors)


def triton_supports(q, k, v, conv_state_q, conv_state_k, conv_state_v, conv_weight_q, conv_weight_k,
                    conv_weight_v, f, A_log, dt_bias, lower_bound, beta_logits, out_gate, o_norm_weight,
                    state, eps) -> Reason:
    B, HV, V, K = state.shape
    if K > MAX_HEAD_DIM or V > MAX_HEAD_DIM:
        return f"head dims K={K}, V={V} > {MAX_HEAD_DIM} (the state tile would not fit in registers)"
    W = conv_weight_q.shape[-1]
    if W > MAX_CONV_WIDTH:
        return f"conv width {W} > {MAX_CONV_WIDTH}"
    if state.dtype != torch.float32:
        return f"state dtype {state.dtype} (kernel keeps an fp32 state)"
    # batch strides are free; everything inside a row must be packed
    for name, t in (("q", q), ("k", k), ("v", v), ("f", f), ("out_gate", out_gate), ("beta_logits", beta_logits)):
        if t.stride(-1) != 1:
            return f"{name} is not contiguous in its last dim (stride {t.stride()})"
    for name, t in (("conv_state_q", conv_state_q), ("conv_state_k", conv_state_k),
                    ("conv_state_v", conv_state_v), ("state", state)):
        if not t[0].is_contiguous():
            return f"{name} rows are not packed (strides {t.stride()})"
    for name, t in (("conv_weight_q", conv_weight_q), ("conv_weight_k", conv_weight_k),
                    ("conv_weight_v", conv_weight_v), ("A_log", A_log), ("dt_bias", dt_bias),
                    ("o_norm_weight", o_norm_weight)):
        if not t.is_contiguous():
            return f"{name} is not contiguous"
    return None


def kda_decode_triton(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    conv_state_q: torch.Tensor, conv_state_k: torch.Tensor, conv_state_v: torch.Tensor,
    conv_weight_q: torch.Tensor, conv_weight_k: torch.Tensor, conv_weight_v: torch.Tensor,
    f: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, lower_bound: Optional[float],
    beta_logits: torch.Tensor, out_gate: torch.Tensor, o_norm_weight: torch.Tensor,
    state: torch.Tensor, eps: float, num_warps: Optional[int] = None, out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Launch the kernel; ``out`` (``[B, HV*V]``, v's dtype, row-contiguous) lets tests poison the output."""
    B, HV, V, K = state.shape
    H = q.shape[-1] // K
    W = conv_weight_q.shape[-1]
    o = torch.empty(B, HV * V, dtype=v.dtype, device=v.device) if out is None else out
    if B == 0:
        return o
    kda_decode_kernel[(B, H)](
        q, k, v, conv_state_q, conv_state_k, conv_state_v, conv_weight_q, conv_weight_k, conv_weight_v,
        f, A_log, dt_bias, beta_logits, out_gate, o_norm_weight, state, o,
        q.stride(0), k.stride(0), v.stride(0),
        conv_state_q.stride(0), conv_state_k.stride(0), conv_state_v.stride(0),
        f.stride(0), beta_logits.stride(0), out_gate.stride(0), state.stride(0), o.stride(0),
        0.0 if lower_bound is None else float(lower_bound), K ** -0.5, float(eps),
        H=H, HV=HV, K=K, V=V, W=W,
        BK=triton.next_power_of_2(K), BV=triton.next_power_of_2(V), BW=triton.next_power_of_2(W),
        USE_LOWER_BOUND=lower_bound is not None,
        num_warps=num_warps or default_num_warps(K, V),
    )
    return o
