"""The static-weight proof (``k3compile/static_weights.py``) and its plumbing through the pass manager.

- hand-built graphs (``make_fx`` on fake tensors, or nodes placed by hand): proven where the weight is a
  parameter nothing writes and the activation comes from a kernel of the graph; not proven, with the
  reason, for every way that can fail; never an exception; under Inductor's PDL codegen the same verdicts, but
  for activations read from no memory (fills);
- Inductor's PDL codegen as our proof reads it: its source, and the Triton code it writes (on the CPU);
- a small module compiled by ``k3compile.optimize``, with and without Inductor's PDL codegen (one compile each):
  each GEMM's verdict in the report, strict mode unaffected;
- the micro K3 (CPU, fp32, every pass): the decode graph's skinny GEMMs and latent-MoE tail proven, in
  tests/compiler/test_tiny_k3.py (sharing its compiled model);
- on a GPU: the micro K3 in bf16, default mode and ``reduce-overhead``.
"""
from __future__ import annotations

import copy
import inspect
import operator
from unittest import mock

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch.fx.experimental.proxy_tensor import make_fx

import k3compile
import k3compile.ops.kda_decode  # noqa: F401  (registers k3::kda_decode)
import k3compile.ops.latent_moe_tail  # noqa: F401  (registers k3::latent_moe_tail)
import k3compile.ops.skinny_gemm  # noqa: F401  (registers k3::skinny_gemm)
from k3compile import static_weights
from k3compile.passes import STATIC_WEIGHT_FACT, _source_files
from k3compile.static_weights import mark_static_weights
from k3compile.testing import assert_within_bf16_noise, teacher_forced_logits

aten = torch.ops.aten
GEMM = torch.ops.k3.skinny_gemm.default
TAIL = torch.ops.k3.latent_moe_tail.default
M, K, N, L, D = 4, 16, 24, 16, 24


def _norm(x):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def _trace(fn, *shapes, functional=False) -> torch.fx.Graph:
    if functional:  # input mutations become copy_ into the placeholder, as in the post-grad graph
        fn = torch.func.functionalize(fn, remove="mutations_and_views")
    return make_fx(fn, tracing_mode="fake")(*[torch.empty(s) for s in shapes]).graph


def _static_flags(graph: torch.fx.Graph) -> list:
    return [static_weights.schema_arg(n, "static_weight", False) for n in graph.nodes if n.target in (GEMM, TAIL)]


def _verdict(graph: torch.fx.Graph) -> tuple[int, list[str]]:
    (result,) = mark_static_weights(graph).values()
    return result["proven"], list(result["not proven"])


# --- hand-built graphs ----------------------------------------------------------------------------

def test_proven_after_a_norm_and_the_flag_is_set():
    graph = _trace(lambda x, w: GEMM(_norm(x), w), (M, K), (N, K))
    assert _verdict(graph) == (1, [])
    assert _static_flags(graph) == [True]
    graph.lint()


@pytest.mark.parametrize("pdl", [False, True])
def test_no_trigger_first_under_inductor_pdl(pdl):
    """Under Inductor's PDL codegen a proven skinny GEMM may not let the next kernel in before its wait (step 1)."""
    graph = _trace(lambda x, w: GEMM(_norm(x), w), (M, K), (N, K))
    with torch._inductor.config.patch({"triton.enable_pdl": pdl}):
        assert _verdict(graph) == (1, [])
    (node,) = [n for n in graph.nodes if n.target is GEMM]
    assert static_weights.schema_arg(node, "trigger_first", True) is (not pdl)


def test_weight_through_views_is_proven():
    graph = _trace(lambda x, w: GEMM(x * 2, w.t().t()), (M, K), (N, K))
    assert _verdict(graph) == (1, [])


def test_tail_proven_after_the_moe_combine():
    def tail(y, p, shared, g, w):  # latent = routed outputs weighted by their probabilities, summed
        return TAIL((y * p.unsqueeze(-1)).sum(1), shared, g, w, 1e-5)

    graph = _trace(tail, (M, 2, L), (M, 2), (M, D), (L,), (D, L))
    assert _verdict(graph) == (1, [])
    assert _static_flags(graph) == [True]


