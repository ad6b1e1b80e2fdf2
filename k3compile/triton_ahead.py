"""Building the Triton kernels our ops launch ahead of the first call, in the precompile workers (``precompile.py``
runs it on each graph our pass rewrote wherever it builds ahead; ``K3_PRECOMPILE_TRITON=0`` turns this part off).

1. ``dry_run`` calls each k3 op of the graph that launches Triton kernels (``OPS``: no collective) once, on
   ``DryTensor`` arguments -- the call's shapes, strides, offsets and dtypes on its device, without storage: every
   aten op on them runs on meta tensors -- while ``capturing`` turns every Triton launch into a compile request:
   ``JITFunction.run`` is made a warmup (nothing launches) and Triton's ``jit_cache_hook`` records the exact
   specialisation the launcher asked for (signature, constexprs, the alignment and divisibility attributes, options,
   target: ``serialize_specialization_data``, what Triton's own ``preload`` reads) and skips the compile. No k3 kernel
   is loaded or built: a CuTe kernel asked for on the way does nothing (``kernel_cache.dry_running``), so a call that
   composes ops (``k3::experts_beside``) reaches the Triton launches after it, and an op it calls through the
   dispatcher runs its implementation on the DryTensors, not its meta kernel; no choice is recorded. An op that
   writes an input (``k3::kda_decode``) is listed through its ``auto_functionalized`` call (``call_sites``).
2. ``build`` (a worker's job, GPU-blind) compiles a request for its target into Triton's disk cache, under the key the
   first call computes, and the kernel's launcher where Triton compiles one per signature: that call then only loads
   them.

A call the dry run cannot follow (a data-dependent size, an op without a meta kernel, an argument it cannot stand in
for) is left to its first call, as without this; so is a kernel whose build fails in a worker.
"""
from __future__ import annotations

import contextlib
import importlib
import json
import os
import threading
from typing import Any

import torch
from torch.utils._pytree import tree_map

from . import kernel_cache
from .call_sites import StandIn, spec_value

ENV = "K3_PRECOMPILE_TRITON"
# ops whose implementations launch Triton kernels and communicate with no other rank (a collective would wait)
OPS = frozenset({"attn_res", "attn_res_add", "experts_beside", "kda_decode", "mla_decode", "moe_experts", "moe_route",
                 "products_beside", "route_beside", "skinny_gemm", "latent_moe_tail"})
_STATE = threading.local()


def enabled() -> bool:
    """Wherever the precompile builds (its ``Batch`` decides that), unless ``K3_PRECOMPILE_TRITON=0``; and only with a
    Triton that has the hook this needs."""
    if os.environ.get(ENV, "") in ("0", "false", "no"):
        return False
    try:
        from triton import knobs
    except Exception:
        return False
    return hasattr(knobs, "runtime") and hasattr(knobs.runtime, "jit_cache_hook")


def _extent(t: torch.Tensor) -> int:
    if any(s == 0 for s in t.shape):
        return t.storage_offset()
    return t.storage_offset() + sum((s - 1) * st for s, st in zip(t.shape, t.stride())) + 1


def _to_meta(x: Any) -> Any:
    if not isinstance(x, torch.Tensor):
        return x
    return torch.empty(_extent(x), dtype=x.dtype, device="meta").as_strided(x.shape, x.stride(), x.storage_offset())


class DryTensor(StandIn):
    """A tensor's metadata on its device, without storage (``call_sites.StandIn``), on which aten ops do run: on meta
    tensors, returning DryTensors (so an op's launcher computes what it would); ``data_ptr`` is the offset's bytes,
    which is what Triton's specialisation reads. Nothing is ever computed."""

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        nested = _launching_k3_op(func)
        if nested is not None:   # a k3 op another one calls (k3::experts_beside's k3::moe_experts): its launches too
            return nested(*args, **(kwargs or {}))
        device = next(a.device for a in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(a, DryTensor))
        out = func(*tree_map(_to_meta, args), **tree_map(_to_meta, kwargs or {}))
        return tree_map(lambda t: DryTensor(t.shape, t.stride(), t.dtype, device, t.storage_offset())
                        if isinstance(t, torch.Tensor) else t, out)


def _launching_k3_op(func) -> Any:
    """The implementation of ``func`` where it is a k3 op of ``OPS`` (the one its registration runs on a device),
    else None: such a call, reached through the dispatcher, would otherwise run its meta kernel and launch nothing."""
    if getattr(func, "namespace", None) != "k3" or func._opname not in OPS:
        return None
    from torch._library.custom_ops import OPDEFS

    opdef = OPDEFS.get(f"k3::{func._opname}")
    return None if opdef is None else opdef._init_fn


def _dry(spec: Any) -> Any:
    return spec_value(spec, DryTensor)


def is_dry() -> bool:
    return getattr(_STATE, "requests", None) is not None


def _with_target(specialization: str) -> str:
    """The specialisation with the GPU target the launch compiles for: Triton 3.6 leaves it out (its ``preload``
    takes the current device's), and a worker, GPU-blind, has no current device to take it from."""
    obj = json.loads(specialization)
    if "target" not in obj:
        from triton.runtime.driver import driver

        target = driver.active.get_current_target()
        obj["target"] = dict(backend=target.backend, arch=target.arch, warp_size=target.warp_size)
        specialization = json.dumps(obj)
    return specialization


