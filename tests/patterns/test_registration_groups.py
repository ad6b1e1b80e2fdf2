"""Registration groups (patterns/_common.py ``Group``, k3compile/passes.py ``_register``): a pass's patterns are traced
only for a graph that calls the ops they need, which is sound only if every pattern a group registers calls each op
the group requires. Counted, never timed."""
import pytest
import torch
from torch._inductor import pattern_matcher as pm

from k3compile import passes
from k3compile.passes import COMPILE_RECORD, K3Options, K3PostGradPass, _groups, _register
from k3compile.patterns import PASS_ORDER
from k3compile.patterns import moe_experts, moe_route, skinny_gemm
from k3compile.patterns._common import fake_mode, pattern_targets, trace_fn, warm_inductor_patterns

# moe_experts' spellings (the CUDA ones traced on fake tensors)
ALL_DEVICES = [("cpu", False), ("cuda", False), ("cuda", True)]


def _all_groups():
    out = []
    for name in PASS_ORDER:
        options = K3Options(backend="reference", passes=(name,))
        groups = moe_experts.groups(options, ALL_DEVICES) if name == "moe_experts" else _groups(name, options)
        out += [pytest.param(group, id=f"{name}-{group.name.replace(' ', '_')}") for group in groups]
    return out


@pytest.mark.parametrize("group", _all_groups())
def test_every_pattern_of_a_group_calls_the_ops_it_requires(group):
    pm_pass = pm.PatternMatcherPass()
    with fake_mode():
        warm_inductor_patterns()
        group.register(pm_pass)
    entries = {id(e): e for es in pm_pass.patterns.values() for e in es}.values()
    if not group.requires:
        return
    assert entries, f"{group.name} registered nothing"
    for entry in entries:
        missing = [op for op in group.requires if op not in pattern_targets(entry.pattern)]
        assert not missing, f"{group.name}: a pattern without {missing}:\n{pm.PatternPrettyPrinter.run(entry.pattern)}"


def _graph(fn, inputs) -> torch.fx.Graph:
    """``fn`` traced as a post-grad graph on fake tensors made by ``inputs()``."""
    with fake_mode():
        return trace_fn(fn, inputs()).graph


def _linear_residual(a, w, r):
    return torch.nn.functional.linear(a, w) + r


def _run(options, graph):
    """Our pass on ``graph``: (its match counts, the groups it registered)."""
    before = len(passes.REGISTRATIONS)
    COMPILE_RECORD.take()
    K3PostGradPass(options)(graph)
    (record,) = COMPILE_RECORD.take()
    return record.matches, {name for name, _ in passes.REGISTRATIONS[before:]}


def test_a_graph_without_moe_never_traces_the_moe_or_attention_patterns():
    options = K3Options(backend="reference", small_m_limit=11)   # options no other test uses: nothing registered yet
    def dense():
        return [torch.empty(4, 8), torch.empty(6, 8), torch.empty(4, 6)]
    matches, traced = _run(options, _graph(_linear_residual, dense))
    assert matches["skinny_gemm"] == 1 and sum(matches.values()) == 1
    assert traced == {"skinny_gemm"}

    matches, traced = _run(options, _graph(moe_route._renorm_scaled, moe_route.get_inputs))
    assert matches["moe_route"] == 1 and sum(matches.values()) == 1
    assert traced == {"moe_route"}   # skinny_gemm's patterns are not traced twice

    matches, traced = _run(options, _graph(_linear_residual, dense))
    assert matches["skinny_gemm"] == 1 and not traced


def _order(pm_pass) -> dict:
    return {key: [pm.PatternPrettyPrinter.run(e.pattern) for e in entries] for key, entries in pm_pass.patterns.items()
            if entries}


def test_groups_registered_one_graph_at_a_time_keep_the_all_at_once_order():
    """moe_experts' dense form first (a graph that scatters and calls no index), then the rest: each target's
    patterns end in the order registering every group at once gives."""
    lazy, eager = (K3Options(backend="reference", passes=("moe_experts",), small_m_limit=n) for n in (9, 10))
    graph = _graph(lambda c, i, w: c.scatter(1, i, w),
                   lambda: [torch.zeros(3, 4), torch.zeros(3, 2, dtype=torch.int64), torch.empty(3, 2)])
    first = _register(lazy, graph)[0]["moe_experts"]
    dense_only = _order(first)
    assert dense_only and all(len(v) for v in dense_only.values())
    lazily = _order(_register(lazy)[0]["moe_experts"])
    assert lazily == _order(_register(eager)[0]["moe_experts"])
    assert lazily != dense_only
    assert skinny_gemm.REQUIRES   # every pass either declares what it needs or splits into groups that do


def _three_linear_residuals(a, w1, w2, w3, r1, r2, r3):
    return [torch.nn.functional.linear(a, w) + r for w, r in ((w1, r1), (w2, r2), (w3, r3))]


def test_a_search_is_traced_once_for_matches_of_the_same_shapes(monkeypatch):
    """Three products of the same shapes (as a model's layers repeat them): the matcher checks each match by
    re-tracing the search at its values, once for all three."""
    calls = []

    def counting(fn, args, **kwargs):
        calls.append((fn, tuple(a.shape for a in args if isinstance(a, torch.Tensor))))
        return traced(fn, args, **kwargs)

    traced = skinny_gemm.trace_literal_mm
    monkeypatch.setattr(skinny_gemm, "trace_literal_mm", counting)
    options = K3Options(backend="reference", passes=("skinny_gemm",), small_m_limit=12)   # registered anew here
    graph = _graph(_three_linear_residuals, lambda: [torch.empty(4, 8)] + [torch.empty(6, 8)] * 3
                   + [torch.empty(4, 6)] * 3)
    matches, _ = _run(options, graph)
    assert matches["skinny_gemm"] == 3
    searches = {search for search, _ in skinny_gemm._PATTERNS}
    at_graph_shapes = [fn for fn, shapes in calls if shapes[-1] == (4, 6)]
    assert sum(fn in searches for fn in at_graph_shapes) == 1     # the check's trace, once
    assert sum(fn not in searches for fn in at_graph_shapes) == 3  # each replacement traced anew


def test_a_cuda_graph_traces_the_coordinate_descent_setting_it_is_compiled_under():
    """moe_experts' CUDA spellings differ with Inductor's coordinate-descent setting (max-autotune's): a graph is
    compiled under one, so only that one's group is traced for it."""
    from torch._inductor import config as inductor_config

    from k3compile.patterns._common import GraphFacts

    options = K3Options(backend="reference", passes=("moe_experts",))
    gathered = [g for g in moe_experts.groups(options, ALL_DEVICES) if g.name.startswith("gathered ")]
    facts = GraphFacts(frozenset({torch.ops.aten.index.Tensor}), frozenset({"cpu", "cuda"}), graph=torch.fx.Graph())
    for cd in (False, True):
        with inductor_config.patch(coordinate_descent_tuning=cd):
            assert [g.name for g in gathered if g.needed(facts)] == (
                ["gathered cpu", "gathered cuda coordinate-descent"] if cd else ["gathered cpu", "gathered cuda"])
    assert all(g.needed(GraphFacts(facts.targets, facts.devices)) for g in gathered)   # no graph: every group
