"""Prove in the post-grad graph that a k3 GEMM's weight is static, so its kernel may stream it before
the PDL wait (``static_weight=True`` on ``k3::skinny_gemm`` / ``k3::latent_moe_tail``).

Our CuTe and Triton GEMMs are launched with programmatic dependent launch (PDL): kernel C may start once
the kernel before it in the stream triggers (``griddepcontrol.launch_dependents`` in each of its blocks, or
its blocks exiting). C must then ``griddepcontrol.wait`` before reading anything an earlier kernel may write.
With ``static_weight`` C issues its first weight loads before that wait. Why that is safe:

1. A kernel of our streams is one of three kinds. (W) It triggers only after its own wait: every k3 kernel
   but (T); every Inductor kernel that loads from memory (its PDL codegen writes the wait no later than just
   after the first load, ``launch_dependents`` after it; Inductor's templates launch without PDL); any kernel
   launched without PDL (it starts once everything before it has completed). (T) A k3 GEMM called with
   ``static_weight`` whose configuration has ``trigger_first``: it triggers as its blocks start, so that
   several products' weights stream at once; never under Inductor's own PDL codegen, whose kernels wait only
   before loading their stream predecessor's outputs and so read, before their wait, what the kernel two back
   wrote, which is safe only behind a predecessor that triggered after its own wait: the proof then sets
   ``trigger_first=False`` on the ``k3::skinny_gemm`` calls it marks (the latent tail's inner GEMM triggers
   first only behind the op's own norm kernel, whose one output only that GEMM reads). (F) Only under
   Inductor's own PDL codegen (``triton.enable_pdl``): an Inductor kernel that loads nothing (a fill, an
   ``arange``) may never wait, and triggers by exiting.
   We rely on (P): a wait returns once every earlier kernel of the stream has completed, not only the one
   right before it (PTX ISA: "wait until all prerequisite grids in flight have completed"; it follows if a
   kernel that never waits does not complete before the kernel before it); ``tests/compiler/test_pdl_ordering.py``
   checks it on a GPU. Inductor's PDL codegen would need more, and does not get it on an H200 (the same file):
   after an (F) kernel the next one reads, before its wait, what the kernel before the (F) may still be writing,
   a race of Inductor's own kernels, outside what this proof covers (``inductor_pdl``: off by default).
   So when C starts, the last (W) kernel Q before C has passed its wait: every kernel before Q has completed
   and its writes are visible; only Q and the (T) and (F) kernels after it may still run.
2. (a) C's activation (skinny_gemm ``a``, the tail's ``latent``), walked back through views and through
   ops Inductor may drop or turn into aliases (clone, ``_to_copy``, its registered no-ops), comes from a
   node of this graph that launches a kernel (an ATen/prims compute op, a k3 op, a collective whose own
   input does), launched before C in the same graph run. Without Inductor's PDL codegen every Inductor
   kernel is (W): that kernel is (W), or a (T) GEMM whose own activation passed this test. Under
   that codegen the activation must also be read from memory: through ops that read their inputs' values,
   from a graph input or a k3 op's output. The kernel that reads the graph input loads it (W); a k3 op's
   kernels are (W) or (T) as above. Either way a (W) kernel of this graph runs before C, so Q is a kernel of
   this graph and so is everything from Q to C: not the user's optimizer step, ``load_state_dict`` or
   another graph. Refused under that codegen: a value made without reading memory, by a factory (``full``,
   ``arange``/``iota``, ``scalar_tensor``, ``empty``, random), a ``*_like`` / ``new_*`` fill,
   ``fill``/``zero``, or an op whose inputs are only such values or are statically empty (Inductor fuses
   them into one kernel that loads nothing).
   (b) The weight, walked back through views that never copy, is a placeholder or ``get_attr``,
   and no node of this graph writes it or any view of it: no schema argument marked written
   (``Tensor(a!)``: in-place ops, ``copy_`` into an input), no higher-order or unknown op taking it.
   Then none of the kernels that may still run writes the weight. Residual, shared, bias and the norm
   weight are read after the wait.

The graph is functional at our pass time (input mutations are ``copy_`` into placeholders, mutating
custom ops are ``auto_functionalized``), and Inductor's later passes add no writes to graph inputs.
The proof runs last, after a chained user pass too. At run time the ops pass the flag on only for a
non-empty activation (an empty one may have been made by no kernel at all).

Assumptions left: (P); a vendor kernel in the graph (cuBLAS, NCCL, fla) launched with PDL that triggers
before its own wait would not be (W), against step 2 (a); none does by default. Whether Inductor's PDL
codegen is on is read from Inductor's config as the graph compiles (``optimize(inductor_pdl=True)`` turns it on
for its own compiles). ``tests/compiler/test_static_weight.py`` checks Inductor's PDL codegen: the
wait before ``launch_dependents`` in every kernel that loads, no ``launch_dependents`` in one that does not.

``mark_static_weights(graph)`` runs after every pattern pass (``passes.K3PostGradPass``); it never
raises: whatever it cannot analyse is "not proven", with the reason recorded for ``k3compile.report``.
``K3_STATIC_WEIGHT=0`` in the environment turns it off (A/B timing, or a suspected race); the pass's
uuid includes the setting, so cached graphs follow it.
"""
from __future__ import annotations

