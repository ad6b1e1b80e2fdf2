"""The skinny GEMM's Triton kernel (``ops/skinny_gemm/triton.py``) against the fp32 reference.

On CPU the Triton kernel runs under TRITON_INTERPRET=1 (set by conftest); its 16-bit products are
computed in fp32 there (exact, as on the GPU's MMA) because the interpreter's 16-bit ``tl.dot`` is
wrong, and it truncates fp32 -> bf16 where a GPU rounds: tolerances cover both.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

from k3compile.ops.skinny_gemm.reference import skinny_gemm_reference
from k3compile.ops.skinny_gemm.triton import skinny_gemm_triton
from k3compile.ops.skinny_gemm.triton_config import TritonConfig, heuristic, supports
from k3compile.testing import rel_err

# the kernel tests run on the GPU when there is one, else on CPU under the interpreter
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 3e-3, torch.float64: 1e-12}


def make_inputs(m, n, k, dtype, bias=True, residual=True, seed=0, device=DEVICE):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(m, k, generator=g).to(device, dtype)
    w = (torch.randn(n, k, generator=g) / max(k, 1) ** 0.5).to(device, dtype)
    b = torch.randn(n, generator=g).to(device, dtype) if bias else None
    r = torch.randn(m, n, generator=g).to(device, dtype) if residual else None
    return a, w, b, r


def run_triton(a, w, b, r, config=None, static_weight=False):
    out = torch.full((a.shape[0], w.shape[0]), float("nan"), dtype=a.dtype, device=a.device)
    return skinny_gemm_triton(a, w, b, r, config=config, out=out, static_weight=static_weight)


@pytest.mark.parametrize("m,n,k,dtype", [
    pytest.param(1, 7, 13, "bf16", id="M1-N7-K13-bf16"),
    pytest.param(4, 100, 200, "fp16", id="M4-N100-K200-fp16"),
    pytest.param(16, 96, 384, "bf16", id="M16-N96-K384-bf16"),
    pytest.param(64, 33, 70, "fp32", id="M64-N33-K70-fp32"),
])
def test_triton_matches_reference_fixed_shapes(m, n, k, dtype):
    a, w, b, r = make_inputs(m, n, k, DTYPES[dtype])
    out = run_triton(a, w, b, r)
    assert rel_err(out, skinny_gemm_reference(a, w, b, r)) < TOL[DTYPES[dtype]]


def config_for(m, k, block_n, split_k, mode, num_stages=None):
    """A kernel config of the drawn kind: "dot" (tensor-core tile, M padded to 16) or "fma" (CUDA-core
    products, M padded to a power of 2 only); "+1" sums split-K partials in the last-arriving program, "+1p"
    in the last split, which polls the others' partials."""
    fma = mode.startswith("fma")
    block_m = 1 << (m - 1).bit_length()
    return TritonConfig(block_m=block_m if fma else max(16, block_m), block_n=block_n, block_k=32 if k > 16 else 16,
                        split_k=split_k,
                        num_stages=num_stages, one_launch="+1" in mode, fma=fma, poll=mode.endswith("+1p"))


MODES = ["dot", "dot+1", "dot+1p", "fma", "fma+1", "fma+1p"]


@given(
    m=st.integers(1, 64), n=st.integers(1, 160), k=st.integers(1, 300),
    dtype=st.sampled_from(sorted(DTYPES)), bias=st.booleans(), residual=st.booleans(),
    split_k=st.sampled_from([1, 2, 3]), block_n=st.sampled_from([16, 32, 64]), mode=st.sampled_from(MODES),
    seed=st.integers(0, 2**16),
)
@example(m=1, n=2112, k=64, dtype="bf16", bias=False, residual=True, split_k=1, block_n=64, mode="dot", seed=0)
@example(m=16, n=128, k=512, dtype="bf16", bias=True, residual=True, split_k=3, block_n=64, mode="dot", seed=1)
@example(m=1, n=96, k=520, dtype="bf16", bias=False, residual=True, split_k=3, block_n=32, mode="fma+1", seed=2)
@example(m=5, n=70, k=300, dtype="fp16", bias=True, residual=False, split_k=2, block_n=32, mode="dot+1", seed=3)
@example(m=16, n=100, k=300, dtype="fp32", bias=True, residual=True, split_k=3, block_n=32, mode="dot+1p", seed=4)
@example(m=2, n=40, k=300, dtype="bf16", bias=False, residual=True, split_k=3, block_n=16, mode="fma+1p", seed=5)
def test_triton_matches_reference_random_shapes(m, n, k, dtype, bias, residual, split_k, block_n, mode, seed):
    dt = DTYPES[dtype]
    a, w, b, r = make_inputs(m, n, k, dt, bias, residual, seed)
    out = run_triton(a, w, b, r, config_for(m, k, block_n, split_k, mode))
    assert rel_err(out, skinny_gemm_reference(a, w, b, r)) < TOL[dt]


