"""The KDA prefill recurrence (``kda_chunked``, unrolled over its chunks) -> one in-place ``k3::kda_prefill``.

The model's prefill (``model/kda.py: kda_chunked``) is a Python loop over n = ceil(T / C) chunks, so the
captured graph is unrolled and its structure depends on T: no single traced pattern fits every prompt.
This pass therefore builds its pattern per shape:

1. anchors: each ``linalg_solve_triangular(tri, rhs, upper=False, unitriangular=True)`` whose ``tri`` is
   ``[B, H, n, C, C]`` with C = ``kda_chunked``'s chunk size; with the shapes around it these give the
   candidate keys (B, T, H, K, V, C, v's dtype, device);
2. per key (cached): ``kda_chunked`` itself is traced at exactly those shapes, its state ``copy_`` turned
   into a second output, and the trace normalised by the same joint-graph and post-grad passes Inductor
   ran on the model's graph; the pattern keeps every literal (sizes, chunk size, constants, dtypes): only
   device objects are wildcards;
3. Inductor's pattern matcher replaces each exact match (its intermediates used by nothing else) with::

       o, state' = auto_functionalized(k3.kda_prefill, q, k, v, g, beta, state, chunk_size=C)

   and the graph's trailing ``copy_(state, ...)`` takes ``state'``, as for the decode step.

So the guard is an exact graph match against the function the model calls: another chunk size, another
formula or another order of operations leaves the graph as it is. The op's reference path *is*
``kda_chunked``; its Triton path is fla's ``chunk_kda`` (``k3compile/ops/kda_prefill``).
"""
from __future__ import annotations

import functools
import inspect
import logging
import threading
from typing import NamedTuple, Optional

import torch

from k3compile.patterns._common import fake_mode, pm, trace_fn, val

log = logging.getLogger("k3compile")

NAME = "kda_prefill"
ARGNAMES = ("q", "k", "v", "g", "beta", "state")
# how far above a solve's right-hand side its token-major inputs are looked for (pad, reshape, permute, mul)
ANCESTOR_DEPTH = 6


def _chunk_size() -> int:
    from k3compile.model.kda import kda_chunked
    return inspect.signature(kda_chunked).parameters["chunk_size"].default


class PrefillKey(NamedTuple):
    """Everything the traced pattern depends on."""
    B: int
    T: int
    H: int
    K: int
    V: int
    C: int
    v_dtype: torch.dtype
    device: torch.device


# -- the search: kda_chunked traced at one key -----------------------------------------------------------
def _example_inputs(key: PrefillKey) -> list[torch.Tensor]:
    B, T, H, K, V = key.B, key.T, key.H, key.K, key.V
    f32 = functools.partial(torch.empty, dtype=torch.float32, device=key.device)
    return [f32(B, T, H, K), f32(B, T, H, K), torch.empty(B, T, H, V, dtype=key.v_dtype, device=key.device),
            f32(B, T, H, K), f32(B, T, H), f32(B, H, V, K)]


def _search_graph(key: PrefillKey) -> torch.fx.GraphModule:
    """``kda_chunked`` at ``key``'s shapes as a functional graph ``(q, k, v, g, beta, state) -> (o, S_end)``,
    normalised like a post-grad graph."""
    from torch._inductor import config as inductor_config
    from torch._inductor.fx_passes.joint_graph import joint_graph_passes
    from torch._inductor.fx_passes.post_grad import post_grad_passes

    from k3compile.model.kda import kda_chunked

    def prefill(q, k, v, g, beta, state):
        return kda_chunked(q, k, v, g, beta, state, chunk_size=key.C)

    gm = trace_fn(prefill, _example_inputs(key))
    graph = gm.graph
    state = [n for n in graph.nodes if n.op == "placeholder"][-1]
    (copy,) = [n for n in graph.nodes if n.target is torch.ops.aten.copy_.default and n.args[0] is state]
    output = graph.output_node()
    o = output.args[0]
    output.args = ((o, copy.args[1]),)      # the state's end value becomes an output, as functionalised
    graph.erase_node(copy)
    graph.eliminate_dead_code()
    gm.recompile()
    # the passes Inductor ran on the model's graph before ours (ours and any user pass are not re-entered)
    with inductor_config.patch(joint_custom_pre_pass=None, joint_custom_post_pass=None,
                               post_grad_custom_pre_pass=None, post_grad_custom_post_pass=None):
        gm = joint_graph_passes(gm) or gm
        post_grad_passes(gm, is_inference=True)
    gm.graph.eliminate_dead_code()
    canonical_reshapes(gm.graph)
    gm.recompile()
    return gm


