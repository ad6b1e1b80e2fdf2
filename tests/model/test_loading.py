"""Checkpoints in the published layout: save/load round trips, MXFP4 experts, the padded A_log."""
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from k3compile.model import KimiK3Config, KimiK3ForConditionalGeneration
from k3compile.model.loading import INDEX_NAME, SINGLE_NAME, dequantize_mxfp4, quantize_mxfp4

EXPERT = "language_model.model.layers.1.block_sparse_moe.experts.5"
A_LOG = "language_model.model.layers.0.self_attn.A_log"


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    return KimiK3ForConditionalGeneration(KimiK3Config.micro()).eval()


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, 512, (2, 7), generator=torch.Generator().manual_seed(3))


def rewrite_single(path, edit):
    tensors = load_file(str(path / SINGLE_NAME))
    edit(tensors)
    save_file(tensors, str(path / SINGLE_NAME), metadata={"format": "pt"})


def test_state_dict_keys_are_published_names(tiny):
    keys = set(tiny.state_dict())
    assert f"{EXPERT}.w1.weight" in keys and f"{EXPERT}.w2.weight" in keys
    assert "language_model.lm_head.weight" in keys and "language_model.model.embed_tokens.weight" in keys
    assert "language_model.model.layers.3.self_attn.kv_a_proj_with_mqa.weight" in keys
    assert "language_model.model.layers.0.self_attn.q_conv1d.weight" in keys
    assert "language_model.model.output_attn_res_proj.weight" in keys
    assert not any(k.endswith(("experts.w1", "experts.w2", "experts.w3")) for k in keys)
    assert tiny.state_dict()[f"{EXPERT}.w2.weight"].shape == (64, 48)        # [L, I] per expert


@torch.no_grad()
def test_round_trip_sharded_fp32(tiny, ids, tmp_path):
    tiny.save_pretrained(tmp_path, max_shard_size=400_000)
    index = json.loads((tmp_path / INDEX_NAME).read_text())
    assert len(set(index["weight_map"].values())) > 1 and set(index["weight_map"]) == set(tiny.state_dict())
    loaded = KimiK3ForConditionalGeneration.from_pretrained(tmp_path)
    assert loaded.dtype == torch.float32
    for key, t in tiny.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], t), key
    assert torch.equal(loaded(ids), tiny(ids))


@torch.no_grad()
def test_round_trip_bf16_keeps_fp32_tensors(tiny, ids, tmp_path):
    import copy
    m = copy.deepcopy(tiny).set_dtype(torch.bfloat16)
    m.save_pretrained(tmp_path)
    files = load_file(str(tmp_path / SINGLE_NAME))
    assert files[A_LOG].dtype == torch.float32 and files["language_model.lm_head.weight"].dtype == torch.bfloat16
    loaded = KimiK3ForConditionalGeneration.from_pretrained(tmp_path)
    assert loaded.dtype == torch.bfloat16
    assert loaded.get_parameter(A_LOG).dtype == torch.float32
    assert torch.equal(loaded(ids), m(ids))


def test_mxfp4_dequantize_hand_computed():
    # byte 0x2B: low nibble 0xB = sign + code 3 -> -1.5, high nibble 0x2 -> +1.0
    # byte 0xF7: low 0x7 -> 6.0, high 0xF -> -6.0;   byte 0x90: low 0 -> 0, high 0x9 -> -0.5
    packed = torch.tensor([[0x2B, 0xF7, 0x90] + [0x00] * 13, [0x44] * 16], dtype=torch.uint8)   # [2, 16] -> 32 cols
    scale = torch.tensor([[128], [125]], dtype=torch.uint8)                                     # x2, x1/4
    out = dequantize_mxfp4(packed, scale, torch.float32)
    assert out.shape == (2, 32)
    assert out[0, :6].tolist() == [-3.0, 2.0, 12.0, -12.0, 0.0, -1.0]
    assert torch.equal(out[0, 6:], torch.zeros(26))
    assert torch.equal(out[1], torch.full((32,), 0.5))                                          # code 4 = 2.0, /4


def test_mxfp4_rejects_bad_input():
    with pytest.raises(ValueError, match="shapes"):
        dequantize_mxfp4(torch.zeros(2, 16, dtype=torch.uint8), torch.zeros(2, 2, dtype=torch.uint8))
    with pytest.raises(ValueError, match="NaN"):
        dequantize_mxfp4(torch.zeros(1, 16, dtype=torch.uint8), torch.full((1, 1), 255, dtype=torch.uint8))


