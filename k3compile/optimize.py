"""``k3compile.optimize``: torch.compile with the k3 passes, and the record ``report`` reads.

The model is compiled in place (as ``nn.Module.compile`` does), so ``model.generate`` and every
``module(...)`` call run the compiled graphs. The compiler is Inductor itself, through a subclass of
torch's own Inductor wrapper (mode, options and CUDA graphs behave exactly as with
``torch.compile(mode=...)``) whose only addition is bookkeeping around ``compile_fx``:

- on an FX-cache miss our pass runs and leaves a ``GraphRecord`` in ``passes.COMPILE_RECORD``; we
  keep it and also store it in a small sidecar JSON under the Inductor cache directory, keyed by
  the Dynamo graph's code, its inputs' metadata and our pass's uuid (``graph_records.py``);
- on a hit no pass runs (Inductor serves the compiled artifact); we load the sidecar instead, so
  the report stays truthful on a warm start;
- under ``backend="auto"`` a graph whose tensors no k3 kernel can run on (CPU tensors without Triton's
  interpreter) is compiled exactly as plain ``torch.compile`` compiles it, without our pass
  (``passes.stand_down_reason``): the ops' PyTorch references would only be slower than Inductor's code;
- by default the CuTe kernels a graph calls are built by worker processes while it compiles (``precompile``);
- ``inductor_pdl=True`` / ``"trigger"``: Inductor's own PDL codegen in these compiles only (``inductor_pdl.py``).

Each graph's compilation is announced on the ``k3compile`` logger (INFO, shown on stderr unless the
application configures logging; ``logging.getLogger("k3compile").setLevel(logging.WARNING)`` hides it).
"""
from __future__ import annotations

import inspect
import logging
import threading
import time
import warnings
import weakref
from dataclasses import dataclass, field, replace
from typing import Any, Optional, Union

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass

from .backends import BackendUnavailableError, REGISTRY, forced_backend_reason
from .choices import recorded_into
from .graph_records import (
    STOOD_DOWN, CompiledGraph, cache_counters, device_types, graph_key, graph_label, load_record, merge_records,
    save_record,
)
from .inductor_pdl import option as inductor_pdl_option
from .logs import show_progress
from .passes import (
    COMPILE_RECORD, GraphRecord, K3Options, K3PostGradPass, pattern_module, stand_down_reason, summarize_model,
)
from . import regions as compile_regions
from .precompile import Batch, enabled as precompile_enabled, setting as precompile_setting, should_prestart

log = logging.getLogger("k3compile")


show_progress()

STATE_ATTR = "_k3compile"


class K3PassMissingError(RuntimeError):
    """``strict=True``: a pass expected on a graph rewrote nothing there, or the passes stood down."""


@dataclass
class K3State:
    options: K3Options
    strict: bool
    summary: dict
    graphs: list = field(default_factory=list)
    compiler: Any = None                    # the K3Inductor torch.compile was given
    model_name: str = "model"
    choices: dict = field(default_factory=dict)   # this model's kernel choices (choices.recording_choices)
    told: set = field(default_factory=set)        # one-time notices already logged
    regions: str = ""                             # which blocks optimize() made compile regions, or why none
    precompile: Optional[bool] = None             # build kernels ahead: True / False, None: K3_PRECOMPILE or on
    inductor_pdl: str = ""                        # whether Inductor's own kernels launch with PDL, and why
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def tell_once(self, what: str, level: int, msg: str, *args) -> None:
        if what not in self.told:
            self.told.add(what)
            log.log(level, msg, *args)


def describe(state: K3State, index: int, graph: Optional[CompiledGraph] = None, label: str = "") -> str:
    """"graph 1 (decode, batch 1) of KimiK3ForConditionalGeneration"."""
    label = graph.label if graph is not None else label
    return f"graph {index}{f' ({label})' if label else ''} of {state.model_name}"


def _missing(state: K3State, record: GraphRecord) -> list[tuple[str, str]]:
    """(pass, why it was expected) for each pass whose ``expected()`` holds for this graph but rewrote nothing."""
    summary = {**state.summary, **record.facts, "small_m_limit": state.options.small_m_limit}
    out = []
    for name in state.options.enabled:
        module = pattern_module(name)
        expected = getattr(module, "expected", None)
        if record.matches.get(name, 0) or expected is None or not expected(summary):
            continue
        out.append((name, getattr(module, "EXPECTED", "its pattern is there").format(**summary)))
    return out