def canonical_reshapes(graph: torch.fx.Graph) -> None:
    """Spell every static ``reshape`` size out (``-1`` -> its size). Dynamo resolves ``-1`` in some traces and
    keeps it in others; the sizes mean the same, and the exact pattern compares them literally."""
    for node in graph.find_nodes(op="call_function", target=torch.ops.aten.reshape.default):
        sizes, out = node.args[1], val(node)
        if isinstance(sizes, (list, tuple)) and -1 in sizes and isinstance(out, torch.Tensor):
            shape = _static(out.shape)
            if shape is not None:
                node.args = (node.args[0], list(shape))


def _search_signature(q, k, v, g, beta, state):  # names the pattern's inputs (the pattern is pre-traced)
    raise NotImplementedError


# -- the replacement ----------------------------------------------------------------------------------------
def _replacement(backend: str, chunk_size: int):
    def replacement(q, k, v, g, beta, state):
        from torch._higher_order_ops.auto_functionalize import auto_functionalized

        o, new_state = auto_functionalized(torch.ops.k3.kda_prefill.default, q=q, k=k, v=v, g=g, beta=beta,
                                           state=state, chunk_size=chunk_size, backend=backend)
        return o, new_state
    return replacement


# -- keys from the graph ------------------------------------------------------------------------------------
def _is_prefill_solve(node: torch.fx.Node, C: int) -> bool:
    if node.target is not torch.ops.aten.linalg_solve_triangular.default:
        return False
    if node.kwargs.get("upper", True) or not node.kwargs.get("unitriangular", False):
        return False
    tri, rhs = val(node.args[0]), val(node.args[1])
    return (tri is not None and rhs is not None and tri.dim() == 5 and rhs.dim() == 5
            and tuple(tri.shape[-2:]) == (C, C) and tuple(rhs.shape[:4]) == tuple(tri.shape[:4]))


def _ancestors(node: torch.fx.Node, depth: int) -> set[torch.fx.Node]:
    seen, frontier = set(), [node]
    for _ in range(depth):
        frontier = [a for n in frontier for a in n.all_input_nodes if a not in seen]
        seen.update(frontier)
    return seen


def _static(shape) -> Optional[tuple[int, ...]]:
    try:
        return tuple(int(s) for s in shape)
    except (TypeError, ValueError):   # a symbolic size: no exact key (this pass needs static shapes)
        return None


def candidate_keys(graph: torch.fx.Graph) -> list[PrefillKey]:
    """Keys worth tracing, read around each chunk solve; a wrong guess costs one trace that matches nothing."""
    C = _chunk_size()
    by_tri: dict[torch.fx.Node, list[torch.fx.Node]] = {}
    for node in graph.find_nodes(op="call_function", target=torch.ops.aten.linalg_solve_triangular.default):
        if _is_prefill_solve(node, C):
            by_tri.setdefault(node.args[0], []).append(node)
    keys: list[PrefillKey] = []
    for tri, solves in by_tri.items():
        tri_shape = _static(val(tri).shape)
        if tri_shape is None or len(solves) != 2:
            continue
        B, H, n = tri_shape[:3]
        widths = [_static(val(s.args[1]).shape) for s in solves]
        if None in widths:
            continue
        dims = {w[-1] for w in widths}
        # token-major [B, T, H, X] tensors feeding the solves: q, k, v, g (padded to n*C, or not)
        seen = set()
        for s in solves:
            for a in _ancestors(s.args[1], ANCESTOR_DEPTH):
                if a.target is torch.ops.aten.constant_pad_nd.default:
                    continue   # the tokens padded to n*C: its input carries the true T
                t = val(a)
                if not isinstance(t, torch.Tensor) or t.dim() != 4:
                    continue
                shape = _static(t.shape)
                if (shape and shape[0] == B and shape[2] == H and shape[3] in dims
                        and (n - 1) * C < shape[1] <= n * C):
                    seen.add((shape[1], shape[3], t.dtype, t.device))
        for T, X, dtype, device in seen:
            for V in dims:
                K = (dims - {V}) or {V}
                key = PrefillKey(B, T, H, K.pop(), V, C, dtype, device)
                if X == V and key not in keys:
                    keys.append(key)
    # a 16-bit v first: its trace carries the .float() the fp32 trace lacks
    return sorted(keys, key=lambda k: k.v_dtype == torch.float32)


