"""The whole micro K3 (3 KDA + 1 MLA layers, layers 1-3 latent MoE) through k3compile.optimize with every pass,
``backend="auto"`` (the Triton kernels, interpreted on a CPU), strict: the generated tokens equal eager (fp32, CPU),
and per pass, where it fired on the prefill and the decode graph (skinny GEMM, MLA decode, routed experts, latent-MoE
tail, KDA decode and prefill), what the static-weight proof shows, and that no KDA state is copied in the decode
code. The same decode step compiled as regions fires every pass as often. In bf16 the upcast-matmul pass takes each
router.

One compiled model for the module, shared by the per-pass tests (tests/patterns/ test each pass on small graphs):
compiling the prefill and decode graphs takes a minute or two on a 2-core CPU. The FX-graph and AOTAutograd caches
are off so the passes run and their counts are real.
"""
from __future__ import annotations

import contextlib
import copy
import os
from types import SimpleNamespace
from unittest import mock

import pytest
import torch
from torch._inductor.utils import run_and_get_code

import k3compile
from k3compile.model import KimiK3Config, KimiK3ForConditionalGeneration
from k3compile.passes import PRODUCT_ORDER_FACT, STATIC_WEIGHT_FACT
from k3compile.patterns.attn_res import FACT as ATTN_RES_FACT
from k3compile.patterns.attn_res_add import FACT as ADD_FACT
from k3compile.patterns.moe_experts import FACT as MOE_FACT
from k3compile.testing import assert_kda_states_not_copied

pytestmark = pytest.mark.slow

BATCH, PROMPT, NEW = 2, 20, 3          # prefill M = 40 > 16, T = 20 > 8 (two KDA chunks); decode M = 2, T = 1
KDA_LAYERS = 3                         # micro: layers 0-2 KDA, 3 MLA
MOE_LAYERS = 3                         # layer 0 dense, 1-3 latent MoE (the experts: dense form in prefill,
                                       # M·A = 160 > E = 16; gathered in decode, 8 <= 16)


@contextlib.contextmanager
def graph_caches_off():
    with torch._inductor.config.patch(fx_graph_cache=False), \
            torch._functorch.config.patch(enable_autograd_cache=False):
        yield


@pytest.fixture(scope="module")
def micro():
    """eager, ids, eager's tokens (ref), and the compiled model's tokens (out), report and output code (codes)."""
    torch.manual_seed(0)
    eager = KimiK3ForConditionalGeneration(KimiK3Config.micro()).eval()
    model = copy.deepcopy(eager)
    ids = torch.randint(0, eager.config.text_config.vocab_size, (BATCH, PROMPT))
    ref = eager.generate(ids, NEW)
    torch._dynamo.reset()
    with graph_caches_off():
        k3compile.optimize(model, strict=True, dynamic=False, fullgraph=True)
        out, codes = run_and_get_code(model.generate, ids, NEW)
    return SimpleNamespace(eager=eager, ids=ids, ref=ref, out=out, report=k3compile.report(model), codes=codes)


def test_generated_tokens_equal_eager(micro):
    assert torch.equal(micro.out, micro.ref)


def test_report_shows_matches_on_decode_graph(micro):
    """Every small-M product of the decode step is a skinny GEMM, but the up-projection each latent-MoE tail takes."""
    prefill, decode = micro.report.graphs            # generate: one prefill graph, one decode graph reused
    n_decode = decode.record.matches["skinny_gemm"]
    assert n_decode > 0
    assert n_decode + decode.record.matches["latent_moe_tail"] == decode.record.facts["graph_small_m_gemms"]
    assert micro.report.op_calls["skinny_gemm"] >= n_decode * (NEW - 1)


def test_every_call_site_of_the_decode_graph_plans(micro):
    """Planning each k3 call of the decode graph on stand-ins (precompile's first step, ``k3compile/call_sites.py``)
    raises nothing: an op's plan reads metadata only, its composed ops' plans included."""
    from k3compile.call_sites import plan

    sites = micro.report.graphs[-1].record.kernel_calls
    assert {"experts_beside", "products_beside", "route_beside", "skinny_gemm"} <= {s["op"] for s in sites}
    for site in sites:
        assert "unplanned" not in site, site
        plan(site)


