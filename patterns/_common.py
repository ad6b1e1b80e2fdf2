"""What every pattern file shares: tracing, fake-mode registration, reading node metadata.

Contract of a pattern module ``patterns/<name>.py`` (listed in ``patterns/__init__.py``):

- ``NAME: str`` -- the pass name shown in reports and used in ``optimize(passes=...)``.
- ``register(pm_pass: PatternMatcherPass, options: K3Options) -> None`` -- registers its
  search/replacement pairs into ``pm_pass``. Called once per (pass, options) under fake tensors,
  lazily, at the first compile that needs it.
- Optionally ``REQUIRES: tuple`` -- ops every pattern ``register`` adds calls (checked in
  ``tests/patterns/test_common.py``): a graph that lacks one of them is never traced for (:class:`Group`).
- Optionally ``groups(options) -> list[Group]`` -- the same registrations split by what a graph must hold for
  them to match (:class:`Group`); the pass manager then registers each group only at the first graph that could
  hold one of its matches, and ``register`` is ``register_groups(pm_pass, groups(options))``.
- ``expected(summary: dict) -> bool`` -- whether a graph of a model described by the summary
  (``k3compile.passes.summarize_model`` keys, plus every module's ``facts`` for this graph and
  ``small_m_limit``) should produce at least one match; used by ``strict=True`` and the warning
  on zero matches.
- ``EXPECTED: str`` and ``MISSED: str`` -- that warning's words: why the pass was expected on the graph
  (formatted with the summary's keys, e.g. ``{small_m_limit}``), and what the graph runs instead.
- Optionally ``postprocess(graph, options) -> int`` for rewrites done by hand after the pattern
  matcher (returns the number of rewrites).
- Optionally ``facts(graph, options) -> dict`` -- read-only facts about a post-grad graph, taken
  before any pass rewrites it (e.g. ``{"graph_small_m_gemms": 3}``). The pass manager merges every
  module's facts into the summary that ``expected()`` receives for that graph, so a pass can be
  expected only where its candidates exist (a decode graph, not a prefill graph). Keys must be
  unique across modules: prefix them ``graph_``.

Search and replacement functions are plain eager functions traced with :func:`trace_fn`; guards
read ``meta["val"]`` through :func:`val` and decide symbolic sizes only through
``statically_known_true`` / ``guard_or_false`` so that they never add guards of their own.
"""
from __future__ import annotations

import contextlib
import functools
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
import torch.utils._pytree as pytree
from torch._inductor import pattern_matcher as pm
from torch.fx.experimental.symbolic_shapes import guard_or_false, statically_known_true

aten = torch.ops.aten

__all__ = [
    "aten", "pm", "trace_fn", "fake_mode", "val", "match_val", "is_static_le", "guard_or_false",
    "statically_known_true", "LOW_PRECISION", "TRACE_DTYPES", "Group", "register_groups", "pattern_targets",
    "GraphFacts", "reusing_search_traces", "search_traces_reused", "online_softmax_pass", "with_online_softmax",
    "trace_dtypes_of",
]

# Patterns ignore sizes but not dtypes (a 16-bit trace carries converts a fp32 trace lacks), so each
# pattern registers one fp32 and one 16-bit trace; bf16 and fp16 traces are identical.
LOW_PRECISION = torch.bfloat16
TRACE_DTYPES = (torch.float32, LOW_PRECISION)


def trace_fn(*args, **kwargs) -> torch.fx.GraphModule:
    """``fwd_only`` + ``view_to_reshape`` so traced patterns look like the post-grad graph.

    torch >= 2.12 passes extra keywords (``get_decomp_fn``); accept and forward them.
    """
    from torch._inductor.fx_passes.post_grad import view_to_reshape

    gm = pm.fwd_only(*args, **kwargs)
    view_to_reshape(gm)
    return gm


