"""The memory plan against the model itself: parameter bytes per rank equal a meta-device model's (published config,
TP 8 and 16, MXFP4 and bf16 experts, by component), cache bytes equal an allocated cache's; the command line."""
import pytest
import torch

from k3compile.model import KimiK3Config, KimiK3ForConditionalGeneration, TPContext, memory_plan
from k3compile.model.plan import GB, main

COMPONENT_OF = [        # parameter name -> plan component, first match wins
    ("vision tower + projector", "vision_tower."), ("vision tower + projector", "mm_projector."),
    ("routed experts", ".experts."), ("router", ".block_sparse_moe.gate."),
    ("latent projections + norm", "routed_expert_"), ("shared experts", "shared_experts."), ("dense MLP", ".mlp."),
    ("embedding", "embed_tokens"), ("lm_head", "lm_head"), ("norms + AttnRes", "input_layernorm."),
    ("norms + AttnRes", "post_attention_layernorm."), ("norms + AttnRes", "_res_"), ("norms + AttnRes", "model.norm."),
]


def meta_bytes(config, tp: int, experts: str) -> dict:
    with torch.device("meta"):
        model = KimiK3ForConditionalGeneration(config, TPContext(0, tp))
        model.convert_experts(experts).set_dtype(torch.bfloat16)
    mla = {i for i in range(config.text_config.num_hidden_layers) if config.text_config.is_mla_layer(i)}
    out = {}
    for name, p in model.named_parameters():
        component = next((c for c, key in COMPONENT_OF if key in name), None)
        if component is None and ".self_attn." in name:
            component = "attention (MLA)" if int(name.split(".")[3]) in mla else "attention (KDA)"
        out[component] = out.get(component, 0) + p.numel() * p.element_size()
    return out


@pytest.mark.parametrize("tp", [8, 16], ids=["tp8", "tp16"])
@pytest.mark.parametrize("experts", ["mxfp4", "bf16"])
def test_plan_equals_meta_model_of_published_config(tp, experts):
    config = KimiK3Config.kimi_k3()
    plan = memory_plan(config, tp=tp, experts=experts)
    assert plan.params == meta_bytes(config, tp, experts)


def test_published_figures():
    """README: at TP 16 the MXFP4 experts are 90.4 GB a rank, the rest 18.8 GB; at TP 8 181 GB + 25 GB; the embedding
    and the lm_head split by vocabulary (0.15 GB each at TP 16)."""
    tp16, tp8 = memory_plan(tp=16), memory_plan(tp=8)
    assert round(tp16.params["routed experts"] / GB, 1) == 90.4 and round(tp16.param_bytes / GB, 1) == 109.2
    assert round(tp8.params["routed experts"] / GB) == 181 and round(tp8.param_bytes / GB) == 206
    assert round(tp16.params["lm_head"] / GB, 2) == round(tp16.params["embedding"] / GB, 2) == 0.15
    assert tp16.fits(141 * GB) and not tp8.fits(141 * GB)
    assert round(memory_plan(tp=8, experts="bf16", dtype=torch.bfloat16).params["routed experts"] / GB) == 681


@pytest.mark.parametrize("tp", [1, 2])
def test_cache_bytes_equal_an_allocated_cache(tp):
    config = KimiK3Config.micro(num_nextn_predict_layers=0)
    with torch.device("meta"):
        model = KimiK3ForConditionalGeneration(config, TPContext(0, tp)).set_dtype(torch.bfloat16)
    cache = model.allocate_cache(1, 300, device="meta")
    allocated = sum(t.numel() * t.element_size() for t in cache.tensors()[:-1])
    assert memory_plan(config, tp=tp, context=300).cache_per_sequence == allocated


def test_float_experts_need_the_model_dtype():
    with pytest.raises(ValueError, match="model's dtype"):
        memory_plan(tp=16, experts="float32", dtype=torch.bfloat16)


def test_command_line_says_whether_it_fits(capsys):
    assert main(["--tp", "16", "--experts", "mxfp4", "--device-gb", "141"]) == 0
    out = capsys.readouterr().out
    assert "routed experts" in out and "90.40" in out and "fits" in out
    assert main(["--tp", "8", "--device-gb", "141", "--context", "4096"]) == 1
    assert "does NOT fit" in capsys.readouterr().out