def _check_expected(state: K3State, index: int, graph: CompiledGraph) -> None:
    """Each pass whose ``expected()`` holds for this graph but rewrote nothing: a warning in words (what the
    graph loses, what to do), or ``K3PassMissingError`` under ``strict``."""
    for name, why in _missing(state, graph.record):
        module = pattern_module(name)
        msg = (f"k3compile: pass {name!r} rewrote nothing on {describe(state, index, graph)} although {why}. "
               f"The graph is correct but slower: it runs {getattr(module, 'MISSED', 'the unfused form')}. "
               f"k3compile.report(model) shows what each pass found; strict=True makes this an error, "
               f"passes=[...] without {name!r} silences it.")
        if state.strict:
            raise K3PassMissingError(msg)
        log.warning(msg)


class K3Inductor(torch._TorchCompileInductorWrapper):
    """Inductor as ``torch.compile`` configures it, plus the pass record per compiled graph."""

    def __init__(self, mode, options, dynamic, state: K3State, plain_options: dict):
        super().__init__(mode, options, dynamic)
        self.k3_state = state
        # plain torch.compile's Inductor (the user's options, no pass of ours): for graphs we stand down on
        self.plain = torch._TorchCompileInductorWrapper(mode, plain_options, dynamic)

    def __call__(self, model_, inputs_, **kwargs):
        state = self.k3_state
        with state.lock:
            index = len(state.graphs)
        label, devices = graph_label(model_, inputs_), device_types(inputs_)
        stood_down = stand_down_reason(state.options, set(devices))
        if stood_down:
            if state.strict:
                raise K3PassMissingError(f"k3compile (strict=True): {describe(state, index, label=label)}: "
                                         f"{stood_down}")
            state.tell_once("stood down", logging.INFO, "k3compile: %s", stood_down)
        log.info("k3compile: compiling %s%s ...", describe(state, index, label=label),
                 f" ({STOOD_DOWN})" if stood_down else "")
        t0 = time.perf_counter()
        if stood_down:
            compile_regions.inline(model_)   # exactly as plain torch.compile compiles it: no regions
            self.plain.name = getattr(self, "name", None)
            compiled = self.plain(model_, inputs_, **kwargs)
            graph = CompiledGraph("", GraphRecord(), STOOD_DOWN, time.perf_counter() - t0, {}, label, devices,
                                  stood_down)
        else:
            compiled, graph = compile_regions.compile_or_whole(   # the whole graph where regions fail or lose
                model_, lambda gm: self._compile_with_passes(gm, inputs_, label, devices, kwargs),
                lambda record: _missing(state, record), describe(state, index, label=label))
        with state.lock:
            state.graphs.append(graph)
        if stood_down:
            done = ""
        elif graph.record is None:
            done = f"; {graph.source}"
        else:
            rewrites = ", ".join(f"{n} {name}" for name, n in graph.record.matches.items() if n)
            done = f"; rewrites: {rewrites or 'none'}"
        if graph.precompile is not None and graph.precompile.waited_seconds >= 0.1:
            done += f"; then {graph.precompile.waited_seconds:.1f} s waiting for the k3 kernels built ahead"
        log.info("k3compile: %s compiled in %.1f s%s", describe(state, index, graph), graph.compile_seconds, done)
        if graph.record is not None and not stood_down:
            _check_expected(state, index, graph)
        return compiled

    def _compile_with_passes(self, model_, inputs_, label, devices, kwargs) -> tuple[Any, CompiledGraph]:
        state = self.k3_state
        pass_ = self.config["post_grad_custom_post_pass"]
        with torch._inductor.config.patch(self.config):   # the uuid reads this compile's config, as Inductor's does
            key = graph_key(model_, inputs_, pass_.uuid())
        COMPILE_RECORD.take()  # drop records left by an unrelated compile in this thread
        batch = Batch(*precompile_enabled(state.precompile))
        if batch.record.on and should_prestart(devices, load_record(key)):
            batch.prestart()   # the workers import while AOTAutograd, Inductor and our pass run
        before = cache_counters()
        t0 = time.perf_counter()
        try:
            with batch.active():   # our pass hands it the graph's kernel calls: built while Inductor compiles
                compiled = self._compile(model_, inputs_, **kwargs)
            seconds = time.perf_counter() - t0
            after = cache_counters()
            records = COMPILE_RECORD.take()
            if records:
                record, source = merge_records(records), "pass ran"
                save_record(key, record)
            else:
                record = load_record(key)
                source = "cache hit (sidecar)" if record is not None else "cache hit (no record)"
                batch.submit(record.kernel_calls if record is not None else [])
            built = batch.finish()
        finally:
            batch.close()
        return compiled, CompiledGraph(key, record, source, seconds,
                                       {k: after[k] - before[k] for k in after if after[k] != before[k]}, label,
                                       devices, precompile=built)

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


