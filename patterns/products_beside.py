"""The small products of an input, on a second stream beside its large products -> ``k3::products_beside``.

At decode size a product of a small weight costs its launch, not its bytes: in a KDA layer the beta and gate-rank
products of the layer's input (heads and head-dim rows) and the gate's up-projection of the second cost 4-8 µs
beside 12-22 µs for q, k, v and the output gate together (``docs/tuning/decode_step.md``). The op runs the small
ones on a second stream while the large ones run (``k3compile/ops/products_beside/dispatch.py``). A graph walk, run
after every other pass (the products are ``k3::skinny_gemm`` calls by then), rewrites the plain products of one input
``x``::

    q = k3::skinny_gemm(x, w_q); k = ...; v = ...; g = ...           # large: the main products
    b = k3::skinny_gemm(x, w_b); fa = k3::skinny_gemm(x, w_fa)       # small: the side products
    f = k3::skinny_gemm(fa, w_fb)                                    # small, of a side output read by it alone

to ``q, k, v, g, b, fa, f = k3::products_beside(x, [w_q, ...], [w_b, w_fa], [w_fb], [1], ...)``, placed where the
first of them was.

Guard: plain products (no bias or residual, in ``x``'s dtype) of the same ``x`` node, one backend and small-M limit.
A product is small where its weight has at most a quarter of the elements of the largest one's; a chained product
where its weight is small too, its input a side output that nothing else reads. The side chain's weights together
hold at most a quarter of the main products' (so the large products outlast the chain). The static-weight proof
runs after this walk and proves every product of the op (``k3compile/static_weights.py``).
"""
from __future__ import annotations

import operator
from typing import Optional

import torch

import k3compile.ops.products_beside  # noqa: F401  (registers k3::products_beside)
import k3compile.ops.skinny_gemm  # noqa: F401  (registers k3::skinny_gemm)
from k3compile.graph_values import bound_args, schema_arg
from k3compile.patterns._common import aten, val
from k3compile.patterns.route_beside import plain_product_in_its_dtype

NAME = "products_beside"
FACT = "graph_small_products_beside_large"
# What the pass manager's warning says where a graph had candidates and none was rewritten.
EXPECTED = ("the graph holds {graph_small_products_beside_large} small-M inputs with small products beside large "
            "ones")
MISSED = "those small products on the one stream, each its own launch between the large ones"

SMALL = 4   # a small weight: at most 1 / SMALL of the largest product's elements; the side chain likewise of the main


def groups(options) -> list:
    """No traced patterns (nothing to register, ever): the rewrite is :func:`postprocess`'s walk."""
    return []


def register(pm_pass, options) -> None:
    """Nothing: see :func:`groups`."""


def _numel(w) -> int:
    v = val(w)
    return int(v.numel()) if isinstance(v, torch.Tensor) else 0


def split(weights: list) -> Optional[tuple[list, list]]:
    """(indices of the large weights, of the small ones) by element count, or None where none is small, the small
    ones hold more than 1 / ``SMALL`` of the large ones' elements, or a count is unknown."""
    sizes = [_numel(w) for w in weights]
    if not sizes or min(sizes) <= 0:
        return None
    largest = max(sizes)
    small = [i for i, s in enumerate(sizes) if s * SMALL <= largest]
    large = [i for i, s in enumerate(sizes) if s * SMALL > largest]
    if not small or sum(sizes[i] for i in small) * SMALL > sum(sizes[i] for i in large):
        return None
    return large, small


def _chained(side: torch.fx.Node, largest: int) -> Optional[torch.fx.Node]:
    """The plain product of ``side``'s output that alone reads it, with a small weight, else None."""
    if len(side.users) != 1:
        return None
    (user,) = side.users
    if not (plain_product_in_its_dtype(user, side) and _numel(schema_arg(user, "w")) * SMALL <= largest):
        return None
    return user if _launch(user) == _launch(side) else None


def _launch(product: torch.fx.Node) -> tuple:
    """(backend, small-M limit) of a product, defaults included."""
    args = bound_args(product)
    return args["backend"], args["m_limit"]


def _fold(x: torch.fx.Node, products: list, order: dict) -> bool:
    parts = split([schema_arg(p, "w") for p in products])
    if parts is None:
        return False
    large, small = parts
    main, side = [products[i] for i in large], [products[i] for i in small]
    largest = max(_numel(schema_arg(p, "w")) for p in main)
    chain, chain_of = [], []
    for i, s in enumerate(side):
        c = _chained(s, largest)
        if c is not None:
            chain.append(c)
            chain_of.append(i)
    side_elems = sum(_numel(schema_arg(p, "w")) for p in side + chain)
    if side_elems * SMALL > sum(_numel(schema_arg(p, "w")) for p in main):
        return False
    first = min(products, key=order.__getitem__)
    backend, m_limit = _launch(first)
    args = dict(x=x, w_main=[schema_arg(p, "w") for p in main], w_side=[schema_arg(p, "w") for p in side],
                w_chain=[schema_arg(p, "w") for p in chain], chain_of=chain_of, backend=backend, m_limit=m_limit)
    graph = x.graph
    outs = main + side + chain
    with graph.inserting_before(first):
        fused = graph.call_function(torch.ops.k3.products_beside.default, (), args)
        items = [graph.call_function(operator.getitem, (fused, i)) for i in range(len(outs))]
    fused.meta["val"] = [val(p) for p in outs]
    for meta in ("stack_trace", "nn_module_stack"):
        if meta in first.meta:
            fused.meta[meta] = first.meta[meta]
    for item, p in zip(items, outs):
        item.meta["val"] = val(p)
        p.replace_all_uses_with(item)
    for p in chain + side + main:   # a chained product reads a side output: erased first
        graph.erase_node(p)
    return True


def postprocess(graph: torch.fx.Graph, options) -> int:
    """Fold the products of each input as the module doc says; the number of inputs folded."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    by_input: dict = {}
    for node in graph.find_nodes(op="call_function", target=torch.ops.k3.skinny_gemm.default):
        x = schema_arg(node, "a")
        if isinstance(x, torch.fx.Node) and plain_product_in_its_dtype(node, x):
            by_input.setdefault(x, []).append(node)
    folded = 0
    for x, products in by_input.items():
        if len(products) >= 2 and len({_launch(p) for p in products}) == 1:
            folded += _fold(x, products, order)
    return folded


def facts(graph: torch.fx.Graph, options) -> dict:
    """Read before any rewrite: the small-M inputs whose products of weights split into large and small ones
    (:func:`split`; the chained products are not counted), a MoE layer's routed input aside (``route_beside`` takes
    its router's product)."""
    from k3compile.patterns.route_beside import router_inputs
    from k3compile.patterns.skinny_gemm import small_m, transposed_weight

    routed = router_inputs(graph)
    by_input: dict = {}
    for mm in graph.find_nodes(op="call_function", target=aten.mm.default):
        if transposed_weight(mm.args[1]) and mm.args[0] not in routed:
            by_input.setdefault(mm.args[0], []).append(mm.args[1].args[0])
    n = 0
    for x, weights in by_input.items():
        x_val = val(x)
        n += (isinstance(x_val, torch.Tensor) and x_val.dim() == 2 and small_m(x_val.shape[0], options.small_m_limit)
              and split(weights) is not None)
    return {FACT: n}


def expected(summary: dict) -> bool:
    """A graph with an input whose products split into small and large ones."""
    return summary.get(FACT, 0) > 0
