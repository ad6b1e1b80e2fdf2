"""Compile regions: the decoder layers' blocks compiled once per distinct block, not once per layer.

``optimize(regions=True)`` marks the blocks of every layer stack (an ``nn.ModuleList`` named ``layers``): each
child of a layer that has children of its own (K3: ``self_attn`` -- KDA or MLA --, ``block_sparse_moe`` or
``mlp``) runs its ``forward`` as a ``torch.compiler.nested_compile_region``. Inductor compiles each distinct body
once (its post-grad passes, ours included, run on every body, ``torch/_inductor/compile_fx.py:
_recursive_post_grad_passes``): the 93-layer K3 compiles four bodies (KDA, MLA, latent MoE, dense MLP) instead of a
graph 93 layers long. Dynamo traces each distinct body once where it can reuse a traced body (a torch whose
``nested_compile_region`` takes ``max_reuse_entries``: 2.13), and only for calls whose inputs are tensors, numbers
and modules: a KDA or MLA block takes its layer's state object, so the region's body gets the state's tensors and
rebuilds the object around them (:func:`_flat_args`); a torch without reuse traces every call (the block's own
``forward`` is the region there). Every argument of a reused region is such a leaf (the flattening's spec as a string,
a mix's sources one by one): a tuple or list among them costs Dynamo a traced ``pytree.tree_flatten`` at every call
(:func:`_spec_text`). A layer's AttnRes mixes (its ``attn_res_mix``, ``model/modeling.py``) are
regions too, one body per number of sources (K3: at most 8, one more every 12 layers): left in the outer graph,
Inductor fused each with its neighbours into kernels that differ with depth and built more of them the deeper the
model. The norms and residual adds between the regions stay in the outer graph, the same at every layer (the layer
itself cannot be the region: its output list aliases its input list, which ``invoke_subgraph`` refuses); the
AttnRes pass folds each mix's norm back into the mix's op there (``patterns/attn_res.py``). What a region boundary
costs at run time: the kernels on either side do not fuse across it (``docs/design.md``, "Compile regions", has the
figures).

Marking swaps the instance's class for a subclass whose ``forward`` (a layer's: ``attn_res_mix``) is the region (one
subclass per class): a region on a bound method (``module.forward = region.__get__(module)``) makes torch 2.13's
Dynamo reuse the first instance's parameters for every later call of the body (wrong results), a class-level region
does not. :func:`unmark` restores the classes. Outside ``torch.compile`` a region is a plain call.

Cost (why ``optimize`` marks only deep models by default, :func:`wanted`): a shallow model compiles slower with them;
their run time measured the whole graph's on the H200 once each mix's norm was folded back (``docs/design.md``,
"Compile regions").
The static-weight proof reaches into the bodies from their calls (``static_weights.py``, "compile regions": the
micro K3's decode step proves 48 of 48 skinny GEMMs as regions, as in the whole graph).

What the passes did in a body counts once per call of it (``graph_records.merge_records`` weights each record by
:func:`calls`), so a report over regions reads as one over the whole graph. :func:`inline` turns a Dynamo graph
with regions back into the whole graph (``optimize``'s fallback where a pass lost matches in the regions).
"""
from __future__ import annotations

import copy
import dataclasses
import functools
import inspect
import logging
import operator
import time
import types
from typing import Any, Callable, Optional

import torch

from .graph_values import invoke_subgraph_op, region_call

REGION_OF = "_k3compile_region_of"     # on a region subclass: the class it wraps
log = logging.getLogger("k3compile")


def available() -> Optional[str]:
    """None where this torch has ``torch.compiler.nested_compile_region``, else why not."""
    if getattr(torch.compiler, "nested_compile_region", None) is None or invoke_subgraph_op() is None:
        return f"torch {torch.__version__} has no torch.compiler.nested_compile_region"
    return None


def _reuse_options() -> dict:
    """``nested_compile_region``'s keywords: where this torch's Dynamo reuses a traced body for later calls (it has
    ``max_reuse_entries``: torch 2.13 does; a torch without it traces every call), a cap on its entries that equal
    blocks never reach and that a guard failing on every call cannot turn into an error (past the cap Dynamo raises
    instead of tracing the call)."""
    params = inspect.signature(torch.compiler.nested_compile_region).parameters
    return {"max_reuse_entries": 1 << 16} if "max_reuse_entries" in params else {}


class _States:
    """The state dataclasses flat block calls carry, as attributes ``t0``, ``t1``, ... (see :func:`_flat_args`).
    Attributes, not a list: Dynamo guards only the attribute a body reads, so a type added later (another model's)
    does not make the graphs compiled before it recompile, as a guarded list's new length would."""
    types: list[type] = []

    @classmethod
    def index(cls, state_type: type) -> int:
        if state_type not in cls.types:
            setattr(cls, f"t{len(cls.types)}", state_type)
            cls.types.append(state_type)
        return cls.types.index(state_type)


