"""Checkpoints in the published layout: config.json + safetensors shards (+ index) under the published tensor names.

:func:`from_pretrained` checks config.json and every file's header first (names, shapes, dtypes, nothing missing or
extra), builds the model on the meta device, then streams: file by file, this tensor-parallel rank's slice of each
tensor is read (:mod:`.reader`) and converted straight into its parameter on the target device. Routed experts load
as MXFP4 codes + scales or as floats (dequantised, or quantised, slice by slice); the zero-padded ``A_log`` is
trimmed; the tensors the checkpoint keeps in fp32 stay fp32. Loaded floats are checked for NaN / inf and E8M0
scales for the NaN byte 255. On any error the model is dropped and the error names the file and the tensor.
:func:`save_pretrained` writes the same layout, one shard in memory at a time, experts packed or not.
"""
from __future__ import annotations

import copy
import json
import os
import re
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch

from .config import KimiK3Config
from .moe import PROJECTIONS, Experts, experts_dtype
from .mxfp4 import E2M1_VALUES, GROUP, MXFP4_GROUP, dequantize_mxfp4, quantize_mxfp4, scale_nan  # noqa: F401
from .parallel import SINGLE, TPContext
from .reader import INDEX_NAME, SINGLE_NAME, CheckpointError, DictSource, Entry, FileSource, Progress  # noqa: F401

CONFIG_NAME = "config.json"
MODEL_TYPE = "kimi_k3"

# a routed expert's tensor: float ``weight`` [rows, cols], or MXFP4 ``weight_packed`` [rows, cols/2] + ``weight_scale``
# [rows, cols/32] (+ compressed-tensors' optional ``weight_shape`` = [rows, cols])
EXPERT_TENSOR = re.compile(r"^(.*\.experts)\.(\d+)\.(w[123])\.(weight|weight_packed|weight_scale|weight_shape)$")
ROUTED_EXPERT = re.compile(r"\.experts\.\d+\.w[123]\.weight$")

# MTP layers (spec §10) are published as text layers past the last one: language_model.model.layers.{L+s}.*;
# this model keeps them under mtp.layers.{s}.*, the decoder-layer part under mtp.layers.{s}.mtp_block.*.
TEXT_LAYER = re.compile(r"^language_model\.model\.layers\.(\d+)\.(.*)$")
MTP_LAYER = re.compile(r"^mtp\.layers\.(\d+)\.(.*)$")
MTP_OWN = ("enorm.", "hnorm.", "eh_proj.", "shared_head.")

# keywords transformers' Auto classes and hub helpers pass along; nothing here downloads, so they are ignored
HUB_KWARGS = {"cache_dir", "force_download", "proxies", "revision", "token", "local_files_only", "subfolder",
              "code_revision", "trust_remote_code", "adapter_kwargs", "_from_auto", "_from_pipeline",
              "_commit_hash", "use_auth_token", "resume_download", "low_cpu_mem_usage", "attn_implementation",
              "use_safetensors", "variant"}


def mtp_key_to_published(key: str, num_hidden_layers: int) -> str:
    """``mtp.layers.{s}[.mtp_block].rest`` -> ``language_model.model.layers.{L+s}.rest``; other keys unchanged."""
    m = MTP_LAYER.match(key)
    if m is None:
        return key
    rest = m.group(2).removeprefix("mtp_block.")
    return f"language_model.model.layers.{num_hidden_layers + int(m.group(1))}.{rest}"


def published_key_to_mtp(key: str, num_hidden_layers: int) -> str:
    """Inverse of :func:`mtp_key_to_published` for layer indices >= num_hidden_layers."""
    m = TEXT_LAYER.match(key)
    if m is None or int(m.group(1)) < num_hidden_layers:
        return key
    s, rest = int(m.group(1)) - num_hidden_layers, m.group(2)
    return f"mtp.layers.{s}.{rest}" if rest.startswith(MTP_OWN) else f"mtp.layers.{s}.mtp_block.{rest}"


