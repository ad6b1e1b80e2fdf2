"""The post-grad pass manager: one ``CustomGraphPass`` that runs every enabled k3 pattern pass.

Inductor calls it as ``post_grad_custom_post_pass`` on each functional, normalized ATen graph it
compiles (only on an FX-graph-cache miss). It

1. registers each enabled pattern module's patterns once per options value, lazily, under fake tensors, and only
   those a graph could match: a module's registration groups (``patterns/_common.py`` ``Group``) are traced at
   the first graph that calls the ops they need (a graph without MoE never traces the MoE patterns),
2. applies the passes in ``patterns.PASS_ORDER`` and records each pass's match count in
   :data:`COMPILE_RECORD` (per-thread, read by ``optimize``'s backend and by ``report``),
3. runs the pass the user had installed before us (chained), if any,
4. finishes with ``static_weights.mark_static_weights``: ``static_weight=True`` on each k3 GEMM whose
   weight the final graph proves static (recorded, proven or not and why, in ``facts["static_weight"]``;
   not a pass: strict mode expects nothing of it),
5. lists the final graph's calls of k3 ops that JIT-build kernels (``call_sites.py``, kept in the record) and
   hands them to the build-ahead batch ``optimize`` runs, if any (``precompile.found``).

Its ``uuid()`` hashes our version, the torch version, the source of every pass and pattern file and
op schema, the options, whether the static-weight proof is on and whether Inductor's PDL codegen is (the proof
reads both), and the chained pass's uuid, so the FX graph and AOTAutograd caches stay valid -- and are
invalidated by any edit that could change the rewritten graph.
"""
from __future__ import annotations

import dataclasses
import hashlib
import importlib
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch
from torch._inductor import pattern_matcher as pm
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

from .backends import check_backend, triton_importable, triton_interpret
from .call_sites import call_sites
from .inductor_pdl import note_graph as note_inductor_graph, on as inductor_pdl_on, \
    set_trigger_only as set_inductor_trigger_only
from .precompile import found as precompile_found
from .product_order import order_same_input_products
from .regions import calls as region_calls
from .static_weights import enabled as static_weights_enabled
from .static_weights import mark_static_weights

log = logging.getLogger("k3compile")


@dataclass(frozen=True)
class K3Options:
    """Everything that changes what our passes do. Part of the cache key (see ``uuid``)."""
    backend: str = "auto"                       # auto | cute | triton | reference
    passes: tuple[str, ...] = ()                # enabled pass names; () = all of patterns.PASS_ORDER
    small_m_limit: int = 16                     # skinny GEMM / fused tails only up to this many rows
    inductor_trigger: bool = False              # Inductor's kernels trigger, launched without PDL (inductor_pdl.py)
    # same-input skinny GEMMs largest first (product_order.py, where its measurements are); K3_ORDER_PRODUCTS=1
    order_products: bool = field(default_factory=lambda: os.environ.get("K3_ORDER_PRODUCTS", "") not in ("", "0"))

    def __post_init__(self):
        check_backend(self.backend)
        from k3compile.patterns import PASS_ORDER
        unknown = set(self.passes) - set(PASS_ORDER)
        if unknown:
            raise ValueError(f"unknown pass(es) {sorted(unknown)}; known: {list(PASS_ORDER)}")
        if self.small_m_limit < 1:
            raise ValueError("small_m_limit must be >= 1")

    @property
    def enabled(self) -> tuple[str, ...]:
        from k3compile.patterns import PASS_ORDER
        return tuple(p for p in PASS_ORDER if not self.passes or p in self.passes)