@functools.cache
def warm_inductor_patterns() -> None:
    """Initialise Inductor's lazily registered pattern sets (joint graph, post grad) for every device our searches
    are traced on, before any ``register_replacement`` of ours runs. Some searches are traced through Inductor's
    own passes; one that reaches a set not yet initialised registers Inductor's patterns from inside our
    ``register_replacement``, which re-enters a config patch torch 2.11 cannot enter twice ("prior should be empty
    when entering ConfigPatch": the moe_experts pass failed so on the H200 image). Call under :func:`fake_mode`."""
    from torch._inductor import config as inductor_config
    from torch._inductor.fx_passes.joint_graph import joint_graph_passes
    from torch._inductor.fx_passes.post_grad import post_grad_passes

    for device in ("cpu", "cuda") if torch.cuda.is_available() else ("cpu",):
        gm = pm.fwd_only(lambda x: x + 1, [torch.empty(2, device=device)])
        with inductor_config.patch(joint_custom_pre_pass=None, joint_custom_post_pass=None,
                                   post_grad_custom_pre_pass=None, post_grad_custom_post_pass=None):
            joint_graph_passes(gm)
            post_grad_passes(gm, is_inference=True)


@contextlib.contextmanager
def fake_mode():
    """Register patterns on fake tensors: no real memory, no real kernels, no device needed."""
    from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily

    with torch._guards.tracing(None), unset_fake_temporarily(), FakeTensorMode():
        yield


def val(node: Any) -> Optional[torch.Tensor]:
    """The fake value an FX node carries (None for non-nodes or nodes without one)."""
    if isinstance(node, torch.fx.Node):
        return node.meta.get("val")
    return None


def trace_dtypes_of(node: torch.fx.Node, depth: int = 12, limit: int = 96) -> frozenset:
    """The ``TRACE_DTYPES`` whose spelling a computation ending at ``node`` can have: ``LOW_PRECISION`` where a 16-bit
    float tensor is among the values it is computed from (within ``depth`` steps, ``limit`` nodes: its converts
    are the 16-bit trace's), fp32 where every float value found is fp32, both where none is found."""
    floats, seen, frontier = set(), {node}, [node]
    for _ in range(depth):
        nxt = []
        for n in frontier:
            for a in n.all_input_nodes:
                if a not in seen and len(seen) < limit:
                    seen.add(a)
                    nxt.append(a)
                    floats.update(v.dtype for v in pytree.tree_leaves(a.meta.get("val"))
                                  if isinstance(v, torch.Tensor) and v.dtype.is_floating_point)
        frontier = nxt
    if floats & {torch.bfloat16, torch.float16}:
        return frozenset({LOW_PRECISION})
    return frozenset({torch.float32}) if floats else frozenset(TRACE_DTYPES)


def fold_each(graph: torch.fx.Graph, target, fold: Callable) -> int:
    """For a graph walk's ``postprocess``: ``fold(node, order)`` on each call of ``target``, ``order`` the nodes'
    positions in the graph (a fold gives the nodes it adds a place in it); the number of calls it folded."""
    nodes = graph.find_nodes(op="call_function", target=target)
    if not nodes:
        return 0
    order = {n: i for i, n in enumerate(graph.nodes)}
    return sum(bool(fold(node, order)) for node in nodes)


def match_val(match: pm.Match, name: str) -> Any:
    """The fake value bound to keyword ``name`` in a match (a tensor, or a plain Python value)."""
    v = match.kwargs[name]
    return val(v) if isinstance(v, torch.fx.Node) else v


def matched_scalar_ok(match: pm.Match, name: str) -> bool:
    """True when keyword ``name`` (a ``scalar_workaround`` constant) is bound to a Python number, or is absent.
    Absent happens on torch < 2.12: ``register_replacement``'s re-check re-traces the search with the first
    match's value, which is then no placeholder and stays in the specific pattern as a literal, so the specific
    match (the one the guard sees) proved the graph holds exactly that number; torch >= 2.12 re-binds it."""
    v = match.kwargs.get(name, 0.0)
    return isinstance(v, (float, int)) and not isinstance(v, bool)