@given(
    m=st.integers(1, 16), n=st.integers(1, 160), k=st.integers(1, 300), dtype=st.sampled_from(["bf16", "fp16"]),
    bias=st.booleans(), residual=st.booleans(), split_k=st.sampled_from([1, 2, 3]),
    block_n=st.sampled_from([16, 32, 64]), mode=st.sampled_from(MODES), static=st.booleans(),
    seed=st.integers(0, 2**16),
)
@example(m=4, n=96, k=448, dtype="bf16", bias=False, residual=False, split_k=3, block_n=32, mode="dot+1p",
         static=True, seed=0)   # the router's form: no bias, no residual, split K
@example(m=1, n=40, k=300, dtype="fp16", bias=True, residual=True, split_k=2, block_n=16, mode="fma+1", static=False,
         seed=1)
def test_triton_fp32_output_of_16_bit_operands_matches_reference(m, n, k, dtype, bias, residual, split_k, block_n,
                                                                    mode, static, seed):
    """``out_dtype=float32``: the fp32 sums of the 16-bit products, stored unrounded (a bf16 store would miss by
    ~1e-3), every split-K flavour and the peeled static-weight path; residual fp32."""
    a, w, b, r = make_inputs(m, n, k, DTYPES[dtype], bias, residual, seed)
    r = None if r is None else r.float() + 1e-3 * torch.randn(m, n, device=DEVICE)   # not a 16-bit value
    cfg = dataclasses.replace(config_for(m, k, block_n, split_k, mode), pdl=static, preload=2 if static else 0)
    out = torch.full((m, n), float("nan"), dtype=torch.float32, device=DEVICE)
    skinny_gemm_triton(a, w, b, r, config=cfg, out=out, static_weight=static, out_dtype=torch.float32)
    assert rel_err(out, skinny_gemm_reference(a, w, b, r, torch.float32)) < TOL[torch.float32]


@given(
    m=st.integers(1, 16), n=st.integers(1, 100), k=st.integers(1, 300), dtype=st.sampled_from(sorted(DTYPES)),
    residual=st.booleans(), split_k=st.sampled_from([1, 2, 3]), mode=st.sampled_from(MODES),
    preload=st.sampled_from([1, 2, 4]), seed=st.integers(0, 2**16),
)
@example(m=1, n=64, k=40, dtype="bf16", residual=True, split_k=2, mode="dot+1", preload=4, seed=0)  # K < preload
@example(m=4, n=33, k=300, dtype="fp32", residual=False, split_k=3, mode="fma+1", preload=2, seed=1)
def test_static_weight_peels_first_tiles_and_stays_correct(m, n, k, dtype, residual, split_k, mode, preload, seed):
    """static_weight=True under a pdl config loads the first ``preload`` weight tiles before the (GPU-only)
    wait and adds their products after the loop; off the GPU only the wait is missing, so the peeled path
    runs here: any K (shorter than the peel too), split or not, dot or fma."""
    dt = DTYPES[dtype]
    a, w, b, r = make_inputs(m, n, k, dt, True, residual, seed)
    cfg = dataclasses.replace(config_for(m, k, 32, split_k, mode), pdl=True, preload=preload)
    out = run_triton(a, w, b, r, cfg, static_weight=True)
    assert rel_err(out, skinny_gemm_reference(a, w, b, r)) < TOL[dt]