@pytest.mark.parametrize("pdl", [False, True])
def test_lists_of_weights_get_a_flag_each(pdl):
    """``k3::products_beside`` (``STATIC_OPS``: lists of weights): each weight proven on its own, its flag in a list of
    the list's length; a main product's weight written first (the op reads the new value) is the one not proven, and
    the main products' trigger-first flags follow Inductor's PDL codegen (step 1)."""
    import k3compile.ops.products_beside  # noqa: F401  (registers k3::products_beside)

    def fn(x, w0, w1, ws, wc):
        w1.add_(1)
        return torch.ops.k3.products_beside(_norm(x), [w0, w1], [ws], [wc], [0])

    graph = _trace(fn, (M, K), (N, K), (N, K), (2, K), (N, 2), functional=True)
    with torch._inductor.config.patch({"triton.enable_pdl": pdl}):
        proven, why = _verdict(graph)
    assert proven == 3 and len(why) == 1 and "computed (or may be copied) in the graph" in why[0]
    (node,) = [n for n in graph.nodes if n.target is torch.ops.k3.products_beside.default]
    flags = {k: static_weights.schema_arg(node, k) for k in ("main_static_weight", "main_trigger_first",
                                                               "side_static_weight", "chain_static_weight")}
    assert flags == {"main_static_weight": [True, False], "main_trigger_first": [not pdl] * 2,
                     "side_static_weight": [True], "chain_static_weight": [True]}
    graph.lint()


def _gemm_on(make_a):
    return lambda x, w: GEMM(make_a(x), w)


def _mutate_then_gemm(x, w):
    w.add_(1)
    return GEMM(x * 2, w)


def _mutate_view_then_gemm(x, w):
    w[0].zero_()
    return GEMM(x * 2, w)


def _gemm_then_mutate(x, w):
    out = GEMM(x * 2, w)
    w.mul_(2)
    return out


NOT_PROVEN = [
    # id, function, shape of x, functionalize, reason fragment
    ("activation-input-M4-K16", _gemm_on(lambda x: x), (M, K), False, "is a graph input"),
    ("activation-view-of-input-2x2-K16", _gemm_on(lambda x: x.reshape(M, K)), (2, 2, K), False,
     "a view or copy of a graph input"),
    ("activation-view-copy-of-input", _gemm_on(lambda x: x.reshape(M, K)), (2, 2, K), True,
     "a view or copy of a graph input"),
    ("activation-clone-of-input", _gemm_on(lambda x: x.clone()), (M, K), False, "a view or copy of a graph input"),
    ("activation-to-copy-of-input", _gemm_on(lambda x: x.to(torch.float64).to(torch.float32)), (M, K), False,
     "a view or copy of a graph input"),
    ("weight-add_-in-graph", _mutate_then_gemm, (M, K), False, "written in the graph by aten.add_"),
    ("weight-view-zero_-in-graph", _mutate_view_then_gemm, (M, K), False, "written in the graph by aten.zero_"),
    ("weight-mutated-after-functional", _gemm_then_mutate, (M, K), True, "written in the graph by aten.copy_"),
    ("weight-computed", lambda x, w: GEMM(x * 2, w * 2), (M, K), False, "computed (or may be copied)"),
    ("weight-reshape-may-copy", lambda x, w: GEMM(x * 2, w.t().reshape(N, K)), (M, K), False,
     "computed (or may be copied)"),
    ("weight-view-copy", lambda x, w: GEMM(x * 2, w.t().t()), (M, K), True, "computed (or may be copied)"),
]


@pytest.mark.parametrize("fn, x_shape, functional, why", [c[1:] for c in NOT_PROVEN], ids=[c[0] for c in NOT_PROVEN])
def test_not_proven(fn, x_shape, functional, why):
    graph = _trace(fn, x_shape, (N, K), functional=functional)
    proven, reasons = _verdict(graph)
    assert proven == 0 and len(reasons) == 1 and why in reasons[0], reasons
    assert _static_flags(graph) == [False]


