"""Block AttnRes mix, and the RMSNorm after it -> ``k3::attn_res``.

Matches, in the post-grad graph (S sources [..., D]: the completed block sums, then the partial sum; the model's
``attn_res``, ``model/attn_res.py``, and the ``rms_norm`` of ``model/layers.py`` the layer applies to its result)::

    x      = cat(sources).reshape(S, ..., D).float()                 # the stack
    scores = sum(x * rsqrt(mean(x², -1) + eps) * (mix_norm_w * proj_w), -1)
    mix    = sum(softmax(scores, 0)[..., None] * x, 0).to(dtype)
    out    = norm_w * (mix32 * rsqrt(mean(mix32², -1) + norm_eps)).to(dtype)   # mix32 = mix.float()

and rewrites it to ``out = k3.attn_res(sources, proj_w, mix_norm_w, eps, norm_w, norm_eps, backend)``: one kernel,
a program a token, in place of Inductor's two reductions (each one or two programs at decode sizes, so two launch
latencies a mix: about 18 µs a layer of the H200's decode step, docs/tuning/decode_step.md). Where no norm follows
(the mix compiled as a region of its own, k3compile/regions.py; the model's final mix) the mix alone is rewritten,
``norm_w`` None.

Spellings per number of sources: fp32 (no casts), 16-bit, and 16-bit as torch < 2.12 leaves it (its joint-graph
``pointless_convert`` drops the mix's rounding to 16 bits before the norm: the op rounds, as the model does); each
with the softmax as the model writes it (a CPU graph) and as Inductor rewrites it on a GPU before our pass
(``prepare_softmax_online``). A search is traced for each S a graph's ``cat`` calls could be (a ``Group`` per S and
softmax spelling); the matcher re-traces each match at its own values and compares every literal (dims, keepdim,
exponent, dtypes), the epsilons excepted (placeholders, read back).

Guard: the sources one shape and dtype, at most ``MAX_SOURCES`` of at most ``MAX_D`` values (beyond, the op would
run its reference: Inductor's code is left); the query weights D values; the norm weight [D].

Regions (``optimize(regions=True)``): a layer's mix is a region body (rewritten there, mix alone) and the norm after
it sits in the caller's graph, so the two would stay two kernels. :func:`postprocess` folds them back in the caller:
a call of a body that is one mix-alone ``k3::attn_res`` of its inputs, whose result feeds only an RMSNorm, becomes
one ``k3::attn_res`` with the norm, on the call's operands (the call is then dead). The report counts the mix once
either way: a body's matches count per call left (``graph_records.merge_records``).
"""
from __future__ import annotations

import functools
import inspect
import operator
from typing import Optional

import torch

from k3compile.graph_values import invoke_subgraph_op, region_call
from k3compile.ops.attn_res.dispatch import MAX_D, MAX_SOURCES
from k3compile.patterns._common import (LOW_PRECISION, TRACE_DTYPES, Group, aten, fake_mode, is_static_le,
                                        match_val, matched_scalar_ok, online_softmax_pass, pm, register_groups,
                                        reusing_search_traces, statically_known_true, trace_fn, val,
                                        with_online_softmax)

prims = torch.ops.prims

NAME = "attn_res"
# ops every pattern calls: a graph without one of them is not traced for (patterns/_common.py Group)
REQUIRES = (aten.cat.default, aten.exp.default, aten.rsqrt.default)

EPS = 1.2347e-5        # traced in place of the mix's eps, turned back into a keyword (unique in the trace)
NORM_EPS = 2.3459e-5   # ... and of the norm's
_B, _T, _D = 2, 3, 10  # example sizes, all distinct


# --- search functions (the model's lines; S sources as S arguments) -------------------------------------------

def _mix32(sources, proj_weight, mix_norm_weight, eps):
    x = torch.stack(sources).float()
    keys = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    query = mix_norm_weight.float() * proj_weight.float().reshape(-1)
    alpha = torch.softmax((keys * query).sum(-1), dim=0)
    return (alpha.unsqueeze(alpha.dim()) * x).sum(0)   # alpha[..., None]: CPU-only torch cannot index fake CUDA


