"""The CuTe latent-MoE tail (skinny GEMM with the RMSNorm fused) against the reference.

CPU (CI): the module imports without cutlass, its predicates give reasons, and (when CuTe DSL is installed) the
fused variants of both kernels compile for sm_90a. GPU
(`-m gpu` on the H200): random shapes with NaN-poisoned outputs for both kernels' forms, every work division
(incl. split-K clusters), static weight on and off, CUDA-graph capture and replay.
"""
import importlib.util
import os

import pytest
import torch
from hypothesis import example, given, settings, strategies as st

from k3compile.backends import cute_can_run_on
from k3compile.kernels.cute.configs import MmaConfig, WgmmaConfig as WG
from k3compile.ops.latent_moe_tail import cute as tc
from k3compile.ops.latent_moe_tail import dispatch
from k3compile.ops.latent_moe_tail.reference import latent_moe_tail_ref
from k3compile.ops.skinny_gemm import cute as kc
from k3compile.testing import rel_err

HAS_CUTLASS = importlib.util.find_spec("cutlass") is not None
needs_cutlass = pytest.mark.skipif(not HAS_CUTLASS, reason="CuTe DSL (nvidia-cutlass-dsl) not installed")
TOL = 1e-2  # bf16: x·g is rounded before normalising, ~1 ulp from the model's order

# the wgmma form: one block per row tile, a split-K cluster (the rows' sums of squares meet through DSMEM too), the
# producer warp, 64-wide K tiles, the MMA warps alone letting the next kernel launch
WGMMA_FORMS = [WG(block_n=64, block_k=128, stages=6, split_k=1, evict_hints=True),
               WG(block_n=64, block_k=64, stages=8, split_k=2, evict_hints=True),
               WG(block_n=64, block_k=128, stages=4, split_k=4, producer_warp=True, evict_hints=True),
               WG(block_n=128, block_k=64, stages=6, split_k=1, producer_warp=True),
               WG(block_n=64, block_k=128, stages=6, split_k=1, producer_warp=True, evict_hints=True, mma_trigger=True)]


def mma(row_groups, warps_n, warps_k, unroll, **options):
    """An MmaConfig, its block's four dimensions first."""
    return MmaConfig(row_groups=row_groups, warps_n=warps_n, warps_k=warps_k, unroll=unroll, **options)


def op_config(m, d, l, static_weight=False):
    """What the op runs on an H200 (its tables, else the heuristic)."""
    from k3compile.ops.skinny_gemm import dispatch as gemm_dispatch

    return dispatch.cute_config_for(torch.bfloat16, m, d, l, static_weight, dispatch.table_for("NVIDIA H200"),
                                    gemm_dispatch.table_for("NVIDIA H200"))


def _inputs(m, l, d, dtype=torch.bfloat16, device="cpu", scale=1.0):
    latent = (scale * torch.randn(m, l, device=device)).to(dtype)
    shared = torch.randn(m, d, device=device).to(dtype)
    norm_weight = (1 + 0.1 * torch.randn(l, device=device)).to(dtype)
    up_weight = (torch.randn(d, l, device=device) / l ** 0.5).to(dtype)
    return latent, shared, norm_weight, up_weight


# ---------------------------------------------------------------------------------------- CPU tests

def test_module_imports_without_cutlass_at_import_time():
    with open(tc.__file__) as f:
        src = f.read()
    assert "import cutlass" not in src.replace("`import cutlass`", "")


def test_available_says_why_on_cpu_tensors():
    why = cute_can_run_on(*_inputs(2, 64, 32))
    assert isinstance(why, str) and why


@pytest.mark.parametrize("case,why", [
    ("fp16", "bf16 only"),
    ("k_not_multiple_of_8", "multiple of 8"),
    ("m17", "M=17"),
    ("norm_weight_strided", "contiguous"),
    ("norm_weight_wrong_length", "norm_weight must be [L]"),
    ("shared_wrong_shape", "residual must be"),
    ("negative_eps", "eps"),
], ids=["fp16", "K60", "M17", "norm_weight_strided", "norm_weight_L72", "shared_M3", "eps_negative"])
def test_supports_rejects_with_reason(case, why):
    m, l, d, eps = 2, 64, 32, 1e-6
    lat, sh, g, w = _inputs(m, l, d)
    if case == "fp16":
        lat, sh, g, w = _inputs(m, l, d, torch.float16)
    elif case == "k_not_multiple_of_8":
        lat, sh, g, w = _inputs(m, 60, d)
    elif case == "m17":
        lat, sh, g, w = _inputs(17, l, d)
    elif case == "norm_weight_strided":
        g = torch.randn(2 * l, dtype=torch.bfloat16)[::2]
    elif case == "norm_weight_wrong_length":
        g = torch.randn(l + 8, dtype=torch.bfloat16)
    elif case == "shared_wrong_shape":
        sh = torch.randn(m + 1, d, dtype=torch.bfloat16)
    elif case == "negative_eps":
        eps = -1.0
    assert why in tc.supports(lat, sh, g, w, eps)


