"""What ``optimize`` keeps of each graph it compiles (``CompiledGraph``, which ``report`` prints): the pass record,
stored in a small sidecar JSON under Inductor's cache directory keyed by the Dynamo graph's code, its inputs' metadata
and our pass's uuid (so that on an FX-cache hit, where no pass runs, the record is loaded instead and the report stays
truthful on a warm start), the cache counters' deltas, and what the graph computes (its label)."""
from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from .passes import AFTER_REWRITES_FACTS, GraphRecord
from .precompile import PrecompileRecord

log = logging.getLogger("k3compile")


@dataclass
class CompiledGraph:
    """One graph Dynamo handed to the compiler, and what our passes did to it."""
    key: str
    record: Optional[GraphRecord]   # None: served from cache and no sidecar found
    source: str                     # "pass ran" | "cache hit (sidecar)" | "cache hit (no record)" | STOOD_DOWN
    compile_seconds: float          # wall time of compile_fx for this graph
    cache_hits: dict = field(default_factory=dict)   # counter deltas during compile_fx
    label: str = ""                 # what the graph computes: "prefill, batch 1, 8 tokens", "decode, batch 2", ""
    devices: tuple = ()             # device types of its tensors, e.g. ("cuda",)
    stood_down: str = ""            # why our passes left it alone (backend="auto" where no k3 kernel runs)
    regions: str = ""               # "4 region bodies for 8 calls", "whole graph: <why>", "" (no regions)
    precompile: Optional[PrecompileRecord] = None   # its kernels built ahead of its first call (precompile.py)

    @property
    def on_gpu(self) -> bool:
        return "cuda" in self.devices


STOOD_DOWN = "compiled as plain torch.compile"


def _sidecar_dir() -> str:
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return os.path.join(cache_dir(), "k3compile")


def _input_meta(x: Any) -> str:
    if isinstance(x, torch.Tensor):
        return f"T({x.dtype},{tuple(x.shape)},{tuple(x.stride())},{x.device.type})"
    return f"{type(x).__name__}({x})"


def graph_key(gm: torch.fx.GraphModule, inputs: list, uuid: Optional[str]) -> str:
    """Stable across processes: the Dynamo graph's code (its region bodies' too), its inputs' metadata, our pass
    uuid."""
    h = hashlib.sha256()
    h.update(str(uuid).encode())
    h.update(gm.code.encode())
    for name, body in sorted(gm.named_modules()):   # compile regions' bodies (their calls name them)
        if name and isinstance(body, torch.fx.GraphModule):
            h.update(f"{name}:{body.code}".encode())
    for x in inputs:
        h.update(_input_meta(x).encode())
    return h.hexdigest()[:32]


def save_record(key: str, record: GraphRecord) -> None:
    try:
        d = _sidecar_dir()
        os.makedirs(d, exist_ok=True)
        tmp = os.path.join(d, f"{key}.json.{os.getpid()}.tmp")
        with open(tmp, "w") as f:
            json.dump(record.to_json(), f)
        os.replace(tmp, os.path.join(d, f"{key}.json"))
    except OSError as e:  # a read-only cache dir costs only the warm-start report
        log.warning("k3compile: could not store the pass record (%s)", e)


def load_record(key: str) -> Optional[GraphRecord]:
    try:
        with open(os.path.join(_sidecar_dir(), f"{key}.json")) as f:
            return GraphRecord.from_json(json.load(f))
    except (OSError, ValueError, TypeError):
        return None


