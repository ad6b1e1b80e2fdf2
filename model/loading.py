"""Checkpoints in the published layout: config.json + sharded safetensors under the published tensor names.

Loading dequantises MXFP4 routed experts (``weight_packed`` + ``weight_scale``), trims the zero-padded ``A_log``,
slices tensors for tensor parallelism and keeps the fp32 tensors of the checkpoint in fp32. Saving writes the same
layout (optionally re-packing the routed experts as MXFP4).
"""
from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path
from typing import Optional

import torch

from .config import KimiK3Config
from .parallel import SINGLE, TPContext, shard_tensor

log = logging.getLogger(__name__)

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"

# E2M1 magnitudes by 3-bit code; bit 3 is the sign
_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_VALUES = torch.tensor(_E2M1 + tuple(-v for v in _E2M1), dtype=torch.float32)
MXFP4_GROUP = 32

ROUTED_EXPERT = re.compile(r"\.experts\.\d+\.w[123]\.weight$")

# MTP layers (spec §10) are published as text layers past the last one: language_model.model.layers.{L+s}.*;
# this model keeps them under mtp.layers.{s}.*, the decoder-layer part under mtp.layers.{s}.mtp_block.*.
TEXT_LAYER = re.compile(r"^language_model\.model\.layers\.(\d+)\.(.*)$")
MTP_LAYER = re.compile(r"^mtp\.layers\.(\d+)\.(.*)$")
MTP_OWN = ("enorm.", "hnorm.", "eh_proj.", "shared_head.")


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