def test_supports_accepts_k3_shape():
    assert tc.supports(*_inputs(4, 3584, 7168), 1e-6) is None


def test_a_wgmma_form_too_small_for_the_latent_is_refused():
    """Forcing a wgmma form whose resident A cannot hold the latent's K share raises rather than overrunning shared
    memory (the dispatch never picks one: test_latent_moe_tail_dispatch.py)."""
    cfg = WG(block_n=64, block_k=128, stages=6, split_k=1)
    fits = 128 * cfg.norm_a_tiles(16)
    with pytest.raises(ValueError, match="does not fit"):
        tc.latent_moe_tail_cute(*_inputs(16, fits + 8, 64), 1e-6, cfg)


@needs_cutlass
def test_compiles_for_sm90a_without_gpu(monkeypatch, tmp_path):
    monkeypatch.setenv("CUTE_DSL_ARCH", os.environ.get("CUTE_DSL_ARCH", "sm_90a"))
    monkeypatch.setenv("K3_CUTE_CACHE_DIR", str(tmp_path))
    h200 = dispatch.table_for("NVIDIA H200")
    static_pick = h200.get("bfloat16", 16, 7168, 3584, True).configs["cute"]
    variants = [(1, h200.get("bfloat16", 1, 7168, 3584, False).configs["cute"]), (9, mma(2, 2, 2, 1, stages=3)),
                (16, mma(1, 1, 4, 2, stages=4, split_k=2)), (16, static_pick),
                (5, WG(block_n=64, block_k=64, stages=8, split_k=2, evict_hints=True))]
    for m, cfg in variants:
        assert kc.compile_kernel(torch.bfloat16, m, cfg, False, True, False, 1e-6) is not None
    names = sorted(p.name for p in tmp_path.rglob("*.so"))
    assert len(names) == len(variants) and all("_norm" in n for n in names)
    assert sum("wgmma" in n for n in names) == 3


# ---------------------------------------------------------------------------------------- GPU tests

def _run(m, l, d, eps, cfg=None, static_weight=False, scale=1.0):
    lat, sh, g, w = _inputs(m, l, d, device="cuda", scale=scale)
    assert cute_can_run_on(lat, sh, g, w) is None
    assert tc.supports(lat, sh, g, w, eps) is None
    out = torch.full((m, d), float("nan"), device="cuda", dtype=torch.bfloat16)
    tc.latent_moe_tail_cute(lat, sh, g, w, eps, cfg or op_config(m, d, l, static_weight), out=out,
                            static_weight=static_weight)
    ref = latent_moe_tail_ref(lat.double(), sh.double(), g.double(), w.double(), eps)
    assert not out.isnan().any(), "unwritten or NaN outputs"
    e = rel_err(out, ref)
    assert e < TOL, f"rel={e:.2e}"


# D ≥ 64: with a handful of outputs, ‖out − ref‖/‖ref‖ is ruled by cancellation (out ≈ 0 while its terms are
# not), where any bf16 evaluation order misses any fixed tolerance; simulated on CPU, 1.3% of draws with
# M ≤ 2, D ≤ 3 exceed 1e-2 for this kernel's rounding and 2.1% for the model's own; with D ≥ 64 none of
# 6000 did (max 3.3e-3). Small D is checked against the kernel's own rounding below.
@pytest.mark.gpu
@settings(deadline=None)
@given(m=st.integers(1, 16), l=st.integers(1, 600).map(lambda x: 8 * x), d=st.integers(64, 3000),
       eps=st.sampled_from([1e-6, 1e-5, 1e-2]), scale=st.sampled_from([1e-3, 1.0, 300.0]))
@example(m=1, l=3584, d=7168, eps=1e-6, scale=1.0)
@example(m=4, l=3584, d=7168, eps=1e-5, scale=1.0)
@example(m=16, l=3584, d=7168, eps=1e-6, scale=1.0)
def test_matches_reference_random_shapes(m, l, d, eps, scale):
    _run(m, l, d, eps, scale=scale)


