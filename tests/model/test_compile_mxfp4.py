"""A packed-MXFP4 K3 through k3compile.optimize on the CPU: its decode steps give eager's tokens, and the passes
still rewrite the decode graph (the experts' dequantisation sits between the router and the latent-MoE tail).

One small model (2 layers: KDA + dense MLP, then MLA + latent MoE), one compiled graph: the prefill runs eagerly
(``model.forward`` bypasses the in-place compile), the decode steps compiled. Caches off, so the counts are real.
"""
from __future__ import annotations

import copy

import pytest
import torch

import k3compile
from k3compile.model import KimiK3Config, KimiK3ForConditionalGeneration

pytestmark = pytest.mark.slow

BATCH, PROMPT, NEW = 2, 6, 3          # decode M = 2: the gathered MXFP4 experts


@pytest.fixture(scope="module")
def decoded():
    torch.manual_seed(0)
    eager = KimiK3ForConditionalGeneration(KimiK3Config.micro(num_hidden_layers=2, moe_intermediate_size=64)).eval()
    eager.convert_experts("mxfp4")
    model = copy.deepcopy(eager)
    ids = torch.randint(0, eager.config.text_config.vocab_size, (BATCH, PROMPT))
    ref = eager.generate(ids, NEW)
    torch._dynamo.reset()
    with torch._inductor.config.patch(fx_graph_cache=False), \
            torch._functorch.config.patch(enable_autograd_cache=False), torch.no_grad():
        k3compile.optimize(model, backend="reference", dynamic=False)
        cache = model.allocate_cache(BATCH, PROMPT + NEW)
        token = model.forward(ids, cache=cache, logits_to_keep=1).argmax(-1)        # eager prefill
        out = [token]
        for _ in range(NEW - 1):
            token = model(token, cache=cache, logits_to_keep=1).argmax(-1)
            out.append(token)
    return torch.cat(out, 1), ref, k3compile.report(model)


def test_packed_decode_tokens_equal_eager(decoded):
    out, ref, _ = decoded
    assert torch.equal(out, ref)


def test_passes_still_rewrite_the_packed_decode_graph(decoded):
    _, _, rep = decoded
    (graph,) = rep.graphs
    matches = graph.record.matches
    assert matches["latent_moe_tail"] == 1 and matches["kda_decode"] == 1 and matches["skinny_gemm"] > 0, matches
    assert matches["moe_experts"] == 1, matches    # the packed experts' gathered form -> k3::moe_experts (MXFP4)
