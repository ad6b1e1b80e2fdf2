"""The KDA prefill rewrite: ``kda_chunked``'s unrolled chunk recurrence becomes one ``k3::kda_prefill`` per call,
for one or several chunks, padded or not, fp32 or 16-bit values; the compiled result equals eager; a graph that
differs (another chunk size, a changed formula) is left alone. The tiny K3 checks (fires once per KDA layer of
the prefill graph, tokens equal eager) live in ``test_kda_decode.py`` beside the decode pass, sharing its compile.

Each test compiles one small function (seconds on CPU) through tests/conftest.py's PassHarness, caches off.
"""
from __future__ import annotations

import copy
import inspect
import math

import pytest
import torch
import torch.nn.functional as F
from torch._inductor.custom_graph_pass import CustomGraphPass

from k3compile.model import kda as model_kda
from k3compile.model.kda import kda_chunked
from k3compile.ops.kda_prefill import KDA_PREFILL
from k3compile.testing import rel_err as rel

TOL_FLA = 1e-2   # fla (tf32 dots, its own chunking) and a bf16 output
PREFILL = torch.ops.k3.kda_prefill.default
SOLVE = torch.ops.aten.linalg_solve_triangular.default   # one per chunk of the unrolled recurrence


def make_inputs(B, T, H, K, v_dtype, seed=0, device="cpu"):
    """A prefill layer's recurrence inputs (q, k unit-norm, q scaled; bounded log-decay; post-sigmoid beta),
    plus an output gate in v's dtype, and the fp32 state."""
    g = torch.Generator().manual_seed(seed)

    def r(*shape):
        return torch.randn(*shape, generator=g)

    q = F.normalize(r(B, T, H, K), dim=-1) * K ** -0.5
    k = F.normalize(r(B, T, H, K), dim=-1)
    x = [q, k, r(B, T, H, K).to(v_dtype), -5.0 * torch.sigmoid(r(B, T, H, K)), torch.sigmoid(r(B, T, H)),
         r(B, H, K, K), r(B, T, H, K).to(v_dtype)]
    return [t.to(device) for t in x]


def layer(recurrence):
    """The recurrence between its inputs and the gated output, as the model's prefill wraps it."""
    def fn(q, k, v, g, beta, state, gate):
        o = recurrence(q, k, v, g, beta, state)
        return (o * torch.sigmoid(gate.float())).to(gate.dtype)
    return fn


def two_layers(first, second):
    """Two layers' recurrences in one graph (on their own inputs and states), outputs flattened and joined."""
    def fn(inputs_a, inputs_b):
        return torch.cat([first(*inputs_a).flatten(), second(*inputs_b).flatten()])
    return fn


def compile_and_check(pass_harness, fn, inputs_a, inputs_b, backend="triton", tol=0.0):
    """Compile ``fn`` with the kda_prefill pass only; states equal eager within ``tol`` (bitwise on the reference
    path: the op runs ``kda_chunked`` itself), outputs within ``max(tol, 1e-6)`` (Inductor fuses the gate
    multiply after it in its own order). Returns (matches, solves seen, the harness)."""
    ref_a, ref_b = copy.deepcopy(inputs_a), copy.deepcopy(inputs_b)
    ref = fn(ref_a, ref_b)
    harness = pass_harness(backend=backend, passes=("kda_prefill",))
    out = harness.compile(fn, fullgraph=True, dynamic=False)(inputs_a, inputs_b)
    assert rel(out, ref) <= max(tol, 1e-6)
    for got, want in zip(inputs_a + inputs_b, ref_a + ref_b):     # states updated in place, as eager
        assert rel(got, want) <= tol
    (solves,) = harness.facts("graph_kda_prefill_solves")
    return harness.matches("kda_prefill"), solves, harness


CASES = [  # (T, v dtype): chunks n = ceil(T / 16)
    (5, torch.bfloat16),    # one chunk, padded
    (32, torch.float32),    # two whole chunks, no padding
    (40, torch.bfloat16),   # three chunks, the last padded
]


@pytest.mark.parametrize("T,v_dtype", CASES, ids=[f"T{T}-v{str(d)[6:]}" for T, d in CASES])
def test_fires_once_per_recurrence_and_equals_eager(T, v_dtype, pass_harness):
    """Two layers (different head counts) in one graph: two matches, two op calls, no triangular solve left."""
    KDA_PREFILL.clear()
    fn = two_layers(layer(kda_chunked), layer(kda_chunked))
    n, solves, harness = compile_and_check(pass_harness, fn, make_inputs(2, T, 2, 8, v_dtype, seed=0),
                                           make_inputs(1, T, 3, 16, v_dtype, seed=1))
    assert (n, solves) == (2, 4) and harness.before(SOLVE) == 4
    harness.check(replaced=[SOLVE], added={PREFILL: 2})
    # on CPU the forced Triton backend (fla) falls back to the reference, recorded with its reason
    assert {c.impl for c in KDA_PREFILL.choices()} == {"reference"}
    assert all("fla" in c.reason for c in KDA_PREFILL.choices())


def test_another_chunk_size_does_not_fire(pass_harness):
    """kda_chunked at chunk 8 is not the model's prefill (chunk 16): no candidate, no rewrite, still correct."""
    fn = layer(lambda q, k, v, g, beta, state: kda_chunked(q, k, v, g, beta, state, chunk_size=8))
    n, solves, harness = compile_and_check(pass_harness, two_layers(fn, fn),
                                           make_inputs(1, 20, 2, 8, torch.bfloat16, seed=0),
                                           make_inputs(1, 20, 2, 8, torch.bfloat16, seed=1), tol=1e-5)
    assert (n, solves) == (0, 0)
    harness.check(kept=[SOLVE], added={PREFILL: 0})