def _normed(mix32, norm_weight, norm_eps, dtype):
    return norm_weight * (mix32 * torch.rsqrt(mix32.pow(2).mean(-1, keepdim=True) + norm_eps)).to(dtype)


def _mix(sources, proj_weight, mix_norm_weight, eps):
    return _mix32(sources, proj_weight, mix_norm_weight, eps).to(sources[-1].dtype)


def _mix_norm(sources, proj_weight, mix_norm_weight, eps, norm_weight, norm_eps):
    return _normed(_mix(sources, proj_weight, mix_norm_weight, eps).float(), norm_weight, norm_eps,
                   sources[-1].dtype)


def _mix_norm_unrounded(sources, proj_weight, mix_norm_weight, eps, norm_weight, norm_eps):
    return _normed(_mix32(sources, proj_weight, mix_norm_weight, eps), norm_weight, norm_eps, sources[-1].dtype)


_WEIGHTS = {_mix: ("proj_weight", "mix_norm_weight", "eps")}
_WEIGHTS[_mix_norm] = _WEIGHTS[_mix_norm_unrounded] = (*_WEIGHTS[_mix], "norm_weight", "norm_eps")


@functools.cache
def search(body, n: int):
    """``body`` with its S = ``n`` sources as arguments ``s0 .. s{n-1}`` (the matcher names a pattern's inputs
    after its search function's parameters)."""
    names = [f"s{i}" for i in range(n)] + list(_WEIGHTS[body])

    def fn(*args):
        return body(list(args[:n]), *args[n:])
    fn.__name__ = f"{body.__name__}_{n}"
    fn.__signature__ = inspect.Signature([inspect.Parameter(p, inspect.Parameter.POSITIONAL_OR_KEYWORD)
                                          for p in names])
    return fn


def replacement(n: int, norm: bool, backend: str):
    def fn(*args):
        sources, rest = list(args[:n]), args[n:]
        proj_weight, mix_norm_weight, eps = rest[:3]
        norm_weight, norm_eps = rest[3:] if norm else (None, 0.0)
        return torch.ops.k3.attn_res.default(sources, proj_weight, mix_norm_weight, eps, norm_weight, norm_eps,
                                             backend)
    return fn


def get_inputs(n: int, dtype: torch.dtype, norm: bool) -> list:
    """The search's tensor arguments (the epsilons are ``scalar_workaround``'s)."""
    sources = [torch.empty(_B, _T, _D, dtype=dtype) for _ in range(n)]
    weights = [torch.empty(1, _D, dtype=dtype), torch.empty(_D, dtype=dtype)]
    return sources + weights + ([torch.empty(_D, dtype=dtype)] if norm else [])


# (search body, takes the norm, the dtypes it is traced in) -- longest first
SEARCHES = ((_mix_norm, True, TRACE_DTYPES), (_mix_norm_unrounded, True, (LOW_PRECISION,)), (_mix, False, TRACE_DTYPES))


# --- guard ---------------------------------------------------------------------------------------------------

def _can_attn_res(match: pm.Match, n: int) -> bool:
    sources = [match_val(match, f"s{i}") for i in range(n)]
    if not all(isinstance(s, torch.Tensor) for s in sources) or not all(
            matched_scalar_ok(match, k) for k in ("eps", "norm_eps")):
        return False
    first = sources[0]
    d = first.shape[-1]
    if not (first.dtype.is_floating_point and is_static_le(d, MAX_D) and n <= MAX_SOURCES):
        return False
    if any(s.dtype != first.dtype or s.dim() != first.dim() or s.device != first.device
           or not all(statically_known_true(a == b) for a, b in zip(s.shape, first.shape)) for s in sources):
        return False
    weights = [match_val(match, k) for k in ("proj_weight", "mix_norm_weight", "norm_weight") if k in match.kwargs]
    return all(isinstance(w, torch.Tensor) and w.dtype.is_floating_point and w.device == first.device
               and statically_known_true(w.numel() == d) for w in weights) and (
        "norm_weight" not in match.kwargs or match_val(match, "norm_weight").dim() == 1)