def stand_down_reason(options: K3Options, device_types: set[str]) -> Optional[str]:
    """Why the passes leave a graph whose tensors are on ``device_types`` alone, or None.

    Only ``backend="auto"`` stands down, and only where no k3 kernel can run: there each op would run its
    plain PyTorch reference, slower than what Inductor makes of the model's own code (the micro K3 decoding on
    a 2-core CPU: 13.9 ms a token with the references, 0.9 with plain torch.compile). CPU tensors under
    ``TRITON_INTERPRET=1`` run the Triton kernels (interpreted: for tests), so the passes run there."""
    if options.backend != "auto" or "cuda" in device_types:
        return None
    if device_types <= {"cpu"} and triton_interpret() and triton_importable() is None:
        return None
    where = "the CPU" if device_types <= {"cpu"} else "/".join(sorted(device_types))
    return (f"backend='auto' leaves the graphs as plain torch.compile compiles them: their tensors are on {where}, "
            "where no k3 kernel runs (the kernels need a GPU), and the k3 ops' plain PyTorch references are slower "
            "than Inductor's own code; backend='reference' rewrites anyway")


def pattern_module(name: str):
    return importlib.import_module(f"k3compile.patterns.{name}")


@dataclass
class GraphRecord:
    """What our passes did to one compiled graph."""
    matches: dict = field(default_factory=dict)   # pass name -> matches
    seconds: float = 0.0                          # time spent in our passes (registration included)
    registration_seconds: float = 0.0
    # what pattern modules' facts() saw before rewriting, and under STATIC_WEIGHT_FACT what
    # static_weights.mark_static_weights proved after it: {op: {"proven": n, "not proven": {reason: n}}}
    facts: dict = field(default_factory=dict)
    # compile regions (regions.py) of a merged record: {"bodies": distinct bodies compiled, "calls": their calls}
    regions: dict = field(default_factory=dict)
    # the calls of k3 ops that JIT-build kernels, as call_sites.call_sites lists them (a warm start plans from these)
    kernel_calls: list = field(default_factory=list)
    # not stored: which graph the pass saw, {id of a region body's graph: calls} it makes after our rewrites (a
    # body's matches count per call left) and before them (its facts count per call they were read for)
    graph_id: Optional[int] = field(default=None, compare=False, repr=False, metadata={"transient": True})
    calls: dict = field(default_factory=dict, compare=False, repr=False, metadata={"transient": True})
    calls_read: Optional[dict] = field(default=None, compare=False, repr=False, metadata={"transient": True})

    def to_json(self) -> dict:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if not f.metadata.get("transient")}

    @classmethod
    def from_json(cls, d: dict) -> "GraphRecord":
        return cls(**{f.name: d[f.name] for f in dataclasses.fields(cls) if f.name in d})


class _CompileRecord(threading.local):
    """Per-thread list of the graphs our pass rewrote since the last ``take()``."""

    def __init__(self):
        self.graphs: list[GraphRecord] = []

    def take(self) -> list[GraphRecord]:
        graphs, self.graphs = self.graphs, []
        return graphs


COMPILE_RECORD = _CompileRecord()

STATIC_WEIGHT_FACT = "static_weight"
PRODUCT_ORDER_FACT = "products reordered"
AFTER_REWRITES_FACTS = (STATIC_WEIGHT_FACT, PRODUCT_ORDER_FACT)   # found after the passes, not read before them

_register_lock = threading.Lock()


@dataclass
class _Registered:
    """One options value's pattern passes and which of their registration groups are in them."""
    passes: dict        # pass name -> PatternMatcherPass
    groups: dict        # pass name -> its modules' groups (patterns._common.Group), in order
    done: set = field(default_factory=set)   # (pass name, group index) registered
    rank: dict = field(default_factory=dict)  # pass name -> {id of a pattern entry: index of the group it came from}


def _groups(name: str, options: K3Options) -> list:
    from k3compile.patterns._common import Group

    module = pattern_module(name)
    if hasattr(module, "groups"):
        return module.groups(options)
    return [Group(name, lambda pm_pass: module.register(pm_pass, options), requires=getattr(module, "REQUIRES", ()))]


