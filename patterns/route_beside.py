"""A MoE layer's routing and the largest other product of its input, in one op -> ``k3::route_beside``.

The router's product and the routing (``k3::moe_route``) are a few µs of latency on a handful of SMs; the latent
MoE's down-projection, a product of the same input, streams the layer's largest weight. The op runs the routing on
a second stream while that product runs (``k3compile/ops/route_beside/dispatch.py``). A graph walk, run after every
other pass (the products are ``k3::skinny_gemm`` calls by then), rewrites::

    logits           = k3::skinny_gemm(a, router_w, out_dtype=float32)       # read by the routing only
    weights, experts = k3::moe_route(logits, bias, k, eps, scaling, route_backend)
    y                = k3::skinny_gemm(a, w)      # the routed experts' input, else the largest such product of ``a``

to ``weights, experts, y = k3::route_beside(a, router_w, bias, k, eps, scaling, w, ...)``, placed where the first
of the three was (an input computed later, such as the bias's cast, moved before it where its own inputs allow).

Guard: both products of the same ``a`` node, with no bias or residual, one backend and small-M limit; the router's
product in fp32 and read by the routing alone; ``y`` in ``a``'s dtype. The static-weight proof runs after this walk
and proves each product of the op as it proves a skinny GEMM (``k3compile/static_weights.py``).
"""
from __future__ import annotations

import operator
from typing import Optional

import torch

import k3compile.ops.moe_experts  # noqa: F401  (registers k3::moe_experts)
import k3compile.ops.moe_route  # noqa: F401  (registers k3::moe_route)
import k3compile.ops.route_beside  # noqa: F401  (registers k3::route_beside)
import k3compile.ops.skinny_gemm  # noqa: F401  (registers k3::skinny_gemm)
from k3compile.graph_values import bound_args, schema_arg, tensor_bytes
from k3compile.patterns._common import aten, fold_each, val

NAME = "route_beside"
FACT = "graph_routes_beside_products"
# What the pass manager's warning says where a graph had candidates and none was rewritten.
EXPECTED = ("the graph routes {graph_routes_beside_products} MoE layers whose input has another small-M product "
            "of a weight")
MISSED = "each MoE layer's routing on the one stream, between the products of its input"

_VIEWS = (aten.view.default, aten.reshape.default, aten._unsafe_view.default)


def groups(options) -> list:
    """No traced patterns (nothing to register, ever): the rewrite is :func:`postprocess`'s walk."""
    return []


def register(pm_pass, options) -> None:
    """Nothing: see :func:`groups`."""


def _arg(node: torch.fx.Node, name: str):
    return bound_args(node)[name]


def plain_product(node, a=None) -> bool:
    """``node`` is ``k3::skinny_gemm(a, w)`` without bias or residual (of ``a`` where given)."""
    return (isinstance(node, torch.fx.Node) and node.op == "call_function"
            and node.target is torch.ops.k3.skinny_gemm.default
            and (a is None or schema_arg(node, "a") is a)
            and schema_arg(node, "bias") is None and schema_arg(node, "residual") is None)


def plain_product_in_its_dtype(node, a=None) -> bool:
    """``plain_product`` whose output is in its input's dtype (no fp32 output of 16-bit operands)."""
    return plain_product(node, a) and schema_arg(node, "out_dtype") in (None, val(schema_arg(node, "a")).dtype)


def _beside(route: torch.fx.Node) -> Optional[tuple]:
    """(the router's product, the other product) the op would take for ``route``, or None (module doc's guard)."""
    logits = _arg(route, "logits")
    logits_val = val(logits)
    if not (plain_product(logits) and isinstance(logits_val, torch.Tensor) and logits_val.dtype == torch.float32
            and len(logits.users) == 1):
        return None
    a = schema_arg(logits, "a")
    a_val = val(a)
    if not isinstance(a_val, torch.Tensor):
        return None
    same = ("backend", "m_limit")
    others = [u for u in a.users if u is not logits and plain_product(u, a)
              and _arg(u, "out_dtype") in (None, a_val.dtype)
              and all(_arg(u, k) == _arg(logits, k) for k in same)]
    if not others:
        return None
    # the latent down-projection, which the routed experts read (their own op may then take the shared experts
    # beside them: patterns/experts_beside.py), else the largest
    latent = [u for u in others if any(v.target is torch.ops.k3.moe_experts.default and _arg(v, "z") is u
                                       for v in u.users)]
    return logits, max(latent or others, key=lambda u: tensor_bytes(_arg(u, "w")))


