"""Kimi K3 image preprocessing (NaViT resize, chessboard fill, normalise, patchify) and the processor.

Spec: k3-architecture.md §2.3 (media_proc_cfg) and §9 (navit_resize_image, prompt expansion).

Per image W×H (original size):
    scale = min(1, sqrt(in_patch_limit / (max(1, W//p) * max(1, H//p))), side*p / W, side*p / H)
    new_w, new_h = max(1, int(W*scale)), max(1, int(H*scale))      # each capped at side*p
    bicubic resize in the image's own mode -> transparent pixels blended over an 8-px chessboard in float,
    truncated to uint8 -> pad right/bottom with 0 to a multiple of merge*p (28) -> (x/255 - mean)/std ->
    patches [gh*gw, 3, p, p], grid_thw [1, gh, gw]
    tokens = (gh/merge) * (gw/merge)
The order of the pixel steps and the background's keys and arithmetic are those of Moonshot's published
processor (``media_utils.py`` of the K3 checkpoint: ``image_to_np``, ``fill_transparent_bg_with``).
and each `<|kimi_image_placeholder|>` of the prompt becomes
    <|media_begin|>image {W}x{H}<|media_content|> + tokens × <|media_pad|> + <|media_end|>

Legend: p patch size (14), m merge kernel (2), gh/gw patch-grid height/width, N patches.
"""
from __future__ import annotations

import dataclasses
import io
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError
from transformers import BatchFeature

from .config import K3_TRANSPARENT_BG_CONFIG

PREPROCESSOR_CONFIG_NAME = "preprocessor_config.json"

IMAGE_PLACEHOLDER = "<|kimi_image_placeholder|>"
MEDIA_BEGIN = "<|media_begin|>"
MEDIA_CONTENT = "<|media_content|>"
MEDIA_PAD = "<|media_pad|>"
MEDIA_END = "<|media_end|>"
MEDIA_TOKENS = (IMAGE_PLACEHOLDER, MEDIA_BEGIN, MEDIA_CONTENT, MEDIA_PAD, MEDIA_END)

# transparent_bg_config: the published keys and, where a key is missing, the published defaults
BG_DEFAULTS = {"pattern": "black", "chessboard_square_size": 16, "chessboard_square_on_top_left": True,
               "chessboard_white_value": 255, "chessboard_gray_value": 200}
BG_PATTERNS = {"white": 255, "black": 0, "gray": 128, "chessboard": None}   # -> uniform value


# ----------------------------------------------------------------------------------------------
# Configuration
# ----------------------------------------------------------------------------------------------

