"""The order of a decode graph's skinny GEMMs of one input: largest weight first, one after another.

Why: each skinny GEMM is launched with PDL and, with a static weight, streams the start of its weight while the
kernel before it runs (``static_weights.py``). Behind a long product that lets it in early it streams at the copy
ceiling; behind a short kernel, or one that waits on a chain (KDA's f_a -> f_b), it pays its ramp. In the H200's
decode step (``docs/tuning/decode_step.md``) KDA's output gate, 1536 x 7168, took 8.1-9.0 µs behind f_b against
4.4-5.2 for v behind k; the model computes it last (it feeds the gated norm after the recurrence), and Inductor keeps
the order it is given where the order does not change its peak-memory estimate.

``order_same_input_products`` moves, for each tensor that two or more skinny GEMMs multiply, those GEMMs together
to the place of the first of them, sorted by weight bytes (largest first, ties in graph order). A GEMM whose other
inputs (bias, residual) are computed after that place stays where it is. Only the order changes: the same nodes, the
same values. Off unless ``K3_ORDER_PRODUCTS=1`` (``passes.K3Options.order_products``): on one H100 it saved nothing
beside the default trigger-only Inductor PDL; on one H200 at a TP 16 rank it took 1.6% off the M 8 step and nothing
at M 1 (``docs/tuning/decode_step.md``); TP 8 unmeasured.
"""
from __future__ import annotations

import torch
from torch.fx import Graph, Node

from .graph_values import tensor_bytes


def _skinny_gemm():
    import k3compile.ops.skinny_gemm  # noqa: F401  (registers k3::skinny_gemm)

    return torch.ops.k3.skinny_gemm.default


def order_same_input_products(graph: Graph) -> int:
    """Reorder as the module doc says; returns how many GEMMs changed place."""
    gemm = _skinny_gemm()
    groups: dict[Node, list[Node]] = {}
    for node in graph.nodes:
        if node.op == "call_function" and node.target is gemm and isinstance(node.args[0], Node):
            groups.setdefault(node.args[0], []).append(node)
    moved = 0
    for source, members in groups.items():
        if len(members) < 2:
            continue
        place = {n: i for i, n in enumerate(graph.nodes)}
        first = members[0]
        movable = [n for n in members if all(place[i] < place[first] or i is source or i is n
                                             for i in n.all_input_nodes)]
        if len(movable) < 2:
            continue
        before = list(movable)
        # stable: equal weights keep their order
        movable.sort(key=lambda n: -tensor_bytes(n.args[1] if len(n.args) > 1 else None))
        anchor = first.prev
        for n in movable:
            anchor.append(n)
            anchor = n
        order = {n: i for i, n in enumerate(graph.nodes)}
        moved += sum(a is not b for a, b in zip(before, sorted(movable, key=order.get)))
    return moved