def _hoist(node: torch.fx.Node, before: torch.fx.Node, order: dict) -> bool:
    """Make ``node`` come before ``before``: already so, or moved there where its own inputs do (a pure op)."""
    if order[node] < order[before]:
        return True
    if node.op != "call_function" or node.is_impure() or any(order[i] >= order[before] for i in node.all_input_nodes):
        return False
    before.prepend(node)
    order[node] = order[before] - 0.5
    return True


def _fold(route: torch.fx.Node, order: dict) -> bool:
    found = _beside(route)
    if found is None:
        return False
    logits, product = found
    first = min(logits, product, key=order.__getitem__)
    bias = _arg(route, "bias")
    if isinstance(bias, torch.fx.Node) and not _hoist(bias, first, order):
        return False
    args = dict(a=_arg(logits, "a"), router_w=_arg(logits, "w"), bias=bias, top_k=_arg(route, "top_k"),
                renorm_eps=_arg(route, "renorm_eps"), scaling=_arg(route, "scaling"), w=_arg(product, "w"),
                backend=_arg(logits, "backend"), route_backend=_arg(route, "backend"), m_limit=_arg(logits, "m_limit"))
    graph = route.graph
    with graph.inserting_before(first):
        fused = graph.call_function(torch.ops.k3.route_beside.default, (), args)
        y = graph.call_function(operator.getitem, (fused, 2))
    y.meta["val"] = val(product)
    fused.meta["val"] = (*val(route), y.meta["val"])
    for meta in ("stack_trace", "nn_module_stack"):
        if meta in route.meta:
            fused.meta[meta] = route.meta[meta]
    order[fused], order[y] = order[first] - 0.25, order[first] - 0.2
    route.replace_all_uses_with(fused)    # its items 0 and 1 are the op's
    product.replace_all_uses_with(y)
    for node in (route, logits, product):
        graph.erase_node(node)
    return True


def postprocess(graph: torch.fx.Graph, options) -> int:
    """Fold each routing with its input's largest other product (module doc); the number folded."""
    return fold_each(graph, torch.ops.k3.moe_route.default, _fold)


def _router_mm(topk: torch.fx.Node) -> Optional[torch.fx.Node]:
    """The ``mm`` / ``addmm`` whose product a router top-k's sigmoid reads (through views), else None."""
    node = topk.args[0].args[0].args[0]   # topk(add(sigmoid(logits), bias)): logits
    while isinstance(node, torch.fx.Node) and node.target in _VIEWS:
        node = node.args[0]
    ok = isinstance(node, torch.fx.Node) and node.target in (aten.mm.default, aten.addmm.default)
    return node if ok else None


def router_inputs(graph: torch.fx.Graph) -> dict:
    """Before any rewrite: {a router's input (of its upcast, where the router upcasts): its product ``mm``} for each
    routing top-k whose router product is an ``mm`` / ``addmm`` of a weight."""
    from k3compile.patterns.moe_route import _is_router_topk
    from k3compile.patterns.skinny_gemm import transposed_weight
    from k3compile.patterns.upcast_matmul import _upcast_source

    inputs = {}
    for topk in graph.find_nodes(op="call_function", target=aten.topk.default):
        mm = _router_mm(topk) if _is_router_topk(topk) else None
        if mm is not None and transposed_weight(mm.args[1]):
            inputs[_upcast_source(mm.args[0]) or mm.args[0]] = mm
    return inputs


def facts(graph: torch.fx.Graph, options) -> dict:
    """Read before any rewrite: the routing top-k's whose router product is a small-M product of a weight (of the
    upcast operands, or in fp32) and whose input some other product of a weight reads."""
    from k3compile.patterns.skinny_gemm import small_m, transposed_weight

    n = 0
    for a, mm in router_inputs(graph).items():
        a_val, limit = val(a), options.small_m_limit
        if not (isinstance(a_val, torch.Tensor) and a_val.dim() == 2 and small_m(a_val.shape[0], limit)):
            continue
        n += any(u is not mm and u.target is aten.mm.default and u.args[0] is a and transposed_weight(u.args[1])
                 for u in a.users)
    return {FACT: n}


def expected(summary: dict) -> bool:
    """A model with MoE layers, on a graph routing one whose input another product reads."""
    return summary.get("moe_layers", 0) > 0 and summary.get(FACT, 0) > 0
