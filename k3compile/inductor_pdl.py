"""Inductor's own PDL codegen (``torch._inductor.config.triton.enable_pdl``) in k3compile's compiles.

``optimize(inductor_pdl=True)`` turns it on for that model's compiles (``option``): each Inductor kernel's launch
then hides under the kernel before it, and the k3 kernel after an Inductor kernel may start early. Not by default
(``RACE``): Inductor's kernels load, before their wait, every buffer their stream predecessor did not write, and a
kernel that loads nothing (a fill: no wait, it triggers by exiting) lets the next one in while the kernel before it
still writes; on one H200 such a read saw the old value 64 times in 64 (``tests/compiler/test_pdl_ordering.py``).
Under it the static-weight proof asks more of a GEMM's activation (``static_weights.py``, step 2 (a)): that its
value be read from memory (``read_from_memory``).

``optimize(inductor_pdl="trigger")`` keeps the codegen (each Inductor kernel that loads calls ``gdc_wait``, a no-op
without a PDL launch, then ``gdc_launch_dependents``) but launches Inductor's kernels without PDL
(``launch_pdl`` off in their ``triton_meta``, ``plain_launches``): each starts only once the kernel before it has
completed, as without the codegen, so the race above cannot occur, while its trigger lets a k3 kernel behind it,
launched with PDL, start early and stream its static weight (it waits for the Inductor kernel to complete before it
reads what that wrote). The proof then stands as without the codegen (``on`` is False). The default: the MXFP4
decode step at M 1 took 756.1 µs with it against 765.6 without (``docs/tuning/decode_step.md``; about 18 k3 kernels
a decode step follow an Inductor kernel).
"""
from __future__ import annotations

import logging
import operator
import os
import weakref
from typing import Optional

import torch
from torch.fx import Node

from .backends import is_rocm
from .graph_values import auto_functionalized_k3_op

log = logging.getLogger("k3compile")

ENV = "K3_INDUCTOR_PDL"
OPTION = "triton.enable_pdl"

# ops whose output takes its values from none of their tensor arguments (a fill or random draw of their shape):
# their kernels may load nothing. Ops without a tensor argument (full, arange, iota, scalar_tensor, empty, rand,
# ...) need no entry; fill and the random ops are listed whole, overloads that read a value tensor included.
READS_NO_VALUES = {"aten.full_like", "aten.zeros_like", "aten.ones_like", "aten.empty_like", "aten.rand_like",
                   "aten.randn_like", "aten.randint_like", "aten.new_full", "aten.new_zeros", "aten.new_ones",
                   "aten.new_empty", "aten.new_empty_strided", "aten.fill", "aten.zero", "aten.bernoulli",
                   "aten.uniform", "aten.normal", "aten.exponential", "aten.random", "aten.geometric",
                   "aten.log_normal", "aten.cauchy", "prims.fill", "prims.full_like", "prims.empty_like"}


TRIGGER = "trigger"
# set by our pass while it rewrites a graph of a trigger-only compile (k3compile/passes.py): the proof reads it
_trigger_only = False
# the graphs our pass saw compile with Inductor's kernels launched with PDL (inductor_pdl=True); once
# ``plain_launches`` is installed, every other graph's Triton kernels launch without PDL
_full_pdl_graphs: "weakref.WeakSet[torch.fx.Graph]" = weakref.WeakSet()


def set_trigger_only(flag: bool) -> None:
    global _trigger_only
    _trigger_only = bool(flag)


def on(trigger_only: Optional[bool] = None) -> bool:
    """Whether Inductor's kernels launch with PDL in the graph compiling now: its codegen on in the config as patched
    for this compile, and not the trigger-only form (``trigger_only``, else the setting of the graph our pass is
    rewriting)."""
    trigger = _trigger_only if trigger_only is None else trigger_only
    return bool(getattr(torch._inductor.config.triton, "enable_pdl", False)) and not trigger


def note_graph(graph: torch.fx.Graph, trigger_only: bool) -> None:
    """Our pass, for each graph it rewrites: whether Inductor's kernels of that graph launch with PDL."""
    if on(trigger_only):
        _full_pdl_graphs.add(graph)


RACE = ("an Inductor kernel reads before its wait what the kernel two back wrote, and a fill between them does not "
        "hold it back (tests/compiler/test_pdl_ordering.py)")


