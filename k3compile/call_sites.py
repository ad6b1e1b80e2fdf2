"""The calls of k3 ops that JIT-build kernels in a compiled graph, and the kernels they build
(``k3compile/precompile.py`` builds those ahead of the first call).

``call_sites`` reads them off the final graph our pass leaves: each call of a k3 op whose ``OpImpls`` has a ``plan``
(the skinny GEMM and the latent-MoE tail, whose CuTe kernels are compiled per variant), with its arguments as the op's
schema names them, each tensor as its shape, strides, offset, dtype and device (a Tensor[] as a list of them). A
call with a symbolic size is listed once per value it is planned at: the tables' M buckets (``tables.M_BUCKETS``)
and the example's value where one symbol varies, the example's values alone where several do (a size at another
value builds at its first call). The list is JSON, kept in the graph's record (``passes.GraphRecord.kernel_calls``)
so that a warm start plans from it.

``plan`` asks the op which kernels a call will build (``OpImpls.plan``: the dispatch's own decision and configuration)
on ``StandIn`` tensors, which carry a tensor's metadata without data.
"""
from __future__ import annotations

import json
from typing import Any, Optional

import torch

from .backends import REGISTRY
from .graph_values import auto_functionalized_k3_op, bind_schema, bound_args
from .kernel_cache import Build
from .tables import M_BUCKETS


class StandIn(torch.Tensor):
    """A tensor's metadata without data, on any device (nothing allocated, no GPU touched): what a dispatch's
    predicates and configuration read -- shape, strides, dtype, device, and the address's 16-byte alignment, from the
    storage offset (an allocation's base is aligned). Anything that would compute raises."""

    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, shape, stride, dtype, device, offset=0):
        return torch.Tensor._make_wrapper_subclass(cls, shape, strides=stride, storage_offset=offset, dtype=dtype,
                                                   device=device)

    def data_ptr(self) -> int:
        return self.storage_offset() * self.element_size()

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise TypeError(f"a stand-in tensor has no data ({func}): planning reads metadata only")


def stand_in(shape, dtype: torch.dtype, device, stride=None, offset: int = 0) -> StandIn:
    """A ``StandIn`` (row-major unless ``stride`` is given)."""
    shape = tuple(shape)
    if stride is None:
        stride, step = [], 1
        for size in reversed(shape):
            stride.insert(0, step)
            step *= max(size, 1)
    return StandIn(shape, tuple(stride), dtype, torch.device(device), offset)


def _k3_overload(node: torch.fx.Node) -> Optional[torch._ops.OpOverload]:
    """The k3 op ``node`` calls: directly, or through ``auto_functionalized`` (e.g. ``k3::kda_decode``, which
    writes its state)."""
    target = node.target
    if node.op == "call_function" and isinstance(target, torch._ops.OpOverload) and target.namespace == "k3":
        return target
    return auto_functionalized_k3_op(node)


def _call_args(node: torch.fx.Node) -> dict:
    """Every schema argument of the k3 call ``node`` by name (an ``auto_functionalized`` call passes them by
    keyword; its v2 form, which passes the written inputs as bases, raises: that call is left unplanned)."""
    if isinstance(node.target, torch._ops.OpOverload):
        return bound_args(node)
    return bind_schema(node.args[0]._schema, (), node.kwargs)


def _planned_op(node: torch.fx.Node, ops=None) -> Optional[str]:
    target = _k3_overload(node)
    if target is None:
        return None
    name = target._schema.name.split("::", 1)[1]
    if ops is not None:
        return name if name in ops else None
    impls = REGISTRY.get(name)
    return name if impls is not None and impls.plan is not None else None


