"""k3compile.optimize / report on small hand-written modules: in-place compile, strict mode,
chaining a user's pass, option folding, the cache key."""
from __future__ import annotations

import logging
import sys

import pytest
import torch
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch.fx.experimental.proxy_tensor import make_fx

import k3compile
from k3compile.optimize import K3PassMissingError, state_of
from k3compile.passes import K3Options, K3PostGradPass, summarize_model


@pytest.fixture(autouse=True)
def no_graph_caches():
    with torch._inductor.config.patch(fx_graph_cache=False), \
            torch._functorch.config.patch(enable_autograd_cache=False):
        torch._dynamo.reset()
        yield


class Decoder(torch.nn.Module):
    """A residual projection and a ``generate`` that calls ``self(...)`` like a real model."""

    def __init__(self, d=16):
        super().__init__()
        self.proj = torch.nn.Linear(d, d)

    def forward(self, h):
        return self.proj(h) + h

    def generate(self, h, steps):
        for _ in range(steps):
            h = self(h)
        return h


class FakeK3Config:
    model_type = "kimi_k3"

    class text_config:
        model_type = "kimi_linear"
        num_hidden_layers = 4
        num_experts = 8
        first_k_dense_replace = 1
        linear_attn_config = {"kda_layers": [1, 2, 3], "full_attn_layers": [4]}


class Bias(torch.nn.Module):
    """Not a K3: one small-M product whose [M, 1] bias the skinny-GEMM rewrite refuses."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(8, 8))
        self.b = torch.nn.Parameter(torch.randn(2, 1))

    def forward(self, x):
        return torch.addmm(self.b, x, self.w.T)


class BroadcastBiasK3(Bias):
    """Looks like a K3 to summarize_model; its one small-M product has a [M, 1] bias the rewrite refuses."""
    config = FakeK3Config


def test_optimize_compiles_in_place_so_generate_runs_compiled():
    model = Decoder()
    h = torch.randn(2, 16)
    ref = model.generate(h, 3)
    assert k3compile.optimize(model, passes=["skinny_gemm"], backend="reference") is model
    with torch.no_grad():
        out = model.generate(h, 3)
    torch.testing.assert_close(out, ref)
    rep = k3compile.report(model)
    assert rep.matches == {"skinny_gemm": 1}
    assert rep.op_calls.get("skinny_gemm", 0) >= 3
    assert rep.graphs[0].source == "pass ran" and rep.pass_seconds > 0
    text = str(rep)
    assert "skinny_gemm" in text and "reference" in text


def test_report_needs_an_optimized_model():
    with pytest.raises(ValueError, match="optimize"):
        k3compile.report(Decoder())


def test_summarize_model_reads_the_k3_config():
    s = summarize_model(BroadcastBiasK3())
    assert s == {"is_k3": True, "num_layers": 4, "kda_layers": 3, "mla_layers": 1, "moe_layers": 3,
                 "tp_size": 1}
    assert summarize_model(Decoder())["is_k3"] is False


@pytest.mark.parametrize("cls", [BroadcastBiasK3, Bias], ids=["k3", "not-k3"])
def test_strict_raises_when_an_expected_pass_matches_nothing(cls):
    """On any model: the skinny-GEMM pass is expected wherever a linear layer's product has few rows."""
    model = cls()
    assert summarize_model(model)["is_k3"] is (cls is BroadcastBiasK3)
    k3compile.optimize(model, passes=["skinny_gemm"], strict=True)
    with pytest.raises(Exception, match="skinny_gemm") as info:
        model(torch.randn(2, 8))
    assert isinstance(info.value, K3PassMissingError) or isinstance(info.value.__cause__, K3PassMissingError) \
        or "K3PassMissingError" in str(info.value)


def test_default_warns_naming_the_pass(caplog):
    model = BroadcastBiasK3()
    k3compile.optimize(model, passes=["skinny_gemm"])
    with caplog.at_level(logging.WARNING, logger="k3compile"), torch.no_grad():
        out = model(torch.randn(2, 8))
    assert out.shape == (2, 8)
    (msg,) = [r.getMessage() for r in caplog.records if "'skinny_gemm' rewrote nothing" in r.getMessage()]
    # in words: which pass, on which graph, what it costs, what to do; no internal dict
    assert "graph 0 of BroadcastBiasK3" in msg and "at most 16 rows" in msg and "slower" in msg
    assert "strict=True" in msg and "{" not in msg