# -- per-key pattern passes --------------------------------------------------------------------------------
_PASSES: dict[tuple[PrefillKey, str], pm.PatternMatcherPass] = {}
_PASSES_LOCK = threading.Lock()


def _pass_for(key: PrefillKey, backend: str) -> pm.PatternMatcherPass:
    with _PASSES_LOCK:
        cached = _PASSES.get((key, backend))
        if cached is not None:
            return cached
        import k3compile.ops.kda_prefill  # noqa: F401  (registers k3::kda_prefill)

        pm_pass = pm.PatternMatcherPass(pass_name=f"k3_{NAME}")
        with fake_mode():
            search = _search_graph(key)
            # exact: sizes, constants and dtypes must all agree; device objects may not (cpu vs cuda:0)
            pattern = pm.fx_to_pattern(search, ignore_types=(torch.device,), argnames=ARGNAMES)
            # pm_pass.patterns, not pm_pass: registering into the pass first pretty-prints the pattern to
            # look for duplicates, and the printed tree doubles with every chunk (each state feeds the next
            # chunk twice); one key registers one pattern, so there is no duplicate to find
            pm.register_replacement(
                _search_signature, _replacement(backend, key.C), _example_inputs(key), trace_fn,
                pm_pass.patterns, search_fn_pattern=pattern,
            )
        _PASSES[(key, backend)] = pm_pass
        return pm_pass


# -- the pattern-module contract ------------------------------------------------------------------------------
def register(pm_pass: pm.PatternMatcherPass, options) -> None:
    """Nothing shape-independent to register: patterns are built per shape in :func:`postprocess`."""
    import k3compile.ops.kda_prefill  # noqa: F401


def facts(graph: torch.fx.Graph, options) -> dict:
    """How many chunk solves of the model's chunk size, with static shapes, the graph holds (two per KDA layer
    of a prefill). Symbolic sizes (``dynamic=True``) give no exact pattern, so they are not counted."""
    C = _chunk_size()
    n = sum(_is_prefill_solve(node, C) and _static(val(node.args[0]).shape) is not None for node in
            graph.find_nodes(op="call_function", target=torch.ops.aten.linalg_solve_triangular.default))
    return {"graph_kda_prefill_solves": n}


# What the pass manager's warning says where a graph had candidates and none was rewritten.
EXPECTED = "the model has KDA layers and the graph holds kda_chunked's chunk solves: a prefill"
MISSED = ("the prompt's KDA recurrence as Inductor compiles the model's chunk loop, not one k3::kda_prefill "
          "(fla's chunk_kda on a GPU)")


def expected(model_summary: dict) -> bool:
    """A K3 / Kimi Linear model with KDA layers, on a graph holding the chunked recurrence (a prefill)."""
    return (bool(model_summary.get("is_k3")) and model_summary.get("kda_layers", 0) > 0
            and model_summary.get("graph_kda_prefill_solves", 1) > 0)


def postprocess(graph: torch.fx.Graph, options) -> int:
    """Match every candidate key's exact pattern; returns the number of recurrences replaced."""
    from torch._inductor.pattern_matcher import stable_topological_sort

    n = 0
    keys = candidate_keys(graph)
    if keys:
        canonical_reshapes(graph)
    for key in keys:
        try:
            pm_pass = _pass_for(key, options.backend)
        except Exception as e:  # a trace that fails leaves the graph unfused (and correct); say why
            log.warning("k3compile %s: could not trace kda_chunked at %s: %s: %s", NAME, key, type(e).__name__, e)
            continue
        n += pm_pass.apply(graph)
    if n:
        # the replacement goes before the earliest matched output; put every node after its inputs again
        stable_topological_sort(graph)
    return n