def _state_fields(value) -> Optional[tuple[str, ...]]:
    """The field names of a block argument that is a dataclass of tensors (K3: ``KDAState``, ``MLAState``), else
    None."""
    if isinstance(value, type) or not dataclasses.is_dataclass(value):
        return None
    fields = dataclasses.fields(value)
    if not fields or not all(f.init and isinstance(getattr(value, f.name), torch.Tensor) for f in fields):
        return None
    return tuple(f.name for f in fields)


def _flat_args(args: tuple) -> tuple[tuple, list]:
    """(spec, flat): each state dataclass among ``args`` replaced by its tensors. Dynamo reuses a traced body only
    for calls whose inputs are tensors, numbers and modules (``torch/_dynamo/variables/invoke_subgraph.py``: "not
    eligible -- unsupported input VT types"): a block given its layer's state object would be traced anew at every
    call. spec: per argument None (one flat slot) or (its type's index in _States, its field count)."""
    spec, flat = [], []
    for value in args:
        names = _state_fields(value)
        if names is None:
            spec.append(None)
            flat.append(value)
            continue
        spec.append((_States.index(type(value)), len(names)))   # unseen by register_states: a recompile
        flat.extend(getattr(value, n) for n in names)
    return tuple(spec), flat


def register_states(value, depth: int = 5) -> None:
    """Add the state dataclasses found in ``value`` (a call's arguments; K3: ``cache.layers``' states) to
    ``_States`` before Dynamo traces the call: a type first added during a trace changes what the trace guards, and
    the next call would compile the graph again."""
    if _state_fields(value) is not None:
        _States.index(type(value))
        return
    if depth == 0 or isinstance(value, (torch.Tensor, torch.nn.Module, str, bytes, int, float, type)):
        return
    if isinstance(value, dict):
        items = list(value.values())
    elif isinstance(value, (list, tuple)):
        items = list(value)
    elif hasattr(value, "__dict__") and not callable(value):
        items = list(vars(value).values())
    else:
        return
    for item in items:
        register_states(item, depth - 1)


def _spec_text(spec: tuple) -> str:
    """``_flat_args``' spec as one string: a region call whose every argument is a tensor, number, string or module
    takes Dynamo's fast input fingerprint; a tuple among them sends the call through Dynamo's trace of
    ``pytree.tree_flatten``, about 35 ms a call (``torch/_dynamo/variables/invoke_subgraph.py``,
    ``build_input_fingerprint``)."""
    return ";".join("-" if item is None else f"{item[0]}.{item[1]}" for item in spec)


def _body(module, spec: str, *flat, **kwargs):
    """A region's body: the block's own ``forward`` on the arguments ``_flat_args`` flattened (``spec`` as
    ``_spec_text`` spells it), the state objects rebuilt around the same tensors (the blocks update their state in
    place, never rebind a field)."""
    args, i = [], 0
    for item in spec.split(";") if spec else ():
        if item == "-":
            args.append(flat[i])
            i += 1
        else:
            kind, count = (int(v) for v in item.split("."))
            args.append(getattr(_States, f"t{kind}")(*flat[i:i + count]))
            i += count
    return module._k3compile_block_forward(*args, **kwargs)


@functools.cache
def _region_class(cls: type) -> type:
    """``cls`` whose ``forward`` calls its own through a nested compile region (one per class, so equal blocks share
    it; the body's code is copied per class, so each class has its own Dynamo reuse entries). A torch whose Dynamo
    traces every call anyway (no ``max_reuse_entries``) gets the block's own ``forward`` as the region, arguments as
    they are."""
    attrs = {REGION_OF: cls, "__module__": cls.__module__, "__qualname__": cls.__qualname__}
    if not _reuse_options():
        return type(cls.__name__, (cls,), {"forward": torch.compiler.nested_compile_region(cls.forward), **attrs})
    code = _body.__code__.replace(co_name=f"{cls.__name__}_region")
    region = torch.compiler.nested_compile_region(
        types.FunctionType(code, _body.__globals__, code.co_name, _body.__defaults__), **_reuse_options())

    def forward(self, *args, **kwargs):
        spec, flat = _flat_args(args)
        return region(self, _spec_text(spec), *flat, **kwargs)
    return type(cls.__name__, (cls,), {"forward": forward, "_k3compile_block_forward": cls.forward, **attrs})


MIX = "attn_res_mix"   # a layer's AttnRes mix (model/modeling.py: KimiDecoderLayer), a region of its own


_MIXES: list = []   # the mix functions of the layer classes marked, by index (``_mix_body``'s ``which``)


def _mix_body(which: int, n: int, prefix, *rest):
    """A mix region's body: the layer class's own mix on its ``n`` sources, passed flat (see ``_spec_text``)."""
    return _MIXES[which](prefix, list(rest[:n]), *rest[n:])