def _same_rounding(lat, sh, g, w, eps):
    """The kernel's arithmetic in float64: x·g rounded to bf16, dot, times rsqrt(mean(x²) + eps), + shared."""
    xg = (lat.double() * g.double()).to(lat.dtype).double()
    rstd = torch.rsqrt(lat.double().pow(2).mean(-1, keepdim=True) + eps)
    return (xg @ w.double().t()) * rstd + sh.double()


@pytest.mark.gpu
@pytest.mark.parametrize("m,l,d", [(1, 8, 1), (5, 24, 3), (16, 520, 7), (9, 1032, 9), (2, 4096, 5)],
                         ids=["M1-L8-D1", "M5-L24-D3", "M16-L520-D7", "M9-L1032-D9", "M2-L4096-D5"])
@pytest.mark.parametrize("cfg", [None, WGMMA_FORMS[1]], ids=["table", "wgmma"])
def test_small_d_matches_same_rounding(m, l, d, cfg):
    lat, sh, g, w = _inputs(m, l, d, device="cuda")
    out = torch.full((m, d), float("nan"), device="cuda", dtype=torch.bfloat16)
    tc.latent_moe_tail_cute(lat, sh, g, w, 1e-6, cfg or op_config(m, d, l), out=out)
    assert rel_err(out, _same_rounding(lat, sh, g, w, 1e-6)) < TOL


@pytest.mark.gpu
@settings(deadline=None)
@given(m=st.integers(1, 16), l=st.integers(1, 448).map(lambda x: 8 * x), d=st.integers(64, 3000),
       form=st.sampled_from(WGMMA_FORMS), static_weight=st.booleans(), scale=st.sampled_from([1e-3, 1.0, 300.0]))
@example(m=16, l=3584, d=7168, form=WGMMA_FORMS[0], static_weight=False, scale=1.0)
@example(m=3, l=3584, d=7168, form=WGMMA_FORMS[2], static_weight=True, scale=1.0)
def test_wgmma_form_matches_reference_random_shapes(m, l, d, form, static_weight, scale):
    _run(m, l, d, 1e-6, cfg=form, static_weight=static_weight, scale=scale)


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", [mma(1, 1, 1, 1),
                                 mma(2, 2, 2, 1, stages=3),
                                 mma(1, 1, 8, 2, stages=3),
                                 mma(1, 1, 4, 2, stages=4, split_k=2),
                                 mma(1, 1, 2, 4, split_k=4),
                                 mma(1, 2, 4, 2, stages=3, a_ring=True, a_l1=True),
                                 mma(1, 1, 4, 2, stages=4, a_l1=True)] + WGMMA_FORMS,
                         ids=lambda c: c.tag())
@pytest.mark.parametrize("m", [1, 8, 9, 16], ids=lambda m: f"M{m}")
@pytest.mark.parametrize("static_weight", [False, True], ids=["dynamic_w", "static_w"])
def test_every_config_matches_reference(cfg, m, static_weight):
    _run(m, 1032, 1000, 1e-6, cfg=cfg, static_weight=static_weight)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 16], ids=lambda m: f"M{m}-L3584-D7168")
def test_cuda_graph_capture_and_replay(m):
    l, d, eps = 3584, 7168, 1e-6
    lat, sh, g, w = _inputs(m, l, d, device="cuda")
    cfg = op_config(m, d, l)
    tc.warmup(torch.bfloat16, m, cfg, eps)
    tc.latent_moe_tail_cute(lat, sh, g, w, eps, cfg)  # first call outside capture
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        with torch.cuda.graph(graph):
            out = tc.latent_moe_tail_cute(lat, sh, g, w, eps, cfg)
    torch.cuda.current_stream().wait_stream(side)
    for i in range(3):  # fresh inputs each replay, latent scale changing (the norm must follow)
        lat.copy_(torch.randn_like(lat) * 10 ** (i - 1))
        sh.copy_(torch.randn_like(sh))
        g.copy_(1 + 0.1 * torch.randn_like(g))
        w.copy_(torch.randn_like(w) / l ** 0.5)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref = latent_moe_tail_ref(lat.double(), sh.double(), g.double(), w.double(), eps)
        assert not out.isnan().any()
        assert rel_err(out, ref) < TOL
