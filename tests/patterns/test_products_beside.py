"""The products-beside fold (patterns/products_beside.py): an input's small products (and a product of one of their
outputs) go beside its large ones in one ``k3::products_beside`` after the skinny-GEMM pass made them k3 ops, exactly
where the split holds, and the module equals eager."""
from __future__ import annotations

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from k3compile.ops.products_beside import PRODUCTS_BESIDE
from k3compile.patterns.products_beside import FACT
from k3compile.testing import eager_then_optimized, rel_err

pytestmark = pytest.mark.usefixtures("no_graph_caches")   # tests/conftest.py

PASSES = ("skinny_gemm", "products_beside")
TOL = {torch.float32: 1e-5, torch.bfloat16: 3e-2}   # the interpreter truncates bf16 casts


class Projections(torch.nn.Module):
    """A KDA layer's input projections (model/kda.py): four of ``heads x dim`` rows, the beta product (``heads``
    rows), the gate's rank product (``dim`` rows) and its up-projection; ``bias``: q's with a bias; ``tap``: the rank
    product's output also returned (read outside its chained product)."""

    def __init__(self, dtype, d=96, heads=6, dim=16, bias=False, tap=False):
        super().__init__()
        p = heads * dim
        self.q, self.k, self.v, self.g = (torch.nn.Linear(d, p, bias=bias and i == 0) for i in range(4))
        self.b, self.f_a = torch.nn.Linear(d, heads, bias=False), torch.nn.Linear(d, dim, bias=False)
        self.f_b = torch.nn.Linear(dim, p, bias=False)
        self.tap = tap
        self.to(dtype)

    def forward(self, x):
        x = torch.tanh(x)   # made in the graph, as a mix's output is (the static-weight proof can hold)
        fa = self.f_a(x)
        # the gate's up-projection read by a nonlinearity, as in the model (an add would become its residual)
        out = (self.q(x) * self.k(x) + self.v(x) * torch.sigmoid(self.g(x)) * torch.sigmoid(self.f_b(fa)),
               torch.sigmoid(self.b(x).float()))
        return (*out, fa) if self.tap else out


def compile_and_run(model, x, passes=PASSES):
    return eager_then_optimized(model, x, passes=passes, records=(PRODUCTS_BESIDE,))


def close(out, ref, dtype):
    return all(rel_err(o.float(), r.float()) <= TOL[dtype] for o, r in zip(out, ref))


# each example compiles a graph (seconds): few examples
@settings(max_examples=max(3, settings.default.max_examples // 6))
@given(m=st.integers(1, 16), dtype=st.sampled_from([torch.float32, torch.bfloat16]), seed=st.integers(0, 99))
@example(m=1, dtype=torch.bfloat16, seed=0)    # a decode step
@example(m=5, dtype=torch.float32, seed=1)
def test_small_products_fold_beside_the_large_and_equal_eager(m, dtype, seed):
    torch.manual_seed(seed)
    model = Projections(dtype)
    x = torch.randn(m, 96).to(dtype)
    out, ref, record = compile_and_run(model, x)
    assert record.matches["products_beside"] == record.facts[FACT] == 1 and record.matches["skinny_gemm"] == 7
    (choice,) = PRODUCTS_BESIDE.choices()
    assert choice.impl == "in turn" and choice.key == ("cpu", "N=96+96+96+96", "side=16+6")   # graph order: f_a first
    # four main products, two side products and the chained one, each proven static
    assert record.facts["static_weight"]["products_beside"] == {"proven": 7, "not proven": {}}
    assert close(out, ref, dtype)


def test_a_side_output_read_elsewhere_keeps_its_chained_product_apart():
    model = Projections(torch.float32, tap=True)
    out, ref, record = compile_and_run(model, torch.randn(2, 96))
    assert record.matches["products_beside"] == 1
    assert record.facts["static_weight"]["products_beside"]["proven"] == 6   # f_b a skinny GEMM of its own
    assert record.facts["static_weight"]["skinny_gemm"]["proven"] == 1
    assert close(out, ref, torch.float32)


def test_a_product_with_a_bias_stays_apart():
    model = Projections(torch.float32, bias=True)
    out, ref, record = compile_and_run(model, torch.randn(2, 96))
    assert record.matches["products_beside"] == 1
    assert record.facts["static_weight"]["products_beside"]["proven"] == 6   # q (with its bias) a skinny GEMM
    assert close(out, ref, torch.float32)


def test_no_small_product_nothing_folded_or_expected():
    """Two heads of two: every product of x has at least half the rows of the largest."""
    model = Projections(torch.float32, heads=2, dim=2)
    out, ref, record = compile_and_run(model, torch.randn(2, 96))
    assert record.matches["products_beside"] == record.facts[FACT] == 0 and record.matches["skinny_gemm"] == 7
    assert close(out, ref, torch.float32)


@pytest.mark.parametrize("rows, parts", [
    ((96, 96, 96, 96, 6, 16), ([0, 1, 2, 3], [4, 5])),     # KDA's: four large, beta and the gate's rank
    ((96, 24), ([0], [1])),                                 # a quarter of the largest is small, and within budget
    ((96, 25), None),                                       # just over a quarter: nothing small
    ((96, 20, 20), None),                                   # two small ones hold more than a quarter of the large
    ((96, 96, 20, 20), ([0, 1], [2, 3])),                   # ... of two large ones, not
    ((8, 8), None),                                         # all alike
])
def test_split_by_elements(rows, parts, monkeypatch):
    import k3compile.patterns.products_beside as pb

    sizes = dict(enumerate(rows))
    monkeypatch.setattr(pb, "_numel", lambda w: sizes[w] * 64)
    assert pb.split(list(range(len(rows)))) == parts


def test_prefill_rows_above_the_small_m_limit_no_fold():
    model = Projections(torch.float32)
    out, ref, record = compile_and_run(model, torch.randn(40, 96))
    assert record.matches["products_beside"] == record.facts[FACT] == 0
    assert close(out, ref, torch.float32)