@functools.cache
def _mix_class(cls: type) -> type:
    """``cls`` (a layer) whose ``attn_res_mix(prefix, blocks, *rest)`` runs as a nested compile region: one body per
    number of sources. Where Dynamo reuses bodies, the sources go in flat (the body's code copied per class, as for
    the blocks)."""
    mix = getattr(cls, MIX)
    if _reuse_options():
        _MIXES.append(mix)
        which = len(_MIXES) - 1
        code = _mix_body.__code__.replace(co_name=f"{cls.__name__}_{MIX}")
        region = torch.compiler.nested_compile_region(
            types.FunctionType(code, _mix_body.__globals__, code.co_name), **_reuse_options())

        def mix(prefix, blocks, *rest):
            return region(which, len(blocks), prefix, *blocks, *rest)
    else:
        mix = torch.compiler.nested_compile_region(mix)
    return type(cls.__name__, (cls,), {MIX: staticmethod(mix), REGION_OF: cls, "__module__": cls.__module__,
                                       "__qualname__": cls.__qualname__})


def _stacks(model: torch.nn.Module):   # (name, module) of each layer stack: an nn.ModuleList named "layers"
    return [(name, stack) for name, stack in model.named_modules()
            if isinstance(stack, torch.nn.ModuleList) and name.rsplit(".", 1)[-1] == "layers"]


def _layers(model: torch.nn.Module):
    for name, stack in _stacks(model):
        yield from ((f"{name}.{i}", layer) for i, layer in enumerate(stack))


