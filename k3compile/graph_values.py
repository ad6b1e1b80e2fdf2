"""Walking values back through an FX graph as Inductor will lower it: which nodes are views (or may become one),
which arguments an op writes, schema arguments by name, which region body a node calls with which operands. The
static-weight proof (``static_weights.py``) reads a GEMM's activation and weight with these.
"""
from __future__ import annotations

import operator
from typing import Any, Optional

import torch
from torch.fx import Node

# ops that may leave no kernel behind (Inductor turns them into aliases or removes them): walked
# through like views; and ops that are views in Inductor though their schema says otherwise
_MAY_VANISH = {"aten.clone", "aten._to_copy", "aten.alias", "aten.detach", "aten.lift_fresh_copy",
               "aten.copy", "aten.contiguous", "aten.expand", "aten.expand_copy", "aten.alias_copy"}
_VIEW_EXTRA = {"aten._unsafe_view", "aten._reshape_alias"}
_MAY_COPY = {"aten.reshape"}   # a view where the strides allow, else a copy



def op_packet(target) -> str:
    # "aten.clone" for aten.clone.default
    return f"{target.namespace}.{target._schema.name.split('::')[-1]}"


def op_name(target) -> str:
    return str(target) if isinstance(target, torch._ops.OpOverload) else getattr(target, "__name__", str(target))


def schema_arg(node: Node, name: str, default: Any = None) -> Any:
    """The value bound to schema argument ``name`` (positional or keyword)."""
    for i, a in enumerate(node.target._schema.arguments):
        if a.name == name:
            if i < len(node.args):
                return node.args[i]
            return node.kwargs.get(name, default)
    raise KeyError(name)


def auto_functionalized_k3_op(node: Node) -> Optional[torch._ops.OpOverload]:
    """The k3 op an ``auto_functionalized`` call (v1 or v2: how a graph calls an op that writes an input, until
    Inductor unwraps it after our pass) wraps; None for any other node."""
    t = node.target
    if node.op != "call_function" or not isinstance(t, torch._ops.HigherOrderOperator) or not node.args:
        return None
    wrapped = node.args[0]
    if (t.__name__.startswith("auto_functionalized") and isinstance(wrapped, torch._ops.OpOverload)
            and wrapped.namespace == "k3"):
        return wrapped
    return None


def bound_args(node: Node) -> dict:
    """Every schema argument of ``node``'s call by name: positional, keyword, or the schema's default."""
    return bind_schema(node.target._schema, node.args, node.kwargs)


def bind_schema(schema, args: tuple, kwargs: dict) -> dict:
    """Every argument of ``schema`` by name, from ``args`` (positional), ``kwargs``, or the schema's default."""
    out = {}
    for i, arg in enumerate(schema.arguments):
        if i < len(args):
            out[arg.name] = args[i]
        elif arg.name in kwargs:
            out[arg.name] = kwargs[arg.name]
        elif arg.has_default_value():
            out[arg.name] = arg.default_value
        else:
            raise ValueError(f"argument {arg.name!r} is missing")
    return out


def tensor_bytes(node: Any) -> int:
    """Bytes of the tensor an FX node's value is (0 for anything else)."""
    v = node.meta.get("val") if isinstance(node, Node) else None
    return v.numel() * v.element_size() if isinstance(v, torch.Tensor) else 0


def set_schema_arg(node: Node, name: str, value: Any) -> None:
    for i, a in enumerate(node.target._schema.arguments):
        if a.name == name:
            if i < len(node.args):
                node.update_arg(i, value)
            else:
                node.update_kwarg(name, value)
            return
    raise KeyError(name)


def returns_alias(t: torch._ops.OpOverload) -> bool:
    return any(r.alias_info is not None for r in t._schema.returns)


def is_view(node: Node, surely: bool = False) -> bool:
    """The node's output may alias an input: a view op (or its ``*_copy`` form, which Inductor may lower
    to a view), an in-place op's return, or getitem of a multi-output view. ``surely``: only ops whose
    output always aliases (not ``reshape`` or a ``*_copy``, which may copy)."""
    if node.op != "call_function":
        return False
    t = node.target
    if t is operator.getitem:
        src = node.args[0]
        return isinstance(src, Node) and is_view(src, surely)
    if not isinstance(t, torch._ops.OpOverload):
        return False
    if surely and op_packet(t) in _MAY_COPY:
        return False
    if op_packet(t) in _VIEW_EXTRA or returns_alias(t):
        return True
    if surely:
        return False
    name = t._schema.name.split("::")[-1]
    if name.endswith("_copy"):  # view_copy, permute_copy, ...: functional forms of views
        base = getattr(getattr(torch.ops, t.namespace), name[:-len("_copy")], None)
        overload = getattr(base, t._overloadname, None) if base is not None else None
        return isinstance(overload, torch._ops.OpOverload) and returns_alias(overload)
    return False