# steps applied to x [M, K] before the GEMM: (name, function, makes a kernel)
ACTIVATION_STEPS = {
    "reshape": (lambda x: x.reshape(2, M // 2, K).reshape(M, K), False),
    "transpose-twice": (lambda x: x.t().t(), False),
    "slice-all": (lambda x: x[:, :K], False),
    "clone": (lambda x: x.clone(), False),
    "to-double-and-back": (lambda x: x.double().float(), False),
    "contiguous": (lambda x: x.contiguous(), False),
    "mul": (lambda x: x * 2, True),
    "relu": (lambda x: torch.relu(x), True),
    "norm": (_norm, True),
    "softmax": (lambda x: torch.softmax(x, -1), True),
}


@given(steps=st.lists(st.sampled_from(sorted(ACTIVATION_STEPS)), max_size=4), pdl=st.booleans())
@example(steps=[], pdl=False)
@example(steps=["norm", "reshape"], pdl=True)
@example(steps=["clone", "transpose-twice"], pdl=True)
def test_activation_chains_proven_iff_a_kernel_made_it(steps, pdl):
    def fn(x, w):
        for name in steps:
            x = ACTIVATION_STEPS[name][0](x)
        return GEMM(x, w)

    graph = _trace(fn, (M, K), (N, K))
    with torch._inductor.config.patch({"triton.enable_pdl": pdl}):   # each step reads x: the same verdicts
        proven, reasons = _verdict(graph)
    assert proven == any(ACTIVATION_STEPS[name][1] for name in steps), (steps, reasons)


# activations whose kernel reads no memory: proven while Inductor's kernels launch without PDL (each then waits
# for everything before it), not under its PDL codegen (such a kernel may trigger without waiting)
LOAD_FREE = {
    "full_like": lambda x: torch.full_like(x, 2.0),
    "zeros_like-plus-1": lambda x: torch.zeros_like(x) + 1,
    "new_ones-times-2": lambda x: x.new_ones(M, K) * 2,
    "sum-of-empty-slice": lambda x: x[:, :0].sum(-1, keepdim=True).expand(M, K) + 1,
    "fill-then-copy-into-x": lambda x: x.clone().fill_(3.0) * 2,
}
READS_MEMORY = {
    "x-times-fill": lambda x: x * torch.ones(M, K),
    "fill-plus-norm": lambda x: torch.zeros_like(x) + _norm(x),
    "scatter-into-fill": lambda x: torch.zeros_like(x).index_copy(0, torch.tensor([0, 2]), x[:2]),
}


@pytest.mark.parametrize("name", sorted(LOAD_FREE) + sorted(READS_MEMORY))
def test_load_free_activation_not_proven_under_inductor_pdl(name):
    make_a = LOAD_FREE.get(name) or READS_MEMORY[name]
    graph = _trace(_gemm_on(make_a), (M, K), (N, K))
    assert _verdict(graph) == (1, [])
    with torch._inductor.config.patch({"triton.enable_pdl": True}):
        proven, reasons = _verdict(graph)
    if name in READS_MEMORY:
        assert (proven, reasons) == (1, []), reasons
    else:
        assert proven == 0 and "read from no graph input or k3 op" in reasons[0], reasons
        assert _static_flags(graph) == [False]


# steps applied to the weight [N, K] before the GEMM: (function, keeps it provably the parameter)
WEIGHT_STEPS = {
    "transpose-twice": (lambda w: w.t().t(), True),
    "unsqueeze-squeeze": (lambda w: w.unsqueeze(0).squeeze(0), True),
    "slice-all": (lambda w: w[:N], True),
    "flatten-transposed": (lambda w: w.t().reshape(K * N).reshape(K, N).t(), False),   # a copy
    "scale": (lambda w: w * 1, False),
}


@given(steps=st.lists(st.sampled_from(sorted(WEIGHT_STEPS)), max_size=3),
       write=st.sampled_from(["none", "add_-before", "zero_-row-after", "copy_-after"]))
@example(steps=["transpose-twice"], write="none")
@example(steps=["slice-all"], write="zero_-row-after")
def test_weight_chains_proven_iff_untouched_parameter(steps, write):
    def fn(x, w):
        if write == "add_-before":
            w.add_(1)
        v = w
        for name in steps:
            v = WEIGHT_STEPS[name][0](v)
        out = GEMM(x * 2, v)
        if write == "zero_-row-after":
            w[1].zero_()
        elif write == "copy_-after":
            w.copy_(x.new_zeros(N, K))
        return out

    proven, reasons = _verdict(_trace(fn, (M, K), (N, K)))
    assert proven == (write == "none" and all(WEIGHT_STEPS[name][1] for name in steps)), (steps, write, reasons)


def _graph_by_hand(build):
    """A graph ``build(graph, x, w)`` fills; the k3 GEMM on the node it returns as activation."""
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    w = graph.placeholder("w")
    act, w_use = build(graph, x, w)
    graph.output(graph.call_function(GEMM, (act, w_use)))
    return graph


def _collective(graph, src):
    c10d = torch.ops._c10d_functional
    reduced = graph.call_function(c10d.all_reduce.default, (src, "sum", "0"))
    return graph.call_function(c10d.wait_tensor.default, (reduced,))


def test_collective_of_a_kernel_output_is_proven():
    graph = _graph_by_hand(lambda g, x, w: (_collective(g, g.call_function(aten.mul.Tensor, (x, 2))), w))
    assert _verdict(graph) == (1, [])


def test_collective_of_a_graph_input_is_not_proven():
    graph = _graph_by_hand(lambda g, x, w: (_collective(g, x), w))
    assert _verdict(graph)[1] == ["activation is a graph input: the kernel before it may be outside this graph"]


def test_slice_of_a_collective_is_proven():  # the TP tail's latent: slice(wait(all_reduce(cat)))
    def build(g, x, w):
        cat = g.call_function(aten.cat.default, ([g.call_function(aten.mul.Tensor, (x, 2)), x], 1))
        return g.call_function(aten.slice.Tensor, (_collective(g, cat), 1, 0, K)), w

    assert _verdict(_graph_by_hand(build)) == (1, [])


def test_weight_through_a_post_grad_reshape_is_not_proven():  # aten.reshape: a view, or a copy
    graph = _graph_by_hand(lambda g, x, w: (g.call_function(aten.mul.Tensor, (x, 2)),
                                            g.call_function(aten.reshape.default, (w, [N, K]))))
    assert "may be copied" in _verdict(graph)[1][0]


def test_weight_taken_by_a_higher_order_op_is_not_proven():
    def build(g, x, w):
        g.call_function(torch.ops.higher_order.auto_functionalized, (aten.add_.Tensor,), {"self": w, "other": x})
        return g.call_function(aten.mul.Tensor, (x, 2)), w

    assert "higher-order or unknown op" in _verdict(_graph_by_hand(build))[1][0]


def _auto_functionalized(g, op, x):
    out = g.call_function(torch.ops.higher_order.auto_functionalized, (op,), {"self": x, "other": x})
    return g.call_function(operator.getitem, (out, 1))


def test_activation_from_a_mutating_k3_op_is_proven():  # KDA decode's output feeds o_proj
    k3_op = torch.ops.k3.kda_decode.default
    graph = _graph_by_hand(
        lambda g, x, w: (_auto_functionalized(g, k3_op, g.call_function(aten.mul.Tensor, (x, 2))), w))
    assert _verdict(graph) == (1, [])
    with torch._inductor.config.patch({"triton.enable_pdl": True}):   # a k3 op's kernels wait before they trigger
        assert _verdict(graph) == (1, [])
    graph = _graph_by_hand(lambda g, x, w: (_auto_functionalized(g, aten.add_.Tensor, x), w))
    assert "higher-order op auto_functionalized" in _verdict(graph)[1][0]


def test_a_flag_that_came_with_the_graph_is_cleared():
    graph = _trace(lambda x, w: GEMM(x, w, None, None, "auto", 16, True), (M, K), (N, K))
    assert _static_flags(graph) == [True]
    assert _verdict(graph)[0] == 0
    assert _static_flags(graph) == [False]


def test_activation_from_an_unknown_op_is_not_proven():
    graph = _graph_by_hand(lambda g, x, w: (g.call_function(torch.sin, (x,)), w))
    assert "not an ATen/k3 op" in _verdict(graph)[1][0]


def test_activation_from_constants_only_is_not_proven():
    def build(g, x, w):
        return g.call_function(aten.mul.Tensor, (g.call_function(aten.ones.default, ([M, K],)), 2)), w

    assert "constants only" in _verdict(_graph_by_hand(build))[1][0]


def test_a_cpu_scalar_is_read_from_no_memory_under_inductor_pdl():
    """A 0-d CPU tensor feeding a GPU op reaches its kernel as an argument: ``fill * s`` loads nothing."""
    def fn(x, s, w):
        return GEMM(torch.ones(M, K, device=x.device) * s, w), GEMM(x * s, w)

    x, w = torch.empty(M, K, device="meta"), torch.empty(N, K, device="meta")
    graph = make_fx(fn, tracing_mode="fake")(x, torch.tensor(2.0), w).graph
    with torch._inductor.config.patch({"triton.enable_pdl": True}):
        proven, reasons = _verdict(graph)
    assert proven == 1 and "read from no graph input or k3 op" in reasons[0], reasons


def test_collective_of_a_kernel_output_is_proven_under_inductor_pdl():   # the TP all-reduce before a GEMM
    c10d = torch.ops._c10d_functional

    def fn(x, w):
        return GEMM(c10d.wait_tensor(c10d.all_reduce(x * 2, "sum", "0")), w)

    graph = _trace(fn, (M, K), (N, K))
    with torch._inductor.config.patch({"triton.enable_pdl": True}):
        assert _verdict(graph) == (1, [])


def test_turned_off_by_the_environment_and_in_the_cache_key(monkeypatch):
    from k3compile.passes import K3Options, K3PostGradPass

    on = K3PostGradPass(K3Options()).uuid()
    monkeypatch.setenv("K3_STATIC_WEIGHT", "0")
    graph = _trace(lambda x, w: GEMM(_norm(x), w), (M, K), (N, K))
    assert _verdict(graph) == (0, ["turned off (K3_STATIC_WEIGHT=0)"])
    assert K3PostGradPass(K3Options()).uuid() != on


def test_odd_graphs_never_raise(monkeypatch):
    odd = torch.fx.Graph()
    x = odd.placeholder("x")
    odd.output(odd.call_function(GEMM, (x, 3.0)))          # a weight that is no tensor
    assert _verdict(odd) == (0, ["weight is not a graph value"])

    def boom(self, node, act_name, w_name, index=None):
        raise RuntimeError("boom")

    monkeypatch.setattr(static_weights._Prover, "prove", boom)
    graph = _trace(lambda x, w: GEMM(_norm(x), w), (M, K), (N, K))
    assert _verdict(graph) == (0, ["analysis failed (RuntimeError: boom)"])
    assert _static_flags(graph) == [False]


def test_graph_without_k3_ops_records_nothing():
    assert mark_static_weights(_trace(lambda x: x * 2, (M, K))) == {}


def test_proof_runs_after_the_chained_user_pass():
    from k3compile.passes import COMPILE_RECORD, K3Options, K3PostGradPass

    def user_pass(graph):  # writes the weight after our patterns ran
        w = [n for n in graph.nodes if n.op == "placeholder"][1]
        with graph.inserting_before(next(n for n in graph.nodes if n.target is GEMM)):
            graph.call_function(aten.add_.Tensor, (w, 1))

    graph = _trace(lambda x, w: GEMM(_norm(x), w), (M, K), (N, K))
    COMPILE_RECORD.take()
    K3PostGradPass(K3Options(passes=("skinny_gemm",)), chained=user_pass)(graph)
    (record,) = COMPILE_RECORD.take()
    why = "weight (or a view of it) is written in the graph by aten.add_.Tensor"
    assert record.facts[STATIC_WEIGHT_FACT] == {"skinny_gemm": {"proven": 0, "not proven": {why: 1}}}
    assert _static_flags(graph) == [False]


def test_pass_uuid_covers_the_proof():
    from k3compile import inductor_pdl

    from k3compile import graph_values

    assert {inspect.getfile(m) for m in (static_weights, graph_values, inductor_pdl)} <= set(_source_files())


def test_inductor_pdl_codegen_orders_wait_before_launch():
    """What step 1 of the proof takes of Inductor's PDL codegen, in its source: each Inductor kernel that loads
    emits ``gdc_wait`` before ``gdc_launch_dependents``, and the filter keeps the first wait and the last launch."""
    from torch._inductor.codegen.triton import TritonKernel
    from torch._inductor.codegen.common import IndentedBuffer

    if not hasattr(TritonKernel, "_handle_pdl_after_load"):
        pytest.skip("this torch's Inductor has no PDL codegen")
    src = inspect.getsource(TritonKernel._handle_pdl_after_load)
    assert 0 <= src.index("GDC_WAIT") < src.index("GDC_LAUNCH")
    buf = IndentedBuffer()
    for line in (TritonKernel.GDC_WAIT, TritonKernel.GDC_LAUNCH, "x = tl.load(p)",
                 TritonKernel.GDC_WAIT, TritonKernel.GDC_LAUNCH, "tl.store(q, x)"):
        buf.writeline(line)
    TritonKernel._filter_pdl(TritonKernel, buf)
    lines = [str(line).strip() for line in buf._lines]
    assert lines.count(TritonKernel.GDC_WAIT) == 1 and lines.count(TritonKernel.GDC_LAUNCH) == 1
    assert lines.index(TritonKernel.GDC_WAIT) < lines.index(TritonKernel.GDC_LAUNCH)


def _inductor_pdl_code(fn, *args, post_grad=None) -> str:
    """The code Inductor writes for ``fn`` under its PDL codegen (``post_grad``: a pass run on its graph). On the
    CPU: Inductor's Triton backend for CPU tensors, its CUDA sm_90 check bypassed; the code is taken as Inductor
    saves it, and the compile stopped there (nothing runs)."""
    from torch._inductor.codegen.triton import TritonKernel
    from torch._inductor.graph import GraphLowering

    class Written(Exception):
        pass

    codes = []

    def save(code):
        codes.append(code)
        raise Written

    torch._dynamo.reset()
    with mock.patch.object(GraphLowering, "save_output_code", staticmethod(save)), \
            mock.patch.object(TritonKernel, "_enable_pdl_codegen", staticmethod(lambda: True)), \
            mock.patch("torch.utils._triton.triton_hash_with_backend", lambda: "0" * 64), \
            torch._inductor.config.patch({"cpu_backend": "triton", "triton.enable_pdl": True, "fx_graph_cache": False,
                                          "post_grad_custom_post_pass": post_grad}):
        try:
            torch.compile(fn)(*args)
        except Exception as e:   # Written, as Dynamo wraps it
            if not codes:
                pytest.skip(f"Inductor's Triton code for CPU tensors is not written here: {type(e).__name__}: {e}")
    torch._dynamo.reset()
    return codes[0]


def _inductor_pdl_kernels(fn, *args) -> dict[str, list[str]]:
    """The Triton kernels of ``_inductor_pdl_code``, each as its body's lines."""
    kernels, lines = {}, None
    for line in _inductor_pdl_code(fn, *args).splitlines():
        if line.startswith("def triton_"):
            kernels[line[4:line.index("(")]] = lines = []
        elif lines is not None and (line.startswith(" ") or not line):
            lines.append(line.strip())
        else:
            lines = None
    return kernels


def test_inductor_pdl_code_waits_before_launch_in_every_kernel_that_loads():
    """Step 1's (W) in the code Inductor writes: a kernel that loads calls ``gdc_wait`` once, before
    ``gdc_launch_dependents`` (after its first loads where the kernel before it wrote none of what it loads:
    here the looped reduction after a fill); one that loads nothing never calls ``gdc_launch_dependents`` (it
    triggers by exiting, and may never wait: (F))."""
    from torch._inductor.codegen.triton import TritonKernel

    if not hasattr(TritonKernel, "_enable_pdl_codegen"):
        pytest.skip("this torch's Inductor has no PDL codegen")

    def fn(x, y):   # a persistent reduction, a fill, a looped reduction, a fill
        return x.sin(), torch.full((8, 8), 3.0), y.cos().sum(-1), torch.arange(16) * 2, x.sum()

    kernels = _inductor_pdl_kernels(fn, torch.randn(4, 64), torch.randn(4, 4096))
    wait, launch = "tl.extra.cuda.gdc_wait()", "tl.extra.cuda.gdc_launch_dependents()"
    loads = {k: lines for k, lines in kernels.items() if any("tl.load(" in line for line in lines)}
    assert loads and len(loads) < len(kernels), kernels
    for name, lines in kernels.items():
        assert lines.count(wait) <= 1 and lines.count(launch) <= 1, (name, lines)
        if name in loads:
            assert wait in lines and lines.index(wait) < lines.index(launch), (name, lines)
        else:
            assert launch not in lines, (name, lines)


# --- a small compiled module --------------------------------------------------------------------

class Cases(torch.nn.Module):
    """One graph, one skinny GEMM per case: the report lists each verdict."""

    def __init__(self):
        super().__init__()
        self.after_norm = torch.nn.Linear(K, N, bias=False)
        self.on_input = torch.nn.Linear(K, N, bias=False)
        self.on_clone = torch.nn.Linear(K, N, bias=False)
        self.mutated_first = torch.nn.Linear(K, N, bias=False)
        self.mutated_after = torch.nn.Linear(K, N, bias=False)
        self.on_fill = torch.nn.Linear(K, N, bias=False)

    def forward(self, x, x3):
        self.mutated_first.weight.add_(1)                 # in-graph writes to parameters: before the GEMM
        y = self.mutated_first(_norm(x)) + self.mutated_after(_norm(x) * 2)
        self.mutated_after.weight.mul_(0.5)               # and after it
        y = y + self.after_norm(_norm(x)) + self.on_input(x) + self.on_clone(x.clone())
        y = y + self.on_fill(x[:, :0].sum(-1, keepdim=True).expand(M, K) + 1)   # a kernel that reads nothing
        return y, self.on_input(x3)                       # x3 [2, 2, K]: a view of the input reaches the GEMM


@pytest.fixture(scope="module", params=[False, True], ids=["inductor-pdl-off", "inductor-pdl-on"])
def compiled_cases(request):
    torch.manual_seed(0)
    eager = Cases().eval()
    model = copy.deepcopy(eager)
    x, x3 = torch.randn(M, K), torch.randn(2, 2, K)
    torch._dynamo.reset()
    with torch.no_grad(), torch._inductor.config.patch(fx_graph_cache=False), \
            torch._functorch.config.patch(enable_autograd_cache=False):
        # on the CPU Inductor writes no PDL code; the proof reads the setting all the same
        k3compile.optimize(model, passes=["skinny_gemm"], strict=True, dynamic=False, inductor_pdl=request.param)
        out = model(x, x3)
        ref = eager(x, x3)
    return out, ref, k3compile.report(model), request.param


def test_compiled_verdicts_and_reasons(compiled_cases):
    _, _, rep, pdl = compiled_cases
    r = rep.static_weight["skinny_gemm"]
    why_not = "\n".join(r["not proven"])
    assert r["proven"] == (1 if pdl else 2), rep.format()          # after_norm, and on_fill without PDL
    assert sum(r["not proven"].values()) == (6 if pdl else 5), why_not
    assert "computed (or may be copied) in the graph" in why_not   # mutated_first reads the new value
    assert "written in the graph by aten.copy_" in why_not         # mutated_after's weight is written back
    assert "activation is a graph input" in why_not                # x (and its clone: Inductor dropped it)
    assert "a view or copy of a graph input" in why_not            # x3 reshaped
    assert ("read from no graph input or k3 op" in why_not) == pdl  # on_fill: its kernel loads nothing
    text = rep.format(verbose=True)   # GPU launch details: listed for CPU graphs only when verbose
    assert "static weight" in text and f"proven {1 if pdl else 2} of 7" in text and "static weight" not in str(rep)
    assert f"Inductor's own kernels with PDL (inductor_pdl): {'on' if pdl else 'as Inductor'}" in text


def test_compiled_outputs_equal_eager(compiled_cases):
    out, ref, _, _ = compiled_cases
    for o, r in zip(out, ref):
        torch.testing.assert_close(o, r)


def test_static_weight_is_no_expected_pass_in_strict_mode(compiled_cases):
    _, _, rep, _ = compiled_cases   # strict=True compiled without raising; the fact is no pass name
    assert STATIC_WEIGHT_FACT not in rep.passes and STATIC_WEIGHT_FACT not in rep.matches


# --- GPU ------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize("mode", [None, "reduce-overhead"], ids=["default", "reduce-overhead"])
@torch.no_grad()
def test_gpu_micro_k3_bf16_decode_proves_and_matches_eager(mode):
    """Every product proven in the micro K3's bf16 decode graph, and its logits, teacher-forced on eager's tokens,
    within bf16 noise (``k3compile.testing.assert_within_bf16_noise``: greedy tokens compared bit for bit fail at
    bf16 near-ties, and one of the two prompts is ill-conditioned in 16 bits at every step)."""
    from k3compile.model import KimiK3Config, KimiK3ForConditionalGeneration

    torch.manual_seed(0)
    eager = KimiK3ForConditionalGeneration(KimiK3Config.micro()).eval().cuda().set_dtype(torch.bfloat16)
    model = copy.deepcopy(eager)
    ids = torch.randint(0, eager.config.text_config.vocab_size, (2, 12), device="cuda")
    tokens = eager.generate(ids, 6)
    torch._dynamo.reset()
    k3compile.optimize(model, dynamic=False, mode=mode)
    teacher_forced_logits(model, ids, tokens)   # the prefill and decode graphs, compiled
    rep = k3compile.report(model)
    print(rep.format())
    assert_within_bf16_noise(model, eager, ids, tokens)
    decode = rep.graphs[-1].record
    static = decode.facts[STATIC_WEIGHT_FACT]
    assert decode.matches["skinny_gemm"] > 0 and decode.matches["latent_moe_tail"] >= 1
    # every product proven: the routers' on their 16-bit weights (patterns/upcast_matmul.py, no cast kernel left), and
    # each MoE layer's router product and latent down-projection inside its k3::route_beside, its shared experts'
    # three products inside its k3::experts_beside
    folded, beside = decode.matches["route_beside"], decode.matches["experts_beside"]
    assert folded == beside == decode.matches["latent_moe_tail"]
    assert static["latent_moe_tail"] == {"proven": decode.matches["latent_moe_tail"], "not proven": {}}, static
    assert static["route_beside"] == {"proven": 2 * folded, "not proven": {}}, static
    assert static["experts_beside"] == {"proven": 3 * beside, "not proven": {}}, static
    # each KDA layer's seven input products inside its k3::products_beside
    beside_kda = decode.matches["products_beside"]
    assert static["products_beside"] == {"proven": 7 * beside_kda, "not proven": {}}, static
    products = (decode.matches["skinny_gemm"] + decode.matches["upcast_matmul"] - 2 * folded - 3 * beside
                - 7 * beside_kda)
    assert static["skinny_gemm"] == {"proven": products, "not proven": {}}, static


def test_trigger_only_graphs_launch_their_triggering_kernels_without_pdl():
    """``inductor_pdl="trigger"``: once ``plain_launches`` is installed, a graph our pass did not note as compiling
    with Inductor's PDL launches keeps the codegen's wait and trigger but has ``launch_pdl`` off (each Inductor
    kernel then starts after its predecessor completes: no race); a graph noted so keeps it on."""
    from torch._inductor.codegen.triton import TritonKernel
    from k3compile import inductor_pdl

    if not hasattr(TritonKernel, "_enable_pdl_codegen"):
        pytest.skip("this torch's Inductor has no PDL codegen")
    assert inductor_pdl.plain_launches() is None

    def fn(x):
        return (x.sin() * 2).sum(-1)

    class Note(CustomGraphPass):
        def __init__(self, trigger_only):
            self.trigger_only = trigger_only

        def __call__(self, graph):
            inductor_pdl.note_graph(graph, self.trigger_only)

        def uuid(self):
            return None

    trigger = _inductor_pdl_code(fn, torch.randn(4, 64), post_grad=Note(True))
    full = _inductor_pdl_code(fn, torch.randn(4, 64), post_grad=Note(False))
    for code, launch in ((trigger, False), (full, True)):
        assert "tl.extra.cuda.gdc_launch_dependents()" in code
        assert f"'launch_pdl': {launch}" in code and f"'launch_pdl': {not launch}" not in code



# --- compile regions: a body's GEMM proven at the body's calls (static_weights.py, compile regions) --------------

def _region_verdicts(calls) -> dict:
    """The static-weight fact (of the region body's skinny GEMM, counted once a call) of a model that calls the body
    as ``calls(x, w, body)``."""
    from k3compile import regions

    if regions.available() is not None:
        pytest.skip(regions.available())

    @torch.compiler.nested_compile_region
    def body(a, w):
        return torch.nn.functional.linear(a, w)

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(N, K))

        def forward(self, x):
            return calls(x, self.w, body)

    torch._dynamo.reset()
    model = k3compile.optimize(Model(), passes=["skinny_gemm"], backend="reference", dynamic=False)
    with torch._inductor.config.patch(fx_graph_cache=False), \
            torch._functorch.config.patch(enable_autograd_cache=False), torch.no_grad():   # our pass must run
        x = torch.randn(M, K)
        torch.testing.assert_close(model(x), calls(x, model.w, lambda a, w: torch.nn.functional.linear(a, w)))
    (graph,) = k3compile.report(model).graphs
    assert graph.record.regions.get("bodies") == 1, graph.record.regions   # counts weigh the body by its calls
    return graph.record.facts[STATIC_WEIGHT_FACT]["skinny_gemm"]


def test_region_body_gemms_proven_where_every_call_passes():
    # both calls' activations come from kernels of the caller, the weight is a parameter nothing writes
    v = _region_verdicts(lambda x, w, body: body(torch.relu(x), w) + body(x.sin(), w))
    assert v == {"proven": 2, "not proven": {}}, v


def test_region_body_gemms_not_proven_where_a_call_fails():
    # one call passes the caller's own input: the kernel before the body may be outside the graph
    v = _region_verdicts(lambda x, w, body: body(torch.relu(x), w) + body(x, w))
    assert v["proven"] == 0 and any("at a call of its region: activation is" in r for r in v["not proven"]), v
    # the weight a call passes is computed in the caller
    v = _region_verdicts(lambda x, w, body: body(torch.relu(x), w * 2) + body(x.sin(), w * 2))
    assert v["proven"] == 0 and any("at a call of its region: weight is computed" in r for r in v["not proven"]), v