def is_static_le(size: Any, limit: int) -> bool:
    """True only when ``size <= limit`` holds for every value a symbolic size may take."""
    return bool(statically_known_true(size <= limit))


@functools.cache
def online_softmax_pass() -> Optional[pm.PatternMatcherPass]:
    """Inductor's post-grad rewrite of a softmax into ``prims.prepare_softmax_online`` (torch/_inductor/fx_passes/
    post_grad.py), without its device check: Inductor applies it to GPU graphs only (its online-softmax kernels are
    Triton's), so a search traced on the CPU must be given it to match a GPU graph (``with_online_softmax``). None where
    torch has no such rewrite."""
    from torch._inductor.fx_passes import post_grad

    search, replacement = (getattr(post_grad, f"prepare_softmax_{k}", None) for k in ("pattern", "replacement"))
    if search is None or replacement is None:
        return None
    online = pm.PatternMatcherPass()
    pm.register_replacement(search, replacement, [torch.empty(4, 8)], pm.fwd_only, online,
                            scalar_workaround={"dim": -1})
    return online


def with_online_softmax(trace: Callable) -> Callable:
    """``trace`` followed by :func:`online_softmax_pass`: a search's spelling in a GPU graph."""
    def traced(*args, **kwargs) -> torch.fx.GraphModule:
        gm = trace(*args, **kwargs)
        online_softmax_pass().apply(gm.graph)
        gm.graph.eliminate_dead_code()
        gm.recompile()
        return gm
    return traced


# --- registration groups: trace a pattern only for a graph that could hold its match ----------------------------

@dataclass(frozen=True)
class Group:
    """Some of one pass's registrations, traced only where a graph could hold one of their matches.

    ``requires``: ops every pattern of the group calls (``tests/patterns/test_common.py`` checks each pattern the
    group registers): a pattern matches only nodes calling its ops, so a graph that calls none of one of them cannot
    match. ``device``: the device type of the group's example inputs, where a pass traces one group per device
    because the spelling differs (the matcher re-traces every match at its own device and checks that trace, so
    a graph with no tensor on ``device`` gets its matches from the group traced on its own device). ``cat_inputs``:
    the number of tensors a ``cat`` of the graph must join, where the group's patterns stack that many (one group
    per count, so a graph traces only the counts it holds). ``when``: the pass's own test of the graph
    (``facts.graph``), where what a match needs is finer than the ops it calls (e.g. the sizes its trace was made
    at); it must answer True wherever it cannot tell."""
    name: str
    register: Callable[[pm.PatternMatcherPass], None]
    requires: tuple = ()
    device: Optional[str] = None
    cat_inputs: Optional[int] = None
    when: Optional[Callable[["GraphFacts"], bool]] = None

    def needed(self, facts: Optional["GraphFacts"]) -> bool:
        """Whether a graph with these facts could hold a match (None: any graph, everything is registered)."""
        if facts is None:
            return True
        return all(op in facts.targets for op in self.requires) and (
            self.device is None or self.device in facts.devices) and (
            self.cat_inputs is None or self.cat_inputs in facts.cat_inputs) and (
            self.when is None or facts.graph is None or self.when(facts))


@dataclass(frozen=True)
class GraphFacts:
    """What :meth:`Group.needed` reads of a graph: the ops it calls, the device types of its tensors and how many
    tensors each of its ``cat`` calls joins; the graph itself for a group's ``when``."""
    targets: frozenset
    devices: frozenset
    cat_inputs: frozenset = frozenset()
    graph: Optional[torch.fx.Graph] = field(default=None, compare=False, repr=False)
    _derived: dict = field(default_factory=dict, compare=False, repr=False)

    def derived(self, fn: Callable[[torch.fx.Graph], Any]) -> Any:
        """``fn(self.graph)``, computed once for these facts: a pass's groups each ask their ``when`` of one graph."""
        if fn not in self._derived:
            self._derived[fn] = fn(self.graph)
        return self._derived[fn]

    @classmethod
    def of(cls, graph: torch.fx.Graph) -> "GraphFacts":
        targets, devices, cat_inputs = set(), set(), set()
        for node in graph.nodes:
            if node.op == "call_function":
                targets.add(node.target)
                if node.target is aten.cat.default and isinstance(node.args[0], (list, tuple)):
                    cat_inputs.add(len(node.args[0]))
            devices.update(v.device.type for v in pytree.tree_leaves(node.meta.get("val"))
                           if isinstance(v, torch.Tensor))
        return cls(frozenset(targets), frozenset(devices), frozenset(cat_inputs), graph)


