"""Triton KDA decode step: programs over (batch row, q/k head, V split) stream the fp32 states once.

Each program does, for its head: the three short-conv updates (+ SiLU), the gate, β, the q/k L2 norms,
the delta-rule update of its rows of the ``[V, K]`` state, the output ``o = S q`` and the sigmoid-gated
RMSNorm of ``o``. The delta rule is independent per V row (``u[v]``, ``S[v, :]`` and ``o[v]`` read only
row v of S), so the V rows of a head can be split over ``NSPLIT`` programs, each walking its rows in
tiles of ``BV`` rows with ``DEPTH`` tile loads in flight. The whole 128 x 128 fp32 tile in one program
leaves one 8-warp program per SM, which serialises load, math and store (2x the state-traffic floor on
the H200). Small tiles walked in order keep the next load overlapping the current math at any batch;
splits add programs where there are fewer heads than SMs (``default_config`` holds the measured choice).

What a split costs, and how it is paid:
- the RMSNorm spans all V rows: each program writes its unnormalised ``o`` rows (fp32) and its partial
  sum of squares to scratch, then takes a ticket from a per-(row, head) counter; the last program to
  arrive normalises the whole head and resets the counter to 0 for the next call;
- every split reads the q/k conv states, so the shifted states are written only by that last program,
  after all the readers have taken their tickets (a single writer, no reader left behind);
- the v conv channels are split with the V rows: each program shifts only its own.
With one split and one tile (``NSPLIT == 1``, ``BV >= V``) the norm runs in registers, no scratch.

States are updated in place. With grouped value heads a program loops over the HV/H value heads of its
q/k head. Runs on CUDA/ROCm, and on CPU tensors under ``TRITON_INTERPRET=1`` (CI; programs run in
order there, so the ticket logic is exercised too).
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from k3compile.ops.arrival_counters import arrival_counters
from k3compile.backends import Reason, triton_can_run_on

# One program's tile must fit in registers; a K row beyond 128 fp32 would spill.
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
def _short_conv_read(p_x, p_state, p_w, o_c, m_c, W: tl.constexpr, BW: tl.constexpr):
    """(SiLU(Σ_j w[c, j] · window[c, j]), window) for window = [state[c, :], x[c]] as one [C, BW] tile
    (column W-1 holds x). The state is not touched: :func:`_short_conv_shift` stores the window back."""
    o_w = tl.arange(0, BW)
    b_x = tl.load(p_x + o_c, mask=m_c, other=0)
    p_win = p_state + o_c[:, None] * (W - 1) + o_w[None, :]
    b_win = tl.load(p_win, mask=m_c[:, None] & (o_w[None, :] < W - 1), other=0)
    b_win = tl.where(o_w[None, :] == W - 1, b_x[:, None], b_win)
    b_w = tl.load(p_w + o_c[:, None] * W + o_w[None, :], mask=m_c[:, None] & (o_w[None, :] < W), other=0)
    b_y = tl.sum(b_win.to(tl.float32) * b_w.to(tl.float32), 1)
    b_y = b_y * tl.sigmoid(b_y)
    # the model casts the conv output back to the activation dtype before normalising it
    return _round_to(b_y, b_x.dtype).to(tl.float32), b_win


@triton.jit
def _short_conv_shift(p_state, b_win, o_c, m_c, W: tl.constexpr, BW: tl.constexpr):
    """Store the window one column to the left: the oldest input drops out, x becomes the newest.

    The barrier separates every thread's loads of the state from any thread's stores: a tile element can
    be held by several threads (more threads than elements), and without it a fast warp could overwrite
    a state column that a slower warp has not read yet.
    """
    o_w = tl.arange(0, BW)
    tl.debug_barrier()
    tl.store(p_state + o_c[:, None] * (W - 1) + o_w[None, :] - 1, b_win.to(p_state.dtype.element_ty),
             mask=m_c[:, None] & (o_w[None, :] >= 1) & (o_w[None, :] < W))


@triton.jit
def _load_state_tile(p_s0, row0, o_t, m_k, j: tl.constexpr, NT: tl.constexpr, BV: tl.constexpr,
                     V: tl.constexpr, K: tl.constexpr):
    """Tile j of a program's walk: value head j // NT of its group, rows (j % NT)·BV.. of its split."""
    m = (row0 + (j % NT) * BV + o_t < V)[:, None] & m_k[None, :]
    return tl.load(p_s0 + ((j // NT) * V * K + (j % NT) * BV * K), mask=m, other=0, eviction_policy="evict_first")


@triton.jit
def kda_decode_kernel(
    q, k, v, conv_q, conv_k, conv_v, w_q, w_k, w_v,
    f, A_log, dt_bias, beta, gate, norm_w, state, o, o_part, ss_part, tickets,
    stride_q, stride_k, stride_v, stride_cq, stride_ck, stride_cv,
    stride_f, stride_beta, stride_gate, stride_state, stride_o,
    lower_bound, scale, eps,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, W: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, BVH: tl.constexpr, BW: tl.constexpr,
    NSPLIT: tl.constexpr, NT: tl.constexpr, BS: tl.constexpr, DEPTH: tl.constexpr, USE_LOWER_BOUND: tl.constexpr,
):
    """Grid (B, H, NSPLIT). Split i_s owns V rows [i_s·NT·BV, (i_s+1)·NT·BV), walked in NT tiles of BV
    rows, DEPTH (1-3) tile loads ahead. BVH = next_pow2(V) (the whole head, for the norm), BS = next_pow2(NSPLIT).
    o_part [B, HV, V] fp32 and ss_part [B, HV, NSPLIT] fp32 are scratch; tickets [B, H] int32 is all
    zero on entry and left all zero (unused when NSPLIT == NT == 1)."""
    i_b = tl.program_id(0).to(tl.int64)
    i_h = tl.program_id(1)
    i_s = tl.program_id(2)
    G: tl.constexpr = HV // H
    IN_REGISTERS: tl.constexpr = NSPLIT == 1 and NT == 1

    o_k = tl.arange(0, BK)
    m_k = o_k < K
    o_t = tl.arange(0, BV)
    row0 = i_s * (NT * BV)
    p_s0 = state + i_b * stride_state + (i_h * G) * V * K + (row0 + o_t)[:, None] * K + o_k[None, :]
    # The program walks G * NT tiles (value head j // NT, rows j % NT) with DEPTH tile loads in flight.
    # The first loads are issued before any conv-state store: the compiler cannot prove the pointers
    # disjoint, so a load placed after a store would wait for it (and for the conv math).
    b_s1 = _load_state_tile(p_s0, row0, o_t, m_k, 0, NT, BV, V, K)
    if DEPTH >= 2 and G * NT >= 2:
        b_s2 = _load_state_tile(p_s0, row0, o_t, m_k, 1, NT, BV, V, K)
    if DEPTH >= 3 and G * NT >= 3:
        b_s3 = _load_state_tile(p_s0, row0, o_t, m_k, 2, NT, BV, V, K)

    p_cq = conv_q + i_b * stride_cq + i_h * K * (W - 1)
    p_ck = conv_k + i_b * stride_ck + i_h * K * (W - 1)
    b_q, b_win_q = _short_conv_read(q + i_b * stride_q + i_h * K, p_cq, w_q + i_h * K * W, o_k, m_k, W, BW)
    b_k, b_win_k = _short_conv_read(k + i_b * stride_k + i_h * K, p_ck, w_k + i_h * K * W, o_k, m_k, W, BW)
    if NSPLIT == 1:   # this program is the q/k conv states' only reader
        _short_conv_shift(p_cq, b_win_q, o_k, m_k, W, BW)
        _short_conv_shift(p_ck, b_win_k, o_k, m_k, W, BW)
    b_q = b_q * tl.rsqrt(tl.sum(b_q * b_q) + 1e-6) * scale
    b_k = b_k * tl.rsqrt(tl.sum(b_k * b_k) + 1e-6)

    # set per value head at its first tile (declared here: a name first bound inside an `if` does not outlive it)
    b_decay = tl.zeros([BK], dtype=tl.float32)
    b_beta = tl.sum(b_decay)
    b_ss = tl.zeros([BV], dtype=tl.float32)
    for j in tl.static_range(G * NT):
        i_g = j // NT
        i_t = j % NT
        i_hv = i_h * G + i_g
        if i_t == 0:   # a new value head: its gate, beta, and the sum of squares of its outputs
            b_f = tl.load(f + i_b * stride_f + i_hv * K + o_k, mask=m_k, other=0).to(tl.float32)
            b_f += tl.load(dt_bias + i_hv * K + o_k, mask=m_k, other=0).to(tl.float32)
            b_a = tl.exp(tl.load(A_log + i_hv).to(tl.float32))
            if USE_LOWER_BOUND:
                b_g = lower_bound * tl.sigmoid(b_a * b_f)
            else:
                # softplus with torch's threshold (x > 20 -> x), written stably
                b_sp = tl.maximum(b_f, 0.0) + tl.log(1.0 + tl.exp(-tl.abs(b_f)))
                b_g = -b_a * tl.where(b_f > 20.0, b_f, b_sp)
            b_decay = tl.exp(b_g)
            b_beta = tl.sigmoid(tl.load(beta + i_b * stride_beta + i_hv).to(tl.float32))
            b_ss = tl.zeros([BV], dtype=tl.float32)

        rows = row0 + i_t * BV + o_t
        m_v = rows < V
        # the v conv channels of these rows belong to this program alone
        p_cv = conv_v + i_b * stride_cv + i_hv * V * (W - 1)
        b_v, b_win_v = _short_conv_read(v + i_b * stride_v + i_hv * V, p_cv, w_v + i_hv * V * W, rows, m_v, W, BW)
        _short_conv_shift(p_cv, b_win_v, rows, m_v, W, BW)

        # take this tile, move the queue up, and issue the load DEPTH tiles ahead
        b_s = b_s1
        if DEPTH >= 2 and j + 1 < G * NT:
            b_s1 = b_s2
        if DEPTH >= 3 and j + 2 < G * NT:
            b_s2 = b_s3
        if j + DEPTH < G * NT:
            b_next = _load_state_tile(p_s0, row0, o_t, m_k, j + DEPTH, NT, BV, V, K)
            if DEPTH == 1:
                b_s1 = b_next
            elif DEPTH == 2:
                b_s2 = b_next
            else:
                b_s3 = b_next

        # delta rule on the tile S [BV, K]
        b_s *= b_decay[None, :]
        b_u = b_beta * (b_v - tl.sum(b_s * b_k[None, :], 1))
        b_s += b_u[:, None] * b_k[None, :]
        b_o = tl.sum(b_s * b_q[None, :], 1)
        tl.store(p_s0 + (i_g * V * K + i_t * BV * K), b_s, mask=m_v[:, None] & m_k[None, :])

        if IN_REGISTERS:   # sigmoid-gated RMSNorm over the head's V outputs, all held here
            b_rstd = tl.rsqrt(tl.sum(b_o * b_o) / V + eps)
            b_gate = tl.load(gate + i_b * stride_gate + i_hv * V + rows, mask=m_v, other=0).to(tl.float32)
            b_nw = tl.load(norm_w + rows, mask=m_v, other=0).to(tl.float32)
            b_out = b_o * b_rstd * b_nw * tl.sigmoid(b_gate)
            tl.store(o + i_b * stride_o + i_hv * V + rows, _round_to(b_out, o.dtype.element_ty), mask=m_v)
        else:
            b_ss += b_o * b_o
            tl.store(o_part + (i_b * HV + i_hv) * V + rows, b_o, mask=m_v)
            if i_t == NT - 1:
                tl.store(ss_part + (i_b * HV + i_hv) * NSPLIT + i_s, tl.sum(b_ss))

    if not IN_REGISTERS:
        # every thread's scratch stores happen before the ticket (release); the last arrival sees them all
        tl.debug_barrier()
        if NSPLIT > 1:
            p_ticket = tickets + i_b * H + i_h
            is_last = tl.atomic_add(p_ticket, 1, sem="acq_rel") == NSPLIT - 1
        else:
            is_last = True
        tl.debug_barrier()
        if is_last:
            if NSPLIT > 1:
                tl.store(p_ticket, 0)   # ready for the next call
                # every split has read the q/k conv states by now: shift them, once
                _short_conv_shift(p_cq, b_win_q, o_k, m_k, W, BW)
                _short_conv_shift(p_ck, b_win_k, o_k, m_k, W, BW)
            o_vh = tl.arange(0, BVH)
            m_vh = o_vh < V
            o_sp = tl.arange(0, BS)
            b_nw_h = tl.load(norm_w + o_vh, mask=m_vh, other=0).to(tl.float32)
            for i_gh in tl.static_range(G):
                i_hv_h = i_h * G + i_gh
                # .cg: other programs wrote these; read them from L2, not a stale L1 line
                b_ss_all = tl.load(ss_part + (i_b * HV + i_hv_h) * NSPLIT + o_sp, mask=o_sp < NSPLIT, other=0,
                                   cache_modifier=".cg")
                b_o_h = tl.load(o_part + (i_b * HV + i_hv_h) * V + o_vh, mask=m_vh, other=0, cache_modifier=".cg")
                b_rstd_h = tl.rsqrt(tl.sum(b_ss_all) / V + eps)
                b_gate_h = tl.load(gate + i_b * stride_gate + i_hv_h * V + o_vh, mask=m_vh, other=0).to(tl.float32)
                b_out_h = b_o_h * b_rstd_h * b_nw_h * tl.sigmoid(b_gate_h)
                tl.store(o + i_b * stride_o + i_hv_h * V + o_vh, _round_to(b_out_h, o.dtype.element_ty), mask=m_vh)


class KernelConfig(NamedTuple):
    """How the kernel is laid out: V splits (programs per head), rows per tile, warps, tile loads in flight."""
    splits: int
    rows: int
    num_warps: int
    depth: int = 1


def default_config(B: int, H: int, K: int, V: int) -> KernelConfig:
    """The layout measured fastest for the decode shapes (H200, K = V = 128; benchmarks/results/
    kda_decode_split_h200.json and kda_decode_split2_h200.json): few heads in flight want V splits (more
    programs than SMs), many want one program per head walking small tiles, the next tile's load
    overlapping the current tile's math. More loads in flight (depth 2-3) did not help, except 8-row
    tiles two ahead at the largest batches (1-5%)."""
    if K * V < 64 * 128:   # small heads (tests, tiny models): the whole tile in one program
        return KernelConfig(1, triton.next_power_of_2(V), 4)
    heads = B * H
    if heads <= 24:        # B1 x H12: 4.5 us, x2.7 over fla (the whole tile in one program: 6.7 us)
        return KernelConfig(8, 16, 4)
    if heads <= 192:       # B1 x H96, B8 x H12: 6.6-7.0 us, x1.9-2.2 over fla
        return KernelConfig(4, 16, 4)
    if heads < 6144:       # B8 x H96, B64/256 x H12: 1.30-1.45x the state-traffic floor, x1.23-1.45 over fla
        return KernelConfig(1, 16, 4)
    # B64/256 x H96: 1.20-1.22x the floor, x1.16-1.25 over fla
    return KernelConfig(1, 8, 4, 2)


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
    config: Optional[KernelConfig] = None,
) -> torch.Tensor:
    """Launch the kernel; ``out`` (``[B, HV*V]``, v's dtype, row-contiguous) lets tests poison the output.
    ``config`` overrides the measured layout (``num_warps`` alone overrides its warps)."""
    B, HV, V, K = state.shape
    H = q.shape[-1] // K
    W = conv_weight_q.shape[-1]
    o = torch.empty(B, HV * V, dtype=v.dtype, device=v.device) if out is None else out
    if B == 0:
        return o
    cfg = config or default_config(B, H, K, V)
    if num_warps:
        cfg = cfg._replace(num_warps=num_warps)
    splits = max(1, min(cfg.splits, V))
    per_split = triton.cdiv(V, splits)
    BV = min(triton.next_power_of_2(per_split), triton.next_power_of_2(cfg.rows))
    NT = triton.cdiv(per_split, BV)
    splits = triton.cdiv(V, NT * BV)   # no split left without rows
    if splits == 1 and NT == 1:
        o_part = ss_part = tickets = o   # unused
    else:
        o_part = torch.empty(B, HV, V, dtype=torch.float32, device=v.device)
        ss_part = torch.empty(B, HV, splits, dtype=torch.float32, device=v.device)
        tickets = arrival_counters(v.device, B * H)   # all zero; every launch leaves them zero
        if tickets is None:  # first launch inside a CUDA-graph capture: the graph zeroes its own
            tickets = torch.zeros(B * H, dtype=torch.int32, device=v.device)
    kda_decode_kernel[(B, H, splits)](
        q, k, v, conv_state_q, conv_state_k, conv_state_v, conv_weight_q, conv_weight_k, conv_weight_v,
        f, A_log, dt_bias, beta_logits, out_gate, o_norm_weight, state, o, o_part, ss_part, tickets,
        q.stride(0), k.stride(0), v.stride(0),
        conv_state_q.stride(0), conv_state_k.stride(0), conv_state_v.stride(0),
        f.stride(0), beta_logits.stride(0), out_gate.stride(0), state.stride(0), o.stride(0),
        0.0 if lower_bound is None else float(lower_bound), K ** -0.5, float(eps),
        H=H, HV=HV, K=K, V=V, W=W,
        BK=triton.next_power_of_2(K), BV=BV, BVH=triton.next_power_of_2(V), BW=triton.next_power_of_2(W),
        NSPLIT=splits, NT=NT, BS=triton.next_power_of_2(splits), DEPTH=max(1, min(cfg.depth, 3)),
        USE_LOWER_BOUND=lower_bound is not None,
        num_warps=cfg.num_warps,
    )
    return o
