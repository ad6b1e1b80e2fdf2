"""The Kimi K3 model (spec §7-10): decoder layers wired by Block Attention Residuals, the vision path, inference
and generate.

Shape legend: B batch, T tokens, D hidden, Vocab vocabulary, N stored AttnRes blocks.
Module names follow the published checkpoint: ``language_model.model.layers.{i}.self_attn...``,
``language_model.lm_head.weight``, ``vision_tower.*``, ``mm_projector.*``; state-dict keys equal the published
tensor names (the MTP module's through state-dict hooks: ``language_model.model.layers.{L+s}.*``).
"""
from __future__ import annotations

import math
import numbers
from typing import Optional

import torch
from torch import nn

from .attn_res import attn_res
from .cache import KimiK3Cache
from .config import KimiK3Config, KimiK3TextConfig
from .kda import KimiDeltaAttention
from .layers import KimiMLP, RMSNorm, VocabParallelEmbedding, VocabParallelHead
from .mla import KimiMLAAttention
from .moe import Experts, KimiLatentMoE, experts_dtype
from .mxfp4 import GROUP, scale_for_rms
from .parallel import SINGLE, TPContext
from .vision import MoonViT, PatchMergerV2, grid_list, image_features, merge_image_features

# Tensors the checkpoint keeps in fp32 (and so does ``set_dtype``).
FP32_PARAMS = ("A_log", "dt_bias", "q_conv1d.weight", "k_conv1d.weight", "v_conv1d.weight", "o_norm.weight",
               "e_score_correction_bias")


class AttnResMix(nn.Module):
    """The weights of one AttnRes mixing point: ``*_res_norm.weight`` [D] and ``*_res_proj.weight`` [1, D]."""

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.norm = RMSNorm(hidden_size, eps)
        self.proj = nn.Linear(hidden_size, 1, bias=False)


def left_padding(attention_mask: torch.Tensor, input_ids: torch.Tensor) -> Optional[torch.Tensor]:
    """attention_mask [B, T] (1 token, 0 padding; bool or integer) -> each row's padding count [B] int64, None
    when no row is padded. Raises ValueError / TypeError unless each row is zeros then at least one one."""
    if not isinstance(attention_mask, torch.Tensor):
        raise TypeError(f"attention_mask must be a torch.Tensor like input_ids, got {type(attention_mask).__name__}")
    if attention_mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask has shape {list(attention_mask.shape)}, input_ids "
                         f"{list(input_ids.shape)}: they must be equal")
    if attention_mask.dtype.is_floating_point or attention_mask.dtype.is_complex:
        raise TypeError(f"attention_mask must be bool or integer (1 token, 0 padding), got {attention_mask.dtype}")
    if attention_mask.device != input_ids.device:
        raise ValueError(f"attention_mask is on {attention_mask.device}, input_ids on {input_ids.device}")
    mask = attention_mask.long()
    if ((mask != 0) & (mask != 1)).any():
        raise ValueError("attention_mask must hold only 0 (padding) and 1 (token)")
    after_token = mask[:, 1:] < mask[:, :-1]                              # a 0 right after a 1
    if after_token.any():
        row, col = (int(i) for i in after_token.nonzero()[0])
        raise ValueError(f"attention_mask row {row} has padding (0) after a token (1), at position {col + 1}: "
                         "only left padding is supported (tokenizer padding_side='left')")
    if not mask[:, -1].all():
        raise ValueError(f"attention_mask row {int((mask[:, -1] == 0).long().argmax())} has no token")
    pad = input_ids.shape[1] - mask.sum(1)
    return pad if bool(pad.any()) else None


