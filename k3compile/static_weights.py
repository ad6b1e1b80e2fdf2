"""Prove in the post-grad graph that a k3 GEMM's weight is static, so its kernel may stream it before
the PDL wait (``static_weight=True`` on ``k3::skinny_gemm`` / ``k3::latent_moe_tail``, and the flags of each of
``k3::route_beside``'s two products and ``k3::experts_beside``'s three).

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

``k3::route_beside`` queues its routing kernel on a second stream, after a full wait on the current stream (its
router product's output) and before the current stream's own wait on it: every kernel after the op starts after the
routing has completed, so the argument above, about one stream, holds for both streams. ``k3::experts_beside`` is
the same with the routed experts on the side stream; its shared chain runs on the current stream, gate and up
products of ``x``, the SiTU-GLU kernel (W: it waits before it loads), then the down product, whose activation that
kernel made inside the op, after ``x``'s producer: proving ``x`` proves it too (the latent tail's inner GEMM is
proven through ``latent`` alike). ``k3::products_beside``: small products of ``x`` (and products of their outputs,
made inside the op after ``x``) on the side stream, its large ones on the current one; weights and flags are lists.

Assumptions left: (P); a vendor kernel in the graph (cuBLAS, NCCL, fla) launched with PDL that triggers
before its own wait would not be (W), against step 2 (a); none does by default. Whether Inductor's PDL
codegen is on is read from Inductor's config as the graph compiles (``optimize(inductor_pdl=True)`` turns it on
for its own compiles). ``tests/compiler/test_static_weight.py`` checks Inductor's PDL codegen: the
wait before ``launch_dependents`` in every kernel that loads, no ``launch_dependents`` in one that does not.

Compile regions (``k3compile/regions.py``): a region body's graph is rewritten, and proven, before the graph that
calls it, and there its GEMMs' activations (and weights) are body inputs. The caller's proof then proves the body
again at its call sites (``invoke_subgraph(body, name, *operands)``, body input i = operand i): a body input passes
step 2 (a) where at every call of the body the operand does, in the caller's graph (its kernel is launched before
the call, hence before C), and step 2 (b) where at every call the operand is a parameter or input that no node of the
caller writes; a caller's weight taken by ``invoke_subgraph`` passes where the body writes that input nowhere. The
kernels between Q and C then belong to the caller's run or the body's, as in step 1.

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

from .graph_values import (auto_functionalized_k3_op, is_view, mentions, op_name, region_call, schema_arg, set_schema_arg, value_root,
                           written_args)
from .inductor_pdl import on as inductor_pdl_on, read_from_memory

KEYWORD = "static_weight"
TRIGGER_FIRST = "trigger_first"   # the skinny GEMMs' (step 1)
# op name -> its GEMMs: (activation argument, weight argument, flag, trigger-first flag or None) each
STATIC_OPS: dict[str, tuple[tuple[str, str, str, Optional[str]], ...]] = {
    "skinny_gemm": (("a", "w", KEYWORD, TRIGGER_FIRST),),
    "latent_moe_tail": (("latent", "up_weight", KEYWORD, None),),
    # both products on the current stream, the router's first; the routing between them runs on a side stream
    "route_beside": (("a", "router_w", "router_static_weight", "router_trigger_first"),
                     ("a", "w", KEYWORD, TRIGGER_FIRST)),
    # the shared chain on the current stream, the routed experts on a side stream; the down product's input is the
    # op's own SiTU-GLU kernel's output, made from x's products after x: proven through x (module doc)
    "experts_beside": (("x", "w_gate", "gate_static_weight", "gate_trigger_first"),
                       ("x", "w_up", "up_static_weight", "up_trigger_first"),
                       ("x", "w_down", "down_static_weight", "down_trigger_first")),
    # lists of weights, a flag each (module doc)
    "products_beside": (("x", "w_main", "main_static_weight", "main_trigger_first"),
                        ("x", "w_side", "side_static_weight", None),
                        ("x", "w_chain", "chain_static_weight", None)),
}
ENV = "K3_STATIC_WEIGHT"


def enabled() -> bool:
    """Whether the proof runs (``K3_STATIC_WEIGHT=0`` turns it off)."""
    return os.environ.get(ENV, "1") != "0"


_KERNEL_NAMESPACES = {"aten", "prims", "k3"}
_COLLECTIVE_NAMESPACES = {"_c10d_functional", "c10d_functional"}


def _k3_op(node: Node) -> Optional[str]:
    """``skinny_gemm`` / ``latent_moe_tail`` for a node calling one of them, else None."""
    t = node.target
    if node.op != "call_function" or not isinstance(t, torch._ops.OpOverload) or t.namespace != "k3":
        return None
    name = t._schema.name.split("::")[-1]
    return name if name in STATIC_OPS else None


def _region_call(node: Node) -> Optional[tuple]:
    """``graph_values.region_call``'s ``(body, operands)``, nothing proven through a written operand (None) or one
    whose value differs from the body input it is bound to."""
    call = region_call(node)
    if call is None:
        return None
    body, operands = call
    inputs = body.graph.find_nodes(op="placeholder")
    for i, operand in enumerate(operands):
        if isinstance(operand, Node) and not (i < len(inputs) and _same_value_type(operand, inputs[i])):
            operands[i] = None
    return body, operands


def _same_value_type(a: Node, b: Node) -> bool:
    va, vb = a.meta.get("val"), b.meta.get("val")
    return (isinstance(va, torch.Tensor) and isinstance(vb, torch.Tensor) and va.dtype == vb.dtype
            and va.shape == vb.shape)


def _region_calls(graph: torch.fx.Graph) -> dict:
    """{region body GraphModule: [(call node, operands)] in ``graph``} (module doc, compile regions)."""
    out: dict = {}
    for node in graph.nodes:
        call = _region_call(node)
        if call is not None:
            out.setdefault(call[0], []).append((node, call[1]))
    return out


class _Prover:
    """Proofs for the k3 nodes of one graph (one instance per graph: it caches what it walks). ``sites``: for a
    region body, its caller's prover and the calls ``[(call node, operands)]`` (module doc, compile regions)."""

    def __init__(self, graph: torch.fx.Graph, sites: Optional[tuple] = None):
        self.graph = graph
        self.sites = sites
        self._from_input: Optional[set] = None
        self._from_memory: Optional[set] = None

    def at_call_sites(self, placeholder: Node, check: str) -> Optional[str]:
        """None when, at every call of this body, the operand bound to ``placeholder`` passes the caller's
        ``check`` ("activation_reason" / "weight_reason"); else why not (no sites: not proven)."""
        if self.sites is None:
            return "no call site to prove it at"
        caller, calls = self.sites
        index = self.graph.find_nodes(op="placeholder").index(placeholder)
        for _, operands in calls:
            if index >= len(operands) or operands[index] is None:
                return "a call of its region binds it to no operand, or to one the region writes"
            why = getattr(caller, check)(operands[index])
            if why is not None:
                return f"at a call of its region: {why}"
        return None

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
        root, steps = value_root(act)
        of = "a view or copy of " if steps else ""
        if root.op == "placeholder":
            if self.sites is not None:   # a region body's input: the operand at each of its calls
                return self.at_call_sites(root, "activation_reason")
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
            if auto_functionalized_k3_op(root) is not None:
                return None
            return f"activation comes from higher-order op {op_name(t)}"
        if not isinstance(t, torch._ops.OpOverload):
            return f"activation comes from {op_name(t)}, not an ATen/k3 op"
        if t.namespace in _COLLECTIVE_NAMESPACES:
            # a collective may run on its own stream: ask that its input be made by a kernel of this graph
            if depth > 8:
                return "activation comes from a chain of collectives too deep to follow"
            inputs = [a for a in root.args if isinstance(a, Node)]
            if not inputs:
                return f"activation comes from {op_name(t)} without a tensor input"
            return self.activation_reason(inputs[0], depth + 1)
        if t.namespace not in _KERNEL_NAMESPACES:
            return f"activation comes from {op_name(t)}, which may launch no kernel"
        if t.namespace != "k3" and not self.depends_on_input(root):
            return f"activation comes from {op_name(t)} of constants only (may be folded)"
        if inductor_pdl_on() and not self.read_from_memory(root):
            return (f"activation comes from {op_name(t)}, whose value is read from no graph input or k3 op (a fill, "
                    "or computed only from fills): under Inductor's PDL codegen its kernel may trigger without "
                    "waiting")
        return None

    def weight_reason(self, w: Any) -> Optional[str]:
        """None when ``w`` is a parameter/input that no node of this graph writes."""
        if not isinstance(w, Node):
            return "weight is not a graph value"
        # only certain views: a copy of the weight would be a buffer some kernel of this graph writes
        root, _ = value_root(w, surely=True)
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
                    if is_view(user):
                        if user not in aliases:
                            aliases.add(user)
                            todo.append(user)
                        continue
                    return "weight is indexed by getitem"
                if not isinstance(t, torch._ops.OpOverload):
                    why = self.region_writes(user, aliases)
                    if why is None:
                        continue
                    return why

                written = written_args(user)
                if any(mentions(v, aliases) for v in written):
                    return f"weight (or a view of it) is written in the graph by {op_name(t)}"
                if is_view(user) and user not in aliases:
                    aliases.add(user)
                    todo.append(user)
        if root.op == "placeholder" and self.sites is not None:   # a region body's input: its operands
            return self.at_call_sites(root, "weight_reason")
        return None

    def region_writes(self, call: Node, aliases: set) -> Optional[str]:
        """None when ``call`` is a call of a region body that writes none of the inputs bound to ``aliases``, else
        why the weight is not proven."""
        region = _region_call(call)
        if region is None:
            return f"weight is taken by {op_name(call.target)} (higher-order or unknown op)"
        if mentions(call.kwargs.get("_all_bases", []), aliases):
            return "weight (or a view of it) is written by a region"
        body, operands = region
        inputs = body.graph.find_nodes(op="placeholder")
        inner = _Prover(body.graph)
        for i, operand in enumerate(operands):
            if operand in aliases and i < len(inputs):
                why = inner.weight_reason(inputs[i])
                if why is not None:
                    return f"weight is passed to a region whose body does not prove it: {why}"
        return None

    def prove(self, node: Node, act_name: str, w_name: str, index: Optional[int] = None) -> Optional[str]:
        """None when ``node``'s weight ``w_name`` (its element ``index`` for a list of weights) may be streamed
        before its PDL wait, else the reason."""
        if not enabled():
            return f"turned off ({ENV}=0)"
        w = schema_arg(node, w_name)
        if index is not None:
            w = w[index]
        return self.weight_reason(w) or self.activation_reason(schema_arg(node, act_name))