import operator
import os
from typing import Any, Optional

import torch
from torch.fx import Node

from .inductor_pdl import on as inductor_pdl_on, read_from_memory

# op name -> (activation argument, weight argument)
STATIC_OPS: dict[str, tuple[str, str]] = {
    "skinny_gemm": ("a", "w"),
    "latent_moe_tail": ("latent", "up_weight"),
}
KEYWORD = "static_weight"
TRIGGER_FIRST = "trigger_first"   # k3::skinny_gemm only (step 1)
ENV = "K3_STATIC_WEIGHT"


def enabled() -> bool:
    """Whether the proof runs (``K3_STATIC_WEIGHT=0`` turns it off)."""
    return os.environ.get(ENV, "1") != "0"


# ops that may leave no kernel behind (Inductor turns them into aliases or removes them): walked
# through like views; and ops that are views in Inductor though their schema says otherwise
_MAY_VANISH = {"aten.clone", "aten._to_copy", "aten.alias", "aten.detach", "aten.lift_fresh_copy",
               "aten.copy", "aten.contiguous", "aten.expand", "aten.expand_copy", "aten.alias_copy"}
_VIEW_EXTRA = {"aten._unsafe_view", "aten._reshape_alias"}
_MAY_COPY = {"aten.reshape"}   # a view where the strides allow, else a copy
_KERNEL_NAMESPACES = {"aten", "prims", "k3"}
_COLLECTIVE_NAMESPACES = {"_c10d_functional", "c10d_functional"}


def _k3_op(node: Node) -> Optional[str]:
    """``skinny_gemm`` / ``latent_moe_tail`` for a node calling one of them, else None."""
    t = node.target
    if node.op != "call_function" or not isinstance(t, torch._ops.OpOverload) or t.namespace != "k3":
        return None
    name = t._schema.name.split("::")[-1]
    return name if name in STATIC_OPS else None


def _packet(target) -> str:
    # "aten.clone" for aten.clone.default
    return f"{target.namespace}.{target._schema.name.split('::')[-1]}"


def _name(target) -> str:
    return str(target) if isinstance(target, torch._ops.OpOverload) else getattr(target, "__name__", str(target))


def _arg(node: Node, name: str, default: Any = None) -> Any:
    """The value bound to schema argument ``name`` (positional or keyword)."""
    for i, a in enumerate(node.target._schema.arguments):
        if a.name == name:
            if i < len(node.args):
                return node.args[i]
            return node.kwargs.get(name, default)
    raise KeyError(name)


def _set_arg(node: Node, name: str, value: Any) -> None:
    for i, a in enumerate(node.target._schema.arguments):
        if a.name == name:
            if i < len(node.args):
                node.update_arg(i, value)
            else:
                node.update_kwarg(name, value)
            return
    raise KeyError(name)


def _returns_alias(t: torch._ops.OpOverload) -> bool:
    return any(r.alias_info is not None for r in t._schema.returns)


def _is_view(node: Node, surely: bool = False) -> bool:
    """The node's output may alias an input: a view op (or its ``*_copy`` form, which Inductor may lower
    to a view), an in-place op's return, or getitem of a multi-output view. ``surely``: only ops whose
    output always aliases (not ``reshape`` or a ``*_copy``, which may copy)."""
    if node.op != "call_function":
        return False
    t = node.target
    if t is operator.getitem:
        src = node.args[0]
        return isinstance(src, Node) and _is_view(src, surely)
    if not isinstance(t, torch._ops.OpOverload):
        return False
    if surely and _packet(t) in _MAY_COPY:
        return False
    if _packet(t) in _VIEW_EXTRA or _returns_alias(t):
        return True
    if surely:
        return False
    name = t._schema.name.split("::")[-1]
    if name.endswith("_copy"):  # view_copy, permute_copy, ...: functional forms of views
        base = getattr(getattr(torch.ops, t.namespace), name[:-len("_copy")], None)
        overload = getattr(base, t._overloadname, None) if base is not None else None
        return isinstance(overload, torch._ops.OpOverload) and _returns_alias(overload)
    return False