# -- MXFP4 -----------------------------------------------------------------------------------------------------
def dequantize_mxfp4(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """packed uint8 [R, C/2] (element 2j in the low nibble, 2j+1 in the high), scale uint8 E8M0 [R, C/32]
    -> [R, C] = E2M1(code) * 2^(scale - 127)."""
    if packed.dtype != torch.uint8 or scale.dtype != torch.uint8:
        raise ValueError(f"MXFP4 expects uint8 packed codes and scales, got {packed.dtype} / {scale.dtype}")
    R, half = packed.shape
    if scale.shape != (R, 2 * half // MXFP4_GROUP) or (2 * half) % MXFP4_GROUP:
        raise ValueError(f"MXFP4 shapes disagree: packed {tuple(packed.shape)}, scale {tuple(scale.shape)} "
                         f"(one scale per {MXFP4_GROUP} values)")
    if (scale == 255).any():
        raise ValueError("MXFP4 scale 0xFF (E8M0 NaN) in checkpoint")
    codes = torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(R, 2 * half)
    values = E2M1_VALUES.to(packed.device)[codes.long()]
    factor = torch.exp2(scale.float() - 127.0).repeat_interleave(MXFP4_GROUP, dim=1)
    return (values * factor).to(dtype)


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[R, C] -> (packed uint8 [R, C/2], scale uint8 [R, C/32]); round to nearest E2M1 after a power-of-two
    scale that puts each group's largest magnitude at or below 6. Exact for values MXFP4 can represent."""
    R, C = w.shape
    if C % MXFP4_GROUP:
        raise ValueError(f"MXFP4 needs the column count ({C}) to be a multiple of {MXFP4_GROUP}")
    groups = w.float().reshape(R, C // MXFP4_GROUP, MXFP4_GROUP)
    amax = groups.abs().amax(-1).clamp_min(2.0 ** -127)
    exponent = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127)
    scaled = (groups / torch.exp2(exponent)[..., None]).reshape(R, C)
    magnitudes = E2M1_VALUES[:8]
    code = (scaled.abs()[..., None] - magnitudes).abs().argmin(-1)            # nearest magnitude
    code = code + 8 * (scaled < 0).long() * (code > 0).long()
    code = code.to(torch.uint8).reshape(R, C // 2, 2)
    packed = code[..., 0] | (code[..., 1] << 4)
    return packed, (exponent + 127).to(torch.uint8)


# -- reading ---------------------------------------------------------------------------------------------------
def checkpoint_files(path: Path) -> list[Path]:
    if (path / INDEX_NAME).exists():
        weight_map = json.loads((path / INDEX_NAME).read_text())["weight_map"]
        return [path / name for name in sorted(set(weight_map.values()))]
    if (path / SINGLE_NAME).exists():
        return [path / SINGLE_NAME]
    raise FileNotFoundError(f"no {INDEX_NAME} or {SINGLE_NAME} in {path}")


def read_checkpoint(path: Path) -> dict:
    from safetensors import safe_open
    tensors = {}
    for file in checkpoint_files(path):
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                tensors[key] = f.get_tensor(key)
    return tensors


def dequantize_experts(tensors: dict, dtype: torch.dtype) -> dict:
    """Replace every ``X.weight_packed`` / ``X.weight_scale`` pair by ``X.weight``."""
    out = {}
    for key, t in tensors.items():
        if key.endswith(".weight_packed"):
            base = key[:-len("_packed")]
            scale = tensors.get(base + "_scale")
            if scale is None:
                raise ValueError(f"{key} has no matching {base}_scale")
            out[base] = dequantize_mxfp4(t, scale, dtype)
        elif key.endswith((".weight_scale", ".weight_shape")) and key.rsplit(".", 1)[0] + ".weight_packed" in tensors:
            continue
        else:
            out[key] = t
    return out


def _param_for_key(model: torch.nn.Module, key: str):
    """The parameter a checkpoint key lands in and the dimension of the key's tensor that TP splits."""
    m = re.match(r"^(.*\.experts)\.\d+\.(w[123])\.weight$", key)
    if m:  # per-expert tensor into a stacked [E, ...] parameter
        param = model.get_parameter(f"{m.group(1)}.{m.group(2)}")
        dim = getattr(param, "tp_dim", None)
        return param, None if dim is None else dim - 1
    param = model.get_parameter(key)
    return param, getattr(param, "tp_dim", None)


def convert_checkpoint(model, tensors: dict, dtype: torch.dtype, tp: TPContext) -> dict:
    """Published tensors -> this model's state dict (dequantised, trimmed, sharded, cast)."""
    from .modeling import FP32_PARAMS
    text = model.config.text_config
    heads = text.linear_attn_config["num_heads"]
    tensors = {published_key_to_mtp(k, text.num_hidden_layers): t for k, t in tensors.items()}
    tensors = dequantize_experts(tensors, dtype)
    own = {name for name, _ in model.named_parameters()}
    state = {}
    for key, t in tensors.items():
        if key.startswith("mtp.") and not hasattr(model, "mtp"):
            raise KeyError(f"checkpoint holds MTP layer tensors ({key!r}) but the config has "
                           f"num_nextn_predict_layers = {text.num_nextn_predict_layers}")
        if key.endswith("A_log"):
            t = t.reshape(-1)
            if t.numel() > heads:  # published: per-head [H] zero-padded for kernels
                if t[heads:].abs().max() != 0:
                    raise ValueError(f"{key}: {t.numel()} entries but {heads} heads, and the padding is not zero")
                t = t[:heads]
        if ROUTED_EXPERT.search(key) is None and key not in own:
            raise KeyError(f"checkpoint tensor {key!r} has no place in {type(model).__name__}")
        _, dim = _param_for_key(model, key)
        t = shard_tensor(t, dim, tp)
        state[key] = t.to(torch.float32 if key.endswith(FP32_PARAMS) else dtype).contiguous()
    return state


def _config_dtype(config) -> Optional[torch.dtype]:
    d = getattr(config, "dtype", None) or getattr(config.text_config, "dtype", None)
    if isinstance(d, str):
        d = getattr(torch, d)
    return d


def from_pretrained(cls, path, *model_args, config: Optional[KimiK3Config] = None,
                    dtype: Optional[torch.dtype] = None, device=None, tp: Optional[TPContext] = None,
                    tp_group=None, **kwargs):
    """Build ``cls`` from a directory in the published layout.

    dtype: of every tensor but the fp32 ones (default: the config's ``dtype``, else float32);
    tp / tp_group: load this rank's shards. Hub keywords passed by transformers' Auto classes are ignored.
    """
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"{path} is not a local checkpoint directory (nothing is downloaded here)")
    if config is None:
        config = KimiK3Config.from_pretrained(str(path))
    dtype = kwargs.pop("torch_dtype", None) or dtype
    if dtype == "auto" or dtype is None:
        dtype = _config_dtype(config) or torch.float32
    if tp is None:
        tp = TPContext.from_group(tp_group) if tp_group is not None else SINGLE
    with torch.device("meta"):
        model = cls(config, tp)
    state = convert_checkpoint(model, read_checkpoint(path), dtype, tp)
    model.load_state_dict(state, strict=True, assign=True)
    if device is not None:
        model.to(device)
    return model.eval()


# -- writing ---------------------------------------------------------------------------------------------------
def default_quantization_config() -> dict:
    """compressed-tensors MXFP4 description of routed experts (our minimal form of the published entry)."""
    return {
        "quant_method": "compressed-tensors",
        "format": "mxfp4-pack-quantized",
        "config_groups": {"group_0": {
            "targets": ["Linear"], "format": "mxfp4-pack-quantized",
            "weights": {"num_bits": 4, "type": "float", "strategy": "group", "group_size": MXFP4_GROUP,
                        "symmetric": True, "scale_dtype": "uint8"}}},
        "ignore": ["re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|down)_proj.*", "lm_head",
                   "re:.*block_sparse_moe\\.gate$", "re:.*routed_expert_(down|up)_proj.*",
                   "re:.*vision_tower.*", "re:.*mm_projector.*"],
    }


def save_pretrained(model, path, max_shard_size: int = 5 * 1024 ** 3, quantize_experts: Optional[bool] = None):
    """Write config.json and safetensors shards (+ index) under the published names.

    quantize_experts: pack routed experts as MXFP4 (default: when the config carries a quantization_config).
    """
    from safetensors.torch import save_file
    if model.tp.world > 1:
        raise NotImplementedError("save_pretrained of a tensor-parallel shard: gather the full model first")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = model.config
    if quantize_experts is None:
        quantize_experts = getattr(config, "quantization_config", None) is not None
    if quantize_experts and getattr(config, "quantization_config", None) is None:
        config.quantization_config = default_quantization_config()
    if not quantize_experts and getattr(config, "quantization_config", None) is not None:
        config.quantization_config = None
    tensors = {}
    L = config.text_config.num_hidden_layers
    for key, t in model.state_dict().items():
        key = mtp_key_to_published(key, L)
        t = t.detach().to("cpu")
        if quantize_experts and ROUTED_EXPERT.search(key):
            packed, scale = quantize_mxfp4(t)
            tensors[key + "_packed"], tensors[key + "_scale"] = packed, scale
        else:
            tensors[key] = t.contiguous().clone()
    shards, sizes = [[]], [0]
    for key, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and sizes[-1] + nbytes > max_shard_size:
            shards.append([])
            sizes.append(0)
        shards[-1].append(key)
        sizes[-1] += nbytes
    for old in list(path.glob("model*.safetensors")) + [path / INDEX_NAME]:
        if old.exists():
            os.remove(old)
    if len(shards) == 1:
        save_file(tensors, str(path / SINGLE_NAME), metadata={"format": "pt"})
    else:
        weight_map = {}
        for i, keys in enumerate(shards):
            name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file({k: tensors[k] for k in keys}, str(path / name), metadata={"format": "pt"})
            weight_map.update({k: name for k in keys})
        index = {"metadata": {"total_size": sum(sizes)}, "weight_map": weight_map}
        (path / INDEX_NAME).write_text(json.dumps(index, indent=2, sort_keys=True))
    config.dtype = model.dtype
    config.save_pretrained(str(path))
