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


pytestmark = pytest.mark.usefixtures("no_graph_caches")   # tests/conftest.py


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


# each example compiles a model (0.5-3 s here): a sixth of the profile's examples (the deep profile draws many)
@settings(max_examples=max(4, settings.default.max_examples // 6))
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


# --- max-autotune: Inductor's coordinate-descent mm decomposition must not hide our products ------

def _traced_targets(table, m, dtype=torch.bfloat16, transposed=True):
    """The ops ``mm(a, w.T)`` (or ``mm(a, b)``) becomes under ``table`` for CUDA tensors, traced on
    fake tensors (no GPU needed) with coordinate-descent tuning on, as ``mode="max-autotune*"`` sets."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    aten = torch.ops.aten
    with FakeTensorMode():
        a = torch.empty(m, 32, device="cuda", dtype=dtype)
        w = torch.empty(*((24, 32) if transposed else (32, 24)), device="cuda", dtype=dtype)
    fn = (lambda a, w: aten.mm(a, w.t())) if transposed else (lambda a, b: aten.mm(a, b))
    with torch._inductor.config.patch(coordinate_descent_tuning=True):
        gm = make_fx(fn, decomposition_table=table, tracing_mode="fake")(a, w)
    return {n.target for n in gm.graph.nodes if n.op == "call_function"}


@pytest.mark.parametrize("m,dtype,transposed,kept", [
    pytest.param(1, torch.bfloat16, True, True, id="M1-bf16-linear-kept"),
    pytest.param(1, torch.float32, True, True, id="M1-fp32-linear-kept"),
    pytest.param(1, torch.float64, True, False, id="M1-fp64-decomposed"),
    pytest.param(1, torch.bfloat16, False, False, id="M1-bf16-plain-mm-decomposed"),
])
def test_max_autotune_decomposition_keeps_only_our_products(m, dtype, transposed, kept):
    from torch._inductor.decomposition import select_decomp_table

    from k3compile.passes import K3Options
    from k3compile.patterns import skinny_gemm as pattern

    aten = torch.ops.aten
    default = select_decomp_table()
    assert aten.mm.default not in _traced_targets(default, m, dtype, transposed)  # what Inductor does
    with torch._inductor.config.patch(coordinate_descent_tuning=True):
        overrides = pattern.decompositions(K3Options())
    assert pattern.decompositions(K3Options()) == {}  # default modes: nothing overridden
    targets = _traced_targets({**default, **overrides}, m, dtype, transposed)
    assert (aten.mm.default in targets) == kept
    assert (aten.sum.dim_IntList in targets) == (not kept)


@pytest.mark.parametrize("mode", [None, "max-autotune-no-cudagraphs"], ids=["default", "max-autotune"])
def test_pattern_fires_under_max_autotune(mode):
    """optimize() hands compile_fx the amended table only under coordinate-descent tuning."""
    from unittest import mock

    import torch._inductor.compile_fx as cfx

    from k3compile.patterns.skinny_gemm import KeepSkinnyMM

    torch.manual_seed(0)
    model = Projection(32, 24, bias=False, residual=True).to(torch.bfloat16)
    x, r = torch.randn(1, 1, 32, dtype=torch.bfloat16), torch.randn(1, 1, 24, dtype=torch.bfloat16)
    with mock.patch.object(cfx, "compile_fx", wraps=cfx.compile_fx) as spy:
        out, ref, rep = compile_and_run(model, x, r, backend="reference", mode=mode)
    table = spy.call_args_list[0].kwargs.get("decompositions")
    if mode is None:
        assert table is None
    else:
        assert isinstance(table[torch.ops.aten.mm.default], KeepSkinnyMM)
    assert rep.matches["skinny_gemm"] == 1
    assert rel_err(out, ref) < TOL[torch.bfloat16]


@pytest.mark.parametrize("m", [1, 4], ids=lambda m: f"M{m}")
def test_pattern_fires_on_a_gpu_graph_traced_as_max_autotune_does(m):
    """The GPU side of mode="max-autotune*" without a GPU: ``linear(x, w) + r`` on fake CUDA tensors,
    traced with Inductor's table plus our override under coordinate-descent tuning (as AOTAutograd
    does), then our pass under the same config -- where the matcher re-traces its search function on
    the match's CUDA values (an M = 1 ``mm`` must not decompose there either)."""
    from torch._inductor.decomposition import select_decomp_table
    from torch._inductor.fx_passes.post_grad import view_to_reshape
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    from k3compile.passes import COMPILE_RECORD, K3Options, K3PostGradPass
    from k3compile.patterns import skinny_gemm as pattern

    options = K3Options(backend="reference", passes=("skinny_gemm",))
    with FakeTensorMode():
        x = torch.empty(m, 1, 64, device="cuda", dtype=torch.bfloat16)
        w = torch.empty(48, 64, device="cuda", dtype=torch.bfloat16)
        r = torch.empty(m, 1, 48, device="cuda", dtype=torch.bfloat16)
    with torch._inductor.config.patch(coordinate_descent_tuning=True):
        table = {**select_decomp_table(), **pattern.decompositions(options)}
        gm = make_fx(lambda x, w, r: torch.nn.functional.linear(x, w) + r, decomposition_table=table,
                     tracing_mode="fake")(x, w, r)
        view_to_reshape(gm)
        COMPILE_RECORD.take()
        K3PostGradPass(options)(gm.graph)
    (record,) = COMPILE_RECORD.take()
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert record.matches["skinny_gemm"] == 1
    assert torch.ops.k3.skinny_gemm.default in targets and torch.ops.aten.add.Tensor not in targets


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["reduce-overhead", "max-autotune-no-cudagraphs"])
def test_pattern_triton_on_gpu_decode_product(mode):
    """M = 1 on the GPU: the rewrite fires under both modes (max-autotune: despite Inductor's M = 1 mm
    decomposition), and replays stay right (reduce-overhead: the one-launch counters live outside the
    CUDA-graph pool and rearm between replays)."""
    torch.manual_seed(0)
    model = Projection(7168, 2112, bias=False, residual=True).cuda().to(torch.bfloat16)
    x = torch.randn(1, 1, 7168, device="cuda", dtype=torch.bfloat16)
    r = torch.randn(1, 1, 2112, device="cuda", dtype=torch.bfloat16)
    out, ref, rep = compile_and_run(model, x, r, backend="triton", mode=mode)
    assert rep.matches["skinny_gemm"] == 1
    assert any(c.impl == "triton" for c in rep.choices)
    with torch.no_grad():
        for _ in range(3):
            out = model(x, r).clone()
            assert rel_err(out, ref) < TOL[torch.bfloat16]
