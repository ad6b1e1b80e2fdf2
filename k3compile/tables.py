"""Measured picks as data: one JSON table per op and GPU, ``k3compile/ops/<op>/tables/<gpu>.json``.

The op's tuner (``benchmarks/tune_<op>.py``) writes the table on the GPU it describes; the op's ``dispatch.py``
reads it. A GPU without a table of its own reads ``FALLBACK_GPU``'s (the only GPU tuned so far) where it has that GPU's
architecture (``FALLBACK_ARCH``); a GPU of another architecture has no measurements (its op's dispatch says what it
runs then). The format::

    {"op": "skinny_gemm", "gpu": "NVIDIA H200", "sms": 132, "tuner": "benchmarks/tune_skinny_gemm.py", "note": "...",
     "configs": {"<name>": {"kernel": "<kernel>", "<field>": <value>, ...}, ...},
     "picks": [{"dtype": "bfloat16", "m": 4, "n": 7168, "k": 3584, "static": false,
                "order": ["cute", "triton"], "cute": "<name>", "triton": "<name>"}, ...]}

- A configuration is named by its ``tag()`` (checked on load) and lists the fields that differ from its
  dataclass's defaults; ``kernel`` says which dataclass (the op maps kernels to dataclasses).
- A pick is keyed by (dtype, M bucket, N, K, static weight). ``order``: the implementations measured faster than
  the op's fallback at that shape, in the order the dispatch tries them; the other keys name the configuration
  each implementation runs there (when it runs under ``auto``, or when a backend forces it).
- The dispatch decides before it knows ``static_weight``, so both static values of a shape carry one order.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import os
import re
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

M_BUCKETS = (1, 2, 4, 8, 16)
FALLBACK_GPU = "h200"
FALLBACK_ARCH = "sm_90"   # FALLBACK_GPU's architecture: its picks stand in for GPUs of that architecture only
KEY_FIELDS = ("dtype", "m", "n", "k", "static")


def m_bucket(m: int) -> int:
    """The M a table is keyed by: the smallest bucket that holds ``m`` (kernels are compiled per exact M)."""
    for b in M_BUCKETS:
        if m <= b:
            return b
    raise ValueError(f"M={m} > {M_BUCKETS[-1]}: not a skinny product")


def gpu_slug(device_name: str) -> str:
    """A table's file stem for a GPU: ``"NVIDIA H200"`` -> ``"h200"``."""
    name = device_name.lower().removeprefix("nvidia ").removeprefix("amd ")
    return re.sub(r"[^a-z0-9]+", "_", name).strip("_")


@dataclass(frozen=True)
class Pick:
    """One shape's measured decision: the implementations that beat the fallback, in the order to try them, and
    the configuration each implementation runs there (``configs[impl]``; an implementation without one uses its
    heuristic)."""
    order: tuple[str, ...]
    configs: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Table:
    op: str
    gpu: str
    sms: int
    picks: Mapping[tuple, Pick]
    path: str = ""

    def get(self, dtype: str, m: int, n: int, k: int, static: bool) -> Optional[Pick]:
        """The pick for this shape (``m`` any M up to 16: its bucket is looked up), else None."""
        return self.picks.get((dtype, m_bucket(m), n, k, bool(static)))

    def label(self) -> str:
        return os.path.relpath(self.path, _REPO) if self.path else f"{self.op} table for {self.gpu}"


_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def config_fields(cfg: Any, kernel: str) -> dict:
    """A configuration as a table stores it: its kernel and the fields that differ from their defaults."""
    out = {"kernel": kernel}
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if f.default is dataclasses.MISSING or value != f.default:
            out[f.name] = value
    return out


