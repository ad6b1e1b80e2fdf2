"""k3compile/product_order.py: the skinny GEMMs of one input moved together, largest weight first, on drawn graphs
of products (a KDA-like group: equal and smaller weights, a low-rank chain hanging off one of them, a product whose
residual is computed after the group starts); the reordered graph computes the same values bit for bit. One compile
through ``optimize()`` with the setting on."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.fx.experimental.proxy_tensor import make_fx

import k3compile.ops.skinny_gemm  # noqa: F401  (registers k3::skinny_gemm)
from k3compile.product_order import order_same_input_products

GEMM = torch.ops.k3.skinny_gemm.default
K = 16


def _program(widths, chain_after, late_residual):
    """x -> one product a width of ``widths`` (in that order), a chain product on the output of product
    ``chain_after`` placed right after it, and (``late_residual``) a last product whose residual is computed from
    the first product's output."""
    def fn(x, *ws):
        outs, first = [], None
        for i, w in enumerate(ws[:len(widths)]):
            y = GEMM(x, w, None, None, "reference")
            first = y if first is None else first
            outs.append(y)
            if i == chain_after:
                outs.append(GEMM(y, ws[len(widths)], None, None, "reference"))
        if late_residual:
            r = first[:, :widths[-1]] * 2
            outs.append(GEMM(x, ws[len(widths) - 1], None, r, "reference"))
        return tuple(outs)
    return fn


@settings(max_examples=40, deadline=None)
@given(widths=st.lists(st.sampled_from([4, 8, 24, 40]), min_size=2, max_size=6),
       chain=st.integers(0, 5), late=st.booleans(), seed=st.integers(0, 2**16))
def test_same_input_products_move_together_largest_first(widths, chain, late, seed):
    chain = min(chain, len(widths) - 1)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, K, generator=g)
    ws = [torch.randn(n, K, generator=g) for n in widths] + [torch.randn(8, widths[chain], generator=g)]
    gm = make_fx(_program(widths, chain, late))(x, *ws)
    want = gm(x, *ws)
    order_same_input_products(gm.graph)
    gm.graph.lint()
    gm.recompile()
    got = gm(x, *ws)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    gemms = [n for n in gm.graph.nodes if n.target is GEMM]
    xs = [n for n in gemms if n.args[0].op == "placeholder" and n.args[3] is None]
    rows = [n.args[1].meta["val"].shape[0] for n in xs]
    assert rows == sorted(rows, reverse=True)                       # largest first, ...
    at = [gemms.index(n) for n in xs]
    assert at == list(range(at[0], at[0] + len(xs)))                # ... one after another
    if late:                                                        # its residual comes later: it stays last
        assert gemms[-1].args[3] is not None


def test_a_single_product_of_an_input_is_left_alone():
    x, w = torch.randn(2, K), torch.randn(8, K)
    gm = make_fx(lambda x, w: GEMM(torch.relu(x), w, None, None, "reference") + 1)(x, w)
    before = [n.name for n in gm.graph.nodes]
    assert order_same_input_products(gm.graph) == 0
    assert [n.name for n in gm.graph.nodes] == before


def test_options_follow_the_environment(monkeypatch):
    from k3compile.passes import K3Options, K3PostGradPass

    monkeypatch.delenv("K3_ORDER_PRODUCTS", raising=False)
    assert not K3Options().order_products
    monkeypatch.setenv("K3_ORDER_PRODUCTS", "1")
    assert K3Options().order_products
    assert K3PostGradPass(K3Options()).uuid() != K3PostGradPass(K3Options(order_products=False)).uuid()


@pytest.mark.usefixtures("no_graph_caches")   # tests/conftest.py
def test_optimize_orders_a_compiled_graphs_products_under_the_setting(monkeypatch):
    """Through ``optimize()`` (the pass manager's call, ``k3compile/passes.py``): with ``K3_ORDER_PRODUCTS=1`` the
    decode graph's same-input products are reordered, the count in the record, the outputs equal eager's."""
    from k3compile.passes import PRODUCT_ORDER_FACT
    from k3compile.testing import eager_then_optimized

    class Group(torch.nn.Module):   # a KDA-like group: a small product ahead of two larger ones of one input
        def __init__(self):
            super().__init__()
            self.small, self.big, self.mid = (torch.nn.Linear(K, n, bias=False) for n in (4, 48, 24))

        def forward(self, x):
            x = torch.tanh(x)
            return self.small(x), self.big(x), self.mid(x)

    monkeypatch.setenv("K3_ORDER_PRODUCTS", "1")
    out, ref, record = eager_then_optimized(Group(), torch.randn(2, K), passes=("skinny_gemm",))
    assert record.matches["skinny_gemm"] == 3 and record.facts[PRODUCT_ORDER_FACT] > 0
    for o, r in zip(out, ref):
        torch.testing.assert_close(o, r, rtol=1e-5, atol=1e-6)
