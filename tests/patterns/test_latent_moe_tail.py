"""The latent-MoE tail rewrite at graph level: fires exactly where the math is the tail's, and equals eager.

A function traced to ATen with fake tensors (as Inductor's post-grad graph looks), our pass applied
(tests/conftest.py's PassHarness), the rewritten graph run on real tensors. Collectives are traced by name with no
process group (their fake kernels need none), so the tensor-parallel form is checked here too. Through Inductor,
the micro K3 and two gloo processes: test_latent_moe_tail_compiled.py.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from torch._guards import detect_fake_mode
from torch._inductor.decomposition import select_decomp_table
from torch._inductor.fx_passes.post_grad import view_to_reshape
from torch._inductor.virtualized import V
from torch.fx.experimental.proxy_tensor import make_fx

import k3compile.ops.latent_moe_tail  # noqa: F401  (registers k3::latent_moe_tail)
from k3compile.passes import STATIC_WEIGHT_FACT, K3Options
from k3compile.testing import rel_err

NAME = "latent_moe_tail"
c10d = torch.ops._c10d_functional
TAIL_OP = torch.ops.k3.latent_moe_tail.default
import k3compile.ops.all_reduce  # noqa: E402,F401  (registers k3::all_reduce_)
MERGED_AR = torch.ops.k3.all_reduce_.default   # the merged all-reduce: in place, on the current stream
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# bf16 vs the model's own bf16 sequence: both round; the interpreter truncates (see tests/ops)
TOL = {torch.float32: 1e-5, torch.bfloat16: 3e-2, torch.float16: 5e-3}


def count(graph, target) -> int:
    return sum(1 for n in graph.nodes if n.op == "call_function" and n.target is target)


def all_reduces(graph) -> int:
    """Functional all-reduces plus merged ones."""
    return count(graph, c10d.all_reduce.default) + count(graph, MERGED_AR)


def rms(x, w, eps):
    """KimiRMSNorm as the model writes it."""
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


LAST_FACTS = {}


@pytest.fixture
def rewrite(pass_harness):
    """``rewrite(fn, args, small_m_limit=16)``: ``fn`` traced to a post-grad-like ATen graph on fake tensors, our pass
    applied (tests/conftest.py's PassHarness); (module, matches). The facts our module read from the graph before
    rewriting land in ``LAST_FACTS``."""
    def run(fn, args, small_m_limit=16):
        harness = pass_harness(passes=(NAME,), small_m_limit=small_m_limit)
        gm = harness.rewrite(fn, *args)
        (graph,) = harness.graphs
        LAST_FACTS.clear()
        # the pattern's own facts (the pass manager adds its static-weight proof's under STATIC_WEIGHT_FACT)
        LAST_FACTS.update({k: v for k, v in graph["record"].facts.items() if k != STATIC_WEIGHT_FACT})
        return gm, harness.matches(NAME)
    return run


def tail_inputs(m, l, d, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(m, l, generator=g).to(dtype), torch.randn(m, d, generator=g).to(dtype),
            (1 + 0.1 * torch.randn(l, generator=g)).to(dtype), (torch.randn(d, l, generator=g) / l ** 0.5).to(dtype)]


# The spellings of one tail: the add on either side, the add folded into addmm, and the shared output
# arriving as a product that Inductor folds with the tail's add into addmm(tail_mm, a, b).
def tail_add_right(y, s, g, w, eps=1e-5):
    return torch.nn.functional.linear(rms(y, g, eps), w) + s


def tail_add_left(y, s, g, w, eps=1e-5):
    return s + torch.nn.functional.linear(rms(y, g, eps), w)


def tail_addmm(y, s, g, w, eps=1e-5):
    return torch.addmm(s, rms(y, g, eps), w.t())


def tail_shared_product(y, s, g, w, eps=1e-5):
    # s [M, D] stands for a @ b with a = s, b = I (the shared experts' down-projection)
    eye = torch.eye(s.shape[1], dtype=s.dtype)
    return torch.addmm(torch.nn.functional.linear(rms(y, g, eps), w), s, eye)


SPELLINGS = {f.__name__: f for f in (tail_add_right, tail_add_left, tail_addmm, tail_shared_product)}


@settings(max_examples=max(10, settings.default.max_examples // 2))
@given(m=st.integers(2, 16), l=st.integers(2, 70), d=st.integers(2, 50), dtype=st.sampled_from(sorted(DTYPES)),
       eps=st.sampled_from([1e-6, 1e-5, 1e-3]), spelling=st.sampled_from(sorted(SPELLINGS)),
       seed=st.integers(0, 2**16))
@example(m=4, l=64, d=128, dtype="bf16", eps=1e-5, spelling="tail_add_right", seed=0)   # micro K3 widths
@example(m=16, l=33, d=17, dtype="fp16", eps=1e-6, spelling="tail_shared_product", seed=1)
def test_rewritten_graph_equals_eager(m, l, d, dtype, eps, spelling, seed, rewrite):
    fn = SPELLINGS[spelling]
    args = tail_inputs(m, l, d, DTYPES[dtype], seed)
    gm, matches = rewrite(lambda y, s, g, w: fn(y, s, g, w, eps), args)
    assert matches == 1 and count(gm.graph, TAIL_OP) == 1, gm.code
    assert count(gm.graph, torch.ops.aten.rsqrt.default) == 0
    assert LAST_FACTS == {"graph_latent_moe_tail_candidates": 1}
    ref = fn(*args, eps)
    assert rel_err(gm(*args), ref) < TOL[DTYPES[dtype]], f"M{m}-L{l}-D{d}-{dtype}-{spelling}"


def no_shared(y, s, g, w):
    return torch.nn.functional.linear(rms(y, g, 1e-5), w)


def no_norm(y, s, g, w):
    return torch.nn.functional.linear(y, w) + s


def norm_weight_2d(y, s, g, w):
    return torch.nn.functional.linear(rms(y, g[None, :], 1e-5), w) + s


def norm_in_low_precision(y, s, g, w):
    """RMSNorm without the fp32 upcast: different rounding in bf16."""
    return torch.nn.functional.linear(g * (y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + 1e-5)), w) + s


def eps_outside_sqrt(y, s, g, w):
    yf = y.float()
    return torch.nn.functional.linear(g * (yf / (yf.pow(2).mean(-1, keepdim=True).sqrt() + 1e-5)).to(y.dtype),
                                      w) + s


def shared_broadcast(y, s, g, w):
    return torch.nn.functional.linear(rms(y, g, 1e-5), w) + s[:1]


NEAR_MISSES = {f.__name__: f for f in (no_shared, no_norm, norm_weight_2d, norm_in_low_precision, eps_outside_sqrt,
                                       shared_broadcast)}


# In fp32 the missing upcast of norm_in_low_precision is a no-op (the same math, which does fire), so that
# near miss is drawn in bf16 only.
NEAR_MISS_CASES = [(case, dtype) for case in sorted(NEAR_MISSES) for dtype in ("fp32", "bf16")
                   if not (case == "norm_in_low_precision" and dtype == "fp32")]


@pytest.mark.parametrize("case,dtype", NEAR_MISS_CASES, ids=[f"{c}-{d}" for c, d in NEAR_MISS_CASES])
def test_does_not_fire_where_math_differs(case, dtype, rewrite):
    fn = NEAR_MISSES[case]
    args = tail_inputs(4, 24, 16, DTYPES[dtype])
    gm, matches = rewrite(fn, args)
    assert matches == 0 and count(gm.graph, TAIL_OP) == 0
    assert rel_err(gm(*args), fn(*args)) < 1e-6


@pytest.mark.parametrize("m,limit,fires", [(16, 16, True), (17, 16, False), (8, 4, False), (4, 4, True)],
                         ids=["M16-lim16", "M17-lim16", "M8-lim4", "M4-lim4"])
def test_static_m_above_limit_left_to_inductor(m, limit, fires, rewrite):
    args = tail_inputs(m, 24, 16, torch.bfloat16)
    _, matches = rewrite(lambda y, s, g, w: tail_add_right(y, s, g, w), args, small_m_limit=limit)
    assert matches == int(fires)


def tail_weight_on_the_right(y, s, g, w, eps=1e-5):
    """``normed * weight`` (the traced patterns spell ``weight * normed``): only the graph walk knows it."""
    yf = y.float()
    h = (yf * torch.rsqrt(yf.pow(2).mean(-1, keepdim=True) + eps)).to(y.dtype) * g
    return torch.nn.functional.linear(h, w) + s


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("spelling", sorted(SPELLINGS) + ["tail_weight_on_the_right"])
def test_graph_walk_alone_fuses_every_spelling(spelling, dtype):
    """The structural walk in ``postprocess`` (the fallback for graphs the traces do not match, as on
    the H200 decode graph) fuses each spelling by itself and equals eager."""
    from k3compile.patterns import latent_moe_tail as mod

    fn = {**SPELLINGS, "tail_weight_on_the_right": tail_weight_on_the_right}[spelling]
    args = tail_inputs(5, 40, 24, DTYPES[dtype])
    gm = make_fx(lambda *a: fn(*a), select_decomp_table(), tracing_mode="fake")(*args)
    view_to_reshape(gm)
    fake_mode = detect_fake_mode([n.meta["val"] for n in gm.graph.nodes if "val" in n.meta])
    with V.set_fake_mode(fake_mode):
        assert mod.facts(gm.graph, K3Options())[mod.FACT] == 1
        assert mod.postprocess(gm.graph, K3Options()) == 1
    gm.graph.lint()
    gm.recompile()
    assert count(gm.graph, TAIL_OP) == 1 and count(gm.graph, torch.ops.aten.rsqrt.default) == 0, gm.code
    assert rel_err(gm(*args), fn(*args)) < TOL[DTYPES[dtype]]


def test_unknown_spelling_fires_through_the_pass(rewrite):
    args = tail_inputs(4, 24, 16, torch.bfloat16)
    gm, matches = rewrite(tail_weight_on_the_right, args)
    assert matches == 1 and count(gm.graph, TAIL_OP) == 1
    assert rel_err(gm(*args), tail_weight_on_the_right(*args)) < TOL[torch.bfloat16]


def collapsed_upcast(y32, s, g, w, eps=1e-5):
    """The bf16 tail as torch < 2.12 leaves it: its joint-graph ``pointless_convert`` folds the
    model's ``bf16(y_lat).float()`` into the fp32 ``y_lat``, so the norm reads an fp32 latent."""
    h = g * (y32 * torch.rsqrt(y32.pow(2).mean(-1, keepdim=True) + eps)).to(g.dtype)
    return torch.nn.functional.linear(h, w) + s


@pytest.mark.parametrize("m", [1, 4, 16], ids=lambda m: f"M{m}-L40-D24-bf16")
def test_collapsed_upcast_fuses_with_the_models_rounding(m, rewrite):
    """The H200 (torch 2.11) decode graph: the traced patterns miss it (their latent would be fp32);
    the walk fuses it and feeds the op ``bf16(y_lat)``, the model's own rounding."""
    y32, s, g, w = tail_inputs(m, 40, 24, torch.float32)
    s, g, w = s.bfloat16(), g.bfloat16(), w.bfloat16()
    gm, matches = rewrite(collapsed_upcast, [y32, s, g, w])
    assert matches == 1 and count(gm.graph, TAIL_OP) == 1, gm.code
    assert LAST_FACTS == {"graph_latent_moe_tail_candidates": 1}
    model = tail_add_right(y32.bfloat16(), s, g, w)   # what the model's code computes
    assert rel_err(gm(y32, s, g, w), model) < TOL[torch.bfloat16]


def fp32_shared(y, s, g, w):
    return torch.nn.functional.linear(rms(y, g, 1e-5), w) + s.float()


def test_rejected_candidate_says_why(rewrite):
    """An addend in fp32 (the sum promoted) is not the op's contract: no rewrite, not counted as a
    candidate, and the record (printed by the missing-pass warning) says why."""
    args = tail_inputs(4, 24, 16, torch.bfloat16)
    gm, matches = rewrite(fp32_shared, args)
    assert matches == 0 and count(gm.graph, TAIL_OP) == 0
    assert LAST_FACTS["graph_latent_moe_tail_candidates"] == 0
    assert any("dtypes differ" in why for why in LAST_FACTS["latent_moe_tail_rejected"]), LAST_FACTS
    assert rel_err(gm(*args), fp32_shared(*args)) < 1e-6


def test_prefill_above_limit_is_not_a_candidate(rewrite):
    """A static prefill M above the limit is left to Inductor and not counted, so ``expected()`` stays quiet."""
    from k3compile.patterns import latent_moe_tail as mod

    args = tail_inputs(128, 24, 16, torch.bfloat16)
    _, matches = rewrite(tail_add_right, args)
    assert matches == 0 and LAST_FACTS["graph_latent_moe_tail_candidates"] == 0
    assert not mod.expected({"moe_layers": 3, **LAST_FACTS})


# ---------------------------------------------------------------------------------------------
# tensor-parallel form, graph level (group "g0" of 2 ranks, never executed)

def tp_tail(y, s, g, w, *, groups=("g0", "g0"), ops=("sum", "sum"), shared_collective="all_reduce"):
    y = c10d.wait_tensor(c10d.all_reduce(y, ops[0], groups[0]))
    if shared_collective == "all_reduce":
        s = c10d.wait_tensor(c10d.all_reduce(s, ops[1], groups[1]))
    elif shared_collective == "sequence_parallel":   # rows reduce-scattered, then gathered back
        s = c10d.wait_tensor(c10d.reduce_scatter_tensor(s, "sum", 2, groups[1]))
        s = c10d.wait_tensor(c10d.all_gather_into_tensor(s, 2, groups[1]))
    return torch.nn.functional.linear(rms(y, g, 1e-5), w) + s


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_tp_two_all_reduces_become_one(dtype, rewrite):
    gm, matches = rewrite(tp_tail, tail_inputs(4, 24, 16, DTYPES[dtype]))
    assert matches == 1 and count(gm.graph, TAIL_OP) == 1
    assert count(gm.graph, c10d.all_reduce.default) == 0 and count(gm.graph, c10d.wait_tensor.default) == 0
    (ar,) = [n for n in gm.graph.nodes if n.target is MERGED_AR]
    (cat,) = [n for n in gm.graph.nodes if n.target is torch.ops.aten.cat.default]
    assert ar.args == (cat, "sum", "g0") and tuple(cat.meta["val"].shape) == (4, 24 + 16)
    # the tail reads the reduced buffer after the all-reduce: both slices of ``cat`` come after it
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    (tail,) = [n for n in gm.graph.nodes if n.target is TAIL_OP]
    assert all(a.args[0] is cat and order[a] > order[ar] for a in tail.args[:2])
    # Inductor copies a custom op's inputs to the strides recorded at trace time: they must be the slices'
    (tail,) = [n for n in gm.graph.nodes if n.target is TAIL_OP]
    eager_args = tail.meta.get("eager_input_vals", (tail.args, {}))[0]
    for arg, eager in zip(tail.args[:2], eager_args[:2]):
        assert eager.stride() == arg.meta["val"].stride() == (24 + 16, 1)


@pytest.mark.parametrize("kwargs", [dict(groups=("g0", "g1")), dict(ops=("sum", "avg")),
                                    dict(shared_collective="sequence_parallel"), dict(shared_collective="none")],
                         ids=["different-groups", "sum-and-avg", "sequence-parallel-shared", "shared-replicated"])
def test_tp_collectives_left_alone_where_they_differ(kwargs, pass_harness):
    """The tail itself still fuses (its inputs are complete tensors); the collectives are not merged."""
    harness = pass_harness(passes=(NAME,))
    harness.rewrite(lambda *a: tp_tail(*a, **kwargs), *tail_inputs(4, 24, 16, torch.bfloat16))
    assert harness.matches(NAME) == 1
    harness.check(added={TAIL_OP: 1}, kept=(c10d.all_reduce.default, c10d.reduce_scatter_tensor.default,
                                            c10d.all_gather_into_tensor.default))
    assert harness.after(MERGED_AR) == 0


@pytest.mark.parametrize("reader", ["before-shared-all-reduce", "after-both"])
def test_tp_other_readers_of_the_reduced_latent(reader, rewrite):
    """Another reader of the reduced latent: it reads the slice when it comes after both collectives;
    when it comes between them the merged result would not exist yet, so nothing merges."""
    def fn(y, s, g, w):
        y = c10d.wait_tensor(c10d.all_reduce(y, "sum", "g0"))
        early = y.sum() if reader == "before-shared-all-reduce" else None
        s = c10d.wait_tensor(c10d.all_reduce(s, "sum", "g0"))
        late = y.sum() if early is None else early
        return torch.nn.functional.linear(rms(y, g, 1e-5), w) + s, late
    gm, matches = rewrite(fn, tail_inputs(4, 24, 16, torch.float32))
    assert matches == 1
    assert all_reduces(gm.graph) == (2 if reader == "before-shared-all-reduce" else 1)
    gm.graph.lint()


def test_tp_sequence_sharded_rows_keep_their_collectives(rewrite):
    """Shared output reduce-scattered to [M/2, D], the latent sliced to match: nothing to concatenate."""
    def fn(y, s, g, w):
        y = c10d.wait_tensor(c10d.all_reduce(y, "sum", "g0"))
        s = c10d.wait_tensor(c10d.reduce_scatter_tensor(s, "sum", 2, "g0"))
        return torch.nn.functional.linear(rms(y[: s.shape[0]], g, 1e-5), w) + s
    gm, _ = rewrite(fn, tail_inputs(4, 24, 16, torch.bfloat16))
    assert count(gm.graph, c10d.all_reduce.default) == 1
    assert count(gm.graph, c10d.reduce_scatter_tensor.default) == 1


# ---------------------------------------------------------------------------------------------
# the model's own module, graph level: fires once, and not without shared experts or latent norm

def moe_graph(rewrite, **overrides):
    from torch.func import functional_call

    from k3compile.model import KimiK3Config
    from k3compile.model.moe import KimiLatentMoE

    torch.manual_seed(0)
    cfg = KimiK3Config.micro(**overrides).text_config
    moe = KimiLatentMoE(cfg)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=cfg.hidden_size ** -0.5)
    params = dict(moe.named_parameters())
    x = torch.randn(1, 3, cfg.hidden_size)
    gm, matches = rewrite(lambda p, x: functional_call(moe, p, (x,)), (params, x))
    return gm, matches, rel_err(gm(params, x), moe(x)) if matches else None


@pytest.mark.parametrize("overrides,fires", [({}, True), ({"num_shared_experts": 0}, False),
                                             ({"latent_moe_use_norm": False}, False)],
                         ids=["k3", "no-shared-experts", "no-latent-norm"])
@torch.no_grad()
def test_model_moe_module(overrides, fires, rewrite):
    from k3compile.patterns.latent_moe_tail import FACT, expected

    gm, matches, err = moe_graph(rewrite, **overrides)
    assert matches == int(fires) and count(gm.graph, TAIL_OP) == int(fires)
    assert LAST_FACTS[FACT] == int(fires)
    assert expected({"moe_layers": 3, **LAST_FACTS}) == fires
    if fires:
        assert err < 1e-5