def test_static_weight_without_pdl_is_a_no_op():
    """Without pdl the flag changes nothing: the same kernel runs, bit for bit."""
    a, w, b, r = make_inputs(3, 70, 200, torch.float32, seed=4)
    cfg = config_for(3, 200, 32, 2, "dot+1")
    assert torch.equal(run_triton(a, w, b, r, cfg), run_triton(a, w, b, r, cfg, static_weight=True))


@pytest.mark.parametrize("bad", [dict(preload=3), dict(preload=8), dict(prefetch_lines=3), dict(prefetch_lines=-1)],
                         ids=lambda d: "-".join(f"{k}{v}" for k, v in d.items()))
def test_triton_config_rejects_bad_preload_and_prefetch(bad):
    with pytest.raises(ValueError, match="bad config"):
        TritonConfig(block_m=16, block_n=32, block_k=128, split_k=1, **bad)


def test_triton_config_tag_spells_the_pdl_flavour():
    assert TritonConfig(block_m=16, block_n=32, block_k=128, split_k=4, one_launch=True,
                        tma=True).tag() == "dot-m16-n32-k128-s4x1-w4-std-tma"
    assert TritonConfig(block_m=1, block_n=8, block_k=256, split_k=1, num_stages=4, fma=True, tma=True, a_tma=True,
                        pdl=True, prefetch_lines=0,
                        early_trigger=True).tag() == "fma-m1-n8-k256-s1-w4-st4-tma-atma-pdl0e"
    cfg = TritonConfig(block_m=16, block_n=32, block_k=128, split_k=4, one_launch=True, pdl=True, prefetch_lines=0,
                       preload=2, early_trigger=True)
    assert cfg.tag() == "dot-m16-n32-k128-s4x1-w4-std-pdl0ep2"
    assert dataclasses.replace(cfg, poll=True).tag() == "dot-m16-n32-k128-s4x1-w4-std-pdl0ep2-poll"


@pytest.mark.parametrize("mode", ["dot+1", "fma+1", "dot+1p", "fma+1p"])
def test_one_launch_split_k_rearms_its_counters(mode):
    """The last program of each column tile zeroes its arrival counter ("+1"), or empties the partial slots
    it polled ("+1p"): a second call (and one with another tile count, and with more splits) on the same
    buffers must be exactly as right as the first."""
    from k3compile.ops import arrival_counters

    results = []
    for n, seed, split_k in ((100, 0, 3), (100, 1, 3), (37, 2, 6)):
        a, w, b, r = make_inputs(4, n, 200, torch.bfloat16, seed=seed)
        out = run_triton(a, w, b, r, config_for(4, 200, 32, split_k, mode))
        results.append(rel_err(out, skinny_gemm_reference(a, w, b, r)))
        if DEVICE == "cpu":
            assert arrival_counters.all_zero() and arrival_counters.partials_all_empty()
    assert max(results) < TOL[torch.bfloat16], results


@pytest.mark.parametrize("split_k", [2, 4, 6])
def test_one_launch_split_k_equals_two_launch_bit_for_bit(split_k):
    """All three paths sum the fp32 partials in split order, then apply the same epilogue."""
    a, w, b, r = make_inputs(3, 90, 400, torch.float32, seed=5)
    two = run_triton(a, w, b, r, config_for(3, 400, 32, split_k, "dot"))
    assert torch.equal(run_triton(a, w, b, r, config_for(3, 400, 32, split_k, "dot+1")), two)
    assert torch.equal(run_triton(a, w, b, r, config_for(3, 400, 32, split_k, "dot+1p")), two)