@dataclass
class MediaProcConfig:
    """`media_proc_cfg` of the published preprocessor_config.json (K3 values by default)."""

    patch_size: int = 14
    merge_kernel_size: int = 2
    in_patch_limit: int = 65536
    patch_limit_on_one_side: int = 512
    fixed_output_tokens: int | None = None
    image_mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    image_std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    # Background behind transparent pixels, published keys (BG_DEFAULTS); None: no blend, alpha dropped.
    transparent_bg_config: dict | None = field(default_factory=lambda: dict(K3_TRANSPARENT_BG_CONFIG))
    transparent_bg_fill_stage: str = "after_resize"
    # Keys we do not use (video sampling, ...), kept so a saved config round-trips unchanged.
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
        mk = self.merge_kernel_size
        if isinstance(mk, (list, tuple)):  # some configs store [2, 2]
            if len(set(mk)) != 1:
                raise ValueError(f"merge_kernel_size must be square, got {mk}")
            self.merge_kernel_size = int(mk[0])
        self.image_mean = tuple(float(v) for v in self.image_mean)
        self.image_std = tuple(float(v) for v in self.image_std)
        for name in ("patch_size", "merge_kernel_size", "in_patch_limit", "patch_limit_on_one_side"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.transparent_bg_fill_stage != "after_resize":
            raise NotImplementedError(
                f"transparent_bg_fill_stage={self.transparent_bg_fill_stage!r}: only 'after_resize' (K3)")
        check_bg_config(self.transparent_bg_config)

    @classmethod
    def tiny(cls) -> "MediaProcConfig":
        """Test sizes of spec §14.2: 56×84 px ⇒ a 4×6 patch grid ⇒ 6 tokens."""
        return cls(in_patch_limit=1024, patch_limit_on_one_side=64)

    @classmethod
    def from_dict(cls, d: dict) -> "MediaProcConfig":
        names = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        known = {k: v for k, v in d.items() if k in names}
        extra = {**d.get("extra", {}), **{k: v for k, v in d.items() if k not in names and k != "extra"}}
        return cls(**known, extra=extra)

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        extra = d.pop("extra")
        d["image_mean"], d["image_std"] = list(self.image_mean), list(self.image_std)
        return {**extra, **d}


# ----------------------------------------------------------------------------------------------
# NaViT resize plan (pure integer/float math, no pixels)
# ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ResizePlan:
    """Where one image of `width`×`height` goes: resized size, padding, patch grid, token count."""

    width: int
    height: int
    new_width: int
    new_height: int
    pad_width: int
    pad_height: int
    patch_size: int
    merge_kernel_size: int
    num_tokens: int

    @property
    def padded_width(self) -> int:
        return self.new_width + self.pad_width

    @property
    def padded_height(self) -> int:
        return self.new_height + self.pad_height

    @property
    def grid_thw(self) -> tuple[int, int, int]:
        return (1, self.padded_height // self.patch_size, self.padded_width // self.patch_size)

    @property
    def num_patches(self) -> int:
        t, h, w = self.grid_thw
        return t * h * w


def navit_resize_image(width: int, height: int, patch_size: int = 14, merge_kernel_size: int = 2,
                       in_patch_limit: int = 65536, patch_limit_on_one_side: int = 512,
                       fixed_output_tokens: int | None = None) -> ResizePlan:
    """The spec's NaViT resize: never upscale, limit patches in total and per side, pad to merge·patch.

    Args:
        width, height: original image size in pixels (>= 1).
    Returns:
        ResizePlan with new_width/new_height (resize target), pad_width/pad_height (right/bottom),
        grid_thw = (1, padded_height/p, padded_width/p) and num_tokens = grid_h·grid_w / merge².
    Example:
        >>> navit_resize_image(84, 56, in_patch_limit=1024, patch_limit_on_one_side=64).num_tokens
        6
    """
    width, height = int(width), int(height)
    if width < 1 or height < 1:
        raise ValueError(f"image size must be at least 1×1 pixels, got {width}×{height}")
    p = patch_size
    s_total = math.sqrt(in_patch_limit / (max(1.0, width // p) * max(1.0, height // p)))
    s_width = patch_limit_on_one_side * p / width
    s_height = patch_limit_on_one_side * p / height
    scale = min(1.0, s_total, s_width, s_height)
    max_side = patch_limit_on_one_side * p
    new_w = min(max(1, int(width * scale)), max_side)
    new_h = min(max(1, int(height * scale)), max_side)

    factor = merge_kernel_size * p
    pad_w = (factor - new_w % factor) % factor
    pad_h = (factor - new_h % factor) % factor
    if fixed_output_tokens is not None:
        num_tokens = int(fixed_output_tokens)
    else:
        num_tokens = ((new_h + pad_h) // factor) * ((new_w + pad_w) // factor)
    return ResizePlan(width, height, new_w, new_h, pad_w, pad_h, p, merge_kernel_size, num_tokens)


# ----------------------------------------------------------------------------------------------
# Pixels
# ----------------------------------------------------------------------------------------------

IMAGE_TYPES = (Image.Image, np.ndarray, torch.Tensor, bytes, bytearray, memoryview, str, os.PathLike)
CHANNELS_FIRST, CHANNELS_LAST = "channels_first", "channels_last"   # Hugging Face's input_data_format values
_ARRAY_CHANNELS = (1, 3, 4)                                            # "L", "RGB", "RGBA"


def load_image(image: Any, input_data_format: str | None = None) -> Image.Image:
    """A fully decoded PIL image from a PIL image, a numpy array or torch tensor (:func:`array_to_image`),
    encoded bytes, or a file path.

    Raises ValueError for corrupt, truncated or empty data, for 0-sized images and for arrays of another
    shape or dtype, TypeError for anything else, so a bad input fails before any output is produced.
    """
    if isinstance(image, (np.ndarray, torch.Tensor)):
        return array_to_image(image, input_data_format)
    if isinstance(image, (bytes, bytearray, memoryview)):
        if len(image) == 0:
            raise ValueError("image data is empty (0 bytes)")
        source, what = io.BytesIO(bytes(image)), "image bytes"
    elif isinstance(image, (str, os.PathLike)):
        source, what = image, f"image file {os.fspath(image)!r}"
    elif isinstance(image, Image.Image):
        source, what = None, "PIL image"
    else:
        raise TypeError(f"expected a PIL.Image.Image, a numpy array, a torch tensor, encoded image bytes or a path, "
                        f"got {type(image).__name__}")
    try:
        img = image if source is None else Image.open(source)
        img.load()  # decode now: a truncated file raises here, not half-way through a batch
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError, EOFError,
            Image.DecompressionBombError) as err:
        raise ValueError(f"cannot decode {what}: {err}") from err
    _check_size(img.width, img.height)
    return img


def _check_size(width: int, height: int) -> None:
    if width < 1 or height < 1:
        raise ValueError(f"image size must be at least 1×1 pixels, got {width}×{height}")


def array_to_image(array: np.ndarray | torch.Tensor, input_data_format: str | None = None) -> Image.Image:
    """An image array as Hugging Face image processors take one -> PIL image ("L", "RGB" or "RGBA").

    Shapes: [H, W] (grayscale), [H, W, C] or [C, H, W] with C = 1, 3 or 4 (RGBA); where both readings fit
    (e.g. [3, 5, 3]), ``input_data_format`` ("channels_first" / "channels_last") must say which.
    dtypes: uint8, or floating point in [0, 1] (scaled by 255 and rounded to the nearest integer, so that
    uint8 / 255 comes back exactly). Anything else raises ValueError.
    """
    kind = "numpy array" if isinstance(array, np.ndarray) else "tensor"
    shape = tuple(array.shape)
    if isinstance(array, np.ndarray):
        if array.dtype != np.uint8 and array.dtype.kind != "f":
            raise ValueError(f"an image {kind} must be uint8 or floating point in [0, 1], got {array.dtype}")
        t = torch.from_numpy(np.ascontiguousarray(array, np.uint8 if array.dtype == np.uint8 else np.float64))
    else:
        if array.dtype != torch.uint8 and not array.dtype.is_floating_point:
            raise ValueError(f"an image {kind} must be uint8 or floating point in [0, 1], got {array.dtype}")
        t = array.detach().cpu()
    if input_data_format not in (None, CHANNELS_FIRST, CHANNELS_LAST):
        raise ValueError(f"input_data_format must be {CHANNELS_FIRST!r} or {CHANNELS_LAST!r}, got "
                         f"{input_data_format!r}")
    if t.dim() == 2:
        t = t[..., None]
    elif t.dim() == 3:
        first, last = shape[0] in _ARRAY_CHANNELS, shape[-1] in _ARRAY_CHANNELS
        if input_data_format is not None:
            layout = input_data_format
        elif first != last:
            layout = CHANNELS_FIRST if first else CHANNELS_LAST
        elif first:
            raise ValueError(f"image {kind} of shape {list(shape)} is ambiguous: its first and its last dimension "
                             f"could both be channels (1, 3 or 4); pass input_data_format={CHANNELS_FIRST!r} or "
                             f"{CHANNELS_LAST!r}")
        else:
            raise ValueError(f"image {kind} of shape {list(shape)}: neither its first nor its last dimension is a "
                             "channel count (1, 3 or 4)")
        if layout == CHANNELS_FIRST:
            t = t.permute(1, 2, 0)
        if t.shape[-1] not in _ARRAY_CHANNELS:
            raise ValueError(f"image {kind} of shape {list(shape)} read {layout} has {t.shape[-1]} channels, "
                             "not 1, 3 or 4")
    else:
        raise ValueError(f"an image {kind} must be [H, W], [H, W, C] or [C, H, W], got shape {list(shape)} "
                         "(a batch: a list of images, or a 4-D array at the top level)")
    _check_size(t.shape[1], t.shape[0])
    if t.dtype != torch.uint8:
        t = t.double()
        if not bool(((t >= 0) & (t <= 1)).all()):
            raise ValueError(f"a floating-point image {kind} must hold values in [0, 1] (NaN excluded), got "
                             f"[{t.min().item()}, {t.max().item()}]; pass uint8 for 0..255")
        t = (t * 255).round().to(torch.uint8)
    hwc = t.contiguous().numpy()
    return Image.fromarray(hwc[..., 0] if hwc.shape[-1] == 1 else hwc)     # uint8: "L", "RGB" or "RGBA"


def check_bg_config(bg: dict | None) -> None:
    """A ``transparent_bg_config`` must use the published keys (BG_DEFAULTS) with sane values."""
    if bg is None:
        return
    if not isinstance(bg, dict):
        raise TypeError(f"transparent_bg_config must be a dict or None, got {type(bg).__name__}")
    unknown = sorted(set(bg) - set(BG_DEFAULTS))
    if unknown:
        raise ValueError(f"transparent_bg_config has unknown key(s) {unknown}; the published keys are "
                         f"{sorted(BG_DEFAULTS)}")
    cfg = {**BG_DEFAULTS, **bg}
    if cfg["pattern"] not in BG_PATTERNS:
        raise ValueError(f"transparent_bg_config pattern {cfg['pattern']!r} is none of {sorted(BG_PATTERNS)}")
    square = cfg["chessboard_square_size"]
    if isinstance(square, bool) or not isinstance(square, int) or square < 1:
        raise ValueError(f"chessboard_square_size must be an int >= 1, got {square!r}")
    for key in ("chessboard_white_value", "chessboard_gray_value"):
        if isinstance(cfg[key], bool) or not isinstance(cfg[key], int) or not 0 <= cfg[key] <= 255:
            raise ValueError(f"{key} must be an int in [0, 255], got {cfg[key]!r}")
    if not isinstance(cfg["chessboard_square_on_top_left"], bool):
        raise ValueError(f"chessboard_square_on_top_left must be true or false, got "
                         f"{cfg['chessboard_square_on_top_left']!r}")


def background(width: int, height: int, bg: dict) -> np.ndarray:
    """The background of a ``transparent_bg_config`` (published keys, BG_DEFAULTS for missing ones):
    [height, width, 3] uint8. Chessboard: squares of ``chessboard_square_size`` px, white top left when
    ``chessboard_square_on_top_left`` (else gray)."""
    cfg = {**BG_DEFAULTS, **bg}
    value = BG_PATTERNS[cfg["pattern"]]
    if value is not None:
        return np.full((height, width, 3), value, dtype=np.uint8)
    square = cfg["chessboard_square_size"]
    parity = (np.arange(height)[:, None] // square + np.arange(width)[None, :] // square) % 2
    gray_parity = 1 if cfg["chessboard_square_on_top_left"] else 0
    board = np.where(parity == gray_parity, cfg["chessboard_gray_value"], cfg["chessboard_white_value"])
    return np.repeat(board.astype(np.uint8)[..., None], 3, axis=-1)


def fill_transparent(img: Image.Image, bg: dict | None) -> Image.Image:
    """Any mode -> RGB. An image with an alpha band or a ``transparency`` key (an RGB one excepted, as in the
    reference) is blended over the background in float32, alpha/255 * rgb + (1 - alpha/255) * bg, and
    truncated to uint8: a pixel (130, 130, 130, alpha 1) over white gives 254 (Pillow's rounding
    ``alpha_composite`` would give 255)."""
    if bg is None:
        return img.convert("RGB")
    if img.mode == "RGB":
        return img
    if "A" not in img.getbands() and "transparency" not in img.info:
        return img.convert("RGB")
    rgba = np.asarray(img.convert("RGBA"))
    alpha = rgba[..., 3:].astype(np.float32) / 255.0
    out = alpha * rgba[..., :3] + (1 - alpha) * background(img.width, img.height, bg)
    return Image.fromarray(out.astype(np.uint8))


def resize_and_fill(img: Image.Image, plan: ResizePlan, cfg: MediaProcConfig) -> Image.Image:
    """Bicubic resize to the plan's inner size in the image's own mode (Pillow resizes "P" and "1" images
    nearest-neighbour, and premultiplies alpha for "RGBA" / "LA"), then the background fill (RGB out)."""
    if img.size != (plan.new_width, plan.new_height):
        img = img.resize((plan.new_width, plan.new_height), resample=Image.Resampling.BICUBIC)
    return fill_transparent(img, cfg.transparent_bg_config)


def to_patches(img: Image.Image, plan: ResizePlan, cfg: MediaProcConfig) -> torch.Tensor:
    """RGB image of the plan's inner size -> normalised patches [N, 3, p, p] (float32), row-major (h, w)."""
    p = plan.patch_size
    assert img.mode == "RGB" and img.size == (plan.new_width, plan.new_height), (img.mode, img.size)
    hwc = torch.frombuffer(bytearray(img.tobytes()), dtype=torch.uint8).view(img.height, img.width, 3)
    padded = torch.zeros(plan.padded_height, plan.padded_width, 3, dtype=torch.uint8)  # pad value 0
    padded[: img.height, : img.width] = hwc
    mean = torch.tensor(cfg.image_mean, dtype=torch.float32)
    std = torch.tensor(cfg.image_std, dtype=torch.float32)
    x = (padded.float() / 255.0 - mean) / std                                     # [Hp, Wp, 3]
    _, gh, gw = plan.grid_thw
    x = x.view(gh, p, gw, p, 3).permute(0, 2, 4, 1, 3)                            # [gh, gw, 3, p, p]
    return x.reshape(gh * gw, 3, p, p).contiguous()


# ----------------------------------------------------------------------------------------------
# Image processor
# ----------------------------------------------------------------------------------------------

@dataclass
class ProcessedImages:
    pixel_values: torch.Tensor  # [ΣN, 3, p, p] float32
    grid_thws: torch.Tensor     # [n_images, 3] int64
    plans: list[ResizePlan]

    @property
    def num_tokens(self) -> list[int]:
        return [plan.num_tokens for plan in self.plans]


class KimiK3ImageProcessor:
    """NaViT image processor of Kimi K3 (Hugging Face conventions: `__call__` -> BatchFeature).

    `processor(images)` -> BatchFeature {pixel_values [ΣN, 3, 14, 14] float32, grid_thws [n, 3] int64}.
    Images: PIL images, numpy arrays or torch tensors (:func:`array_to_image`; a 4-D array is a batch),
    encoded bytes or paths. Every image is decoded and checked before any is processed, so bad input
    raises without partial output.
    """

    model_input_names = ["pixel_values", "grid_thws"]

    def __init__(self, media_proc_cfg: MediaProcConfig | dict | None = None, **kwargs):
        if media_proc_cfg is None:
            media_proc_cfg = MediaProcConfig(**kwargs)
        elif isinstance(media_proc_cfg, dict):
            media_proc_cfg = MediaProcConfig.from_dict({**media_proc_cfg, **kwargs})
        elif kwargs:
            media_proc_cfg = dataclasses.replace(media_proc_cfg, **kwargs)
        self.cfg = media_proc_cfg

    def plan(self, width: int, height: int) -> ResizePlan:
        c = self.cfg
        return navit_resize_image(width, height, c.patch_size, c.merge_kernel_size, c.in_patch_limit,
                                  c.patch_limit_on_one_side, c.fixed_output_tokens)

    def process(self, images: Sequence[Any], input_data_format: str | None = None) -> ProcessedImages:
        """input_data_format: "channels_first" / "channels_last" for arrays whose layout is ambiguous."""
        decoded = []
        for i, image in enumerate(image_list(images)):
            try:
                decoded.append(load_image(image, input_data_format))
            except (ValueError, TypeError) as err:
                raise type(err)(f"image {i}: {err}") from err
        plans = [self.plan(*img.size) for img in decoded]
        p = self.cfg.patch_size
        patches = [to_patches(resize_and_fill(img, plan, self.cfg), plan, self.cfg)
                   for img, plan in zip(decoded, plans)]
        pixel_values = torch.cat(patches) if patches else torch.empty(0, 3, p, p)
        grid_thws = torch.tensor([plan.grid_thw for plan in plans], dtype=torch.int64).view(-1, 3)
        return ProcessedImages(pixel_values, grid_thws, plans)

    def __call__(self, images: Sequence[Any], return_tensors: str | None = "pt", input_data_format: str | None = None,
                 **_) -> BatchFeature:
        out = self.process(images, input_data_format)
        return BatchFeature({"pixel_values": out.pixel_values, "grid_thws": out.grid_thws},
                            tensor_type=return_tensors)

    # -- save / load: the published layout, {"media_proc_cfg": {...}} in preprocessor_config.json
    def to_dict(self) -> dict:
        return {"image_processor_type": type(self).__name__, "media_proc_cfg": self.cfg.to_dict()}

    def save_pretrained(self, save_directory: str | os.PathLike) -> str:
        os.makedirs(save_directory, exist_ok=True)
        path = Path(save_directory) / PREPROCESSOR_CONFIG_NAME
        path.write_text(json.dumps(self.to_dict(), indent=2) + "\n")
        return str(path)

    @classmethod
    def from_pretrained(cls, directory: str | os.PathLike, **kwargs) -> "KimiK3ImageProcessor":
        path = Path(directory) / PREPROCESSOR_CONFIG_NAME
        if not path.is_file():
            raise FileNotFoundError(f"no {PREPROCESSOR_CONFIG_NAME} in {os.fspath(directory)!r}")
        d = json.loads(path.read_text())
        return cls(d.get("media_proc_cfg", {}), **kwargs)


# ----------------------------------------------------------------------------------------------
# Prompt expansion (string level: testable without any tokenizer)
# ----------------------------------------------------------------------------------------------

def image_prompt(width: int, height: int, num_tokens: int) -> str:
    """The media tokens that replace one image placeholder (W, H = original size)."""
    return f"{MEDIA_BEGIN}image {width}x{height}{MEDIA_CONTENT}" + MEDIA_PAD * num_tokens + MEDIA_END


def expand_image_placeholders(text: str, plans: Sequence[ResizePlan]) -> str:
    """Replace the i-th `<|kimi_image_placeholder|>` of `text` by the media tokens of image i.

    Raises ValueError when the placeholder count differs from the image count, or when the text
    already holds raw media tokens (they would be miscounted as image positions).
    """
    for token in MEDIA_TOKENS[1:]:
        if token in text:
            raise ValueError(f"prompt contains the reserved media token {token}; use {IMAGE_PLACEHOLDER}")
    parts = text.split(IMAGE_PLACEHOLDER)
    if len(parts) - 1 != len(plans):
        raise ValueError(f"prompt has {len(parts) - 1} image placeholder(s) {IMAGE_PLACEHOLDER} "
                         f"but {len(plans)} image(s) were given")
    out = [parts[0]]
    for plan, rest in zip(plans, parts[1:]):
        out += [image_prompt(plan.width, plan.height, plan.num_tokens), rest]
    return "".join(out)


# ----------------------------------------------------------------------------------------------
# Processor
# ----------------------------------------------------------------------------------------------

class KimiK3Processor:
    """Tokenizer + image processor, Hugging Face style.

    `processor(text=..., images=...)` -> BatchFeature {input_ids, attention_mask, pixel_values,
    grid_thws}. `text` is a string or a list of strings; `images` a flat list consumed in placeholder
    order across the texts (or one list per text). The tokenizer must know the media tokens as
    special tokens (`<|media_pad|>` etc.); any HF tokenizer works.
    """

    def __init__(self, image_processor: KimiK3ImageProcessor | None = None, tokenizer=None):
        self.image_processor = image_processor or KimiK3ImageProcessor()
        self.tokenizer = tokenizer

    @property
    def media_pad_token_id(self) -> int:
        return self._token_id(MEDIA_PAD)

    def _token_id(self, token: str) -> int:
        if self.tokenizer is None:
            raise ValueError("this processor has no tokenizer")
        tid = self.tokenizer.convert_tokens_to_ids(token)
        if tid is None or tid == getattr(self.tokenizer, "unk_token_id", object()):
            raise ValueError(f"the tokenizer does not know the media token {token}; add it as a special token")
        return tid

    def __call__(self, text: str | list[str] | None = None, images: Sequence[Any] | None = None,
                 return_tensors: str | None = "pt", padding: bool | str = True, input_data_format: str | None = None,
                 **tokenizer_kwargs) -> BatchFeature:
        texts = [text] if isinstance(text, str) else (list(text) if text is not None else None)
        flat_images = _flatten_images(images, texts)
        processed = self.image_processor.process(flat_images, input_data_format) if flat_images else None
        data: dict[str, Any] = {}
        if texts is not None:
            plans = processed.plans if processed is not None else []
            counts = [t.count(IMAGE_PLACEHOLDER) for t in texts]
            if sum(counts) != len(plans):
                raise ValueError(f"prompt(s) have {sum(counts)} image placeholder(s) {IMAGE_PLACEHOLDER} "
                                 f"but {len(plans)} image(s) were given")
            expanded, start = [], 0
            for t, n in zip(texts, counts):
                expanded.append(expand_image_placeholders(t, plans[start:start + n]))
                start += n
            if self.tokenizer is None:
                raise ValueError("tokenizing text needs a tokenizer; build the processor with one")
            enc = self.tokenizer(expanded, padding=padding, return_tensors=return_tensors, **tokenizer_kwargs)
            self._check_pad_counts(enc["input_ids"], plans, counts)
            data.update(enc)
        if processed is not None:
            data["pixel_values"], data["grid_thws"] = processed.pixel_values, processed.grid_thws
        return BatchFeature(data, tensor_type=return_tensors)

    def _check_pad_counts(self, input_ids, plans, counts):
        """Each text must carry exactly its images' pad tokens (a tokenizer that splits the pad
        token, or truncation, would otherwise misplace image features)."""
        pad_id, start = self.media_pad_token_id, 0
        for row, n in zip(input_ids, counts):
            row = row.tolist() if isinstance(row, torch.Tensor) else list(row)
            want = sum(plan.num_tokens for plan in plans[start:start + n])
            if row.count(pad_id) != want:
                raise ValueError(f"tokenized prompt holds {row.count(pad_id)} {MEDIA_PAD} tokens, expected {want} "
                                 "(truncation, or a tokenizer without the media special tokens?)")
            start += n

    def batch_decode(self, *args, **kwargs):
        return self.tokenizer.batch_decode(*args, **kwargs)

    def decode(self, *args, **kwargs):
        return self.tokenizer.decode(*args, **kwargs)

    def save_pretrained(self, save_directory: str | os.PathLike) -> None:
        self.image_processor.save_pretrained(save_directory)
        if self.tokenizer is not None:
            self.tokenizer.save_pretrained(save_directory)

    @classmethod
    def from_pretrained(cls, directory: str | os.PathLike, tokenizer=None) -> "KimiK3Processor":
        image_processor = KimiK3ImageProcessor.from_pretrained(directory)
        if tokenizer is None and (Path(directory) / "tokenizer_config.json").is_file():
            from transformers import AutoTokenizer
            tokenizer = AutoTokenizer.from_pretrained(directory)
        return cls(image_processor, tokenizer)


def image_list(images) -> list:
    """One image (a 4-D array: a batch of them) or a sequence of images -> a list of images."""
    if isinstance(images, (np.ndarray, torch.Tensor)) and images.ndim == 4:
        return list(images)
    if isinstance(images, IMAGE_TYPES):
        return [images]
    return list(images)


def _flatten_images(images, texts) -> list:
    if images is None:
        return []
    images = image_list(images)
    if images and all(isinstance(x, (list, tuple)) for x in images):
        if texts is not None and len(images) != len(texts):
            raise ValueError(f"got {len(images)} image lists for {len(texts)} texts")
        return [img for per_text in images for img in per_text]
    return images
