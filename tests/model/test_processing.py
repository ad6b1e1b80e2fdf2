"""NaViT resize, chessboard fill, normalisation, patchify and the Kimi K3 processor (spec §2.3, §9).

Expected resize/token numbers in the tables are worked out by hand from the spec's formulas
(the comment beside each row shows the arithmetic).
"""
import io
import json

import numpy as np
import pytest
import torch
from hypothesis import example, given, strategies as st
from PIL import Image

from k3compile.model.processing import (
    IMAGE_PLACEHOLDER, MEDIA_BEGIN, MEDIA_CONTENT, MEDIA_END, MEDIA_PAD, KimiK3ImageProcessor,
    KimiK3Processor, MediaProcConfig, expand_image_placeholders, image_prompt, navit_resize_image,
)

REAL = MediaProcConfig()
TINY = MediaProcConfig.tiny()


def plan_for(cfg, w, h):
    return navit_resize_image(w, h, cfg.patch_size, cfg.merge_kernel_size, cfg.in_patch_limit,
                              cfg.patch_limit_on_one_side, cfg.fixed_output_tokens)


# ----------------------------------------------------------------------------------------------
# Resize / token-count tables (hand-computed)
# columns: W, H -> new_w, new_h, padded_w, padded_h, grid_thw, tokens   (None: float-rounding-sensitive)
# ----------------------------------------------------------------------------------------------
REAL_TABLE = [
    # 1×1: W//14 = 0 -> max(1, 0); scale = 1; pad 27 -> 28×28; grid 2×2 -> 1 token
    ("1x1", 1, 1, 1, 1, 28, 28, (1, 2, 2), 1),
    # fits: 84 and 56 are multiples of 28 -> no pad; grid 4×6 -> 2·3 tokens
    ("84x56", 84, 56, 84, 56, 84, 56, (1, 4, 6), 6),
    # 100 % 28 = 16 -> pad 12 -> 112; 50 % 28 = 22 -> pad 6 -> 56; grid 4×8 -> 2·4
    ("100x50", 100, 50, 100, 50, 112, 56, (1, 4, 8), 8),
    # huge: s1 = sqrt(65536 / (571·428)) = 0.5178453, s2 = 0.896, s3 = 1.195 -> scale 0.5178453;
    # 8000·s = 4142.76 -> 4142 (% 28 = 26, pad 2 -> 4144); 6000·s = 3107.07 -> 3107 (% 28 = 27 -> 3108);
    # grid 222×296 (65712 patches: the padding may overshoot the limit a little); tokens 111·148
    ("8000x6000", 8000, 6000, 4142, 3107, 4144, 3108, (1, 222, 296), 16428),
    # tall thin, fits: 30 -> pad 26 -> 56; 5000 % 28 = 16 -> pad 12 -> 5012; grid 358×4 -> 179·2
    ("30x5000", 30, 5000, 30, 5000, 56, 5012, (1, 358, 4), 358),
    # wide strip: s2 = 7168/10000 = 0.7168 is the limit; 10000·s ≈ 7168 (7167 or 7168 by float
    # rounding, both pad to 7168); 20·s = 14.3 -> 14 -> pad 14 -> 28; grid 2×512 -> 1·256
    ("10000x20", 10000, 20, None, 14, 7168, 28, (1, 2, 512), 256),
    # 1 px wide, 100000 tall: s3 = 0.07168; new_w = max(1, int(0.07)) = 1 -> 28; new_h ≈ 7168;
    # grid 512×2 -> 256·1
    ("1x100000", 1, 100000, 1, None, 28, 7168, (1, 512, 2), 256),
]

TINY_TABLE = [
    # spec §14.2 example: 84 wide × 56 high -> grid 4×6 -> 6 tokens
    ("84x56", 84, 56, 84, 56, 84, 56, (1, 4, 6), 6),
    # over the total limit: s1 = sqrt(1024 / (71·50)) = 0.5370763; 1000·s = 537.08 -> 537 (% 28 = 5,
    # pad 23 -> 560); 700·s = 375.95 -> 375 (% 28 = 11, pad 17 -> 392); grid 28×40 -> 14·20
    ("1000x700", 1000, 700, 537, 375, 560, 392, (1, 28, 40), 280),
    # over the side limit: s2 = 896/2000 = 0.448; 2000·s ≈ 896 -> 896; 30·s = 13.4 -> 13 -> 28;
    # grid 2×64 -> 1·32
    ("2000x30", 2000, 30, None, 13, 896, 28, (1, 2, 64), 32),
    # 1×1 -> 28×28 -> 1 token
    ("1x1", 1, 1, 1, 1, 28, 28, (1, 2, 2), 1),
]