def mark_static_weights(graph: torch.fx.Graph, bodies: Optional[dict] = None) -> dict:
    """Set ``static_weight=True`` on every k3 GEMM node whose weight is proven static (and, under Inductor's PDL
    codegen, ``trigger_first=False`` on the skinny GEMMs among them: step 1), then prove the region bodies ``graph``
    calls again at its call sites (module doc, compile regions), their results into ``bodies`` (``{id of the
    body's graph: (graph, result)}``) where given.

    Returns ``{op: {"proven": n, "not proven": {reason: count}}}`` for the ops present (the compile
    record). Never raises: a failed analysis counts as not proven, with the error as its reason.
    """
    prover = _Prover(graph)
    result = _mark(graph, prover)
    try:
        calls = _region_calls(graph)
    except Exception:   # pragma: no cover - an odd graph costs the bodies' proofs only
        calls = {}
    for body, sites in calls.items():
        body_result = _mark(body.graph, _Prover(body.graph, (prover, sites)))
        if bodies is not None:
            bodies[id(body.graph)] = (body.graph, body_result)
    return result


def _mark(graph: torch.fx.Graph, prover: _Prover) -> dict:
    result: dict = {}
    for node in list(graph.nodes):
        op = _k3_op(node)
        if op is None:
            continue
        entry = result.setdefault(op, {"proven": 0, "not proven": {}})
        for act_name, w_name, flag, trigger in STATIC_OPS[op]:
            weights = schema_arg(node, w_name)
            if isinstance(weights, (list, tuple)):   # a list of weights: a list of flags, one a weight
                reasons = _mark_list(node, prover, act_name, w_name, flag, trigger, len(weights))
            else:
                reasons = [_mark_one(node, prover, act_name, w_name, flag, trigger)]
            for reason in reasons:
                if reason is None:
                    entry["proven"] += 1
                else:
                    entry["not proven"][reason] = entry["not proven"].get(reason, 0) + 1
    return result


