"""Kimi K3 configuration: the published ``config.json`` keys, plus constructors for test and benchmark sizes.

``KimiK3Config`` is the top-level (multimodal) config, ``model_type = "kimi_k3"``. Its ``text_config`` is always
*our* ``KimiK3TextConfig``, built straight from the dict, whatever ``model_type`` the dict carries: the published
text config says ``"kimi_linear"``, which transformers would resolve to its own Kimi Linear config and lose K3's
keys (AttnRes, latent MoE, SiTU, the gate lower bound). When written out, the text config says ``"kimi_linear"``
again, so a saved ``config.json`` has the published layout.

Configs follow the remote-code convention (explicit ``__init__`` + ``super().__init__(**kwargs)``), which works on
transformers 5.x both before and after configs became dataclasses.
"""
from __future__ import annotations

import copy
from typing import Any, Optional

from transformers import PretrainedConfig

PUBLISHED_TEXT_MODEL_TYPE = "kimi_linear"


def official_full_attn_layers(num_hidden_layers: int) -> list[int]:
    """1-based MLA layers of K3's schedule: every 4th layer and the last one."""
    n = num_hidden_layers
    return [p for p in range(1, n + 1) if p % 4 == 0 or p == n]


def _linear_attn_config(num_heads, head_dim, num_hidden_layers, gate_lower_bound=-5.0, full_attn_layers=None,
                        use_full_rank_gate=True, short_conv_kernel_size=4) -> dict:
    full = list(full_attn_layers) if full_attn_layers is not None else official_full_attn_layers(num_hidden_layers)
    return {
        "num_heads": num_heads,
        "head_dim": head_dim,
        "short_conv_kernel_size": short_conv_kernel_size,
        "gate_lower_bound": gate_lower_bound,
        "use_full_rank_gate": use_full_rank_gate,
        "full_attn_layers": full,
        "kda_layers": [p for p in range(1, num_hidden_layers + 1) if p not in full],
    }