def may_vanish(node: Node) -> Optional[Node]:
    """For an op Inductor may turn into an alias of its input (or drop), that input; else None."""
    t = node.target
    if not isinstance(t, torch._ops.OpOverload):
        return None
    if op_packet(t) in _MAY_VANISH:
        src = node.args[1] if op_packet(t) == "aten.copy" else node.args[0]
        return src if isinstance(src, Node) else None
    try:
        from torch._inductor.fx_passes.post_grad import noop_registry, same_meta
    except ImportError:  # pragma: no cover - other torch versions
        return None
    if t not in noop_registry:
        return None
    _, src_index = noop_registry[t]
    try:
        src = node.args[src_index] if isinstance(src_index, int) else src_index(node.args)
    except Exception:
        return None
    # a registered no-op whose output differs from its source (dtype, shape, strides) does real work
    return src if isinstance(src, Node) and same_meta(node, src) else None


def view_source(node: Node, surely: bool) -> Optional[Node]:
    """The input ``node``'s value is (with ``surely``: certainly) an alias of, or, without ``surely``,
    may be an alias of because Inductor may drop the op; None when ``node`` computes its value."""
    if node.op != "call_function":
        return None
    if is_view(node, surely):
        if node.target is operator.getitem:
            return view_source(node.args[0], surely)
        return next((a for a in node.args if isinstance(a, Node)), None)
    return None if surely else may_vanish(node)


def value_root(node: Any, surely: bool = False) -> tuple[Any, int]:
    """Walk back through views (``surely``: only certain ones; else also ops that may vanish):
    (root, number of steps walked)."""
    steps = 0
    while isinstance(node, Node):
        src = view_source(node, surely)
        if src is None:
            break
        node, steps = src, steps + 1
    return node, steps


def written_args(node: Node) -> list:
    """Values bound to the schema arguments ``node`` writes (``Tensor(a!)``)."""
    out = []
    for i, a in enumerate(node.target._schema.arguments):
        if a.alias_info is not None and a.alias_info.is_write:
            if i < len(node.args):
                out.append(node.args[i])
            elif a.name in node.kwargs:
                out.append(node.kwargs[a.name])
    return out


def mentions(value: Any, nodes: set) -> bool:
    found = []
    torch.fx.node.map_arg(value, lambda n: found.append(n in nodes))
    return any(found)


def invoke_subgraph_op():
    """The higher-order op a compile region's call becomes (None in a torch without it)."""
    return getattr(torch.ops.higher_order, "invoke_subgraph", None)


def region_call(node: torch.fx.Node) -> Optional[tuple]:
    """``(body GraphModule, operands)`` where ``node`` calls a region body (operand i: the body's input i): as
    ``invoke_subgraph(body, name, *operands)``, or, for a body that writes its inputs, ``auto_functionalized_v2(
    invoke_subgraph, subgraph=body, arg0=..., ...)``, whose written operands (through ``_all_bases``) are None."""
    op, owner = invoke_subgraph_op(), node.graph.owning_module
    if op is None or owner is None or node.op != "call_function":
        return None
    if node.target is op:
        body, operands = node.args[0], list(node.args[2:])
    elif node.args and node.args[0] is op and "auto_functionalized" in str(node.target):
        last = max([int(k[3:]) for k in node.kwargs if k.startswith("arg") and k[3:].isdigit()]   # unwritten ones
                   + [int(k[4:-11]) for k in node.kwargs if k.startswith("_arg") and k.endswith("_base_index")],
                   default=-1)
        body, operands = node.kwargs.get("subgraph"), [node.kwargs.get(f"arg{i}") for i in range(last + 1)]
    else:
        return None
    body = getattr(owner, body.target, None) if isinstance(body, torch.fx.Node) and body.op == "get_attr" else None
    return (body, operands) if isinstance(body, torch.fx.GraphModule) else None
