"""The routing-tail rewrite (patterns/moe_route.py): the model's ``route`` after its product becomes
``k3::moe_route`` exactly where the math is the op's, and the result equals eager."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import example, given, settings
from hypothesis import strategies as st

import k3compile
from k3compile.model.moe import route

pytestmark = pytest.mark.usefixtures("no_graph_caches")   # tests/conftest.py


class Router(torch.nn.Module):
    """The model's router: ``route`` (model/moe.py) on a [M, D] hidden state; ``tail`` replaces what follows the
    product for the near misses."""

    def __init__(self, d, e, top_k, renormalize=True, scaling=1.0, dtype=torch.float32, tail=None):
        super().__init__()
        self.weight = torch.nn.Parameter((torch.randn(e, d) / d ** 0.5).to(dtype))
        self.bias = torch.nn.Parameter(torch.randn(e) * 0.1)
        self.top_k, self.renormalize, self.scaling, self.tail = top_k, renormalize, scaling, tail

    def forward(self, x):
        if self.tail is not None:
            return self.tail(F.linear(x.float(), self.weight.float()), self.bias, self.top_k)
        return route(x, self.weight, self.bias, self.top_k, self.renormalize, self.scaling)


def softmax_routing(logits, bias, k):
    scores = logits.softmax(-1)
    experts = torch.topk(scores + bias, k, dim=-1).indices
    w = scores.gather(-1, experts)
    return w / (w.sum(-1, keepdim=True) + 1e-20), experts


def weights_from_the_biased_keys(logits, bias, k):
    keys = torch.sigmoid(logits) + bias
    experts = torch.topk(keys, k, dim=-1).indices
    w = keys.gather(-1, experts)
    return w / (w.sum(-1, keepdim=True) + 1e-20), experts


def smallest_k(logits, bias, k):
    scores = torch.sigmoid(logits)
    experts = torch.topk(scores + bias, k, dim=-1, largest=False).indices
    w = scores.gather(-1, experts)
    return w / (w.sum(-1, keepdim=True) + 1e-20), experts


def compile_and_run(model, x, backend="reference"):
    torch._dynamo.reset()
    with torch.no_grad():
        ref = model(x)
        k3compile.optimize(model, backend=backend, passes=["moe_route"], dynamic=False)
        out = model(x)
    rep = k3compile.report(model)
    return out, ref, rep.graphs[0].record


# each example compiles a graph (a second or two): a sixth of the profile's examples (the deep profile draws many)
@settings(max_examples=max(4, settings.default.max_examples // 6))
@given(m=st.integers(1, 20), e=st.integers(2, 70), k_frac=st.floats(0, 1), renormalize=st.booleans(),
       scaling=st.sampled_from([1.0, 2.5]), bf16=st.booleans(), seed=st.integers(0, 99))
@example(m=1, e=64, k_frac=0.12, renormalize=True, scaling=1.0, bf16=True, seed=0)     # K3's form, a decode M
@example(m=40, e=16, k_frac=0.2, renormalize=False, scaling=2.5, bf16=False, seed=1)   # a prefill M
def test_route_is_rewritten_and_equals_eager(m, e, k_frac, renormalize, scaling, bf16, seed):
    torch.manual_seed(seed)
    k = 1 + round(k_frac * (e - 1))
    dtype = torch.bfloat16 if bf16 else torch.float32
    model = Router(24, e, k, renormalize, scaling, dtype).eval()
    x = torch.randn(m, 24, dtype=dtype)
    (w, experts), (ref_w, ref_e), record = compile_and_run(model, x, backend="triton")
    assert record.matches["moe_route"] == record.facts["graph_router_topks"] == 1
    assert torch.equal(experts, ref_e)
    torch.testing.assert_close(w, ref_w, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("tail", [softmax_routing, weights_from_the_biased_keys, smallest_k],
                         ids=lambda f: f.__name__)
def test_other_routing_math_is_left_alone(tail):
    torch.manual_seed(0)
    model = Router(24, 32, 4, tail=tail).eval()
    x = torch.randn(3, 24)
    (w, experts), (ref_w, ref_e), record = compile_and_run(model, x)
    assert record.matches["moe_route"] == 0
    assert torch.equal(experts, ref_e) and torch.allclose(w, ref_w)