def test_partial_slots_rotate_and_outgrow(monkeypatch):
    """Launches take the next of PARTIAL_RING slots (all empty); a larger request makes a larger buffer and
    keeps the old one alive (a captured graph may hold its address); inside a capture nothing is allocated."""
    from k3compile.ops import arrival_counters as ac

    monkeypatch.setattr(ac, "_PARTIALS", {})
    monkeypatch.setattr(ac, "_PARTIALS_NEXT", {})
    monkeypatch.setattr(ac, "_PARTIALS_OUTGROWN", [])
    slots = [ac.partial_slots(torch.device("cpu"), 10) for _ in range(ac.PARTIAL_RING + 1)]
    assert len({s.data_ptr() for s in slots[:-1]}) == ac.PARTIAL_RING and slots[-1].data_ptr() == slots[0].data_ptr()
    assert all(s.shape == (10,) and s.dtype == torch.float32 for s in slots) and ac.partials_all_empty()
    big = ac.partial_slots(torch.device("cpu"), 1 << 17)
    assert big.numel() == 1 << 17 and len(ac._PARTIALS_OUTGROWN) == 1 and ac.partials_all_empty()
    monkeypatch.setattr(ac, "_capturing", lambda device: True)
    assert ac.partial_slots(torch.device("cpu"), 1 << 18) is None


def test_slot_taken_last_on_another_stream_waits_for_it(monkeypatch):
    """When the ring comes round to a slot whose last launch went to another stream, the current stream waits
    for that one (the launch may still run); on the same stream, or while capturing, it does not."""
    from k3compile.ops import arrival_counters as ac

    class FakeStream:
        def __init__(self, name):
            self.name, self.waited_for = name, []

        def wait_stream(self, other):
            self.waited_for.append(other.name)

    streams = {"s1": FakeStream("s1"), "s2": FakeStream("s2")}
    current = ["s1"]
    monkeypatch.setattr(ac, "_current_stream", lambda device: streams[current[0]])
    for name in ("_PARTIALS", "_PARTIALS_NEXT", "_PARTIALS_OWNERS"):
        monkeypatch.setattr(ac, name, {})
    monkeypatch.setattr(ac, "_PARTIALS_OUTGROWN", [])
    cpu = torch.device("cpu")
    for _ in range(ac.PARTIAL_RING + 1):          # one stream all the way round: never waits
        ac.partial_slots(cpu, 10)
    assert streams["s1"].waited_for == []
    current[0] = "s2"
    ac.partial_slots(cpu, 10)                     # slot 1, last taken on s1
    assert streams["s2"].waited_for == ["s1"]
    monkeypatch.setattr(ac, "_capturing", lambda device: True)
    ac.partial_slots(cpu, 10)                     # slot 2 (s1's): a capture cannot wait, and leaves no owner
    assert streams["s2"].waited_for == ["s1"]
    monkeypatch.setattr(ac, "_capturing", lambda device: False)
    for _ in range(ac.PARTIAL_RING - 1):          # slots 3..7 (s1's) then 0 (s1's), 1 (s2's)
        ac.partial_slots(cpu, 10)
    assert streams["s2"].waited_for == ["s1"] * 7
    ac.partial_slots(cpu, 10)                     # slot 2: its capture left no owner
    assert streams["s2"].waited_for == ["s1"] * 7


@pytest.mark.parametrize("config,match", [
    pytest.param(TritonConfig(block_m=2, block_n=32, block_k=32, split_k=1, fma=True), "cannot hold M=3",
                 id="block_m-below-M"),
    pytest.param(TritonConfig(block_m=4, block_n=32, block_k=32, split_k=1), "cannot hold M=3",
                 id="dot-block_m-below-16"),
    pytest.param(TritonConfig(block_m=6, block_n=32, block_k=32, split_k=1, fma=True), "cannot hold M=3",
                 id="block_m-not-pow2"),
])
def test_triton_rejects_configs_that_cannot_hold_m(config, match):
    a, w, _, _ = make_inputs(3, 8, 16, torch.float32, bias=False, residual=False)
    with pytest.raises(ValueError, match=match):
        skinny_gemm_triton(a, w, config=config)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 4, 16, 64], ids=lambda m: f"M{m}")
@pytest.mark.parametrize("n,k", [(2112, 7168), (7168, 2048), (384, 7168), (1000, 1000)],
                         ids=lambda v: str(v))
