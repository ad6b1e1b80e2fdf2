"""The micro K3 on a CUDA GPU in bf16 (routed experts bf16, or packed MXFP4), through k3compile.optimize with every
pass.

- decode runs our kernels (the report names the implementation of each op, CuTe for the skinny GEMM
  where cutlass is installed) and, teacher-forced on eager's tokens, every step's logits are within bf16 noise of
  the same bf16 weights computed in fp32, or where eager bf16 or plain torch.compile is itself further off (an
  ill-conditioned step), no more than twice as far as the further of the two;
- ``mode="reduce-overhead"`` keeps its CUDA graphs: the cache is mutated in place by the compiled
  step, which cudagraph trees accept only for inputs with static addresses (``KimiK3Cache`` marks
  them); no graph may be skipped, and the tokens equal the default mode's.

One compiled model per test: each compile takes tens of seconds.
"""
from __future__ import annotations

import copy
import importlib.util

import pytest
import torch

import k3compile
from k3compile.backends import all_choices
from k3compile.model import KimiK3Config, KimiK3ForConditionalGeneration
from k3compile.testing import assert_within_bf16_noise

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

BATCH, PROMPT, NEW = 2, 12, 6


def _models(experts: str = "bf16"):
    """(eager, a copy to compile, prompt ids); ``experts="mxfp4"``: the routed experts packed (I = 64: MXFP4 takes
    widths in multiples of 32), as the published checkpoint holds them."""
    torch.manual_seed(0)
    config = KimiK3Config.micro(**({"moe_intermediate_size": 64} if experts == "mxfp4" else {}))
    eager = KimiK3ForConditionalGeneration(config).eval().cuda()
    if experts == "mxfp4":
        eager.convert_experts("mxfp4")
    eager.set_dtype(torch.bfloat16)
    ids = torch.randint(0, eager.config.text_config.vocab_size, (BATCH, PROMPT), device="cuda")
    return eager, copy.deepcopy(eager), ids


@torch.no_grad()
@pytest.mark.parametrize("experts", ["bf16", "mxfp4"])
def test_decode_runs_our_kernels_and_matches_eager(experts):
    eager, model, ids = _models(experts)
    ref = eager.generate(ids, NEW)
    torch._dynamo.reset()
    k3compile.optimize(model, strict=True, dynamic=False)
    out = model.generate(ids, NEW)
    rep = k3compile.report(model)
    print(rep.format(verbose=True), f"\ntokens {out}\neager  {ref}")
    assert_within_bf16_noise(model, eager, ids, ref)
    decode = rep.graphs[-1].record.matches
    assert decode["kda_decode"] == 3 and decode["latent_moe_tail"] >= 1 and decode["skinny_gemm"] > 0
    assert decode["mla_decode"] == 1                              # the micro K3's one MLA layer
    impls = {(c.op, c.impl) for c in all_choices() if c.calls}
    assert ("kda_decode", "triton") in impls and ("mla_decode", "triton") in impls
    if importlib.util.find_spec("cutlass") is not None:
        assert ("skinny_gemm", "cute") in impls, sorted(impls)
        if experts == "mxfp4":   # decode, 2 tokens: the packed experts' mma.sync kernels
            assert ("moe_experts", "cute") in impls, sorted(impls)


@torch.no_grad()
def test_reduce_overhead_keeps_cuda_graphs():
    from torch._dynamo.utils import counters

    eager, model, ids = _models()
    torch._dynamo.reset()
    default = copy.deepcopy(eager)
    k3compile.optimize(default, dynamic=False)
    ref = default.generate(ids, NEW)
    counters.clear()
    k3compile.optimize(model, dynamic=False, mode="reduce-overhead")
    out = model.generate(ids, NEW)
    out_again = model.generate(ids, NEW)       # a new cache: its graphs re-record, nothing recompiles
    assert counters["inductor"]["cudagraph_skips"] == 0, (
        "CUDA graphs skipped (see the 'skipping cudagraphs' log lines)")
    assert torch.equal(out, ref) and torch.equal(out_again, ref)


@torch.no_grad()
def test_first_decode_step_compiles_none_of_our_triton_kernels(monkeypatch, tmp_path):
    """The precompile builds our ops' Triton kernels ahead (``k3compile/triton_ahead.py``), each with its launcher
    where Triton compiles one per signature: the first decode step after a cold compile (empty Triton cache, no
    Inductor cache) finds every kernel of ours on disk and builds no launcher. Prefill is not covered (its KDA
    kernels are fla's, autotuned at their first call)."""
    import triton
    from triton import knobs

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    monkeypatch.setattr(torch._inductor.config, "fx_graph_cache", False)
    monkeypatch.setattr(torch._functorch.config, "enable_autograd_cache", False)
    _, model, ids = _models()
    torch._dynamo.reset()
    k3compile.optimize(model, dynamic=False)
    cache = model.allocate_cache(BATCH, PROMPT + 2, device="cuda")
    token = model(ids, cache=cache, logits_to_keep=1).argmax(-1)      # prefill: its own graph, not checked

    ours, launchers = [], []

    def listener(*, src, cache_hit, **_):
        fn = getattr(src, "fn", None)
        if fn is not None and fn.__module__.startswith("k3compile."):
            ours.append((fn.__name__, cache_hit))

    monkeypatch.setattr(knobs.compilation, "listener", listener)
    build = getattr(triton.runtime.build, "_build", None)
    if build is not None:   # Triton 3.6: a C launcher a kernel signature
        def recording_build(name, *args, **kwargs):
            launchers.append(name)
            return build(name, *args, **kwargs)
        monkeypatch.setattr(triton.runtime.build, "_build", recording_build)
    model(token, cache=cache, logits_to_keep=1)                        # the decode step: compiled, then run
    torch.cuda.synchronize()
    rep = k3compile.report(model)
    assert ours, "no Triton kernel of ours was loaded in the decode step"
    built_then = [name for name, hit in ours if not hit]
    assert not built_then, (f"built at the first call, not ahead: {built_then}\n" + rep.format(verbose=True))
    assert "__triton_launcher" not in launchers, launchers