def _check_plan(plan, new_w, new_h, padded_w, padded_h, grid, tokens):
    if new_w is not None:
        assert plan.new_width == new_w
    if new_h is not None:
        assert plan.new_height == new_h
    assert (plan.padded_width, plan.padded_height) == (padded_w, padded_h)
    assert plan.grid_thw == grid
    assert plan.num_tokens == tokens


@pytest.mark.parametrize("name,w,h,new_w,new_h,padded_w,padded_h,grid,tokens", REAL_TABLE,
                         ids=[r[0] for r in REAL_TABLE])
def test_navit_resize_real_config_table(name, w, h, new_w, new_h, padded_w, padded_h, grid, tokens):
    _check_plan(plan_for(REAL, w, h), new_w, new_h, padded_w, padded_h, grid, tokens)


@pytest.mark.parametrize("name,w,h,new_w,new_h,padded_w,padded_h,grid,tokens", TINY_TABLE,
                         ids=[r[0] for r in TINY_TABLE])
def test_navit_resize_tiny_config_table(name, w, h, new_w, new_h, padded_w, padded_h, grid, tokens):
    _check_plan(plan_for(TINY, w, h), new_w, new_h, padded_w, padded_h, grid, tokens)


@pytest.mark.parametrize("name,w,h,new_w,new_h,padded_w,padded_h,grid,tokens", TINY_TABLE,
                         ids=[r[0] for r in TINY_TABLE])
def test_image_processor_pixels_match_plan(name, w, h, new_w, new_h, padded_w, padded_h, grid, tokens):
    out = KimiK3ImageProcessor(TINY)([Image.new("RGB", (w, h), (10, 20, 30))])
    n = grid[1] * grid[2]
    assert out["pixel_values"].shape == (n, 3, 14, 14)
    assert out["pixel_values"].dtype == torch.float32
    assert out["grid_thws"].tolist() == [list(grid)]
    assert torch.isfinite(out["pixel_values"]).all()


