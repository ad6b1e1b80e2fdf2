"""The upcast-matmul rewrite (patterns/upcast_matmul.py): ``linear(x.float(), w.float())`` of a 16-bit parameter
becomes ``k3::skinny_gemm`` on the 16-bit weight with a fp32 output, exactly where its guard allows, and the result
equals eager.

Compiled with the FX-graph and AOTAutograd caches off (``no_graph_caches``); the passes are this one and the
skinny-GEMM pass it runs before, so each test shows which of the two took a product.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import example, given, settings
from hypothesis import strategies as st

import k3compile
from k3compile.testing import rel_err

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
PASSES = ["upcast_matmul", "skinny_gemm"]
FP32_TOL = 1e-6   # the same fp32 products; only the summation order may differ from eager's

pytestmark = pytest.mark.usefixtures("no_graph_caches")   # tests/conftest.py


class Router(torch.nn.Module):
    """``sigmoid(linear(x.float(), w.float()[, b.float()]))`` as model/moe.py ``route`` scores, x [M, K] 16-bit."""

    def __init__(self, k, n, bias):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(n, k) / k ** 0.5)
        self.bias = torch.nn.Parameter(torch.randn(n)) if bias else None

    def forward(self, x):
        b = None if self.bias is None else self.bias.float()
        return torch.sigmoid(F.linear(x.float(), self.weight.float(), b))


def compile_and_run(model, *inputs, passes=PASSES, **optimize_kwargs):
    torch._dynamo.reset()
    with torch.no_grad():
        ref = model(*inputs)
        k3compile.optimize(model, backend="reference", passes=passes, strict=True, **optimize_kwargs)
        out = model(*inputs)
    rep = k3compile.report(model)
    return out, ref, rep, rep.graphs[0].record.facts


# each example compiles a model (0.5-3 s here): a sixth of the profile's examples (the deep profile draws many)
@settings(max_examples=max(4, settings.default.max_examples // 6))
@given(m=st.integers(1, 24), n=st.integers(2, 40), k=st.integers(2, 40), dtype=st.sampled_from(sorted(DTYPES)),
       bias=st.booleans(), seed=st.integers(0, 2**16))
@example(m=4, n=24, k=56, dtype="bf16", bias=False, seed=0)     # the router's form at a decode M
@example(m=16, n=8, k=9, dtype="fp16", bias=True, seed=1)
@example(m=17, n=8, k=9, dtype="bf16", bias=False, seed=2)      # above the limit: left to skinny_gemm (which also
def test_pattern_fires_iff_m_within_limit_and_equals_eager(m, n, k, dtype, bias, seed):  # declines, M > 16)
    torch.manual_seed(seed)
    model = Router(k, n, bias).to(DTYPES[dtype]).eval()
    x = torch.randn(m, k, dtype=DTYPES[dtype])
    out, ref, rep, facts = compile_and_run(model, x)
    fires = int(m <= 16)
    assert rep.matches["upcast_matmul"] == facts["graph_upcast_gemms"] == fires
    assert rep.matches["skinny_gemm"] == 0
    assert out.dtype == torch.float32 and rel_err(out, ref) < FP32_TOL


class NearMisses(torch.nn.Module):
    """Upcast products the pass must leave to skinny_gemm, one whose output is used in 16 bits, and one sharing its
    ``x.float()`` with another use."""

    def __init__(self, k, n):
        super().__init__()
        self.w16 = torch.nn.Parameter(torch.randn(n, k, dtype=torch.bfloat16))
        self.v16 = torch.nn.Parameter(torch.randn(n, k, dtype=torch.bfloat16))
        self.w32 = torch.nn.Parameter(torch.randn(n, k))
        self.src = torch.nn.Parameter(torch.randn(n, k, dtype=torch.bfloat16))

    def forward(self, x, y, z):
        fp32_weight = F.linear(x.float(), self.w32.float())                     # .float() of fp32: no cast at all
        computed = F.linear(x.float(), (self.src * 2).float())                  # a computed [N, K], no parameter
        # used in 16 bits: the fp32 sums rounded once, as eager rounds them (a bf16-output GEMM would round the
        # same sums once too; what the pass must keep is the fp32 value every other use of the output reads)
        rounded = F.linear(y.float(), self.w16.float()).to(torch.bfloat16)
        zf = z.float()
        shared = F.linear(zf, self.v16.float()), zf.sum()                        # zf has another user
        return fp32_weight, computed, rounded, *shared


def test_pattern_near_misses_go_to_skinny_gemm_and_16_bit_use_stays_exact():
    model = NearMisses(24, 10).eval()
    x, y, z = (torch.randn(4, 24, dtype=torch.bfloat16) for _ in range(3))
    out, ref, rep, facts = compile_and_run(model, x, y, z)
    assert rep.matches["upcast_matmul"] == facts["graph_upcast_gemms"] == 2     # the 16-bit use, the shared x
    assert rep.matches["skinny_gemm"] == 2                                       # fp32 weight, computed weight
    assert [o.dtype for o in out] == [r.dtype for r in ref]
    for o, r in zip(out, ref):
        assert rel_err(o, r) < FP32_TOL if o.dtype == torch.float32 else torch.equal(o, r)


def test_pattern_ignores_fp32_models_and_is_not_expected_there():
    """An fp32 router has no cast: the skinny-GEMM pass takes it, and strict mode raises nothing for this pass."""
    model = Router(24, 10, bias=False).eval()
    out, ref, rep, facts = compile_and_run(model, torch.randn(4, 24))
    assert rep.matches["upcast_matmul"] == facts["graph_upcast_gemms"] == 0
    assert rep.matches["skinny_gemm"] == 1
    assert rel_err(out, ref) < FP32_TOL


def test_static_weight_proof_holds_for_the_rewritten_router():
    """The 16-bit parameter is the op's weight: proven static where the activation comes from a kernel of the graph
    (here a norm-like scale), where the cast used to stand in between."""

    class Scaled(Router):
        def forward(self, x):
            return super().forward(x * 2)

    model = Scaled(32, 16, bias=False).to(torch.bfloat16).eval()
    out, ref, rep, facts = compile_and_run(model, torch.randn(2, 32, dtype=torch.bfloat16))
    assert rep.matches["upcast_matmul"] == 1
    assert facts["static_weight"]["skinny_gemm"]["proven"] == 1
    assert rel_err(out, ref) < FP32_TOL


def test_symbolic_m_rewrites_and_dispatches_at_run_time():
    from k3compile.ops.skinny_gemm import SKINNY_GEMM

    SKINNY_GEMM.clear()
    model = Router(24, 10, bias=True).to(torch.bfloat16).eval()
    torch._dynamo.reset()
    k3compile.optimize(model, backend="reference", passes=PASSES, dynamic=True)
    with torch.no_grad():
        for m in (3, 40):
            x = torch.randn(m, 24, dtype=torch.bfloat16)
            assert rel_err(model(x), torch.sigmoid(F.linear(x.float(), model.weight.float(),
                                                            model.bias.float()))) < FP32_TOL
    assert k3compile.report(model).matches["upcast_matmul"] >= 1
    impls = {c.key[2][0]: c.impl for c in SKINNY_GEMM.choices()}
    assert impls[3] == "reference" and impls[40] == "aten"