@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32"])
def test_triton_on_gpu_decode_shapes(m, n, k, dtype):
    dt = DTYPES[dtype]
    a, w, b, r = make_inputs(m, n, k, dt)
    out = torch.full((m, n), float("nan"), dtype=dt, device="cuda")
    skinny_gemm_triton(a, w, b, r, out=out)                      # heuristic config, split-K on
    assert rel_err(out, skinny_gemm_reference(a, w, b, r)) < TOL[dt]


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 4, 16], ids=lambda m: f"M{m}")
@pytest.mark.parametrize("static", [False, True], ids=["dynamic-w", "static-w"])
def test_triton_fp32_output_on_gpu_router_shape(m, static):
    """K3's router, ``linear(x.float(), w.float())`` with w [896, 7168] bf16, at the configuration the op's dispatch
    picks on this GPU: fp32 out, NaN-poisoned first."""
    from k3compile.ops.skinny_gemm import dispatch

    a, w, _, _ = make_inputs(m, 896, 7168, torch.bfloat16, bias=False, residual=False)
    cfg = dispatch.triton_config_for(torch.bfloat16, m, 896, 7168, dispatch.gpu_of(a.device))
    out = torch.full((m, 896), float("nan"), dtype=torch.float32, device="cuda")
    skinny_gemm_triton(a, w, config=cfg, out=out, static_weight=static, out_dtype=torch.float32)
    assert rel_err(out, torch.nn.functional.linear(a.float(), w.float())) < TOL[torch.float32]


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 4], ids=lambda m: f"M{m}")
@pytest.mark.parametrize("config", [
    pytest.param(dict(block_n=64, block_k=128, split_k=7, one_launch=True), id="dot-1launch"),
    pytest.param(dict(block_n=64, block_k=128, split_k=7, one_launch=True, tma=True, num_stages=4),
                 id="dot-1launch-tma"),
    pytest.param(dict(block_n=64, block_k=128, split_k=7, one_launch=True, tma=True, pdl=True),
                 id="dot-1launch-tma-pdl"),
    pytest.param(dict(block_n=32, block_k=128, split_k=4, one_launch=True, tma=True, pdl=True, prefetch_lines=0,
                      preload=2, static=True), id="dot-1launch-tma-pdl-static"),
    pytest.param(dict(block_n=32, block_k=128, split_k=4, one_launch=True, pdl=True, prefetch_lines=0,
                      preload=4, early_trigger=True, static=True), id="dot-1launch-pdl-early-static"),
    pytest.param(dict(block_n=32, block_k=128, split_k=1, one_launch=True, tma=True, pdl=True, prefetch_lines=0,
                      early_trigger=True, num_stages=5, num_warps=2), id="dot-tma-pdl-early-st5-w2"),
    pytest.param(dict(block_n=32, block_k=128, split_k=2, one_launch=True, tma=True, pdl=True, prefetch_lines=0,
                      early_trigger=True, num_stages=4, num_warps=2), id="dot-1launch-tma-pdl-early-st4-w2"),
    pytest.param(dict(block_n=32, block_k=128, split_k=4, one_launch=True, fma=True, num_stages=4), id="fma-1launch"),
    pytest.param(dict(block_n=32, block_k=128, split_k=4, one_launch=True, fma=True, tma=True, num_stages=4),
                 id="fma-1launch-tma"),
    pytest.param(dict(block_n=8, block_k=256, split_k=1, fma=True, tma=True, a_tma=True, pdl=True, prefetch_lines=0,
                      early_trigger=True, num_stages=4), id="fma-n8-tma-atma-pdl-early"),
    pytest.param(dict(block_n=32, block_k=128, split_k=3, one_launch=True, tma=True, a_tma=True, num_warps=2,
                      num_stages=4), id="dot-1launch-tma-atma"),
    pytest.param(dict(block_n=32, block_k=128, split_k=3, one_launch=True, poll=True, tma=True, pdl=True,
                      prefetch_lines=0, early_trigger=True, num_stages=4, num_warps=2), id="dot-poll-tma-pdl-early"),
    pytest.param(dict(block_n=32, block_k=128, split_k=7, one_launch=True, poll=True), id="dot-poll-s7"),
    pytest.param(dict(block_n=32, block_k=128, split_k=4, one_launch=True, poll=True, fma=True, num_stages=4),
                 id="fma-poll"),
])
def test_triton_kernel_variants_on_gpu_in_a_cuda_graph(m, config):
    """Every kernel variant at a decode shape, eagerly and replayed twice from one CUDA graph (the
    one-launch counters must rearm between products and between replays)."""
    config = dict(config)
    static = config.pop("static", False)
    block_m = (1 << (m - 1).bit_length()) if config.get("fma") else 16
    cfg = TritonConfig(block_m=block_m, **config)
    a, w, b, r = make_inputs(m, 2112, 7168, torch.bfloat16)
    ref = skinny_gemm_reference(a, w, b, r)
    assert rel_err(run_triton(a, w, b, r, cfg, static), ref) < TOL[torch.bfloat16]
    outs = [torch.full((m, 2112), float("nan"), dtype=torch.bfloat16, device="cuda") for _ in range(2)]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for out in outs:
            skinny_gemm_triton(a, w, b, r, config=cfg, out=out, static_weight=static)
    for _ in range(2):
        for out in outs:
            out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        for out in outs:
            assert rel_err(out, ref) < TOL[torch.bfloat16]