@contextlib.contextmanager
def capturing(requests: list):
    """Within this block, in this thread, a Triton launch is a compile request appended to ``requests``
    ``(module, qualname, specialisation, Triton's cache folder)``; nothing compiles or launches. Elsewhere Triton
    behaves as ever."""
    from triton import knobs
    from triton.runtime.jit import JITFunction

    run, outer = JITFunction.run, knobs.runtime.jit_cache_hook

    def dry_run(self, *args, grid, warmup, **kwargs):
        return run(self, *args, grid=grid, warmup=warmup or is_dry(), **kwargs)

    def hook(**kw):
        if not is_dry():
            return outer(**kw) if outer is not None else None
        _STATE.requests.append((kw["fn"].module, kw["fn"].name, _with_target(kw["compile"]["specialization_data"]),
                                knobs.cache.dir))   # where this process's first call will look
        return True   # not compiled here: a worker compiles it

    JITFunction.run, knobs.runtime.jit_cache_hook, _STATE.requests = dry_run, hook, requests
    try:
        yield
    finally:
        JITFunction.run, knobs.runtime.jit_cache_hook, _STATE.requests = run, outer, None


def dry_run(sites: list[dict]) -> tuple[list, dict]:
    """The Triton compile requests of these calls (deduplicated), and why some calls could not be followed."""
    from torch._library.custom_ops import OPDEFS

    from .backends import REGISTRY
    from .choices import _MODEL_CHOICES

    requests: list = []
    skipped: dict = {}
    # by op name: OpImpls, a dataclass with __eq__, does not hash
    tables = {name: (impls, dict(impls._choices), dict(impls._decided)) for name, impls in REGISTRY.items()}
    token = _MODEL_CHOICES.set(None)   # the dry calls count in no model's report
    try:
        with torch._subclasses.fake_tensor.unset_fake_temporarily(), torch.no_grad(), \
                kernel_cache.dry_running(), capturing(requests):
            for site in sites:
                if site["op"] not in OPS or "unplanned" in site:
                    continue
                try:
                    OPDEFS[f"k3::{site['op']}"]._init_fn(**{k: _dry(v) for k, v in site["args"].items()})
                except Exception as e:   # left to the first call
                    why = f"k3::{site['op']}: {type(e).__name__}: {str(e)[:160]}"
                    skipped[why] = skipped.get(why, 0) + 1
    finally:
        _MODEL_CHOICES.reset(token)
        for impls, choices, decided in tables.values():   # no choice made by a dry call survives it
            with impls._lock:
                impls._choices.clear(), impls._choices.update(choices)
                impls._decided.clear(), impls._decided.update(decided)
    return list(dict.fromkeys(requests)), skipped


def build(module: str, qualname: str, specialization: str, cache_dir: str) -> str:
    """Compile one request for its target into Triton's disk cache ``cache_dir`` (a worker's job; no GPU needed), and
    its launcher (``_build_launcher``). Returns the kernel's name."""
    os.environ["TRITON_CACHE_DIR"] = cache_dir   # the compiling process's, whatever this worker inherited
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget

    fn: Any = importlib.import_module(module)
    for part in qualname.split("."):
        fn = getattr(fn, part)
    obj = json.loads(specialization)

    def constant(value):   # as Triton's JITFunction.preload decodes them
        if tl.dtype.is_dtype(value):
            return tl.dtype(value)
        if isinstance(value, dict) and "constexpr" in value:
            return tl.constexpr(value["constexpr"])
        if isinstance(value, dict) and "jit_function" in value:
            mod, name = value["jit_function"].split(":")
            found: Any = importlib.import_module(mod)
            for part in name.split("."):
                found = getattr(found, part)
            return found
        return value

    def tuples(value):
        return tuple(tuples(v) for v in value) if isinstance(value, list) else value

    constexprs = {tuple(k): constant(v) for k, v in zip(obj["constant_keys"], obj["constant_vals"])}
    attrs = dict(zip(map(tuple, obj["attrs_keys"]), obj["attrs_vals"]))
    signature = {k: tuples(v) for k, v in obj["signature"].items()}
    options = {k: tuple(v) if isinstance(v, list) else v for k, v in obj["options"].items()}
    source = getattr(fn, "ASTSource", None) or triton.compiler.ASTSource
    target = GPUTarget(**obj["target"])
    kernel = triton.compile(source(fn, signature, constexprs, attrs), target=target, options=options)
    _build_launcher(kernel, target)
    return obj.get("name", qualname)


def _build_launcher(kernel: Any, target: Any) -> None:
    """Build the kernel's launcher into Triton's disk cache where its Triton compiles one per signature (Triton 3.6:
    a C module, ~0.35 s of a C compiler each, which the first call would otherwise pay). Through the target's own
    backend driver, not the active one: a worker sees no GPU (``CUDA_VISIBLE_DEVICES=""``), so it has no active driver.
    The launcher needs no GPU to build; a driver that cannot start here, or a Triton whose launcher is generic (3.7),
    leaves nothing to do or nothing done, and the first call builds or loads it as without this."""
    from triton.backends import backends

    drivers = [b.driver for b in backends.values() if b.compiler.supports_target(target)]
    try:
        drivers[0]().launcher_cls(kernel.src, kernel.metadata)
    except Exception:   # the kernel itself is built; only its launcher is left to the first call
        pass