class KimiDecoderLayer(nn.Module):
    """One decoder layer. attn_res_block_size: -1 = the config's, 0 = plain pre-norm residual (MTP);
    is_mla: None = the config's 1-based ``full_attn_layers`` rule (MTP layers past the last index pass True)."""

    # The AttnRes mix, as an attribute so that a compiler can compile it apart (k3compile/regions.py does).
    attn_res_mix = staticmethod(attn_res)

    def __init__(self, config: KimiK3TextConfig, layer_idx: int, tp: TPContext = SINGLE,
                 attn_res_block_size: Optional[int] = -1, is_mla: Optional[bool] = None):
        super().__init__()
        D, eps = config.hidden_size, config.rms_norm_eps
        self.layer_idx = layer_idx
        self.block_size = config.attn_res_block_size if attn_res_block_size == -1 else attn_res_block_size
        self.eps = eps
        self.is_mla = config.is_mla_layer(layer_idx) if is_mla is None else bool(is_mla)
        self.self_attn = (KimiMLAAttention if self.is_mla else KimiDeltaAttention)(config, layer_idx, tp)
        if config.is_moe_layer(layer_idx):
            self.block_sparse_moe = KimiLatentMoE(config, tp)
        else:
            self.mlp = KimiMLP(config, D, config.intermediate_size, tp)
        self.input_layernorm = RMSNorm(D, eps)
        self.post_attention_layernorm = RMSNorm(D, eps)
        if self.block_size:
            self.self_attention_res_norm = RMSNorm(D, eps)
            self.self_attention_res_proj = nn.Linear(D, 1, bias=False)
            self.mlp_res_norm = RMSNorm(D, eps)
            self.mlp_res_proj = nn.Linear(D, 1, bias=False)

    def attention(self, x: torch.Tensor, state, pos: torch.Tensor, start: Optional[torch.Tensor] = None,
                  valid: Optional[torch.Tensor] = None) -> torch.Tensor:
        return self.self_attn(x, state, pos, start) if self.is_mla else self.self_attn(x, state, valid)

    def ffn(self, x: torch.Tensor) -> torch.Tensor:
        return self.block_sparse_moe(x) if hasattr(self, "block_sparse_moe") else self.mlp(x)

    def forward(self, prefix: torch.Tensor, blocks: list, state, pos: torch.Tensor,
                start: Optional[torch.Tensor] = None, valid: Optional[torch.Tensor] = None):
        """prefix [B, T, D] (sum of the current block so far), blocks: N completed block sums [B, T, D]
        -> (prefix, blocks) after this layer. Left padding: start [B] (MLA) and valid [B, T] (a KDA prefill),
        as ``KimiK3TextModel.forward`` makes them."""
        if not self.block_size:  # plain pre-norm residual (MTP / draft layers)
            h = prefix + self.attention(self.input_layernorm(prefix), state, pos, start, valid)
            return h + self.ffn(self.post_attention_layernorm(h)), blocks
        h = self.attn_res_mix(prefix, blocks, self.self_attention_res_proj.weight,
                              self.self_attention_res_norm.weight, self.eps) if blocks else prefix
        starts_block = self.layer_idx % self.block_size == 0
        if starts_block:  # the finished block becomes a source; a new partial sum starts
            blocks = blocks + [prefix]
        a = self.attention(self.input_layernorm(h), state, pos, start, valid)
        prefix = a if starts_block else prefix + a
        h = self.attn_res_mix(prefix, blocks, self.mlp_res_proj.weight, self.mlp_res_norm.weight, self.eps)
        prefix = prefix + self.ffn(self.post_attention_layernorm(h))
        return prefix, blocks


class KimiK3TextModel(nn.Module):
    def __init__(self, config: KimiK3TextConfig, tp: TPContext = SINGLE):
        super().__init__()
        D = config.hidden_size
        self.config = config
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, D, tp)
        self.layers = nn.ModuleList(KimiDecoderLayer(config, i, tp) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(D, config.rms_norm_eps)
        self.use_attn_res = bool(config.attn_res_block_size)
        if self.use_attn_res:
            self.output_attn_res_norm = RMSNorm(D, config.rms_norm_eps)
            self.output_attn_res_proj = nn.Linear(D, 1, bias=False)

    def forward(self, inputs_embeds: torch.Tensor, cache: KimiK3Cache) -> torch.Tensor:
        """inputs_embeds [B, T, D] -> hidden [B, T, D] after the output AttnRes, before the final norm.
        Advances ``cache.pos`` by T. A left-padded batch (``cache.start`` set) keeps its padding out of the
        state; every other part of a layer is per token."""
        T = inputs_embeds.shape[1]
        start, valid = cache.start, None
        if start is not None and T > 1:  # [B, T]: False at the padding of a prefill
            valid = cache.pos + torch.arange(T, device=inputs_embeds.device) >= start[:, None]
        prefix, blocks = inputs_embeds, []
        for layer, state in zip(self.layers, cache.layers):
            prefix, blocks = layer(prefix, blocks, state, cache.pos, start, valid)
        if self.use_attn_res:
            prefix = attn_res(prefix, blocks, self.output_attn_res_proj.weight, self.output_attn_res_norm.weight,
                              self.config.rms_norm_eps)
        cache.pos.add_(inputs_embeds.shape[1])
        return prefix


class KimiK3ForCausalLM(nn.Module):
    """The text tower with its head (``language_model`` in the published checkpoint)."""

    def __init__(self, config: KimiK3TextConfig, tp: TPContext = SINGLE):
        super().__init__()
        self.config = config
        self.model = KimiK3TextModel(config, tp)
        self.lm_head = VocabParallelHead(config.hidden_size, config.vocab_size, tp)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.model.norm(hidden))


