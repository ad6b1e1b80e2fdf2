"""The routed-experts rewrite: fires on the model's two forms exactly, equals eager, and leaves near misses alone.

Graph level (cheap): the model's own functions traced to ATen on fake tensors as Inductor's inference graph looks
when our pass runs (make_fx with Inductor's decompositions, its joint-graph passes, ``view_to_reshape``), the
pass applied, the rewritten graph run on real tensors (``backend="reference"``). The CUDA spellings (batch-1
``bmm`` as ``mm``, max-autotune's ``bmm`` as mul + sum) are checked on fake CUDA tensors, which need no GPU.
The whole micro K3 through ``optimize`` (decode and prefill graphs, tokens equal eager) is in
tests/compiler/test_tiny_k3.py, sharing its compiled model.
"""
from __future__ import annotations

import pytest
import torch
from torch._guards import detect_fake_mode
from torch._inductor import config as inductor_config
from torch._inductor.decomposition import select_decomp_table
from torch._inductor.fx_passes.joint_graph import joint_graph_passes
from torch._inductor.fx_passes.post_grad import view_to_reshape
from torch._inductor.pattern_matcher import PatternMatcherPass
from torch._inductor.virtualized import V
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

import k3compile.ops.moe_experts  # noqa: F401  (registers k3::moe_experts)
from k3compile.model import KimiK3Config
from k3compile.model.layers import situ_glu
from k3compile.model.moe import (
    KimiLatentMoE, experts_dense, experts_dense_mxfp4, experts_gathered, experts_gathered_mxfp4,
)
from k3compile.passes import K3Options
from k3compile.patterns import moe_experts as pattern
from k3compile.patterns._common import fake_mode
from k3compile.testing import moe_experts_inputs, rel_err

OP = torch.ops.k3.moe_experts.default
aten = torch.ops.aten
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
BETAS = (4.0, 25.0)
_PASSES: dict = {}


def matcher(variants: tuple) -> PatternMatcherPass:
    """The pattern registered for these (device kind, coordinate descent) spellings, once per module."""
    if variants not in _PASSES:
        pm_pass = PatternMatcherPass(pass_name="k3_moe_experts_test")
        with fake_mode():
            pattern.register(pm_pass, K3Options(backend="reference", passes=(pattern.NAME,)), list(variants))
        _PASSES[variants] = pm_pass
    return _PASSES[variants]


def inductor_graph(fn, args, coordinate_descent: bool = False) -> torch.fx.GraphModule:
    """``fn`` as Inductor's inference graph on fake copies of ``args`` (already fake ones: traced as they are)."""
    mode = "real" if detect_fake_mode(args) is not None else "fake"
    with inductor_config.patch(coordinate_descent_tuning=coordinate_descent):
        gm = make_fx(fn, select_decomp_table(), tracing_mode=mode)(*args)
    fake = detect_fake_mode([n.meta.get("val") for n in gm.graph.nodes])
    # constant folding would run ``zeros`` on the device for real: on fake CUDA tensors it is skipped
    folding = fake is None or all(getattr(v, "device", torch.device("cpu")).type == "cpu" for v in args)
    with V.set_fake_mode(fake), inductor_config.patch(joint_graph_constant_folding=folding):
        joint_graph_passes(gm)
    view_to_reshape(gm)
    gm.graph.eliminate_dead_code()
    gm.recompile()
    return gm


def rewrite(fn, args, variants=(("cpu", False),), coordinate_descent=False):
    """(rewritten module, matches, facts before the rewrite)."""
    gm = inductor_graph(fn, args, coordinate_descent)
    facts = pattern.facts(gm.graph, K3Options())
    fake = detect_fake_mode([n.meta.get("val") for n in gm.graph.nodes])
    with V.set_fake_mode(fake):
        n = matcher(tuple(variants)).apply(gm.graph)
    gm.graph.eliminate_dead_code()
    gm.recompile()
    return gm, n, facts


def count(gm, *targets) -> int:
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and n.target in targets)


CASES = [("gathered", 1), ("gathered", 3), ("dense", 5), ("dense", 9), ("gathered-mxfp4", 1),
         ("gathered-mxfp4", 3), ("dense-mxfp4", 5)]   # dense needs M·A > E: A 3, E 4


