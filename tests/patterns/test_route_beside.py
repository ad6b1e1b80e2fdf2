"""The routing-beside fold (patterns/route_beside.py): a MoE layer's routing and the largest other product of its
input become one ``k3::route_beside`` after the other passes made them k3 ops, exactly where both read one input
with no bias or residual, and the outputs equal eager."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import example, given, settings
from hypothesis import strategies as st

from k3compile.model.moe import route
from k3compile.ops.route_beside import ROUTE_BESIDE
from k3compile.patterns.route_beside import FACT
from k3compile.testing import eager_then_optimized, rel_err

pytestmark = pytest.mark.usefixtures("no_graph_caches")   # tests/conftest.py

PASSES = ("moe_route", "upcast_matmul", "skinny_gemm", "route_beside")


class Front(torch.nn.Module):
    """The front of a latent MoE layer (model/moe.py): the routing, the latent down-projection and a shared
    expert's product, all of one input. ``down_bias``: the down-projection with a bias (a near miss)."""

    def __init__(self, d, e, latent, shared, top_k, dtype, down_bias=False):
        super().__init__()
        g = torch.Generator().manual_seed(d * e)
        self.router = torch.nn.Parameter((torch.randn(e, d, generator=g) / d ** 0.5).to(dtype))
        self.bias = torch.nn.Parameter(torch.randn(e, generator=g) * 0.1)
        self.down = torch.nn.Linear(d, latent, bias=down_bias).to(dtype)
        self.shared = torch.nn.Parameter((torch.randn(shared, d, generator=g) / d ** 0.5).to(dtype))
        self.top_k = top_k

    def forward(self, x):
        x = torch.tanh(x)   # made in the graph, as the mix's output is: the static-weight proof can hold
        weights, experts = route(x, self.router, self.bias, self.top_k, True, 2.5)
        return weights, experts, self.down(x), F.linear(x, self.shared)


def compile_and_run(model, x, passes=PASSES):
    return eager_then_optimized(model, x, passes=passes, records=(ROUTE_BESIDE,))


def assert_equal_to_eager(out, ref, dtype):
    weights, experts, down, shared = out
    assert torch.equal(experts, ref[1])
    torch.testing.assert_close(weights, ref[0], rtol=1e-5, atol=1e-6)
    tol = 1e-5 if dtype == torch.float32 else 2 * torch.finfo(dtype).eps
    assert rel_err(down, ref[2]) <= tol and rel_err(shared, ref[3]) <= tol


# each example compiles a graph (a few seconds): an eighth of the profile's examples (the deep profile draws many)
@settings(max_examples=max(3, settings.default.max_examples // 8))
@given(m=st.integers(1, 16), d=st.sampled_from([32, 48, 64]), e=st.integers(8, 24), latent=st.integers(8, 40),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), seed=st.integers(0, 99))
@example(m=1, d=64, e=16, latent=40, dtype=torch.bfloat16, seed=0)    # a decode step, the upcast router
@example(m=8, d=32, e=8, latent=24, dtype=torch.float32, seed=1)
def test_routing_and_the_largest_product_fold_and_equal_eager(m, d, e, latent, dtype, seed):
    torch.manual_seed(seed)
    shared = latent // 2   # the down-projection the larger: the op takes it
    model = Front(d, e, latent, shared, 4, dtype).eval()
    x = torch.randn(m, d).to(dtype)
    out, ref, record = compile_and_run(model, x)
    assert record.matches["route_beside"] == record.facts[FACT] == 1
    (choice,) = ROUTE_BESIDE.choices()
    assert choice.key[2] == f"N={latent}"
    assert record.facts["static_weight"]["route_beside"]["proven"] == 2   # both its products proven
    assert_equal_to_eager(out, ref, dtype)


def test_takes_the_shared_product_where_it_is_the_larger():
    model = Front(32, 8, 8, 24, 2, torch.float32).eval()
    out, ref, record = compile_and_run(model, torch.randn(2, 32))
    assert record.matches["route_beside"] == 1 and ROUTE_BESIDE.choices()[0].key[2] == "N=24"
    assert_equal_to_eager(out, ref, torch.float32)


def test_a_product_with_a_bias_is_not_taken():
    """The down-projection with a bias is left; the shared product (no bias) is taken instead."""
    model = Front(32, 8, 24, 8, 2, torch.float32, down_bias=True).eval()
    out, ref, record = compile_and_run(model, torch.randn(2, 32))
    assert record.matches["route_beside"] == 1 and ROUTE_BESIDE.choices()[0].key[2] == "N=8"
    assert_equal_to_eager(out, ref, torch.float32)


def test_no_other_product_of_the_input_no_fold():
    class RouteOnly(Front):
        def forward(self, x):
            return route(x, self.router, self.bias, self.top_k, True, 2.5)

    model = RouteOnly(32, 8, 8, 8, 2, torch.float32).eval()
    x = torch.randn(2, 32)
    out, ref, record = compile_and_run(model, x)
    assert record.matches["route_beside"] == record.facts[FACT] == 0 and record.matches["moe_route"] == 1
    assert torch.equal(out[1], ref[1])


def test_prefill_rows_above_the_small_m_limit_no_fold():
    """M 40: the products stay ``mm`` (the skinny-GEMM pass's limit), so nothing to fold and nothing expected."""
    model = Front(32, 8, 24, 8, 2, torch.float32).eval()
    out, ref, record = compile_and_run(model, torch.randn(40, 32))
    assert record.matches["route_beside"] == record.facts[FACT] == 0
    assert_equal_to_eager(out, ref, torch.float32)


def test_without_the_skinny_gemm_pass_nothing_is_folded():
    model = Front(32, 8, 24, 8, 2, torch.float32).eval()
    out, ref, record = compile_and_run(model, torch.randn(2, 32), passes=("moe_route", "route_beside"))
    assert record.matches["route_beside"] == 0
    assert_equal_to_eager(out, ref, torch.float32)
