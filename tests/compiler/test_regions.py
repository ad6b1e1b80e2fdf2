"""Compile regions (``k3compile/regions.py``): each distinct decoder block compiled once, the passes' counts weighed by
the calls of each body, and the whole graph where regions fail or lose a pass.

A stack of three equal layers (a Linear block each, M = 2: one skinny GEMM a layer) covers the mechanics in seconds;
the micro K3's decode step as regions (every pass as often as in the whole graph, the same tokens) is in
tests/compiler/test_tiny_k3.py, beside the whole graph it is compared with.
"""
from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from torch import nn

import k3compile
from k3compile import regions
from k3compile.graph_records import merge_records
from k3compile.passes import GraphRecord
from k3compile.testing import rel_err

LAYERS, D = 3, 16


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(D, D)

    def forward(self, x):
        return torch.relu(self.proj(x))


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.mlp = Block()

    def forward(self, x):
        return x + self.mlp(self.norm(x))


class Stack(nn.Module):
    def __init__(self, layer=Layer):
        super().__init__()
        self.layers = nn.ModuleList(layer() for _ in range(LAYERS))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def _compiled(model, regions=True):
    torch._dynamo.reset()
    k3compile.optimize(model, backend="reference", passes=["skinny_gemm"], dynamic=False, regions=regions)
    x = torch.randn(2, D)
    with torch.no_grad():
        out = model(x)
    return out, x, k3compile.report(model)


def test_merge_records_weighs_each_body_by_its_calls():
    body = GraphRecord(matches={"skinny_gemm": 2}, facts={"graph_small_m_gemms": 2, "rejected": ["b"],
                                                           "static_weight": {"skinny_gemm": {"proven": 1}}})
    inner = GraphRecord(matches={"skinny_gemm": 1}, facts={"graph_small_m_gemms": 1, "rejected": ["a"]})
    outer = GraphRecord(matches={"skinny_gemm": 1}, facts={"graph_small_m_gemms": 1})
    body.graph_id, inner.graph_id, outer.graph_id = 1, 2, 3
    body.calls = {2: 2}          # the body calls a nested body twice; the graph calls the body three times
    outer.calls = {1: 3}
    merged = merge_records([inner, body, outer])   # bodies first, as Inductor's recursive post-grad passes run
    assert merged.matches == {"skinny_gemm": 1 * 6 + 2 * 3 + 1}
    assert merged.facts["graph_small_m_gemms"] == 13
    assert merged.facts["rejected"] == ["a", "b"]
    assert merged.facts["static_weight"] == {"skinny_gemm": {"proven": 3}}
    assert merged.regions == {"bodies": 2, "calls": 9}
    assert "graph_id" not in merged.to_json() and "calls" not in merged.to_json()


def test_merge_records_counts_a_body_per_call_left_and_its_facts_per_call_read():
    """A rewrite of the caller took the work of two of a body's three calls out of them (as the AttnRes pass folds
    a region's mix into its caller's norm): the body's matches and proven weights count once, the facts it was read
    for three times; a body no call is left to is not a compiled body."""
    body = GraphRecord(matches={"attn_res": 1}, facts={"graph_attn_res_mixes": 1,
                                                        "static_weight": {"skinny_gemm": {"proven": 1}}})
    gone = GraphRecord(matches={"attn_res": 1}, facts={"graph_attn_res_mixes": 1})
    outer = GraphRecord(matches={"attn_res": 2 + 1}, facts={"graph_attn_res_mixes": 0})
    body.graph_id, gone.graph_id, outer.graph_id = 1, 2, 3
    outer.calls_read, outer.calls = {1: 3, 2: 1}, {1: 1, 2: 0}
    merged = merge_records([body, gone, outer])
    assert merged.matches == {"attn_res": 1 + 0 + 3}
    assert merged.facts["graph_attn_res_mixes"] == 3 + 1
    assert merged.facts["static_weight"] == {"skinny_gemm": {"proven": 1}}
    assert merged.regions == {"bodies": 1, "calls": 1}


def test_regions_count_every_call_of_a_body(no_graph_caches):
    eager = Stack().eval()
    model = copy.deepcopy(eager)
    out, x, rep = _compiled(model)
    assert rel_err(out, eager(x)) < 1e-6
    (graph,) = rep.graphs
    assert rep.regions == f"{LAYERS} Block"
    assert graph.regions == f"1 region bodies for {LAYERS} calls"
    assert rep.matches["skinny_gemm"] == LAYERS == graph.record.facts["graph_small_m_gemms"]
    assert "compile regions: 3 Block" in str(rep)
    assert regions.unmark(model) == LAYERS and type(model.layers[0].mlp) is Block