def _may_vanish(node: Node) -> Optional[Node]:
    """For an op Inductor may turn into an alias of its input (or drop), that input; else None."""
    t = node.target
    if not isinstance(t, torch._ops.OpOverload):
        return None
    if _packet(t) in _MAY_VANISH:
        src = node.args[1] if _packet(t) == "aten.copy" else node.args[0]
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


def _source(node: Node, surely: bool) -> Optional[Node]:
    """The input ``node``'s value is (with ``surely``: certainly) an alias of, or, without ``surely``,
    may be an alias of because Inductor may drop the op; None when ``node`` computes its value."""
    if node.op != "call_function":
        return None
    if _is_view(node, surely):
        if node.target is operator.getitem:
            return _source(node.args[0], surely)
        return next((a for a in node.args if isinstance(a, Node)), None)
    return None if surely else _may_vanish(node)


def _root(node: Any, surely: bool = False) -> tuple[Any, int]:
    """Walk back through views (``surely``: only certain ones; else also ops that may vanish):
    (root, number of steps walked)."""
    steps = 0
    while isinstance(node, Node):
        src = _source(node, surely)
        if src is None:
            break
        node, steps = src, steps + 1
    return node, steps


class _Prover:
    """Proofs for the k3 nodes of one graph (one instance per graph: it caches what it walks)."""

    def __init__(self, graph: torch.fx.Graph):
        self.graph = graph
        self._from_input: Optional[set] = None
        self._from_memory: Optional[set] = None

    def read_from_memory(self, node: Node) -> bool:
        """Whether ``node``'s value is read from memory (``inductor_pdl.read_from_memory``)."""
        if self._from_memory is None:
            self._from_memory = read_from_memory(self.graph)
        return node in self._from_memory

    def depends_on_input(self, node: Node) -> bool:
        """Whether ``node`` reads, transitively, a placeholder (else Inductor could fold it to a constant)."""
        if self._from_input is None:
            dep = set()
            for n in self.graph.nodes:
                if n.op == "placeholder" or any(i in dep for i in n.all_input_nodes):
                    dep.add(n)
            self._from_input = dep
        return node in self._from_input

    def activation_reason(self, act: Any, depth: int = 0) -> Optional[str]:
        """None when ``act`` comes from a kernel this graph launches before its consumer."""
        if not isinstance(act, Node):
            return "activation is not a graph value"
        root, steps = _root(act)
        of = "a view or copy of " if steps else ""
        if root.op == "placeholder":
            return f"activation is {of}a graph input: the kernel before it may be outside this graph"
        if root.op == "get_attr":
            return f"activation is {of}a constant"
        if root.op != "call_function":
            return f"activation comes from a {root.op} node"
        t = root.target
        if t is operator.getitem:  # one output of a multi-output op
            src = root.args[0]
            if not isinstance(src, Node) or src.op != "call_function":
                return "activation is an item of a non-call node"
            root, t = src, src.target
        if isinstance(t, torch._ops.HigherOrderOperator):
            # auto_functionalized(op, ...): the wrapped custom op runs here; only our own ops are known to launch
            wrapped = root.args[0] if root.args else None
            if (t.__name__.startswith("auto_functionalized") and isinstance(wrapped, torch._ops.OpOverload)
                    and wrapped.namespace == "k3"):
                return None
            return f"activation comes from higher-order op {_name(t)}"
        if not isinstance(t, torch._ops.OpOverload):
            return f"activation comes from {_name(t)}, not an ATen/k3 op"
        if t.namespace in _COLLECTIVE_NAMESPACES:
            # a collective may run on its own stream: ask that its input be made by a kernel of this graph
            if depth > 8:
                return "activation comes from a chain of collectives too deep to follow"
            inputs = [a for a in root.args if isinstance(a, Node)]
            if not inputs:
                return f"activation comes from {_name(t)} without a tensor input"
            return self.activation_reason(inputs[0], depth + 1)
        if t.namespace not in _KERNEL_NAMESPACES:
            return f"activation comes from {_name(t)}, which may launch no kernel"
        if t.namespace != "k3" and not self.depends_on_input(root):
            return f"activation comes from {_name(t)} of constants only (may be folded)"
        if inductor_pdl_on() and not self.read_from_memory(root):
            return (f"activation comes from {_name(t)}, whose value is read from no graph input or k3 op (a fill, "
                    "or computed only from fills): under Inductor's PDL codegen its kernel may trigger without "
                    "waiting")
        return None

    def weight_reason(self, w: Any) -> Optional[str]:
        """None when ``w`` is a parameter/input that no node of this graph writes."""
        if not isinstance(w, Node):
            return "weight is not a graph value"
        # only certain views: a copy of the weight would be a buffer some kernel of this graph writes
        root, _ = _root(w, surely=True)
        if root.op not in ("placeholder", "get_attr"):
            return "weight is computed (or may be copied) in the graph, not a parameter or input"
        # every alias of the root: the root and its views, transitively
        aliases, todo = {root}, [root]
        while todo:
            x = todo.pop()
            for user in x.users:
                if user.op == "output":
                    continue
                if user.op != "call_function":
                    return f"weight is used by a {user.op} node"
                t = user.target
                if t is operator.getitem:
                    if _is_view(user):
                        if user not in aliases:
                            aliases.add(user)
                            todo.append(user)
                        continue
                    return "weight is indexed by getitem"
                if not isinstance(t, torch._ops.OpOverload):
                    return f"weight is taken by {_name(t)} (higher-order or unknown op)"
                written = _written_args(user)
                if any(_mentions(v, aliases) for v in written):
                    return f"weight (or a view of it) is written in the graph by {_name(t)}"
                if _is_view(user) and user not in aliases:
                    aliases.add(user)
                    todo.append(user)
        return None

    def prove(self, node: Node) -> Optional[str]:
        """None when ``node``'s weight may be streamed before its PDL wait, else the reason."""
        op = _k3_op(node)
        act_name, w_name = STATIC_OPS[op]
        if not enabled():
            return f"turned off ({ENV}=0)"
        return self.weight_reason(_arg(node, w_name)) or self.activation_reason(_arg(node, act_name))


