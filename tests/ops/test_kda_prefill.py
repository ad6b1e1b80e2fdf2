"""k3::kda_prefill: the op vs the token-by-token recurrence, the state handed to decode, fla on the GPU, fallbacks."""
from __future__ import annotations

import pytest
import torch
from hypothesis import example, given, strategies as st

from k3compile.backends import BackendUnavailableError
from k3compile.ops.kda_decode.reference import kda_decode_ref
from k3compile.ops.kda_prefill import KDA_PREFILL, kda_prefill
from k3compile.ops.kda_prefill.reference import kda_prefill_ref, kda_sequential_ref
from k3compile.testing import rel_err as rel

# fp32 throughout; the chunked form re-associates sums (triangular solves instead of T sequential steps)
TOL_CHUNKED = 2e-5
# fla feeds fp32 through tensor-core dots (tf32) and a different chunking
TOL_FLA = 5e-3


def make_inputs(B, T, H, K, V, v_dtype=torch.float32, state_scale=1.0, lower_bound=-5.0, seed=0, device="cpu"):
    """Prefill inputs as the model makes them: q, k L2-normalised (q scaled by K^-0.5), g a bounded log-decay,
    beta post-sigmoid, fp32 V-first state."""
    gen = torch.Generator().manual_seed(seed)

    def r(*shape, scale=1.0):
        return torch.randn(*shape, generator=gen) * scale

    q = torch.nn.functional.normalize(r(B, T, H, K), dim=-1) * K ** -0.5
    k = torch.nn.functional.normalize(r(B, T, H, K), dim=-1)
    g = lower_bound * torch.sigmoid(r(B, T, H, K))
    x = dict(q=q, k=k, v=r(B, T, H, V).to(v_dtype), g=g, beta=torch.sigmoid(r(B, T, H)),
             state=r(B, H, V, K, scale=state_scale))
    return {n: t.to(device) for n, t in x.items()}


def clone(x: dict) -> dict:
    return {n: t.clone() for n, t in x.items()}


def shape_id(B, T, H, K, V, v_dtype="fp32"):
    return f"B{B}-T{T}-H{H}-K{K}-V{V}-v{v_dtype}"


@pytest.fixture
def nan_poisoned_allocations():
    """Every ``torch.empty`` returns NaN-filled memory (the op and fla allocate their own outputs), so an
    element no kernel wrote fails ``rel_err``."""
    prev = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    fill = torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    yield
    torch.use_deterministic_algorithms(prev[0], warn_only=prev[1])
    torch.utils.deterministic.fill_uninitialized_memory = fill


# ---------------------------------------------------------------------------------------------------
# The op (reference path on CPU) vs T sequential decode steps

@given(B=st.integers(1, 3), T=st.integers(1, 40), H=st.integers(1, 3), K=st.sampled_from([4, 8, 16, 32]),
       V=st.sampled_from([4, 8, 16, 32]), chunk=st.sampled_from([4, 16]), state_scale=st.sampled_from([0.0, 1.0, 30.0]),
       seed=st.integers(0, 2**16))
@example(B=1, T=17, H=2, K=16, V=16, chunk=16, state_scale=1.0, seed=0)   # one token past a chunk
@example(B=2, T=32, H=1, K=8, V=32, chunk=16, state_scale=1.0, seed=1)    # whole chunks, no padding
def test_kda_prefill_equals_sequential_recurrence(nan_poisoned_allocations, B, T, H, K, V, chunk, state_scale,
                                                  seed):
    x = make_inputs(B, T, H, K, V, state_scale=state_scale, seed=seed)
    seq = clone(x)
    out = kda_prefill(**x, chunk_size=chunk, backend="reference")
    ref = kda_sequential_ref(**seq)
    assert out.shape == (B, T, H, V) and out.dtype == torch.float32 and out.is_contiguous()
    assert rel(out, ref) < TOL_CHUNKED
    assert rel(x["state"], seq["state"]) < TOL_CHUNKED


@pytest.mark.parametrize("backend", ["auto", "triton"])
def test_kda_prefill_on_cpu_falls_back_to_reference_and_records_it(backend):
    """fla's kernels need a GPU: on CPU (Triton interpreter or not) the op runs the reference, recorded."""
    KDA_PREFILL.clear()
    x = make_inputs(2, 9, 2, 8, 8, v_dtype=torch.bfloat16)
    ref_in = clone(x)
    out = kda_prefill(**x, backend=backend)
    ref = kda_prefill_ref(**ref_in, chunk_size=16)
    assert rel(out, ref) == 0.0 and torch.equal(x["state"], ref_in["state"])
    (choice,) = KDA_PREFILL.choices()
    assert choice.impl == "reference"
    assert "fla" in choice.reason or "GPU" in choice.reason or "Triton" in choice.reason


def test_kda_prefill_state_hands_over_to_decode():
    """Prefill T tokens then decode 3 more (k3::kda_decode's reference): the same state and outputs as
    T + 3 sequential steps on the same q, k, v, g, beta."""
    B, T, H, K = 2, 21, 2, 16
    x = make_inputs(B, T + 3, H, K, K, seed=5)
    seq = clone(x)
    want = kda_sequential_ref(**seq)
    state = x["state"].clone()
    head = {n: t[:, :T] for n, t in x.items() if n != "state"}
    o = kda_prefill(**head, state=state, backend="reference")
    assert rel(o, want[:, :T]) < TOL_CHUNKED
    for t in range(T, T + 3):
        o_t = kda_sequential_ref(*(x[n][:, t:t + 1] for n in ("q", "k", "v", "g", "beta")), state)
        assert rel(o_t[:, 0], want[:, t]) < TOL_CHUNKED
    assert rel(state, seq["state"]) < TOL_CHUNKED