def _register(options: K3Options, graph: Optional[torch.fx.Graph] = None
              ) -> tuple[dict[str, pm.PatternMatcherPass], float]:
    """The enabled passes with every registration group a graph could match registered (every group for None):
    a group is traced at the first graph that needs it, never twice (``patterns/_common.py`` ``Group``). Each
    target's entries stay in the order registering every group at once gives: by group, then as registered."""
    from k3compile.patterns._common import GraphFacts, fake_mode, warm_inductor_patterns

    with _register_lock:
        state = _REGISTERED.get(options)
        if state is None:
            state = _REGISTERED[options] = _Registered(
                {name: pm.PatternMatcherPass(pass_name=f"k3_{name}") for name in options.enabled},
                {name: _groups(name, options) for name in options.enabled})
        facts = GraphFacts.of(graph) if graph is not None else None
        todo = [(name, i) for name, groups in state.groups.items() for i, group in enumerate(groups)
                if (name, i) not in state.done and group.needed(facts)]
        if not todo:
            return state.passes, 0.0
        t0 = time.perf_counter()
        with fake_mode():
            warm_inductor_patterns()
            for name, i in todo:
                pm_pass = state.passes[name]
                state.groups[name][i].register(pm_pass)
                state.done.add((name, i))
                rank = state.rank.setdefault(name, {})
                for entries in pm_pass.patterns.values():
                    for entry in entries:
                        rank.setdefault(id(entry), i)
                    entries.sort(key=lambda entry: rank[id(entry)])
        REGISTRATIONS.extend(todo)
        seconds = time.perf_counter() - t0
        log.debug("k3compile: traced %s in %.2f s", ", ".join(f"{n} ({state.groups[n][i].name})" for n, i in todo),
                  seconds)
        return state.passes, seconds


_REGISTERED: dict[K3Options, _Registered] = {}
# (pass name, group index) in the order they were registered, this process (tests count what a graph made us trace)
REGISTRATIONS: list[tuple[str, int]] = []


def _source_files() -> tuple[str, ...]:
    """Every file whose edit could change the rewritten graph: passes, the static-weight proof, patterns, op schemas."""
    root = Path(__file__).resolve().parent
    files = [root / "passes.py", root / "backends.py", root / "static_weights.py", root / "graph_values.py",
             root / "inductor_pdl.py", root / "product_order.py"]
    files += sorted((root / "ops").rglob("op.py"))
    import k3compile.patterns as patterns_pkg
    files += sorted(Path(patterns_pkg.__file__).resolve().parent.glob("*.py"))
    return tuple(str(f) for f in files)


def summarize_model(model: Any) -> dict:
    """What ``expected()`` of each pattern reads about the model (graph facts are added per graph).

    Keys: ``is_k3`` (a Kimi K3 / Kimi Linear text model), ``num_layers``, ``kda_layers``,
    ``mla_layers``, ``moe_layers`` (counts), ``tp_size`` (``torch.distributed`` world size, or the
    model's own ``tp_size`` attribute).
    """
    config = getattr(model, "config", None)
    text = getattr(config, "text_config", None) or config
    model_type = str(getattr(config, "model_type", "") or "")
    text_type = str(getattr(text, "model_type", "") or "")
    is_k3 = (model_type in ("kimi_k3", "kimi_linear") or text_type == "kimi_linear"
             or type(model).__name__.startswith(("KimiK3", "KimiLinear")))
    lin = getattr(text, "linear_attn_config", None) or {}
    if not isinstance(lin, dict):
        lin = vars(lin)
    num_layers = int(getattr(text, "num_hidden_layers", 0) or 0)
    num_experts = int(getattr(text, "num_experts", 0) or 0)
    first_dense = int(getattr(text, "first_k_dense_replace", 0) or 0)
    tp_size = getattr(model, "tp_size", None)
    if tp_size is None:
        dist = torch.distributed
        tp_size = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    return {
        "is_k3": is_k3,
        "num_layers": num_layers,
        "kda_layers": len(lin.get("kda_layers", []) or []),
        "mla_layers": len(lin.get("full_attn_layers", []) or []),
        "moe_layers": max(0, num_layers - first_dense) if num_experts else 0,
        "tp_size": int(tp_size),
    }