def test_prefill_graph_fuses_only_its_small_m_product(micro):
    prefill = micro.report.graphs[0]
    # every prefill GEMM has M = B * T = 40 > 16 and is left alone, except the lm_head, which
    # generate() applies to the last position only (logits_to_keep=1: M = B = 2)
    assert prefill.record.facts["graph_small_m_gemms"] == 1
    assert prefill.record.matches["skinny_gemm"] == 1
    assert all(c.key[2][0] == BATCH for c in micro.report.choices if c.op == "skinny_gemm")


def test_mla_decode_fires_on_the_decode_graph_only(micro):
    """The prefill's attention (T = 20) stays on the plain path; the decode step's becomes k3::mla_decode."""
    rep = micro.report
    assert [g.record.matches["mla_decode"] for g in rep.graphs] == [0, 1]      # prefill, then decode
    assert [g.record.facts["graph_mla_decode_masks"] for g in rep.graphs] == [0, 1]
    (choice,) = [c for c in rep.choices if c.op == "mla_decode"]
    assert choice.impl == "triton" and choice.calls == NEW - 1                 # one decode step a new token


def test_report_times_our_passes(micro):
    rep = micro.report
    assert 0 < rep.pass_seconds < rep.compile_seconds
    assert "skinny_gemm" in str(rep)


def test_routed_experts_rewritten_in_decode_and_prefill_graphs(micro):
    rep = micro.report
    for graph in rep.graphs:          # prefill: the dense form; decode: the gathered form
        assert graph.record.matches["moe_experts"] == MOE_LAYERS == graph.record.facts[MOE_FACT]
    assert rep.op_calls["moe_experts"] == MOE_LAYERS * NEW    # one prefill and NEW - 1 decode steps
    forms = {c.key[1][2] for c in rep.choices if c.op == "moe_experts"}
    assert forms == {"decode", "prefill"}


def test_latent_moe_tail_fires_once_per_moe_layer_of_decode(micro):
    """Single device: one tail per MoE layer of the decode step, no all-reduce to merge (TP:
    tests/patterns/test_latent_moe_tail_compiled.py); the prefill's M = 40 is above the small-M limit."""
    rep = micro.report
    assert [g.record.matches["latent_moe_tail"] for g in rep.graphs] == [0, MOE_LAYERS]
    assert rep.op_calls["latent_moe_tail"] == MOE_LAYERS * (NEW - 1)


def test_fp32_routers_are_no_upcast_and_not_expected(micro):
    """fp32: ``F.linear(x.float(), w.float())`` is a plain mm the skinny-GEMM pass takes (strict mode raised
    nothing)."""
    assert all(g.record.matches["upcast_matmul"] == g.record.facts["graph_upcast_gemms"] == 0
               for g in micro.report.graphs)


# --- KDA: the decode step and the chunked prefill ----------------------------------------------------------------

def test_kda_decode_fires_on_every_kda_layer_of_decode_and_not_on_prefill(micro):
    rep = micro.report
    assert [g.record.matches["kda_decode"] for g in rep.graphs] == [0, KDA_LAYERS]
    # the prefill graph is not one where the pass is expected (no warning / strict error there)
    assert [g.record.facts["graph_kda_decode_convs"] for g in rep.graphs] == [0, 3 * KDA_LAYERS]
    (choice,) = [c for c in rep.choices if c.op == "kda_decode"]
    assert choice.impl == "triton" and choice.calls == KDA_LAYERS * (NEW - 1)


def test_kda_prefill_fires_once_per_kda_layer(micro):
    """Prompt [2, 20]: two chunks (the second padded from 4 to 16) per layer; the decode graph holds no chunk
    solve."""
    rep = micro.report
    assert [g.record.matches["kda_prefill"] for g in rep.graphs] == [KDA_LAYERS, 0]
    assert [g.record.facts["graph_kda_prefill_solves"] for g in rep.graphs] == [2 * KDA_LAYERS, 0]
    # CPU: fla cannot run, so the op runs its reference, recorded with the reason
    (choice,) = [c for c in rep.choices if c.op == "kda_prefill"]
    assert choice.impl == "reference" and "fla" in choice.reason
    assert choice.calls == KDA_LAYERS


def test_kda_decode_code_holds_no_state_copy(micro):
    counts = [assert_kda_states_not_copied(code) for code in micro.codes]
    assert counts == [0, KDA_LAYERS]   # one op call per KDA layer, in the decode graph


# --- the static-weight proof (k3compile/static_weights.py) on the decode graph ---------------------------------

