"""k3::moe_experts' CuTe kernels (MXFP4 weights, bf16 activations, M <= 16: ``cute.py``, ``cute_gate_up.py``,
``cute_down.py``).

On the CPU: the conversion's bit recipe (``e2m1_bits.py``, the PTX is generated from it) against the reference
dequantisation for every code, byte position and scale byte, and the dispatch rules. On an sm_90 GPU: the op against
the reference (random and skewed routing, duplicates, K tails, scales above 2^1, ids out of range), NaN-poisoned
outputs, and a CUDA graph replayed on fresh inputs.
"""
from __future__ import annotations

import dataclasses
import importlib.util

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from k3compile import kernel_cache
from k3compile.ops.moe_experts import cute, e2m1_bits
from k3compile.ops.moe_experts.dispatch import MOE_EXPERTS
from k3compile.ops.moe_experts.op import moe_experts_op
from k3compile.ops.moe_experts.reference import dequantize_mxfp4, moe_experts_ref
from k3compile.testing import moe_experts_inputs, rel_err

K3_BETAS = (4.0, 25.0)


def _emulate(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """What the kernel's conversion yields for rows of 16 code bytes and their scale byte: [N, 32] bf16, elements in
    the reference's order (register k of word q holds elements 8q + k and 8q + k + 4)."""
    words = codes.contiguous().view(torch.int32).long() & 0xFFFFFFFF            # [N, 4], little-endian
    regs = e2m1_bits.e2m1x8_bits(words)                                         # [N, 4 words, 4 registers]
    halves = torch.stack([regs & 0xFFFF, regs >> 16], dim=-1)                   # [N, q, k, lo / hi]
    values = halves.to(torch.int16).view(torch.bfloat16).float()               # value · 2^-126
    s = scales.long().view(-1, 1, 1, 1)
    f1 = torch.exp2(torch.minimum(s, torch.tensor(128)) - 1.0)
    f2 = torch.where(s == 255, torch.nan, torch.exp2(torch.maximum(s, torch.tensor(128)) - 128.0))
    # two bf16 multiplies, each rounded (the kernel's fma.rn.bf16x2 with a -0.0 addend)
    out = ((values * f1).to(torch.bfloat16).float() * f2).to(torch.bfloat16)   # [N, q, k, lo/hi]
    # element 8q + k (lo) and 8q + k + 4 (hi) -> [N, q, (lo/hi), k] -> [N, 32]
    return out.permute(0, 1, 3, 2).reshape(codes.shape[0], 32)


@pytest.mark.filterwarnings("ignore:overflow encountered")   # 6·2^127 is inf, in the reference too
def test_bit_recipe_every_code_position_and_scale():
    g = torch.Generator().manual_seed(0)
    n = 256 * 64
    codes = torch.randint(0, 256, (n, 16), dtype=torch.uint8, generator=g)
    codes[:256, :] = torch.arange(256, dtype=torch.uint8)[:, None]   # every byte in every position
    scales = torch.arange(n, dtype=torch.int64).remainder(256).to(torch.uint8)   # every scale byte, 64 times
    got = _emulate(codes, scales)
    want = dequantize_mxfp4(codes, scales[:, None], torch.bfloat16)
    same = (got.view(torch.int16) == want.view(torch.int16)) | (got.isnan() & want.isnan())
    assert bool(same.all()), f"{int((~same).sum())} values differ, first at {(~same).nonzero()[0].tolist()}"


def test_ptx_spells_the_recipe():
    ptx = e2m1_bits.e2m1x8_ptx()
    for k in range(2):
        assert f"{e2m1_bits.MASK[k]:#x}" in ptx and f"{e2m1_bits.MUL[k]:#x}" in ptx
    assert ptx.count("fma.rn.bf16x2") == 4 and f"{e2m1_bits.BF16_BITS:#x}" in ptx


@pytest.mark.parametrize("case,why", [
    (dict(mxfp4=False), "float weights"),
    (dict(dtype=torch.float16), "float16 activations"),
    (dict(m=17), "M=17 outside"),
    (dict(i=544), "I=544 above"),
    (dict(scales="strided"), "w2_scale must have unit stride"),
    (dict(a=33), "33 experts per token outside"),
])
def test_supports_names_what_it_lacks(case, why):
    m = case.get("m", 2)
    args = moe_experts_inputs(m, case.get("a", 4), 40, case.get("i", 64), 64, case.get("dtype", torch.bfloat16),
                              mxfp4=case.get("mxfp4", True))
    z, experts, weights, w1, w3, w2, s1, s3, s2 = args
    if case.get("scales") == "strided" and s2 is not None:
        s2 = s2.transpose(1, 2).contiguous().transpose(1, 2)
    assert why in cute.supports(z, experts, weights, w1, w3, w2, s1, s3, s2, 16)


def test_cpu_tensors_never_reach_the_cute_kernels():
    args = moe_experts_inputs(2, 4, 8, 64, 64, torch.bfloat16, mxfp4=True)
    impl, why = MOE_EXPERTS.decide("auto", (*args, 16))
    assert impl != "cute" and "cute:" in why


def test_variant_names_are_distinct_and_exact():
    a = cute.variant_name(cute.variant("gate_up", 1, 16, cute.GATE_UP_CONFIG, 4.0, 25.0, torch.int64))
    b = cute.variant_name(cute.variant("gate_up", 1, 16, cute.GATE_UP_CONFIG, 4.0 + 1e-12, 25.0, torch.int64))
    c = cute.variant_name(cute.variant("down", 1, 16, cute.DOWN_CONFIG, 4.0, 25.0, torch.int32, 3))
    d = cute.variant_name(cute.variant("down", 1, 16, cute.DOWN_CONFIG, None, None, torch.int32, 2))
    assert c != d and c == cute.variant_name(cute.variant("down", 1, 16, cute.DOWN_CONFIG, None, None, torch.int32, 3))
    assert len({a, b, c}) == 3 and all(n.isidentifier() for n in (a, b, c))


# ---------------------------------------------------------------------------------------------
# GPU (sm_90+ with CuTe DSL)

def _cute_ready() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9 and cute.unavailable() is None


def _run(args, betas=K3_BETAS):
    z = args[0]
    out = torch.full_like(z, float("nan"))
    cute.moe_experts_cute(*args, *betas, out=out)
    return out


CASES = [  # m, a, e, i, l, routing
    (1, 16, 896, 384, 3584, "random"), (8, 16, 896, 384, 3584, "random"), (4, 16, 896, 192, 3584, "skewed"),
    (3, 4, 16, 96, 160, "repeat"), (8, 2, 3, 32, 32, "one"), (5, 6, 40, 224, 416, "random"), (2, 1, 1, 64, 96, "one"),
    # TP 16's own picks of both products at M 2, 7 and 8
    (2, 16, 896, 192, 3584, "random"), (7, 16, 896, 192, 3584, "repeat"), (8, 16, 896, 192, 3584, "random"),
    # two blocks of 8 tokens
    (16, 16, 896, 384, 3584, "random"), (12, 16, 896, 192, 3584, "skewed"), (9, 3, 10, 96, 160, "repeat"),
]


def test_big_scales_read_once_a_version():
    s = torch.full((2, 3, 4), 128, dtype=torch.uint8)
    other = torch.full((5,), 127, dtype=torch.uint8)
    assert not cute.big_scales(s, other)
    s[1, 2, 3] = 129                       # in place: a new version, read again
    assert cute.big_scales(s, other) and cute.big_scales(other, s)
    assert not cute.big_scales(other)
    s.fill_(0)
    assert not cute.big_scales(s)


@pytest.mark.gpu
@pytest.mark.parametrize("big", [False, True], ids=["scales<=2", "scales>2"])
@pytest.mark.parametrize("m,a,e,i,l,routing", CASES, ids=lambda v: str(v))
def test_gpu_matches_reference(m, a, e, i, l, routing, big):
    if not _cute_ready():
        pytest.skip("needs sm_90+ and CuTe DSL")
    args = moe_experts_inputs(m, a, e, i, l, torch.bfloat16, routing, mxfp4=True, seed=m * 7 + a, device="cuda")
    args = list(args)
    for s in args[6:]:   # scales at the smallest byte, and (big) a few above 2^1: the exact variants
        s.view(-1)[5::131] = 0
        if big:
            s.view(-1)[::97] = 129
    assert cute.big_scales(*args[6:]) == big
    out = _run(args)
    torch.cuda.synchronize()
    want = moe_experts_ref(*args, *K3_BETAS)
    assert not out.isnan().any()
    assert rel_err(out, want) < 1e-2, rel_err(out, want)


@pytest.mark.gpu
@pytest.mark.parametrize("m,a,e,i,l,routing", CASES, ids=lambda v: str(v))
def test_gpu_every_token_column_forms_match_reference(m, a, e, i, l, routing):
    """The forms whose MMA columns are every token of the call (the picks are compact) on the fixed cases."""
    if not _cute_ready():
        pytest.skip("needs sm_90+ and CuTe DSL")
    args = moe_experts_inputs(m, a, e, i, l, torch.bfloat16, routing, mxfp4=True, seed=m * 5 + a, device="cuda")
    up = dataclasses.replace(cute.gate_up_config(m), compact=False)
    with cute.configs_forced(up, dataclasses.replace(cute.down_config(m), compact=False)):
        out = _run(args)
    torch.cuda.synchronize()
    want = moe_experts_ref(*args, *K3_BETAS)
    assert not out.isnan().any() and rel_err(out, want) < 1e-2, rel_err(out, want)


@pytest.mark.gpu
@pytest.mark.parametrize("big", [False, True], ids=["scales<=2", "scales>2"])
@pytest.mark.parametrize("m,a,e,i,l,routing", CASES, ids=lambda v: str(v))
def test_gpu_down_loads_ahead_match_reference(m, a, e, i, l, routing, big):
    """Down with each group's loads ahead of the group before it (two groups a warp: both buffers; the drawn test
    draws other divisions): lanes past K read their row's last group (scales up to 2^1) or nothing (the variant
    exact for any scale); the output NaN-poisoned."""
    if not _cute_ready():
        pytest.skip("needs sm_90+ and CuTe DSL")
    args = list(moe_experts_inputs(m, a, e, i, l, torch.bfloat16, routing, mxfp4=True, seed=m * 3 + a, device="cuda"))
    if big:
        args[8].view(-1)[::97] = 129
    down = cute.Mxfp4DownConfig(4, 1, 2, scan_unrolled=True, compact=True, ahead=True)
    with cute.configs_forced(None, down):
        out = _run(args)
    torch.cuda.synchronize()
    want = moe_experts_ref(*args, *K3_BETAS)
    assert not out.isnan().any() and rel_err(out, want) < 1e-2, rel_err(out, want)


@pytest.mark.skipif(importlib.util.find_spec("cutlass") is None, reason="CuTe DSL (nvidia-cutlass-dsl) not installed")
@pytest.mark.parametrize("m", [1, 8, 16], ids=lambda m: f"M{m}")
def test_picks_and_other_scans_build_for_sm90a_without_gpu(monkeypatch, m):
    """Each pick (compact; TP 16's too), and each with every token's column (the id scan unrolled, and looped),
    compiles for sm_90a (what the GPU tests cannot show on a host without one: a DSL error in a variant no pick takes
    yet)."""
    if torch.cuda.is_available():
        pytest.skip("GPU present: the GPU tests compile for the real device")
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")
    up, down = cute.gate_up_config(m), cute.down_config(m)
    steps = cute.down_steps(384)

    def unrolled(cfg):   # every token's column, the scan unrolled
        return dataclasses.replace(cfg, compact=False)

    def looped(cfg):
        return dataclasses.replace(cfg, compact=False, scan_unrolled=False)
    # the forms with every token's column at top-k 32 too: a token's slot mask fills all 32 bits; each distinct
    # variant built once (at M 16 TP 16's gate/up pick is TP 8's)
    for key in dict.fromkeys((cute.variant("gate_up", m, 16, up, 4.0, 25.0, torch.int64),
                cute.variant("gate_up", m, 32, unrolled(up), 4.0, 25.0, torch.int32),
                cute.variant("gate_up", m, 16, looped(up), 4.0, 25.0, torch.int64),
                cute.variant("down", m, 16, down, None, None, torch.int64, steps),
                cute.variant("down", m, 32, unrolled(down), None, None, torch.int64, steps),
                cute.variant("down", m, 32, looped(down), None, None, torch.int32, steps),
                # TP 16's picks: a step and a half of K, loads ahead at few tokens; exact for any scale too
                cute.variant("gate_up", m, 16, cute.gate_up_config(m, 192), 4.0, 25.0, torch.int64),
                cute.variant("down", m, 16, cute.down_config(m, 192), None, None, torch.int64, cute.down_steps(192)),
                cute.variant("down", m, 16, cute.down_config(m, 192), None, None, torch.int64, cute.down_steps(192),
                             big_scales=False),
                # ... and TP 16's own down pick at M 2 (eight warps a block), which no M above takes
                *([cute.variant("down", 2, 16, cute.down_config(2, 192), None, None, torch.int64,
                                cute.down_steps(192))] if m == 1 else []))):
        assert cute.build(key) is not None, cute.variant_name(key)


# the id scan looped, unrolled, or unrolled with the MMA's columns compacted to the expert's tokens
SCANS = st.sampled_from([(False, False), (True, False), (True, True)])


# the drawn GPU test's cases: shapes, routings and both products' work divisions (its kernels also build on the CPU
# host: test_drawn_kernels_build_for_sm90a_without_gpu)
DRAWS = given(
    m=st.integers(1, 16), a=st.integers(1, 8) | st.sampled_from([16, 20, 32]), e=st.integers(1, 40),
    i=st.sampled_from([32, 64, 96, 160, 224]), l=st.sampled_from([32, 64, 160, 416]),
    routing=st.sampled_from(["random", "repeat", "one", "skewed"]), big=st.booleans(), ids32=st.booleans(),
    seed=st.integers(0, 2 ** 16), warps_k=st.sampled_from([1, 2, 4, 8]), row_groups=st.integers(1, 2),
    unroll=st.integers(1, 2), prefetch=st.booleans(), up_scan=SCANS, down_scan=SCANS,
    down_division=st.sampled_from([(4, 1, 2), (4, 2, 2), (8, 1, 1), (2, 1, 3), (4, 2, 4)]), ahead=st.booleans())


def _drawn_configs(warps_k, row_groups, unroll, prefetch, up_scan, down_scan, down_division, ahead):
    return (cute.Mxfp4MmaConfig(warps_k, row_groups, unroll, prefetch, *up_scan),
            cute.Mxfp4DownConfig(*down_division, *down_scan, ahead=ahead))


@pytest.mark.gpu
@settings(max_examples=max(16, settings.default.max_examples // 2))   # each draw may build two kernels (a second or two each)
@DRAWS
def test_gpu_drawn_shapes_match_reference(m, a, e, i, l, routing, big, ids32, seed, **division):
    """Drawn tokens, experts, widths (K tails of 32 / 64 / 96 past a step of 128), routings (duplicates within a
    token, every pair on one expert: past 8 tokens a second compact block, experts nobody chose), top-k whose
    tokens straddle the scan's 32-pair rounds, int32 or int64 ids, scales above 2^1 or not, gate/up work divisions
    (warps with no K step; prefetching or not: odd and even counts of chunks a warp), down's (groups past the
    rows, their loads ahead or not), the id scan looped, unrolled or compact, in both products; the output
    NaN-poisoned."""
    if not _cute_ready():
        pytest.skip("needs sm_90+ and CuTe DSL")
    with cute.configs_forced(*_drawn_configs(**division)):
        _drawn_case(m, a, e, i, l, routing, big, ids32, seed)


@pytest.mark.skipif(importlib.util.find_spec("cutlass") is None, reason="CuTe DSL (nvidia-cutlass-dsl) not installed")
@settings(max_examples=max(4, settings.default.max_examples // 6))   # two builds a draw, 1-6 s each
@DRAWS
def test_drawn_kernels_build_for_sm90a_without_gpu(m, a, e, i, l, routing, big, ids32, seed, **division):
    """Each drawn case's two kernels compile for sm_90a on the CPU host (conftest.py sets the arch): a DSL error in a
    drawn variant shows here, not first as a GPU test's failure."""
    if torch.cuda.is_available():
        pytest.skip("GPU present: the drawn GPU test compiles for the real device")
    experts = torch.zeros(m, a, dtype=torch.int32 if ids32 else torch.int64)
    w1 = torch.empty(1, i, l // 2, dtype=torch.uint8)
    with cute.configs_forced(*_drawn_configs(**division)):   # the keys the op would build for this case
        keys = cute.kernels(torch.empty(m, l, dtype=torch.bfloat16), experts, w1, *K3_BETAS, big)
    for _, key in keys:
        assert cute.build(key) is not None, cute.variant_name(key)


def _drawn_case(m, a, e, i, l, routing, big, ids32, seed):
    if routing == "random" and a > e:
        routing = "repeat"
    args = list(moe_experts_inputs(m, a, e, i, l, torch.bfloat16, routing, mxfp4=True, seed=seed, device="cuda"))
    if ids32:
        args[1] = args[1].to(torch.int32)
    if big:
        args[8].view(-1)[::7] = 130
    out = _run(args)
    torch.cuda.synchronize()
    want = moe_experts_ref(args[0], args[1].long(), *args[2:], *K3_BETAS)
    assert not out.isnan().any() and rel_err(out, want) < 1e-2, rel_err(out, want)


@pytest.mark.gpu
def test_gpu_unseen_scales_inside_a_capture_take_the_exact_variants():
    """Inside a CUDA-graph capture the scales cannot be read: a tensor not seen before takes the variants exact for
    every scale byte, and the replay is right whatever its bytes are."""
    if not _cute_ready():
        pytest.skip("needs sm_90+ and CuTe DSL")
    args = list(moe_experts_inputs(2, 4, 16, 64, 128, torch.bfloat16, mxfp4=True, seed=5, device="cuda"))
    _run(args)   # builds outside the capture (these scales are seen: the fast variants)
    fresh = [s.clone() for s in args[6:]]
    fresh[0].view(-1)[::11] = 131
    args[6:] = fresh
    for kind, key in cute.kernels(args[0], args[1], args[3], *K3_BETAS, big=True):
        kernel_cache.get(kind, key)   # the exact variants built outside the capture (a capture cannot compile)
    graph = torch.cuda.CUDAGraph()
    out = torch.full_like(args[0], float("nan"))
    with torch.cuda.graph(graph):
        cute.moe_experts_cute(*args, *K3_BETAS, out=out)
    graph.replay()
    torch.cuda.synchronize()
    assert rel_err(out, moe_experts_ref(*args, *K3_BETAS)) < 1e-2


@pytest.mark.gpu
def test_gpu_other_activations_and_bad_ids():
    if not _cute_ready():
        pytest.skip("needs sm_90+ and CuTe DSL")
    for betas in [(None, None), (2.5, None)]:
        args = moe_experts_inputs(3, 4, 16, 64, 128, torch.bfloat16, mxfp4=True, seed=1, device="cuda")
        assert rel_err(_run(args, betas), moe_experts_ref(*args, *betas)) < 1e-2, betas
    args = list(moe_experts_inputs(4, 4, 16, 64, 128, torch.bfloat16, mxfp4=True, seed=2, device="cuda"))
    experts = args[1].clone()
    experts[1, 2] = 16
    experts[3, 0] = -1
    # an int64 id whose low 32 bits are a valid expert, on a pair before the first that truly holds it: the kernels
    # compare ids by their low 32 bits, so that pair's block serves the expert (token 2 included), and the combine
    # (whole ids) NaNs token 1
    v = next(x for x in range(16) if x not in experts[0].tolist() + experts[2].tolist())
    experts[2, 0] = v
    experts[1, 0] = (1 << 32) + v
    args[1] = experts
    out = _run(args)
    good = torch.tensor([True, False, True, False], device="cuda")
    assert out[~good].isnan().all()
    fixed = experts.clamp(0, 15)
    want = moe_experts_ref(args[0], fixed, *args[2:], *K3_BETAS)
    assert rel_err(out[good], want[good]) < 1e-2


@pytest.mark.gpu
def test_gpu_op_picks_cute_and_replays_in_a_graph():
    if not _cute_ready():
        pytest.skip("needs sm_90+ and CuTe DSL")
    args = moe_experts_inputs(2, 8, 64, 96, 256, torch.bfloat16, mxfp4=True, seed=3, device="cuda")
    z, experts, weights = args[:3]
    impl, _ = MOE_EXPERTS.decide("auto", (*args, 16))
    assert impl == "cute"
    moe_experts_op(*args, *K3_BETAS)   # builds outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moe_experts_op(*args, *K3_BETAS)
    for seed in range(3):
        fresh = moe_experts_inputs(2, 8, 64, 96, 256, torch.bfloat16, mxfp4=True, seed=10 + seed, device="cuda")
        z.copy_(fresh[0])
        experts.copy_(fresh[1])
        weights.copy_(fresh[2])
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert rel_err(out, moe_experts_ref(*args, *K3_BETAS)) < 1e-2, seed


def test_picks_follow_the_intermediate_width():
    """Each measured I has its picks by M (TP 16's I 192 its own: down's loads ahead at few tokens but M 2, four
    groups a warp from M 8; gate/up's 4 K-warps without the prefetch at M 7-8), a width nobody measured takes TP 8's;
    the planned kernel keys follow the width."""
    at_192 = [cute.down_config(m, 192) for m in (1, 2, 7, 8, 16)]
    assert [c.ahead for c in at_192] == [True, False, True, False, False]
    assert [(c.warps, c.row_groups, c.groups) for c in at_192] == [(4, 1, 1), (8, 1, 1), (4, 1, 2), (4, 1, 4),
                                                                   (4, 2, 4)]
    assert [cute.down_config(m, 384) for m in (1, 8, 9, 16)] == [cute.DOWN_CONFIG] * 2 + [cute.DOWN_CONFIG_SIXTEEN] * 2
    assert cute.down_config(8, 96) == cute.DOWN_CONFIG == cute.down_config(8)
    up_192 = [cute.gate_up_config(m, 192) for m in (1, 2, 3, 6, 7, 8, 9, 16)]
    few, many, sixteen = cute.GATE_UP_CONFIG, cute.GATE_UP_CONFIG_MANY, cute.GATE_UP_CONFIG_SIXTEEN
    assert up_192[:4] == [few, few, many, many] and up_192[6:] == [sixteen, sixteen]
    assert up_192[4] == up_192[5] and (up_192[5].warps_k, up_192[5].prefetch, up_192[5].compact) == (4, False, True)
    assert [cute.gate_up_config(m, 384) for m in (2, 3, 8, 9)] == [few, many, many, sixteen]
    assert cute.gate_up_config(8, 96) == many == cute.gate_up_config(8)
    z, experts = torch.empty(8, 3584, dtype=torch.bfloat16), torch.zeros(8, 16, dtype=torch.int64)
    for i, want_up, want_down in ((192, up_192[5], at_192[3]), (384, many, cute.DOWN_CONFIG)):
        w1 = torch.empty(1, i, 1792, dtype=torch.uint8)
        (_, up), (_, down) = cute.kernels(z, experts, w1, *K3_BETAS)
        assert (up[3], down[3]) == (want_up, want_down)


def test_plan_names_the_kernels_the_first_call_builds(monkeypatch):
    """Planning (stand-in tensors on a GPU, nothing allocated) asks for exactly the variants a first call with scales
    at most 2^1 loads: both products, the configuration of its M."""
    from k3compile.call_sites import stand_in
    from k3compile.ops.moe_experts import dispatch

    monkeypatch.setattr(dispatch, "cute_can_run_on", lambda *tensors: None)
    monkeypatch.setattr(cute, "unavailable", lambda: None)
    MOE_EXPERTS.clear()
    try:
        for m in (1, 8):
            e, a, i, l = 896, 16, 384, 3584
            z = stand_in((m, l), torch.bfloat16, "cuda")
            experts = stand_in((m, a), torch.int64, "cuda")
            weights = stand_in((m, a), torch.float32, "cuda")
            w1, w3 = (stand_in((e, i, l // 2), torch.uint8, "cuda") for _ in range(2))
            w2 = stand_in((e, l, i // 2), torch.uint8, "cuda")
            s1, s3 = (stand_in((e, i, l // 32), torch.uint8, "cuda") for _ in range(2))
            s2 = stand_in((e, l, i // 32), torch.uint8, "cuda")
            builds = dispatch.kernels(z, experts, weights, w1, w3, w2, s1, s3, s2, *K3_BETAS)
            want = cute.kernels(z, experts, w1, *K3_BETAS, big=False)
            assert [(b.kind, b.key) for b in builds] == want
            assert want[0][1][3] == cute.gate_up_config(m) and want[1][1][3] == cute.down_config(m)
            assert want[1][1][7] == 6   # I 384 in steps of 64
    finally:
        MOE_EXPERTS.clear()
