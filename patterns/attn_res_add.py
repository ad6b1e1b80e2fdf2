"""The residual add that makes a Block AttnRes mix's last source, folded into the mix -> ``k3::attn_res_add``.

A layer's mixes read the partial sum of the current block as their last source, made by the residual adds of
``model/modeling.py`` (``prefix + a`` after the attention, ``prefix + ffn`` after the FFN). Under tensor parallelism
each add sits behind an all-reduce, alone in an Inductor kernel of its own: at decode sizes a launch of ~1.1 µs an add,
two a layer (docs/tuning/decode_step.md). A graph walk, run after every other pass (the skinny-GEMM pass keeps the adds
it fuses into a product as its residual), rewrites::

    partial = aten.add.Tensor(x, y)                          # one shape and dtype: no broadcast, no promotion
    out     = k3::attn_res([*blocks, partial], ...)          # or the mix of a region, folded by the attn_res pass

to::

    out, partial = k3::attn_res_add([*blocks, x], y, ...)     # every other reader of partial reads the op's

The op adds in the activations' dtype, as the model does, so the sum is the add's bit for bit.

Guard: both operands tensors of the add's shape and dtype, no ``alpha`` but 1, the add read by the mix as its last
source only, and no other reader of the sum before the op's place (after the add and the mix's other operands).
"""
from __future__ import annotations

import operator
from typing import Optional

import torch

import k3compile.ops.attn_res  # noqa: F401  (registers k3::attn_res_add)
from k3compile.patterns._common import aten, fold_each, statically_known_true, val

NAME = "attn_res_add"
FACT = "graph_attn_res_residual_adds"
# What the pass manager's warning says where a graph had candidates and none was rewritten.
EXPECTED = "the model's mixes read residual adds as their last source ({graph_attn_res_residual_adds} of them)"
MISSED = "each residual add before a mix as a kernel of its own"


def groups(options) -> list:
    """No traced patterns (nothing to register, ever): the rewrite is :func:`postprocess`'s walk."""
    return []


def register(pm_pass, options) -> None:
    """Nothing: see :func:`groups`."""


def _foldable_add(node) -> bool:
    """``node`` is ``aten.add.Tensor(x, y)`` of two floating tensors of its own shape and dtype, alpha 1."""
    if not (isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target is aten.add.Tensor):
        return False
    if len(node.args) != 2 or node.kwargs.get("alpha", 1) != 1:
        return False
    out, operands = val(node), [val(a) for a in node.args]
    if not isinstance(out, torch.Tensor) or not out.dtype.is_floating_point:
        return False
    return all(isinstance(t, torch.Tensor) and t.dtype == out.dtype and t.dim() == out.dim()
               and all(statically_known_true(a == b) for a, b in zip(t.shape, out.shape)) for t in operands)


def _fold_at(mix: torch.fx.Node, order: dict) -> Optional[torch.fx.Node]:
    """Fold the add that makes ``mix``'s last source (``k3::attn_res``) into one ``k3::attn_res_add``, placed after
    the add and the mix's other operands; the new node, or None where the guard fails."""
    sources, *rest = mix.args
    add = sources[-1]
    if not _foldable_add(add) or any(s is add for s in sources[:-1]) or len(rest) != 6:
        return None
    after = max([add, *(n for n in [*sources[:-1], *rest] if isinstance(n, torch.fx.Node))], key=order.__getitem__)
    if any(order[u] <= order[after] for u in add.users if u is not mix):   # a reader of the sum before that place
        return None
    x, y = add.args
    graph = mix.graph
    with graph.inserting_after(after):
        fused = graph.call_function(torch.ops.k3.attn_res_add.default, ([*sources[:-1], x], y, *rest))
    with graph.inserting_after(fused):
        out = graph.call_function(operator.getitem, (fused, 0))
    with graph.inserting_after(out):
        partial = graph.call_function(operator.getitem, (fused, 1))
    total = val(add)
    out.meta["val"], partial.meta["val"] = val(mix), total.new_empty(total.shape)   # the op's sum is contiguous
    fused.meta["val"] = (out.meta["val"], partial.meta["val"])
    for meta in ("stack_trace", "nn_module_stack"):
        if meta in mix.meta:
            fused.meta[meta] = mix.meta[meta]
    for i, node in enumerate((fused, out, partial), 1):   # between ``after`` and the node after it
        order[node] = order[after] + i / 4
    mix.replace_all_uses_with(out)
    add.replace_all_uses_with(partial)
    graph.erase_node(mix)
    graph.erase_node(add)
    return fused


def postprocess(graph: torch.fx.Graph, options) -> int:
    """Fold each foldable residual add into the mix that reads it (module doc); the number folded."""
    return fold_each(graph, torch.ops.k3.attn_res.default, _fold_at)


_VIEWS = (aten.unsqueeze.default, aten.view.default, aten.reshape.default)


def _cat_of(node: torch.fx.Node, depth: int = 10) -> Optional[torch.fx.Node]:
    """The ``cat`` of sources a depth softmax's scores are computed from (the model's ``torch.stack``), walking up
    through the first tensor operand of each op."""
    for _ in range(depth):
        if node.target is aten.cat.default:
            return node
        operands = [a for a in node.args if isinstance(a, torch.fx.Node)]
        if not operands:
            return None
        node = operands[0]
    return None


def _last_sources(graph: torch.fx.Graph) -> list:
    """The last source of each mix of ``graph`` before our passes: the last tensor its depth softmax's ``cat``
    stacks, or the operand a region call hands its body's mix (a body is rewritten before its caller)."""
    from k3compile.graph_values import invoke_subgraph_op, region_call
    from k3compile.patterns.attn_res import _lone_mix, depth_softmaxes

    lasts = []
    for softmax in depth_softmaxes(graph):
        cat = _cat_of(softmax.args[0])
        if cat:   # through the views (unsqueeze) a stack of sources may put before the cat
            last = cat.args[0][-1]
            while isinstance(last, torch.fx.Node) and last.target in _VIEWS:
                last = last.args[0]
            lasts.append(last)
    op = invoke_subgraph_op()
    for call in graph.find_nodes(op="call_function", target=op) if op is not None else ():
        body, operands = region_call(call) or (None, None)
        mix = _lone_mix(body) if isinstance(body, torch.fx.GraphModule) else None
        if mix is not None:
            inputs = dict(zip([p for p in body.graph.nodes if p.op == "placeholder"], operands))
            lasts.append(inputs.get(mix.args[0][-1]))
    return lasts


def facts(graph: torch.fx.Graph, options) -> dict:
    """Read before any rewrite: the residual adds that are a mix's last source (the skinny-GEMM pass may still take
    one as its product's residual: then the fold finds fewer)."""
    return {FACT: len({n for n in _last_sources(graph) if _foldable_add(n)})}


def expected(summary: dict) -> bool:
    """A K3 graph holding a mix whose last source is a residual add."""
    return bool(summary.get("is_k3")) and summary.get(FACT, 0) > 0