# --- registration ----------------------------------------------------------------------------------------------

def _register_sources(pm_pass: pm.PatternMatcherPass, options, n: int, trace) -> None:
    import k3compile.ops.attn_res  # noqa: F401  (registers k3::attn_res)

    trace = reusing_search_traces(trace, [search(body, n) for body, _, _ in SEARCHES])
    for body, norm, dtypes in SEARCHES:
        for dtype in dtypes:
            pm.register_replacement(
                search(body, n), replacement(n, norm, options.backend), get_inputs(n, dtype, norm), trace, pm_pass,
                extra_check=functools.partial(_can_attn_res, n=n),
                scalar_workaround={"eps": EPS, **({"norm_eps": NORM_EPS} if norm else {})}, skip_duplicates=True)


def groups(options) -> list[Group]:
    """One group per number of sources and softmax spelling: the model's (``amax`` ... ``div``: a CPU graph) and
    Inductor's online form (``prims.prepare_softmax_online``: a GPU graph), each traced only for a graph that calls
    its softmax's op and holds a ``cat`` of that many tensors."""
    spellings = [("", trace_fn, aten.amax.default)]
    if online_softmax_pass() is not None:
        spellings.append((", online softmax", with_online_softmax(trace_fn), prims.prepare_softmax_online.default))
    return [Group(f"{n} sources{name}", functools.partial(_register_sources, options=options, n=n, trace=trace),
                  requires=(*REQUIRES, softmax), cat_inputs=n)
            for name, trace, softmax in spellings for n in range(2, MAX_SOURCES + 1)]


def register(pm_pass: pm.PatternMatcherPass, options) -> None:
    register_groups(pm_pass, groups(options))


# --- a mix compiled as a region, and the norm after it in the caller --------------------------------------------

def _norm_of(mix, norm_weight, norm_eps):
    return _normed(mix.float(), norm_weight, norm_eps, mix.dtype)


def _lone_mix(body: torch.fx.GraphModule) -> Optional[torch.fx.Node]:
    """The body's ``k3::attn_res`` where the body is that one mix alone of its own inputs, returned as its only
    output; else None."""
    nodes = [n for n in body.graph.nodes if n.op not in ("placeholder", "output")]
    if len(nodes) != 1 or nodes[0].target is not torch.ops.k3.attn_res.default or len(nodes[0].args) != 7:
        return None
    mix = nodes[0]
    sources, proj_weight, mix_norm_weight, _, norm_weight, _, _ = mix.args
    if norm_weight is not None or list(body.graph.output_node().args[0]) != [mix]:
        return None
    tensors = [*sources, proj_weight, mix_norm_weight]
    return mix if all(isinstance(t, torch.fx.Node) and t.op == "placeholder" for t in tensors) else None


def _region_mix(node) -> Optional[tuple]:
    """``(call, its lone mix, the call's operands)`` where ``node`` is item 0 of a region call whose body is a lone
    mix (:func:`_lone_mix`) and nothing else reads the call."""
    if not (isinstance(node, torch.fx.Node) and node.target is operator.getitem and node.args[1] == 0):
        return None
    call = node.args[0]
    if call.target is not invoke_subgraph_op() or len(call.users) != 1:
        return None
    body_operands = region_call(call)
    mix = body_operands and _lone_mix(body_operands[0])
    return (call, mix, body_operands[1]) if mix is not None else None


def _norm_after_region_mix(match: pm.Match) -> bool:
    out = match.output_node()
    if _region_mix(match.kwargs["mix"]) is None or not matched_scalar_ok(match, "norm_eps"):
        return False
    inner = [n for n in match.nodes if n is not out]
    if any(u not in match.nodes for n in [*inner, match.kwargs["mix"]] for u in n.users):
        return False   # a value inside the norm (or the mix) read elsewhere too
    w, mix = match_val(match, "norm_weight"), val(match.kwargs["mix"])
    return (isinstance(w, torch.Tensor) and w.dim() == 1 and w.dtype.is_floating_point and w.device == mix.device
            and statically_known_true(w.shape[0] == mix.shape[-1]))