def form(name):
    return {"gathered": experts_gathered, "dense": experts_dense, "gathered-mxfp4": experts_gathered_mxfp4,
            "dense-mxfp4": experts_dense_mxfp4}[name]


def spelled(name):
    """The pattern's own copy of a form (ATen spelling: fake CUDA tensors need it on a machine without CUDA)."""
    return {"gathered": pattern._gathered, "dense": pattern._dense, "gathered-mxfp4": pattern._gathered_mxfp4,
            "dense-mxfp4": pattern._dense_mxfp4}[name]


def inputs(name, m, dtype, seed=0):
    """The form's arguments: (z, experts, weights, w1, w3, w2), or for MXFP4 the model's order
    (z, experts, weights, w1_packed, w1_scale, w3_packed, w3_scale, w2_packed, w2_scale)."""
    if not name.endswith("mxfp4"):
        return moe_experts_inputs(m, 3, 4, 24, 40, dtype, seed=seed)[:6]
    z, ex, w, c1, c3, c2, s1, s3, s2 = moe_experts_inputs(m, 3, 4, 64, 96, dtype, mxfp4=True, seed=seed)
    return (z, ex, w, c1, s1, c3, s3, c2, s2)


def _ops(gm) -> list:
    """Each call's target and constant arguments (node names left out: the order of independent ops may differ)."""
    return [f"{n.target} {[a for a in n.args if not isinstance(a, (torch.fx.Node, list, tuple))]}"
            for n in gm.graph.nodes if n.op == "call_function"]


@pytest.mark.parametrize("name,m", [c for c in CASES if c[1] != 1 and c[:2] != ("dense", 9)],
                         ids=lambda v: str(v))
def test_pattern_copy_traces_as_the_model(name, m):
    """The pattern's copy of each form is the model's code, op for op (so the CUDA checks below, which trace the
    copy, speak for the model)."""
    args = inputs(name, m, torch.bfloat16)
    model_gm = inductor_graph(lambda *a: form(name)(*a, *BETAS), args)
    copy_gm = inductor_graph(lambda *a: spelled(name)(*a, *BETAS), args)
    assert sorted(_ops(model_gm)) == sorted(_ops(copy_gm))   # the same ops (the model may order them otherwise)
    _, n, _ = rewrite(lambda *a: form(name)(*a, *BETAS), args)
    assert n == 1


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("name,m", CASES, ids=[f"{f}-M{m}" for f, m in CASES])
def test_model_forms_rewritten_and_equal_eager(name, m, dtype):
    dt = DTYPES[dtype]
    args = inputs(name, m, dt, seed=m)
    fn = form(name)
    gm, n, facts = rewrite(lambda *a: fn(*a, *BETAS), args)
    assert (n, count(gm, OP), count(gm, aten.bmm.default, aten.mm.default)) == (1, 1, 0), gm.graph
    assert facts[pattern.FACT] == 1
    tol = 1e-6 if dt == torch.float32 else 1e-2
    assert rel_err(gm(*args), fn(*args, *BETAS)) < tol


def test_dense_mxfp4_in_chunks_left_alone_and_listed():
    """The dense MXFP4 form dequantising its experts in several chunks (K3's real widths): a graph whose size
    follows E, no candidate (strict mode must not expect it), and the reason recorded."""
    args = inputs("dense-mxfp4", 5, torch.bfloat16)
    gm, n, facts = rewrite(lambda *a: experts_dense_mxfp4(*a, *BETAS, chunk=2), args)
    assert n == 0 and facts[pattern.FACT] == 0 and "several chunks" in facts[pattern.REJECTED][0]


def test_dropped_final_cast_rewritten_with_the_models_rounding():
    """torch < 2.12 folds the model's ``bf16(out).float()`` into the fp32 sum: the op then comes with ``.float()``."""
    args = moe_experts_inputs(3, 3, 4, 24, 40, torch.bfloat16, seed=1)[:6]
    gm, n, _ = rewrite(lambda *a: experts_gathered(*a, *BETAS).float() * 2, args)
    assert n == 1
    out = gm(*args)
    assert out.dtype == torch.float32
    assert rel_err(out, experts_gathered(*args, *BETAS).float() * 2) < 1e-6


