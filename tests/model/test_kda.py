"""KDA pieces against fla's references (written by others) and against each other.

rel = ||out - ref|| / ||ref|| throughout; NaN never passes (it makes rel NaN, and NaN < tol is False).
"""
import pytest
import torch
import torch.nn.functional as F
from hypothesis import example, given, strategies as st

from k3compile.model.kda import (
    gated_rms_norm, kda_chunked, kda_gate_lower_bound, kda_gate_softplus, kda_recurrent_step, l2_normalize,
    short_conv_decode, short_conv_prefill,
)
from k3compile.testing import rel_err as rel

fla_naive = pytest.importorskip("fla.ops.kda.naive")
fla_gate = pytest.importorskip("fla.ops.kda.gate")


def kda_inputs(B, T, H, K, V, lower_bound, seed):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen)
    q = l2_normalize(r(B, T, H, K)) * K ** -0.5
    k = l2_normalize(r(B, T, H, K))
    v = r(B, T, H, V)
    f = r(B, T, H, K)
    A_log = torch.rand(H, generator=gen).mul(15).add(1).log()
    dt_bias = r(H * K)
    if lower_bound is None:
        g = kda_gate_softplus(f, A_log, dt_bias)
    else:
        g = kda_gate_lower_bound(f, A_log, dt_bias, lower_bound)
    beta = torch.rand(B, T, H, generator=gen)
    state0 = r(B, H, V, K) * 0.5
    return q, k, v, g, beta, state0


def fla_reference(q, k, v, g, beta, state0):
    """fla's K-first state [B, H, K, V] is our V-first state transposed; our q already carries the scale."""
    o, S = fla_naive.naive_recurrent_kda(q, k, v, g, beta, scale=1.0, initial_state=state0.transpose(-1, -2),
                                         output_final_state=True)
    return o, S.transpose(-1, -2)


shapes = st.tuples(st.integers(1, 2), st.integers(1, 40), st.integers(1, 4), st.sampled_from([8, 16, 32]),
                   st.sampled_from([8, 16, 32]), st.sampled_from([-5.0, None]), st.integers(0, 2**16))


@given(shapes)
@example((1, 1, 96, 128, 128, -5.0, 0))   # the real decode step (one token, 96 heads of 128)
@example((2, 37, 6, 32, 32, -5.0, 1))     # tiny config, T not a multiple of the chunk
def test_recurrent_step_matches_fla(shape):
    B, T, H, K, V, lb, seed = shape
    q, k, v, g, beta, state0 = kda_inputs(B, T, H, K, V, lb, seed)
    o_ref, S_ref = fla_reference(q, k, v, g, beta, state0)
    state = state0.clone()
    o = torch.full_like(v, float("nan"))
    for t in range(T):
        o[:, t] = kda_recurrent_step(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], state)
    assert rel(o, o_ref) < 1e-5
    assert rel(state, S_ref) < 1e-5


@given(shapes, st.sampled_from([4, 16, 32]))
@example((2, 37, 6, 32, 32, -5.0, 1), 16)
def test_chunked_prefill_matches_fla(shape, chunk):
    B, T, H, K, V, lb, seed = shape
    q, k, v, g, beta, state0 = kda_inputs(B, T, H, K, V, lb, seed)
    o_ref, S_ref = fla_reference(q, k, v, g, beta, state0)
    state = state0.clone()
    o = kda_chunked(q, k, v, g, beta, state, chunk_size=chunk)
    assert o.shape == o_ref.shape
    assert rel(o, o_ref) < 1e-4
    assert rel(state, S_ref) < 1e-4


@given(st.tuples(st.integers(1, 3), st.integers(1, 5), st.integers(1, 8), st.integers(0, 2**16)))
def test_gates_match_fla(shape):
    B, T, H, seed = shape
    K = 16
    gen = torch.Generator().manual_seed(seed)
    f = torch.randn(B, T, H, K, generator=gen) * 3
    A_log = torch.rand(H, generator=gen).mul(15).add(1).log()
    dt_bias = torch.randn(H * K, generator=gen)
    ref_lb = fla_gate.naive_kda_lowerbound_gate(f, A_log, dt_bias, lower_bound=-5.0)
    ref_sp = fla_gate.naive_kda_gate(f, A_log, dt_bias)
    assert rel(kda_gate_lower_bound(f, A_log, dt_bias, -5.0), ref_lb) < 1e-6
    assert rel(kda_gate_softplus(f, A_log, dt_bias), ref_sp) < 1e-6


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@given(st.tuples(st.integers(1, 3), st.integers(1, 12), st.sampled_from([1, 8, 96]), st.integers(0, 2**16)))
def test_short_conv_prefill_equals_decode_steps(dtype, shape):
    B, T, P, seed = shape
    W = 4
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, P, generator=gen).to(dtype)
    weight = torch.randn(P, 1, W, generator=gen)
    state0 = torch.randn(B, P, W - 1, generator=gen).to(dtype)
    # zero history = F.conv1d with causal zero padding
    zero_state = torch.zeros_like(state0)
    y0 = short_conv_prefill(x, zero_state, weight)
    ref0 = F.silu(F.conv1d(F.pad(x.float().transpose(1, 2), (W - 1, 0)), weight, groups=P)).transpose(1, 2)
    assert rel(y0.float(), ref0) < (1e-6 if dtype == torch.float32 else 1e-2)
    # prefill with history == T decode steps, outputs and final conv state
    s_pre, s_dec = state0.clone(), state0.clone()
    y_pre = short_conv_prefill(x, s_pre, weight)
    y_dec = torch.full_like(x, float("nan"))
    for t in range(T):
        y_dec[:, t] = short_conv_decode(x[:, t], s_dec, weight)
    assert rel(y_pre.float(), y_dec.float()) < 1e-6
    assert torch.equal(s_pre, s_dec)


@given(st.tuples(st.integers(1, 3), st.integers(1, 8), st.sampled_from([16, 128]), st.integers(0, 2**16)))
def test_gated_rms_norm_and_l2(shape):
    B, H, V, seed = shape
    gen = torch.Generator().manual_seed(seed)
    o, gate, w = torch.randn(B, H, V, generator=gen), torch.randn(B, H, V, generator=gen), torch.randn(V, generator=gen)
    ref = F.rms_norm(o, (V,), w, 1e-5) * torch.sigmoid(gate)
    assert rel(gated_rms_norm(o, gate, w, 1e-5), ref) < 1e-6
    ref_l2 = o / torch.sqrt(o.pow(2).sum(-1, keepdim=True) + 1e-6)
    assert rel(l2_normalize(o), ref_l2) < 1e-6