def test_no_warning_on_graphs_without_candidates(caplog):
    class K3Decoder(Decoder):
        config = FakeK3Config

    model = K3Decoder()
    k3compile.optimize(model, passes=["skinny_gemm"], strict=True)
    with caplog.at_level(logging.WARNING, logger="k3compile"), torch.no_grad():
        model(torch.randn(40, 16))   # M = 40 > limit: no candidate, nothing expected, no raise
    assert not any("rewrote nothing" in r.getMessage() for r in caplog.records)
    assert k3compile.report(model).matches == {"skinny_gemm": 0}


class CountingPass(CustomGraphPass):
    def __init__(self):
        self.calls = 0

    def __call__(self, graph):
        self.calls += 1

    def uuid(self):
        return "counting-pass-v1"


def test_user_pass_is_chained_and_keyed():
    user = CountingPass()
    model = Decoder()
    k3compile.optimize(model, passes=["skinny_gemm"], options={"post_grad_custom_post_pass": user})
    with torch.no_grad():
        model(torch.randn(2, 16))
    assert user.calls == 1
    ours = state_of(model).compiler.config["post_grad_custom_post_pass"]
    assert isinstance(ours, K3PostGradPass) and ours.chained is user
    assert ours.uuid() != K3PostGradPass(ours.options).uuid()


def test_raw_callable_user_pass_warns_about_caching():
    with torch._inductor.config.patch(post_grad_custom_post_pass=lambda g: None):
        with pytest.warns(UserWarning, match="cannot cache"):
            model = k3compile.optimize(Decoder(), passes=["skinny_gemm"])
    assert state_of(model).compiler.config["post_grad_custom_post_pass"].uuid() is None


def test_mode_is_folded_into_options():
    model = k3compile.optimize(Decoder(), mode="max-autotune-no-cudagraphs")
    config = state_of(model).compiler.config
    assert config["max_autotune"] is True and isinstance(config["post_grad_custom_post_pass"], K3PostGradPass)


def test_shape_padding_is_off_unless_the_caller_sets_it():
    """Inductor's pad_mm (CUDA) would wrap small-M products in cat/slice that our patterns do not match."""
    assert state_of(k3compile.optimize(Decoder())).compiler.config["shape_padding"] is False
    kept = k3compile.optimize(Decoder(), options={"shape_padding": True})
    assert state_of(kept).compiler.config["shape_padding"] is True
    kda_only = k3compile.optimize(Decoder(), passes=["kda_decode"])
    assert "shape_padding" not in state_of(kda_only).compiler.config


class ConfigProbe(CustomGraphPass):
    """Records Inductor's PDL setting as each graph it sees compiles."""

    def __init__(self):
        self.seen = []

    def __call__(self, graph):
        self.seen.append(torch._inductor.config.triton.enable_pdl)

    def uuid(self):
        return None


def test_inductor_pdl_is_on_for_our_compiles_only():
    """optimize(inductor_pdl=True) turns Inductor's PDL codegen on in its own compiles' config: a plain
    torch.compile after it, and the process's config, keep theirs."""
    ours, plain = ConfigProbe(), ConfigProbe()
    model = k3compile.optimize(Decoder(), passes=["skinny_gemm"], backend="reference", inductor_pdl=True,
                               options={"post_grad_custom_post_pass": ours})
    assert state_of(model).compiler.config["triton.enable_pdl"] is True
    with torch.no_grad():
        model(torch.randn(2, 16))
        torch.compile(lambda x: x.sin() + 1, options={"post_grad_custom_post_pass": plain})(torch.randn(4))
    assert ours.seen == [True] and plain.seen == [False] and torch._inductor.config.triton.enable_pdl is False
    assert "kernels with PDL (inductor_pdl): on" in k3compile.report(model).format(verbose=True)


def test_inductor_pdl_launches_are_opt_in(monkeypatch):
    """Inductor's kernels launch with PDL only by keyword or environment (its codegen races after a fill:
    test_pdl_ordering.py); by default they trigger only, and "0" turns the codegen off."""
    monkeypatch.delenv("K3_INDUCTOR_PDL", raising=False)
    default = k3compile.optimize(Decoder())
    if hasattr(torch._inductor.config.triton, "enable_pdl"):
        assert state_of(default).options.inductor_trigger and "launched without PDL" in state_of(default).inductor_pdl
    off = k3compile.optimize(Decoder(), inductor_pdl=False)
    assert "triton.enable_pdl" not in state_of(off).compiler.config and not state_of(off).options.inductor_trigger
    assert "test_pdl_ordering" in state_of(off).inductor_pdl
    monkeypatch.setenv("K3_INDUCTOR_PDL", "0")
    assert "triton.enable_pdl" not in state_of(k3compile.optimize(Decoder())).compiler.config
    kept = k3compile.optimize(Decoder(), inductor_pdl=True, options={"triton.enable_pdl": False})   # options win
    assert state_of(kept).compiler.config["triton.enable_pdl"] is False
    monkeypatch.setenv("K3_INDUCTOR_PDL", "1")
    assert state_of(k3compile.optimize(Decoder())).compiler.config["triton.enable_pdl"] is True
    kept = k3compile.optimize(Decoder(), inductor_pdl=False)   # the keyword wins over the environment
    assert "triton.enable_pdl" not in state_of(kept).compiler.config