# -- config.json -----------------------------------------------------------------------------------------------
def experts_quantized(qc, where: str) -> bool:
    """Whether a ``quantization_config`` describes MXFP4 routed experts (compressed-tensors
    ``mxfp4-pack-quantized``: 4-bit float weights, groups of 32, no activation quantisation); None -> False.
    Anything else is a CheckpointError: loading it as plain weights would compute something else."""
    if qc is None:
        return False
    if hasattr(qc, "to_dict"):
        qc = qc.to_dict()
    bad = f"{where}: quantization_config {json.dumps(qc, default=str)[:300]} is not understood here: "
    if not isinstance(qc, dict) or qc.get("quant_method") != "compressed-tensors":
        raise CheckpointError(bad + "only compressed-tensors MXFP4 (mxfp4-pack-quantized) routed experts load")
    groups = qc.get("config_groups") or {}
    if not groups:
        raise CheckpointError(bad + "no config_groups")
    for name, group in groups.items():
        weights = group.get("weights") or {}
        fmt = group.get("format", qc.get("format"))
        wanted = {"num_bits": 4, "type": "float", "group_size": GROUP}
        if fmt != "mxfp4-pack-quantized" or any(weights.get(k) != v for k, v in wanted.items()) \
                or weights.get("strategy", "group") != "group" or group.get("input_activations") \
                or group.get("output_activations"):
            raise CheckpointError(bad + f"config group {name!r} is not 4-bit float weights in groups of {GROUP} "
                                        f"(format mxfp4-pack-quantized) without activation quantisation")
    return True


def read_config(path: Path) -> KimiK3Config:
    """``path/config.json`` as a KimiK3Config; a missing file, another model_type or an unknown
    quantization_config is an error naming the file."""
    file = Path(path) / CONFIG_NAME
    if not file.is_file():
        raise FileNotFoundError(f"{file} does not exist: from_pretrained needs the checkpoint's {CONFIG_NAME} "
                                f"(or pass config=KimiK3Config(...))")
    try:
        raw = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{file}: not valid JSON ({e})") from None
    if raw.get("model_type") != MODEL_TYPE:
        raise CheckpointError(f"{file}: model_type is {raw.get('model_type')!r}; this loads Kimi K3 checkpoints "
                              f"(model_type {MODEL_TYPE!r})")
    if not isinstance(raw.get("text_config"), dict):
        raise CheckpointError(f"{file}: no text_config (a Kimi K3 config.json holds the text tower's config there)")
    experts_quantized(raw.get("quantization_config"), str(file))
    return KimiK3Config.from_pretrained(str(path))


# -- the loading plan ------------------------------------------------------------------------------------------
@dataclass
class _Target:
    """One parameter being filled: its local shape and dtype, and the dimension TP splits."""
    shape: tuple
    dtype: torch.dtype
    tp_dim: Optional[int]


@dataclass
class _Tensor:
    """A checkpoint tensor that fills one parameter (not a routed expert)."""
    entry: Entry
    param: str
    index: Optional[tuple]                   # this rank's slice, None: whole
    heads: Optional[int] = None              # A_log: the real heads of the published zero-padded [H_pad]


@dataclass
class _ExpertGroup:
    """One expert's projection (w1, w2 or w3) of one Experts module, from its parts in the checkpoint."""
    prefix: str
    e: int
    w: str
    logical: tuple = ()                      # full [rows, cols]
    parts: dict = field(default_factory=dict)          # part -> Entry
    index: dict = field(default_factory=dict)          # part -> this rank's slice
    narrow: Optional[tuple] = None           # (start, length) of columns after dequantising a superset of groups


def _float_dtype(entry: Entry, where: str, what: str) -> None:
    if not (isinstance(entry.dtype, torch.dtype) and entry.dtype.is_floating_point):
        raise CheckpointError(f"{where}: tensor {entry.name} is {entry.dtype}, expected a floating-point {what}")


def _shape(entry: Entry, want: tuple, where: str, what: str) -> None:
    if tuple(entry.shape) != tuple(want):
        raise CheckpointError(f"{where}: tensor {entry.name} has shape {list(entry.shape)}, expected {list(want)} "
                              f"({what})")


def _rank_slice(dim: int, start: int, stop: int) -> tuple:
    return (slice(None),) * dim + (slice(start, stop),)