def _model_devices(model) -> set:
    if not isinstance(model, torch.nn.Module):
        return set()
    return {t.device for t in (*model.parameters(), *model.buffers())}


def _check_backend(options: K3Options, model, strict: bool) -> None:
    """What would fail or do nothing on the first call, said before anything is compiled: a forced backend
    that cannot run here or lacks an op an enabled pass emits (``BackendUnavailableError``); under ``strict``,
    passes that ``backend="auto"`` would stand down on this model's device (``K3PassMissingError``)."""
    backend, devices = options.backend, _model_devices(model)
    why = forced_backend_reason(backend, devices)
    if why:
        raise BackendUnavailableError(f"backend={backend!r} cannot run here: {why}")
    if backend in ("cute", "triton"):
        # a pass is named after the op it emits (patterns/<op>.py -> k3compile/ops/<op>)
        lacking = [name for name in options.enabled if name in REGISTRY and not REGISTRY[name].has(backend)]
        if lacking:
            raise BackendUnavailableError(
                f"backend={backend!r}: {', '.join(f'k3::{n}' for n in lacking)} "
                f"{'has' if len(lacking) == 1 else 'have'} no {backend} implementation; use backend='auto', or "
                f"passes={[n for n in options.enabled if n not in lacking]}")
    if strict and devices:
        why = stand_down_reason(options, {d.type for d in devices})
        if why:
            raise K3PassMissingError(f"k3compile (strict=True): {why}")


def nothing_done(state: K3State) -> Optional[str]:
    """Why this model got nothing from k3compile, where that is so (None otherwise)."""
    with state.lock:
        graphs = list(state.graphs)
    if not graphs:
        return (f"k3compile: optimize() compiled nothing for {state.model_name}: it was not called after "
                "optimize() (torch.compile compiles at the first call of the module optimize() returned)")
    if all(g.stood_down for g in graphs):
        return None   # said when it happened, with the reason
    if not any(n for g in graphs if g.record for n in g.record.matches.values()) \
            and not any(g.record is None for g in graphs):
        return (f"k3compile: no k3 pass rewrote anything in {state.model_name} ({len(graphs)} graph(s) compiled): "
                "it runs as plain torch.compile would. The passes rewrite small-M matrix products on any model "
                "and the KDA steps and latent-MoE tail of Kimi K3 / Kimi Linear.")
    return None


def warn_if_nothing_done(state: K3State) -> None:
    msg = nothing_done(state)
    if msg:
        state.tell_once("nothing done", logging.WARNING, "%s", msg)


def _skipped_by_dynamo(model: torch.nn.Module) -> bool:
    try:
        from torch._dynamo import trace_rules

        return bool(trace_rules.check(model.forward))
    except Exception:   # pragma: no cover - a torch without this helper
        return type(model).forward.__module__.startswith("torch.")


