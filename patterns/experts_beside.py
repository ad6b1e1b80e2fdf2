"""A latent MoE layer's routed experts and its shared experts' chain, in one op -> ``k3::experts_beside``.

The routed experts (``k3::moe_experts``) are latency-bound at decode sizes; the shared experts (two products of the
layer's input, SiTU-GLU, a down product) need nothing of them. The op runs the routed experts on a second stream
while the shared chain runs (``k3compile/ops/experts_beside/dispatch.py``). A graph walk, run after every other pass
(the products are ``k3::skinny_gemm`` calls by then), rewrites::

    routed = k3::moe_experts(z, experts, weights, w1, w3, w2, ...)     # z: a product of x (or route_beside's)
    gate   = k3::skinny_gemm(x, w_gate)                                 # read by the SiTU-GLU alone
    up     = k3::skinny_gemm(x, w_up)                                   # likewise
    h      = situ_glu(gate, up, beta, linear_beta)                      # the model's ATen ops, matched exactly
    shared = k3::skinny_gemm(h, w_down)

to ``routed, shared = k3::experts_beside(z, experts, weights, w1, ..., x, w_gate, w_up, w_down, beta, linear_beta,
...)``, placed where the routed experts were.

Guard: the SiTU-GLU is the model's ops (``model/layers.py`` ``situ_glu``, copied in ``patterns/moe_experts.py``),
matched against their trace in the graph's dtype with every intermediate read only inside it, both constants Python
numbers; the three products plain (no bias, residual or other output dtype), of one backend and small-M limit; gate
and up of the same ``x``, the layer input that also made ``z`` (route_beside's input, or the latent product's); every
reader of the shared output after the routed experts. The static-weight proof runs after this walk and proves the
three products of the op (``k3compile/static_weights.py``).
"""
from __future__ import annotations

import functools
import operator
from typing import Optional

import torch

import k3compile.ops.experts_beside  # noqa: F401  (registers k3::experts_beside)
import k3compile.ops.moe_experts  # noqa: F401  (registers k3::moe_experts)
import k3compile.ops.skinny_gemm  # noqa: F401  (registers k3::skinny_gemm)
from k3compile.graph_values import bound_args, schema_arg
from k3compile.patterns._common import LOW_PRECISION, aten, fake_mode, fold_each, pm, trace_fn, val
from k3compile.patterns.moe_experts import SCALARS, _situ_glu   # the model's SiTU-GLU, copied there
from k3compile.patterns.route_beside import plain_product_in_its_dtype

NAME = "experts_beside"
FACT = "graph_shared_beside_experts"
# What the pass manager's warning says where a graph had candidates and none was rewritten.
EXPECTED = ("the graph holds {graph_shared_beside_experts} MoE layers whose shared experts' SiTU-GLU chain runs on "
            "small-M products of the layer's input")
MISSED = "each MoE layer's routed experts on the one stream, before or after its shared experts' chain"


def groups(options) -> list:
    """No traced patterns registered (nothing to register, ever): the rewrite is :func:`postprocess`'s walk."""
    return []


def register(pm_pass, options) -> None:
    """Nothing: see :func:`groups`."""


@functools.cache
def glue_patterns() -> tuple:
    """The SiTU-GLU's search patterns, fp32 and 16-bit (dtypes are ignored by the match: bf16 and fp16 trace alike),
    its constants traced as the routed experts' pattern traces them."""
    def example(dtype):
        return [torch.empty(3, 8, dtype=dtype), torch.empty(3, 8, dtype=dtype), *SCALARS.values()]

    with fake_mode():
        return tuple(pm.gen_pattern(_situ_glu, example(dtype), trace_fn, scalar_workaround=SCALARS)
                     for dtype in (torch.float32, LOW_PRECISION))


def match_glue(h: torch.fx.Node) -> Optional[pm.Match]:
    """The match of the model's SiTU-GLU ending at ``h`` (both constants numbers), else None."""
    for pattern in glue_patterns():
        match = pattern.match(h)
        if isinstance(match, pm.Match) and all(isinstance(match.kwargs.get(k), (int, float))
                                               and not isinstance(match.kwargs.get(k), bool)
                                               for k in SCALARS):
            return match
    return None


def layer_input(routed: torch.fx.Node) -> Optional[torch.fx.Node]:
    """The layer input whose latent down-projection the routed experts read: route_beside's ``a``, or a plain
    product's ``a``; else None (a MoE without a latent projection: there the shared experts' down product takes the
    routed experts' output as its residual, and no chain is left beside them)."""
    z = schema_arg(routed, "z")
    if (isinstance(z, torch.fx.Node) and z.target is operator.getitem and z.args[1] == 2
            and getattr(z.args[0], "target", None) is torch.ops.k3.route_beside.default):
        return schema_arg(z.args[0], "a")
    return schema_arg(z, "a") if plain_product_in_its_dtype(z) else None


def shared_chain(down: torch.fx.Node) -> Optional[tuple]:
    """(gate product, up product, glue match) of a plain down product whose input is the model's SiTU-GLU of two
    plain products of one input, each read by the glue alone, else None."""
    if not plain_product_in_its_dtype(down):
        return None
    h = schema_arg(down, "a")
    if not isinstance(h, torch.fx.Node) or len(h.users) != 1:
        return None
    match = match_glue(h)
    if match is None:
        return None
    gate, up = match.kwargs["gate"], match.kwargs["up"]
    if not (plain_product_in_its_dtype(gate) and plain_product_in_its_dtype(up)) or gate is up:
        return None
    if schema_arg(gate, "a") is not schema_arg(up, "a") or any(
            schema_arg(gate, k) != schema_arg(p, k) for p in (up, down) for k in ("backend", "m_limit")):
        return None
    inside = set(match.nodes)
    if any(u not in inside for p in (gate, up) for u in p.users):
        return None
    return gate, up, match