class KimiK3TextConfig(PretrainedConfig):
    """The text tower (published ``text_config``). Defaults are the published Kimi K3 values."""

    model_type = "kimi_k3_text"

    def __init__(
        self,
        vocab_size: int = 163840,
        hidden_size: int = 7168,
        num_hidden_layers: int = 93,
        num_attention_heads: int = 96,
        num_key_value_heads: int = 96,
        q_lora_rank: Optional[int] = 1536,
        kv_lora_rank: int = 512,
        qk_nope_head_dim: int = 128,
        qk_rope_head_dim: int = 64,
        v_head_dim: int = 128,
        mla_use_nope: bool = True,
        mla_use_output_gate: bool = True,
        linear_attn_config: Optional[dict] = None,
        intermediate_size: int = 33792,
        first_k_dense_replace: int = 1,
        moe_layer_freq: int = 1,
        num_experts: Optional[int] = 896,
        num_experts_per_token: int = 16,
        num_shared_experts: int = 2,
        moe_intermediate_size: int = 3072,
        routed_expert_hidden_size: Optional[int] = 3584,
        latent_moe_use_norm: bool = True,
        moe_router_activation_func: str = "sigmoid",
        topk_method: str = "noaux_tc",
        use_grouped_topk: bool = True,
        num_expert_group: int = 1,
        topk_group: int = 1,
        moe_renormalize: bool = True,
        routed_scaling_factor: float = 1.0,
        hidden_act: str = "situ",
        activation_situ_beta: float = 4.0,
        activation_situ_linear_beta: Optional[float] = 25.0,
        attn_res_block_size: Optional[int] = 12,
        rms_norm_eps: float = 1e-5,
        mla_lora_norm_eps: float = 1e-6,
        max_position_embeddings: int = 1048576,
        num_nextn_predict_layers: int = 0,
        rope_theta: float = 10000.0,
        head_dim: int = 74,
        tie_word_embeddings: bool = False,
        bos_token_id: int = 163584,
        eos_token_id: int = 163586,
        pad_token_id: int = 163839,
        **kwargs,
    ):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads
        self.q_lora_rank = q_lora_rank
        self.kv_lora_rank = kv_lora_rank
        self.qk_nope_head_dim = qk_nope_head_dim
        self.qk_rope_head_dim = qk_rope_head_dim
        self.v_head_dim = v_head_dim
        self.mla_use_nope = mla_use_nope
        self.mla_use_output_gate = mla_use_output_gate
        if linear_attn_config is None:
            linear_attn_config = _linear_attn_config(96, 128, num_hidden_layers)
        self.linear_attn_config = dict(linear_attn_config)
        self.intermediate_size = intermediate_size
        self.first_k_dense_replace = first_k_dense_replace
        self.moe_layer_freq = moe_layer_freq
        self.num_experts = num_experts
        self.num_experts_per_token = num_experts_per_token
        self.num_shared_experts = num_shared_experts
        self.moe_intermediate_size = moe_intermediate_size
        self.routed_expert_hidden_size = routed_expert_hidden_size
        self.latent_moe_use_norm = latent_moe_use_norm
        self.moe_router_activation_func = moe_router_activation_func
        self.topk_method = topk_method
        self.use_grouped_topk = use_grouped_topk
        self.num_expert_group = num_expert_group
        self.topk_group = topk_group
        self.moe_renormalize = moe_renormalize
        self.routed_scaling_factor = routed_scaling_factor
        self.hidden_act = hidden_act
        self.activation_situ_beta = activation_situ_beta
        self.activation_situ_linear_beta = activation_situ_linear_beta
        self.attn_res_block_size = attn_res_block_size
        self.rms_norm_eps = rms_norm_eps
        self.mla_lora_norm_eps = mla_lora_norm_eps
        self.max_position_embeddings = max_position_embeddings
        self.num_nextn_predict_layers = num_nextn_predict_layers
        self.rope_theta = rope_theta
        self.head_dim = head_dim
        self.tie_word_embeddings = tie_word_embeddings
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.pad_token_id = pad_token_id
        kwargs.pop("model_type", None)  # "kimi_linear" in the published file; this class decides
        super().__init__(**kwargs)
        self.check()

    # -- derived -----------------------------------------------------------------------------------------------
    @property
    def full_attn_layers(self) -> list[int]:
        """1-based indices of the MLA layers."""
        return list(self.linear_attn_config.get("full_attn_layers") or [])

    def is_mla_layer(self, i: int) -> bool:
        """0-based layer ``i`` is a (gated NoPE) MLA layer; otherwise KDA."""
        return (i + 1) in self.full_attn_layers

    def is_moe_layer(self, i: int) -> bool:
        return (self.num_experts is not None and i >= self.first_k_dense_replace
                and i % self.moe_layer_freq == 0)

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def check(self) -> None:
        """Reject configurations this implementation would compute wrongly."""
        lac = self.linear_attn_config
        if self.hidden_act != "situ" and self.hidden_act != "silu":
            raise ValueError(f"hidden_act {self.hidden_act!r} unsupported (situ or silu)")
        if self.num_experts is not None:
            if self.moe_router_activation_func != "sigmoid":
                raise ValueError("only sigmoid routing is implemented")
            if self.num_expert_group > 1 and self.num_expert_group > self.topk_group:
                raise ValueError("grouped top-k routing (num_expert_group > topk_group) is not implemented")
        if not self.mla_use_nope and self.full_attn_layers:
            raise ValueError("MLA with RoPE is not part of Kimi K3; only mla_use_nope=True is implemented")
        bad = [p for p in self.full_attn_layers if not 1 <= p <= self.num_hidden_layers]
        if bad:
            raise ValueError(f"full_attn_layers out of range: {bad}")
        if any(key not in lac for key in ("num_heads", "head_dim")):
            raise ValueError("linear_attn_config needs num_heads and head_dim")

    def to_dict(self) -> dict[str, Any]:
        out = super().to_dict()
        out["model_type"] = self.model_type
        return out