@pytest.mark.gpu
def test_polled_and_counted_split_k_on_many_streams_at_once():
    """Four streams launch split-K products (polled partials and arrival counters) with no synchronisation
    between them, many more than either ring holds: launches that overlap must never share a slot."""
    a, w, b, r = make_inputs(16, 2112, 7168, torch.bfloat16)
    ref = skinny_gemm_reference(a, w, b, r)
    configs = [TritonConfig(block_m=16, block_n=32, block_k=128, split_k=split_k, one_launch=True, poll=poll)
               for split_k, poll in ((3, True), (7, True), (4, False))]
    streams = [torch.cuda.Stream() for _ in range(4)]
    outs = [[torch.full((16, 2112), float("nan"), dtype=torch.bfloat16, device="cuda") for _ in range(24)]
            for _ in streams]
    torch.cuda.synchronize()
    for i in range(24):
        for stream, stream_outs in zip(streams, outs):
            with torch.cuda.stream(stream):
                skinny_gemm_triton(a, w, b, r, config=configs[i % 3], out=stream_outs[i])
    torch.cuda.synchronize()
    errs = [rel_err(out, ref) for stream_outs in outs for out in stream_outs]
    assert max(errs) < TOL[torch.bfloat16], errs


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 2, 5], ids=lambda m: f"M{m}")
@pytest.mark.parametrize("flavour", [
    pytest.param(dict(), id="default"),
    pytest.param(dict(static=True), id="default-static"),
    pytest.param(dict(pdl=True, prefetch_lines=0, preload=2, early_trigger=False, static=True), id="pdl-static"),
    pytest.param(dict(pdl=True, prefetch_lines=0, preload=4, early_trigger=True, static=True, tma=False),
                 id="pdl-static-early-plain"),
    pytest.param(dict(num_warps=4, num_stages=None), id="default-w4-std"),
    pytest.param(dict(a_tma=True), id="default-a-tma"),
])
def test_triton_dependent_chain_in_a_cuda_graph(m, flavour):
    """Each product reads the previous one's output as a and the one before as residual, back to back in
    one CUDA graph: a PDL launch that read a, residual or the counters before the previous kernel
    finished would read NaN (every output is poisoned before each replay) or a stale value."""
    from dataclasses import replace

    from k3compile.backends import sm_count

    flavour = dict(flavour)
    static = flavour.pop("static", False)
    dims = [3584, 7168, 3584, 7168, 3584]
    g = torch.Generator().manual_seed(m)
    ws = [(torch.randn(dims[i + 1], dims[i], generator=g) / dims[i] ** 0.5).to("cuda", torch.bfloat16)
          for i in range(len(dims) - 1)]
    x = torch.randn(m, dims[0], generator=g).to("cuda", torch.bfloat16)
    outs = [torch.full((m, d), float("nan"), dtype=torch.bfloat16, device="cuda") for d in dims[1:]]

    def chain():
        ins = [x] + outs
        for i, w in enumerate(ws):
            cfg = replace(heuristic(m, *w.shape, sm_count(x.device)), **flavour)
            skinny_gemm_triton(ins[i], w, None, ins[i - 1] if i else None, config=cfg, out=outs[i],
                               static_weight=static)

    chain()  # compiles, and makes the arrival counters outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        chain()
    for _ in range(2):
        for out in outs:
            out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ins = [x] + outs
        for i, w in enumerate(ws):
            ref = skinny_gemm_reference(ins[i], w, None, ins[i - 1] if i else None)
            assert rel_err(outs[i], ref) < TOL[torch.bfloat16], (i, rel_err(outs[i], ref))


