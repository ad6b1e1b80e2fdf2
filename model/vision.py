"""MoonViT-V2 vision tower and the patchmergerv2 projector of Kimi K3 (spec §2.2, §3, §9).

    patches --Conv2d(p×p)--> + pos-emb (bilinear to the grid) --> blocks × L --> final norm
            --2×2 merge--> [M, 4, D] --Linear, GELU, Linear, RMSNorm--> [M, E] image features

A block (pre-norm):
    x = x + wo(attn(rope2d(wqkv(norm0(x)))))        bidirectional within each image
    x = x + fc1(gelu_tanh(fc0(norm1(x))))

Legend: N patches of all images packed in order, D vt_hidden_size, Q qkv_hidden_size, Hq heads,
Dh = Q / Hq head dim, F vt_intermediate_size, M merged tokens (N / 4), E text_hidden_size,
(t, h, w) one image's grid_thw in patches.
Module and parameter names equal the published checkpoint's (`vision_tower.*`, `mm_projector.*`).
"""
from __future__ import annotations

import math
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

Grid = Sequence[Sequence[int]]


def grid_list(grid_thws: torch.Tensor | Grid) -> list[tuple[int, int, int]]:
    """grid_thws as Python ints (shapes must be static to the code below)."""
    rows = grid_thws.tolist() if isinstance(grid_thws, torch.Tensor) else grid_thws
    return [(int(t), int(h), int(w)) for t, h, w in rows]