def optimize(model, *, backend: str = "auto", passes=None, strict: bool = False,
             small_m_limit: int = 16, regions: Optional[bool] = None, precompile: Optional[bool] = None,
             inductor_pdl: Optional[Union[bool, str]] = None, **torch_compile_kwargs):
    """Compile ``model`` with Inductor and the k3 passes; returns the same (now compiled) module.

    backend: "auto" | "cute" | "triton" | "reference" -- which kernel implementation the k3 ops use.
        auto: CuTe on sm_90+ NVIDIA, else Triton on a GPU; every step down recorded with its reason. Where
        no k3 kernel can run (CPU tensors without TRITON_INTERPRET=1) auto leaves the graph as plain
        torch.compile compiles it. A forced backend that cannot run here raises ``BackendUnavailableError``
        now; "reference" rewrites with the plain PyTorch references (any device).
    passes: names from ``k3compile.patterns.PASS_ORDER`` to enable (default: all).
    strict: raise ``K3PassMissingError`` where k3compile would otherwise only warn: when a pass that
        finds its pattern on a graph (small-M matrix products on any model; the KDA steps and the MoE tail
        of a K3) rewrites none of it, naming the pass and the graph; and when backend="auto" stands the
        passes down on this device (raised here where the model's device tells).
    small_m_limit: most rows a GEMM may have to become a skinny GEMM.
    regions: compile each distinct block of the decoder layers once (``k3compile/regions.py``); a graph whose
        regions fail or lose a pass is compiled whole (the reason in ``report``). None (default): for a layer stack
        of at least ``regions.FROM_LAYERS`` (K3's 93 layers need them; a shallow model compiles faster whole).
    precompile: build the CuTe kernels a graph calls in worker processes while it compiles, so that its first call
        only loads them (``k3compile/precompile.py``). None (default): ``K3_PRECOMPILE`` ("1" / "0"), else on.
    inductor_pdl: True: Inductor's own kernels launch with PDL in these compiles only (``triton.enable_pdl``; CUDA
        sm_90+; it races after a kernel that loads nothing: ``inductor_pdl.py``); "trigger": they let the k3 kernel
        after them start early, launched plain (no race); False: neither. None (default): ``K3_INDUCTOR_PDL`` ("1" /
        "trigger" / "0"), else "trigger". ``options={"triton.enable_pdl": ...}`` wins.
    torch_compile_kwargs: as ``torch.compile`` (mode, dynamic, fullgraph, options, ...). A
        ``post_grad_custom_post_pass`` given in ``options`` or installed in Inductor's config runs
        after ours.

    Each graph's compilation is logged (logger "k3compile", INFO); a warning follows where a pass expected
    on a graph rewrote nothing, and where the model compiled or rewrote nothing at all (at ``report`` or
    when the model is freed).

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
    _check_backend(options, model, strict)
    inductor_options = dict(torch_compile_kwargs.pop("options", None) or {})
    plain_options = dict(inductor_options)
    pdl, trigger_only = inductor_pdl_option(inductor_pdl, inductor_options)   # this model's compiles only
    options = replace(options, inductor_trigger=trigger_only)
    mode = torch_compile_kwargs.pop("mode", None)
    chained = inductor_options.pop("post_grad_custom_post_pass", None)
    if chained is None:
        chained = torch._inductor.config.post_grad_custom_post_pass
    if isinstance(chained, K3PostGradPass):
        chained = chained.chained  # optimize() called again on the same setup: do not stack ours
        plain_options["post_grad_custom_post_pass"] = chained
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
    state = K3State(options, strict, summarize_model(model), model_name=type(model).__name__
                    if isinstance(model, torch.nn.Module) else getattr(model, "__name__", "the function"),
                    precompile=precompile_setting(precompile), inductor_pdl=pdl)
    types = {d.type for d in _model_devices(model)}
    regions, why_not = compile_regions.wanted(model, regions)
    state.regions = compile_regions.mark_model(model, types and stand_down_reason(options, types)) if regions else \
        f"off ({why_not})"
    compiler = K3Inductor(mode, inductor_options, torch_compile_kwargs.get("dynamic"), state, plain_options)
    state.compiler = compiler
    if isinstance(model, torch.nn.Module):
        model.compile(backend=compiler, **torch_compile_kwargs)
        if _skipped_by_dynamo(model):
            # torch.nn's own modules (nn.Sequential, ...): Dynamo skips frames of torch's files, so model.compile()
            # alone compiles nothing; a frame of ours in front is traced and inlines them (as torch.compile(module))
            call = model._call_impl

            def frame(*args, **kwargs):
                return call(*args, **kwargs)
            model._compiled_call_impl = torch.compile(frame, backend=compiler, **torch_compile_kwargs)
        model._compiled_call_impl = recorded_into(  # where Dynamo cannot trace the regions: traced without them
            state.choices, compile_regions.without_regions_on_error(model._compiled_call_impl, model, state))
        compiled = model
    else:
        compiled = recorded_into(state.choices, torch.compile(model, backend=compiler, **torch_compile_kwargs))
    setattr(compiled, STATE_ATTR, state)
    weakref.finalize(compiled, warn_if_nothing_done, state)
    return compiled


def state_of(model) -> K3State:
    state = getattr(model, STATE_ATTR, None)
    if state is None:
        raise ValueError("this model was not compiled by k3compile.optimize()")
    return state