class _Plan:
    """What to read for this rank and where it goes: every checkpoint tensor checked against the model (names,
    shapes, dtypes, nothing missing) before any data is read."""

    def __init__(self, model, source, dtype: torch.dtype, tp: TPContext):
        from .modeling import FP32_PARAMS
        text = model.config.text_config
        self.layers, self.heads = text.num_hidden_layers, text.linear_attn_config["num_heads"]
        self.source, self.tp, self.dtype = source, tp, dtype
        self.experts = {name: m for name, m in model.named_modules() if isinstance(m, Experts)}
        self.targets: dict[str, _Target] = {}
        for name, p in model.named_parameters():
            if p.dtype == torch.uint8:           # MXFP4 codes / scales
                target_dtype = p.dtype
            else:
                target_dtype = torch.float32 if name.endswith(FP32_PARAMS) else dtype
            self.targets[name] = _Target(tuple(p.shape), target_dtype, getattr(p, "tp_dim", None))
        self.tensors: dict[str, _Tensor] = {}
        self.groups: dict[tuple, _ExpertGroup] = {}
        for name, entry in source.entries.items():
            self._place(model, name, entry)
        self._check_complete()
        self.by_file: dict[str, list[Entry]] = {file: [] for file in source.files}
        for entry in source.entries.values():
            self.by_file[entry.file].append(entry)

    def where(self, entry: Entry) -> str:
        return self.source.where(entry)

    def published(self, own: str) -> str:
        return mtp_key_to_published(own, self.layers)

    def _place(self, model, name: str, entry: Entry) -> None:
        own = published_key_to_mtp(name, self.layers)
        where = self.where(entry)
        if own.startswith("mtp.") and not hasattr(model, "mtp"):
            raise CheckpointError(f"{where}: tensor {name} belongs to an MTP layer but the config has "
                                  f"num_nextn_predict_layers = {model.config.text_config.num_nextn_predict_layers}")
        m = EXPERT_TENSOR.match(own)
        if m is not None:
            prefix, e, w, part = m.group(1), int(m.group(2)), m.group(3), m.group(4)
            module = self.experts.get(prefix)
            if module is None or e >= module.num_experts:
                why = f"no routed experts at {prefix}" if module is None else f"{module.num_experts} experts there"
                raise CheckpointError(f"{where}: tensor {name} has no place in {type(model).__name__} ({why})")
            group = self.groups.setdefault((prefix, e, w), _ExpertGroup(prefix, e, w))
            group.parts[part] = entry
            return
        target = self.targets.get(own)
        if target is None:
            raise CheckpointError(f"{where}: tensor {name} has no place in {type(model).__name__}")
        _float_dtype(entry, where, "weight")
        full = list(target.shape)
        if target.tp_dim is not None:
            full[target.tp_dim] *= self.tp.world
        heads = None
        if own.endswith("A_log"):      # published per-head [H] zero-padded for kernels (K3: 96 heads in [128])
            heads = self.heads
            n = 1
            for s in entry.shape:
                n *= s
            if n < heads:
                raise CheckpointError(f"{where}: tensor {name} has {n} entries for {heads} heads")
        else:
            _shape(entry, full, where, f"{own} at tensor-parallel size {self.tp.world}: local {list(target.shape)}")
        index = None
        if target.tp_dim is not None and self.tp.world > 1 and heads is None:
            n = target.shape[target.tp_dim]
            index = _rank_slice(target.tp_dim, self.tp.rank * n, (self.tp.rank + 1) * n)
        self.tensors[name] = _Tensor(entry, own, index, heads)

    def _check_complete(self) -> None:
        filled = {t.param for t in self.tensors.values()}
        for own, target in self.targets.items():
            if own.rsplit(".", 1)[0] not in self.experts and own not in filled:
                raise CheckpointError(f"{self._dir()}: no file holds tensor {self.published(own)} "
                                      f"(shape {list(target.shape)} on this rank)")
        for prefix, module in self.experts.items():
            for e in range(module.num_experts):
                for w in PROJECTIONS:
                    group = self.groups.get((prefix, e, w))
                    if group is None:
                        raise CheckpointError(f"{self._dir()}: no file holds tensor "
                                              f"{self.published(f'{prefix}.{e}.{w}.weight')} (float) or "
                                              f"{self.published(f'{prefix}.{e}.{w}.weight_packed')} (MXFP4)")
                    self._check_group(group, module)

    def _dir(self) -> str:
        return str(getattr(self.source, "path", "the checkpoint"))

    def _check_group(self, group: _ExpertGroup, module: Experts) -> None:
        parts, L, I, W, r = group.parts, module.latent, module.intermediate, self.tp.world, self.tp.rank
        R, C = (I * W, L) if group.w != "w2" else (L, I * W)
        group.logical = (R, C)
        name = self.published(f"{group.prefix}.{group.e}.{group.w}.weight")
        if "weight" in parts and ({"weight_packed", "weight_scale"} & set(parts)):
            raise CheckpointError(f"{self.where(parts['weight'])}: the checkpoint holds {name} both as floats and "
                                  f"as MXFP4 (_packed / _scale)")
        if "weight" not in parts:
            for have, lack in (("weight_packed", "weight_scale"), ("weight_scale", "weight_packed"),
                               ("weight_shape", "weight_packed")):
                if have in parts and lack not in parts:
                    raise CheckpointError(f"{self.where(parts[have])}: tensor {name}_{have[7:]} has no matching "
                                          f"{name}_{lack[7:]} in the checkpoint")
        if "weight_shape" in parts:
            entry = parts["weight_shape"]
            if entry.dtype not in (torch.int32, torch.int64) or entry.shape != (2,):
                raise CheckpointError(f"{self.where(entry)}: tensor {entry.name} should be the int logical shape "
                                      f"[2], is {entry.dtype} {list(entry.shape)}")
        rows = (slice(r * I, (r + 1) * I),) if W > 1 and group.w != "w2" else None
        c0, c1 = r * I, (r + 1) * I              # w2's columns on this rank
        if "weight" in parts:
            entry = parts["weight"]
            _float_dtype(entry, self.where(entry), "expert weight")
            _shape(entry, (R, C), self.where(entry), f"expert {group.w} [rows, cols]")
            group.index["weight"] = rows if group.w != "w2" else (_rank_slice(1, c0, c1) if W > 1 else None)
            return
        for part, cols in (("weight_packed", C // 2), ("weight_scale", C // GROUP)):
            entry = parts[part]
            if entry.dtype != torch.uint8:
                raise CheckpointError(f"{self.where(entry)}: tensor {entry.name} is {entry.dtype}, expected uint8 "
                                      f"(MXFP4 {'codes' if part == 'weight_packed' else 'E8M0 scales'})")
            if C % GROUP:
                raise CheckpointError(f"{self.where(entry)}: tensor {entry.name}: MXFP4 needs the logical column "
                                      f"count ({C}) to be a multiple of {GROUP}")
            _shape(entry, (R, cols), self.where(entry), f"MXFP4 of a [{R}, {C}] expert {group.w}")
        if group.w != "w2" or W == 1:
            group.index = {"weight_packed": rows, "weight_scale": rows}
        elif module.packed:                      # I % 32 == 0 (Experts.check_mxfp4): whole groups and bytes
            group.index = {"weight_packed": _rank_slice(1, c0 // 2, c1 // 2),
                           "weight_scale": _rank_slice(1, c0 // GROUP, c1 // GROUP)}
        else:                                    # dequantise the groups that cover the columns, then narrow
            g0, g1 = c0 // GROUP, -(-c1 // GROUP)
            group.index = {"weight_packed": _rank_slice(1, g0 * GROUP // 2, g1 * GROUP // 2),
                           "weight_scale": _rank_slice(1, g0, g1)}
            group.narrow = (c0 - g0 * GROUP, c1 - c0)


class _Loader:
    """Streams the plan's tensors into freshly allocated parameters on ``device``."""

    def __init__(self, plan: _Plan, device, check_finite: bool):
        self.plan, self.device, self.check_finite = plan, device, check_finite
        self.dests: dict[str, torch.Tensor] = {}
        self.pending: dict[tuple, dict] = {}
        self.flags: list[tuple] = []             # (min and max of a float written, its entries)
        self.experts_written: dict[str, dict] = {}          # float expert stack -> {e: entry}, this file

    def dest(self, param: str) -> torch.Tensor:
        t = self.dests.get(param)
        if t is None:
            target = self.plan.targets[param]
            t = self.dests[param] = torch.empty(target.shape, dtype=target.dtype, device=self.device)
        return t

    def flag(self, t: torch.Tensor, entry: Entry, run: Optional[tuple] = None) -> None:
        """Keep ``t``'s min and max (they propagate NaN; one fast reduction: isfinite(t).all() measured 4-40x
        slower on the CPU) for the check at the end of the file. run: (stack, first expert, entries) of a run."""
        if self.check_finite and t.is_floating_point() and t.numel():
            self.flags.append((torch.stack(torch.aminmax(t)).double(), entry, run))

    def raise_if_not_finite(self) -> None:
        """At the end of a file, one host sync: every float written from it is finite. Float experts are checked
        as runs of consecutive experts (one reduction a run) and, where a run fails, expert by expert."""
        for param, written in self.experts_written.items():
            es = sorted(written)
            starts = [i for i, e in enumerate(es) if i == 0 or e != es[i - 1] + 1] + [len(es)]
            for a, b in zip(starts, starts[1:]):
                e0, e1 = es[a], es[b - 1]
                self.flag(self.dests[param][e0:e1 + 1], written[e0],
                          (param, e0, [written[e] for e in range(e0, e1 + 1)]))
        self.experts_written = {}
        if not self.flags:
            return
        flags, self.flags = self.flags, []
        bad = (~torch.isfinite(torch.stack([f for f, _, _ in flags])).all(-1)).tolist()
        for is_bad, (_, entry, run) in zip(bad, flags):
            if is_bad:
                if run is not None:
                    param, e0, entries = run
                    block = self.dests[param][e0:e0 + len(entries)]
                    entry = entries[int((~torch.isfinite(block)).flatten(1).any(1).nonzero()[0, 0])]
                raise CheckpointError(f"{self.plan.where(entry)}: tensor {entry.name} holds NaN or inf once loaded: "
                                      f"the file is damaged (or its values overflow {self.plan.dtype}); "
                                      f"check_finite=False loads it anyway")

    def load(self, entry: Entry, reader) -> None:
        job = self.plan.tensors.get(entry.name)
        if job is not None:
            t = reader.read(entry, None if job.heads is not None else job.index)
            if job.heads is not None:
                t = self._trim_heads(t, entry, job)
            dest = self.dest(job.param)
            if tuple(t.shape) != tuple(dest.shape):
                raise CheckpointError(f"{self.plan.where(entry)}: tensor {entry.name} read as {list(t.shape)}, "
                                      f"expected {list(dest.shape)}")
            dest.copy_(t)
            self.flag(dest, entry)
            return
        m = EXPERT_TENSOR.match(published_key_to_mtp(entry.name, self.plan.layers))
        key = (m.group(1), int(m.group(2)), m.group(3))
        group, part = self.plan.groups[key], m.group(4)
        t = reader.read(entry, group.index.get(part))
        if part == "weight_shape":
            if t.tolist() != list(group.logical):
                raise CheckpointError(f"{self.plan.where(entry)}: tensor {entry.name} says {t.tolist()}, the "
                                      f"expert's logical shape is {list(group.logical)}")
            return
        if part == "weight_scale" and bool(scale_nan(t)):
            raise CheckpointError(f"{self.plan.where(entry)}: tensor {entry.name} holds the E8M0 scale 255 (NaN): "
                                  f"the file is damaged")
        parts = self.pending.setdefault(key, {})
        parts[part] = t
        if "weight" in parts or len(parts) == 2:
            del self.pending[key]
            self._write_expert(group, parts)

    def _trim_heads(self, t: torch.Tensor, entry: Entry, job: _Tensor) -> torch.Tensor:
        t = t.reshape(-1)
        if t.numel() > job.heads and t[job.heads:].abs().max() != 0:
            raise CheckpointError(f"{self.plan.where(entry)}: tensor {entry.name}: {t.numel()} entries but "
                                  f"{job.heads} heads, and the padding is not zero")
        t = t[:job.heads]
        target = self.plan.targets[job.param]
        n = target.shape[0]
        return t[self.plan.tp.rank * n:(self.plan.tp.rank + 1) * n] if self.plan.tp.world > 1 else t

    def _write_expert(self, group: _ExpertGroup, parts: dict) -> None:
        module = self.plan.experts[group.prefix]
        base = f"{group.prefix}.{group.w}"
        if "weight" in parts:                    # float in the checkpoint
            t, entry = parts["weight"], group.parts["weight"]
            if not module.packed:
                self.dest(base)[group.e].copy_(t)
                self.experts_written.setdefault(base, {})[group.e] = entry
                return
            t = t.to(self.device, torch.float32)
            self.flag(t, entry)                  # before quantising: a NaN has no MXFP4 code
            codes, scale = quantize_mxfp4(t)
        else:
            codes, scale = parts["weight_packed"], parts["weight_scale"]
            if not module.packed:
                dest = self.dest(base)[group.e]
                w = dequantize_mxfp4(codes.to(self.device), scale.to(self.device), dest.dtype)
                if group.narrow is not None:
                    w = w.narrow(1, *group.narrow)
                dest.copy_(w)
                self.experts_written.setdefault(base, {})[group.e] = group.parts["weight_packed"]
                return
        self.dest(base + "_packed")[group.e].copy_(codes)
        self.dest(base + "_scale")[group.e].copy_(scale)


def load_tensors(model, source, dtype: torch.dtype, tp: TPContext = SINGLE, device=None, check_finite: bool = True,
                 progress: bool = False) -> dict:
    """The model's parameters by name (stacked experts in the model's current form, this rank's slices, on
    ``device``: default the source tensors' device, else the CPU) from ``source`` (:mod:`.reader`).

    Everything is checked before data is read; on any error nothing loaded stays referenced.
    """
    plan = _Plan(model, source, dtype, tp)
    if device is None:
        device = next((t.device for t in getattr(source, "tensors", {}).values()), torch.device("cpu"))
    loader = _Loader(plan, torch.device(device), check_finite)
    bar = Progress(sum(e.nbytes for e in source.entries.values()), source.files, progress)
    ok = False
    try:
        for i, file in enumerate(source.files):
            bar.file(i, file)
            with source.reader(file) as reader:
                for entry in plan.by_file[file]:
                    loader.load(entry, reader)
                    reader.done_with_tensor()
                    bar.advance(entry.nbytes)
            loader.raise_if_not_finite()
        ok = True
        return loader.dests
    except BaseException as err:
        loader.dests.clear()
        loader.pending.clear()
        loader.flags.clear()
        traceback.clear_frames(err.__traceback__)      # frames below would keep the slices being converted
        raise
    finally:
        bar.close(ok)


def convert_checkpoint(model, tensors: dict, dtype: torch.dtype, tp: TPContext) -> dict:
    """Published tensors in memory -> this model's state dict (this rank's slices, experts in the model's form,
    cast), for ``model.load_state_dict(state, strict=True, assign=True)``."""
    return load_tensors(model, DictSource(tensors), dtype, tp, check_finite=False)


def assign_parameters(model, state: dict) -> None:
    """Put the loaded tensors in place of the (meta) parameters, keeping each one's attributes (``tp_dim``)."""
    for name, t in state.items():
        module_name, leaf = name.rsplit(".", 1)
        module = model.get_submodule(module_name)
        old = module._parameters[leaf]
        new = torch.nn.Parameter(t, requires_grad=old.requires_grad)
        new.__dict__.update(old.__dict__)
        module._parameters[leaf] = new
    left = [name for name, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    if left:
        raise RuntimeError(f"loading left {len(left)} tensor(s) unset, e.g. {left[0]}")


# -- from_pretrained -------------------------------------------------------------------------------------------
def _as_dtype(value) -> Optional[torch.dtype]:
    if value is None or value == "auto" or isinstance(value, torch.dtype):
        return None if value == "auto" else value
    if isinstance(value, str):
        named = experts_dtype(value) if value != "mxfp4" else None
        if named is not None:
            return named
        if isinstance(getattr(torch, value, None), torch.dtype):
            return getattr(torch, value)
    raise ValueError(f"dtype {value!r}: expected a torch dtype or its name")


def _config_dtype(config) -> Optional[torch.dtype]:
    d = getattr(config, "dtype", None) or getattr(config.text_config, "dtype", None)
    return _as_dtype(d) if d is not None else None


def _device(device, device_map):
    if device_map is None:
        return torch.device(device if device is not None else "cpu")
    if device is not None:
        raise ValueError("pass device= or device_map=, not both")
    if isinstance(device_map, dict) and set(device_map) == {""}:
        device_map = device_map[""]
    if device_map == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if isinstance(device_map, (str, int, torch.device)):
        return torch.device(device_map)
    raise ValueError(f"device_map={device_map!r}: only one device is supported (the whole model, or this "
                     f"tensor-parallel rank's part of it, on it); split the model with tp= / tp_group=")


def ships_packed(entries) -> bool:
    """Whether every routed expert of the checkpoint is MXFP4 (the form ``experts=None`` keeps)."""
    forms = {m.group(4) for m in map(EXPERT_TENSOR.match, entries) if m is not None}
    return "weight_packed" in forms and "weight" not in forms


def from_pretrained(cls, path, *model_args, config: Optional[KimiK3Config] = None, dtype=None, device=None,
                    experts=None, tp: Optional[TPContext] = None, tp_group=None, check_finite: bool = True,
                    progress: Optional[bool] = None, device_map=None, **kwargs):
    """Build ``cls`` from a directory in the published layout, reading only this rank's bytes.

    dtype: of every tensor but the fp32 ones (default: the config's ``dtype``, else float32).
    experts: ``"mxfp4"`` (packed codes + scales, dequantised in the forward to the activations' dtype),
    ``"bf16"`` / ``"float16"`` / ``"float32"`` (float stacks; the model's dtype then defaults to it and must equal
    it), or None: as the checkpoint ships them (MXFP4 if every routed expert is packed).
    device (or a one-device ``device_map``): where the parameters are allocated and filled, tensor by tensor.
    tp / tp_group: load this rank's shards (for MXFP4 experts, moe_intermediate_size / tp must be a multiple of 32).
    check_finite: fail on NaN / inf in any loaded float: one min/max reduction per tensor on the device and one host
    sync per file (on one CPU thread ~7 GB/s of floats, 5-17% of a load from the page cache; README).
    progress: a bar / lines on stderr (default: on TP rank 0).
    Hub keywords passed by transformers' Auto classes are ignored; nothing is downloaded.
    """
    unknown = set(kwargs) - HUB_KWARGS - {"torch_dtype"}
    if model_args or unknown:
        raise TypeError(f"from_pretrained() got unexpected arguments {list(model_args) + sorted(unknown)}")
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"{path} is not a local checkpoint directory (nothing is downloaded here)")
    if config is None:
        config = read_config(path)
    else:
        experts_quantized(getattr(config, "quantization_config", None), "config")
    dtype = _as_dtype(kwargs.get("torch_dtype") or dtype)
    experts_float = None if experts is None else experts_dtype(experts)
    if experts is not None and experts_float is not None:
        if dtype is not None and dtype != experts_float:
            raise ValueError(f"experts={experts!r} with dtype={dtype}: float experts compute in the model's dtype "
                             f"(pass the same dtype, or experts='mxfp4', dequantised to the activations' dtype)")
        dtype = experts_float
    dtype = dtype or _config_dtype(config) or torch.float32
    device = _device(device, device_map)
    if tp is None:
        tp = TPContext.from_group(tp_group) if tp_group is not None else SINGLE
    source = FileSource(path)
    packed = ships_packed(source.entries) if experts is None else experts_float is None
    with torch.device("meta"):
        model = cls(config, tp)
        model.convert_experts("mxfp4" if packed else dtype)
    state = load_tensors(model, source, dtype, tp, device, check_finite,
                         progress if progress is not None else tp.rank == 0)
    assign_parameters(model, state)
    return model.eval()


# -- writing ---------------------------------------------------------------------------------------------------
def default_quantization_config() -> dict:
    """compressed-tensors MXFP4 description of routed experts (our minimal form of the published entry)."""
    return {
        "quant_method": "compressed-tensors",
        "format": "mxfp4-pack-quantized",
        "config_groups": {"group_0": {
            "targets": ["Linear"], "format": "mxfp4-pack-quantized",
            "weights": {"num_bits": 4, "type": "float", "strategy": "group", "group_size": GROUP,
                        "symmetric": True, "scale_dtype": "uint8"}}},
        "ignore": ["re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|down)_proj.*", "lm_head",
                   "re:.*block_sparse_moe\\.gate$", "re:.*routed_expert_(down|up)_proj.*",
                   "re:.*vision_tower.*", "re:.*mm_projector.*"],
    }


def _published_items(state: dict, quantize: bool, dtype: torch.dtype) -> list:
    """(names and byte sizes, make) per item to write: a tensor as it is, a float expert packed (two tensors), or
    a packed expert's codes + scales dequantised (one). ``make`` builds the item's tensors on the CPU."""
    items = []
    for key, t in state.items():
        m = EXPERT_TENSOR.match(key)
        part = m.group(4) if m else None
        if part == "weight" and quantize:
            R, C = t.shape
            items.append(([(key + "_packed", R * C // 2), (key + "_scale", R * C // GROUP)],
                          lambda key=key, t=t: dict(zip((key + "_packed", key + "_scale"),
                                                        quantize_mxfp4(t.detach().cpu())))))
        elif part == "weight_packed" and not quantize:
            base, scale = key[:-len("_packed")], state[key[:-len("_packed")] + "_scale"]
            R, C = t.shape[0], 2 * t.shape[1]
            items.append(([(base, R * C * dtype.itemsize)],
                          lambda base=base, t=t, s=scale: {base: dequantize_mxfp4(t.cpu(), s.cpu(), dtype)}))
        elif part == "weight_scale" and not quantize:
            continue                             # written with its codes
        else:
            items.append(([(key, t.numel() * t.element_size())], lambda key=key, t=t: {key: t.detach().cpu()}))
    return items


def save_pretrained(model, path, max_shard_size: int = 5 * 1024 ** 3, quantize_experts: Optional[bool] = None):
    """Write config.json and safetensors shards (+ index) under the published names, one shard in memory at a time.

    quantize_experts: write routed experts as MXFP4 (``weight_packed`` / ``weight_scale``; float experts are
    quantised, exact only for values MXFP4 holds) or as floats in the model's dtype (packed ones dequantised).
    Default: as the model holds them, or MXFP4 when float experts come with a quantization_config.
    """
    from safetensors.torch import save_file
    if model.tp.world > 1:
        raise NotImplementedError("save_pretrained of a tensor-parallel shard: gather the full model first")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = copy.deepcopy(model.config)
    qc = getattr(config, "quantization_config", None)
    if quantize_experts is None:
        quantize_experts = model.experts_packed or qc is not None
    config.quantization_config = (qc if qc is not None else default_quantization_config()) if quantize_experts \
        else None
    items = _published_items(model.state_dict(), quantize_experts, model.dtype)
    shards, sizes = [[]], [0]
    for item in items:
        nbytes = sum(n for _, n in item[0])
        if shards[-1] and sizes[-1] + nbytes > max_shard_size:
            shards.append([])
            sizes.append(0)
        shards[-1].append(item)
        sizes[-1] += nbytes
    for old in list(path.glob("model*.safetensors")) + [path / INDEX_NAME]:
        if old.exists():
            os.remove(old)
    names = [SINGLE_NAME] if len(shards) == 1 else \
        [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map = {}
    for name, shard in zip(names, shards):
        tensors = {}
        for _, make in shard:                    # own memory: per-expert views share their stack's storage
            tensors.update({k: t.contiguous().clone() for k, t in make().items()})
        save_file(tensors, str(path / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, name))
        del tensors
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(sizes)}, "weight_map": weight_map}
        (path / INDEX_NAME).write_text(json.dumps(index, indent=2, sort_keys=True))
    config.dtype = model.dtype
    config.save_pretrained(str(path))
