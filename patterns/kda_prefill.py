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

Symbolic sizes (torch.compile's default ``dynamic``: a second prompt length recompiles the prefill with a
symbolic T, a second batch size with a symbolic B): the key holds the graph's own ``SymInt`` s, and
``kda_chunked`` is traced at them, in the graph's fake mode, with the symbols as pattern inputs (as
Inductor's ``register_replacement`` re-traces its patterns), so the sizes the graph computes from them
(``ceil(T / C)``, the padding) must be the same expressions. The trace adds no guard; such a pattern
belongs to its graph and is not cached.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import threading
from typing import NamedTuple

import torch

from k3compile.patterns._common import fake_mode, pm, statically_known_true, trace_fn, val

log = logging.getLogger("k3compile")

NAME = "kda_prefill"
ARGNAMES = ("q", "k", "v", "g", "beta", "state")
# how far above a solve's right-hand side its token-major inputs are looked for (pad, reshape, permute, mul)
ANCESTOR_DEPTH = 6


def _chunk_size() -> int:
    from k3compile.model.kda import kda_chunked
    return inspect.signature(kda_chunked).parameters["chunk_size"].default


class PrefillKey(NamedTuple):
    """Everything the traced pattern depends on. B and T are the graph's ``SymInt`` s where it has them."""
    B: int
    T: int
    H: int
    K: int
    V: int
    C: int
    v_dtype: torch.dtype
    device: torch.device

    @property
    def symbols(self) -> list:
        """The distinct symbolic sizes among B and T (traced as pattern inputs)."""
        out = []
        for size in (self.B, self.T):
            if isinstance(size, torch.SymInt) and not any(statically_known_true(size == s) for s in out):
                out.append(size)
        return out


# -- the search: kda_chunked traced at one key -----------------------------------------------------------
def _example_inputs(key: PrefillKey) -> list[torch.Tensor]:
    B, T, H, K, V = key.B, key.T, key.H, key.K, key.V
    f32 = functools.partial(torch.empty, dtype=torch.float32, device=key.device)
    return [f32(B, T, H, K), f32(B, T, H, K), torch.empty(B, T, H, V, dtype=key.v_dtype, device=key.device),
            f32(B, T, H, K), f32(B, T, H), f32(B, H, V, K)]


def _search_graph(key: PrefillKey) -> tuple[torch.fx.GraphModule, tuple[str, ...]]:
    """``kda_chunked`` at ``key``'s shapes as a functional graph ``(*symbols, q, k, v, g, beta, state) -> (o,
    S_end)``, normalised like a post-grad graph; and its inputs' names."""
    from torch._inductor import config as inductor_config
    from torch._inductor.fx_passes.joint_graph import joint_graph_passes
    from torch._inductor.fx_passes.post_grad import post_grad_passes

    from k3compile.model.kda import kda_chunked

    symbols = key.symbols

    def prefill(*args):   # the symbols first: make_fx then reads every size of them from these inputs
        q, k, v, g, beta, state = args[len(symbols):]
        return kda_chunked(q, k, v, g, beta, state, chunk_size=key.C)

    gm = trace_fn(prefill, [*symbols, *_example_inputs(key)])
    graph = gm.graph
    argnames = tuple(f"size{i}" for i in range(len(symbols))) + ARGNAMES   # fx_to_pattern: by position
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
    return gm, argnames


def canonical_reshapes(graph: torch.fx.Graph) -> None:
    """Spell a ``reshape``'s ``-1`` out where that size is static. Dynamo resolves ``-1`` in some traces and keeps it
    in others; the sizes mean the same, and the exact pattern compares them literally."""
    for node in graph.find_nodes(op="call_function", target=torch.ops.aten.reshape.default):
        sizes, out = node.args[1], val(node)
        if isinstance(sizes, (list, tuple)) and -1 in sizes and isinstance(out, torch.Tensor):
            spelled = [out.shape[i] if s == -1 and isinstance(out.shape[i], int) else s for i, s in enumerate(sizes)]
            node.args = (node.args[0], spelled)