def decode_step_inputs(B, H, K, state, seed):
    """One k3::kda_decode step's activations and weights (bf16 activations, fp32 params) around ``state``."""
    gen = torch.Generator().manual_seed(seed)
    P, W = H * K, 4

    def r(*shape, dt=torch.bfloat16, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(dt)

    return dict(q=r(B, P), k=r(B, P), v=r(B, P), conv_state_q=r(B, P, W - 1), conv_state_k=r(B, P, W - 1),
                conv_state_v=r(B, P, W - 1), conv_weight_q=r(P, 1, W, dt=torch.float32, scale=0.5),
                conv_weight_k=r(P, 1, W, dt=torch.float32, scale=0.5),
                conv_weight_v=r(P, 1, W, dt=torch.float32, scale=0.5), f=r(B, P),
                A_log=torch.empty(H).uniform_(1, 16, generator=gen).log(), dt_bias=r(P, dt=torch.float32),
                lower_bound=-5.0, beta_logits=r(B, H), out_gate=r(B, P),
                o_norm_weight=1 + r(K, dt=torch.float32, scale=0.1), state=state, eps=1e-5)


@pytest.mark.parametrize("decode_backend", ["reference", "triton"])
def test_kda_prefill_then_fused_decode_steps_continue_the_state(decode_backend):
    """The state the prefill op leaves is the one k3::kda_decode continues from: three fused decode steps
    from it give the outputs and state they give from the token-by-token truth."""
    from k3compile.ops.kda_decode import kda_decode

    B, H, K = 2, 2, 16
    x = make_inputs(B, 11, H, K, K, seed=2)
    truth = clone(x)
    kda_prefill(**x, backend="reference")
    kda_sequential_ref(**truth)
    assert rel(x["state"], truth["state"]) < TOL_CHUNKED
    for step in range(3):
        a = decode_step_inputs(B, H, K, x["state"], seed=step)
        b = decode_step_inputs(B, H, K, truth["state"], seed=step)
        out_a = kda_decode(**a, backend=decode_backend)
        out_b = kda_decode_ref(**b)
        assert rel(out_a, out_b) < 2e-2, f"decode step {step}"   # bf16 outputs
    assert rel(x["state"], truth["state"]) < 1e-4


def test_kda_prefill_bad_shapes_raise():
    x = make_inputs(2, 5, 2, 8, 8)
    with pytest.raises(ValueError, match="beta"):
        kda_prefill(**{**x, "beta": x["beta"][:, :4]})
    with pytest.raises(ValueError, match="fp32"):
        kda_prefill(**{**x, "state": x["state"].half()})
    with pytest.raises(ValueError, match="state"):
        kda_prefill(**{**x, "state": x["state"].transpose(-1, -2)[..., :4]})


def test_kda_prefill_forced_cute_unavailable_raises():
    with pytest.raises(BackendUnavailableError):
        kda_prefill(**make_inputs(1, 3, 1, 4, 4), backend="cute")


def test_kda_prefill_opcheck():
    x = make_inputs(2, 5, 2, 8, 8)
    torch.library.opcheck(torch.ops.k3.kda_prefill.default, tuple(x.values()) + (16, "reference"),
                          test_utils=("test_schema", "test_faketensor"))


# ---------------------------------------------------------------------------------------------------
# GPU: fla's chunk_kda (does not run under the Triton interpreter: its state-passing kernel fails there)

@pytest.mark.gpu
@pytest.mark.parametrize("B,T,H,K,V,v_dtype", [(1, 37, 12, 128, 128, "bf16"), (2, 64, 4, 128, 128, "fp32"),
                                               (3, 5, 2, 64, 64, "bf16"), (1, 300, 2, 128, 128, "bf16")],
                         ids=[shape_id(1, 37, 12, 128, 128, "bf16"), shape_id(2, 64, 4, 128, 128),
                              shape_id(3, 5, 2, 64, 64, "bf16"), shape_id(1, 300, 2, 128, 128, "bf16")])
def test_kda_prefill_fla_matches_reference_and_hands_state_to_decode(nan_poisoned_allocations, B, T, H, K, V,
                                                                    v_dtype):
    KDA_PREFILL.clear()
    dt = {"bf16": torch.bfloat16, "fp32": torch.float32}[v_dtype]
    x = make_inputs(B, T, H, K, V, v_dtype=dt, device="cuda", seed=3)
    ref_in = clone(x)
    out = kda_prefill(**x, backend="triton")
    ref = kda_prefill_ref(**ref_in, chunk_size=16)
    assert [c.impl for c in KDA_PREFILL.choices()] == ["triton"]
    assert rel(out, ref) < TOL_FLA
    assert rel(x["state"], ref_in["state"]) < TOL_FLA
    # the state continues under three sequential steps like the reference's
    for t in range(3):
        step = make_inputs(B, 1, H, K, V, v_dtype=dt, device="cuda", seed=10 + t)
        del step["state"]
        a = kda_sequential_ref(**step, state=x["state"])
        b = kda_sequential_ref(**step, state=ref_in["state"])
        assert rel(a, b) < TOL_FLA


@pytest.mark.gpu
def test_kda_prefill_fla_head_dim_beyond_limit_falls_back_recorded():
    KDA_PREFILL.clear()
    x = make_inputs(1, 5, 1, 8, 512, device="cuda")
    kda_prefill(**x, backend="triton")
    (choice,) = KDA_PREFILL.choices()
    assert choice.impl == "reference" and "head dims" in choice.reason