def test_decode_graph_proves_its_gemms_and_tail(micro):
    decode = micro.report.graphs[-1].record
    static = decode.facts[STATIC_WEIGHT_FACT]
    assert decode.matches["latent_moe_tail"] >= 1 and decode.matches["skinny_gemm"] > 0
    # every skinny GEMM (after an RMSNorm, the KDA step, attention) and every tail (after the MoE combine)
    assert static["latent_moe_tail"] == {"proven": decode.matches["latent_moe_tail"], "not proven": {}}, static
    # the routing beside a product took two of the skinny GEMMs of each MoE layer into its op, the routed experts
    # beside the shared chain three more (patterns/experts_beside.py), all proven there
    folded, beside = decode.matches["route_beside"], decode.matches["experts_beside"]
    assert folded == beside == MOE_LAYERS == decode.facts["graph_shared_beside_experts"]
    assert static["route_beside"] == {"proven": 2 * folded, "not proven": {}}, static
    assert static["experts_beside"] == {"proven": 3 * beside, "not proven": {}}, static
    # each KDA layer's seven input products (q, k, v, the gate; beta, the gate's rank product and its up-projection
    # beside them: patterns/products_beside.py), the MLA layer's none (no small product there)
    beside_kda = decode.matches["products_beside"]
    assert beside_kda == KDA_LAYERS == decode.facts["graph_small_products_beside_large"]
    assert static["products_beside"] == {"proven": 7 * beside_kda, "not proven": {}}, static
    products = decode.matches["skinny_gemm"] - 2 * folded - 3 * beside - 7 * beside_kda
    assert static["skinny_gemm"] == {"proven": products, "not proven": {}}, static
    assert "proven" in micro.report.format(verbose=True)


# --- the decode step as regions (k3compile/regions.py) against the whole graph ---------------------------------

@pytest.fixture(scope="module")
def regions_decoded(micro):
    """(tokens, report) of the micro K3 whose decode step compiles as regions (the prefill eager), from the same
    prompt as ``micro``."""
    model = copy.deepcopy(micro.eager)
    cache = model.allocate_cache(BATCH, PROMPT + NEW)
    torch._dynamo.reset()
    with graph_caches_off(), torch.no_grad():
        tokens = [model(micro.ids, cache=cache, logits_to_keep=1).argmax(-1)]
        k3compile.optimize(model, dynamic=False, regions=True, strict=True)
        for _ in range(NEW - 1):
            tokens.append(model(tokens[-1], cache=cache, logits_to_keep=1).argmax(-1))
    return torch.cat(tokens, 1), k3compile.report(model)


def test_routing_tail_rewritten_in_decode_and_prefill_graphs(micro):
    rep = micro.report
    for graph in rep.graphs:          # one sigmoid top-k a MoE layer, whatever M
        assert graph.record.matches["moe_route"] == MOE_LAYERS == graph.record.facts["graph_router_topks"]
    assert rep.op_calls["moe_route"] == MOE_LAYERS * NEW


def test_regions_decode_eager_tokens(micro, regions_decoded):
    assert torch.equal(regions_decoded[0], micro.ref)


def test_regions_match_as_often_as_the_whole_graph(micro, regions_decoded):
    (with_regions,), whole = regions_decoded[1].graphs, micro.report.graphs[-1]
    assert with_regions.regions and "whole graph" not in with_regions.regions
    assert whole.regions == ""
    assert with_regions.record.matches == whole.record.matches
    assert all(whole.record.matches[name] for name in ("kda_decode", "mla_decode", "moe_experts", "moe_route",
                                                        "latent_moe_tail", "skinny_gemm"))
    counted = {k: v for k, v in whole.record.facts.items() if isinstance(v, int) and not isinstance(v, bool)}
    assert {k: with_regions.record.facts[k] for k in counted} == counted


def test_regions_prove_as_many_static_weights_as_the_whole_graph(micro, regions_decoded):
    """A region body's GEMMs read the body's inputs; proven at the body's calls (k3compile/static_weights.py, compile
    regions), as many are proven as in the whole graph."""
    (with_regions,), whole = regions_decoded[1].graphs, micro.report.graphs[-1]
    static = with_regions.record.facts[STATIC_WEIGHT_FACT]
    assert static == whole.record.facts[STATIC_WEIGHT_FACT], static