@given(w=st.integers(1, 30000), h=st.integers(1, 30000), cfg=st.sampled_from([REAL, TINY]))
@example(w=84, h=56, cfg=TINY)
@example(w=7168, h=7168, cfg=REAL)
def test_navit_resize_invariants(w, h, cfg):
    plan = plan_for(cfg, w, h)
    factor = cfg.patch_size * cfg.merge_kernel_size
    assert plan.new_width <= w and plan.new_height <= h                       # never upscale
    assert plan.padded_width % factor == 0 and plan.padded_height % factor == 0
    assert 0 <= plan.pad_width < factor and 0 <= plan.pad_height < factor
    _, gh, gw = plan.grid_thw
    assert gh <= cfg.patch_limit_on_one_side and gw <= cfg.patch_limit_on_one_side
    assert plan.num_tokens == (gh // 2) * (gw // 2)
    fits = (max(1, w // 14) * max(1, h // 14) <= cfg.in_patch_limit
            and max(w, h) <= cfg.patch_limit_on_one_side * cfg.patch_size)
    if fits:
        assert (plan.new_width, plan.new_height) == (w, h)


# ----------------------------------------------------------------------------------------------
# Pixels: modes, transparency, normalisation, patch order
# ----------------------------------------------------------------------------------------------

def _norm(v):
    return v / 255.0 * 2.0 - 1.0


def _norm_inverse(pixel_values):
    """Normalised values back to integer 0..255."""
    return ((pixel_values + 1.0) / 2.0 * 255.0).round().long()


def _pixel(pixel_values, grid, x, y):
    """Normalised RGB of padded-image pixel (x, y) read back from the patches."""
    _, gh, gw = grid
    patch = pixel_values[(y // 14) * gw + x // 14]
    return patch[:, y % 14, x % 14]


def test_patchify_row_major_order_and_normalisation():
    g = torch.Generator().manual_seed(1)
    data = torch.randint(0, 256, (56, 84, 3), dtype=torch.uint8, generator=g)
    img = Image.frombytes("RGB", (84, 56), bytes(data.flatten().tolist()))
    out = KimiK3ImageProcessor(TINY)([img])
    pv, grid = out["pixel_values"], tuple(out["grid_thws"][0].tolist())
    assert grid == (1, 4, 6)
    for r in range(4):
        for c in range(6):
            crop = data[r * 14:(r + 1) * 14, c * 14:(c + 1) * 14].permute(2, 0, 1).float()
            torch.testing.assert_close(pv[r * 6 + c], _norm(crop), rtol=0, atol=1e-6)


def test_padding_is_zero_pixels_right_and_bottom():
    out = KimiK3ImageProcessor(TINY)([Image.new("RGB", (30, 20), (255, 255, 255))])
    pv, grid = out["pixel_values"], tuple(out["grid_thws"][0].tolist())
    assert grid == (1, 2, 4)  # 30 -> 56, 20 -> 28
    assert _pixel(pv, grid, 29, 19).tolist() == [1.0, 1.0, 1.0]
    assert _pixel(pv, grid, 30, 0).tolist() == [-1.0, -1.0, -1.0]
    assert _pixel(pv, grid, 0, 20).tolist() == [-1.0, -1.0, -1.0]


def test_transparent_png_gets_chessboard_after_resize():
    img = Image.new("RGBA", (40, 30), (255, 0, 0, 0))  # fully transparent red
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    out = KimiK3ImageProcessor(TINY)([buf.getvalue()])
    pv, grid = out["pixel_values"], tuple(out["grid_thws"][0].tolist())
    white, gray = _norm(255.0), _norm(180.0)
    for (x, y), v in {(0, 0): white, (7, 7): white, (8, 0): gray, (0, 8): gray, (8, 8): white,
                      (16, 0): white, (39, 29): gray}.items():  # (39//8 + 29//8) = 4 + 3 odd -> gray
        torch.testing.assert_close(_pixel(pv, grid, x, y), torch.full((3,), v), rtol=0, atol=1e-6)
    # padding stays 0 (-1 after normalisation), not chessboard
    torch.testing.assert_close(_pixel(pv, grid, 40, 0), torch.full((3,), -1.0))


def test_chessboard_is_laid_on_the_resized_image():
    # 1000×700 RGBA shrinks to 537×375 (tiny table); squares stay 8 px in the *resized* image.
    out = KimiK3ImageProcessor(TINY)([Image.new("RGBA", (1000, 700), (0, 0, 0, 0))])
    pv, grid = out["pixel_values"], tuple(out["grid_thws"][0].tolist())
    assert grid == (1, 28, 40)
    # (536//8 + 374//8) = 67 + 46 odd -> gray; (528//8 + 374//8) = 66 + 46 even -> white
    torch.testing.assert_close(_pixel(pv, grid, 536, 374), torch.full((3,), _norm(180.0)))
    torch.testing.assert_close(_pixel(pv, grid, 528, 374), torch.full((3,), _norm(255.0)))


def test_half_transparent_pixels_blend_over_white_square():
    out = KimiK3ImageProcessor(TINY)([Image.new("RGBA", (28, 28), (255, 0, 0, 128))])
    got = _pixel(out["pixel_values"], (1, 2, 2), 0, 0)
    # over white, in float32: R = 255; G = B = (1 - 128/255) · 255 = 126.99999 -> truncated to 126
    want = torch.tensor([_norm(255.0), _norm(126.0), _norm(126.0)])
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


def test_composite_blends_in_float_and_truncates():
    """(130, 130, 130) at alpha 1 over white: 1/255 · 130 + 254/255 · 255 = 254.51 -> 254 (the published
    processor's float blend and uint8 cast; a rounding composite gives 255)."""
    out = KimiK3ImageProcessor(TINY)([Image.new("RGBA", (28, 28), (130, 130, 130, 1))])
    torch.testing.assert_close(_pixel(out["pixel_values"], (1, 2, 2), 0, 0), torch.full((3,), _norm(254.0)),
                               rtol=0, atol=1e-6)


@pytest.mark.parametrize("value,bg", [(0, 255), (130, 255), (255, 180), (77, 180)],
                         ids=["black-on-white", "grey-on-white", "white-on-gray", "dark-on-gray"])
def test_composite_every_alpha_matches_float32_formula(value, bg):
    """All 256 alphas of one colour on one square: uint8(a/255 · v + (1 - a/255) · bg), in float32."""
    alphas = np.arange(256, dtype=np.uint8)
    img = Image.fromarray(np.stack([np.full((16, 256), value, np.uint8)] * 3 + [np.tile(alphas, (16, 1))], -1))
    bg_cfg = {"pattern": "chessboard", "chessboard_square_size": 1024, "chessboard_white_value": bg}
    out = KimiK3ImageProcessor(TINY, transparent_bg_config=bg_cfg)([img])
    a = alphas.astype(np.float32) / np.float32(255)
    want = (a * np.float32(value) + (np.float32(1) - a) * np.float32(bg)).astype(np.uint8)
    pv, grid = out["pixel_values"], tuple(out["grid_thws"][0].tolist())
    got = torch.stack([_pixel(pv, grid, x, 3)[0] for x in range(256)])
    torch.testing.assert_close(got, _norm(torch.from_numpy(want).float()), rtol=0, atol=1e-6)


def _fine_pattern(mode: str, size: int = 500) -> Image.Image:
    """A 1-px checkerboard of two colours: any resampling filter that mixes neighbours makes new colours."""
    cells = (np.add.outer(np.arange(size), np.arange(size)) % 2).astype(np.uint8)
    if mode == "1":
        return Image.fromarray(cells * 255).convert("1", dither=Image.Dither.NONE)
    img = Image.fromarray(cells).convert("P")
    img.putpalette([200, 30, 40, 10, 20, 230] + [0] * 762)
    return img


@pytest.mark.parametrize("mode", ["P", "1"], ids=["palette", "1-bit"])
def test_palette_and_bilevel_resize_in_their_own_mode(mode):
    """The published order: resize in the source mode (Pillow: nearest for "P" and "1"), then to RGB; so only
    the source's two colours appear (a conversion to RGB first would blend them bicubically)."""
    img = _fine_pattern(mode)
    plan = plan_for(TINY, *img.size)
    assert plan.new_width < img.width                                   # 500 -> 457: a real resize
    out = KimiK3ImageProcessor(TINY)([img])
    ref = img.resize((plan.new_width, plan.new_height), Image.Resampling.BICUBIC).convert("RGB")
    ref = torch.from_numpy(np.array(ref)).float()
    pv, grid = out["pixel_values"], tuple(out["grid_thws"][0].tolist())
    got = torch.stack([_pixel(pv, grid, x, y) for y, x in [(0, 0), (5, 9), (200, 301), (456, 455)]])
    want = torch.stack([_norm(ref[y, x]) for y, x in [(0, 0), (5, 9), (200, 301), (456, 455)]])
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    colours = {tuple(c) for c in _norm_inverse(pv).permute(0, 2, 3, 1).reshape(-1, 3).tolist()}
    source = {(0, 0, 0), (255, 255, 255)} if mode == "1" else {(200, 30, 40), (10, 20, 230)}
    assert colours <= source | {(0, 0, 0)}                              # (0, 0, 0): the padding


def test_palette_transparency_survives_the_resize():
    """A "P" image with a transparent index is resized as "P" (nearest), its transparency key kept, then
    blended: the transparent cells show the chessboard, the others their colour."""
    img = _fine_pattern("P")
    img.info["transparency"] = 1                                       # the blue index
    plan = plan_for(TINY, *img.size)
    out = KimiK3ImageProcessor(TINY)([img])
    small = np.asarray(img.resize((plan.new_width, plan.new_height), Image.Resampling.NEAREST))
    pv, grid = out["pixel_values"], tuple(out["grid_thws"][0].tolist())
    for y, x in [(0, 0), (0, 1), (9, 17), (300, 200)]:
        board = 255.0 if (x // 8 + y // 8) % 2 == 0 else 180.0
        want = torch.full((3,), board) if small[y, x] == 1 else torch.tensor([200.0, 30.0, 40.0])
        torch.testing.assert_close(_pixel(pv, grid, x, y), _norm(want), rtol=0, atol=1e-6)


def test_rgb_with_transparency_key_is_left_as_is():
    """As the reference: an RGB image is never blended, whatever its ``transparency`` key says."""
    img = Image.new("RGB", (28, 28), (9, 8, 7))
    img.info["transparency"] = (9, 8, 7)
    out = KimiK3ImageProcessor(TINY)([img])
    torch.testing.assert_close(_pixel(out["pixel_values"], (1, 2, 2), 0, 0), _norm(torch.tensor([9.0, 8.0, 7.0])))


def test_palette_image_with_and_without_transparency():
    rgb = Image.new("RGB", (28, 28), (200, 100, 50))
    pal = rgb.convert("P", palette=Image.Palette.ADAPTIVE, colors=4)
    out = KimiK3ImageProcessor(TINY)([pal])
    torch.testing.assert_close(_pixel(out["pixel_values"], (1, 2, 2), 5, 5),
                               torch.tensor([_norm(200.0), _norm(100.0), _norm(50.0)]), rtol=0, atol=1e-6)
    pal.info["transparency"] = pal.getpixel((0, 0))  # its only colour becomes transparent
    out = KimiK3ImageProcessor(TINY)([pal])
    torch.testing.assert_close(_pixel(out["pixel_values"], (1, 2, 2), 8, 0), torch.full((3,), _norm(180.0)))


@pytest.mark.parametrize("mode,value", [("L", 100), ("1", 255), ("I;16", 77), ("LA", 60)],
                         ids=["L-greyscale", "1-bit", "I16", "LA-opaque"])
def test_greyscale_modes_become_rgb(mode, value):
    img = Image.new("L", (28, 28), value).convert(mode) if mode != "LA" else Image.new("LA", (28, 28), (value, 255))
    out = KimiK3ImageProcessor(TINY)([img])
    got = _pixel(out["pixel_values"], (1, 2, 2), 3, 3)
    torch.testing.assert_close(got, torch.full((3,), _norm(float(value))), rtol=0, atol=1e-6)


# ----------------------------------------------------------------------------------------------
# Bad input
# ----------------------------------------------------------------------------------------------

def _png_bytes(size=(40, 40)):
    buf = io.BytesIO()
    Image.new("RGB", size, (1, 2, 3)).save(buf, format="PNG")
    return buf.getvalue()


def _jpeg_bytes(size=(64, 64)):
    g = torch.Generator().manual_seed(2)
    data = torch.randint(0, 256, (size[1], size[0], 3), dtype=torch.uint8, generator=g)
    buf = io.BytesIO()
    Image.frombytes("RGB", size, bytes(data.flatten().tolist())).save(buf, format="JPEG")
    return buf.getvalue()


@pytest.mark.parametrize("data", [
    pytest.param(_png_bytes()[:60], id="png-truncated"),
    pytest.param(_jpeg_bytes()[:300], id="jpeg-truncated"),
    pytest.param(b"not an image at all", id="garbage"),
    pytest.param(b"", id="empty-bytes"),
])
def test_corrupt_or_truncated_image_raises(data):
    with pytest.raises(ValueError, match="image 1"):
        KimiK3ImageProcessor(TINY)([_png_bytes(), data])


def test_corrupt_file_path_raises(tmp_path):
    path = tmp_path / "cut.png"
    path.write_bytes(_png_bytes((300, 300))[:100])
    with pytest.raises(ValueError, match="cut.png"):
        KimiK3ImageProcessor(TINY)([str(path)])


@pytest.mark.parametrize("size", [(0, 5), (5, 0), (0, 0)], ids=["W0", "H0", "W0H0"])
def test_zero_sized_image_raises(size):
    with pytest.raises(ValueError, match="at least 1×1"):
        KimiK3ImageProcessor(TINY)([Image.new("RGB", size)])
    with pytest.raises(ValueError, match="at least 1×1"):
        navit_resize_image(*size)


def test_unsupported_image_type_raises():
    with pytest.raises(TypeError, match="image 0: expected a PIL.Image.Image, a numpy array"):
        KimiK3ImageProcessor(TINY)([{"not": "an image"}])


# ----------------------------------------------------------------------------------------------
# Arrays and tensors (as Hugging Face image processors take them)
# ----------------------------------------------------------------------------------------------

def _hwc(h=20, w=30, c=3, seed=5):
    return torch.randint(0, 256, (h, w, c), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def _as_pil(hwc):
    return Image.fromarray(hwc.numpy()[..., 0] if hwc.shape[-1] == 1 else hwc.numpy())


ARRAY_FORMS = {
    "numpy-HWC-uint8": lambda t: t.numpy(),
    "numpy-HW-grey": lambda t: t[..., 0].numpy(),
    "numpy-HWC-float": lambda t: (t.double() / 255).numpy(),
    "tensor-CHW-uint8": lambda t: t.permute(2, 0, 1),
    "tensor-HWC-uint8": lambda t: t,
    "tensor-CHW-float32": lambda t: t.permute(2, 0, 1).float() / 255,
    "tensor-HWC-float16": lambda t: t.half() / 255,
    "tensor-CHW-1-channel": lambda t: t[..., :1].permute(2, 0, 1),
    "numpy-HWC-RGBA": None,
}


@pytest.mark.parametrize("form", list(ARRAY_FORMS))
def test_arrays_and_tensors_equal_their_pil_image(form):
    hwc = _hwc(c=4) if form.endswith("RGBA") else _hwc()
    grey = "grey" in form or "1-channel" in form
    array = hwc.numpy() if ARRAY_FORMS[form] is None else ARRAY_FORMS[form](hwc)
    pil = _as_pil(hwc[..., :1] if grey else hwc)
    got, want = KimiK3ImageProcessor(TINY)(array), KimiK3ImageProcessor(TINY)([pil])
    assert torch.equal(got["pixel_values"], want["pixel_values"])
    assert torch.equal(got["grid_thws"], want["grid_thws"])


def test_batch_array_is_a_list_of_images():
    batch = torch.stack([_hwc(seed=1), _hwc(seed=2)]).permute(0, 3, 1, 2)              # [2, 3, 20, 30]
    out = KimiK3ImageProcessor(TINY)(batch)
    one = KimiK3ImageProcessor(TINY)([_as_pil(_hwc(seed=1)), _as_pil(_hwc(seed=2))])
    assert torch.equal(out["pixel_values"], one["pixel_values"]) and out["grid_thws"].shape == (2, 3)


def test_ambiguous_layout_needs_input_data_format():
    chw = _hwc(h=5, w=3).permute(2, 0, 1)                                                # [3, 5, 3]
    with pytest.raises(ValueError, match="ambiguous.*input_data_format"):
        KimiK3ImageProcessor(TINY)([chw])
    out = KimiK3ImageProcessor(TINY)([chw], input_data_format="channels_first")
    assert torch.equal(out["pixel_values"], KimiK3ImageProcessor(TINY)([_as_pil(_hwc(h=5, w=3))])["pixel_values"])


def test_processor_takes_tensor_images(processor):
    out = processor(text=f"x{IMAGE_PLACEHOLDER}", images=[_hwc(h=56, w=84).permute(2, 0, 1)])
    assert out["grid_thws"].tolist() == [[1, 4, 6]]
    assert "image84x56" in processor.decode(out["input_ids"][0]).replace(" ", "")


@pytest.mark.parametrize("array,match", [
    pytest.param(np.zeros((5, 6, 2), np.uint8), "neither its first nor its last", id="2-channels"),
    pytest.param(np.zeros(7, np.uint8), r"must be \[H, W\], \[H, W, C\] or \[C, H, W\], got shape \[7\]",
                 id="1-D"),
    pytest.param(np.zeros((1, 2, 5, 5, 3), np.uint8), "got shape", id="5-D"),
    pytest.param(np.zeros((5, 5, 3), np.int32), "uint8 or floating point", id="numpy-int32"),
    pytest.param(torch.zeros(5, 5, 3, dtype=torch.bool), "uint8 or floating point", id="tensor-bool"),
    pytest.param(torch.full((3, 5, 5), 2.0), r"values in \[0, 1\].*got \[2.0, 2.0\]", id="float-over-1"),
    pytest.param(torch.full((3, 5, 5), float("nan")), "NaN", id="float-nan"),
    pytest.param(np.zeros((0, 5, 3), np.uint8), "at least 1×1", id="zero-height"),
])
def test_bad_arrays_raise(array, match):
    with pytest.raises(ValueError, match="image 1: .*" + match):
        KimiK3ImageProcessor(TINY)([_hwc().numpy(), array])


def test_bad_input_data_format_raises():
    with pytest.raises(ValueError, match="input_data_format must be"):
        KimiK3ImageProcessor(TINY)([_hwc().numpy()], input_data_format="HWC")


# ----------------------------------------------------------------------------------------------
# Prompt expansion and the processor
# ----------------------------------------------------------------------------------------------

def test_expand_placeholders_without_tokenizer():
    plans = [plan_for(TINY, 84, 56), plan_for(TINY, 1, 1)]
    text = f"a{IMAGE_PLACEHOLDER}b{IMAGE_PLACEHOLDER}c"
    want = (f"a{MEDIA_BEGIN}image 84x56{MEDIA_CONTENT}" + MEDIA_PAD * 6 + f"{MEDIA_END}b"
            f"{MEDIA_BEGIN}image 1x1{MEDIA_CONTENT}{MEDIA_PAD}{MEDIA_END}c")
    assert expand_image_placeholders(text, plans) == want
    assert image_prompt(84, 56, 6) == want[1:want.index(f"{MEDIA_END}b") + len(MEDIA_END)]


@pytest.mark.parametrize("n_placeholders,n_images", [(2, 1), (1, 2), (0, 1), (1, 0)],
                         ids=["P2-I1", "P1-I2", "P0-I1", "P1-I0"])
def test_placeholder_count_mismatch_raises(n_placeholders, n_images):
    plans = [plan_for(TINY, 28, 28)] * n_images
    with pytest.raises(ValueError, match="placeholder"):
        expand_image_placeholders("x" + IMAGE_PLACEHOLDER * n_placeholders, plans)


def test_raw_media_token_in_prompt_raises():
    with pytest.raises(ValueError, match="reserved media token"):
        expand_image_placeholders(f"hi {MEDIA_PAD}", [])


def make_tokenizer():
    """A character-level tokenizer with the media special tokens (no tokenizer file needed)."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[PAD]": 0, "[UNK]": 1}
    for i in range(32, 127):
        vocab[chr(i)] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]")
    fast.add_special_tokens({"additional_special_tokens": [IMAGE_PLACEHOLDER, MEDIA_BEGIN, MEDIA_CONTENT,
                                                           MEDIA_PAD, MEDIA_END]})
    return fast


@pytest.fixture(scope="module")
def processor():
    return KimiK3Processor(KimiK3ImageProcessor(TINY), make_tokenizer())


def test_processor_two_images_of_different_sizes(processor):
    images = [Image.new("RGB", (84, 56)), Image.new("RGB", (1000, 700))]
    out = processor(text=f"look {IMAGE_PLACEHOLDER} and {IMAGE_PLACEHOLDER}?", images=images)
    pad = processor.media_pad_token_id
    ids = out["input_ids"][0]
    assert int((ids == pad).sum()) == 6 + 280
    assert out["pixel_values"].shape == (24 + 1120, 3, 14, 14)
    assert out["grid_thws"].tolist() == [[1, 4, 6], [1, 28, 40]]
    text = processor.decode(ids).replace(" ", "")
    assert "image84x56" in text and "image1000x700" in text
    # each pad run sits between media_content and media_end
    begin, content, end = (processor.tokenizer.convert_tokens_to_ids(t)
                           for t in (MEDIA_BEGIN, MEDIA_CONTENT, MEDIA_END))
    ids = ids.tolist()
    i = ids.index(content)
    assert ids[i + 1:i + 7] == [pad] * 6 and ids[i + 7] == end
    assert ids.count(begin) == 2


def test_processor_batch_of_texts(processor):
    texts = [f"{IMAGE_PLACEHOLDER}a", f"b{IMAGE_PLACEHOLDER}{IMAGE_PLACEHOLDER}"]
    images = [[Image.new("RGB", (28, 28))], [Image.new("L", (56, 56)), Image.new("RGB", (84, 56))]]
    out = processor(text=texts, images=images)
    pad = processor.media_pad_token_id
    # 28² -> 1 token; 56² -> 2·2, 84×56 -> 2·3
    assert ((out["input_ids"] == pad) & (out["attention_mask"] == 1)).sum(-1).tolist() == [1, 4 + 6]
    assert out["grid_thws"].tolist() == [[1, 2, 2], [1, 4, 4], [1, 4, 6]]


def test_processor_mismatch_and_bad_image_raise(processor):
    with pytest.raises(ValueError, match="placeholder"):
        processor(text=f"{IMAGE_PLACEHOLDER}{IMAGE_PLACEHOLDER}", images=[Image.new("RGB", (28, 28))])
    with pytest.raises(ValueError, match="image 1"):
        processor(text=f"{IMAGE_PLACEHOLDER}{IMAGE_PLACEHOLDER}", images=[Image.new("RGB", (28, 28)), b"junk"])


def test_processor_rejects_tokenizer_without_media_tokens():
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast
    backend = Tokenizer(models.WordLevel({"[PAD]": 0, "[UNK]": 1}, unk_token="[UNK]"))
    bare = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", pad_token="[PAD]")
    proc = KimiK3Processor(KimiK3ImageProcessor(TINY), bare)
    with pytest.raises(ValueError, match="media token"):
        proc(text=IMAGE_PLACEHOLDER, images=[Image.new("RGB", (28, 28))])


def test_processor_save_load_round_trip(tmp_path, processor):
    processor.save_pretrained(tmp_path)
    loaded = KimiK3Processor.from_pretrained(tmp_path)
    assert loaded.image_processor.cfg == processor.image_processor.cfg
    img = Image.new("RGB", (100, 50), (9, 8, 7))
    a = processor(text=f"x{IMAGE_PLACEHOLDER}", images=[img])
    b = loaded(text=f"x{IMAGE_PLACEHOLDER}", images=[img])
    assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["pixel_values"], b["pixel_values"])


PUBLISHED_BG = {"pattern": "chessboard", "chessboard_square_size": 4, "chessboard_square_on_top_left": False,
                "chessboard_white_value": 250, "chessboard_gray_value": 100}


def test_published_background_keys_are_read():
    """square 4, gray on top left (chessboard_square_on_top_left false), white 250, gray 100."""
    out = KimiK3ImageProcessor(TINY, transparent_bg_config=PUBLISHED_BG)([Image.new("LA", (28, 28), (0, 0))])
    pv = out["pixel_values"]
    for (x, y), v in {(0, 0): 100.0, (3, 3): 100.0, (4, 0): 250.0, (0, 4): 250.0, (4, 4): 100.0}.items():
        torch.testing.assert_close(_pixel(pv, (1, 2, 2), x, y), torch.full((3,), _norm(v)), rtol=0, atol=1e-6)


@pytest.mark.parametrize("bg,want", [
    ({"pattern": "chessboard"}, {(0, 0): 255.0, (16, 0): 200.0, (15, 15): 255.0}),   # the published defaults
    ({"pattern": "gray"}, {(0, 0): 128.0, (16, 0): 128.0}),
    ({}, {(0, 0): 0.0, (16, 0): 0.0}),                                                  # pattern "black"
    (None, {(0, 0): 9.0, (16, 0): 9.0}),                                                # no blend: the colour
], ids=["chessboard-defaults", "gray", "empty-is-black", "none"])
def test_background_defaults_follow_the_published_processor(bg, want):
    out = KimiK3ImageProcessor(TINY, transparent_bg_config=bg)([Image.new("RGBA", (28, 28), (9, 9, 9, 0))])
    for (x, y), v in want.items():
        torch.testing.assert_close(_pixel(out["pixel_values"], (1, 2, 2), x, y), torch.full((3,), _norm(v)))


@pytest.mark.parametrize("bg,match", [
    ({"pattern": "chessboard", "square": 8}, r"unknown key\(s\) \['square'\]; the published keys"),
    ({"pattern": "checkers"}, "pattern 'checkers'"),
    ({"chessboard_square_size": 0}, "chessboard_square_size must be an int >= 1"),
    ({"chessboard_gray_value": 300}, r"chessboard_gray_value must be an int in \[0, 255\]"),
    ({"chessboard_square_on_top_left": "white"}, "true or false"),
], ids=["old-key", "pattern", "square-0", "gray-300", "top-left-string"])
def test_bad_background_config_raises(bg, match):
    with pytest.raises(ValueError, match=match):
        MediaProcConfig(transparent_bg_config=bg)


def test_save_pretrained_writes_published_background_keys(tmp_path):
    KimiK3ImageProcessor().save_pretrained(tmp_path / "k3")
    saved = json.loads((tmp_path / "k3" / "preprocessor_config.json").read_text())["media_proc_cfg"]
    assert saved["transparent_bg_config"] == {"pattern": "chessboard", "chessboard_square_size": 8,
                                              "chessboard_square_on_top_left": True, "chessboard_white_value": 255,
                                              "chessboard_gray_value": 180}
    KimiK3ImageProcessor(TINY, transparent_bg_config=PUBLISHED_BG).save_pretrained(tmp_path / "custom")
    loaded = KimiK3ImageProcessor.from_pretrained(tmp_path / "custom")
    assert loaded.cfg.transparent_bg_config == PUBLISHED_BG
    saved = json.loads((tmp_path / "custom" / "preprocessor_config.json").read_text())["media_proc_cfg"]
    assert saved["transparent_bg_config"] == PUBLISHED_BG


def test_media_proc_config_reads_published_keys():
    cfg = MediaProcConfig.from_dict({"patch_size": 14, "merge_kernel_size": [2, 2], "in_patch_limit": 65536,
                                     "patch_limit_on_one_side": 512, "sample_fps": 8.0,
                                     "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]})
    assert cfg.merge_kernel_size == 2 and cfg.extra == {"sample_fps": 8.0}
    assert cfg.to_dict()["sample_fps"] == 8.0
