"""The AttnRes rewrite (patterns/attn_res.py): the model's mix, with the RMSNorm the layer puts after it, becomes
``k3::attn_res`` exactly where the math is the op's, for any number of sources, and the result equals eager."""
from __future__ import annotations

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

import k3compile
from k3compile import passes
from k3compile.model.attn_res import attn_res
from k3compile.model.layers import rms_norm
from k3compile.ops.attn_res import ATTN_RES
from k3compile.ops.attn_res.reference import attn_res_ref
from k3compile.passes import COMPILE_RECORD, K3Options, K3PostGradPass
from k3compile.patterns._common import fake_mode, online_softmax_pass, trace_fn, with_online_softmax
from k3compile.patterns.attn_res import FACT, _mix_norm, _mix_norm_unrounded, get_inputs, search

pytestmark = pytest.mark.usefixtures("no_graph_caches")   # tests/conftest.py


class Mix(torch.nn.Module):
    """A layer's mixing point: ``attn_res`` over (blocks, prefix), then (``norm``) the layer's RMSNorm. ``mix``
    replaces the model's mix for the near misses; ``extra_use`` also returns the mix itself."""

    def __init__(self, d, dtype, norm=True, mix=attn_res, extra_use=False):
        super().__init__()
        self.proj = torch.nn.Parameter(torch.randn(1, d).to(dtype))
        self.mix_norm = torch.nn.Parameter((1 + torch.randn(d) * 0.1).to(dtype))
        self.norm_weight = torch.nn.Parameter((1 + torch.randn(d) * 0.1).to(dtype)) if norm else None
        self.mix, self.extra_use = mix, extra_use

    def forward(self, prefix, *blocks):
        h = self.mix(prefix, list(blocks), self.proj, self.mix_norm, 1e-6)
        if self.norm_weight is None:
            return h
        out = rms_norm(h, self.norm_weight, 1e-5)
        return (out, h * 2) if self.extra_use else out


def depth_mean(prefix, blocks, proj, mix_norm, eps):
    """Not AttnRes: the sources averaged (a softmax over the hidden dim, not over depth)."""
    x = torch.stack([*blocks, prefix]).float()
    alpha = torch.softmax(x * (mix_norm.float() * proj.float().reshape(-1)), dim=-1)
    return (alpha * x).sum(0).to(prefix.dtype)


def raw_keys(prefix, blocks, proj, mix_norm, eps):
    """Not AttnRes: scores from the raw sources (no RMS normalisation of the keys)."""
    x = torch.stack([*blocks, prefix]).float()
    alpha = torch.softmax((x * (mix_norm.float() * proj.float().reshape(-1))).sum(-1), dim=0)
    return (alpha[..., None] * x).sum(0).to(prefix.dtype)


def compile_and_run(model, xs, backend="triton"):
    torch._dynamo.reset()
    ATTN_RES.clear()
    with torch.no_grad():
        ref = model(*xs)
        k3compile.optimize(model, backend=backend, passes=["attn_res"], dynamic=False)
        out = model(*xs)
    return out, ref, k3compile.report(model).graphs[0].record


def forms():
    """The op's calls recorded: "normed" or "mix" each."""
    return [c.key[1][3] for c in ATTN_RES.choices() for _ in range(c.calls)]


def assert_close_to_eager(out, ref):
    """fp32: to rounding; 16-bit: within two ulps of the row's scale (one rounding of the mix to 16 bits may fall
    the other way)."""
    if out.dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=2e-5, atol=2e-5)
        return
    ulp = torch.finfo(out.dtype).eps
    assert ((out.float() - ref.float()).abs() <= 2 * ulp * ref.float().abs().amax(-1, keepdim=True)
            + ulp * ref.float().abs()).all()


# each example compiles a graph (about a second): a sixth of the profile's examples (the deep profile draws many)
@settings(max_examples=max(4, settings.default.max_examples // 6))
@given(s=st.integers(2, 7), rows=st.sampled_from([(1, 1), (3, 1), (2, 5), (4,)]), d=st.integers(8, 96),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]), norm=st.booleans(),
       seed=st.integers(0, 99))
@example(s=2, rows=(1, 1), d=64, dtype=torch.bfloat16, norm=True, seed=0)    # K3's first mixes, a decode step
@example(s=7, rows=(2, 5), d=40, dtype=torch.float32, norm=False, seed=1)    # a region's mix, prefill
def test_mix_is_rewritten_and_equals_eager(s, rows, d, dtype, norm, seed):
    torch.manual_seed(seed)
    model = Mix(d, dtype, norm).eval()
    xs = [torch.randn(*rows, d).to(dtype) * (1 + i) for i in range(s)]
    out, ref, record = compile_and_run(model, xs)
    assert record.matches["attn_res"] == record.facts[FACT] == 1
    assert forms() == ["normed" if norm else "mix"]
    assert_close_to_eager(out, ref)


class Unrounded(Mix):
    """The mix and its norm as torch < 2.12 compiles them: the mix's rounding to 16 bits dropped."""

    def forward(self, prefix, *blocks):
        return _mix_norm_unrounded([*blocks, prefix], self.proj, self.mix_norm, 1e-6, self.norm_weight, 1e-5)


def test_torch_2_11s_unrounded_mix_is_rewritten_and_rounds_as_the_model():
    torch.manual_seed(2)
    model = Unrounded(32, torch.bfloat16).eval()
    xs = [torch.randn(3, 1, 32, dtype=torch.bfloat16) for _ in range(3)]
    out, _, record = compile_and_run(model, xs, backend="reference")
    assert record.matches["attn_res"] == 1 and forms() == ["normed"]
    with torch.no_grad():
        want = attn_res_ref(xs[1:] + xs[:1], model.proj, model.mix_norm, 1e-6, model.norm_weight, 1e-5)
    assert torch.equal(out, want)   # the op rounds the mix, as eager does