_PTX_SCRIPT = """
import json, sys, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from k3compile.ops.skinny_gemm.triton import _skinny_gemm_kernel as kernel

out = {}
for name, flavour in json.loads(sys.argv[1]).items():
    fp32_ptrs = flavour.pop("FP32_PTRS", [])   # pointers of fp32 tensors (out_dtype=float32), else bf16
    const = dict(HAS_BIAS=True, HAS_RES=True, SPLIT=True, ONE_LAUNCH=True, FMA=False, LOOP_STAGES=None,
                 PRECISION=None, UPCAST=False, BLOCK_M=16, BLOCK_N=32, BLOCK_K=128, TMA=False, PDL=True,
                 PREFETCH_LINES=0, PRE_K=0, EARLY_TRIGGER=False, A_TMA=False, POLL=False, PTX=True, stride_ak=1,
                 stride_wk=1, stride_rn=1, stride_on=1)
    const.update(flavour)
    tile = lambda rows: f"tensordesc<bf16[{rows},{const['BLOCK_K']}]>"  # noqa: E731
    sig = {n: "constexpr" if n in const else "*fp32" if n == "ws_ptr" or n in fp32_ptrs else "*i32" if n == "cnt_ptr"
           else tile(const["BLOCK_N"]) if n == "w_desc" and const["TMA"]
           else tile(const["BLOCK_M"]) if n == "a_desc" and const["A_TMA"] else "*bf16" if n.endswith(("_ptr", "_desc"))
           else "i32" for n in kernel.arg_names}
    aligned = ["a_ptr", "w_ptr", "bias_ptr", "res_ptr", "out_ptr", "ws_ptr", "cnt_ptr", "N", "K", "K_PER_SPLIT",
               "stride_am", "stride_wn", "stride_rm", "stride_om"]
    attrs = {(kernel.arg_names.index(k),): [["tt.divisibility", 16]] for k in aligned}
    src = ASTSource(fn=kernel, signature=sig, constexprs=const, attrs=attrs)
    out[name] = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4)).asm["ptx"]
print(json.dumps(out))
"""
PDL_FLAVOURS = {
    "static-preload": dict(PRE_K=256),
    "static-early-trigger": dict(PRE_K=128, EARLY_TRIGGER=True, PREFETCH_LINES=4),
    "prefetch-only": dict(PREFETCH_LINES=8),
    # one program per tile: bias and residual are read before the K loop, still after the wait
    "unsplit-static-early-trigger": dict(SPLIT=False, ONE_LAUNCH=False, PRE_K=128, EARLY_TRIGGER=True),
    # FMA_ROW: one row, CUDA-core products, a and w by TMA (cp.async.bulk), none of it before the wait
    "fma-row-tma-early-trigger": dict(SPLIT=False, ONE_LAUNCH=False, FMA=True, LOOP_STAGES=4, BLOCK_M=1, BLOCK_N=8,
                                      BLOCK_K=256, TMA=True, A_TMA=True, EARLY_TRIGGER=True),
    # the split-K default (POLLED_TAIL): partial slots published and polled only after the wait, the next
    # weight's lines prefetched before it
    "poll-tma-prefetch": dict(POLL=True, TMA=True, PREFETCH_LINES=2, HAS_BIAS=False, HAS_RES=False),
}


