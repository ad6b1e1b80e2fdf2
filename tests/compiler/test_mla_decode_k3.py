"""The micro K3 (3 KDA + 1 MLA layers) through k3compile.optimize with the MLA decode pass: generated tokens equal
eager (fp32, CPU), the decode graph's MLA attention runs ``k3::mla_decode`` (the Triton kernel, interpreted) and
the prefill graph is left alone.

One compiled model for the module (module-scoped fixture, as tests/compiler/test_tiny_k3.py shares its model). The
FX-graph and AOTAutograd caches are off so the pass runs and its counts are real.
"""
from __future__ import annotations

import copy

import pytest
import torch

import k3compile
from k3compile.model import KimiK3Config, KimiK3ForConditionalGeneration
from k3compile.ops.mla_decode import MLA_DECODE

pytestmark = pytest.mark.slow

BATCH, PROMPT, NEW = 2, 20, 4          # prefill T = 20 > 8: the plain path; decode T = 1


@pytest.fixture(scope="module")
def generated():
    torch.manual_seed(0)
    eager = KimiK3ForConditionalGeneration(KimiK3Config.micro()).eval()
    model = copy.deepcopy(eager)
    ids = torch.randint(0, eager.config.text_config.vocab_size, (BATCH, PROMPT))
    with torch.no_grad():
        ref = eager.generate(ids, NEW)
    torch._dynamo.reset()
    MLA_DECODE.clear()          # op records are per process: drop other tests' calls
    with torch._inductor.config.patch(fx_graph_cache=False), \
            torch._functorch.config.patch(enable_autograd_cache=False), torch.no_grad():
        k3compile.optimize(model, backend="triton", passes=["mla_decode"], strict=True, dynamic=False)
        out = model.generate(ids, NEW)
    return out, ref, k3compile.report(model)


def test_generated_tokens_equal_eager(generated):
    out, ref, _ = generated
    assert torch.equal(out, ref)


def test_mla_decode_fires_on_the_decode_graph_only(generated):
    _, _, rep = generated
    assert [g.record.matches["mla_decode"] for g in rep.graphs] == [0, 1]      # prefill, then decode
    assert [g.record.facts["graph_mla_decode_masks"] for g in rep.graphs] == [0, 1]
    (choice,) = [c for c in rep.choices if c.op == "mla_decode"]
    assert choice.impl == "triton" and choice.calls == NEW - 1                  # one decode step a new token
    assert "mla_decode" in str(rep)
