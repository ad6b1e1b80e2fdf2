"""NaViT resize, chessboard fill, normalisation, patchify and the Kimi K3 processor (spec §2.3, §9).

Expected resize/token numbers in the tables are worked out by hand from the spec's formulas
(the comment beside each row shows the arithmetic).
"""
import io

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
    got = _pixel(out["pixel_values"], (1, 2, 2), 0, 0)  # over white: R 255, G = B ≈ 255·127/255
    want = torch.tensor([_norm(255.0), _norm(127.0), _norm(127.0)])
    torch.testing.assert_close(got, want, rtol=0, atol=2.5 / 255 * 2)


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
    with pytest.raises(TypeError, match="image 0"):
        KimiK3ImageProcessor(TINY)([torch.zeros(3, 28, 28)])


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


def test_media_proc_config_reads_published_keys():
    cfg = MediaProcConfig.from_dict({"patch_size": 14, "merge_kernel_size": [2, 2], "in_patch_limit": 65536,
                                     "patch_limit_on_one_side": 512, "sample_fps": 8.0,
                                     "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]})
    assert cfg.merge_kernel_size == 2 and cfg.extra == {"sample_fps": 8.0}
    assert cfg.to_dict()["sample_fps"] == 8.0