def _changed_kda_chunked():
    """kda_chunked with one formula changed (the end-of-chunk key decay), compiled from its own source."""
    src = inspect.getsource(kda_chunked)
    line = "k_to_end = torch.exp(gam[..., -1:, :] - gam) * k"
    assert line in src
    namespace = dict(vars(model_kda))
    exec(compile(src.replace(line, line + " * 0.5"), "<changed kda_chunked>", "exec"), namespace)
    return namespace["kda_chunked"]


def test_changed_formula_does_not_fire_beside_one_that_does(pass_harness):
    """Same shapes and chunk size, one formula different: the exact pattern rejects it (the true one beside it
    still fuses), and the compiled graph stays equal to its own eager run."""
    changed = _changed_kda_chunked()
    fn = two_layers(layer(changed), layer(kda_chunked))
    n, solves, harness = compile_and_check(pass_harness, fn, make_inputs(1, 20, 2, 8, torch.float32, seed=0),
                                           make_inputs(1, 20, 2, 8, torch.float32, seed=1), tol=1e-5)
    assert (n, solves) == (1, 4)
    assert harness.before(SOLVE) == 4 and harness.after(SOLVE) == 2    # the changed layer's solves stay
    harness.check(added={PREFILL: 1})


def test_chunk_count_matches_kda_chunked_loop(pass_harness):
    """The unrolled graph depends on T only through n = ceil(T / C): a 17-token prompt is two chunks."""
    assert math.ceil(17 / inspect.signature(kda_chunked).parameters["chunk_size"].default) == 2
    n, _, _ = compile_and_check(pass_harness, two_layers(layer(kda_chunked), layer(kda_chunked)),
                                make_inputs(1, 17, 1, 8, torch.float32, seed=2),
                                make_inputs(1, 17, 1, 8, torch.float32, seed=3))
    assert n == 2


class TwoLayersOfOneHiddenState(torch.nn.Module):
    """Two layers' recurrences on q, k, v, g and beta cut from one [B, T, H, 8K+2] tensor: as a model's projections
    of one hidden state, they share B and T (separate inputs would each get their own symbols under dynamic
    shapes), so Inductor computes the size arithmetic (chunks, padding) once for both layers."""
    K = 8

    def forward(self, x, state_a, state_b):
        K = self.K
        outs = []
        for half, state in zip(x.chunk(2, dim=-1), (state_a, state_b)):
            q, k, v, g = (half[..., i * K:(i + 1) * K] for i in range(4))
            outs.append(kda_chunked(F.normalize(q, dim=-1) * K ** -0.5, F.normalize(k, dim=-1), v,
                                    -5.0 * torch.sigmoid(g), torch.sigmoid(half[..., -1]), state))
        return torch.cat(outs, dim=-1)


class SymbolicInputs(CustomGraphPass):
    """Chained after ours: records whether each compiled graph takes symbolic sizes."""

    def __init__(self):
        self.seen = []

    def __call__(self, graph):
        self.seen.append(any(isinstance(n.meta.get("val"), torch.SymInt) for n in graph.find_nodes(op="placeholder")))

    def uuid(self):
        return "symbolic-inputs-v1"


def test_fires_on_the_recompiled_graphs_of_default_dynamic():
    """torch.compile's default ``dynamic``: the first prompt compiles a static graph; another batch size and length
    recompile it with symbolic B and T (here two chunks: n = 2). The pass fires on both layers of each graph, and the
    states and outputs equal eager."""
    import k3compile

    torch._dynamo.reset()
    model, symbolic = TwoLayersOfOneHiddenState(), SymbolicInputs()
    k3compile.optimize(model, backend="reference", passes=["kda_prefill"],
                       options={"post_grad_custom_post_pass": symbolic})
    H, K = 2, TwoLayersOfOneHiddenState.K
    for B, T in ((1, 3), (2, 20)):
        gen = torch.Generator().manual_seed(T)
        x = torch.randn(B, T, H, 8 * K + 2, generator=gen)
        states = [torch.randn(B, H, K, K, generator=gen) for _ in range(2)]
        want_states = [s.clone() for s in states]
        want = TwoLayersOfOneHiddenState.forward(model, x, *want_states)
        with torch.no_grad():
            got = model(x, *states)
        assert rel(got, want) <= 1e-6, (B, T)
        assert all(rel(s, w) <= 1e-6 for s, w in zip(states, want_states)), (B, T)
    rep = k3compile.report(model)
    assert symbolic.seen == [False, True]
    assert [g.record.matches["kda_prefill"] for g in rep.graphs] == [2, 2]
    assert [g.record.facts["graph_kda_prefill_solves"] for g in rep.graphs] == [4, 4]


# ---------------------------------------------------------------------------------------------------
# GPU: the same graph on CUDA tensors runs fla's chunk_kda

@pytest.mark.gpu
@pytest.mark.parametrize("T", [37, 128], ids=["T37", "T128"])
def test_cuda_graph_runs_fla_chunk_kda(T, pass_harness):
    KDA_PREFILL.clear()
    fn = two_layers(layer(kda_chunked), layer(kda_chunked))
    n, solves, _ = compile_and_check(pass_harness, fn, make_inputs(2, T, 4, 128, torch.bfloat16, seed=0, device="cuda"),
                                        make_inputs(1, T, 2, 64, torch.bfloat16, seed=1, device="cuda"),
                                        tol=TOL_FLA)
    assert n == 2
    assert {c.impl for c in KDA_PREFILL.choices()} == {"triton"}