def register_groups(pm_pass: pm.PatternMatcherPass, groups) -> None:
    """Register every group of ``groups`` (a module's ``register``; the pass manager registers them one by one)."""
    for group in groups:
        group.register(pm_pass)


def pattern_targets(pattern: Any) -> set:
    """The ops a pattern's nodes call (each node of a match calls one of its pattern node's ``fns``)."""
    out, stack, seen = set(), [pattern], set()
    while stack:
        p = stack.pop()
        if id(p) in seen or not isinstance(p, pm.PatternExpr):
            continue
        seen.add(id(p))
        if isinstance(p, pm.MultiOutputPattern):
            stack.extend(p.outputs)
            continue
        fns = getattr(p, "fns", None)
        if fns:
            if len(fns) == 1:
                out.add(fns[0])
            else:
                out.add(tuple(fns))   # any one of them
        flat = getattr(p, "flat_args_kwargs", None)
        if flat is not None:
            stack.extend(flat[0])
        inner = getattr(p, "pattern", None)
        if inner is not None:
            stack.append(inner)
    return out


# --- one graph's matching: a search traced once per distinct static input metadata ---------------------------

class _SearchTraces(threading.local):
    def __init__(self):
        self.memo: Optional[dict] = None   # (trace, search, decompositions, inputs' metadata) -> GraphModule


_SEARCH_TRACES = _SearchTraces()


@contextlib.contextmanager
def search_traces_reused():
    """While one graph's patterns are registered and matched (``k3compile/passes.py``): each search function's
    trace at the same static input metadata is made once (see :func:`reusing_search_traces`)."""
    outer, _SEARCH_TRACES.memo = _SEARCH_TRACES.memo, {}
    try:
        yield
    finally:
        _SEARCH_TRACES.memo = outer


def _metadata(args) -> Optional[tuple]:
    """What a trace of fake inputs depends on: each tensor's sizes, strides, offset, view-ness, dtype, device and
    grad flag, each other input's type and value; None where a size is symbolic or an input is of another kind."""
    leaves, spec = pytree.tree_flatten(args)
    out = [str(spec)]
    for x in leaves:
        if isinstance(x, torch.Tensor):
            dims = (*x.shape, *x.stride(), x.storage_offset())
            if not all(type(d) is int for d in dims):
                return None
            out.append((tuple(x.shape), x.stride(), x.storage_offset(), x._is_view(), x.dtype, x.device,
                        x.requires_grad))
        elif x is None or type(x) in (int, float, bool, str) or isinstance(x, torch.dtype):
            out.append((type(x), x))
        else:
            return None
    return tuple(out)


def reusing_search_traces(trace, searches):
    """``trace`` for ``register_replacement``, whose trace of a function in ``searches`` is reused within
    :func:`search_traces_reused` for the same static input metadata. The matcher re-traces the search at each
    match's own values to check it (the layers of a model repeat the same ones) and only reads that trace (to make
    a pattern of it); a replacement's trace, whose nodes the matcher edits, is always made anew."""
    searches = tuple(searches)

    def traced(fn, args, **kwargs):
        memo = _SEARCH_TRACES.memo
        key = None
        if memo is not None and any(fn is s for s in searches):
            meta = _metadata(args)
            if meta is not None:
                key = (trace, fn, tuple(sorted(kwargs.items())), meta)
                if key in memo:
                    return memo[key]
        gm = trace(fn, args, **kwargs)
        if key is not None:
            memo[key] = gm
        return gm
    return traced
