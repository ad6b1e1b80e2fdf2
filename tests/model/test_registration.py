"""transformers' Auto classes build *our* K3 from the published config.json, never a Kimi Linear class; the
published size reports 2.78 T parameters on the meta device."""
import json
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from k3compile.model import KimiK3Config, KimiK3ForConditionalGeneration, KimiK3TextConfig, KimiK3VisionConfig

PUBLISHED = Path(__file__).parent / "data" / "kimi_k3_config.json"   # spec §2 values, published layout


@pytest.fixture
def published_dir(tmp_path):
    shutil.copy(PUBLISHED, tmp_path / "config.json")
    return tmp_path


def test_auto_config_builds_k3_text_config_from_kimi_linear_entry(published_dir):
    config = AutoConfig.from_pretrained(published_dir)
    assert type(config) is KimiK3Config
    text = config.text_config
    assert type(text) is KimiK3TextConfig                      # not transformers' KimiLinearConfig
    assert text.attn_res_block_size == 12 and text.routed_expert_hidden_size == 3584
    assert text.linear_attn_config["gate_lower_bound"] == -5.0 and text.activation_situ_beta == 4.0
    assert len(text.full_attn_layers) == 24 and text.is_mla_layer(92) and not text.is_mla_layer(0)
    assert type(config.vision_config) is KimiK3VisionConfig and config.vision_config.vt_hidden_size == 1024
    assert config.media_placeholder_token_id == 163605
    assert config.quantization_config["format"] == "mxfp4-pack-quantized"


def test_the_trap_exists():
    """What the guard is for: transformers resolves the text entry's model_type to its own Kimi Linear."""
    published_text = json.loads(PUBLISHED.read_text())["text_config"]
    assert published_text["model_type"] == "kimi_linear"
    assert type(AutoConfig.for_model("kimi_linear")).__name__ == "KimiLinearConfig"


def test_saved_config_keeps_published_layout(published_dir, tmp_path):
    config = AutoConfig.from_pretrained(published_dir)
    out = tmp_path / "out"
    config.save_pretrained(out)
    saved, published = json.loads((out / "config.json").read_text()), json.loads(PUBLISHED.read_text())
    assert saved["model_type"] == "kimi_k3" and saved["text_config"]["model_type"] == "kimi_linear"
    for key, value in published["text_config"].items():
        if key not in ("architectures", "dtype"):
            assert saved["text_config"][key] == value, key
    assert AutoConfig.from_pretrained(out).to_dict()["text_config"] == config.to_dict()["text_config"]


@torch.no_grad()
def test_auto_model_from_pretrained_builds_our_class(tmp_path):
    torch.manual_seed(0)
    model = KimiK3ForConditionalGeneration(KimiK3Config.micro()).eval()
    model.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["text_config"]["model_type"] == "kimi_linear"
    auto = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert type(auto) is KimiK3ForConditionalGeneration
    ids = torch.randint(0, 512, (1, 6))
    assert torch.equal(auto(ids), model(ids))


def test_published_size_on_meta_is_2_78_T(published_dir):
    config = AutoConfig.from_pretrained(published_dir)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    assert type(model) is KimiK3ForConditionalGeneration
    total = sum(p.numel() for p in model.parameters())
    assert abs(total / 2.78e12 - 1) < 0.01, total
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    assert abs(experts / 2722.7e9 - 1) < 0.001, experts                 # spec §2.1: 2722.7 G routed


def test_kimi_k3_constructor_equals_published_values():
    published = json.loads(PUBLISHED.read_text())
    ours = KimiK3Config.kimi_k3().to_dict()
    for key, value in published["text_config"].items():
        if key not in ("architectures", "dtype"):
            assert ours["text_config"][key] == value, key
    for key, value in published["vision_config"].items():
        assert ours["vision_config"][key] == value, key