def test_inductor_pdl_trigger_keeps_the_codegen_and_plain_launches(monkeypatch):
    """inductor_pdl="trigger" (or K3_INDUCTOR_PDL=trigger): Inductor's PDL codegen on in our compiles, our pass
    option says its kernels launch without PDL, and the proof reads Inductor's PDL as off for them."""
    from k3compile import inductor_pdl

    if not hasattr(torch._inductor.config.triton, "enable_pdl"):
        pytest.skip("this torch's Inductor has no PDL codegen")
    monkeypatch.delenv("K3_INDUCTOR_PDL", raising=False)
    state = state_of(k3compile.optimize(Decoder(), inductor_pdl="trigger"))
    assert state.compiler.config["triton.enable_pdl"] is True and state.options.inductor_trigger
    assert "launched without PDL" in state.inductor_pdl
    monkeypatch.setenv("K3_INDUCTOR_PDL", "trigger")
    assert state_of(k3compile.optimize(Decoder())).options.inductor_trigger
    with pytest.raises(ValueError, match="inductor_pdl"):
        k3compile.optimize(Decoder(), inductor_pdl="sometimes")
    with torch._inductor.config.patch({"triton.enable_pdl": True}):
        assert inductor_pdl.on(trigger_only=False) and not inductor_pdl.on(trigger_only=True)
        assert K3PostGradPass(K3Options(inductor_trigger=True)).uuid() != K3PostGradPass(K3Options()).uuid()


def test_pass_notes_which_graphs_launch_inductor_kernels_with_pdl():
    """Our pass tells Inductor's codegen (``inductor_pdl.plain_launches``) which graphs keep PDL launches (those of an
    ``inductor_pdl=True`` compile), and leaves no trigger-only setting behind for the proof after a graph."""
    from k3compile import inductor_pdl

    for trigger_only in (False, True):
        graph = make_fx(lambda x: x.sin() + 1)(torch.randn(4)).graph
        with torch._inductor.config.patch({"triton.enable_pdl": True}):
            K3PostGradPass(K3Options(passes=("skinny_gemm",), inductor_trigger=trigger_only))(graph)
            assert inductor_pdl.on()                         # the setting is the graph's, not left behind
        assert (graph in inductor_pdl._full_pdl_graphs) is not trigger_only


def test_uuid_follows_inductor_pdl():
    """The static-weight proof reads the setting, so the pass's uuid (read within the compile's config) follows it."""
    pass_ = K3PostGradPass(K3Options())
    with torch._inductor.config.patch({"triton.enable_pdl": True}):
        on = pass_.uuid()
    assert on != pass_.uuid()


def test_uuid_changes_with_every_option():
    uuids = {K3PostGradPass(o).uuid() for o in (
        K3Options(), K3Options(backend="triton"), K3Options(small_m_limit=8), K3Options(passes=("skinny_gemm",)))}
    assert len(uuids) == 4
    assert K3PostGradPass(K3Options()).uuid() == K3PostGradPass(K3Options()).uuid()


@pytest.mark.parametrize("bad", [dict(backend="cuda"), dict(passes=["nope"]), dict(small_m_limit=0)],
                         ids=["backend", "pass-name", "limit"])
def test_bad_options_raise(bad):
    with pytest.raises(ValueError):
        k3compile.optimize(Decoder(), **bad)


# --- what a new user meets first (issue #24): the CPU, forced backends, report and strict on any model ----------

class TinyLM(torch.nn.Module):
    """Token ids in, logits out: its graphs are labelled prefill / decode by their token count."""

    def __init__(self, vocab=32, d=16):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, d)
        self.head = torch.nn.Linear(d, vocab)

    def forward(self, input_ids):
        return self.head(self.embed(input_ids))