def call_sites(graph: torch.fx.Graph, ops=None) -> list[dict]:
    """The distinct calls of k3 ops that build kernels in ``graph`` (``ops``: of these ops instead), at concrete
    sizes, as JSON-able dicts: ``{"op", "args": {name: value}, "symbols": {symbol: value planned}}`` (a tensor as
    ``{"shape", "stride", "offset", "dtype", "device"}``; a call not planned: ``{"op", "unplanned": why}``)."""
    sites, seen = [], set()
    for node in graph.nodes:
        op = _planned_op(node, ops)
        if op is None:
            continue
        try:
            found = _instances(op, node)
        except Exception as e:   # never fails a compile: the call builds at its first call, as without this
            found = [{"op": op, "unplanned": f"{type(e).__name__}: {e}"}]
        for site in found:
            text = json.dumps(site, sort_keys=True)
            if text not in seen:
                seen.add(text)
                sites.append(site)
    return sites


def _instances(op: str, node: torch.fx.Node) -> list[dict]:
    def value(v):
        if isinstance(v, (list, tuple)):   # a Tensor[] argument
            return [value(x) for x in v]
        return v.meta["val"] if isinstance(v, torch.fx.Node) else v

    args = {name: value(v) for name, v in _call_args(node).items()}
    exprs, hints = [], {}
    for v in args.values():
        items = []
        for t in (v if isinstance(v, list) else [v]):
            items += [*t.shape, *t.stride(), t.storage_offset()] if isinstance(t, torch.Tensor) else [t]
        for x in items:
            if isinstance(x, torch.SymInt):
                expr = x.node.expr
                exprs.append(expr)
                env = x.node.shape_env
                values = getattr(env, "backed_var_to_val", None)   # torch 2.13; var_to_val before
                for sym in expr.free_symbols:
                    hint = (values if values is not None else env.var_to_val).get(sym)
                    if hint is None:
                        raise ValueError(f"size {expr} has no example value (data-dependent)")
                    hints[sym] = int(hint)
    if len(hints) == 1:
        ((sym, hint),) = hints.items()
        assignments = [{sym: v} for v in sorted(set(M_BUCKETS) | {hint})]
    else:
        assignments = [hints]
    out = []
    for values in assignments:
        sizes = {}
        try:
            for expr in exprs:
                sizes[expr] = int(expr.subs(values))
        except TypeError:   # not an integer at these values
            continue
        if any(s < 0 for s in sizes.values()):
            continue
        site = {"op": op, "args": {name: _spec(v, sizes) for name, v in args.items()}}
        if values:
            site["symbols"] = {str(sym): v for sym, v in values.items()}
        out.append(site)
    return out


def _spec(v: Any, sizes: dict) -> Any:
    def concrete(x):
        return sizes[x.node.expr] if isinstance(x, torch.SymInt) else int(x)

    if isinstance(v, torch.Tensor):
        return {"shape": [concrete(s) for s in v.shape], "stride": [concrete(s) for s in v.stride()],
                "offset": concrete(v.storage_offset()), "dtype": str(v.dtype).removeprefix("torch."),
                "device": str(v.device)}
    if isinstance(v, torch.dtype):
        return {"dtype": str(v).removeprefix("torch.")}
    if isinstance(v, torch.SymInt):
        return concrete(v)
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, list):
        return [_spec(x, sizes) for x in v]
    raise TypeError(f"an argument of type {type(v).__name__}")


def spec_value(spec: Any, tensor: type = StandIn) -> Any:
    """A call site's argument back as a value: a tensor as ``tensor`` (a ``StandIn`` class) with its metadata, a
    list of them as a list, a dtype as the dtype."""
    if isinstance(spec, list):
        return [spec_value(x, tensor) for x in spec]
    if isinstance(spec, dict) and "shape" in spec:
        return tensor(tuple(spec["shape"]), tuple(spec["stride"]), getattr(torch, spec["dtype"]),
                      torch.device(spec["device"]), spec["offset"])
    if isinstance(spec, dict) and "dtype" in spec:
        return getattr(torch, spec["dtype"])
    return spec


def plan(site: dict) -> list[Build]:
    """The kernels a call builds at its first call (the op's dispatch decides, on stand-in tensors)."""
    with torch._subclasses.fake_tensor.unset_fake_temporarily():
        return REGISTRY[site["op"]].plan(**{name: spec_value(v) for name, v in site["args"].items()})