def test_regions_off_compiles_one_graph(no_graph_caches):
    out, x, rep = _compiled(Stack().eval(), regions=False)
    (graph,) = rep.graphs
    assert rep.regions == "off (regions=False)" and graph.regions == ""
    assert rep.matches["skinny_gemm"] == LAYERS


def test_regions_by_default_from_sixteen_layers(no_graph_caches):
    """optimize(regions=None): a shallow stack compiles whole (its reason in the report), a deep one as regions, and
    a given choice stands either way."""
    deep = Stack()
    deep.layers.extend(Layer() for _ in range(regions.FROM_LAYERS - LAYERS))
    assert regions.wanted(deep, None)[0] is True and regions.wanted(deep, False) == (False, "regions=False")
    assert regions.wanted(Stack(), True)[0] and regions.wanted(lambda x: x, None)[0] is False
    out, x, rep = _compiled(Stack().eval(), regions=None)
    assert rep.regions == f"off ({LAYERS} layers, under {regions.FROM_LAYERS}: regions=None marks deeper ones; " \
        "regions=True forces them)" and rep.graphs[0].regions == ""
    eager = copy.deepcopy(deep).eval()
    out, x, rep = _compiled(deep.eval(), regions=None)
    assert rep.regions == f"{regions.FROM_LAYERS} Block" and rel_err(out, eager(x)) < 1e-6
    assert rep.matches["skinny_gemm"] == regions.FROM_LAYERS


def test_regions_that_lose_a_pass_compile_the_whole_graph(no_graph_caches, monkeypatch):
    """A pass expected on the graph but silent in its regions: the regions are inlined and the whole graph compiled,
    the reason in the report."""
    import importlib

    optimize_module = importlib.import_module("k3compile.optimize")
    found = optimize_module._missing

    def lost_in_regions(state, record):
        return [("skinny_gemm", "simulated")] if record.regions else found(state, record)
    monkeypatch.setattr(optimize_module, "_missing", lost_in_regions)
    eager = Stack().eval()
    out, x, rep = _compiled(copy.deepcopy(eager))
    (graph,) = rep.graphs
    assert graph.regions.startswith("whole graph: pass 'skinny_gemm' rewrote nothing in the regions although "
                                    "simulated")
    assert graph.record.regions == {} and rep.matches["skinny_gemm"] == LAYERS
    assert rel_err(out, eager(x)) < 1e-6


class Passthrough(nn.Module):
    """A block that returns its input as it is (on odd widths): its output aliases its input, which
    ``invoke_subgraph`` refuses."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(D, D)

    def forward(self, x):
        return x


class AliasingLayer(Layer):
    def __init__(self):
        super().__init__()
        self.mlp = Passthrough()


def test_regions_dynamo_cannot_trace_are_removed(no_graph_caches):
    eager = Stack(AliasingLayer).eval()
    model = copy.deepcopy(eager)
    out, x, rep = _compiled(model)
    assert rep.regions.startswith("off (Dynamo could not trace them: ")
    assert type(model.layers[0].mlp) is Passthrough
    assert rel_err(out, eager(x)) < 1e-6


def test_inline_gives_back_the_graph_without_regions():
    captured = []

    def backend(gm, inputs):
        captured.append((gm, inputs))
        return gm.forward
    model = Stack().eval()
    regions.mark(model)
    torch._dynamo.reset()
    x = torch.randn(2, D)
    with torch.no_grad():
        want = torch.compile(model, backend=backend)(x)
    ((gm, inputs),) = captured
    assert regions.has_regions(gm)
    assert regions.inline(gm) == LAYERS and not regions.has_regions(gm)
    assert not any(isinstance(m, torch.fx.GraphModule) for _, m in gm.named_children())
    with torch.no_grad():
        (got,) = gm(*inputs)
    assert torch.equal(got, want)
    torch._dynamo.reset()


def test_warm_start_report_keeps_the_weighed_counts(tmp_path, monkeypatch):
    """The second compile of the same model is an FX-graph-cache hit: no pass runs, the sidecar record has the
    counts over every call of the body."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    eager = Stack().eval()
    reports = [_compiled(copy.deepcopy(eager))[2] for _ in range(2)]
    assert [r.graphs[0].source for r in reports] == ["pass ran", "cache hit (sidecar)"]
    assert [r.matches["skinny_gemm"] for r in reports] == [LAYERS, LAYERS]
    assert reports[1].graphs[0].regions == f"1 region bodies for {LAYERS} calls"


@dataclasses.dataclass
class State:
    """A layer's state as K3's KDA and MLA blocks take it (``model/cache.py``): a dataclass of tensors, updated in
    place."""
    total: torch.Tensor
    steps: torch.Tensor