def _search_signature(q, k, v, g, beta, state):  # names the pattern's inputs (the pattern is pre-traced)
    raise NotImplementedError


def _search_signature_1(size0, q, k, v, g, beta, state):  # with one symbolic size (B or T) as an input
    raise NotImplementedError


def _search_signature_2(size0, size1, q, k, v, g, beta, state):  # with B and T symbolic
    raise NotImplementedError


SEARCH_SIGNATURES = (_search_signature, _search_signature_1, _search_signature_2)   # by number of symbols


# -- the replacement ----------------------------------------------------------------------------------------
def _replacement(backend: str, chunk_size: int):
    def replacement(*args):   # (*symbolic sizes, q, k, v, g, beta, state): the sizes are the tensors' own
        from torch._higher_order_ops.auto_functionalize import auto_functionalized

        q, k, v, g, beta, state = args[-len(ARGNAMES):]

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
            and _same(tri.shape[-2:], (C, C)) and _same(rhs.shape[:4], tri.shape[:4]))


def _same(a, b) -> bool:
    """Sizes equal for every value symbolic ones may take (decided without adding a guard)."""
    return len(a) == len(b) and all(statically_known_true(x == y) for x, y in zip(a, b))


def _ancestors(node: torch.fx.Node, depth: int) -> set[torch.fx.Node]:
    seen, frontier = set(), [node]
    for _ in range(depth):
        frontier = [a for n in frontier for a in n.all_input_nodes if a not in seen]
        seen.update(frontier)
    return seen


def _in_last_chunk(T, n, C: int) -> bool:
    """(n - 1) * C < T <= n * C for static sizes; symbolic ones pass (the exact pattern decides)."""
    if isinstance(T, int) and isinstance(n, int):
        return (n - 1) * C < T <= n * C
    return True


def candidate_keys(graph: torch.fx.Graph) -> list[PrefillKey]:
    """Keys worth tracing, read around each chunk solve; a wrong guess costs one trace that matches nothing.
    Head counts and head dims must be static; the batch and the token count may be symbolic."""
    C = _chunk_size()
    by_tri: dict[torch.fx.Node, list[torch.fx.Node]] = {}
    for node in graph.find_nodes(op="call_function", target=torch.ops.aten.linalg_solve_triangular.default):
        if _is_prefill_solve(node, C):
            by_tri.setdefault(node.args[0], []).append(node)
    keys: dict[str, PrefillKey] = {}
    for tri, solves in by_tri.items():
        B, H, n = val(tri).shape[:3]
        widths = [val(s.args[1]).shape[-1] for s in solves]
        if not isinstance(H, int) or len(solves) != 2 or not all(isinstance(w, int) for w in widths):
            continue
        dims = set(widths)
        # token-major [B, T, H, X] tensors feeding the solves: q, k, v, g (padded to n*C, or not)
        seen = {}
        for s in solves:
            for a in _ancestors(s.args[1], ANCESTOR_DEPTH):
                if a.target is torch.ops.aten.constant_pad_nd.default:
                    continue   # the tokens padded to n*C: its input carries the true T
                t = val(a)
                if not isinstance(t, torch.Tensor) or t.dim() != 4:
                    continue
                b, T, h, x = t.shape
                if (_same((b, h), (B, H)) and isinstance(x, int) and x in dims and _in_last_chunk(T, n, C)):
                    seen[str((T, x, t.dtype, t.device))] = (T, x, t.dtype, t.device)
        for T, X, dtype, device in seen.values():
            for V in dims:
                K = (dims - {V}) or {V}
                key = PrefillKey(B, T, H, K.pop(), V, C, dtype, device)
                if X == V:
                    keys.setdefault(str(key), key)
    # a 16-bit v first: its trace carries the .float() the fp32 trace lacks
    return sorted(keys.values(), key=lambda k: k.v_dtype == torch.float32)