def test_mxfp4_quantize_is_exact_on_representable_values():
    gen = torch.Generator().manual_seed(0)
    magnitudes = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    codes = torch.randint(0, 8, (8, 2, 32), generator=gen)
    codes[:, :, 0] = 7                                                    # each group reaches 6 * 2^e
    sign = torch.where(torch.rand(8, 2, 32, generator=gen) < 0.5, -1.0, 1.0)
    exponent = torch.randint(-4, 4, (8, 2, 1), generator=gen).float()
    w = (magnitudes[codes] * sign * torch.exp2(exponent)).reshape(8, 64)
    packed, scale = quantize_mxfp4(w)
    assert torch.equal(scale, (exponent[..., 0] + 127).to(torch.uint8))
    assert torch.equal(dequantize_mxfp4(packed, scale, torch.float32), w)


@torch.no_grad()
def test_checkpoint_with_one_packed_expert(tiny, tmp_path):
    """A hand-packed MXFP4 expert in an otherwise plain checkpoint loads as the hand-computed values."""
    tiny.save_pretrained(tmp_path, quantize_experts=False)
    I, L = 48, 64                                                        # w1 is [I, L] = [48, 64]
    packed = torch.zeros(I, L // 2, dtype=torch.uint8)
    packed[:, 0] = 0x2B                                                  # cols 0, 1 = -1.5, +1.0 (x scale)
    packed[:, 16] = 0x70                                                 # cols 32, 33 = 0, 6.0
    scale = torch.full((I, L // 32), 127, dtype=torch.uint8)
    scale[:, 1] = 126                                                    # second group x 1/2
    scale[3, 0] = 130                                                    # row 3, first group x 8

    def edit(tensors):
        del tensors[f"{EXPERT}.w1.weight"]
        tensors[f"{EXPERT}.w1.weight_packed"] = packed
        tensors[f"{EXPERT}.w1.weight_scale"] = scale
    rewrite_single(tmp_path, edit)
    loaded = KimiK3ForConditionalGeneration.from_pretrained(tmp_path)
    w1 = loaded.state_dict()[f"{EXPERT}.w1.weight"]
    expect = torch.zeros(I, L)
    expect[:, 0], expect[:, 1], expect[:, 33] = -1.5, 1.0, 3.0
    expect[3, 0], expect[3, 1] = -12.0, 8.0
    assert torch.equal(w1, expect)
    for key in (f"{EXPERT}.w2.weight", "language_model.model.layers.2.block_sparse_moe.experts.0.w1.weight"):
        assert torch.equal(loaded.state_dict()[key], tiny.state_dict()[key])


@torch.no_grad()
def test_round_trip_with_quantized_experts(tiny, ids, tmp_path):
    """Experts MXFP4 can represent survive save (packed) -> load exactly (expert widths multiples of 32)."""
    torch.manual_seed(0)
    m = KimiK3ForConditionalGeneration(KimiK3Config.micro(moe_intermediate_size=96)).eval()
    for layer in m.text_model.layers[1:]:
        ex = layer.block_sparse_moe.experts
        for p in (ex.w1, ex.w2, ex.w3):
            flat = p.data.reshape(-1, p.shape[-1])
            p.data.copy_(dequantize_mxfp4(*quantize_mxfp4(flat), torch.float32).reshape(p.shape))
    m.save_pretrained(tmp_path, quantize_experts=True)
    files = load_file(str(tmp_path / SINGLE_NAME))
    assert files[f"{EXPERT}.w1.weight_packed"].dtype == torch.uint8 and f"{EXPERT}.w1.weight" not in files
    assert json.loads((tmp_path / "config.json").read_text())["quantization_config"]["format"] == "mxfp4-pack-quantized"
    loaded = KimiK3ForConditionalGeneration.from_pretrained(tmp_path)
    assert torch.equal(loaded(ids), m(ids))


@torch.no_grad()
def test_padded_A_log_is_trimmed(tiny, ids, tmp_path):
    tiny.save_pretrained(tmp_path)
    rewrite_single(tmp_path, lambda t: t.update({A_LOG: torch.cat([t[A_LOG], torch.zeros(26)])}))   # [6] -> [32]
    loaded = KimiK3ForConditionalGeneration.from_pretrained(tmp_path)
    assert torch.equal(loaded(ids), tiny(ids))
    rewrite_single(tmp_path, lambda t: t[A_LOG].__setitem__(-1, 1.0))
    with pytest.raises(ValueError, match="padding is not zero"):
        KimiK3ForConditionalGeneration.from_pretrained(tmp_path)


def test_bad_checkpoints_fail_clearly(tiny, tmp_path):
    tiny.save_pretrained(tmp_path)
    rewrite_single(tmp_path, lambda t: t.update({"language_model.model.bogus.weight": torch.zeros(1)}))
    with pytest.raises(KeyError, match="bogus"):
        KimiK3ForConditionalGeneration.from_pretrained(tmp_path)
    rewrite_single(tmp_path, lambda t: (t.pop("language_model.model.bogus.weight"), t.pop(f"{EXPERT}.w3.weight")))
    with pytest.raises(RuntimeError, match="experts"):
        KimiK3ForConditionalGeneration.from_pretrained(tmp_path)