def merge_records(records: list[GraphRecord]) -> GraphRecord:
    """One record for one compiled graph from the records our pass left: the graph's own and, with compile regions,
    one per region body (compiled once however often it is called). A body's matches and counted facts weigh as
    often as the graph calls it (through the bodies that call it, for nested ones), so the sum reads as the whole
    graph's; seconds add up unweighted (they were spent once). Matches and the facts found after our rewrites
    (``AFTER_REWRITES_FACTS``: the static-weight proof's, the products reordered) weigh by the calls left after
    them, the facts read before them by the calls there were (``GraphRecord.calls_read``)."""
    def callers_of(calls) -> dict:
        callers: dict = {}
        for r in records:
            for body, n in calls(r).items():
                callers.setdefault(body, []).append((r, n))
        return callers
    after = callers_of(lambda r: r.calls)
    before = callers_of(lambda r: r.calls if r.calls_read is None else r.calls_read)

    def weight(r: GraphRecord, callers: dict, depth: int = 0) -> int:
        if depth > len(records) or r.graph_id not in callers:
            return 1
        return sum(n * weight(caller, callers, depth + 1) for caller, n in callers[r.graph_id])

    out = GraphRecord()
    for r in records:
        w = weight(r, after)
        for name, n in r.matches.items():
            out.matches[name] = out.matches.get(name, 0) + w * n
        out.seconds += r.seconds
        out.registration_seconds += r.registration_seconds
        found = {k: v for k, v in r.facts.items() if k in AFTER_REWRITES_FACTS}
        read = {k: v for k, v in r.facts.items() if k not in found}
        out.facts = _merge_facts(_merge_facts(out.facts, read, weight(r, before)), found, w)
        out.regions = _merge_facts(out.regions, r.regions, 1)
        out.kernel_calls += [c for c in r.kernel_calls if c not in out.kernel_calls]
        if r.graph_id in after and w:   # a body no call is left to was not compiled
            out.regions["bodies"] = out.regions.get("bodies", 0) + 1
            out.regions["calls"] = out.regions.get("calls", 0) + w
    return out


def _merge_facts(into: dict, facts: dict, weight: int) -> dict:
    """``facts`` added to ``into``: counts (ints) times ``weight``, lists as their sorted union, dicts key by key,
    anything else replaced."""
    out = dict(into)
    for key, value in facts.items():
        have = out.get(key)
        if isinstance(value, bool) or not isinstance(value, (int, list, dict)):
            out[key] = value
        elif isinstance(value, int):
            out[key] = (have if isinstance(have, int) else 0) + weight * value
        elif isinstance(value, list):
            out[key] = sorted(set(have or []) | set(value), key=str)
        else:
            out[key] = _merge_facts(have if isinstance(have, dict) else {}, value, weight)
    return out


_CACHE_COUNTERS = (("inductor", "fxgraph_cache_hit"), ("aot_autograd", "autograd_cache_hit"),
                   ("inductor", "fxgraph_cache_miss"), ("inductor", "fxgraph_cache_bypass"))


def cache_counters() -> dict:
    from torch._dynamo.utils import counters

    return {name: counters[group][name] for group, name in _CACHE_COUNTERS}


def graph_label(gm: torch.fx.GraphModule, inputs: list) -> str:
    """What a Dynamo graph of a language model computes, read off its token ids ``[B, T]`` (or embeddings
    ``[B, T, D]``): "decode, batch B" (T = 1), "prefill, batch B, T tokens", with "any" for a symbolic size;
    "" for a graph without them."""
    for node, x in zip(gm.graph.find_nodes(op="placeholder"), inputs):
        value = node.meta.get("example_value", x)
        name = node.name.lower()
        if not isinstance(value, torch.Tensor) or not (
                ("input_ids" in name and value.dim() == 2) or ("inputs_embeds" in name and value.dim() == 3)):
            continue
        batch, tokens = (s if isinstance(s, int) else "any" for s in value.shape[:2])
        if tokens == 1:
            return f"decode, batch {batch}"
        return f"prefill, batch {batch}, {tokens} tokens" if tokens != "any" else f"prefill, batch {batch}, any length"
    return ""


def device_types(inputs: list) -> tuple:
    return tuple(sorted({x.device.type for x in inputs if isinstance(x, torch.Tensor)}))