# -- per-key pattern passes --------------------------------------------------------------------------------
_PASSES: dict[tuple[PrefillKey, str], pm.PatternMatcherPass] = {}
_PASSES_LOCK = threading.Lock()


def _pass_for(key: PrefillKey, backend: str) -> pm.PatternMatcherPass:
    if key.symbols:
        return _build_pass(key, backend)   # the graph's own symbols: nothing another graph could reuse
    with _PASSES_LOCK:
        cached = _PASSES.get((key, backend))
        if cached is None:
            cached = _PASSES[(key, backend)] = _build_pass(key, backend)
        return cached


@contextlib.contextmanager
def _tracing_mode(key: PrefillKey):
    """A fresh fake mode for static keys; for symbolic ones the graph's own, adding no guard to it."""
    if not key.symbols:
        with fake_mode():
            yield
        return
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    shape_env = key.symbols[0].node.shape_env
    with torch._guards.tracing(None), unset_fake_temporarily(), _graph_fake_mode(shape_env), \
            shape_env.suppress_guards():
        yield


def _graph_fake_mode(shape_env):
    from torch._guards import TracingContext
    from torch._subclasses.fake_tensor import FakeTensorMode

    context = TracingContext.try_get()
    if context is not None and context.fake_mode is not None and context.fake_mode.shape_env is shape_env:
        return context.fake_mode
    return FakeTensorMode(shape_env=shape_env)


def _shared_size_arithmetic(pattern: pm.PatternExpr) -> None:
    """Let the pattern's size arithmetic (``ceil(T / C)``, the padding: SymInt expressions, Python operators on
    sizes) have users outside the match: Inductor computes each once for every layer of the graph. The
    expressions themselves are still compared exactly; the tensor ops keep their exact user counts."""
    todo, seen = [pattern], set()
    while todo:
        p = todo.pop()
        if id(p) in seen:
            continue
        seen.add(id(p))
        if isinstance(p, pm.MultiOutputPattern):
            todo.extend(o for o in p.outputs if o is not None)
        elif isinstance(p, pm.CallFunction):
            if any(not isinstance(f, torch._ops.OpOverload) or f is torch.ops.aten.sym_size.int for f in p.fns):
                p.users = pm.MULTIPLE
            todo.extend(a for a in p.flat_args_kwargs[0] if isinstance(a, pm.PatternExpr))


def _build_pass(key: PrefillKey, backend: str) -> pm.PatternMatcherPass:
    import k3compile.ops.kda_prefill  # noqa: F401  (registers k3::kda_prefill)

    pm_pass = pm.PatternMatcherPass(pass_name=f"k3_{NAME}")
    with _tracing_mode(key):
        search, argnames = _search_graph(key)
        # exact: sizes, constants and dtypes must all agree; device objects may not (cpu vs cuda:0)
        pattern = pm.fx_to_pattern(search, ignore_types=(torch.device,), argnames=argnames)
        _shared_size_arithmetic(pattern)
        # pm_pass.patterns, not pm_pass: registering into the pass first pretty-prints the pattern to
        # look for duplicates, and the printed tree doubles with every chunk (each state feeds the next
        # chunk twice); one key registers one pattern, so there is no duplicate to find
        pm.register_replacement(
            SEARCH_SIGNATURES[len(key.symbols)], _replacement(backend, key.C), [*key.symbols, *_example_inputs(key)],
            trace_fn, pm_pass.patterns, search_fn_pattern=pattern,
        )
    return pm_pass


# -- the pattern-module contract ------------------------------------------------------------------------------
def register(pm_pass: pm.PatternMatcherPass, options) -> None:
    """Nothing shape-independent to register: patterns are built per shape in :func:`postprocess`."""
    import k3compile.ops.kda_prefill  # noqa: F401


def groups(options) -> list:
    """No registration group (see :func:`register`)."""
    return []


def facts(graph: torch.fx.Graph, options) -> dict:
    """How many chunk solves of the model's chunk size the graph holds (two per KDA layer of a prefill)."""
    C = _chunk_size()
    n = sum(_is_prefill_solve(node, C) for node in
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
