"""k3::moe_route: the Triton kernel (interpreted on the CPU) against the reference (model/moe.py ``route``'s tail),
outputs poisoned; checks and fallbacks."""
from __future__ import annotations

import pytest
import torch
from hypothesis import example, given, settings, strategies as st

from k3compile.model.moe import route
from k3compile.ops.moe_route import MOE_ROUTE, moe_route
from k3compile.ops.moe_route.reference import moe_route_ref
from k3compile.ops.moe_route.triton import moe_route_triton


def inputs(m, e, bias_scale, seed, ties=False):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(m, e, generator=g) * 4
    if ties:   # scores that tie exactly (sigmoid saturates to 1.0 above ~17): the lower id first
        logits[:, ::3] = 40.0
    return logits, torch.randn(e, generator=g) * bias_scale


def run_poisoned(logits, bias, k, eps, scaling, network=False):
    m = logits.shape[0]
    out = (torch.full((m, k), float("nan"), device=logits.device),
           torch.full((m, k), -1, dtype=torch.int64, device=logits.device))
    return moe_route_triton(logits, bias, k, eps, scaling, out=out, sorting_network=network)


# drawn rows up to 4 (a program a row: a fifth row is the same program again; the examples take 5 and 8); up to 300
# experts interpreted, about half a second a draw: a third of the profile's draws
@settings(max_examples=max(8, settings.default.max_examples // 3))
@given(m=st.integers(1, 4), e=st.integers(1, 300), k_frac=st.floats(0, 1), renorm=st.booleans(),
       scaling=st.sampled_from([1.0, 2.5]), bias_scale=st.sampled_from([0.0, 0.1, 10.0]), seed=st.integers(0, 99),
       network=st.booleans())
@example(m=1, e=896, k_frac=15 / 895, renorm=True, scaling=1.0, bias_scale=0.1, seed=0, network=True)  # K3
# negative keys
@example(m=8, e=384, k_frac=7 / 383, renorm=True, scaling=2.5, bias_scale=10.0, seed=1, network=False)
@example(m=3, e=64, k_frac=1.0, renorm=False, scaling=1.0, bias_scale=0.0, seed=2, network=False)           # k = E
@example(m=5, e=99, k_frac=1.0, renorm=False, scaling=1.0, bias_scale=0.0, seed=0, network=False)           # near-ties
# top-1 of a pair
@example(m=1, e=2, k_frac=0.0, renorm=False, scaling=1.0, bias_scale=0.0, seed=0, network=True)
def test_kernel_equals_reference(m, e, k_frac, renorm, scaling, bias_scale, seed, network):
    k = min(64, 1 + round(k_frac * (e - 1)))
    logits, bias = inputs(m, e, bias_scale, seed)
    eps = 1e-20 if renorm else None
    weights, experts = run_poisoned(logits, bias, k, eps, scaling, network)
    assert_is_top_k(logits, bias, k, experts)
    # the weights of the experts the kernel picked, as the reference computes them
    scores = torch.sigmoid(logits).gather(-1, experts)
    want = (scores / (scores.sum(-1, keepdim=True) + eps) if renorm else scores) * scaling
    assert not weights.isnan().any()
    torch.testing.assert_close(weights, want, rtol=1e-6, atol=1e-7)
    ref_w, ref_e = moe_route_ref(logits, bias, k, eps, scaling)
    same = (experts == ref_e).all(-1)           # rows without near-ties: exactly the reference's
    torch.testing.assert_close(weights[same], ref_w[same], rtol=1e-6, atol=1e-7)


def assert_is_top_k(logits, bias, k, experts, ulps=4):
    """``experts`` are k distinct ids in descending order of key = sigmoid(logits) + bias, and no other id's key is
    above the k-th: exactly, up to a few ulps (the kernel's sigmoid may round differently from torch's, which
    can swap two keys that are a rounding apart, as plain torch.compile's fused sigmoid can)."""
    key = torch.sigmoid(logits) + bias
    tol = ulps * torch.finfo(torch.float32).eps * key.abs().amax(-1, keepdim=True).clamp_min(1.0)
    picked = key.gather(-1, experts)
    assert ((0 <= experts) & (experts < logits.shape[1])).all()
    assert all(len(set(row)) == k for row in experts.tolist()), "an expert picked twice"
    assert (picked[:, 1:] <= picked[:, :-1] + tol).all(), "not in descending order"
    rest = key.scatter(-1, experts, float("-inf"))
    assert (rest.amax(-1, keepdim=True) <= picked[:, -1:] + tol).all(), "a larger key left out"


def test_reference_is_the_models_route():
    """The op's reference is ``route`` after its product, in the order the model returns."""
    torch.manual_seed(0)
    x, w, bias = torch.randn(5, 12), torch.randn(20, 12), torch.randn(20) * 0.1
    want_w, want_e = route(x, w, bias, 4, True, 2.5)
    got_w, got_e = moe_route_ref(torch.nn.functional.linear(x, w), bias, 4, 1e-20, 2.5)
    assert torch.equal(got_e, want_e) and torch.equal(got_w, want_w)


@pytest.mark.parametrize("network", [False, True], ids=["rounds", "bitonic"])
def test_ties_take_the_lowest_expert_first(network):
    logits, bias = inputs(4, 30, 0.0, 3, ties=True)
    weights, experts = run_poisoned(logits, bias, 6, 1e-20, 1.0, network)
    assert experts.tolist() == [[0, 3, 6, 9, 12, 15]] * 4
    torch.testing.assert_close(weights, torch.full((4, 6), 1 / 6))


def test_nan_scores_are_picked_and_come_out_nan():
    """A NaN logit ranks above every number (as in torch.topk) and its weight is NaN: never a silently finite
    routing."""
    logits, bias = inputs(2, 40, 0.1, 4)
    logits[1, 7] = float("nan")
    weights, experts = run_poisoned(logits, bias, 4, 1e-20, 1.0)
    assert experts[1, 0] == 7 and weights[1].isnan().all()
    ref_w, ref_e = moe_route_ref(logits[:1], bias, 4, 1e-20, 1.0)
    assert torch.equal(experts[:1], ref_e) and torch.allclose(weights[:1], ref_w)


def test_op_checks_its_arguments():
    logits, bias = inputs(2, 10, 0.1, 5)
    with pytest.raises(ValueError, match="top_k"):
        moe_route(logits, bias, 11)
    with pytest.raises(ValueError, match="fp32"):
        moe_route(logits.bfloat16(), bias, 2)
    with pytest.raises(ValueError, match="bias"):
        moe_route(logits, bias[:9], 2)


def test_too_many_experts_for_one_program_fall_back_with_the_reason():
    MOE_ROUTE.clear()
    logits, bias = inputs(1, 8193, 0.1, 6)
    weights, experts = moe_route(logits, bias, 2)
    ref_w, ref_e = moe_route_ref(logits, bias, 2, 1e-20, 1.0)
    assert torch.equal(experts, ref_e) and torch.equal(weights, ref_w)
    (choice,) = MOE_ROUTE.choices()
    assert choice.impl == "reference" and "8193" in choice.reason


def test_empty_batch():
    weights, experts = moe_route(torch.empty(0, 12), torch.zeros(12), 3, backend="triton")
    assert weights.shape == (0, 3) and experts.shape == (0, 3) and experts.dtype == torch.int64


@pytest.mark.gpu
@pytest.mark.parametrize("pdl", [True, False], ids=["pdl", "plain"])
@pytest.mark.parametrize("m", [1, 8, 64, 1000])
def test_gpu_kernel_is_top_k_and_replays_in_a_graph(m, pdl):
    """K3's router (E 896, top-16, renormalised) on the GPU: the top-k, the weights, and a CUDA graph replayed on
    fresh logits with poisoned outputs; launched with PDL behind the kernel that writes the logits, and without."""
    logits, bias = (t.cuda() for t in inputs(m, 896, 0.1, m))
    weights, experts = run_poisoned(logits, bias, 16, 1e-20, 2.5)
    assert_is_top_k(logits, bias, 16, experts)
    ref_w, ref_e = moe_route_ref(logits, bias, 16, 1e-20, 2.5)
    torch.testing.assert_close(weights.sum(-1), ref_w.sum(-1))
    out = (torch.empty_like(weights), torch.empty_like(experts))
    graph = torch.cuda.CUDAGraph()
    source = torch.empty_like(logits)
    with torch.cuda.graph(graph):
        logits.copy_(source)   # the logits' writer right ahead, as the router's product is in the step
        moe_route_triton(logits, bias, 16, 1e-20, 2.5, out=out, pdl=pdl)
    source.copy_(inputs(m, 896, 0.1, m + 1)[0])
    logits.fill_(float("nan"))
    out[0].fill_(float("nan"))
    out[1].fill_(-1)
    graph.replay()
    torch.cuda.synchronize()
    assert_is_top_k(logits, bias, 16, out[1])
    assert not out[0].isnan().any()
