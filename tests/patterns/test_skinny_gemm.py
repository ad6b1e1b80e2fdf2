"""The skinny-GEMM rewrite: fires exactly where its guard allows, and the result equals eager.

Every test compiles with the FX-graph and AOTAutograd caches off (a hit would skip the pass; the
C++ kernel cache stays on, it only saves g++ time) and resets Dynamo per module so no compiled
code is reused across examples. Sizes avoid K = 1 and M = N = 1: Inductor decomposes those
products into pointwise ops before our pass sees them (see the module doc of the pattern).
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

import k3compile
from k3compile.testing import rel_err

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 3e-3, torch.float64: 1e-12}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@pytest.fixture(autouse=True)
def no_graph_caches():
    with torch._inductor.config.patch(fx_graph_cache=False), \
            torch._functorch.config.patch(enable_autograd_cache=False):
        yield


class Projection(torch.nn.Module):
    """``linear(x) (+ r)``, 2-D or 3-D, with or without bias: the four shapes of one pattern."""

    def __init__(self, k, n, bias, residual):
        super().__init__()
        self.proj = torch.nn.Linear(k, n, bias=bias)
        self.residual = residual

    def forward(self, x, r):
        y = self.proj(x)
        return y + r if self.residual else y


class Stack(torch.nn.Module):
    """``repeats`` residual projections in a row: ``h = proj_i(h) + h``."""

    def __init__(self, d, repeats):
        super().__init__()
        self.projs = torch.nn.ModuleList(torch.nn.Linear(d, d, bias=i % 2 == 0) for i in range(repeats))

    def forward(self, h):
        for p in self.projs:
            h = p(h) + h
        return h


def compile_and_run(model, *inputs, **optimize_kwargs):
    torch._dynamo.reset()
    ref = model(*inputs)
    optimize_kwargs.setdefault("passes", ["skinny_gemm"])
    k3compile.optimize(model, **optimize_kwargs)
    with torch.no_grad():
        out = model(*inputs)
    return out, ref, k3compile.report(model)


# each example compiles a model (0.5-3 s here): a third of the profile's examples
@settings(max_examples=max(8, settings.default.max_examples // 3))
@given(
    m=st.integers(1, 64), n=st.integers(2, 40), k=st.integers(2, 40),
    dtype=st.sampled_from(sorted(DTYPES)), bias=st.booleans(), residual=st.booleans(),
    three_d=st.booleans(), seed=st.integers(0, 2**16),
)
@example(m=4, n=24, k=16, dtype="bf16", bias=False, residual=True, three_d=True, seed=0)
@example(m=16, n=8, k=9, dtype="fp32", bias=True, residual=True, three_d=False, seed=0)
@example(m=17, n=8, k=9, dtype="fp32", bias=True, residual=True, three_d=False, seed=0)
def test_pattern_fires_iff_m_within_limit(m, n, k, dtype, bias, residual, three_d, seed):
    torch.manual_seed(seed)
    dt = DTYPES[dtype]
    model = Projection(k, n, bias, residual).to(dt)
    shape = (m, 1) if three_d else (m,)           # 3-D input: [M, 1, K] reaches mm as [M, K]
    x = torch.randn(*shape, k, dtype=dt)
    r = torch.randn(*shape, n, dtype=dt)
    out, ref, rep = compile_and_run(model, x, r, backend="reference")
    assert rep.matches["skinny_gemm"] == (1 if m <= 16 else 0)
    assert rel_err(out, ref) < TOL[dt]


@pytest.mark.parametrize("limit,expected", [(4, 0), (8, 3)], ids=["limit4-M8-none", "limit8-M8-all"])
def test_pattern_counts_exactly_and_respects_the_configured_limit(limit, expected):
    model = Stack(24, 3)
    out, ref, rep = compile_and_run(model, torch.randn(2, 4, 24), backend="reference", small_m_limit=limit)
    assert rep.matches["skinny_gemm"] == expected
    assert rel_err(out, ref) < TOL[torch.float32]


def test_pattern_triton_backend_equals_eager_bf16():
    model = Stack(40, 2).to(torch.bfloat16)
    out, ref, rep = compile_and_run(model, torch.randn(1, 3, 40, dtype=torch.bfloat16), backend="triton")
    assert rep.matches["skinny_gemm"] == 2
    assert rel_err(out, ref) < TOL[torch.bfloat16]
    assert any(c.impl == "triton" for c in rep.choices)


class NearMisses(torch.nn.Module):
    """Products the rewrite must leave alone, partly fuse, or fuse in a disguised form."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(8, 12))
        self.col_bias = torch.nn.Parameter(torch.randn(4, 1))
        self.full_bias = torch.nn.Parameter(torch.randn(4, 8))
        self.row_bias = torch.nn.Parameter(torch.randn(1, 8))

    def forward(self, x, row):
        broadcast_res = torch.nn.functional.linear(x, self.w) + row        # residual [8] broadcasts
        col = torch.addmm(self.col_bias, x, self.w.T)                       # bias [M, 1]: refused
        full = torch.addmm(self.full_bias, x, self.w.T)                     # bias [M, N]: a residual
        row_b = torch.addmm(self.row_bias, x, self.w.T)                     # bias [1, N]: a bias
        return broadcast_res, col, full, row_b


def test_pattern_near_misses_are_left_or_partly_fused():
    model = NearMisses()
    out, ref, rep = compile_and_run(model, torch.randn(4, 12), torch.randn(8), backend="reference")
    # the broadcast add stays an add but its mm alone fuses; the [M, 1] bias does not; the other two do
    assert rep.matches["skinny_gemm"] == 3
    assert rep.graphs[0].record.facts["graph_small_m_gemms"] == 4
    for o, r in zip(out, ref):
        assert rel_err(o, r) < TOL[torch.float32]


def test_pattern_ignores_float64():
    model = Projection(8, 8, True, True).double()
    out, ref, rep = compile_and_run(model, torch.randn(2, 8).double(), torch.randn(2, 8).double())
    assert rep.matches["skinny_gemm"] == 0
    assert rel_err(out, ref) < TOL[torch.float64]


def test_symbolic_m_dispatches_at_run_time():
    from k3compile.ops.skinny_gemm import SKINNY_GEMM

    SKINNY_GEMM.clear()
    torch._dynamo.reset()
    model = Projection(12, 10, True, True)
    k3compile.optimize(model, passes=["skinny_gemm"], backend="reference", dynamic=True)
    with torch.no_grad():
        for m in (3, 5, 40):
            x, r = torch.randn(m, 12), torch.randn(m, 10)
            assert rel_err(model(x, r), model._orig_mod(x, r) if hasattr(model, "_orig_mod")
                           else model.forward(x, r)) < TOL[torch.float32]
    rep = k3compile.report(model)
    assert rep.matches["skinny_gemm"] >= 1
    impls = {c.key[2][0]: c.impl for c in SKINNY_GEMM.choices()}
    assert impls[3] == "reference" and impls[40] == "aten"