def option(choice, inductor_options: dict) -> tuple[str, bool]:
    """Turn the codegen on in ``inductor_options`` (one model's compiles, not the process's config) where
    ``choice`` (``optimize(inductor_pdl=...)``: True, ``TRIGGER`` or False; else ``K3_INDUCTOR_PDL`` "1" /
    "trigger" / "0"; default ``TRIGGER``, never True: ``RACE``) asks, unless the caller's options set it, this
    torch's Inductor lacks it, or this is ROCm (Inductor emits it for CUDA sm_90+ only). Returns the setting in words,
    for the report, and whether Inductor's kernels launch without PDL (``TRIGGER``)."""
    if OPTION in inductor_options:
        return f"{'on' if inductor_options[OPTION] else 'off'} (options={{{OPTION!r}: ...}})", False
    if choice is None:
        env = os.environ.get(ENV, "").lower()
        choice = TRIGGER if env in ("", TRIGGER) else env not in ("0", "false", "no")
    if choice not in (True, False, TRIGGER):
        raise ValueError(f"inductor_pdl={choice!r}: expected True, False, None or {TRIGGER!r}")
    if not choice:
        return (f"as Inductor's config has it (inductor_pdl=True or {ENV}=1 turns it on, at a risk: {RACE}; "
                f"inductor_pdl={TRIGGER!r} lets its kernels trigger only)"), False
    if not hasattr(torch._inductor.config.triton, "enable_pdl"):
        return "off (this torch's Inductor has no PDL codegen)", False
    if is_rocm():
        return "off (ROCm: Inductor's PDL codegen is CUDA's)", False
    if choice == TRIGGER:
        why = plain_launches()
        if why:
            return f"off ({why})", False
        inductor_options[OPTION] = True
        return "its kernels trigger, launched without PDL (inductor_pdl='trigger')", True
    inductor_options[OPTION] = True
    log.warning("k3compile: Inductor's PDL codegen on (inductor_pdl=True): %s", RACE)
    return "on", False


_PLAIN = False


def _graph_compiling() -> Optional[torch.fx.Graph]:
    """The FX graph whose code Inductor is writing (a region body's own, inside a region)."""
    from torch._inductor.virtualized import V

    try:
        return getattr(getattr(V.graph, "module", None), "graph", None)
    except AttributeError:   # no graph being lowered
        return None


def plain_launches() -> Optional[str]:
    """Install, once, the wrapper of Inductor's ``TritonKernel.triton_meta_common`` that turns ``launch_pdl`` off in
    every graph but those our pass saw compile with ``inductor_pdl=True`` (``note_graph``): the trigger-only compiles,
    their region bodies, and any other compile of the process from then on (a launch without PDL is always in
    order). None, or why it cannot here."""
    global _PLAIN
    if _PLAIN:
        return None
    try:
        from torch._inductor.codegen.triton import TritonKernel
    except ImportError as e:   # pragma: no cover
        return f"Inductor's Triton codegen does not import: {e}"
    original = TritonKernel.__dict__.get("triton_meta_common")
    if not isinstance(original, classmethod):
        return "this torch's Inductor sets no launch attributes in triton_meta_common"
    meta_common = original.__func__

    def triton_meta_common(cls):
        meta = meta_common(cls)
        if meta.get("launch_pdl") and _graph_compiling() not in _full_pdl_graphs:
            meta = {**meta, "launch_pdl": False}
        return meta

    TritonKernel.triton_meta_common = classmethod(triton_meta_common)
    _PLAIN = True
    return None


def _packet(target) -> str:
    # "aten.copy" for aten.copy.default, and for the in-place aten.copy_ of a graph not yet functional
    return f"{target.namespace}.{target._schema.name.split('::')[-1].removesuffix('_')}"


def _tensor_val(node: Node) -> Optional[torch.Tensor]:
    val = node.meta.get("val")
    return val if isinstance(val, torch.Tensor) else None


def _value_inputs(node: Node) -> list[Node]:
    """The inputs whose values ``node``'s output is computed from, read from memory by its kernel: its tensor
    inputs, less those it reads only the shape of (``copy``'s destination), those statically empty, and a CPU
    scalar feeding a GPU op (Inductor passes its value as a kernel argument)."""
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    packet = _packet(node.target)
    if packet in READS_NO_VALUES:
        return []
    inputs = node.all_input_nodes
    if packet == "aten.copy":
        inputs = [node.args[1]] if len(node.args) > 1 and isinstance(node.args[1], Node) else []
    out = _tensor_val(node)
    on_cpu = out is not None and out.device.type == "cpu"
    return [a for a in inputs if (val := _tensor_val(a)) is not None and not statically_known_true(val.numel() == 0)
            and (on_cpu or val.device.type != "cpu" or val.dim() > 0)]


def read_from_memory(graph: torch.fx.Graph) -> set:
    """The nodes whose values are read, through ops that read their inputs' values, from a graph input tensor or a
    k3 op's output: some kernel that loads (or a k3 kernel) runs before their consumers. Unknown ops, and
    higher-order ops other than a wrapped k3 op, count as not."""
    found: set = set()
    for n in graph.nodes:
        if n.op == "placeholder":
            yes = _tensor_val(n) is not None
        elif n.op != "call_function":
            yes = False
        elif n.target is operator.getitem:
            yes = isinstance(n.args[0], Node) and n.args[0] in found
        elif isinstance(n.target, torch._ops.HigherOrderOperator):
            yes = auto_functionalized_k3_op(n) is not None
        elif isinstance(n.target, torch._ops.OpOverload):
            yes = n.target.namespace == "k3" or any(a in found for a in _value_inputs(n))
        else:
            yes = False
        if yes:
            found.add(n)
    return found