def blocks(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """(qualified name, module) of each block :func:`mark` makes a region: the children with children of each
    layer of every ``layers`` ModuleList."""
    found = []
    for name, layer in _layers(model):
        for child_name, child in layer.named_children():
            if next(child.children(), None) is not None:
                found.append((f"{name}.{child_name}", child))
    return found


def mark(model: torch.nn.Module) -> dict[str, int]:
    """Make each of ``blocks(model)`` a compile region, and the AttnRes mixes of their layers; returns {block class
    (a layer's mixes: "<layer class>.attn_res_mix"): how many} marked."""
    marked: dict[str, int] = {}
    for _, block in blocks(model):
        cls = getattr(type(block), REGION_OF, type(block))
        block.__class__ = _region_class(cls)
        marked[cls.__name__] = marked.get(cls.__name__, 0) + 1
    if marked:
        for _, layer in _layers(model):
            cls = getattr(type(layer), REGION_OF, type(layer))
            if callable(getattr(cls, MIX, None)):
                layer.__class__ = _mix_class(cls)
                marked[f"{cls.__name__}.{MIX}"] = marked.get(f"{cls.__name__}.{MIX}", 0) + 1
    return marked


def unmark(model: torch.nn.Module) -> int:
    """Restore every marked block's own class; returns how many."""
    n = 0
    for module in model.modules():
        cls = getattr(type(module), REGION_OF, None)
        if cls is not None:
            module.__class__ = cls
            n += 1
    return n


def calls(graph: torch.fx.Graph) -> dict[int, int]:
    """{id of a region body's graph: how many times ``graph`` calls it} (``graph_values.region_call``)."""
    out: dict[int, int] = {}
    for node in graph.nodes:
        call = region_call(node)
        if call is not None:
            out[id(call[0].graph)] = out.get(id(call[0].graph), 0) + 1
    return out


def has_regions(gm: torch.fx.GraphModule) -> bool:
    op = invoke_subgraph_op()
    return op is not None and bool(gm.graph.find_nodes(op="call_function", target=op))


def inline(gm: torch.fx.GraphModule) -> int:
    """Replace every ``invoke_subgraph`` call of a Dynamo graph by a copy of its body (nested ones too); returns how
    many calls were inlined. The graph then is what Dynamo traces without regions."""
    op = invoke_subgraph_op()
    n = 0
    while op is not None:
        nodes = gm.graph.find_nodes(op="call_function", target=op)
        if not nodes:
            break
        for node in nodes:
            body = getattr(gm, node.args[0].target)
            env = dict(zip(body.graph.find_nodes(op="placeholder"), node.args[2:]))
            for attr in body.graph.find_nodes(op="get_attr"):   # a nested body or a constant of the body
                name = f"{node.args[0].target}_{attr.target}".replace(".", "_")
                value = getattr(body, attr.target)
                if isinstance(value, torch.nn.Module):
                    gm.register_module(name, value)
                else:
                    setattr(gm, name, value)
                with gm.graph.inserting_before(node):
                    env[attr] = gm.graph.get_attr(name)
            with gm.graph.inserting_before(node):
                result = gm.graph.graph_copy(body.graph, env)
            outputs = result if isinstance(result, (tuple, list)) else (result,)
            for user in list(node.users):
                if user.op == "call_function" and user.target is operator.getitem:
                    user.replace_all_uses_with(outputs[user.args[1]])
                    gm.graph.erase_node(user)
            if node.users:
                raise RuntimeError(f"k3compile: {node.name} is used other than by getitem: cannot inline it")
            gm.graph.erase_node(node)
            n += 1
    if n:
        for node in gm.graph.find_nodes(op="get_attr"):
            if not node.users and isinstance(getattr(gm, node.target, None), torch.fx.GraphModule):
                gm.graph.erase_node(node)
        used = {node.target for node in gm.graph.find_nodes(op="get_attr")}
        for name, child in list(gm.named_children()):
            if isinstance(child, torch.fx.GraphModule) and name not in used:
                delattr(gm, name)
        gm.graph.lint()
        gm.recompile()
    return n


FROM_LAYERS = 16   # optimize(regions=None) marks a model with a layer stack at least this deep


def wanted(model, choice: Optional[bool]) -> tuple[bool, str]:
    """``optimize(regions=choice)``: whether to mark the model's blocks, and where not why; None: by depth (the
    figures that set ``FROM_LAYERS``: ``docs/design.md``, "Compile regions")."""
    layers = max((len(stack) for _, stack in _stacks(model)), default=0) if isinstance(model, torch.nn.Module) else 0
    if choice is None and layers < FROM_LAYERS:
        return False, f"{layers} layers, under {FROM_LAYERS}: regions=None marks deeper ones; regions=True forces them"
    return choice is not False, "regions=False"


def mark_model(model, stood_down: Optional[str]) -> str:
    """``optimize(regions=True)``: mark the model's blocks unless the passes stand down on its device
    (``stood_down``: why) or this torch has no regions; says what was marked, or why nothing."""
    why = "not a module" if not isinstance(model, torch.nn.Module) else available()
    if why is None and stood_down:
        why = "the passes stand down on this device (plain torch.compile, without regions)"
    if why is not None:
        return f"off ({why})"
    marked = mark(model)
    if not marked:
        return "off (no layer stack: no nn.ModuleList named 'layers' with blocks)"
    return ", ".join(f"{n} {name}" for name, n in marked.items())


def _dynamo_errors() -> tuple:
    exc = torch._dynamo.exc
    return tuple(getattr(exc, name) for name in ("UncapturedHigherOrderOpError", "Unsupported") if hasattr(exc, name))


def without_regions_on_error(call: Callable, model: torch.nn.Module, state) -> Callable:
    """``call`` (the model's compiled call); where Dynamo cannot trace its regions (a torch whose
    ``invoke_subgraph`` refuses what a block does), the blocks are unmarked, the reason kept in ``state.regions``,
    and the call traced again without them."""
    registered = []

    @functools.wraps(call)
    def traced(*args, **kwargs):
        if not registered:   # the first call (it compiles): the states its blocks will take
            register_states((args, kwargs))
            registered.append(True)
        try:
            return call(*args, **kwargs)
        except _dynamo_errors() as e:
            if not unmark(model):
                raise
            why = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:200]}"
            state.regions = f"off (Dynamo could not trace them: {why})"
            log.warning("k3compile: Dynamo could not trace the compile regions of %s (%s); compiling whole graphs "
                        "instead", state.model_name, why)
            return call(*args, **kwargs)
    return traced


def compile_or_whole(gm: torch.fx.GraphModule, compile_: Callable, missing: Callable, where: str) -> tuple[Any, Any]:
    """``compile_(gm)`` -> (compiled, CompiledGraph) for a Dynamo graph with regions; where that raises (e.g. a
    torch whose Inductor cannot lower a body) or ``missing(record)`` names passes expected on the graph that
    rewrote nothing in the regions ((pass, why expected) pairs), the regions are inlined and the whole graph
    compiled, the reason kept in ``CompiledGraph.regions``."""
    if not has_regions(gm):
        return compile_(gm)
    whole = copy.deepcopy(gm)
    t0 = time.perf_counter()
    try:
        compiled, graph = compile_(gm)
        why = "; ".join(f"pass {name!r} rewrote nothing in the regions although {expected}"
                        for name, expected in (missing(graph.record) if graph.record is not None else []))
    except Exception as e:
        why = f"compiling the regions failed ({type(e).__name__}: {str(e).strip().splitlines()[0][:200]})"
    if not why:
        if graph.record is not None and graph.record.regions:
            graph.regions = f"{graph.record.regions['bodies']} region bodies for {graph.record.regions['calls']} calls"
        return compiled, graph
    log.warning("k3compile: %s: %s; compiling the whole graph instead", where, why)
    inline(whole)
    compiled, graph = compile_(whole)
    graph.compile_seconds = time.perf_counter() - t0
    graph.regions = f"whole graph: {why}"
    return compiled, graph