class K3PostGradPass(CustomGraphPass):
    """The one pass object ``optimize`` installs. Reuse one instance per options value."""

    def __init__(self, options: K3Options, chained: Optional[Any] = None):
        self.options = options
        self.chained = chained

    def __call__(self, graph: torch.fx.Graph) -> None:
        from k3compile.patterns._common import search_traces_reused

        set_inductor_trigger_only(self.options.inductor_trigger)   # read by this graph's proof
        note_inductor_graph(graph, self.options.inductor_trigger)    # and by its Triton codegen
        try:
            with search_traces_reused():   # a search is traced once per distinct static shapes of this graph's matches
                self._rewrite(graph)
        finally:
            set_inductor_trigger_only(False)

    def _rewrite(self, graph: torch.fx.Graph) -> None:
        t0 = time.perf_counter()
        passes, reg_s = _register(self.options, graph)
        record = GraphRecord(registration_seconds=reg_s)
        record.graph_id, record.calls_read = id(graph), region_calls(graph)
        for name in passes:
            read_facts = getattr(pattern_module(name), "facts", None)
            if read_facts is not None:
                record.facts.update(read_facts(graph, self.options))
        for name, pm_pass in passes.items():
            n = pm_pass.apply(graph)
            post = getattr(pattern_module(name), "postprocess", None)
            if post is not None:
                n += post(graph, self.options)
            record.matches[name] = n
            log.debug("k3compile %s: %d matches", name, n)
        graph.eliminate_dead_code()
        # a rewrite may have taken a call's work out of its body (a body no call is left to weighs 0)
        left = region_calls(graph)
        record.calls = {body: left.get(body, 0) for body in record.calls_read}
        if self.options.order_products:
            record.facts[PRODUCT_ORDER_FACT] = order_same_input_products(graph)
        graph.lint()
        ours = time.perf_counter() - t0
        if self.chained is not None:
            self.chained(graph)
        t1 = time.perf_counter()
        bodies: dict = {}
        static = mark_static_weights(graph, bodies)   # last: it must see every write any pass added
        if static:
            record.facts[STATIC_WEIGHT_FACT] = static
        for body_record in reversed(COMPILE_RECORD.graphs):   # the region bodies it calls, proven at its calls
            if body_record.graph_id in bodies:
                body, body_static = bodies.pop(body_record.graph_id)
                if body_static:
                    body_record.facts[STATIC_WEIGHT_FACT] = body_static
                body_record.kernel_calls = call_sites(body)
                precompile_found(body_record.kernel_calls, body)
        record.seconds = ours + time.perf_counter() - t1   # the chained pass's time is not ours
        record.kernel_calls = call_sites(graph)
        COMPILE_RECORD.graphs.append(record)
        precompile_found(record.kernel_calls, graph)   # counted as kernel-build time, not ours

    def uuid(self) -> Optional[str]:
        import k3compile

        h = hashlib.sha256()
        h.update(k3compile.__version__.encode())
        h.update(torch.__version__.encode())
        h.update(get_hash_for_files(_source_files()))
        h.update(repr(dataclasses.astuple(self.options)).encode())
        # the proof reads both; Inductor calls this inside its config patch (optimize() keys its records likewise)
        h.update(f"static_weight={static_weights_enabled()} "
                 f"inductor_pdl={inductor_pdl_on(self.options.inductor_trigger)}".encode())
        if self.chained is not None:
            other = self.chained.uuid() if hasattr(self.chained, "uuid") else None
            if other is None:
                # A raw callable has no stable identity: caching would be unsound, so bypass.
                return None
            h.update(repr(other).encode())
        return h.hexdigest()