def _written_args(node: Node) -> list:
    """Values bound to the schema arguments ``node`` writes (``Tensor(a!)``)."""
    out = []
    for i, a in enumerate(node.target._schema.arguments):
        if a.alias_info is not None and a.alias_info.is_write:
            if i < len(node.args):
                out.append(node.args[i])
            elif a.name in node.kwargs:
                out.append(node.kwargs[a.name])
    return out


def _mentions(value: Any, nodes: set) -> bool:
    found = []
    torch.fx.node.map_arg(value, lambda n: found.append(n in nodes))
    return any(found)


def mark_static_weights(graph: torch.fx.Graph) -> dict:
    """Set ``static_weight=True`` on every k3 GEMM node whose weight is proven static (and, under Inductor's PDL
    codegen, ``trigger_first=False`` on the skinny GEMMs among them: step 1).

    Returns ``{op: {"proven": n, "not proven": {reason: count}}}`` for the ops present (the compile
    record). Never raises: a failed analysis counts as not proven, with the error as its reason.
    """
    result: dict = {}
    prover = _Prover(graph)
    for node in list(graph.nodes):
        op = _k3_op(node)
        if op is None:
            continue
        entry = result.setdefault(op, {"proven": 0, "not proven": {}})
        try:
            reason = prover.prove(node)
        except Exception as e:  # an odd graph must cost speed only, never the compile
            reason = f"analysis failed ({type(e).__name__}: {e})"
        try:
            if reason is None:
                _set_arg(node, KEYWORD, True)
                trigger_first = not inductor_pdl_on()   # step 1: no (T) under Inductor's PDL codegen
                if op == "skinny_gemm" and _arg(node, TRIGGER_FIRST, True) is not trigger_first:
                    _set_arg(node, TRIGGER_FIRST, trigger_first)
            elif _arg(node, KEYWORD, False) is not False:
                _set_arg(node, KEYWORD, False)   # a flag that came with the graph is not a proof
        except Exception as e:
            reason = f"could not set {KEYWORD} ({type(e).__name__}: {e})"
        if reason is None:
            entry["proven"] += 1
        else:
            entry["not proven"][reason] = entry["not proven"].get(reason, 0) + 1
    return result
