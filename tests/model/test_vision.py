"""MoonViT-V2 vision tower + patchmergerv2 projector on the tiny config (spec §9, §14.2)."""
import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import example, given, settings, strategies as st
from PIL import Image

from k3compile.model.config import KimiK3VisionConfig
from k3compile.model.processing import IMAGE_PLACEHOLDER, KimiK3ImageProcessor, MediaProcConfig
from k3compile.model.vision import (
    MoonViT, PatchMergerV2, apply_rope_2d, image_features, merge_image_features, rope_2d_angles,
    tpool_patch_merge,
)
from k3compile.testing import rel_err as rel

CFG = KimiK3VisionConfig.tiny()


@pytest.fixture(scope="module")
def tower():
    torch.manual_seed(0)
    return MoonViT(CFG).eval()


@pytest.fixture(scope="module")
def projector():
    torch.manual_seed(1)
    return PatchMergerV2(CFG).eval()


def _pixels(grids, seed=0):
    g = torch.Generator().manual_seed(seed)
    n = sum(t * h * w for t, h, w in grids)
    return torch.rand(n, 3, 14, 14, generator=g) * 2 - 1


# ----------------------------------------------------------------------------------------------
# Independent reference: complex-number RoPE, one masked attention over the packed sequence
# ----------------------------------------------------------------------------------------------