def _fold(routed: torch.fx.Node, order: dict, chains: dict) -> bool:
    x = layer_input(routed)
    found = chains.get(x, [])
    if len(found) != 1:
        return False
    down, gate, up, match = found[0]
    if any(order[u] <= order[routed] for u in down.users):
        return False
    r, g = bound_args(routed), bound_args(gate)
    args = dict(z=r["z"], experts=r["experts"], weights=r["weights"], w1=r["w1"], w3=r["w3"], w2=r["w2"],
                w1_scale=r["w1_scale"], w3_scale=r["w3_scale"], w2_scale=r["w2_scale"], beta=r["beta"],
                linear_beta=r["linear_beta"], experts_backend=r["backend"], small_m_limit=r["small_m_limit"],
                x=x, w_gate=g["w"], w_up=schema_arg(up, "w"), w_down=schema_arg(down, "w"),
                shared_beta=float(match.kwargs["beta"]), shared_linear_beta=float(match.kwargs["linear_beta"]),
                backend=g["backend"], m_limit=g["m_limit"])
    graph = routed.graph
    with graph.inserting_before(routed):
        fused = graph.call_function(torch.ops.k3.experts_beside.default, (), args)
        routed_out = graph.call_function(operator.getitem, (fused, 0))
        shared_out = graph.call_function(operator.getitem, (fused, 1))
    routed_out.meta["val"], shared_out.meta["val"] = val(routed), val(down)
    fused.meta["val"] = (val(routed), val(down))
    for meta in ("stack_trace", "nn_module_stack"):
        if meta in routed.meta:
            fused.meta[meta] = routed.meta[meta]
    for node, at in ((fused, -0.3), (routed_out, -0.2), (shared_out, -0.1)):
        order[node] = order[routed] + at
    routed.replace_all_uses_with(routed_out)
    down.replace_all_uses_with(shared_out)
    graph.erase_node(down)
    for node in sorted(match.nodes, key=order.__getitem__, reverse=True):   # the glue, its output first
        graph.erase_node(node)
    for node in (gate, up, routed):
        graph.erase_node(node)
    chains.pop(x)
    return True


def shared_chains(graph: torch.fx.Graph) -> dict:
    """{x: [(down, gate, up, glue match)]}: the shared experts' chains of k3 products in ``graph``, by their input."""
    chains: dict = {}
    for down in graph.find_nodes(op="call_function", target=torch.ops.k3.skinny_gemm.default):
        found = shared_chain(down)
        if found is not None:
            chains.setdefault(schema_arg(found[0], "a"), []).append((down, *found))
    return chains


def postprocess(graph: torch.fx.Graph, options) -> int:
    """Fold each routed experts' call with its layer's shared chain (module doc); the number folded."""
    chains = shared_chains(graph)
    if not chains:
        return 0
    return fold_each(graph, torch.ops.k3.moe_experts.default,
                     lambda routed, order: _fold(routed, order, chains))


def small_m_shared_mm_chains(graph: torch.fx.Graph, options) -> list:
    """Before any rewrite: ``(x, gate mm, up mm)`` of each shared experts' chain (a product of weights of the model's
    SiTU-GLU of two products of weights of ``x``) whose input has small-M rows."""
    from k3compile.patterns.skinny_gemm import small_m, transposed_weight

    def product_of(node, a) -> bool:
        return (isinstance(node, torch.fx.Node) and node.target is aten.mm.default
                and transposed_weight(node.args[1]) and node.args[0] is a)

    downs = [(d.args[0], d.args[1]) for d in graph.find_nodes(op="call_function", target=aten.mm.default)]
    # Inductor may have taken the add after the down product (the latent tail's, before its pass) as addmm's input
    downs += [(d.args[1], d.args[2]) for d in graph.find_nodes(op="call_function", target=aten.addmm.default)]
    found = []
    for h, w in downs:
        match = match_glue(h) if transposed_weight(w) else None
        if match is None:
            continue
        gate, up = match.kwargs["gate"], match.kwargs["up"]
        x = gate.args[0] if isinstance(gate, torch.fx.Node) and gate.args else None
        x_val = val(x)
        if (product_of(gate, x) and product_of(up, x) and isinstance(x_val, torch.Tensor) and x_val.dim() == 2
                and small_m(x_val.shape[0], options.small_m_limit)):
            found.append((x, gate, up))
    return found


def facts(graph: torch.fx.Graph, options) -> dict:
    """Read before any rewrite: the small-M shared experts' chains whose input is a router top-k's input that a
    latent down-projection reads too (a product of a weight besides the router's and the chain's)."""
    from k3compile.patterns.route_beside import router_inputs
    from k3compile.patterns.skinny_gemm import transposed_weight

    inputs, n = router_inputs(graph), 0
    for x, gate, up in small_m_shared_mm_chains(graph, options):
        n += x in inputs and any(u not in (inputs[x], gate, up) and u.target is aten.mm.default and u.args[0] is x
                                 and transposed_weight(u.args[1]) for u in x.users)
    return {FACT: n}


def expected(summary: dict) -> bool:
    """A model with MoE layers, on a graph holding routed experts and a shared chain beside them."""
    return (summary.get("moe_layers", 0) > 0 and summary.get(FACT, 0) > 0
            and summary.get("graph_moe_experts_candidates", 0) > 0)