class KimiK3VisionConfig(PretrainedConfig):
    """MoonViT-V2 + patchmergerv2 projector (published ``vision_config``, spec §2.2). Data only here."""

    model_type = "kimi_k3_vision"

    def __init__(
        self,
        patch_size: int = 14,
        vt_hidden_size: int = 1024,
        vt_intermediate_size: int = 4096,
        vt_num_hidden_layers: int = 27,
        vt_num_attention_heads: int = 12,
        qkv_hidden_size: int = 1536,
        norm_type: str = "rmsnorm",
        mlp_type: str = "mlp2",
        activation_func: str = "gelu_pytorch_tanh",
        attn_bias: bool = False,
        linear_bias: bool = False,
        patch_embed_proj_bias: bool = False,
        pos_emb_type: str = "divided_fixed",
        init_pos_emb_height: int = 64,
        init_pos_emb_width: int = 64,
        init_pos_emb_time: int = 4,
        pos_emb_interpolation_mode: str = "bilinear",
        merge_kernel_size=(2, 2),
        merge_type: str = "sd2_tpool",
        video_attn_type: str = "spatial_temporal",
        mm_projector_type: str = "patchmergerv2",
        mm_hidden_size: int = 1024,
        projector_hidden_act: str = "gelu",
        projector_ln_eps: float = 1e-5,
        text_hidden_size: int = 7168,
        rope_max_grid: int = 512,
        **kwargs,
    ):
        self.patch_size = patch_size
        self.vt_hidden_size = vt_hidden_size
        self.vt_intermediate_size = vt_intermediate_size
        self.vt_num_hidden_layers = vt_num_hidden_layers
        self.vt_num_attention_heads = vt_num_attention_heads
        self.qkv_hidden_size = qkv_hidden_size
        self.norm_type = norm_type
        self.mlp_type = mlp_type
        self.activation_func = activation_func
        self.attn_bias = attn_bias
        self.linear_bias = linear_bias
        self.patch_embed_proj_bias = patch_embed_proj_bias
        self.pos_emb_type = pos_emb_type
        self.init_pos_emb_height = init_pos_emb_height
        self.init_pos_emb_width = init_pos_emb_width
        self.init_pos_emb_time = init_pos_emb_time
        self.pos_emb_interpolation_mode = pos_emb_interpolation_mode
        self.merge_kernel_size = list(merge_kernel_size)
        self.merge_type = merge_type
        self.video_attn_type = video_attn_type
        self.mm_projector_type = mm_projector_type
        self.mm_hidden_size = mm_hidden_size
        self.projector_hidden_act = projector_hidden_act
        self.projector_ln_eps = projector_ln_eps
        self.text_hidden_size = text_hidden_size
        self.rope_max_grid = rope_max_grid
        kwargs.pop("model_type", None)
        super().__init__(**kwargs)

    @classmethod
    def tiny(cls, **overrides) -> "KimiK3VisionConfig":
        """Spec §14.2: every width distinct, head_dim 24 (divisible by 4 for the 2-D RoPE)."""
        values = dict(patch_size=14, vt_hidden_size=64, vt_intermediate_size=128, vt_num_hidden_layers=2,
                      vt_num_attention_heads=4, qkv_hidden_size=96, init_pos_emb_height=16, init_pos_emb_width=16,
                      init_pos_emb_time=4, mm_hidden_size=64, text_hidden_size=128, rope_max_grid=64)
        values.update(overrides)
        return cls(**values)


# The published K3 background behind transparent pixels: 8-px squares, white (255) top left, gray 180.
K3_TRANSPARENT_BG_CONFIG = {"pattern": "chessboard", "chessboard_square_size": 8, "chessboard_square_on_top_left": True,
                            "chessboard_white_value": 255, "chessboard_gray_value": 180}
# spec §2.3 (preprocessor_config.json "media_proc_cfg")
DEFAULT_MEDIA_PROC_CFG = {
    "patch_size": 14, "merge_kernel_size": 2, "in_patch_limit": 65536, "patch_limit_on_one_side": 512,
    "fixed_output_tokens": None, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
    "in_patch_limit_each_frame": 16384, "sample_fps": 8.0, "temporal_merge_kernel_size": 4,
    "transparent_bg_config": K3_TRANSPARENT_BG_CONFIG, "transparent_bg_fill_stage": "after_resize",
}
TINY_MEDIA_PROC_CFG = {**DEFAULT_MEDIA_PROC_CFG, "in_patch_limit": 1024, "patch_limit_on_one_side": 64,
                       "in_patch_limit_each_frame": 1024}


