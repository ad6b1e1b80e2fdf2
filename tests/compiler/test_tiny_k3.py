"""The whole tiny K3 (micro: 3 KDA + 1 MLA layers) through k3compile.optimize: generated tokens
equal eager (fp32, CPU), and the report shows where the skinny-GEMM, MLA-decode and routed-experts
rewrites fired (the upcast-matmul pass is enabled and not expected: an fp32 router has no cast). In bf16
the upcast-matmul pass takes each router.

One compiled model for the module: compiling the prefill and decode graphs takes minutes on a
shared CPU. The FX-graph and AOTAutograd caches are off so the pass runs and its counts are real.
"""
from __future__ import annotations

import copy

import pytest
import torch

import k3compile
from k3compile.model import KimiK3Config, KimiK3ForConditionalGeneration
from k3compile.ops.mla_decode import MLA_DECODE
from k3compile.ops.moe_experts import MOE_EXPERTS
from k3compile.ops.skinny_gemm import SKINNY_GEMM
from k3compile.patterns.moe_experts import FACT as MOE_FACT

pytestmark = pytest.mark.slow

BATCH, PROMPT, NEW = 2, 20, 4          # prefill M = 40 > 16, T = 20 > 8; decode M = 2, T = 1
MOE_LAYERS = 3                         # micro: layer 0 dense, 1-3 latent MoE (the experts: dense form in prefill,
                                       # M·A = 160 > E = 16; gathered in decode, 8 <= 16)


@pytest.fixture(scope="module")
def generated():
    torch.manual_seed(0)
    eager = KimiK3ForConditionalGeneration(KimiK3Config.micro()).eval()
    model = copy.deepcopy(eager)
    ids = torch.randint(0, eager.config.text_config.vocab_size, (BATCH, PROMPT))
    ref = eager.generate(ids, NEW)
    torch._dynamo.reset()
    SKINNY_GEMM.clear()          # op records are per process: drop other tests' calls
    MLA_DECODE.clear()
    MOE_EXPERTS.clear()
    with torch._inductor.config.patch(fx_graph_cache=False), \
            torch._functorch.config.patch(enable_autograd_cache=False):
        k3compile.optimize(model, backend="reference",
                           passes=["moe_experts", "mla_decode", "upcast_matmul", "skinny_gemm"],
                           strict=True, dynamic=False)
        out = model.generate(ids, NEW)
    return out, ref, k3compile.report(model)


def test_generated_tokens_equal_eager(generated):
    out, ref, _ = generated
    assert torch.equal(out, ref)


def test_report_shows_matches_on_decode_graph(generated):
    _, _, rep = generated
    prefill, decode = rep.graphs            # generate: one prefill graph, one decode graph reused
    n_decode = decode.record.matches["skinny_gemm"]
    assert n_decode > 0 and n_decode == decode.record.facts["graph_small_m_gemms"]
    assert rep.op_calls["skinny_gemm"] >= n_decode * (NEW - 1)


def test_prefill_graph_fuses_only_its_small_m_product(generated):
    _, _, rep = generated
    prefill = rep.graphs[0]
    # every prefill GEMM has M = B * T = 40 > 16 and is left alone, except the lm_head, which
    # generate() applies to the last position only (logits_to_keep=1: M = B = 2)
    assert prefill.record.facts["graph_small_m_gemms"] == 1
    assert prefill.record.matches["skinny_gemm"] == 1
    assert all(c.key[2][0] == BATCH for c in rep.choices if c.op == "skinny_gemm")


def test_mla_decode_fires_on_the_decode_graph_only(generated):
    """The prefill's attention (T = 20) stays on the plain path; the decode step's becomes k3::mla_decode (the
    Triton kernel in a compiled graph: tests/patterns/test_mla_decode.py)."""
    _, _, rep = generated
    assert [g.record.matches["mla_decode"] for g in rep.graphs] == [0, 1]      # prefill, then decode
    assert [g.record.facts["graph_mla_decode_masks"] for g in rep.graphs] == [0, 1]
    (choice,) = [c for c in rep.choices if c.op == "mla_decode"]
    assert choice.impl == "reference" and choice.calls == NEW - 1              # one decode step a new token


def test_report_times_our_passes(generated):
    _, _, rep = generated
    assert 0 < rep.pass_seconds < rep.compile_seconds
    assert "skinny_gemm" in str(rep)


def test_routed_experts_rewritten_in_decode_and_prefill_graphs(generated):
    _, _, rep = generated
    for graph in rep.graphs:          # prefill: the dense form; decode: the gathered form
        assert graph.record.matches["moe_experts"] == MOE_LAYERS == graph.record.facts[MOE_FACT]
    assert rep.op_calls["moe_experts"] == MOE_LAYERS * NEW    # one prefill and NEW - 1 decode steps
    forms = {c.key[1][2] for c in rep.choices if c.op == "moe_experts"}
    assert forms == {"decode", "prefill"}


def test_fp32_routers_are_no_upcast_and_not_expected(generated):
    """fp32: ``F.linear(x.float(), w.float())`` is a plain mm the skinny-GEMM pass takes (strict mode raised
    nothing)."""
    _, _, rep = generated
    assert all(g.record.matches["upcast_matmul"] == g.record.facts["graph_upcast_gemms"] == 0 for g in rep.graphs)


@pytest.fixture(scope="module")
def generated_bf16():
    """The micro K3 in bf16 from a one-token prompt: prefill and decode are then one graph (one compile, ~20 s).
    Three new tokens: Inductor's fused bf16 kernels round where eager's ops do not, and at this seed plain
    torch.compile (no k3 pass) already picks another fourth token than eager, as optimize() does."""
    torch.manual_seed(0)
    eager = KimiK3ForConditionalGeneration(KimiK3Config.micro()).eval().to(torch.bfloat16)
    model = copy.deepcopy(eager)
    ids = torch.randint(0, eager.config.text_config.vocab_size, (BATCH, 1))
    ref = eager.generate(ids, NEW - 1)
    torch._dynamo.reset()
    SKINNY_GEMM.clear()
    with torch._inductor.config.patch(fx_graph_cache=False), \
            torch._functorch.config.patch(enable_autograd_cache=False):
        k3compile.optimize(model, backend="reference", passes=["upcast_matmul"], strict=True, dynamic=False)
        out = model.generate(ids, NEW - 1)
    return out, ref, k3compile.report(model)


def test_bf16_routers_rewritten_proven_static_and_tokens_equal_eager(generated_bf16):
    out, ref, rep = generated_bf16
    assert torch.equal(out, ref)
    (graph,) = rep.graphs
    assert graph.record.matches["upcast_matmul"] == graph.record.facts["graph_upcast_gemms"] == MOE_LAYERS
    assert graph.record.facts["static_weight"]["skinny_gemm"] == {"proven": MOE_LAYERS, "not proven": {}}
    assert all(c.key[-1] == torch.float32 for c in rep.choices if c.op == "skinny_gemm")
