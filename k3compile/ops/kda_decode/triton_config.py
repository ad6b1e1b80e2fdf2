"""The Triton KDA decode kernel's layout (``KernelConfig``), the layout measured fastest per shape, and what the
kernel takes. Nothing here imports Triton."""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch

# One program's tile must fit in registers; a K row beyond 128 fp32 would spill.
MAX_HEAD_DIM = 128
MAX_CONV_WIDTH = 8


def next_power_of_2(n: int) -> int:
    return 0 if n <= 0 else 1 << (n - 1).bit_length()   # as triton.next_power_of_2


class KernelConfig(NamedTuple):
    """How the kernel is laid out: V splits (programs per head), rows per tile, warps, tile loads in flight;
    ``programs_per_sm`` > 0 makes the grid persistent (at most that many programs per SM, each walking an equal
    share of the heads as one stream); ``stream_stores`` stores the state with ``.cs``, ``cg_loads`` loads it
    with ``.cg``; ``max_registers`` caps registers per thread (0: the compiler's choice); ``stages`` > 0 walks
    the tiles in a loop that Triton pipelines through shared memory (stages - 1 tiles in flight; not persistent)."""
    splits: int
    rows: int
    num_warps: int
    depth: int = 1
    programs_per_sm: int = 0
    stream_stores: bool = False
    cg_loads: bool = False
    max_registers: int = 0
    stages: int = 0


def default_config(B: int, H: int, K: int, V: int) -> KernelConfig:
    """The layout measured fastest for the decode shapes (H200, K = V = 128; docs/tuning/kda_decode.md): few heads in
    flight want V splits (more programs than SMs); up to about one wave of programs, one program per head walking
    8-row tiles three loads ahead in registers; more heads, the tile loop pipelined through shared memory (3 tiles in
    flight, no registers held: 9 programs an SM)."""
    if K * V < 64 * 128:   # small heads (tests, tiny models): the whole tile in one program
        return KernelConfig(1, next_power_of_2(V), 4)
    heads = B * H
    if heads <= 24:        # B1 x H12: 4.0 us, x2.6 over fla
        return KernelConfig(8, 16, 4)
    if heads <= 192:       # B8 x H12, B1 x H96: 6.0 us, x2.1 over fla
        return KernelConfig(4, 16, 4)
    if heads < 2048:       # B64 x H12, B8 x H96 (768 heads): 1.16-1.17x the state-traffic floor, x1.6 over fla
        return KernelConfig(1, 8, 4, 3)
    # B256 x H12: 1.12x the floor; B64 / B256 x H96: 1.08 / 1.05x (x1.3-1.5 over fla)
    return KernelConfig(1, 8, 4, stages=4)


def supports(q, k, v, conv_state_q, conv_state_k, conv_state_v, conv_weight_q, conv_weight_k, conv_weight_v, f,
             A_log, dt_bias, lower_bound, beta_logits, out_gate, o_norm_weight, state, eps) -> Optional[str]:
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
