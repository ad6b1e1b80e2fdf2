"""Memory plan of one tensor-parallel rank: parameter bytes by component, cache and recurrent-state bytes per
sequence at a context length, and whether a device holds them. From the config alone (the text tower by the
shapes the modules build, written out here; the replicated vision tower counted on the meta device).

    python -m k3compile.model.plan --tp 16 --experts mxfp4 --device-gb 141 [--context 131072 --batch 4]

GB are 10^9 bytes. Not counted: activations and workspaces of the forward, the CUDA context, allocator slack.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field
from typing import Optional

import torch

from .config import KimiK3Config, KimiK3TextConfig
from .moe import experts_dtype
from .mxfp4 import GROUP

GB = 1e9
COMPONENTS = ("embedding", "lm_head", "attention (MLA)", "attention (KDA)", "dense MLP", "router",
              "latent projections + norm", "shared experts", "routed experts", "norms + AttnRes", "MTP",
              "vision tower + projector")


@dataclass
class MemoryPlan:
    """Bytes on one rank. ``params`` by component; ``cache_per_sequence`` at ``context`` tokens."""
    tp: int
    experts: str
    dtype: torch.dtype
    context: int
    batch: int
    params: dict = field(default_factory=dict)
    param_counts: dict = field(default_factory=dict)      # elements (MXFP4 experts: logical weights)
    cache: dict = field(default_factory=dict)             # per sequence: "MLA latent cache", "KDA state"

    @property
    def param_bytes(self) -> int:
        return sum(self.params.values())

    @property
    def cache_per_sequence(self) -> int:
        return sum(self.cache.values())

    @property
    def total(self) -> int:
        return self.param_bytes + self.batch * self.cache_per_sequence

    def fits(self, device_bytes: float) -> bool:
        return self.total <= device_bytes

    def sequences_that_fit(self, device_bytes: float) -> int:
        room = device_bytes - self.param_bytes
        return max(0, int(room // self.cache_per_sequence)) if self.cache_per_sequence else 0

    def table(self, device_gb: Optional[float] = None) -> str:
        other = str(self.dtype).replace("torch.", "")
        lines = [f"one rank of {self.tp}: experts {self.experts}, other weights {other}",
                 f"  {'component':<34}{'parameters':>16}{'GB':>10}"]
        for name, nbytes in self.params.items():
            lines.append(f"  {name:<34}{self.param_counts[name] / 1e9:>14.3f} G{nbytes / GB:>10.2f}")
        lines.append(f"  {'total':<34}{sum(self.param_counts.values()) / 1e9:>14.3f} G{self.param_bytes / GB:>10.2f}")
        lines.append(f"cache per sequence at context {self.context}: "
                     + " + ".join(f"{k} {v / GB:.3f} GB" for k, v in self.cache.items())
                     + f" = {self.cache_per_sequence / GB:.3f} GB")
        lines.append(f"parameters + {self.batch} sequence(s): {self.total / GB:.2f} GB")
        if device_gb is not None:
            verdict = "fits" if self.fits(device_gb * GB) else "does NOT fit"
            lines.append(f"device {device_gb:g} GB: {verdict} ({(device_gb * GB - self.total) / GB:+.2f} GB left; "
                         f"{self.sequences_that_fit(device_gb * GB)} sequence(s) of {self.context} tokens fit beside "
                         f"the parameters; activations not counted)")
        return "\n".join(lines)


class _Count:
    """Accumulates elements and bytes per component."""

    def __init__(self, dtype: torch.dtype):
        self.dtype, self.counts, self.bytes = dtype, {}, {}

    def add(self, component: str, numel: int, itemsize: Optional[int] = None, nbytes: Optional[int] = None) -> None:
        self.counts[component] = self.counts.get(component, 0) + numel
        if nbytes is None:
            nbytes = numel * (self.dtype.itemsize if itemsize is None else itemsize)
        self.bytes[component] = self.bytes.get(component, 0) + nbytes


def _split(n: int, tp: int, what: str) -> int:
    if n % tp:
        raise ValueError(f"{what} {n} does not split over tensor-parallel size {tp}")
    return n // tp


def _mla(c: KimiK3TextConfig, tp: int, n: _Count) -> None:
    D, H = c.hidden_size, _split(c.num_attention_heads, tp, "MLA num_attention_heads")
    qk = c.qk_nope_head_dim + c.qk_rope_head_dim
    a = "attention (MLA)"
    if c.q_lora_rank is not None:
        n.add(a, c.q_lora_rank * D + c.q_lora_rank + H * qk * c.q_lora_rank)
    else:
        n.add(a, H * qk * D)
    n.add(a, (c.kv_lora_rank + c.qk_rope_head_dim) * D + c.kv_lora_rank
          + H * (c.qk_nope_head_dim + c.v_head_dim) * c.kv_lora_rank)
    n.add(a, (H * c.v_head_dim * D if c.mla_use_output_gate else 0) + D * H * c.v_head_dim)


def _kda(c: KimiK3TextConfig, tp: int, n: _Count) -> None:
    lac, D = c.linear_attn_config, c.hidden_size
    H, K = _split(lac["num_heads"], tp, "KDA num_heads"), lac["head_dim"]
    P, W = H * K, lac.get("short_conv_kernel_size", 4)
    a = "attention (KDA)"
    n.add(a, 3 * P * D + K * D + P * K + H * D + D * P)               # q, k, v, f_a, f_b, b, o
    n.add(a, P * D if lac.get("use_full_rank_gate", True) else K * D + P * K)
    n.add(a, 3 * P * W + H + P + K, itemsize=4)                        # convs, A_log, dt_bias, o_norm: fp32


def _ffn(c: KimiK3TextConfig, layer: int, tp: int, experts: Optional[torch.dtype], n: _Count) -> None:
    D = c.hidden_size
    if not c.is_moe_layer(layer):
        n.add("dense MLP", 3 * D * _split(c.intermediate_size, tp, "intermediate_size"))
        return
    E, L = c.num_experts, c.routed_expert_hidden_size or D
    I = _split(c.moe_intermediate_size, tp, "moe_intermediate_size")
    n.add("router", E * D)
    n.add("router", E, itemsize=4)                                     # e_score_correction_bias
    if c.routed_expert_hidden_size is not None:
        n.add("latent projections + norm", 2 * L * D + (L if c.latent_moe_use_norm else 0))
    if c.num_shared_experts:
        n.add("shared experts", 3 * D * _split(c.moe_intermediate_size * c.num_shared_experts, tp,
                                                "shared experts' intermediate size"))
    weights = 3 * E * I * L
    if experts is None:      # MXFP4: codes [rows, cols/2] + scales [rows, cols/32], a byte each
        n.add("routed experts", weights, nbytes=weights // 2 + weights // GROUP)
    else:
        n.add("routed experts", weights, itemsize=experts.itemsize)


def _layer(c: KimiK3TextConfig, i: int, tp: int, experts, n: _Count, mla: bool, attn_res: bool) -> None:
    D = c.hidden_size
    (_mla if mla else _kda)(c, tp, n)
    _ffn(c, i, tp, experts, n)
    n.add("norms + AttnRes", 2 * D + (4 * D if attn_res else 0))


def _vision(config: KimiK3Config, n: _Count) -> None:
    from .vision import MoonViT, PatchMergerV2
    with torch.device("meta"):
        numel = sum(p.numel() for m in (MoonViT(config.vision_config), PatchMergerV2(config.vision_config))
                    for p in m.parameters())
    n.add("vision tower + projector", numel)


def _caches(c: KimiK3TextConfig, tp: int, dtype: torch.dtype, context: int) -> dict:
    """Per sequence: the MLA latent cache (not split by heads: each rank holds all of it) and the KDA states
    (split by heads), as ``KimiK3Cache.allocate`` makes them; MTP layers (MLA) hold their own latent cache."""
    lac = c.linear_attn_config
    mla = sum(c.is_mla_layer(i) for i in range(c.num_hidden_layers)) + c.num_nextn_predict_layers
    kda = c.num_hidden_layers - sum(c.is_mla_layer(i) for i in range(c.num_hidden_layers))
    H, K = _split(lac["num_heads"], tp, "KDA num_heads"), lac["head_dim"]
    W = lac.get("short_conv_kernel_size", 4)
    return {"MLA latent cache": mla * context * (c.kv_lora_rank + c.qk_rope_head_dim) * dtype.itemsize,
            "KDA state": kda * (3 * H * K * (W - 1) * dtype.itemsize + H * K * K * 4)}


def memory_plan(config: Optional[KimiK3Config] = None, tp: int = 1, experts="mxfp4", context: int = 131072,
                batch: int = 1, dtype: torch.dtype = torch.bfloat16, vision: bool = True) -> MemoryPlan:
    """Bytes per tensor-parallel rank of ``config`` (default: the published K3), parameters as loaded by
    ``from_pretrained(..., experts=experts, dtype=dtype)`` (the tensors the checkpoint keeps in fp32 stay fp32),
    plus ``batch`` sequences' cache at ``context`` tokens."""
    config = config if config is not None else KimiK3Config.kimi_k3()
    if not isinstance(config, KimiK3Config):
        config = KimiK3Config(text_config=config)
    c = config.text_config
    experts_float = experts_dtype(experts)
    if experts_float is not None and experts_float != dtype:
        raise ValueError(f"float experts ({experts}) compute in the model's dtype ({dtype})")
    n = _Count(dtype)
    D, V = c.hidden_size, _split(c.vocab_size, tp, "vocab_size")             # both split by vocabulary
    n.add("embedding", V * D)
    n.add("lm_head", V * D)
    for i in range(c.num_hidden_layers):
        _layer(c, i, tp, experts_float, n, c.is_mla_layer(i), bool(c.attn_res_block_size))
    n.add("norms + AttnRes", D + (2 * D if c.attn_res_block_size else 0))     # final norm, output AttnRes
    for s in range(c.num_nextn_predict_layers):                               # MLA, plain residual
        _layer(c, c.num_hidden_layers + s, tp, experts_float, n, True, False)
        n.add("MTP", 2 * D + 2 * D * D + D + V * D)                            # enorm, hnorm, eh_proj, shared head
    if vision:
        _vision(config, n)
    name = "mxfp4" if experts_float is None else str(experts_float).replace("torch.", "")
    order = [k for k in COMPONENTS if k in n.bytes]
    return MemoryPlan(tp, name, dtype, context, batch, {k: n.bytes[k] for k in order}, {k: n.counts[k] for k in order},
                      _caches(c, tp, dtype, context))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m k3compile.model.plan", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", help="a config.json or a checkpoint directory (default: the published K3)")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--experts", default="mxfp4", help="mxfp4 (as published), bf16, float16, float32")
    parser.add_argument("--dtype", default=None, help="the other weights' dtype (default bf16, or the float "
                                                      "experts' dtype)")
    parser.add_argument("--context", type=int, default=131072, help="tokens per sequence")
    parser.add_argument("--batch", type=int, default=1, help="sequences")
    parser.add_argument("--device-gb", type=float, default=None, help="device memory in GB (10^9 bytes)")
    args = parser.parse_args(argv)
    config = None
    if args.config:
        from pathlib import Path
        from .loading import read_config
        path = Path(args.config)
        config = read_config(path if path.is_dir() else path.parent)
    experts = experts_dtype(args.experts)
    dtype = experts_dtype(args.dtype) if args.dtype else (experts or torch.bfloat16)
    plan = memory_plan(config, tp=args.tp, experts=args.experts, context=args.context, batch=args.batch,
                       dtype=dtype)
    print(plan.table(args.device_gb))
    return 0 if args.device_gb is None or plan.fits(args.device_gb * GB) else 1


if __name__ == "__main__":
    sys.exit(main())
