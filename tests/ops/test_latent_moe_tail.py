"""k3::latent_moe_tail: the one-kernel Triton tail, the split path and the op's dispatch, against the fp32 reference.

On CPU the Triton kernels run under TRITON_INTERPRET=1 (set by conftest). The interpreter (triton 3.7)
truncates fp32 -> bf16 where a GPU rounds to nearest, so bf16 errors here are about twice the GPU's; the
tolerances cover both. The CuTe implementation is wired in through a fake module here (CI has no cutlass);
its kernel is tested in test_latent_moe_tail_cute.py.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from k3compile.ops import arrival_counters
from k3compile.backends import BackendUnavailableError
from k3compile.ops.latent_moe_tail import LATENT_MOE_TAIL, latent_moe_tail, streamk, triton_config
from k3compile.ops.latent_moe_tail.reference import kimi_rms_norm, latent_moe_tail_ref, latent_moe_tail_unfused
from k3compile.ops.latent_moe_tail.triton import latent_moe_tail_triton
from k3compile.ops.latent_moe_tail.triton_config import TailConfig
from k3compile.testing import latent_moe_tail_inputs as make_inputs, rel_err

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
TOL = {torch.float32: 1e-5, torch.bfloat16: 3e-2, torch.float16: 5e-3, torch.float64: 1e-12}


def truth(latent, shared, norm_weight, up_weight, eps):
    """fp32 ground truth, not rounded to the input dtype (the comparison should not see that rounding twice)."""
    return latent_moe_tail_ref(latent.float(), shared.float(), norm_weight.float(), up_weight.float(), eps)


def counters_all_zero() -> bool:
    return arrival_counters.all_zero()


# ---------------------------------------------------------------------------------------------
# the one-kernel tail

# interpreted kernels: a third of the profile's draws (each test's examples hold K3's widths)
@settings(max_examples=max(8, settings.default.max_examples // 3))
@given(m=st.integers(1, 16), l=st.integers(1, 300), d=st.integers(1, 160),
       dtype=st.sampled_from(list(DTYPES)), eps=st.sampled_from([1e-6, 1e-5, 1e-2]),
       block_n=st.sampled_from([16, 32, 64]), block_k=st.sampled_from([16, 64, 128]),
       split_k=st.sampled_from([1, 2, 3, 5]), reduce=st.sampled_from(["last", "kernel"]),
       swap_ab=st.booleans(), prenorm=st.booleans(), tma=st.booleans(), pdl=st.booleans(),
       early=st.booleans(), static=st.booleans(), seed=st.integers(0, 2**16))
@example(m=1, l=3584, d=64, dtype="bf16", eps=1e-5, block_n=64, block_k=128, split_k=4, reduce="last",
         swap_ab=False, prenorm=False, tma=False, pdl=False, early=False, static=False, seed=0)
@example(m=16, l=3584, d=64, dtype="bf16", eps=1e-5, block_n=64, block_k=128, split_k=4, reduce="kernel",
         swap_ab=True, prenorm=False, tma=False, pdl=False, early=False, static=False, seed=1)
@example(m=3, l=257, d=33, dtype="fp16", eps=1e-5, block_n=16, block_k=64, split_k=3, reduce="last",
         swap_ab=False, prenorm=True, tma=False, pdl=False, early=False, static=False, seed=2)
@example(m=16, l=3584, d=64, dtype="bf16", eps=1e-5, block_n=32, block_k=128, split_k=2, reduce="last",
         swap_ab=False, prenorm=False, tma=True, pdl=True, early=True, static=True, seed=3)   # M=16's TMA + PDL form
@example(m=5, l=200, d=40, dtype="fp32", eps=1e-5, block_n=32, block_k=64, split_k=5, reduce="last",
         swap_ab=True, prenorm=False, tma=True, pdl=True, early=False, static=True, seed=4)   # one K tile per split
@example(m=3, l=264, d=40, dtype="bf16", eps=1e-5, block_n=32, block_k=128, split_k=1, reduce="last",
         swap_ab=False, prenorm=False, tma=True, pdl=True, early=True, static=False, seed=5)   # TMA past M, L, D
@example(m=7, l=256, d=48, dtype="fp16", eps=1e-5, block_n=16, block_k=64, split_k=2, reduce="kernel",
         swap_ab=False, prenorm=True, tma=True, pdl=False, early=False, static=False, seed=6)   # TMA latent, prenorm
def test_triton_matches_reference(m, l, d, dtype, eps, block_n, block_k, split_k, reduce, swap_ab, prenorm, tma, pdl,
                                  early, static, seed):
    """The split-K grid form; ``tma`` (the interpreter reads the descriptor too), ``pdl`` + ``static`` (the
    first weight tile peeled off and loaded before the wait: the interpreter has no PDL, only the order
    changes) and ``early`` (the trigger's place: a no-op off the GPU)."""
    dt = DTYPES[dtype]
    args = make_inputs(m, l, d, dt, seed)
    cfg = TailConfig(block_n=block_n, block_k=block_k, split_k=split_k, reduce=reduce, swap_ab=swap_ab,
                     prenorm=prenorm, tma=tma, pdl=pdl, early_trigger=early, preload=static)
    out = torch.full((m, d), float("nan"), dtype=dt)
    latent_moe_tail_triton(*args, eps, cfg, out=out, static_weight=static)
    assert rel_err(out, truth(*args, eps)) < TOL[dt], f"M{m}-L{l}-D{d}-{dtype}-eps{eps}-{cfg.tag()}-static{static}"
    assert counters_all_zero(), "an arrival counter was left non-zero"


@settings(max_examples=max(8, settings.default.max_examples // 3))
@given(m=st.integers(1, 16), l=st.integers(1, 300), d=st.integers(1, 160),
       dtype=st.sampled_from(list(DTYPES)), eps=st.sampled_from([1e-6, 1e-5, 1e-2]),
       block_n=st.sampled_from([16, 32, 64]), block_k=st.sampled_from([16, 64, 128]),
       programs=st.integers(1, 9), prenorm=st.booleans(), tma=st.booleans(), static=st.booleans(),
       reduce=st.sampled_from(["last", "kernel"]), seed=st.integers(0, 2**16))
@example(m=4, l=3584, d=64, dtype="bf16", eps=1e-5, block_n=16, block_k=128, programs=13, prenorm=False,
         tma=True, static=False, reduce="kernel", seed=0)
@example(m=16, l=300, d=100, dtype="fp16", eps=1e-5, block_n=32, block_k=64, programs=7, prenorm=True,
         tma=False, static=True, reduce="last", seed=1)
@example(m=2, l=37, d=20, dtype="bf16", eps=1e-5, block_n=16, block_k=16, programs=3, prenorm=False,
         tma=True, static=False, reduce="last", seed=2)   # rows of 74 bytes: no TMA descriptor, pointer loads
@example(m=8, l=256, d=48, dtype="bf16", eps=1e-5, block_n=16, block_k=64, programs=12, prenorm=False,
         tma=True, static=True, reduce="last", seed=3)   # one unit per program: the unit before the wait is all
def test_stream_k_matches_reference(m, l, d, dtype, eps, block_n, block_k, programs, prenorm, tma, static,
                                    reduce, seed):
    """Persistent programs, each a run of (tile, K block) units crossing tile borders anywhere (on CPU
    ``ctas_per_sm`` is the program count); the weight through pointers or a TMA descriptor; each tile
    reduced by its last program (one launch, counters back at 0) or by a second kernel; with
    ``static_weight`` each program's first weight tile is loaded ahead of the rest (before the PDL wait on
    a GPU; the interpreter has no PDL, so ``pdl`` only changes the tag here)."""
    dt = DTYPES[dtype]
    args = make_inputs(m, l, d, dt, seed)
    cfg = TailConfig(block_n=block_n, block_k=block_k, stream_k=True, ctas_per_sm=programs, prenorm=prenorm,
                     tma=tma, pdl=static, reduce=reduce)
    out = torch.full((m, d), float("nan"), dtype=dt)
    latent_moe_tail_triton(*args, eps, cfg, out=out, static_weight=static)
    assert rel_err(out, truth(*args, eps)) < TOL[dt], f"M{m}-L{l}-D{d}-{dtype}-eps{eps}-{cfg.tag()}-static{static}"
    assert counters_all_zero(), "an arrival counter was left non-zero"


@given(n_tiles=st.integers(1, 120), k_blocks=st.integers(1, 60), programs=st.integers(1, 600))
@example(n_tiles=56, k_blocks=28, programs=132)   # K3's tail at 128x128 tiles on an H200
def test_stream_k_plan_covers_every_unit_once(n_tiles, k_blocks, programs):
    units, p, max_seg = streamk.plan(n_tiles, k_blocks, programs)
    owner = [((u + 1) * p - 1) // units for u in range(units)]
    ranges = [(i * units // p, (i + 1) * units // p) for i in range(p)]
    assert all(lo < hi for lo, hi in ranges) and ranges[-1][1] == units
    assert all(ranges[owner[u]][0] <= u < ranges[owner[u]][1] for u in range(units))
    for t in range(n_tiles):
        first, last = owner[t * k_blocks], owner[t * k_blocks + k_blocks - 1]
        assert last - first + 1 <= max_seg


@pytest.mark.parametrize("reduce", ["last", "kernel"])
def test_split_k_repeated_calls_identical_and_counters_reset(reduce, monkeypatch):
    """Every launch leaves its arrival counters at 0 (CUDA-graph replays depend on it), across more calls
    than the counter ring has slots; the same inputs give the same bits every time."""
    # a fresh ring of 4 slots, each taken again as the 64 are on a GPU: 6 interpreted launches, not 66
    monkeypatch.setattr(arrival_counters, "RING", 4)
    for name in ("_BUFFERS", "_NEXT_SLOT", "_OWNERS"):
        monkeypatch.setattr(arrival_counters, name, {})
    args = make_inputs(3, 64, 20, torch.bfloat16, seed=5)
    cfg = TailConfig(block_n=16, block_k=16, split_k=4, reduce=reduce)
    first = latent_moe_tail_triton(*args, 1e-5, cfg)
    for _ in range(arrival_counters.RING + 2 if reduce == "last" else 3):
        out = torch.full_like(first, float("nan"))
        latent_moe_tail_triton(*args, 1e-5, cfg, out=out)
        assert torch.equal(out, first)
        assert counters_all_zero()
    assert rel_err(first, truth(*args, 1e-5)) < TOL[torch.bfloat16]


def test_no_counters_during_capture_falls_back_to_reduce_kernel(monkeypatch):
    """A first launch inside a CUDA-graph capture gets no counters (they would belong to the graph) and
    reduces with the second kernel instead: same result."""
    args = make_inputs(4, 200, 50, torch.float32, seed=3)
    cfg = TailConfig(block_n=16, block_k=32, split_k=3, reduce="last")
    monkeypatch.setattr(arrival_counters, "_BUFFERS", {})
    monkeypatch.setattr(arrival_counters, "_capturing", lambda device: True)
    assert arrival_counters.arrival_counters(torch.device("cpu"), 8) is None
    out = torch.full((4, 50), float("nan"))
    latent_moe_tail_triton(*args, 1e-5, cfg, out=out)
    assert rel_err(out, truth(*args, 1e-5)) < TOL[torch.float32]
    assert arrival_counters._BUFFERS == {}


def test_fp16_large_latent_prenorm():
    """Unnormalised x·g would overflow fp16 in the factored form; the fp16 default normalises first."""
    args = make_inputs(2, 128, 32, torch.float16, scale=3000.0)
    out = latent_moe_tail(*args, 1e-5)
    assert rel_err(out, truth(*args, 1e-5)) < TOL[torch.float16]
    assert triton_config.heuristic(2, 32, 128, torch.float16, 132).prenorm


def test_bad_config_and_too_many_rows():
    with pytest.raises(ValueError, match="reduce"):
        TailConfig(reduce="atomic")
    with pytest.raises(ValueError, match="M=17"):
        latent_moe_tail_triton(*make_inputs(17, 32, 16, torch.float32), 1e-5)


@pytest.mark.parametrize("layout", ["latent-of-concat", "latent-T", "weight-T"])
def test_grid_tma_layouts(layout):
    """The grid form with every tile by TMA (M=16's default on the H200) on the layouts the op sees: the
    latent as the left part of the TP concatenation buffer (rows of L + D; TMA reads it in place), and
    layouts TMA cannot read (pointer loads instead)."""
    m, l, d = 16, 256, 96
    latent, shared, norm_weight, up_weight = make_inputs(m, l, d, torch.bfloat16, seed=9)
    if layout == "latent-of-concat":
        latent = torch.cat([latent, shared], dim=1).split([l, d], dim=1)[0]
    elif layout == "latent-T":
        latent = latent.t().contiguous().t()
    else:
        up_weight = up_weight.t().contiguous().t()
    cfg = TailConfig(block_n=32, block_k=128, split_k=1, num_warps=2, num_stages=5, tma=True, pdl=True,
                     early_trigger=True)
    out = torch.full((m, d), float("nan"), dtype=torch.bfloat16)
    latent_moe_tail_triton(latent, shared, norm_weight, up_weight, 1e-5, cfg, out=out)
    assert rel_err(out, truth(latent, shared, norm_weight, up_weight, 1e-5)) < TOL[torch.bfloat16], layout


@pytest.mark.parametrize("dtype", list(DTYPES), ids=list(DTYPES))
@pytest.mark.parametrize("layout", ["latent-T", "weight-T", "shared-strided"])
def test_triton_non_contiguous(layout, dtype, tail_records):
    dt = DTYPES[dtype]
    latent, shared, norm_weight, up_weight = make_inputs(4, 96, 48, dt)
    if layout == "latent-T":
        latent = latent.t().contiguous().t()
    elif layout == "weight-T":
        up_weight = up_weight.t().contiguous().t()
    else:
        shared = torch.cat([shared, shared], dim=1)[:, ::2]
    out = latent_moe_tail(latent, shared, norm_weight, up_weight, 1e-5)
    assert rel_err(out, truth(latent, shared, norm_weight, up_weight, 1e-5)) < TOL[dt]
    assert "strides" in tail_records()[0].key   # the key tells a CuTe-incompatible layout apart


@given(m=st.integers(17, 48), l=st.integers(1, 200), d=st.integers(1, 120),
       dtype=st.sampled_from(list(DTYPES)), eps=st.sampled_from([1e-6, 1e-5]), seed=st.integers(0, 2**16))
def test_unfused_above_small_m_matches_reference(m, l, d, dtype, eps, seed):
    dt = DTYPES[dtype]
    args = make_inputs(m, l, d, dt, seed)
    out = latent_moe_tail(*args, eps)
    assert rel_err(out, truth(*args, eps)) < TOL[dt]


@pytest.mark.parametrize("dtype", list(DTYPES), ids=list(DTYPES))
def test_unfused_equals_model_sequence(dtype):
    """The reference implementation is the model's own sequence, with the add moved into addmm."""
    dt = DTYPES[dtype]
    latent, shared, norm_weight, up_weight = make_inputs(5, 72, 40, dt)
    model = torch.nn.functional.linear(kimi_rms_norm(latent, norm_weight, 1e-5), up_weight) + shared
    assert rel_err(latent_moe_tail_unfused(latent, shared, norm_weight, up_weight, 1e-5), model) < TOL[dt]


@pytest.mark.parametrize("m,limit,impl", [(1, 16, "triton"), (16, 16, "triton"), (17, 16, "reference"),
                                          (8, 4, "reference"), (4, 4, "triton"), (8, 64, "triton")],
                         ids=["M1-lim16", "M16-lim16", "M17-lim16", "M8-lim4", "M4-lim4", "M8-lim64"])
def test_dispatch_by_m(m, limit, impl, tail_records):
    args = make_inputs(m, 40, 24, torch.float32)
    out = latent_moe_tail(*args, 1e-5, small_m_limit=limit)
    assert rel_err(out, truth(*args, 1e-5)) < TOL[torch.float32]
    main = tail_records()[0]
    assert main.impl == impl, main
    if impl == "reference":
        assert "small-M limit" in main.reason


def test_dtype_the_kernel_lacks_falls_back_recorded(tail_records):
    args = make_inputs(3, 40, 24, torch.float64)
    out = latent_moe_tail(*args, 1e-5, backend="triton")
    assert rel_err(out, truth(*args, 1e-5)) < 1e-6
    (choice,) = tail_records("triton")
    assert choice.impl == "reference" and "float64" in choice.reason, choice


def test_forced_triton_without_interpreter_raises(monkeypatch, tail_records):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(BackendUnavailableError, match="latent_moe_tail"):
        latent_moe_tail(*make_inputs(2, 40, 24, torch.float32), 1e-5, backend="triton")
    LATENT_MOE_TAIL.clear()
    out = latent_moe_tail(*make_inputs(2, 40, 24, torch.float32), 1e-5, backend="auto")
    assert tail_records()[0].impl == "reference" and not out.isnan().any()


def _bad(case):
    latent, shared, norm_weight, up_weight = make_inputs(2, 40, 24, torch.float32)
    if case == "norm-weight-width":
        norm_weight = norm_weight[:39]
    elif case == "up-weight-width":
        up_weight = up_weight[:, :39]
    elif case == "shared-width":
        shared = shared[:, :23]
    elif case == "shared-rows":
        shared = shared[:1]
    elif case == "mixed-dtype":
        norm_weight = norm_weight.bfloat16()
    elif case == "int-dtype":
        latent, shared, norm_weight, up_weight = (t.to(torch.int32) for t in (latent, shared, norm_weight, up_weight))
    elif case == "latent-3d":
        latent = latent[None]
    return latent, shared, norm_weight, up_weight


BAD_CASES = ["norm-weight-width", "up-weight-width", "shared-width", "shared-rows", "mixed-dtype", "int-dtype",
             "latent-3d"]


@pytest.mark.parametrize("case", BAD_CASES)
def test_bad_input_clear_error(case):
    with pytest.raises(ValueError):
        latent_moe_tail(*_bad(case), 1e-5)


@pytest.mark.parametrize("case", ["norm-weight-width", "shared-width", "mixed-dtype"])
def test_bad_input_clear_error_in_fake(case):
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        fake = [mode.from_tensor(t) for t in _bad(case)]
        with pytest.raises(ValueError):
            torch.ops.k3.latent_moe_tail(*fake, 1e-5)


def test_empty_rows():
    args = make_inputs(0, 40, 24, torch.float32)
    assert latent_moe_tail(*args, 1e-5).shape == (0, 24)


def test_opcheck():
    args = make_inputs(3, 40, 24, torch.float32)
    torch.library.opcheck(torch.ops.k3.latent_moe_tail.default, (*args, 1e-5, "auto", 16),
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_static"))


# ---------------------------------------------------------------------------------------------
# the op (dispatch records: test_latent_moe_tail_dispatch.py)




# ---------------------------------------------------------------------------------------------
# GPU

GPU_TOL = {torch.float32: 1e-4, torch.bfloat16: 1e-2, torch.float16: 2e-3}


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", list(DTYPES), ids=list(DTYPES))
@pytest.mark.parametrize("m", [1, 2, 4, 8, 16, 17], ids=lambda m: f"M{m}-L3584-D7168")
def test_cuda_real_widths(m, dtype, tail_records):
    """The one-kernel tail (default config, both reductions) and the op at K3's widths."""
    dt = DTYPES[dtype]
    args = [t.cuda() for t in make_inputs(m, 3584, 7168, dt, seed=m)]
    ref = truth(*(t.cpu() for t in args), 1e-5)
    if m <= 16:
        pre = dt == torch.float16
        stages = 2 if dt == torch.float32 else 4   # fp32 tiles are twice the bytes
        for cfg in (None, TailConfig(reduce="kernel", prenorm=pre), TailConfig(split_k=1, prenorm=pre),
                    TailConfig(block_n=128, block_k=128, num_warps=8, num_stages=stages, stream_k=True, reduce="kernel",
                               prenorm=pre),
                    TailConfig(block_n=64, block_k=128, num_warps=4, num_stages=stages, stream_k=True, ctas_per_sm=2,
                               tma=True,
                               prenorm=pre)):
            # static: the first weight tile before the PDL wait (stream-K only: the grid form ignores it;
            # bf16 only, the model's dtype: the other dtypes would only add compiles of the same code)
            statics = (False, True) if cfg is not None and cfg.stream_k and dt == torch.bfloat16 else (False,)
            for static in statics:
                out = torch.full((m, 7168), float("nan"), dtype=dt, device="cuda")
                latent_moe_tail_triton(*args, 1e-5, cfg, out=out, static_weight=static)
                assert rel_err(out.cpu(), ref) < GPU_TOL[dt], (cfg, static)
                assert counters_all_zero()
    out = latent_moe_tail(*args, 1e-5)
    assert rel_err(out.cpu(), ref) < GPU_TOL[dt]
    main = tail_records()[0]
    assert main.impl == ("reference" if m > 16 else "cute" if main.impl == "cute" else "triton"), main


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["last", "kernel", "stream-k-tma", "stream-k-pdl", "stream-k-pdl-static",
                                  "stream-k-2launch-pdl-static", "grid-tma-pdl-early", "grid-tma-pdl-static",
                                  "grid-tma-pdl-ring-static", "grid-tma-pdl-unsplit-ring-static"])
def test_cuda_graph_replay(kind):
    """Captured once, replayed on fresh inputs: every replay right (the counters reset themselves; with PDL
    two captured calls back to back, so the second's early start overlaps the first's reduction)."""
    m, l, d, dt = 4, 3584, 7168, torch.bfloat16
    lat, sh, g, w = (t.cuda() for t in make_inputs(m, l, d, dt, seed=11))
    if "stream-k" in kind:
        cfg = TailConfig(block_n=128, block_k=128, num_warps=8, stream_k=True, tma=True, pdl="pdl" in kind,
                         reduce="kernel" if "2launch" in kind else "last")
    elif kind.startswith("grid"):   # the split-K grid with TMA and PDL: early trigger, the peeled first tile, or
        # the wait inside the K loop (the weight ring's first tiles before it)
        # (unsplit: the program's own epilogue, `shared` read after the loop's wait with the ring, else before it)
        ring = "ring" in kind
        cfg = TailConfig(block_n=32, block_k=128, split_k=1 if "unsplit" in kind else 2, tma=True, pdl=True,
                         early_trigger="early" in kind or ring, preload="static" in kind and not ring, ring=ring)
    else:
        cfg = TailConfig(reduce=kind)
    static = kind.endswith("static")
    out = torch.empty(m, d, dtype=dt, device="cuda")
    latent_moe_tail_triton(lat, sh, g, w, 1e-5, cfg, out=out, static_weight=static)   # compiles, makes counters
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        latent_moe_tail_triton(lat, sh, g, w, 1e-5, cfg, out=out, static_weight=static)
        latent_moe_tail_triton(lat, sh, g, w, 1e-5, cfg, out=out, static_weight=static)
    for seed in range(3):
        lat2, sh2, _, _ = make_inputs(m, l, d, dt, seed=20 + seed)
        lat.copy_(lat2)
        sh.copy_(sh2)
        out.fill_(float("nan"))
        graph.replay()
        assert rel_err(out.cpu(), truth(lat.cpu(), sh.cpu(), g.cpu(), w.cpu(), 1e-5)) < GPU_TOL[dt]
    torch.cuda.synchronize()
    assert counters_all_zero()



_TAIL_PTX_SCRIPT = """
import json, sys, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from k3compile.ops.latent_moe_tail.triton import _latent_moe_tail_kernel as kernel

out = {}
for name, flavour in json.loads(sys.argv[1]).items():
    const = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=128, SPLIT_K=1, LAST_REDUCES=False, SWAP_AB=False, PRENORM=False,
                 IEEE_DOT=False, UPCAST_DOT=False, TMA=True, PDL=True, EARLY_TRIGGER=True, PRELOAD=False,
                 RING=False, LATENT_TMA=True)
    const.update(flavour)
    desc = dict(w_desc="tensordesc<bf16[32,128]>", x_desc="tensordesc<bf16[16,128]>", g_desc="tensordesc<bf16[1,128]>")
    sig = {n: "constexpr" if n in const else desc.get(n) or ("*fp32" if n in ("p_ws",
                                                                              "p_ss") else "*i32" if n == "p_cnt"
           else "*bf16" if n.startswith("p_") else "fp32" if n == "eps" else "i32") for n in kernel.arg_names}
    src = ASTSource(fn=kernel, signature=sig, constexprs=const)
    out[name] = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=2,
                                                                                   num_stages=5)).asm["ptx"]
print(json.dumps(out))
"""
# the shipped one-kernel form (M 5-16 on the H200) and its split-K neighbour; "preload" (static weight only) may
# read its first weight tile before the wait
TAIL_PDL_FLAVOURS = {"one-kernel-tma": {}, "split2-last": dict(SPLIT_K=2, LAST_REDUCES=True),
                     "pointer-latent": dict(LATENT_TMA=False), "static-preload": dict(PRELOAD=True)}


def test_pdl_tail_reads_nothing_but_a_static_weight_before_its_wait():
    """The kernel starts while the previous one (which wrote the latent) may still run: before its
    griddepcontrol.wait it may read only the weight, and only where the caller proved it static (PRELOAD); it
    lets the next kernel in only after that wait (the static-weight proof relies on it). Checked in sm_90 PTX
    (Triton's NVIDIA backend compiles without a GPU), in a process without TRITON_INTERPRET."""
    from k3compile.testing import ptx_in_a_fresh_process

    pytest.importorskip("triton.backends.nvidia")
    for name, ptx in ptx_in_a_fresh_process(_TAIL_PTX_SCRIPT, TAIL_PDL_FLAVOURS).items():
        lines = ptx.splitlines()
        wait = [i for i, line in enumerate(lines) if "griddepcontrol.wait" in line]
        trigger = [i for i, line in enumerate(lines) if "griddepcontrol.launch_dependents" in line]
        assert len(wait) == 1 and len(trigger) == 1 and trigger[0] > wait[0], name
        global_ops = [line for line in lines[:wait[0]]
                      if any(op in line for op in ("ld.global", "cp.async", "st.global", "atom.global", "red.global"))]
        if name == "static-preload":   # the weight's first [32, 128] tile: one TMA copy
            assert len(global_ops) == 1 and "cp.async.bulk.tensor" in global_ops[0], global_ops
        else:
            assert not global_ops, (name, global_ops)
