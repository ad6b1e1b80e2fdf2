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


# per row and step, ||a - b|| / ||b|| over the vocabulary against the fp32 computation; eager bf16 and plain
# torch.compile's bf16 give 0.3-2.2e-2 on the CPU (two bf16 runs differ from each other by up to 2.8e-2)
LOGITS_TOL = 3e-2


def teacher_forced_logits(model, ids, tokens) -> torch.Tensor:
    """[B, NEW, V] fp32: the prompt's next-token logits, then those after each of ``tokens[:, :-1]`` fed in turn
    (one decode step each, on one cache)."""
    B, T = ids.shape
    cache = model.allocate_cache(B, T + tokens.shape[1], device=ids.device)
    steps = [model(ids, cache=cache, logits_to_keep=1)]
    steps += [model(tokens[:, i:i + 1], cache=cache, logits_to_keep=1) for i in range(tokens.shape[1] - 1)]
    return torch.cat(steps, dim=1).float()


def step_errors(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    return ((got - want).norm(dim=-1) / want.norm(dim=-1)).cpu()


@torch.no_grad()
@pytest.mark.parametrize("experts", ["bf16", "mxfp4"])
def test_decode_runs_our_kernels_and_matches_eager(experts):
    eager, model, ids = _models(experts)
    ref = eager.generate(ids, NEW)
    torch._dynamo.reset()
    k3compile.optimize(model, strict=True, dynamic=False)
    out = model.generate(ids, NEW)
    rep = k3compile.report(model)
    print(rep.format(verbose=True))
    # teacher-forced: the same tokens (eager's) in both, each step's logits compared; free-running greedy tokens
    # part at the first bf16 near-tie and would hide or fake an error from there on. The truth: the same bf16
    # weights computed in fp32 (no TF32)
    truth = copy.deepcopy(eager).set_dtype(torch.float32)
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        with torch.backends.cudnn.flags(allow_tf32=False):
            want = teacher_forced_logits(truth, ids, ref)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    del truth
    errs = step_errors(teacher_forced_logits(model, ids, ref), want)
    # the noise of a correct bf16 computation: eager's and plain torch.compile's. Where it is itself above the
    # tolerance the step is ill-conditioned in 16 bits, and only "no further off than they are" can be asked there.
    # A rounding can also flip a near-tie in a router's top-k, a jump no tolerance covers. On the CPU (reference
    # kernels) the kda_prefill rewrite alone moves the first layer's KDA inputs by 1.5e-3 (Inductor keeps fp32
    # where eager rounds); noise of that size flips the experts of 2-3 tokens a MoE layer (top-k margins down to
    # 5e-4), and the rewritten model was 0.08 and 0.46 off at two of its twelve steps where eager and
    # torch.compile were 0.02. On the H200 one of the two sequences is ill-conditioned at every step (eager bf16
    # 0.03-0.57 off the fp32 computation). So: most steps within the allowance, and most of the well-conditioned
    # steps (enough of them to tell) within the tolerance itself; a wrong kernel is off at most steps
    control = copy.deepcopy(eager)
    torch._dynamo.reset()
    control_errs = step_errors(teacher_forced_logits(torch.compile(control, dynamic=False), ids, ref), want)
    noise = torch.maximum(step_errors(teacher_forced_logits(eager, ids, ref), want), control_errs)
    allowed = torch.maximum(torch.full_like(noise, LOGITS_TOL), 2 * noise)
    calm = noise < LOGITS_TOL
    seen = (f"logits off the fp32 computation's (rows x steps):\n{errs}\neager's and plain torch.compile's, the "
            f"further:\n{noise}\ntokens {out}\neager  {ref}")
    assert calm.sum() >= 4, f"too few well-conditioned steps to tell a wrong kernel from bf16 noise\n{seen}"
    assert torch.isfinite(errs).all(), seen
    assert (errs < allowed).float().mean() >= 0.75, seen
    assert (errs[calm] < LOGITS_TOL).float().mean() >= 2 / 3, seen
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