def _proof(prover: _Prover, node: Node, act_name: str, w_name: str, index: Optional[int] = None) -> Optional[str]:
    try:
        return prover.prove(node, act_name, w_name, index)
    except Exception as e:  # an odd graph must cost speed only, never the compile
        return f"analysis failed ({type(e).__name__}: {e})"


def _mark_list(node: Node, prover: _Prover, act_name: str, w_name: str, flag: str, trigger: Optional[str],
               n: int) -> list:
    """``_mark_one`` for each of the ``n`` weights of list argument ``w_name``, the flags list arguments."""
    reasons = [_proof(prover, node, act_name, w_name, i) for i in range(n)]
    try:
        set_schema_arg(node, flag, [r is None for r in reasons])
        if trigger is not None:
            set_schema_arg(node, trigger, [not inductor_pdl_on()] * n)   # step 1: no (T) under Inductor's PDL
    except Exception as e:
        reasons = [f"could not set {flag} ({type(e).__name__}: {e})"] * n
    return reasons


def _mark_one(node: Node, prover: _Prover, act_name: str, w_name: str, flag: str, trigger: Optional[str]
              ) -> Optional[str]:
    """Prove one GEMM of ``node`` and set its flags; None where proven, else why not."""
    reason = _proof(prover, node, act_name, w_name)
    try:
        if reason is None:
            set_schema_arg(node, flag, True)
            trigger_first = not inductor_pdl_on()   # step 1: no (T) under Inductor's PDL codegen
            if trigger is not None and schema_arg(node, trigger, True) is not trigger_first:
                set_schema_arg(node, trigger, trigger_first)
        elif schema_arg(node, flag, False) is not False:
            set_schema_arg(node, flag, False)   # a flag that came with the graph is not a proof
    except Exception as e:
        reason = f"could not set {flag} ({type(e).__name__}: {e})"
    return reason