def parse(doc: dict, kernels: Mapping[str, Mapping[str, type]], path: str = "") -> Table:
    """A table from its JSON document. ``kernels``: implementation -> {kernel name: config dataclass} (what each
    implementation may run); the order of ``kernels`` is the order the op tries its implementations."""
    where = path or doc.get("op", "table")
    impl_order = tuple(kernels)
    classes = {name: cls for per_impl in kernels.values() for name, cls in per_impl.items()}
    configs = {}
    for name, fields in doc["configs"].items():
        fields = dict(fields)
        kernel = fields.pop("kernel")
        if kernel not in classes:
            raise ValueError(f"{where}: configuration {name!r} names an unknown kernel {kernel!r}")
        cfg = classes[kernel](**fields)
        if cfg.tag() != name:
            raise ValueError(f"{where}: configuration {name!r} spells {cfg.tag()!r}")
        configs[name] = (kernel, cfg)
    picks: dict = {}
    for row in doc["picks"]:
        key = tuple(row[f] for f in KEY_FIELDS)
        if key in picks:
            raise ValueError(f"{where}: two picks for {dict(zip(KEY_FIELDS, key))}")
        if key[1] not in M_BUCKETS:
            raise ValueError(f"{where}: M bucket {key[1]} is not one of {M_BUCKETS}")
        order = tuple(row["order"])
        if list(order) != [i for i in impl_order if i in order]:
            raise ValueError(f"{where}: order {list(order)} at {key} is not in the op's order {list(impl_order)}")
        chosen = {}
        for impl in impl_order:
            name = row.get(impl)
            if name is None:
                continue
            kernel, cfg = configs[name]
            if kernel not in kernels[impl]:
                raise ValueError(f"{where}: {impl} cannot run {name!r} (a {kernel} configuration)")
            chosen[impl] = cfg
        unknown = set(row) - set(KEY_FIELDS) - {"order"} - set(impl_order)
        if unknown:
            raise ValueError(f"{where}: unknown keys {sorted(unknown)} at {key}")
        picks[key] = Pick(order, chosen)
    for (dtype, m, n, k, static), pick in picks.items():
        other = picks.get((dtype, m, n, k, not static))
        if other is None or other.order != pick.order:
            raise ValueError(f"{where}: {dtype} M{m} N{n} K{k} needs one order for both static-weight values")
    return Table(doc["op"], doc["gpu"], int(doc["sms"]), picks, path)


def dumps(op: str, gpu: str, sms: int, picks: Mapping[tuple, Pick], kernel_of: Mapping[type, str], tuner: str,
          note: str = "") -> str:
    """The JSON text of a table (``kernel_of``: config dataclass -> kernel name): one configuration and one pick a
    line, sorted, so that a re-tune diffs by shape."""
    configs: dict = {}
    rows = []
    for key in sorted(picks, key=lambda k: (k[0], k[2], k[3], k[1], k[4])):
        pick = picks[key]
        row = dict(zip(KEY_FIELDS, key), order=list(pick.order))
        for impl, cfg in pick.configs.items():
            name = cfg.tag()
            fields = config_fields(cfg, kernel_of[type(cfg)])
            if configs.setdefault(name, fields) != fields:
                raise ValueError(f"two configurations spell {name!r}")
            row[impl] = name
        rows.append(row)
    head = {"op": op, "gpu": gpu, "sms": sms, "tuner": tuner, "note": note}
    lines = ["{"] + [f" {json.dumps(k)}: {json.dumps(v)}," for k, v in head.items()]
    lines.append(' "configs": {')
    lines += [f"  {json.dumps(n)}: {json.dumps(f)}," for n, f in sorted(configs.items())]
    lines[-1] = lines[-1].rstrip(",")
    lines += [" },", ' "picks": [']
    lines += [f"  {json.dumps(r)}," for r in rows]
    lines[-1] = lines[-1].rstrip(",")
    lines += [" ]", "}"]
    return "\n".join(lines) + "\n"


def load(path: str, kernels: Mapping[str, Mapping[str, type]]) -> Table:
    with open(path) as f:
        return parse(json.load(f), kernels, path)


def load_for(op_dir: str, device_name: str, arch: str, kernels: Mapping[str, Mapping[str, type]]) -> Optional[Table]:
    """The table a GPU of this name and architecture reads (``table_path``), None where nothing was measured."""
    path = table_path(op_dir, device_name, arch)
    return load(path, kernels) if path else None


def gpu_arch(device_index: int) -> str:
    """The architecture of a CUDA / ROCm device, as tables are keyed: ``"sm_90"`` (NVIDIA), ``"gfx942"`` (AMD)."""
    import torch

    if torch.version.hip is not None:
        return torch.cuda.get_device_properties(device_index).gcnArchName.split(":")[0]
    major, minor = torch.cuda.get_device_capability(device_index)
    return f"sm_{major}{minor}"


@functools.cache
def table_path(op_dir: str, device_name: str, arch: str = FALLBACK_ARCH) -> Optional[str]:
    """``op_dir/tables/<gpu>.json`` for this GPU, else the fallback GPU's where ``arch`` is its architecture, else
    None (nothing measured on this architecture)."""
    own = os.path.join(op_dir, "tables", gpu_slug(device_name) + ".json")
    if os.path.exists(own):
        return own
    return os.path.join(op_dir, "tables", FALLBACK_GPU + ".json") if arch == FALLBACK_ARCH else None