class StatefulBlock(Block):
    def forward(self, x, state):
        y = torch.relu(self.proj(x))
        state.total.add_(y)
        state.steps.add_(1)
        return y


class StatefulLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.attn = StatefulBlock()

    def forward(self, x, state):
        return x + self.attn(self.norm(x), state)


class StatefulStack(Stack):
    def __init__(self):
        super().__init__(StatefulLayer)

    def forward(self, x, states):
        for layer, state in zip(self.layers, states):
            x = layer(x, state)
        return x


def _states():
    return [State(torch.zeros(2, D), torch.zeros((), dtype=torch.long)) for _ in range(LAYERS)]


@pytest.mark.skipif(not regions._reuse_options(), reason="this torch's Dynamo traces every call of a region")
def test_regions_trace_each_distinct_body_once():
    """Dynamo traces a block taking its layer's state object once and reuses the body for the other layers (the state
    reaches the body as its tensors): as many traces as distinct bodies, however many layers; the states are updated
    as in eager."""
    from torch._dynamo.utils import compilation_time_metrics

    eager, model = StatefulStack().eval(), StatefulStack().eval()
    model.load_state_dict(eager.state_dict())
    regions.mark(model)
    captured = []

    def backend(gm, inputs):
        captured.append(gm)
        return gm.forward
    torch._dynamo.reset()
    x, want_states, got_states = torch.randn(2, D), _states(), _states()
    traces = len(compilation_time_metrics.get("invoke_subgraph_trace", []))
    regions.register_states(got_states)     # as optimize() does at the first call
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    with torch.no_grad():
        got = compiled(x, got_states)
        want = eager(x, want_states)
        compiled(x, _states())                # no recompile: no guard on what the first trace registered
    assert len(compilation_time_metrics.get("invoke_subgraph_trace", [])) - traces == 1
    (gm,) = captured
    calls = gm.graph.find_nodes(op="call_function", target=regions.invoke_subgraph_op())
    assert len(calls) == LAYERS and len({node.args[0].target for node in calls}) == 1
    assert torch.equal(got, want)
    for g, w in zip(got_states, want_states):
        assert torch.equal(g.total, w.total) and int(g.steps) == int(w.steps) == 1
    torch._dynamo.reset()


def test_regions_k3_outer_graph_keeps_no_attn_res_mix():
    """The tiny K3's decode step (8 layers, AttnRes blocks of 5) as Dynamo hands it over: the blocks and every
    AttnRes mix of a layer are region calls, one body per distinct block and per number of mix sources, and the outer
    graph keeps only the model's own output mix: what is left between the regions is the same at every layer. Where
    Dynamo reuses bodies, it traced each distinct one once (and the dense MLP, called once and so inlined)."""
    from torch._dynamo.utils import compilation_time_metrics

    from k3compile.model import KimiK3Config, KimiK3ForConditionalGeneration

    torch.manual_seed(0)
    model = KimiK3ForConditionalGeneration(KimiK3Config.tiny(num_hidden_layers=8)).eval()
    cache = model.allocate_cache(2, 4)
    marked = regions.mark(model)
    assert marked["KimiDecoderLayer.attn_res_mix"] == 8
    captured = []

    def backend(gm, inputs):
        captured.append(gm)
        return gm.forward
    torch._dynamo.reset()
    regions.register_states(cache)
    traces = len(compilation_time_metrics.get("invoke_subgraph_trace", []))
    with torch.no_grad():
        torch.compile(model, backend=backend, dynamic=False)(torch.zeros(2, 1, dtype=torch.long), cache=cache,
                                                             logits_to_keep=1)
    (gm,) = captured
    calls = gm.graph.find_nodes(op="call_function", target=regions.invoke_subgraph_op())
    bodies = {node.args[0].target for node in calls}
    # KDA 6, latent MoE 7, MLA 2 calls (the dense MLP's one call is inlined on torch 2.13, a region on others) and
    # 15 mixes (layer 0's first has no source): over 1 completed block in layers 0-4 and mostly 2 in layers 5-7
    assert len(calls) in (30, 31) and len(bodies) == 3 + 2 + len(calls) - 30, (len(calls), sorted(bodies))
    softmaxes = [node for node in gm.graph.nodes if node.op == "call_function" and "softmax" in str(node.target)]
    assert len(softmaxes) == 1    # the output mix, once a model
    if regions._reuse_options():
        assert len(compilation_time_metrics.get("invoke_subgraph_trace", [])) - traces == len(bodies) + 1
    regions.unmark(model)
    torch._dynamo.reset()
