"""The integrated model: images through KimiK3ForConditionalGeneration (bad input, grid forms, bf16), and the
model-owned MTP module (published key mapping, save/load, speculative decoding equal to plain greedy).

One micro model for the module (4 text layers, tiny vision tower, one MTP layer)."""
import copy

import pytest
import torch
from PIL import Image

from k3compile.model import (KimiK3Config, KimiK3ForConditionalGeneration, KimiK3ImageProcessor, KimiK3Processor,
                             speculative_generate)
from k3compile.model.loading import CheckpointError
from k3compile.model.processing import IMAGE_PLACEHOLDER, MediaProcConfig
from k3compile.testing import rel_err as rel

try:  # tests/model may or may not be a package
    from .test_processing import make_tokenizer
except ImportError:
    from test_processing import make_tokenizer

L = 4  # micro: text layers 0..3, the MTP layer is published as layer 4


@pytest.fixture(scope="module")
def mm():
    """(model with vision + MTP, processor, a two-image batch of different sizes)."""
    proc = KimiK3Processor(KimiK3ImageProcessor(MediaProcConfig.tiny()), make_tokenizer())
    cfg = KimiK3Config.micro(num_nextn_predict_layers=1)
    cfg.media_placeholder_token_id = proc.media_pad_token_id
    torch.manual_seed(0)
    model = KimiK3ForConditionalGeneration(cfg).eval()
    images = [Image.new("RGB", (84, 56), (200, 30, 30)), Image.new("RGBA", (60, 120), (0, 0, 255, 100))]
    batch = proc(text=f"a {IMAGE_PLACEHOLDER} b {IMAGE_PLACEHOLDER} ?", images=images)
    return model, proc, batch


def first_image(batch):
    """pixel_values / grid_thws of the batch's first image only."""
    t, h, w = batch["grid_thws"][0].tolist()
    return batch["pixel_values"][:t * h * w], batch["grid_thws"][:1]


# -- images at the model -------------------------------------------------------------------------------------------
def test_grid_thws_as_tensor_or_python_ints_give_the_same_logits(mm):
    model, _, batch = mm
    ids, pv, grids = batch["input_ids"], batch["pixel_values"], batch["grid_thws"]
    with torch.no_grad():
        a = model(ids, pixel_values=pv, grid_thws=grids, logits_to_keep=1)
        b = model(ids, pixel_values=pv, grid_thws=grids.tolist(), logits_to_keep=1)
        c = model.forward(ids, pixel_values=pv, grid_thws=grids, logits_to_keep=1)   # uncompiled path, tensor
    assert torch.equal(a, b) and torch.equal(a, c) and not a.isnan().any()


def test_image_count_differing_from_prompt_is_a_clear_error(mm):
    model, proc, batch = mm
    ids = batch["input_ids"]                                                   # two images in the prompt
    pv1, grid1 = first_image(batch)
    with torch.no_grad():
        with pytest.raises(ValueError, match=r"2 image\(s\).*1 image\(s\)"):
            model.generate(ids, 2, pixel_values=pv1, grid_thws=grid1)
        one = proc(text=f"x {IMAGE_PLACEHOLDER} y", images=[Image.new("RGB", (84, 56))])["input_ids"]
        with pytest.raises(ValueError, match=r"1 image\(s\).*2 image\(s\)"):
            model(one, pixel_values=batch["pixel_values"], grid_thws=batch["grid_thws"])
        with pytest.raises(ValueError, match=r"0 image\(s\)"):                # no media tokens at all
            model(torch.tensor([[5, 6, 7]]), pixel_values=pv1, grid_thws=grid1)


def test_images_in_the_wrong_order_are_a_clear_error(mm):
    model, _, batch = mm
    g = batch["grid_thws"]
    n0 = int(g[0].prod())
    swapped_pv = torch.cat([batch["pixel_values"][n0:], batch["pixel_values"][:n0]])
    with torch.no_grad(), pytest.raises(ValueError, match="do not match the images' token counts"):
        model(batch["input_ids"], pixel_values=swapped_pv, grid_thws=g.flip(0))


def test_half_given_image_inputs_are_an_error(mm):
    model, _, batch = mm
    with torch.no_grad():
        with pytest.raises(ValueError, match="without grid_thws"):
            model(batch["input_ids"], pixel_values=batch["pixel_values"])
        with pytest.raises(ValueError, match="without pixel_values"):
            model(batch["input_ids"], grid_thws=batch["grid_thws"])


