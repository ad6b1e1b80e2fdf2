"""k3compile.optimize on the multimodal model: a prompt with two images of different sizes generates the eager
tokens; the prefill (vision tower included) and the decode step are one graph each, with no graph break
(fullgraph=True), and the text passes still fire on the decode graph.

One compiled model for the module (minutes on a shared CPU). grid_thws arrives as a tensor, as the processor
gives it: the model turns it into Python ints before the compiled forward."""
import copy

import pytest
import torch
from PIL import Image
from torch._dynamo.utils import counters

import k3compile
from k3compile.model import KimiK3Config, KimiK3ForConditionalGeneration, KimiK3ImageProcessor, KimiK3Processor
from k3compile.model.processing import IMAGE_PLACEHOLDER, MediaProcConfig

try:  # tests/model may or may not be a package
    from .test_processing import make_tokenizer
except ImportError:
    from test_processing import make_tokenizer

pytestmark = pytest.mark.slow

NEW = 4


@pytest.fixture(scope="module")
def generated():
    proc = KimiK3Processor(KimiK3ImageProcessor(MediaProcConfig.tiny()), make_tokenizer())
    cfg = KimiK3Config.micro()
    cfg.media_placeholder_token_id = proc.media_pad_token_id
    torch.manual_seed(0)
    eager = KimiK3ForConditionalGeneration(cfg).eval()
    images = [Image.new("RGB", (84, 56), (200, 30, 30)), Image.new("RGBA", (60, 120), (0, 0, 255, 100))]
    batch = proc(text=f"a {IMAGE_PLACEHOLDER} b {IMAGE_PLACEHOLDER} ?", images=images)
    kw = dict(pixel_values=batch["pixel_values"], grid_thws=batch["grid_thws"])
    assert isinstance(kw["grid_thws"], torch.Tensor)
    with torch.no_grad():
        ref = eager.generate(batch["input_ids"], NEW, **kw)
    model = copy.deepcopy(eager)
    torch._dynamo.reset()
    counters.clear()
    with torch._inductor.config.patch(fx_graph_cache=False), \
            torch._functorch.config.patch(enable_autograd_cache=False), torch.no_grad():
        k3compile.optimize(model, backend="reference", passes=["skinny_gemm"], dynamic=False, fullgraph=True)
        out = model.generate(batch["input_ids"], NEW, **kw)
    stats = dict(unique_graphs=counters["stats"]["unique_graphs"], graph_breaks=sum(counters["graph_break"].values()))
    return out, ref, stats, k3compile.report(model), model, batch


def test_image_prompt_tokens_equal_eager(generated):
    out, ref, *_ = generated
    assert out.shape == (1, NEW)
    assert torch.equal(out, ref)


def test_prefill_with_vision_and_decode_are_one_graph_each(generated):
    _, _, stats, rep, *_ = generated
    assert stats == dict(unique_graphs=2, graph_breaks=0)
    assert len(rep.graphs) == 2


def test_text_pass_fires_on_the_decode_graph(generated):
    _, _, _, rep, *_ = generated
    decode = rep.graphs[1]
    assert decode.record.matches["skinny_gemm"] > 0
    assert rep.op_calls["skinny_gemm"] >= decode.record.matches["skinny_gemm"] * (NEW - 1)


def test_compiled_model_still_rejects_a_prompt_image_mismatch(generated):
    *_, model, batch = generated
    t, h, w = batch["grid_thws"][0].tolist()
    with torch.no_grad(), pytest.raises(ValueError, match=r"2 image\(s\).*1 image\(s\)"):
        model(batch["input_ids"], pixel_values=batch["pixel_values"][:t * h * w], grid_thws=batch["grid_thws"][:1])