@pytest.fixture
def no_interpreter(monkeypatch):
    """A CPU as a user has it: no TRITON_INTERPRET (the test session sets it)."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")


def test_auto_on_cpu_compiles_as_plain_torch_compile(no_interpreter, caplog):
    model = Decoder()
    h = torch.randn(2, 16)
    ref = model(h)
    k3compile.optimize(model, passes=["skinny_gemm"])
    with caplog.at_level(logging.INFO, logger="k3compile"), torch.no_grad():
        out = model(h)
    torch.testing.assert_close(out, ref)
    rep = k3compile.report(model)
    (graph,) = rep.graphs
    assert graph.stood_down and graph.source == "compiled as plain torch.compile"
    assert rep.matches == {"skinny_gemm": 0} and rep.choices == []
    assert "backend='reference' rewrites anyway" in str(rep)
    messages = [r.getMessage() for r in caplog.records]
    assert any("compiling graph 0 of Decoder" in m for m in messages)      # progress, before the compile
    assert any("graph 0 of Decoder compiled in" in m for m in messages)    # and after it
    assert not any("rewrote nothing" in m for m in messages)


def test_auto_on_cpu_with_strict_raises_at_optimize(no_interpreter):
    with pytest.raises(K3PassMissingError, match="backend='reference'"):
        k3compile.optimize(Decoder(), strict=True)


def test_forced_backend_that_cannot_run_here_raises_at_optimize(monkeypatch):
    from k3compile import BackendUnavailableError, backends

    with pytest.raises(BackendUnavailableError, match="CPU") as info:
        k3compile.optimize(Decoder(), backend="cute")
    assert len(str(info.value)) < 200
    monkeypatch.setattr(backends, "triton_importable", lambda: "triton does not import (ModuleNotFoundError)")
    with pytest.raises(BackendUnavailableError, match="triton does not import"):
        k3compile.optimize(Decoder(), backend="triton")


def test_forced_backend_lacking_an_op_raises_at_optimize(monkeypatch):
    """backend='cute' where CuTe could run (stubbed): the KDA ops have no CuTe implementation."""
    from k3compile import BackendUnavailableError

    monkeypatch.setattr(sys.modules["k3compile.optimize"], "forced_backend_reason", lambda backend, devices: None)
    with pytest.raises(BackendUnavailableError, match="no cute implementation") as info:
        k3compile.optimize(Decoder(), backend="cute")
    assert "k3::kda_decode" in str(info.value) and "k3::skinny_gemm" not in str(info.value)
    k3compile.optimize(Decoder(), backend="cute", passes=["skinny_gemm", "latent_moe_tail"])


def test_report_is_about_its_model_only():
    used, idle = Decoder(), Decoder()
    k3compile.optimize(used, passes=["skinny_gemm"], backend="reference")
    k3compile.optimize(idle, passes=["skinny_gemm"], backend="reference")
    with torch.no_grad():
        used(torch.randn(2, 16))
    rep = k3compile.report(used)
    assert [(c.op, c.impl, c.calls) for c in rep.choices] == [("skinny_gemm", "reference", 1)]
    assert "PDL" not in str(rep) and "static weight" not in str(rep)    # GPU-only terms: not for a CPU graph
    assert rep.static_weight["skinny_gemm"]["proven"] == 0 and "PDL" in rep.format(verbose=True)
    assert "float32 cpu [M,K]=[2, 16] N=16, a strides (16, 1), w strides (16, 1)" in rep.format(verbose=True)
    assert k3compile.report(idle).choices == []


def test_report_labels_prefill_and_decode_graphs():
    model = TinyLM()
    k3compile.optimize(model, passes=["skinny_gemm"], backend="reference", dynamic=False)
    with torch.no_grad():
        model(torch.randint(0, 32, (2, 5)))
        model(torch.randint(0, 32, (2, 1)))
    rep = k3compile.report(model)
    assert [g.label for g in rep.graphs] == ["prefill, batch 2, 5 tokens", "decode, batch 2"]
    assert "graph 1 (decode, batch 2)" in str(rep)


def test_a_model_never_called_or_with_nothing_to_rewrite_is_reported(caplog):
    """nn.Sequential's frames are torch's own, which Dynamo skips: optimize() still compiles it."""
    never = k3compile.optimize(torch.nn.Sequential(torch.nn.Linear(4, 4)))
    nothing = k3compile.optimize(torch.nn.Sequential(torch.nn.ReLU()), backend="reference")
    with torch.no_grad():
        nothing(torch.randn(3, 4))
    assert len(k3compile.report(nothing).graphs) == 1
    linear = k3compile.optimize(torch.nn.Sequential(torch.nn.Linear(8, 8)), backend="reference")
    with torch.no_grad():
        linear(torch.randn(2, 8))
    assert k3compile.report(linear).matches["skinny_gemm"] == 1
    with caplog.at_level(logging.WARNING, logger="k3compile"):
        assert "compiled nothing" in str(k3compile.report(never))
        assert "no k3 pass rewrote anything" in str(k3compile.report(nothing))
    warned = " ".join(r.getMessage() for r in caplog.records)
    assert "compiled nothing for Sequential" in warned and "no k3 pass rewrote anything in Sequential" in warned