def naive_tower(tower, pixel_values, grids):
    cfg, dh = tower.config, CFG.qkv_hidden_size // CFG.vt_num_attention_heads
    x = F.conv2d(pixel_values, tower.patch_embed.proj.weight, stride=14).flatten(1)
    pos, cis, seg = [], [], []
    for i, (t, h, w) in enumerate(grids):
        wt = tower.patch_embed.pos_emb.weight
        pos.append(F.interpolate(wt.permute(2, 0, 1)[None], size=(h, w), mode="bilinear")[0]
                   .permute(1, 2, 0).reshape(h * w, -1))
        freqs = 1.0 / 10000 ** (torch.arange(0, dh, 4).float() / dh)
        ys, xs = torch.meshgrid(torch.arange(h).float(), torch.arange(w).float(), indexing="ij")
        xc = torch.polar(torch.ones(h * w, dh // 4), xs.reshape(-1, 1) * freqs)
        yc = torch.polar(torch.ones(h * w, dh // 4), ys.reshape(-1, 1) * freqs)
        cis.append(torch.stack([xc, yc], -1).reshape(h * w, dh // 2))
        seg.append(torch.full((h * w,), i))
    x = x + torch.cat(pos)
    cis, seg = torch.cat(cis), torch.cat(seg)
    mask = seg[:, None] == seg[None, :]

    def rms(v, w, eps=torch.finfo(torch.float32).eps):
        return v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps) * w

    def rope(v):  # v [N, H, Dh]
        vc = torch.view_as_complex(v.reshape(*v.shape[:-1], -1, 2))
        return torch.view_as_real(vc * cis[:, None, :]).flatten(-2)

    n, heads = x.shape[0], CFG.vt_num_attention_heads
    for blk in tower.encoder.blocks:
        qkv = rms(x, blk.norm0.weight) @ blk.wqkv.weight.T
        q, k, v = qkv.view(n, 3, heads, dh).unbind(1)
        q, k = rope(q), rope(k)
        s = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(dh)
        a = s.masked_fill(~mask, float("-inf")).softmax(-1)
        x = x + torch.einsum("hqk,khd->qhd", a, v).reshape(n, -1) @ blk.wo.weight.T
        hid = F.gelu(rms(x, blk.norm1.weight) @ blk.mlp.fc0.weight.T, approximate="tanh")
        x = x + hid @ blk.mlp.fc1.weight.T
    x = rms(x, tower.encoder.final_layernorm.weight)
    out = []
    start = 0
    for t, h, w in grids:  # 2×2 merge by explicit indices
        idx = torch.arange(h * w).view(h, w)
        for r in range(0, h, 2):
            for c in range(0, w, 2):
                out.append(x[start + torch.stack([idx[r, c], idx[r, c + 1], idx[r + 1, c], idx[r + 1, c + 1]])])
        start += h * w
    return torch.stack(out)


GRIDS = {
    "one-4x6": [(1, 4, 6)],
    "three-4x6-2x2-16x16": [(1, 4, 6), (1, 2, 2), (1, 16, 16)],
    "two-6x2-2x8": [(1, 6, 2), (1, 2, 8)],
}


@pytest.mark.parametrize("grids", GRIDS.values(), ids=GRIDS.keys())
def test_tower_matches_naive_reference(tower, grids):
    pv = _pixels(grids)
    out = torch.full((sum(h * w for _, h, w in grids) // 4, 4, CFG.vt_hidden_size), float("nan"))
    with torch.no_grad():
        out.copy_(tower(pv, grids))
        ref = naive_tower(tower, pv, grids)
    assert out.shape == ref.shape
    assert rel(out, ref) < 1e-5


EVEN = st.integers(1, 5).map(lambda v: 2 * v)


@settings(max_examples=max(10, settings.default.max_examples // 3))
@given(grids=st.lists(st.tuples(st.just(1), EVEN, EVEN), min_size=1, max_size=3), seed=st.integers(0, 2**16))
def test_tower_matches_naive_reference_drawn_grids(tower, grids, seed):
    pv = _pixels(grids, seed)
    with torch.no_grad():
        out, ref = tower(pv, grids), naive_tower(tower, pv, grids)
    assert rel(out, ref) < 1e-5


def test_output_shapes_tiny(tower, projector):
    grids = [(1, 4, 6), (1, 2, 2)]
    with torch.no_grad():
        merged = tower(_pixels(grids), torch.tensor(grids))
        feats = projector(merged)
    assert merged.shape == (6 + 1, 4, CFG.vt_hidden_size)
    assert feats.shape == (7, CFG.text_hidden_size)
    assert torch.isfinite(feats).all()


def test_checkpoint_names_as_published(tower, projector):
    names = {f"vision_tower.{k}": tuple(v.shape) for k, v in tower.state_dict().items()}
    names |= {f"mm_projector.{k}": tuple(v.shape) for k, v in projector.state_dict().items()}
    d, q, f, e = 64, 96, 128, 128
    want = {"vision_tower.patch_embed.proj.weight": (d, 3, 14, 14),
            "vision_tower.patch_embed.pos_emb.weight": (16, 16, d),
            "vision_tower.encoder.final_layernorm.weight": (d,),
            "mm_projector.proj.0.weight": (4 * d, 4 * d), "mm_projector.proj.2.weight": (e, 4 * d),
            "mm_projector.post_norm.weight": (e,)}
    for i in range(2):
        b = f"vision_tower.encoder.blocks.{i}"
        want |= {f"{b}.norm0.weight": (d,), f"{b}.norm1.weight": (d,), f"{b}.wqkv.weight": (3 * q, d),
                 f"{b}.wo.weight": (d, q), f"{b}.mlp.fc0.weight": (f, d), f"{b}.mlp.fc1.weight": (d, f)}
    assert names == want


def test_real_config_parameter_count_on_meta():
    with torch.device("meta"):
        cfg = KimiK3VisionConfig()
        n_tower = sum(p.numel() for p in MoonViT(cfg).parameters())
        n_proj = sum(p.numel() for p in PatchMergerV2(cfg).parameters())
    # spec §2.2: vision tower 401.2 M, projector 46.1 M (from the shipped tensor shapes)
    assert abs(n_tower - 401.2e6) < 0.1e6
    assert abs(n_proj - 46.1e6) < 0.1e6


# ----------------------------------------------------------------------------------------------
# 2-D RoPE
# ----------------------------------------------------------------------------------------------

def test_rope_angles_hand_values():
    # head_dim 8: f = [1, 10000^-0.5 = 0.01]; patch 5 of a 2×3 grid is (y=1, x=2): [x·f0, y·f0, x·f1, y·f1]
    ang = rope_2d_angles(2, 3, 8)
    assert ang.shape == (6, 4)
    torch.testing.assert_close(ang[5], torch.tensor([2.0, 1.0, 0.02, 0.01]))


@given(dh=st.sampled_from([4, 8, 24, 128]), y1=st.integers(0, 20), x1=st.integers(0, 20), y2=st.integers(0, 20),
       x2=st.integers(0, 20), dy=st.integers(0, 10), dx=st.integers(0, 10), seed=st.integers(0, 2**16))
@example(dh=24, y1=0, x1=0, y2=3, x2=5, dy=7, dx=2, seed=0)
def test_rope_scores_depend_only_on_relative_position(dh, y1, x1, y2, x2, dy, dx, seed):
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(2, 1, 1, dh, generator=g, dtype=torch.float64).float().unbind(0)
    ang = rope_2d_angles(32, 32, dh)

    def score(p1, p2):
        i, j = p1[0] * 32 + p1[1], p2[0] * 32 + p2[1]
        qr = apply_rope_2d(q, ang[i:i + 1].cos(), ang[i:i + 1].sin())
        kr = apply_rope_2d(k, ang[j:j + 1].cos(), ang[j:j + 1].sin())
        return (qr * kr).sum()

    base = score((y1, x1), (y2, x2))
    shifted = score((y1 + dy, x1 + dx), (y2 + dy, x2 + dx))
    assert abs(base - shifted) <= 1e-4 * (1 + abs(base))
    assert abs(score((0, 0), (0, 0)) - (q * k).sum()) < 1e-5  # zero angle = identity


def test_rope_keeps_norm_and_x_y_axes_differ():
    x = torch.randn(5, 2, 24)
    ang = rope_2d_angles(1, 5, 24)
    out = apply_rope_2d(x, ang.cos(), ang.sin())
    torch.testing.assert_close(out.norm(dim=-1), x.norm(dim=-1))
    a_row, a_col = rope_2d_angles(1, 2, 24)[1], rope_2d_angles(2, 1, 24)[1]  # (0,1) vs (1,0)
    assert torch.equal(a_row[0::2], a_col[1::2]) and not torch.equal(a_row, a_col)


def test_block_is_equivariant_when_positions_move_with_tokens(tower):
    blk, grids = tower.encoder.blocks[0], [(1, 4, 6)]
    x = torch.randn(24, CFG.vt_hidden_size)
    cos, sin = tower.encoder.rope(grids, x.device)
    perm = torch.randperm(24, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        out = blk(x, [24], cos, sin)
        out_moved = blk(x[perm], [24], cos[perm], sin[perm])  # tokens keep their positions
        out_swapped = blk(x[perm], [24], cos, sin)             # tokens get other positions
    torch.testing.assert_close(out_moved, out[perm], rtol=1e-5, atol=1e-5)
    assert rel(out_swapped, out[perm]) > 1e-3


# ----------------------------------------------------------------------------------------------
# Batching, position embedding, merge, projector
# ----------------------------------------------------------------------------------------------

def test_image_alone_equals_image_batched_with_others(tower, projector):
    a, others = (1, 4, 6), [(1, 2, 2), (1, 8, 4)]
    pa, pb, pc = _pixels([a], 1), _pixels([others[0]], 2), _pixels([others[1]], 3)
    with torch.no_grad():
        alone = image_features(tower, projector, pa, [a])
        batched = image_features(tower, projector, torch.cat([pb, pa, pc]), [others[0], a, others[1]])
    assert batched.shape[0] == 1 + 6 + 8
    assert rel(batched[1:7], alone) < 1e-6


def test_pos_emb_identity_and_half_size_is_2x2_average(tower):
    pe = tower.patch_embed.pos_emb
    with torch.no_grad():
        assert torch.equal(pe([(1, 16, 16)]), pe.weight.flatten(0, 1))
        # bilinear, align_corners=False, exact 2× downscale samples between 4 source pixels
        half = pe([(1, 8, 8)]).view(8, 8, -1)
        want = F.avg_pool2d(pe.weight.permute(2, 0, 1)[None], 2)[0].permute(1, 2, 0)
    torch.testing.assert_close(half, want, rtol=1e-6, atol=1e-6)


def test_tpool_merge_order():
    x = torch.arange(4 * 6).float()[:, None]  # value = patch index, grid 4×6
    merged = tpool_patch_merge(x, [(1, 4, 6)], (2, 2))
    assert merged.shape == (6, 4, 1)
    assert merged[0, :, 0].tolist() == [0, 1, 6, 7]
    assert merged[1, :, 0].tolist() == [2, 3, 8, 9]
    assert merged[3, :, 0].tolist() == [12, 13, 18, 19]


def test_projector_formula(projector):
    x = torch.randn(5, 4, CFG.vt_hidden_size)
    with torch.no_grad():
        out = projector(x)
        h = F.gelu(x.flatten(1) @ projector.proj[0].weight.T)  # exact erf GELU
        h = h @ projector.proj[2].weight.T
        ref = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5) * projector.post_norm.weight
    assert rel(out, ref) < 1e-6


def test_bf16_tower_close_to_fp32(tower, projector):
    grids = [(1, 4, 6)]
    pv = _pixels(grids)
    import copy
    t16, p16 = copy.deepcopy(tower).bfloat16(), copy.deepcopy(projector).bfloat16()
    with torch.no_grad():
        ref = image_features(tower, projector, pv, grids)
        out = image_features(t16, p16, pv, grids)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    assert rel(out, ref) < 3e-2


# ----------------------------------------------------------------------------------------------
# Substitution and bad input
# ----------------------------------------------------------------------------------------------

def test_merge_image_features_substitutes_pad_positions_in_order():
    pad = 500
    ids = torch.tensor([[1, pad, pad, 2], [pad, 3, 4, 5]])
    emb = torch.zeros(2, 4, 3)
    feats = torch.arange(9.0).view(3, 3)
    out = merge_image_features(emb, ids, feats, pad)
    assert out[0, 1].tolist() == [0, 1, 2] and out[0, 2].tolist() == [3, 4, 5] and out[1, 0].tolist() == [6, 7, 8]
    assert out[0, 0].abs().sum() == 0 and emb.abs().sum() == 0  # untouched input
    with pytest.raises(ValueError, match="media-pad"):
        merge_image_features(emb, ids, feats[:2], pad)


@pytest.mark.parametrize("pixels,grids,match", [
    (24, [(1, 4, 5)], "multiples"),
    (24, [(1, 4, 4)], "cover 16 patches"),
    (24, [(1, 4, 6), (1, 2, 2)], "cover 28 patches"),
    (0, [(0, 2, 2)], "t >= 1"),
    (80 * 2, [(1, 80, 2)], "RoPE grid"),
], ids=["odd-grid", "too-few-grid", "too-many-grid", "t0", "over-rope-grid"])
def test_bad_grid_raises(tower, pixels, grids, match):
    with pytest.raises(ValueError, match=match):
        tower(torch.zeros(pixels, 3, 14, 14), grids)


def test_bad_pixel_shape_raises(tower):
    with pytest.raises(ValueError, match=r"\[N, 3, 14, 14\]"):
        tower(torch.zeros(24, 3, 16, 16), [(1, 4, 6)])


def test_processor_output_feeds_tower(tower, projector):
    proc = KimiK3ImageProcessor(MediaProcConfig.tiny())
    out = proc([Image.new("RGB", (84, 56), (3, 4, 5)), Image.new("RGBA", (300, 200), (0, 0, 0, 0))])
    with torch.no_grad():
        feats = image_features(tower, projector, out["pixel_values"], out["grid_thws"])
    plans = [proc.plan(84, 56), proc.plan(300, 200)]
    assert feats.shape == (sum(p.num_tokens for p in plans), CFG.text_hidden_size)
    assert IMAGE_PLACEHOLDER  # the processor's placeholder is what the prompt carries


# ----------------------------------------------------------------------------------------------
# End to end: processor -> vision tower -> features at media-pad positions -> generate
# ----------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def multimodal():
    from k3compile.model import KimiK3Config, KimiK3ForConditionalGeneration
    from k3compile.model.processing import KimiK3Processor

    try:  # tests/model may or may not be a package
        from .test_processing import make_tokenizer
    except ImportError:
        from test_processing import make_tokenizer
    proc = KimiK3Processor(KimiK3ImageProcessor(MediaProcConfig.tiny()), make_tokenizer())
    cfg = KimiK3Config.micro()
    cfg.media_placeholder_token_id = proc.media_pad_token_id
    torch.manual_seed(0)
    model = KimiK3ForConditionalGeneration(cfg).eval()
    return model, proc


def test_multimodal_generate_two_images_of_different_sizes(multimodal):
    model, proc = multimodal
    images = [Image.new("RGB", (84, 56), (200, 30, 30)), Image.new("RGBA", (60, 120), (0, 0, 255, 100))]
    prompt = f"a {IMAGE_PLACEHOLDER} b {IMAGE_PLACEHOLDER} ?"
    batch = proc(text=prompt, images=images)
    ids, pv, grids = batch["input_ids"], batch["pixel_values"], batch["grid_thws"]
    assert grids.tolist() == [[1, 4, 6], [1, 10, 6]]  # 60×120 pads to 84×140
    with torch.no_grad():
        new = model.generate(ids, 4, pixel_values=pv, grid_thws=grids)
        # the same prompt embedded by hand gives the same first logits
        embeds = model.get_input_embeddings()(ids)
        feats = image_features(model.vision_tower, model.mm_projector, pv, grids)
        embeds = merge_image_features(embeds, ids, feats, proc.media_pad_token_id)
        by_hand = model(inputs_embeds=embeds, logits_to_keep=1)
        direct = model(ids, pixel_values=pv, grid_thws=grids, logits_to_keep=1)
        other = model(ids, pixel_values=pv.flip(0), grid_thws=grids, logits_to_keep=1)
    assert new.shape == (1, 4) and ((new >= 0) & (new < 512)).all()
    assert new[0, 0] == by_hand.argmax(-1)[0, 0]
    assert rel(direct, by_hand) < 1e-6
    assert rel(other, direct) > 1e-4                             # the pixels reach the logits


def test_save_load_round_trip_with_vision_weights(multimodal, tmp_path):
    model, proc = multimodal
    model.save_pretrained(tmp_path)
    from safetensors import safe_open
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
    assert {"vision_tower.patch_embed.proj.weight", "vision_tower.encoder.blocks.1.wqkv.weight",
            "mm_projector.proj.2.weight", "mm_projector.post_norm.weight"} <= keys
    loaded = type(model).from_pretrained(tmp_path)
    for name, t in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], t), name
    batch = proc(text=f"x {IMAGE_PLACEHOLDER} y", images=[Image.new("RGB", (84, 56), (5, 99, 7))])
    kw = dict(pixel_values=batch["pixel_values"], grid_thws=batch["grid_thws"])
    with torch.no_grad():
        assert torch.equal(loaded.generate(batch["input_ids"], 3, **kw), model.generate(batch["input_ids"], 3, **kw))


def test_video_grid_time_embedding(tower):
    # t = 2 frames: the fixed sincos time embedding separates the frames; the merge averages them
    grids = [(2, 4, 4)]
    with torch.no_grad():
        pos = tower.patch_embed.pos_emb(grids).view(2, 16, -1)
        out = tower(_pixels(grids), grids)
    assert out.shape == (4, 4, CFG.vt_hidden_size)
    diff = pos[1] - pos[0]  # sin(1·ω) - sin(0) | cos(1·ω) - cos(0), the same for every patch
    torch.testing.assert_close(diff, diff[:1].expand_as(diff))
    assert diff[0, 0].item() == pytest.approx(math.sin(1.0), abs=1e-6)