@pytest.mark.skipif(online_softmax_pass() is None, reason="this torch has no online-softmax rewrite")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_gpu_graphs_online_softmax_is_rewritten(dtype):
    """On a GPU Inductor rewrites the softmax over depth into ``prims.prepare_softmax_online`` before our pass; that
    graph, made here by the same rewrite of the model's trace, is rewritten whole (the norm in the op)."""
    args = get_inputs(3, dtype, True)
    with fake_mode():
        args = [torch.empty(a.shape, dtype=a.dtype) for a in args]
        gm = with_online_softmax(trace_fn)(search(_mix_norm, 3), args[:5] + [1e-6, args[5], 1e-5])
    graph = gm.graph
    assert graph.find_nodes(op="call_function", target=torch.ops.prims.prepare_softmax_online.default)
    COMPILE_RECORD.take()
    K3PostGradPass(K3Options(backend="reference", passes=("attn_res",)))(graph)
    (record,) = COMPILE_RECORD.take()
    assert record.matches["attn_res"] == record.facts[FACT] == 1
    (op,) = graph.find_nodes(op="call_function", target=torch.ops.k3.attn_res.default)
    assert op.args[4] is not None   # the norm's weight: the norm is in the op


def test_a_mix_used_beside_its_norm_is_rewritten_without_the_norm():
    torch.manual_seed(3)
    model = Mix(24, torch.float32, extra_use=True).eval()
    xs = [torch.randn(2, 24) for _ in range(3)]
    (out, h), (ref, ref_h), record = compile_and_run(model, xs)
    assert record.matches["attn_res"] == 1 and forms() == ["mix"]
    torch.testing.assert_close(out, ref, rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(h, ref_h, rtol=2e-5, atol=2e-5)


region_mix = torch.compiler.nested_compile_region(attn_res)   # a mix as optimize(regions=True) compiles it


@pytest.mark.parametrize("dtype,s,rows", [(torch.float32, 2, (1, 1)), (torch.bfloat16, 3, (2, 3)),
                                          (torch.bfloat16, 2, (4,))], ids=["fp32-S2", "bf16-S3", "bf16-S2-2d"])
def test_a_region_mix_and_the_norm_after_its_call_are_one_op(dtype, s, rows):
    """The mix is rewritten inside its body (mix alone); the caller's norm of the call's result is then folded into
    one op on the call's operands (the call left dead), and the report counts the mix once."""
    torch.manual_seed(4)
    model = Mix(40, dtype, mix=region_mix).eval()
    xs = [torch.randn(*rows, 40).to(dtype) * (1 + i) for i in range(s)]
    out, ref, record = compile_and_run(model, xs)
    assert record.matches["attn_res"] == record.facts[FACT] == 1
    assert forms() == ["normed"]   # one call, with the norm: the body's mix-alone op never ran
    assert_close_to_eager(out, ref)


def test_a_region_mix_read_beside_its_norm_keeps_its_call():
    torch.manual_seed(5)
    model = Mix(24, torch.float32, mix=region_mix, extra_use=True).eval()
    xs = [torch.randn(2, 24) for _ in range(3)]
    (out, h), (ref, ref_h), record = compile_and_run(model, xs)
    assert record.matches["attn_res"] == 1 and forms() == ["mix"]
    torch.testing.assert_close(out, ref, rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(h, ref_h, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("mix", [depth_mean, raw_keys], ids=lambda f: f.__name__)
def test_other_mixing_math_is_left_alone(mix):
    torch.manual_seed(4)
    model = Mix(24, torch.float32, mix=mix).eval()
    xs = [torch.randn(2, 24) for _ in range(3)]
    out, ref, record = compile_and_run(model, xs, backend="reference")
    assert record.matches["attn_res"] == 0
    torch.testing.assert_close(out, ref)


def test_too_many_sources_for_one_program_are_left_to_inductor():
    torch.manual_seed(5)
    model = Mix(16, torch.float32).eval()
    xs = [torch.randn(1, 16) for _ in range(17)]
    out, ref, record = compile_and_run(model, xs)
    assert record.matches["attn_res"] == 0 and record.facts[FACT] == 1
    torch.testing.assert_close(out, ref)


def test_only_the_source_counts_a_graph_holds_are_traced():
    torch.manual_seed(6)
    before = len(passes.REGISTRATIONS)
    out, ref, record = compile_and_run(Mix(16, torch.float32).eval(), [torch.randn(1, 16) for _ in range(5)])
    traced = [i for name, i in passes.REGISTRATIONS[before:] if name == "attn_res"]
    assert record.matches["attn_res"] == 1
    assert traced in ([], [5 - 2])   # the group of 5 sources (already traced by an earlier test: none)


def test_a_symbolic_batch_is_rewritten_once_and_serves_every_m():
    torch.manual_seed(7)
    model = Mix(32, torch.bfloat16).eval()
    inputs = [[torch.randn(m, 1, 32, dtype=torch.bfloat16) for _ in range(3)] for m in (3, 9)]
    with torch.no_grad():
        eager = [model(*xs) for xs in inputs]
        torch._dynamo.reset()
        ATTN_RES.clear()
        k3compile.optimize(model, backend="triton", passes=["attn_res"], dynamic=True)
        outs = [model(*xs) for xs in inputs]
    (graph,) = k3compile.report(model).graphs
    assert graph.record.matches["attn_res"] == 1 and forms() == ["normed", "normed"]
    for out, ref in zip(outs, eager):
        assert_close_to_eager(out, ref)