@pytest.fixture(scope="module")
def ordered_decoded(micro):
    """(tokens, report) of the micro K3 whose decode step compiles with the same-input products ordered
    (``K3_ORDER_PRODUCTS=1``, k3compile/product_order.py; the prefill eager), from the same prompt as ``micro``."""
    model = copy.deepcopy(micro.eager)
    cache = model.allocate_cache(BATCH, PROMPT + NEW)
    torch._dynamo.reset()
    with graph_caches_off(), torch.no_grad(), mock.patch.dict(os.environ, {"K3_ORDER_PRODUCTS": "1"}):
        tokens = [model(micro.ids, cache=cache, logits_to_keep=1).argmax(-1)]
        k3compile.optimize(model, dynamic=False, strict=True)
        for _ in range(NEW - 1):
            tokens.append(model(tokens[-1], cache=cache, logits_to_keep=1).argmax(-1))
    return torch.cat(tokens, 1), k3compile.report(model)


@pytest.mark.deep   # a third compile of the micro K3 (~30 s); the pass manager's ordering call is covered by
# tests/compiler/test_product_order.py::test_optimize_orders_a_compiled_graphs_products_under_the_setting
def test_ordered_products_decode_eager_tokens(micro, ordered_decoded):
    tokens, rep = ordered_decoded
    assert torch.equal(tokens, micro.ref)
    (graph,) = rep.graphs
    assert graph.record.facts[PRODUCT_ORDER_FACT] > 0
    assert graph.record.matches == micro.report.graphs[-1].record.matches


# --- bf16: the routers' upcast products ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def generated_bf16():
    """The micro K3 in bf16 from a one-token prompt: prefill and decode are then one graph (one compile, ~20 s).
    Three new tokens: Inductor's fused bf16 kernels round where eager's ops do not, and at this seed plain
    torch.compile (no k3 pass) already picks another fourth token than eager, as optimize() does."""
    torch.manual_seed(0)
    eager = KimiK3ForConditionalGeneration(KimiK3Config.micro()).eval().to(torch.bfloat16)
    model = copy.deepcopy(eager)
    ids = torch.randint(0, eager.config.text_config.vocab_size, (BATCH, 1))
    ref = eager.generate(ids, 3)
    torch._dynamo.reset()
    with graph_caches_off():
        k3compile.optimize(model, backend="reference", passes=["upcast_matmul"], strict=True, dynamic=False)
        out = model.generate(ids, 3)
    return out, ref, k3compile.report(model)


def test_bf16_routers_rewritten_proven_static_and_tokens_equal_eager(generated_bf16):
    out, ref, rep = generated_bf16
    assert torch.equal(out, ref)
    (graph,) = rep.graphs
    assert graph.record.matches["upcast_matmul"] == graph.record.facts["graph_upcast_gemms"] == MOE_LAYERS
    assert graph.record.facts["static_weight"]["skinny_gemm"] == {"proven": MOE_LAYERS, "not proven": {}}
    assert all(c.key[-1] == torch.float32 for c in rep.choices if c.op == "skinny_gemm")


# --- Block AttnRes: each mix and the norm after it one k3::attn_res ------------------------------------------------

def test_attn_res_mixes_rewritten_in_decode_and_prefill_graphs(micro):
    """Every mix of every graph (two a layer but the first's first, and the final one), each with the RMSNorm after
    it but the final mix, whose norm the head applies to the last position only (``logits_to_keep``)."""
    rep = micro.report
    layers = micro.eager.config.text_config.num_hidden_layers
    for graph in rep.graphs:
        assert graph.record.matches["attn_res"] == graph.record.facts[ATTN_RES_FACT] == 2 * layers
    calls = {}   # the mixes whose residual add was folded in run as k3::attn_res_add
    for c in rep.choices:
        if c.op in ("attn_res", "attn_res_add"):
            calls[c.key[1][3]] = calls.get(c.key[1][3], 0) + c.calls
    assert calls == {"normed": (2 * layers - 1) * NEW, "mix": NEW}
    assert {c.impl for c in rep.choices if c.op in ("attn_res", "attn_res_add")} == {"triton"}


def test_residual_adds_folded_where_no_product_took_them(micro):
    """Each MoE layer's ``prefix + ffn`` (the latent tail's output: no product's residual) is folded into the mix
    that reads it, in decode and prefill; the sums the later layers read come out of the op (tokens equal eager)."""
    for graph in micro.report.graphs:
        facts, folded = graph.record.facts[ADD_FACT], graph.record.matches["attn_res_add"]
        assert MOE_LAYERS <= folded <= facts
    assert sum(c.calls for c in micro.report.choices if c.op == "attn_res_add") >= MOE_LAYERS * NEW