def test_fp32_output_kernel_compiles_for_sm90_and_never_rounds_to_bf16():
    """out_dtype=float32 (out and residual fp32, bf16 a and w): Triton's NVIDIA backend builds it for sm_90 without
    a GPU, and no bf16 conversion is left in the kernel (the output is stored as the fp32 accumulator)."""
    from k3compile.testing import ptx_in_a_fresh_process

    flavours = {"fp32-out": dict(FP32_PTRS=["out_ptr", "res_ptr"], PRE_K=128),
                "bf16-out": dict(PRE_K=128)}
    ptx = ptx_in_a_fresh_process(_PTX_SCRIPT, flavours)
    assert "cvt.rn.bf16" in ptx["bf16-out"]
    assert "cvt.rn.bf16" not in ptx["fp32-out"] and "st.global" in ptx["fp32-out"]


@pytest.fixture(scope="module")
def sm90_ptx():
    """PTX of the PDL kernel flavours compiled for sm_90 (Triton's NVIDIA backend needs no GPU), in a
    process without TRITON_INTERPRET (under it the kernel is not compiled at all)."""
    from k3compile.testing import ptx_in_a_fresh_process

    pytest.importorskip("triton.backends.nvidia")
    return ptx_in_a_fresh_process(_PTX_SCRIPT, PDL_FLAVOURS)


@pytest.mark.parametrize("flavour", sorted(PDL_FLAVOURS))
def test_pdl_kernel_reads_only_the_weight_before_its_wait_and_triggers_after_it(sm90_ptx, flavour):
    """The static-weight proof (k3compile.static_weights) needs every PDL kernel to trigger only after its own
    griddepcontrol.wait, and nothing but the weight may be read before it: checked in the sm_90 PTX."""
    ptx = sm90_ptx[flavour].splitlines()
    wait = [i for i, line in enumerate(ptx) if "griddepcontrol.wait" in line]
    trigger = [i for i, line in enumerate(ptx) if "griddepcontrol.launch_dependents" in line]
    assert len(wait) == 1 and len(trigger) == 1 and trigger[0] > wait[0]
    before = ptx[:wait[0]]
    loads = [line for line in before if "ld.global" in line]
    # the weight tile: [32, PRE_K] bf16 over 128 threads in 16-byte loads, all with the weight's evict-first hint
    assert len(loads) == 32 * PDL_FLAVOURS[flavour].get("PRE_K", 0) * 2 // (128 * 16)
    assert all("evict_first" in line for line in loads)
    assert not any(op in line for line in before for op in ("st.global", "atom.", "red.", "cp.async", "ld.shared"))


def test_triton_handles_strided_and_misaligned_operands():
    base = torch.randn(8, 2 * 67 + 1, device=DEVICE)
    a = base[:, 1:68]                                   # row stride 135, offset 1 element: misaligned
    w = torch.randn(67, 45, device=DEVICE).T            # [45, 67], column-major
    r = torch.randn(45, 8, device=DEVICE).T             # [8, 45], transposed
    out = run_triton(a, w, None, r)
    assert rel_err(out, skinny_gemm_reference(a, w, None, r)) < TOL[torch.float32]


def test_triton_rejects_what_it_cannot_do():
    a, w, _, _ = make_inputs(4, 8, 16, torch.float64, bias=False, residual=False)
    assert "dtype" in supports(a, w)
    assert "M=65" in supports(torch.randn(65, 16), torch.randn(8, 16))
    a16, w16 = a.to(torch.bfloat16), w.to(torch.bfloat16)
    assert "output dtype" in supports(a16.float(), w16.float(), out_dtype=torch.bfloat16)   # a fp32 -> 16-bit output
    assert "residual" in supports(a16, w16, None, torch.zeros(4, 8, dtype=torch.bfloat16), torch.float32)
    with pytest.raises(ValueError, match="dtype"):
        skinny_gemm_triton(a, w)
    with pytest.raises(ValueError, match="do not agree"):
        skinny_gemm_triton(torch.randn(4, 16), torch.randn(8, 15))
