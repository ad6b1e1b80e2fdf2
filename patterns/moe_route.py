"""MoE routing tail: sigmoid scores, top-k of score + bias, gathered weights (renormalised, scaled) ->
``k3::moe_route``.

Matches, in the post-grad graph (M tokens, E experts, k = top_k; the model's ``route``, ``model/moe.py``, after the
router's product, which ``upcast_matmul`` or ``skinny_gemm`` takes on its own)::

    scores  = sigmoid(logits)                                   # logits [M, E] fp32
    experts = topk(scores + bias, k)[1]                         # bias [E] fp32 (or a cast of the 16-bit one)
    weights = gather(scores, -1, experts)                       # [M, k]
    weights = weights / (sum(weights, [-1], keepdim) + eps)     # when the model renormalises
    weights = weights * scaling                                 # when the graph keeps it

and rewrites it to ``weights, experts = k3.moe_route(logits, bias, k, eps or None, scaling, backend)``: one kernel in
place of the sigmoid, a radix top-k, a sort and the gather-and-normalise kernel (on the H200 the top-k and its
sort alone cost 13 µs a MoE layer at M = 1, benchmarks/results/decode_step_h200.json).

Guard: the literals the search leaves open (sizes, k, eps, scaling and dims are wildcards in the pattern) are read
back: top-k over the last dim, largest first; gather over the last dim; the sum over the last dim, kept; eps and
scaling Python numbers; logits [M, E] fp32, bias [E] fp32, 1 <= k <= E. Softmax routing, weights taken from the
biased keys, or a top-k of the smallest do not match.
"""
from __future__ import annotations

import functools
from typing import Optional

import torch

from k3compile.patterns._common import aten, guard_or_false, pm, trace_fn, val

NAME = "moe_route"
# ops every pattern calls: a graph without one of them is not traced for (patterns/_common.py Group)
REQUIRES = (aten.sigmoid.default, aten.topk.default, aten.gather.default)

_M, _E, _K = 3, 10, 4   # example sizes, all distinct


# --- search functions (the model's lines; literals are wildcards) ---------------------------------

def _renorm_scaled(logits, bias):
    scores = torch.sigmoid(logits)
    _, experts = torch.topk(scores + bias, _K, dim=-1)
    weights = scores.gather(-1, experts)
    weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return weights * 0.5, experts


def _renorm(logits, bias):
    scores = torch.sigmoid(logits)
    _, experts = torch.topk(scores + bias, _K, dim=-1)
    weights = scores.gather(-1, experts)
    return weights / (weights.sum(-1, keepdim=True) + 1e-20), experts


def _scaled(logits, bias):
    scores = torch.sigmoid(logits)
    _, experts = torch.topk(scores + bias, _K, dim=-1)
    return scores.gather(-1, experts) * 0.5, experts


# longest first: a graph that scales is rewritten with its scaling inside the op
SEARCHES = (_renorm_scaled, _renorm, _scaled)


def get_inputs() -> list[torch.Tensor]:
    return [torch.empty(_M, _E), torch.empty(_E)]


# --- guard: the literals the pattern left open ---------------------------------------------------

def _node(match: pm.Match, target) -> Optional[torch.fx.Node]:
    nodes = [n for n in match.nodes if n.op == "call_function" and n.target == target]
    return nodes[0] if len(nodes) == 1 else None


def _is_last_dim(dim, ndim: int) -> bool:
    return isinstance(dim, int) and dim in (-1, ndim - 1)


def _literals(match: pm.Match) -> Optional[tuple]:
    """(k, eps or None, scaling) when every literal the search left open is what the op computes, else None."""
    topk, gather = _node(match, aten.topk.default), _node(match, aten.gather.default)
    if topk is None or gather is None:
        return None
    dim = topk.args[2] if len(topk.args) > 2 else topk.kwargs.get("dim", -1)
    largest = topk.args[3] if len(topk.args) > 3 else topk.kwargs.get("largest", True)
    k = topk.args[1]
    if not (isinstance(k, int) and _is_last_dim(dim, 2) and largest is True and _is_last_dim(gather.args[1], 2)):
        return None
    eps = None
    total = _node(match, aten.sum.dim_IntList)
    if total is not None:
        dims, keep = total.args[1], (total.args[2] if len(total.args) > 2 else total.kwargs.get("keepdim", False))
        adds = [n for n in match.nodes if n.target == aten.add.Tensor and n.args[0] is total]
        if not (list(dims) in ([-1], [1]) and keep is True and len(adds) == 1):
            return None
        eps = adds[0].args[1]
        if not isinstance(eps, (int, float)) or isinstance(eps, bool):
            return None
    scaling = 1.0
    muls = [n for n in match.nodes if n.target == aten.mul.Tensor]
    if muls:
        scaling = muls[0].args[1]
        if len(muls) != 1 or not isinstance(scaling, (int, float)) or isinstance(scaling, bool):
            return None
    return k, (None if eps is None else float(eps)), float(scaling)


def _can_moe_route(match: pm.Match) -> bool:
    logits, bias = val(match.kwargs["logits"]), val(match.kwargs["bias"])
    lits = _literals(match)
    if lits is None or logits is None or bias is None:
        return False
    if logits.dim() != 2 or logits.dtype != torch.float32 or bias.dim() != 1 or bias.dtype != torch.float32:
        return False
    e = logits.shape[1]
    return guard_or_false(bias.shape[0] == e) and guard_or_false(lits[0] <= e) and lits[0] >= 1


# --- registration ------------------------------------------------------------------------------

def _rewrite(match: pm.Match, logits: torch.fx.Node, bias: torch.fx.Node, *, backend: str) -> None:
    k, eps, scaling = _literals(match)

    def replacement(logits, bias):
        return torch.ops.k3.moe_route.default(logits, bias, k, eps, scaling, backend)

    match.replace_by_example(replacement, [logits, bias])


def register(pm_pass: pm.PatternMatcherPass, options) -> None:
    import k3compile.ops.moe_route  # noqa: F401  (registers k3::moe_route)

    for search in SEARCHES:
        pattern = pm.gen_pattern(search, get_inputs(), trace_fn)
        pm.register_graph_pattern(pattern, extra_check=_can_moe_route, pass_dict=pm_pass)(
            functools.partial(_rewrite, backend=options.backend))


# What the pass manager's warning says where a graph had candidates and none was rewritten.
EXPECTED = "the model routes its MoE layers by a sigmoid top-k and the graph holds {graph_router_topks} such top-k"
MISSED = "a sigmoid, a radix top-k, a sort and a gather-and-normalise kernel for each MoE layer's routing"


def _is_router_topk(node: torch.fx.Node) -> bool:
    """``topk(add(sigmoid(x), b), k)`` over the last dim."""
    src = node.args[0]
    return (isinstance(src, torch.fx.Node) and src.target == aten.add.Tensor and isinstance(src.args[0], torch.fx.Node)
            and src.args[0].target == aten.sigmoid.default)


def facts(graph: torch.fx.Graph, options) -> dict:
    """Read before any rewrite: the routing top-k's the graph holds (one per MoE layer)."""
    return {"graph_router_topks": sum(_is_router_topk(n) for n in graph.find_nodes(
        op="call_function", target=aten.topk.default))}


def expected(summary: dict) -> bool:
    """A model with MoE layers, on a graph holding a sigmoid routing top-k."""
    return summary.get("moe_layers", 0) > 0 and summary.get("graph_router_topks", 0) > 0