def test_bf16_model_keeps_the_vision_path_close_to_fp32(mm):
    model, _, batch = mm
    ids, pv, grids = batch["input_ids"], batch["pixel_values"], batch["grid_thws"]
    bf = copy.deepcopy(model).set_dtype(torch.bfloat16)
    assert bf.vision_tower.encoder.blocks[0].wqkv.weight.dtype == torch.bfloat16
    assert bf.mm_projector.post_norm.weight.dtype == torch.bfloat16            # stored as published
    pad = ids == model.config.media_placeholder_token_id
    with torch.no_grad():
        ref = model.embed_input_ids(ids, pv, grids)[pad]
        out = bf.embed_input_ids(ids, pv.float(), grids)                      # fp32 pixels are cast in
        logits = bf(ids, pixel_values=pv, grid_thws=grids, logits_to_keep=1)
    assert out.dtype == torch.bfloat16 and not out.isnan().any()
    assert rel(out[pad], ref) < 3e-2                                          # the norms compute in fp32
    assert logits.dtype == torch.bfloat16 and torch.isfinite(logits).all()


def test_whole_published_model_on_meta_includes_the_vision_tower():
    with torch.device("meta"):
        model = KimiK3ForConditionalGeneration(KimiK3Config.kimi_k3())
    vision = sum(p.numel() for n, p in model.named_parameters() if n.startswith(("vision_tower.", "mm_projector.")))
    total = sum(p.numel() for p in model.parameters())
    assert abs(vision / 0.45e9 - 1) < 0.05, vision
    assert abs(total / 2.78e12 - 1) < 0.01, total
    assert not hasattr(model, "mtp")                                          # published: no MTP layers


# -- the model-owned MTP module ------------------------------------------------------------------------------------
def test_mtp_state_dict_keys_are_the_published_names(mm):
    model, _, _ = mm
    keys = set(model.state_dict())
    assert {f"language_model.model.layers.{L}.enorm.weight", f"language_model.model.layers.{L}.eh_proj.weight",
            f"language_model.model.layers.{L}.shared_head.head.weight",
            f"language_model.model.layers.{L}.self_attn.kv_a_proj_with_mqa.weight",
            f"language_model.model.layers.{L}.block_sparse_moe.experts.3.w1.weight",
            f"language_model.model.layers.{L}.input_layernorm.weight"} <= keys
    assert not any(k.startswith("mtp.") or "mtp_block" in k for k in keys)
    assert not any(k.startswith(f"language_model.model.layers.{L}.") and "_res_" in k for k in keys)
    clone = copy.deepcopy(model)
    for p in clone.mtp.parameters():
        p.data.zero_()
    clone.load_state_dict(model.state_dict(), strict=True)                   # published names load back
    assert torch.equal(clone.mtp.layers[0].eh_proj.weight, model.mtp.layers[0].eh_proj.weight)


def test_save_load_round_trip_with_vision_and_mtp(mm, tmp_path):
    model, _, batch = mm
    model.save_pretrained(tmp_path)
    loaded = KimiK3ForConditionalGeneration.from_pretrained(tmp_path)
    assert loaded.config.text_config.num_nextn_predict_layers == 1 and hasattr(loaded, "mtp")
    ref = model.state_dict()
    got = loaded.state_dict()
    assert set(got) == set(ref)
    for key, t in ref.items():
        assert torch.equal(got[key], t), key
    kw = dict(pixel_values=batch["pixel_values"], grid_thws=batch["grid_thws"])
    with torch.no_grad():
        assert torch.equal(loaded.generate(batch["input_ids"], 3, **kw), model.generate(batch["input_ids"], 3, **kw))


def test_checkpoint_with_mtp_tensors_into_a_model_without_mtp_is_an_error(mm, tmp_path):
    model, _, _ = mm
    model.save_pretrained(tmp_path)
    cfg = copy.deepcopy(model.config)
    cfg.text_config.num_nextn_predict_layers = 0
    with pytest.raises(CheckpointError, match="num_nextn_predict_layers"):
        KimiK3ForConditionalGeneration.from_pretrained(tmp_path, config=cfg)


@pytest.mark.parametrize("with_images", [False, True], ids=["text-B1-T6", "two-images"])
def test_speculative_with_the_models_mtp_equals_plain_greedy(mm, with_images):
    model, _, batch = mm
    if with_images:
        ids, kw = batch["input_ids"], dict(pixel_values=batch["pixel_values"], grid_thws=batch["grid_thws"])
    else:
        ids, kw = torch.randint(3, 95, (1, 6), generator=torch.Generator().manual_seed(2)), {}
    with torch.no_grad():
        greedy = model.generate(ids, 6, **kw)
    res = speculative_generate(model, None, ids, 6, num_draft_tokens=2, **kw)
    assert torch.equal(res.tokens, greedy)
    assert res.num_drafted > 0 and 0.0 <= res.acceptance_rate <= 1.0


def test_speculative_without_any_mtp_is_an_error():
    model = KimiK3ForConditionalGeneration(KimiK3Config.micro(num_hidden_layers=1, attn_res_block_size=1))
    with pytest.raises(ValueError, match="no MTP module"):
        speculative_generate(model, None, torch.tensor([[3, 4]]), 2)