def _fold(match: pm.Match, mix, norm_weight, norm_eps) -> None:
    """The norm of a region's lone mix -> one ``k3::attn_res`` with the norm, on the call's operands."""
    call, inner, operands = _region_mix(mix)
    graph, out = match.graph, match.output_node()
    outer = dict(zip([p for p in inner.graph.nodes if p.op == "placeholder"], operands))
    sources, proj_weight, mix_norm_weight, eps, _, _, backend = inner.args
    with graph.inserting_before(out):
        fused = graph.call_function(torch.ops.k3.attn_res.default, (
            [outer[s] for s in sources], outer[proj_weight], outer[mix_norm_weight], eps, norm_weight,
            float(norm_eps), backend))
    fused.meta.update(out.meta)
    out.replace_all_uses_with(fused)
    for node in [*reversed(match.nodes), mix, call]:   # the norm, then the mix's item and the call: dead now
        if not node.users:
            graph.erase_node(node)


@functools.cache
def _region_norm_pass() -> pm.PatternMatcherPass:
    """The norm of a mix that comes out of a region (rounded to its dtype), as the caller's graph spells it, one
    pattern a traced dtype, each handled by :func:`_fold`."""
    pm_pass = pm.PatternMatcherPass(pass_name="attn_res_region_norm")
    with fake_mode():
        for dtype in TRACE_DTYPES:
            pattern = pm.gen_pattern(_norm_of, [torch.empty(_B, _T, _D, dtype=dtype), torch.empty(_D, dtype=dtype)],
                                     trace_fn, scalar_workaround={"norm_eps": NORM_EPS})
            pm.register_graph_pattern(pattern, extra_check=_norm_after_region_mix, pass_dict=pm_pass)(_fold)
    return pm_pass


def postprocess(graph: torch.fx.Graph, options) -> int:
    """Fold each region mix's norm into one op (module doc); the number folded."""
    op = invoke_subgraph_op()
    if op is None or not graph.find_nodes(op="call_function", target=op):
        return 0
    return _region_norm_pass().apply(graph)


# What the pass manager's warning says where a graph had candidates and none was rewritten.
EXPECTED = "the model mixes its sub-layers' inputs by Block AttnRes and the graph holds {graph_attn_res_mixes} mixes"
MISSED = "two Inductor reductions a mix (scores, then softmax, sum and norm), each a launch of one or two programs"
FACT = "graph_attn_res_mixes"


def _is_depth_softmax(node: torch.fx.Node) -> bool:
    """``amax(x, [0], keepdim)`` or ``prepare_softmax_online(x, 0)`` of ``x = sum(., [-1])``: a softmax over depth
    of per-source scores."""
    src, dim = node.args[0], node.args[1]
    return (dim in ([0], 0) and isinstance(src, torch.fx.Node) and src.target == aten.sum.dim_IntList
            and list(src.args[1]) == [-1])


def depth_softmaxes(graph: torch.fx.Graph) -> list:
    """The softmaxes over depth of ``graph``'s mixes, in either spelling (:func:`_is_depth_softmax`)."""
    targets = [aten.amax.default] + ([prims.prepare_softmax_online.default]
                                     if hasattr(prims, "prepare_softmax_online") else [])
    return [n for t in targets for n in graph.find_nodes(op="call_function", target=t) if _is_depth_softmax(n)]


def facts(graph: torch.fx.Graph, options) -> dict:
    """Read before any rewrite: the AttnRes mixes the graph holds."""
    return {FACT: len(depth_softmaxes(graph))}


def expected(summary: dict) -> bool:
    """A K3 (Block AttnRes) on a graph holding a softmax over depth."""
    return bool(summary.get("is_k3")) and summary.get(FACT, 0) > 0