def _no_router_weights(z, experts, weights, w1, w3, w2):
    zc = z[:, None, :, None]
    h = situ_glu((w1[experts] @ zc).squeeze(-1), (w3[experts] @ zc).squeeze(-1), *BETAS)
    return (w2[experts] @ h[..., None]).squeeze(-1).float().sum(1).to(z.dtype)


def _transposed_gate(z, experts, weights, w1, w3, w2):
    zc = z[:, None, :, None]
    gate = (w1[experts].transpose(-1, -2) @ zc).squeeze(-1)      # I == L: same shapes, other math
    h = situ_glu(gate, (w3[experts] @ zc).squeeze(-1), *BETAS)
    y = (w2[experts] @ h[..., None]).squeeze(-1)
    return (y.float() * weights[..., None]).sum(1).to(z.dtype)


def _two_betas(z, experts, weights, w1, w3, w2):
    zc = z[:, None, :, None]
    g = (w1[experts] @ zc).squeeze(-1).float()
    u = (w3[experts] @ zc).squeeze(-1).float()
    h = (4.0 * torch.tanh(g / 5.0) * torch.sigmoid(g) * 25.0 * torch.tanh(u / 25.0)).to(z.dtype)   # beta != beta
    y = (w2[experts] @ h[..., None]).squeeze(-1)
    return (y.float() * weights[..., None]).sum(1).to(z.dtype)


NEAR_MISSES = {
    "silu-gathered": lambda *a: experts_gathered(*a, None, None),
    "silu-dense": lambda *a: experts_dense(*a, None, None),
    "uncapped-up": lambda *a: experts_gathered(*a, 4.0, None),
    "no-router-weights": _no_router_weights,
    "transposed-gate": _transposed_gate,
    "inconsistent-beta": _two_betas,
}


@pytest.mark.parametrize("case", list(NEAR_MISSES))
def test_near_miss_not_rewritten(case):
    m = 5 if "dense" in case else 2
    args = moe_experts_inputs(m, 3, 4, 32, 32, torch.float32, seed=2)[:6]     # I == L: only the math differs
    gm, n, _ = rewrite(NEAR_MISSES[case], args)
    assert n == 0 and count(gm, OP) == 0


@pytest.mark.parametrize("renormalize", [True, False])
def test_routed_latent_rewritten_whatever_the_routing(renormalize):
    """Routing stays outside the op (it takes the ids and weights the graph computed): renormalised or not, the
    experts are rewritten and the layer's routed latent equals eager."""
    cfg = KimiK3Config.tiny(moe_renormalize=renormalize).text_config
    moe = KimiLatentMoE(cfg).eval()
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.1)
    params = {k: v.detach() for k, v in moe.named_parameters()}

    def routed(x, *ps):   # the parameters as graph inputs, as Dynamo lifts them
        return torch.func.functional_call(_Routed(moe), {f"moe.{k}": p for k, p in zip(params, ps)}, (x,))

    x = torch.randn(2, cfg.hidden_size)
    gm, n, _ = rewrite(routed, (x, *params.values()))
    assert n == 1
    with torch.no_grad():
        assert rel_err(gm(x, *params.values()), moe.routed_latent(x)) < 1e-6


class _Routed(torch.nn.Module):
    def __init__(self, moe):
        super().__init__()
        self.moe = moe

    def forward(self, x):
        return self.moe.routed_latent(x)


# ---------------------------------------------------------------------------------------------
# the CUDA spellings, on fake CUDA tensors (no GPU needed)

def fake_cuda(tensors) -> list:
    """Fake CUDA tensors of the same shapes and dtypes (inside a FakeTensorMode; values do not matter)."""
    return [torch.empty(t.shape, dtype=t.dtype, device="cuda") for t in tensors]


