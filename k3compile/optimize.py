"""``k3compile.optimize``: torch.compile with the k3 passes, and the record ``report`` reads.

The model is compiled in place (as ``nn.Module.compile`` does), so ``model.generate`` and every
``module(...)`` call run the compiled graphs. The compiler is Inductor itself, through a subclass of
torch's own Inductor wrapper (mode, options and CUDA graphs behave exactly as with
``torch.compile(mode=...)``) whose only addition is bookkeeping around ``compile_fx``:

- on an FX-cache miss our pass runs and leaves a ``GraphRecord`` in ``passes.COMPILE_RECORD``; we
  keep it and also store it in a small sidecar JSON under the Inductor cache directory, keyed by
  the Dynamo graph's code, its inputs' metadata and our pass's uuid;
- on a hit no pass runs (Inductor serves the compiled artifact); we load the sidecar instead, so
  the report stays truthful on a warm start.
"""
from __future__ import annotations

import hashlib
import inspect
import json
import logging
import os
import threading
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass

from .passes import COMPILE_RECORD, GraphRecord, K3Options, K3PostGradPass, pattern_module, summarize_model

log = logging.getLogger("k3compile")

STATE_ATTR = "_k3compile"


class K3PassMissingError(RuntimeError):
    """``strict=True``: a pass expected on this graph matched nothing."""


@dataclass
class CompiledGraph:
    """One graph Dynamo handed to the compiler, and what our passes did to it."""
    key: str
    record: Optional[GraphRecord]   # None: served from cache and no sidecar found
    source: str                     # "pass ran" | "cache hit (sidecar)" | "cache hit (no record)"
    compile_seconds: float          # wall time of compile_fx for this graph
    cache_hits: dict = field(default_factory=dict)   # counter deltas during compile_fx


@dataclass
class K3State:
    options: K3Options
    strict: bool
    summary: dict
    graphs: list = field(default_factory=list)
    compiler: Any = None                    # the K3Inductor torch.compile was given
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)


def _sidecar_dir() -> str:
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return os.path.join(cache_dir(), "k3compile")


def _input_meta(x: Any) -> str:
    if isinstance(x, torch.Tensor):
        return f"T({x.dtype},{tuple(x.shape)},{tuple(x.stride())},{x.device.type})"
    return f"{type(x).__name__}({x})"


def graph_key(gm: torch.fx.GraphModule, inputs: list, uuid: Optional[str]) -> str:
    """Stable across processes: the Dynamo graph's code, its inputs' metadata, our pass uuid."""
    h = hashlib.sha256()
    h.update(str(uuid).encode())
    h.update(gm.code.encode())
    for x in inputs:
        h.update(_input_meta(x).encode())
    return h.hexdigest()[:32]


def _save_sidecar(key: str, record: GraphRecord) -> None:
    try:
        d = _sidecar_dir()
        os.makedirs(d, exist_ok=True)
        tmp = os.path.join(d, f"{key}.json.{os.getpid()}.tmp")
        with open(tmp, "w") as f:
            json.dump(record.to_json(), f)
        os.replace(tmp, os.path.join(d, f"{key}.json"))
    except OSError as e:  # a read-only cache dir costs only the warm-start report
        log.warning("k3compile: could not store the pass record (%s)", e)


def _load_sidecar(key: str) -> Optional[GraphRecord]:
    try:
        with open(os.path.join(_sidecar_dir(), f"{key}.json")) as f:
            return GraphRecord.from_json(json.load(f))
    except (OSError, ValueError, TypeError):
        return None


def _merge(records: list[GraphRecord]) -> GraphRecord:
    out = GraphRecord()
    for r in records:
        for name, n in r.matches.items():
            out.matches[name] = out.matches.get(name, 0) + n
        out.seconds += r.seconds
        out.registration_seconds += r.registration_seconds
        out.facts.update(r.facts)
    return out


_CACHE_COUNTERS = (("inductor", "fxgraph_cache_hit"), ("aot_autograd", "autograd_cache_hit"),
                   ("inductor", "fxgraph_cache_miss"), ("inductor", "fxgraph_cache_bypass"))


def _counters() -> dict:
    from torch._dynamo.utils import counters

    return {name: counters[group][name] for group, name in _CACHE_COUNTERS}


def _check_expected(state: K3State, record: GraphRecord) -> None:
    summary = {**state.summary, **record.facts, "small_m_limit": state.options.small_m_limit}
    for name in state.options.enabled:
        expected = getattr(pattern_module(name), "expected", None)
        if record.matches.get(name, 0) == 0 and expected is not None and expected(summary):
            msg = (f"k3compile: pass {name!r} matched nothing on a graph where it was expected "
                   f"(summary: {summary})")
            if state.strict:
                raise K3PassMissingError(msg)
            log.warning(msg)