class VisionRMSNorm(nn.Module):
    """RMSNorm computed in fp32; eps None = float32 machine epsilon (torch's default, spec §13.2)."""

    def __init__(self, dim: int, eps: float | None = None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = torch.finfo(torch.float32).eps if eps is None else eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight.float()
        return y.to(x.dtype)


def _make_norm(config, dim: int) -> nn.Module:
    if config.norm_type != "rmsnorm":
        raise NotImplementedError(f"vision norm_type={config.norm_type!r}: only 'rmsnorm' (K3)")
    return VisionRMSNorm(dim)


# ----------------------------------------------------------------------------------------------
# Patch embedding and learned position embedding
# ----------------------------------------------------------------------------------------------

def sincos_1d(dim: int, positions: torch.Tensor) -> torch.Tensor:
    """Fixed 1-D sin/cos embedding [T, dim] = [sin(pos·ω) | cos(pos·ω)], ω_i = 10000^(-2i/dim)."""
    omega = 1.0 / 10000 ** (torch.arange(dim // 2, dtype=torch.float64) / (dim / 2.0))
    angles = positions.to(torch.float64)[:, None] * omega[None, :]
    return torch.cat([angles.sin(), angles.cos()], dim=-1).float()


class PosEmbDivided(nn.Module):
    """`divided_fixed`: a learned [H0, W0, D] grid, bilinearly resized per image; + fixed time sincos (video)."""

    def __init__(self, height: int, width: int, num_frames: int, dim: int, mode: str = "bilinear"):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(height, width, dim))
        self.num_frames, self.mode = num_frames, mode
        # The time table is computed when needed, not kept as a buffer: a model built on the meta device
        # and loaded with assign=True would be left with a meta buffer.
        nn.init.normal_(self.weight, std=0.02)

    def grid_embedding(self, h: int, w: int) -> torch.Tensor:
        """[h·w, D], row-major over (h, w)."""
        if (h, w) == tuple(self.weight.shape[:2]):
            return self.weight.flatten(0, 1)
        grid = self.weight.permute(2, 0, 1)[None]                                   # [1, D, H0, W0]
        grid = F.interpolate(grid, size=(h, w), mode=self.mode, align_corners=False)
        return grid[0].permute(1, 2, 0).flatten(0, 1)

    def forward(self, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        parts = []
        for t, h, w in grids:
            pos = self.grid_embedding(h, w)                                         # [h·w, D]
            if t > 1:
                if t > self.num_frames:
                    raise ValueError(f"grid t={t} exceeds init_pos_emb_time={self.num_frames}")
                time = sincos_1d(pos.shape[-1], torch.arange(t)).to(pos.device, pos.dtype)
                pos = pos[None] + time[:, None, :]                                  # [t, h·w, D]
            parts.append(pos.reshape(-1, pos.shape[-1]))
        return torch.cat(parts)


class PatchEmbed(nn.Module):
    def __init__(self, config):
        super().__init__()
        p, d = config.patch_size, config.vt_hidden_size
        self.proj = nn.Conv2d(3, d, kernel_size=p, stride=p, bias=config.patch_embed_proj_bias)
        if config.pos_emb_type != "divided_fixed":
            raise NotImplementedError(f"pos_emb_type={config.pos_emb_type!r}: only 'divided_fixed' (K3)")
        self.pos_emb = PosEmbDivided(config.init_pos_emb_height, config.init_pos_emb_width,
                                     config.init_pos_emb_time, d, config.pos_emb_interpolation_mode)

    def forward(self, pixel_values: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        x = self.proj(pixel_values).flatten(1)                                     # [N, D]
        return x + self.pos_emb(grids).to(x.dtype)


# ----------------------------------------------------------------------------------------------
# 2-D RoPE
# ----------------------------------------------------------------------------------------------

def rope_2d_angles(h: int, w: int, head_dim: int, theta: float = 10000.0, device=None) -> torch.Tensor:
    """Rotation angles [h·w, Dh/2] (fp32) for patches in row-major order.

    Channel pair i rotates by x·f_j (i = 2j, x = column) or y·f_j (i = 2j+1, y = row),
    with f_j = theta^(-4j/Dh), j = 0..Dh/4-1.
    """
    if head_dim % 4:
        raise ValueError(f"2-D RoPE needs head_dim divisible by 4, got {head_dim}")
    freqs = theta ** (-torch.arange(0, head_dim, 4, dtype=torch.float32, device=device) / head_dim)  # [Dh/4]
    ys = torch.arange(h, dtype=torch.float32, device=device).repeat_interleave(w)                    # [h·w]
    xs = torch.arange(w, dtype=torch.float32, device=device).repeat(h)
    return torch.stack([xs[:, None] * freqs, ys[:, None] * freqs], dim=-1).flatten(1)              # [h·w, Dh/2]


def apply_rope_2d(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate adjacent channel pairs (2i, 2i+1) of x [N, Hq, Dh] by angles given as cos/sin [N, Dh/2]; fp32."""
    xf = x.float().unflatten(-1, (-1, 2))                                          # [N, Hq, Dh/2, 2]
    a, b = xf[..., 0], xf[..., 1]
    cos, sin = cos[:, None, :], sin[:, None, :]
    return torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1).flatten(-2).to(x.dtype)


# ----------------------------------------------------------------------------------------------
# Encoder
# ----------------------------------------------------------------------------------------------

class MLP2(nn.Module):
    def __init__(self, dim: int, hidden: int, bias: bool, activation: str):
        super().__init__()
        if activation not in ("gelu_pytorch_tanh", "gelu"):
            raise NotImplementedError(f"vision activation_func={activation!r}")
        self.approximate = "tanh" if activation == "gelu_pytorch_tanh" else "none"
        self.fc0 = nn.Linear(dim, hidden, bias=bias)
        self.fc1 = nn.Linear(hidden, dim, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc1(F.gelu(self.fc0(x), approximate=self.approximate))


class EncoderBlock(nn.Module):
    def __init__(self, config):
        super().__init__()
        d, q, self.num_heads = config.vt_hidden_size, config.qkv_hidden_size, config.vt_num_attention_heads
        if q % self.num_heads:
            raise ValueError(f"qkv_hidden_size {q} is not divisible by {self.num_heads} heads")
        if config.mlp_type != "mlp2":
            raise NotImplementedError(f"vision mlp_type={config.mlp_type!r}: only 'mlp2' (K3)")
        self.head_dim = q // self.num_heads
        self.norm0 = _make_norm(config, d)
        self.norm1 = _make_norm(config, d)
        self.wqkv = nn.Linear(d, 3 * q, bias=config.attn_bias)                     # [q | k | v], head-major
        self.wo = nn.Linear(q, d, bias=config.attn_bias)
        self.mlp = MLP2(d, config.vt_intermediate_size, config.linear_bias, config.activation_func)

    def attention(self, x: torch.Tensor, seqlens: list[int], cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.wqkv(x).view(n, 3, self.num_heads, self.head_dim).unbind(1)  # [N, Hq, Dh] each
        q, k = apply_rope_2d(q, cos, sin), apply_rope_2d(k, cos, sin)
        outs, start = [], 0
        for length in seqlens:  # bidirectional attention inside each image only
            sl = slice(start, start + length)
            o = F.scaled_dot_product_attention(q[sl].transpose(0, 1), k[sl].transpose(0, 1), v[sl].transpose(0, 1))
            outs.append(o.transpose(0, 1))                                        # [L, Hq, Dh]
            start += length
        return self.wo(torch.cat(outs).reshape(n, -1))

    def forward(self, x: torch.Tensor, seqlens: list[int], cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.norm0(x), seqlens, cos, sin)
        x = x + self.mlp(self.norm1(x))
        return x


class Encoder(nn.Module):
    def __init__(self, config):
        super().__init__()
        if getattr(config, "video_attn_type", "spatial_temporal") != "spatial_temporal":
            raise NotImplementedError(f"video_attn_type={config.video_attn_type!r}")
        self.head_dim = config.qkv_hidden_size // config.vt_num_attention_heads
        self.rope_max_grid = getattr(config, "rope_max_grid", 512)
        self.blocks = nn.ModuleList(EncoderBlock(config) for _ in range(config.vt_num_hidden_layers))
        self.final_layernorm = _make_norm(config, config.vt_hidden_size)

    def rope(self, grids: list[tuple[int, int, int]], device) -> tuple[torch.Tensor, torch.Tensor]:
        angles = torch.cat([rope_2d_angles(h, w, self.head_dim, device=device).repeat(t, 1) for t, h, w in grids])
        return angles.cos(), angles.sin()

    def forward(self, x: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        cos, sin = self.rope(grids, x.device)
        seqlens = [t * h * w for t, h, w in grids]
        for block in self.blocks:
            x = block(x, seqlens, cos, sin)
        return self.final_layernorm(x)


def tpool_patch_merge(x: torch.Tensor, grids: list[tuple[int, int, int]], kernel: tuple[int, int]) -> torch.Tensor:
    """sd2_tpool: [N, D] -> [M, kh·kw, D]; mean over time, each output token = its kh×kw neighbourhood,
    inner order (kh, kw), outputs row-major over the merged grid, images in order."""
    kh, kw = kernel
    outs, start = [], 0
    for t, h, w in grids:
        v = x[start:start + t * h * w].view(t, h // kh, kh, w // kw, kw, -1).mean(0)   # [h/kh, kh, w/kw, kw, D]
        outs.append(v.permute(0, 2, 1, 3, 4).reshape((h // kh) * (w // kw), kh * kw, -1))
        start += t * h * w
    return torch.cat(outs)


class MoonViT(nn.Module):
    """The vision tower (`vision_tower.*`): pixel patches -> merged patch groups [M, kh·kw, D].

    Args (forward):
        pixel_values: [N, 3, p, p], any float dtype (cast to the tower's dtype); images packed in order.
        grid_thws: [n_images, 3] (t, h, w) in patches, h and w multiples of the merge kernel.
    Example:
        >>> tower = MoonViT(KimiK3VisionConfig.tiny())
        >>> tower(torch.randn(24, 3, 14, 14), [[1, 4, 6]]).shape
        torch.Size([6, 4, 64])
    """

    def __init__(self, config):
        super().__init__()
        if config.merge_type != "sd2_tpool":
            raise NotImplementedError(f"merge_type={config.merge_type!r}: only 'sd2_tpool' (K3)")
        self.config = config
        mk = config.merge_kernel_size
        self.merge_kernel_size = (int(mk[0]), int(mk[1])) if isinstance(mk, (list, tuple)) else (int(mk), int(mk))
        self.patch_embed = PatchEmbed(config)
        self.encoder = Encoder(config)

    def check_inputs(self, pixel_values: torch.Tensor, grids: list[tuple[int, int, int]]) -> None:
        p, (kh, kw) = self.config.patch_size, self.merge_kernel_size
        if pixel_values.dim() != 4 or tuple(pixel_values.shape[1:]) != (3, p, p):
            raise ValueError(f"pixel_values must be [N, 3, {p}, {p}], got {list(pixel_values.shape)}")
        for i, (t, h, w) in enumerate(grids):
            if t < 1 or h < kh or w < kw or h % kh or w % kw:
                raise ValueError(f"image {i}: grid_thw {(t, h, w)} must have t >= 1 and h, w multiples of {(kh, kw)}")
            if max(h, w) > self.encoder.rope_max_grid:
                raise ValueError(f"image {i}: grid {h}×{w} exceeds the 2-D RoPE grid {self.encoder.rope_max_grid}")
        total = sum(t * h * w for t, h, w in grids)
        if total != pixel_values.shape[0]:
            raise ValueError(f"grid_thws cover {total} patches but pixel_values holds {pixel_values.shape[0]}")

    def forward(self, pixel_values: torch.Tensor, grid_thws: torch.Tensor | Grid) -> torch.Tensor:
        grids = grid_list(grid_thws)
        self.check_inputs(pixel_values, grids)
        x = self.patch_embed(pixel_values.to(self.patch_embed.proj.weight.dtype), grids)   # [N, D]
        x = self.encoder(x, grids)
        return tpool_patch_merge(x, grids, self.merge_kernel_size)                # [M, kh·kw, D]


class PatchMergerV2(nn.Module):
    """patchmergerv2 projector (`mm_projector.*`): [M, kh·kw, D] -> [M, E].

    flatten -> proj.0 Linear(4D, 4D) -> GELU (erf) -> proj.2 Linear(4D, E) -> post_norm RMSNorm(E, eps).
    """

    def __init__(self, config):
        super().__init__()
        if config.mm_projector_type != "patchmergerv2":
            raise NotImplementedError(f"mm_projector_type={config.mm_projector_type!r}: only 'patchmergerv2' (K3)")
        if config.projector_hidden_act != "gelu":
            raise NotImplementedError(f"projector_hidden_act={config.projector_hidden_act!r}")
        mk = config.merge_kernel_size
        n_merge = math.prod(mk) if isinstance(mk, (list, tuple)) else mk * mk
        width = config.mm_hidden_size * n_merge
        self.proj = nn.Sequential(nn.Linear(width, width, bias=False), nn.GELU(),
                                  nn.Linear(width, config.text_hidden_size, bias=False))
        self.post_norm = VisionRMSNorm(config.text_hidden_size, eps=config.projector_ln_eps)

    def forward(self, merged: torch.Tensor) -> torch.Tensor:
        x = merged.flatten(1).to(self.proj[0].weight.dtype)                       # [M, 4D]
        return self.post_norm(self.proj(x))                                       # [M, E]


# ----------------------------------------------------------------------------------------------
# What the multimodal model calls
# ----------------------------------------------------------------------------------------------

def image_features(vision_tower: MoonViT, mm_projector: PatchMergerV2, pixel_values: torch.Tensor,
                   grid_thws: torch.Tensor | Grid) -> torch.Tensor:
    """Projected image features [M, E], one row per `<|media_pad|>` token, images in order.

    Image i contributes t·h·w/4 rows (its grid_thw), matching the processor's pad-token count.
    """
    return mm_projector(vision_tower(pixel_values, grid_thws))


def merge_image_features(inputs_embeds: torch.Tensor, input_ids: torch.Tensor, features: torch.Tensor,
                         media_pad_token_id: int) -> torch.Tensor:
    """Return inputs_embeds [B, T, E] with the media-pad positions (row-major over B, T) replaced
    by `features` [M, E] in order. Raises ValueError when M differs from the pad-token count."""
    mask = input_ids == media_pad_token_id                                         # [B, T]
    if not torch.compiler.is_compiling():  # a data-dependent check: eager only
        n = int(mask.sum())
        if n != features.shape[0]:
            raise ValueError(f"the prompt holds {n} media-pad tokens but the images give {features.shape[0]} "
                             "features (placeholder count or image sizes do not match the prompt)")
    return inputs_embeds.masked_scatter(mask[..., None], features.to(inputs_embeds.dtype))