class KimiK3ForConditionalGeneration(nn.Module):
    """Kimi K3: text tower, MoonViT-V2 vision tower + patchmergerv2 projector, optional MTP module.

    >>> model = KimiK3ForConditionalGeneration(KimiK3Config.tiny()).eval()
    >>> new_tokens = model.generate(input_ids, max_new_tokens=8)        # input_ids [B, T] int64
    >>> batch = KimiK3Processor(...)(text=prompt, images=images)        # images enter at prefill only
    >>> new_tokens = model.generate(batch["input_ids"], 8, pixel_values=batch["pixel_values"],
    ...                             grid_thws=batch["grid_thws"])
    """

    config_class = KimiK3Config

    def __init__(self, config: KimiK3Config, tp: Optional[TPContext] = None):
        super().__init__()
        if isinstance(config, KimiK3TextConfig):
            config = KimiK3Config(text_config=config)
        self.config = config
        self.tp = tp or SINGLE
        self.language_model = KimiK3ForCausalLM(config.text_config, self.tp)
        self.init_weights()
        # The vision tower is replicated under TP (0.45 B parameters); its modules keep their own init.
        self.vision_tower = MoonViT(config.vision_config)
        self.mm_projector = PatchMergerV2(config.vision_config)
        if config.text_config.num_nextn_predict_layers > 0:
            from .mtp import KimiK3MultiTokenPredictor  # mtp.py imports this module
            self.mtp = KimiK3MultiTokenPredictor(config.text_config, self.tp)
            # state-dict keys stay the published names: mtp.layers.{s}.* <-> language_model.model.layers.{L+s}.*
            self.register_state_dict_post_hook(_publish_mtp_keys)
            self.register_load_state_dict_pre_hook(_unpublish_mtp_keys)

    # -- construction ------------------------------------------------------------------------------------------
    @torch.no_grad()
    def init_weights(self) -> None:
        """Random weights with O(1) activations everywhere (tests, benchmarks); loading overwrites them.
        (Text tower only: the vision tower and the MTP module initialise themselves.) A tensor-parallel rank draws
        its slices from the full model's distribution (a row-parallel weight's bound from the full fan-in). MXFP4
        experts: uniformly random codes, each scale the power of two that gives them the float init's RMS."""
        cfg = self.config.text_config
        for name, p in self.language_model.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            fan_in = p.shape[-1] if p.dim() else 1
            if getattr(p, "tp_dim", None) == p.dim() - 1:
                fan_in *= self.tp.world                                # the full row of a row-parallel slice
            if p.dtype == torch.uint8:                                 # MXFP4 codes and E8M0 scales
                if leaf.endswith("_scale"):
                    p.fill_(scale_for_rms((GROUP * fan_in) ** -0.5 / math.sqrt(3)))   # uniform(-b, b): b / sqrt(3)
                else:
                    p.random_(0, 256)
            elif name.endswith("A_log"):
                p.uniform_(1, 16).log_()
            elif name.endswith("dt_bias"):
                dt = torch.exp(torch.empty_like(p).uniform_(math.log(1e-3), math.log(1e-1)))
                p.copy_(dt + torch.log(-torch.expm1(-dt)))         # inverse softplus
            elif name.endswith("e_score_correction_bias"):
                p.normal_(0, 0.05)
            elif name.endswith("_res_proj.weight"):
                p.normal_(0, cfg.hidden_size ** -0.5)
            elif "norm" in name and leaf == "weight":
                p.fill_(1.0)
            elif name.endswith("embed_tokens.weight"):
                p.normal_(0, 1.0)
            elif p.dim() >= 2:
                bound = fan_in ** -0.5                             # fan-in (the kernel width for convs)
                p.uniform_(-bound, bound)

    def set_dtype(self, dtype: torch.dtype) -> "KimiK3ForConditionalGeneration":
        """Cast to ``dtype`` except the tensors the checkpoint keeps in fp32 (:data:`FP32_PARAMS`).
        Vision norm weights follow ``dtype`` (as published); the vision norms and RoPE compute in fp32."""
        for name, p in self.named_parameters():
            if p.dtype == torch.uint8:  # MXFP4 expert codes and scales: dequantised to the activations' dtype
                continue
            p.data = p.data.to(torch.float32 if name.endswith(FP32_PARAMS) else dtype)
        return self

    def convert_experts(self, form) -> "KimiK3ForConditionalGeneration":
        """Hold every routed expert in ``form``: ``"mxfp4"`` (packed codes + E8M0 scales, quantised if float:
        exact only for values MXFP4 holds), or a float form (``"bf16"``, ``"float32"``, a torch dtype; dequantised
        if packed). The forward then runs the matching expert functions of :mod:`.moe`."""
        dtype = experts_dtype(form)
        for module in self.modules():
            if isinstance(module, Experts):
                module.to_mxfp4() if dtype is None else module.to_float(dtype)
        return self

    @property
    def experts_packed(self) -> bool:
        """Whether the routed experts are held as MXFP4."""
        return any(m.packed for m in self.modules() if isinstance(m, Experts))

    @property
    def tp_size(self) -> int:
        return self.tp.world

    @property
    def text_model(self) -> KimiK3TextModel:
        return self.language_model.model

    @property
    def dtype(self) -> torch.dtype:
        return self.text_model.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.text_model.embed_tokens.weight.device

    def get_input_embeddings(self) -> VocabParallelEmbedding:
        return self.text_model.embed_tokens

    def embed_input_ids(self, input_ids: torch.Tensor, pixel_values: Optional[torch.Tensor] = None,
                        grid_thws=None) -> torch.Tensor:
        """input_ids [B, T] -> [B, T, D]; with images, their features replace the media-pad positions.

        pixel_values [N, 3, p, p] and grid_thws [n_images, 3] as the processor returns them (grid_thws may
        also be Python ints, which keeps a compiled prefill free of the data-dependent ``.tolist()``).
        Raises ValueError when the prompt's images (runs of media-pad tokens) do not match the given images.
        """
        embeds = self.get_input_embeddings()(input_ids)
        if pixel_values is None:
            if grid_thws is not None:
                raise ValueError("grid_thws given without pixel_values")
            return embeds  # (media-pad ids without images embed as text: decode steps may emit any id)
        if grid_thws is None:
            raise ValueError("pixel_values given without grid_thws")
        grids = grid_list(grid_thws)
        if not torch.compiler.is_compiling():
            self.check_media_runs(input_ids, grids)
        feats = image_features(self.vision_tower, self.mm_projector, pixel_values, grids)      # [M, D]
        return merge_image_features(embeds, input_ids, feats, self.config.media_placeholder_token_id)

    def check_media_runs(self, input_ids: torch.Tensor, grids: list[tuple[int, int, int]]) -> None:
        """Each image of the prompt is one run of media-pad tokens; compare runs and their lengths with
        the images' token counts (h·w / (kh·kw): frames are averaged) before any vision work is done."""
        kh, kw = self.vision_tower.merge_kernel_size
        want = [h * w // (kh * kw) for _, h, w in grids]
        is_pad = (input_ids == self.config.media_placeholder_token_id).cpu()
        runs = []
        for row in is_pad:
            edges = torch.diff(torch.cat([row.new_zeros(1), row, row.new_zeros(1)]).int()).nonzero().flatten()
            runs += (edges[1::2] - edges[0::2]).tolist()
        if len(runs) != len(want):
            raise ValueError(f"the prompt holds {len(runs)} image(s) (runs of media-pad tokens) but "
                             f"{len(want)} image(s) were given in pixel_values / grid_thws")
        if runs != want:
            raise ValueError(f"media-pad runs of the prompt {runs} do not match the images' token counts {want}")

    def check_input_ids(self, input_ids) -> None:
        """input_ids must be a non-empty [B, T] int64 tensor on the model's device, every id in [0, vocab):
        a ValueError / TypeError saying which, where the embedding would fail inside a compiled graph."""
        shape = list(getattr(input_ids, "shape", ()))
        if not isinstance(input_ids, torch.Tensor):
            raise TypeError(f"input_ids must be a torch.Tensor [batch, tokens] of int64, got "
                            f"{type(input_ids).__name__}")
        if input_ids.dim() != 2:
            hint = " (one prompt: input_ids[None])" if input_ids.dim() == 1 else ""
            raise ValueError(f"input_ids must be 2-D [batch, tokens], got shape {shape}{hint}")
        if input_ids.dtype != torch.long:
            raise TypeError(f"input_ids must be int64 (torch.long), got {input_ids.dtype}")
        if input_ids.numel() == 0:
            raise ValueError(f"input_ids is empty (shape {shape}): every row needs at least one token")
        if input_ids.device != self.device:
            raise ValueError(f"input_ids is on {input_ids.device}, the model on {self.device}")
        vocab = self.get_input_embeddings().num_embeddings
        lo, hi = (int(v) for v in torch.aminmax(input_ids))
        if lo < 0 or hi >= vocab:
            raise ValueError(f"input_ids holds token id {lo if lo < 0 else hi}, outside the vocabulary [0, {vocab})")

    def __call__(self, *args, **kwargs):
        # Runs before a compiled forward (model.compile() / k3compile.optimize() compile what super() calls):
        # grid_thws becomes Python ints (a tensor would need .tolist() inside the graph: a graph break), and
        # the ids and the images are checked here, as the compiled graph skips data-dependent checks.
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        if input_ids is not None and not torch.compiler.is_compiling():
            self.check_input_ids(input_ids)
        if len(args) > 3 and isinstance(args[3], torch.Tensor):  # forward(input_ids, cache, pixel_values, grid_thws)
            args = (*args[:3], tuple(grid_list(args[3])), *args[4:])
        if isinstance(kwargs.get("grid_thws"), torch.Tensor):
            kwargs["grid_thws"] = tuple(grid_list(kwargs["grid_thws"]))
        pixel_values = kwargs.get("pixel_values", args[2] if len(args) > 2 else None)
        if pixel_values is not None and not torch.compiler.is_compiling():
            grids = kwargs.get("grid_thws", args[3] if len(args) > 3 else None)
            if input_ids is not None and grids is not None:
                self.check_media_runs(input_ids, grid_list(grids))
        return super().__call__(*args, **kwargs)

    def allocate_cache(self, batch: int, max_len: int, dtype=None, device=None) -> KimiK3Cache:
        return KimiK3Cache.allocate(self.text_model, batch, max_len, dtype=dtype, device=device)

    new_cache = allocate_cache

    # -- inference ---------------------------------------------------------------------------------------------
    def forward(self, input_ids: Optional[torch.Tensor] = None, cache: Optional[KimiK3Cache] = None,
                pixel_values=None, grid_thws=None, inputs_embeds: Optional[torch.Tensor] = None,
                logits_to_keep: int = 0, return_hidden: bool = False):
        """input_ids [B, T] (or inputs_embeds [B, T, D]) -> logits [B, T', Vocab] (T' = logits_to_keep or T).

        pixel_values [N, 3, p, p] / grid_thws [n_images, 3]: images whose features replace the prompt's
        media-pad tokens (:meth:`embed_input_ids`); give them with the prompt only, not with decode steps.

        With ``cache`` the tokens continue the cached sequence and the cache is updated in place (T == 1 is a
        decode step); without, a fresh cache of length T is used. ``return_hidden`` also returns the hidden
        state before the final norm [B, T, D] (what the MTP module consumes).
        """
        if inputs_embeds is None:
            inputs_embeds = self.embed_input_ids(input_ids, pixel_values, grid_thws)
        if cache is None:
            cache = self.allocate_cache(inputs_embeds.shape[0], inputs_embeds.shape[1],
                                        device=inputs_embeds.device)
        hidden = self.text_model(inputs_embeds, cache)
        kept = hidden[:, -logits_to_keep:] if logits_to_keep else hidden
        logits = self.language_model.logits(kept)
        return (logits, hidden) if return_hidden else logits

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, max_new_tokens: int, attention_mask: Optional[torch.Tensor] = None,
                 cache: Optional[KimiK3Cache] = None, **forward_kwargs) -> torch.Tensor:
        """Greedy decoding. input_ids [B, T] int64 -> the new tokens [B, max_new_tokens] (0: [B, 0]).

        attention_mask [B, T] (1 token, 0 padding; as a tokenizer pads with ``padding_side="left"``): prompts
        of different lengths, left-padded; each row generates what it would alone. ``cache``: continue
        its sequence (padding only into an empty cache). Every argument is checked before any work, with a
        ValueError / TypeError saying what is wrong. Every step calls ``self(...)``, so a model compiled in
        place (``model.compile(...)``, ``k3compile.optimize``) decodes compiled.
        """
        self.check_input_ids(input_ids)
        B, T = input_ids.shape
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, numbers.Integral):
            raise TypeError(f"max_new_tokens must be an int, got {type(max_new_tokens).__name__}")
        if max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
        start = None if attention_mask is None else left_padding(attention_mask, input_ids)
        held = 0
        if cache is not None:
            held = int(cache.pos)
            if cache.batch_size != B:
                raise ValueError(f"cache is for a batch of {cache.batch_size}, input_ids holds {B} rows")
            if held + T + max_new_tokens - 1 > cache.max_len:
                raise ValueError(f"cache of length {cache.max_len} holds {held} tokens; "
                                 f"{T} + {max_new_tokens} more do not fit")
            if start is not None and held:
                raise ValueError(f"attention_mask pads rows of a prompt that continues a cache holding {held} "
                                 "tokens; padding can only begin a sequence (an empty cache)")
        if max_new_tokens == 0:
            return input_ids.new_zeros(B, 0)
        if cache is None:
            cache = self.allocate_cache(B, T + max_new_tokens, device=input_ids.device)
        if not held:  # an empty cache begins a new batch: its padding, or none
            cache.set_start(start)
        token = self(input_ids, cache=cache, logits_to_keep=1, **forward_kwargs).argmax(-1)   # [B, 1]
        new = [token]
        for _ in range(max_new_tokens - 1):
            # its own argmax: in range, so skip __call__'s check of the ids (a device sync each step)
            token = super().__call__(token, cache=cache, logits_to_keep=1).argmax(-1)
            new.append(token)
        return torch.cat(new, dim=1)

    # -- checkpoints -------------------------------------------------------------------------------------------
    @classmethod
    def _from_config(cls, config, **kwargs) -> "KimiK3ForConditionalGeneration":
        """What ``AutoModelForCausalLM.from_config`` calls."""
        return cls(config, kwargs.get("tp"))

    @classmethod
    def from_pretrained(cls, path, *args, **kwargs) -> "KimiK3ForConditionalGeneration":
        from .loading import from_pretrained
        return from_pretrained(cls, path, *args, **kwargs)

    def save_pretrained(self, path, **kwargs) -> None:
        from .loading import save_pretrained
        save_pretrained(self, path, **kwargs)


def _publish_mtp_keys(module: KimiK3ForConditionalGeneration, state_dict: dict, prefix: str, local_metadata) -> None:
    from .loading import mtp_key_to_published
    L = module.config.text_config.num_hidden_layers
    for key in [k for k in state_dict if k.startswith(prefix + "mtp.")]:
        state_dict[prefix + mtp_key_to_published(key[len(prefix):], L)] = state_dict.pop(key)


def _unpublish_mtp_keys(module: KimiK3ForConditionalGeneration, state_dict: dict, prefix: str, local_metadata,
                        strict, missing_keys, unexpected_keys, error_msgs) -> None:
    from .loading import published_key_to_mtp
    L = module.config.text_config.num_hidden_layers
    for key in [k for k in state_dict if k.startswith(prefix + "language_model.model.layers.")]:
        new = published_key_to_mtp(key[len(prefix):], L)
        if new != key[len(prefix):]:
            state_dict[prefix + new] = state_dict.pop(key)
