"""The residual-add fold (patterns/attn_res_add.py): the add that makes a mix's last source becomes part of
``k3::attn_res_add`` exactly where it is the model's add, after the skinny-GEMM pass has taken the adds it fuses, and
the result (the mix and the partial sum every later reader reads) equals eager."""
from __future__ import annotations

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

import k3compile
from k3compile.model.attn_res import attn_res
from k3compile.model.layers import rms_norm
from k3compile.ops.attn_res import ATTN_RES, ATTN_RES_ADD
from k3compile.patterns.attn_res_add import FACT
from k3compile.testing import rel_err

pytestmark = pytest.mark.usefixtures("no_graph_caches")   # tests/conftest.py


class Residual(torch.nn.Module):
    """Two sub-layers of a block, as model/modeling.py writes them: ``prefix + a`` mixed (then normed), a product
    of the normed mix added to the partial sum again, that sum mixed for the next sub-layer. ``add`` makes each
    partial sum (the near misses replace it)."""

    def __init__(self, d, dtype, add=torch.add):
        super().__init__()
        g = torch.Generator().manual_seed(d)
        self.proj = torch.nn.Parameter(torch.randn(2, 1, d, generator=g).to(dtype))
        self.mix_norm = torch.nn.Parameter((1 + torch.randn(2, d, generator=g) * 0.1).to(dtype))
        self.norm_weight = torch.nn.Parameter((1 + torch.randn(d, generator=g) * 0.1).to(dtype))
        self.ffn = torch.nn.Parameter((torch.randn(d, d, generator=g) / d ** 0.5).to(dtype))
        self.add = add

    def forward(self, prefix, a, *blocks):
        prefix = self.add(prefix, a)
        h = rms_norm(attn_res(prefix, list(blocks), self.proj[0], self.mix_norm[0], 1e-6), self.norm_weight, 1e-5)
        prefix = self.add(prefix, torch.tanh(h @ self.ffn.T))   # a product the skinny-GEMM pass cannot take whole
        return attn_res(prefix, list(blocks), self.proj[1], self.mix_norm[1], 1e-6), prefix


def compile_and_run(model, xs, passes=("attn_res", "attn_res_add")):
    torch._dynamo.reset()
    ATTN_RES.clear()
    ATTN_RES_ADD.clear()
    with torch.no_grad():
        ref = model(*xs)
        k3compile.optimize(model, backend="triton", passes=list(passes), dynamic=False)
        out = model(*xs)
    return out, ref, k3compile.report(model).graphs[0].record


def assert_close_to_eager(out, ref):
    """fp32: to rounding. 16-bit: the second sum is the first one's mix normed, through a product and a tanh, each
    rounded to 16 bits in another order than eager's: within two of the dtype's eps, norm-wise."""
    if out.dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=2e-5, atol=2e-5)
    else:
        assert rel_err(out, ref) <= 2 * torch.finfo(out.dtype).eps


# each example compiles a graph (a few seconds): a sixth of the profile's examples (the deep profile draws many)
@settings(max_examples=max(4, settings.default.max_examples // 6))
@given(blocks=st.integers(1, 5), rows=st.sampled_from([(1, 1), (3, 1), (2, 5), (4,)]), d=st.integers(8, 96),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]), seed=st.integers(0, 99))
@example(blocks=1, rows=(1, 1), d=64, dtype=torch.bfloat16, seed=0)    # K3's first block, a decode step
@example(blocks=4, rows=(2, 5), d=40, dtype=torch.float32, seed=1)     # a prefill
def test_both_residual_adds_are_folded_and_equal_eager(blocks, rows, d, dtype, seed):
    torch.manual_seed(seed)
    model = Residual(d, dtype).eval()
    xs = [torch.randn(*rows, d).to(dtype) * (1 + i) for i in range(blocks + 2)]
    (out, prefix), (ref, ref_prefix), record = compile_and_run(model, xs)
    assert record.matches["attn_res"] == 2
    assert record.matches["attn_res_add"] == record.facts[FACT] == 2
    assert sum(c.calls for c in ATTN_RES_ADD.choices()) == 2 and not ATTN_RES.choices()
    assert_close_to_eager(out, ref)
    assert_close_to_eager(prefix, ref_prefix)   # the partial sum the next layer reads


def scaled_add(x, y):
    return torch.add(x, y, alpha=2)


def broadcast_add(x, y):
    return x + y[..., :1, :]


def scalar_add(x, y):
    return (x + y) + 1.5


@pytest.mark.parametrize("add", [scaled_add, broadcast_add, scalar_add], ids=lambda f: f.__name__)
def test_adds_that_are_not_the_models_are_left(add):
    """alpha != 1, a broadcast operand, a scalar operand: the add stays Inductor's, the mixes are still ops."""
    torch.manual_seed(3)
    model = Residual(24, torch.float32, add=add).eval()
    xs = [torch.randn(2, 3, 24) for _ in range(3)]
    (out, prefix), (ref, ref_prefix), record = compile_and_run(model, xs)
    assert record.matches["attn_res"] == 2
    assert record.matches["attn_res_add"] == record.facts[FACT] == 0
    torch.testing.assert_close(out, ref, rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(prefix, ref_prefix, rtol=2e-5, atol=2e-5)


class ProductResidual(torch.nn.Module):
    """``prefix + x @ wᵀ`` mixed, [B, 1, D] as a decode step's (a 2-D one Inductor turns into ``addmm`` itself)."""

    def __init__(self, d):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(d, d) / d ** 0.5)
        self.proj, self.mix_norm = torch.nn.Parameter(torch.randn(1, d)), torch.nn.Parameter(torch.ones(d))

    def forward(self, prefix, x, block):
        prefix = prefix + x @ self.w.T
        return attn_res(prefix, [block], self.proj, self.mix_norm, 1e-6), prefix


def test_an_add_a_small_product_takes_as_its_residual_stays_the_products():
    torch.manual_seed(4)
    model = ProductResidual(32).eval()
    xs = [torch.randn(2, 1, 32) for _ in range(3)]
    (out, prefix), (ref, ref_prefix), record = compile_and_run(
        model, xs, passes=("attn_res", "skinny_gemm", "attn_res_add"))
    assert record.matches["skinny_gemm"] == 1 and record.matches["attn_res"] == 1
    assert record.matches["attn_res_add"] == 0 and record.facts[FACT] == 1
    torch.testing.assert_close(out, ref, rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(prefix, ref_prefix, rtol=2e-5, atol=2e-5)
    (out, prefix), _, record = compile_and_run(model, xs)   # without the skinny-GEMM pass the add is the mix's
    assert record.matches["attn_res_add"] == record.facts[FACT] == 1
    torch.testing.assert_close(out, ref, rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(prefix, ref_prefix, rtol=2e-5, atol=2e-5)