class K3Inductor(torch._TorchCompileInductorWrapper):
    """Inductor as ``torch.compile`` configures it, plus the pass record per compiled graph."""

    def __init__(self, mode, options, dynamic, state: K3State):
        super().__init__(mode, options, dynamic)
        self.k3_state = state

    def __call__(self, model_, inputs_, **kwargs):
        state = self.k3_state
        pass_ = self.config["post_grad_custom_post_pass"]
        key = graph_key(model_, inputs_, pass_.uuid())
        COMPILE_RECORD.take()  # drop records left by an unrelated compile in this thread
        before = _counters()
        t0 = time.perf_counter()
        compiled = self._compile(model_, inputs_, **kwargs)
        seconds = time.perf_counter() - t0
        after = _counters()
        records = COMPILE_RECORD.take()
        if records:
            record, source = _merge(records), "pass ran"
            _save_sidecar(key, record)
        else:
            record = _load_sidecar(key)
            source = "cache hit (sidecar)" if record is not None else "cache hit (no record)"
        graph = CompiledGraph(key, record, source, seconds,
                              {k: after[k] - before[k] for k in after if after[k] != before[k]})
        with state.lock:
            state.graphs.append(graph)
        if record is not None:
            _check_expected(state, record)
        return compiled

    def _compile(self, model_, inputs_, **kwargs):
        """torch's own Inductor call; where an enabled pattern module overrides entries of Inductor's
        decomposition table for this compile's config (``decompositions(options)``, e.g. the skinny
        GEMM under max-autotune), ``compile_fx`` gets the amended table -- for this compile only."""
        from torch._inductor import config as inductor_config

        patches = {**self.config, **(kwargs.get("config_patches") or {})}
        overrides = {}
        with inductor_config.patch(patches):
            for name in self.k3_state.options.enabled:
                hook = getattr(pattern_module(name), "decompositions", None)
                if hook is not None:
                    overrides.update(hook(self.k3_state.options))
            if not overrides:
                return super().__call__(model_, inputs_, **kwargs)
            from torch._inductor.decomposition import select_decomp_table

            table = {**select_decomp_table(), **overrides}
        from torch._inductor.compile_fx import compile_fx

        extra = {}
        name = getattr(self, "name", None)
        if name is not None and "compile_region_name" in inspect.signature(compile_fx).parameters:
            extra["compile_region_name"] = name  # as torch's own wrapper passes it (newer torch)
        return compile_fx(model_, inputs_, config_patches=patches, decompositions=table, **extra)


_PASSES: dict = {}


def _pass_for(options: K3Options, chained: Any) -> K3PostGradPass:
    # one instance per (options, chained): Inductor compares configs by value, caches by uuid
    key = (options, id(chained))
    if key not in _PASSES:
        _PASSES[key] = K3PostGradPass(options, chained)
    return _PASSES[key]


def optimize(model, *, backend: str = "auto", passes=None, strict: bool = False,
             small_m_limit: int = 16, **torch_compile_kwargs):
    """Compile ``model`` with Inductor and the k3 passes; returns the same (now compiled) module.

    backend: "auto" | "cute" | "triton" | "reference" -- which kernel implementation the k3 ops use
        (auto: CuTe on sm_90+ NVIDIA, else Triton on a GPU, else the reference; fallbacks recorded).
    passes: names from ``k3compile.patterns.PASS_ORDER`` to enable (default: all).
    strict: raise ``K3PassMissingError`` when a pass expected on a graph matched nothing
        (default: log a warning naming the pass).
    small_m_limit: most rows a GEMM may have to become a skinny GEMM.
    torch_compile_kwargs: as ``torch.compile`` (mode, dynamic, fullgraph, options, ...). A
        ``post_grad_custom_post_pass`` given in ``options`` or installed in Inductor's config runs
        after ours.

    Example::

        model = k3compile.optimize(model, mode="reduce-overhead")
        out = model.generate(ids, max_new_tokens=32)
        print(k3compile.report(model))
    """
    if "backend" in torch_compile_kwargs:  # pragma: no cover - keyword taken by our signature
        raise TypeError("backend= selects k3 kernels; the torch.compile backend is always Inductor")
    options = K3Options(backend=backend, passes=tuple(passes or ()), small_m_limit=small_m_limit)
    # A warm start loads compiled code that calls torch.ops.k3.* without running any pass: every
    # k3 op must be registered before the first call, not only when a pattern is registered.
    from . import ops

    ops.load_all()
    for name in options.enabled:
        pattern_module(name)
    inductor_options = dict(torch_compile_kwargs.pop("options", None) or {})
    mode = torch_compile_kwargs.pop("mode", None)
    chained = inductor_options.pop("post_grad_custom_post_pass", None)
    if chained is None:
        chained = torch._inductor.config.post_grad_custom_post_pass
    if isinstance(chained, K3PostGradPass):
        chained = chained.chained  # optimize() called again on the same setup: do not stack ours
    if chained is not None and not isinstance(chained, CustomGraphPass):
        warnings.warn(
            "k3compile: the installed post_grad_custom_post_pass is a plain callable; it is chained "
            "after ours, but without a uuid() Inductor cannot cache the compiled graphs "
            "(subclass torch._inductor.custom_graph_pass.CustomGraphPass)", stacklevel=2)
    inductor_options["post_grad_custom_post_pass"] = _pass_for(options, chained)
    if {"skinny_gemm", "latent_moe_tail", "moe_experts"} & set(options.enabled):
        # On CUDA, Inductor's pad_mm pads a small M up to the dtype's alignment where its benchmark says
        # so, wrapping the product in cat/slice that no k3 pattern sees through (an H200 run lost the
        # latent-MoE tail at M=2 that way; pad_bmm does the same to the routed experts' bmm). The products our
        # passes replace gain nothing from it.
        inductor_options.setdefault("shape_padding", False)
    state = K3State(options, strict, summarize_model(model))
    compiler = K3Inductor(mode, inductor_options, torch_compile_kwargs.get("dynamic"), state)
    state.compiler = compiler
    if isinstance(model, torch.nn.Module):
        model.compile(backend=compiler, **torch_compile_kwargs)
        compiled = model
    else:
        compiled = torch.compile(model, backend=compiler, **torch_compile_kwargs)
    setattr(compiled, STATE_ATTR, state)
    return compiled


def state_of(model) -> K3State:
    state = getattr(model, STATE_ATTR, None)
    if state is None:
        raise ValueError("this model was not compiled by k3compile.optimize()")
    return state