CUDA_CASES = [("gathered", 1, False), ("gathered", 3, False), ("gathered", 3, True), ("dense", 5, False),
              ("dense", 9, True), ("gathered-mxfp4", 1, False), ("gathered-mxfp4", 3, True), ("dense-mxfp4", 5, False)]


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("name,m,autotune", CUDA_CASES,
                         ids=[f"{f}-M{m}{'-max-autotune' if t else ''}" for f, m, t in CUDA_CASES])
def test_cuda_spellings_rewritten(name, m, autotune, dtype):
    """On a GPU the dense form's batch-1 ``bmm`` become ``mm`` (joint-graph ``bmm_to_mm``), and under
    max-autotune the gathered form's one-column ``bmm`` become mul + sum: each is its own registered trace."""
    fn = spelled(name)
    with FakeTensorMode():
        args = fake_cuda(inputs(name, m, DTYPES[dtype]))
        variants = (("cuda", False), ("cuda", True))
        gm, n, facts = rewrite(lambda *a: fn(*a, *BETAS), args, variants, coordinate_descent=autotune)
    assert (n, facts[pattern.FACT], count(gm, OP), count(gm, aten.bmm.default, aten.mm.default)) == (1, 1, 1, 0)


@pytest.mark.parametrize("name,m,autotune,variant", [("dense", 5, False, ("cpu", False)),
                                                     ("gathered", 3, True, ("cuda", False))],
                         ids=["dense-gpu-vs-cpu-trace", "gathered-max-autotune-vs-default-trace"])
def test_each_spelling_needs_its_trace(name, m, autotune, variant):
    """The CUDA and max-autotune traces are needed: another trace does not match those graphs."""
    with FakeTensorMode():
        args = fake_cuda(moe_experts_inputs(m, 3, 4, 24, 40, torch.bfloat16)[:6])
        gm, n, _ = rewrite(lambda *a: spelled(name)(*a, *BETAS), args, (variant,), coordinate_descent=autotune)
    assert n == 0
    if autotune:
        assert count(gm, aten.bmm.default) == 0   # max-autotune decomposed the one-column products


def test_facts_and_expected():
    args = moe_experts_inputs(2, 3, 4, 24, 40, torch.float32)[:6]
    gm = inductor_graph(lambda z, w1: torch.relu(z @ w1[0].t()), (args[0], args[3]))
    assert pattern.facts(gm.graph, K3Options())[pattern.FACT] == 0
    assert pattern.expected({"moe_layers": 3, pattern.FACT: 2})
    assert not pattern.expected({"moe_layers": 3, pattern.FACT: 0})
    assert not pattern.expected({"moe_layers": 0, pattern.FACT: 1})


@pytest.mark.gpu
@pytest.mark.parametrize("m,autotune,packed", [(2, False, False), (2, True, False), (40, False, False),
                                               (2, False, True), (2, True, True), (40, False, True)],
                         ids=["decode", "decode-coordinate-descent", "prefill", "mxfp4-decode",
                              "mxfp4-decode-coordinate-descent", "mxfp4-prefill"])
def test_gpu_routed_latent_rewritten_by_optimize(m, autotune, packed):
    """Through optimize on a GPU (bf16): the CUDA spellings are met in Inductor's real graph (coordinate-descent
    tuning alone is what makes max-autotune decompose the gathered form), and the layer equals eager."""
    import k3compile

    cfg = KimiK3Config.tiny(moe_intermediate_size=64).text_config     # I a multiple of 32 for MXFP4
    moe = KimiLatentMoE(cfg)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.1)
    if packed:
        moe.experts.to_mxfp4()
    moe = moe.to("cuda", torch.bfloat16).eval()
    x = torch.randn(m, cfg.hidden_size, device="cuda", dtype=torch.bfloat16)
    routed = _Routed(moe)
    with torch.no_grad():
        ref = routed(x)
        torch._dynamo.reset()
        with inductor_config.patch(fx_graph_cache=False, coordinate_descent_tuning=autotune):
            k3compile.optimize(routed, passes=[pattern.NAME], strict=True, dynamic=False)
            out = routed(x)
    rep = k3compile.report(routed)
    assert [g.record.matches[pattern.NAME] for g in rep.graphs] == [1]
    assert rel_err(out, ref) < 2e-2