class KimiK3Config(PretrainedConfig):
    """Top-level Kimi K3 config (``model_type = "kimi_k3"``), the layout of the published ``config.json``."""

    model_type = "kimi_k3"

    def __init__(
        self,
        text_config: Optional[dict | KimiK3TextConfig] = None,
        vision_config: Optional[dict | KimiK3VisionConfig] = None,
        media_proc_cfg: Optional[dict] = None,
        media_placeholder_token_id: int = 163605,
        image_placeholder: str = "<|kimi_image_placeholder|>",
        ignore_index: int = -100,
        bos_token_id: int = 163584,
        eos_token_id: int = 163586,
        pad_token_id: int = 163839,
        tie_word_embeddings: bool = False,
        **kwargs,
    ):
        if text_config is None:
            text_config = KimiK3TextConfig()
        elif isinstance(text_config, dict):
            text_config = KimiK3TextConfig(**text_config)
        elif not isinstance(text_config, KimiK3TextConfig):
            # e.g. a transformers KimiLinearConfig: it would drop K3's keys, so take its dict through ours
            text_config = KimiK3TextConfig(**text_config.to_dict())
        if vision_config is None:
            vision_config = KimiK3VisionConfig(text_hidden_size=text_config.hidden_size)
        elif isinstance(vision_config, dict):
            vision_config = KimiK3VisionConfig(**vision_config)
        self.text_config = text_config
        self.vision_config = vision_config
        self.media_proc_cfg = copy.deepcopy(media_proc_cfg if media_proc_cfg is not None else DEFAULT_MEDIA_PROC_CFG)
        self.media_placeholder_token_id = media_placeholder_token_id
        self.image_placeholder = image_placeholder
        self.ignore_index = ignore_index
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.pad_token_id = pad_token_id
        self.tie_word_embeddings = tie_word_embeddings
        kwargs.pop("model_type", None)
        kwargs.setdefault("architectures", ["KimiK3ForConditionalGeneration"])
        super().__init__(**kwargs)

    def to_dict(self) -> dict[str, Any]:
        out = super().to_dict()
        for key in ("text_config", "vision_config"):
            sub = getattr(self, key)
            out[key] = sub.to_dict() if isinstance(sub, PretrainedConfig) else sub
            out[key].pop("transformers_version", None)
        out["text_config"]["model_type"] = PUBLISHED_TEXT_MODEL_TYPE  # the published layout
        return out

    def to_diff_dict(self) -> dict[str, Any]:
        # Sub-configs are written whole: a diff against a default-constructed config would depend on our
        # defaults, and the file must stand on its own.
        out = super().to_diff_dict()
        full = self.to_dict()
        out["text_config"] = full["text_config"]
        out["vision_config"] = full["vision_config"]
        return out

    # -- constructors ------------------------------------------------------------------------------------------
    @classmethod
    def kimi_k3(cls, **text_overrides) -> "KimiK3Config":
        """The published moonshotai/Kimi-K3 sizes (2.78 T parameters)."""
        return cls(text_config=KimiK3TextConfig(**text_overrides))

    @classmethod
    def tiny(cls, **text_overrides) -> "KimiK3Config":
        """Spec §14.2: every code path of the real model at test size, all widths distinct."""
        layers = text_overrides.pop("num_hidden_layers", 13)
        heads = text_overrides.pop("linear_num_heads", 6)
        values = dict(
            vocab_size=512, hidden_size=128, num_hidden_layers=layers, num_attention_heads=6,
            num_key_value_heads=6, q_lora_rank=96, kv_lora_rank=48, qk_nope_head_dim=32, qk_rope_head_dim=16,
            v_head_dim=32, linear_attn_config=_linear_attn_config(heads, 32, layers),
            intermediate_size=320, num_experts=16, num_experts_per_token=4, num_shared_experts=2,
            moe_intermediate_size=48, routed_expert_hidden_size=64, attn_res_block_size=5,
            max_position_embeddings=4096, bos_token_id=2, eos_token_id=1, pad_token_id=0,
        )
        values.update(text_overrides)
        return cls(text_config=KimiK3TextConfig(**values), vision_config=KimiK3VisionConfig.tiny(),
                   media_proc_cfg=TINY_MEDIA_PROC_CFG, media_placeholder_token_id=500,
                   bos_token_id=values["bos_token_id"], eos_token_id=values["eos_token_id"],
                   pad_token_id=values["pad_token_id"])

    @classmethod
    def micro(cls, **text_overrides) -> "KimiK3Config":
        """Spec §14.2 micro variant: 4 layers (KDA, KDA, KDA, MLA), AttnRes block 2."""
        values = dict(num_hidden_layers=4, attn_res_block_size=2)
        values.update(text_overrides)
        return cls.tiny(**values)

    @classmethod
    def slice(cls, num_hidden_layers: int = 4, num_experts: int = 32, vocab_size: int = 163840,
              **text_overrides) -> "KimiK3Config":
        """Real widths, few layers and experts (for single-GPU benchmarks). The layer schedule keeps K3's rule:
        MLA every 4th layer and last; layer 0 dense; top-k = min(16, num_experts)."""
        values = dict(num_hidden_layers=num_hidden_layers, num_experts=num_experts,
                      num_experts_per_token=min(16, num_experts), vocab_size=vocab_size,
                      linear_attn_config=_linear_attn_config(96, 128, num_hidden_layers))
        values.update(text_overrides)
        return cls(text_config=KimiK3TextConfig(**values))
