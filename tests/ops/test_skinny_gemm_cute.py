"""The CuTe DSL skinny GEMM (the mma.sync kernel, and the op's CuTe implementation) against the reference.

CPU (CI): the module imports without cutlass, its predicates give reasons, configurations are checked, and (when
CuTe DSL is installed) variants compile for sm_90a. GPU (`-m gpu` on the H200): random shapes with NaN-poisoned
outputs, bias/residual, fp16, CUDA-graph capture and replay.
"""
import importlib.util
import os

import pytest
import torch
from hypothesis import example, given, strategies as st

from k3compile.backends import cute_can_run_on
from k3compile.kernels.cute.configs import MmaConfig, WgmmaConfig
from k3compile.ops.skinny_gemm import cute as kc
from k3compile.ops.skinny_gemm import dispatch
from k3compile.ops.skinny_gemm.reference import skinny_gemm_reference
from k3compile.testing import check_chain_replays, rel_err

HAS_CUTLASS = importlib.util.find_spec("cutlass") is not None
needs_cutlass = pytest.mark.skipif(not HAS_CUTLASS, reason="CuTe DSL (nvidia-cutlass-dsl) not installed")


def mma(row_groups, warps_n, warps_k, unroll, **options):
    """An MmaConfig, its block's four dimensions first."""
    return MmaConfig(row_groups=row_groups, warps_n=warps_n, warps_k=warps_k, unroll=unroll, **options)


def tol(dtype):
    return 8e-3 if dtype == torch.bfloat16 else 2e-3


# ---------------------------------------------------------------------------------------- CPU tests

def test_available_says_why_on_cpu_tensors():
    a, w = torch.randn(2, 64, dtype=torch.bfloat16), torch.randn(128, 64, dtype=torch.bfloat16)
    why = cute_can_run_on(a, w)
    assert isinstance(why, str) and why


@pytest.mark.parametrize("m,n,k,dtype,why", [
    (17, 64, 64, torch.bfloat16, "M=17"),
    (2, 64, 60, torch.bfloat16, "multiple of 8"),
    (2, 64, 64, torch.float32, "bf16 or fp16"),
], ids=["M17-N64-K64-bf16", "M2-N64-K60-bf16", "M2-N64-K64-fp32"])
def test_supports_rejects_with_reason(m, n, k, dtype, why):
    a, w = torch.randn(m, k, dtype=dtype), torch.randn(n, k, dtype=dtype)
    assert why in kc.supports(a, w)


def test_supports_rejects_strided_and_mismatched():
    a = torch.randn(2, 128, dtype=torch.bfloat16)[:, :64]
    w = torch.randn(64, 128, dtype=torch.bfloat16)[:, ::2]
    assert "row-major" in kc.supports(a, w)
    w = torch.randn(64, 64, dtype=torch.float16)
    assert "dtypes" in kc.supports(a.contiguous(), w)
    assert "residual" in kc.supports(a.contiguous(), w.bfloat16(), None, torch.randn(3, 64, dtype=torch.bfloat16))


def test_supports_accepts_decode_shape():
    a, w = torch.randn(4, 7168, dtype=torch.bfloat16), torch.randn(896, 7168, dtype=torch.bfloat16)
    assert kc.supports(a, w, torch.randn(896, dtype=torch.bfloat16), torch.randn(4, 896, dtype=torch.bfloat16)) is None


@needs_cutlass
def test_compiles_for_sm90a_without_gpu(monkeypatch, tmp_path):
    monkeypatch.setenv("CUTE_DSL_ARCH", os.environ.get("CUTE_DSL_ARCH", "sm_90a"))
    monkeypatch.setenv("K3_CUTE_CACHE_DIR", str(tmp_path))
    for cfg, static in [(mma(2, 1, 2, 2), False), (mma(1, 1, 4, 2, stages=3), False),
                        (mma(1, 1, 4, 2, stages=3), True),
                        (mma(1, 1, 4, 2, stages=4, split_k=4), False),
                        (mma(1, 2, 4, 2, stages=3, a_ring=True, a_l1=True), False)]:
        assert kc.compile_kernel(torch.bfloat16, 3, cfg, True, True, static) is not None
    assert len([p for p in tmp_path.rglob("*.so")]) == 5  # the on-disk cache a second process loads


# one process compiles every variant of every config (importing CuTe DSL takes ~8 s a process): prints, by config
# tag, [trigger_first, static weight, the PDL instructions of its PTX in order] for each variant
_PTX_ORDER = """
import dataclasses, glob, json, os, sys, torch
from k3compile.ops.skinny_gemm import cute as kc
from k3compile.kernels.cute.configs import MmaConfig, WgmmaConfig
by_tag = {}
for cfg in eval(sys.argv[1]):
    orders = by_tag[cfg.tag()] = []
    for tf in (False, True):
        for static in (False, True):
            for old in glob.glob(os.path.join(os.environ["CUTE_DSL_DUMP_DIR"], "*.ptx")):
                os.remove(old)
            kc.compile_kernel(torch.bfloat16, 3, dataclasses.replace(cfg, trigger_first=tf), False, True, static)
            (ptx,) = glob.glob(os.path.join(os.environ["CUTE_DSL_DUMP_DIR"], "*.ptx"))
            lines = [ln.strip() for ln in open(ptx)]
            orders.append([tf, static, [ln.rstrip(";") for ln in lines if ln.startswith("griddepcontrol.")]])
print(json.dumps(by_tag))
"""
PTX_ORDER_CONFIGS = [mma(1, 1, 4, 2, stages=3, split_k=2, a_ring=True), mma(1, 1, 4, 4),
                     WgmmaConfig(block_n=64, block_k=64, stages=4, split_k=2, producer_warp=True, evict_hints=True),
                     WgmmaConfig(block_n=64, block_k=64, stages=4, split_k=4, producer_warp=True, evict_hints=True,
                                 push_partials=True)]


@pytest.fixture(scope="module")
def ptx_orders(tmp_path_factory):
    """{config tag: the PDL orders of its four variants}, every config compiled in one process."""
    import json
    import subprocess
    import sys
    env = dict(os.environ, CUTE_DSL_ARCH="sm_90a", K3_CUTE_CACHE_DIR="0", CUTE_DSL_KEEP="ptx",
               CUTE_DSL_DUMP_DIR=str(tmp_path_factory.mktemp("ptx")))
    out = subprocess.run([sys.executable, "-c", _PTX_ORDER, repr(PTX_ORDER_CONFIGS)], env=env, capture_output=True,
                         text=True, check=True).stdout
    return json.loads(out.splitlines()[-1])


@needs_cutlass
@pytest.mark.parametrize("cfg", PTX_ORDER_CONFIGS, ids=lambda c: c.tag())
def test_trigger_first_only_with_a_static_weight(ptx_orders, cfg):
    """The PDL instructions in PTX order (sm_90a, compiled here): with ``trigger_first`` and a static weight a block
    triggers before it waits; without a static weight, as without the flag, no trigger comes before the first wait
    (what step 1 of the static-weight proof rests on: k3compile/static_weights.py)."""
    orders = ptx_orders[cfg.tag()]
    assert len(orders) == 4
    for tf, static_weight, ops in orders:
        assert "griddepcontrol.wait" in ops and "griddepcontrol.launch_dependents" in ops, (tf, static_weight, ops)
        assert (ops[0] == "griddepcontrol.launch_dependents") == (tf and static_weight), (tf, static_weight, ops)


@pytest.mark.parametrize("kwargs", [dict(split_k=0), dict(split_k=9), dict(stages=0), dict(warps_k=64)],
                         ids=["split_k0", "split_k9", "stages0", "threads2048"])
def test_config_rejects_unlaunchable(kwargs):
    with pytest.raises(ValueError):
        MmaConfig(**kwargs)


def test_config_tag_names_split_k():
    assert mma(1, 1, 8, 2, stages=3, split_k=2).tag() == "rg1-wn1-wk8-u2-s3-c2"


def test_config_tag_names_a_l1():
    assert mma(1, 1, 8, 2, stages=3, a_ring=True, a_l1=True).tag() == "rg1-wn1-wk8-u2-s3-a-ca"


def test_config_tag_names_pdl_options():
    assert mma(1, 1, 8, 2, stages=3, early=True, l2_kb=112).tag() == "rg1-wn1-wk8-u2-s3-e-l112"
    assert mma(1, 1, 8, 2, stages=3, trigger_first=True).tag() == "rg1-wn1-wk8-u2-s3-tf"
    assert mma(1, 1, 4, 2, stages=8, a_ring=True).tag() == "rg1-wn1-wk4-u2-s8-a"
    with pytest.raises(ValueError):
        mma(1, 1, 4, 4, a_ring=True)  # A rides the cp.async ring: needs one


# ---------------------------------------------------------------------------------------- GPU tests

def _run(m, n, k, dtype, bias, residual, cfg=None, static_weight=False, out_dtype=None):
    """Against the float64 reference, into a NaN-poisoned ``out``; ``out_dtype=float32``: out and residual fp32,
    held to a tolerance a 16-bit rounding would miss by ~100x."""
    out_dtype = out_dtype or dtype
    a = torch.randn(m, k, device="cuda", dtype=dtype)
    w = torch.randn(n, k, device="cuda", dtype=dtype) / k ** 0.5
    b = torch.randn(n, device="cuda", dtype=dtype) if bias else None
    r = torch.randn(m, n, device="cuda", dtype=out_dtype) if residual else None
    assert cute_can_run_on(a, w, b, r) is None
    assert kc.supports(a, w, b, r, out_dtype) is None
    out = torch.full((m, n), float("nan"), device="cuda", dtype=out_dtype)
    cfg = cfg or dispatch.cute_config_for(dtype, m, n, k, static_weight, dispatch.gpu_of(a.device).table)
    kc.skinny_gemm_cute(a, w, b, r, cfg, out=out, static_weight=static_weight, out_dtype=out_dtype)
    ref = skinny_gemm_reference(a.double(), w.double(), None if b is None else b.double(),
                                None if r is None else r.double())
    assert not out.isnan().any(), "unwritten or NaN outputs"
    e = rel_err(out, ref)
    assert e < (2e-5 if out_dtype != dtype else tol(dtype)), f"rel={e:.2e}"


@pytest.mark.gpu
@given(m=st.integers(1, 16), n=st.integers(1, 5000), k=st.integers(1, 1200).map(lambda x: 8 * x),
       dtype=st.sampled_from([torch.bfloat16, torch.float16]), bias=st.booleans(), residual=st.booleans())
@example(m=1, n=896, k=7168, dtype=torch.bfloat16, bias=False, residual=False)
@example(m=16, n=2112, k=7168, dtype=torch.bfloat16, bias=False, residual=True)
@example(m=4, n=7168, k=768, dtype=torch.bfloat16, bias=True, residual=True)
def test_matches_reference_random_shapes(m, n, k, dtype, bias, residual):
    _run(m, n, k, dtype, bias, residual)


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", [mma(1, 1, 1, 1),
                                 mma(4, 2, 2, 8),
                                 mma(2, 4, 1, 2),
                                 mma(1, 1, 8, 4),
                                 mma(1, 1, 8, 2, stages=4),
                                 mma(2, 2, 2, 1, stages=3),
                                 mma(1, 1, 8, 2, stages=3, split_k=2),
                                 mma(1, 1, 4, 4, split_k=4),
                                 mma(2, 1, 2, 2, stages=4, split_k=8),
                                 mma(1, 1, 4, 4, early=True, l2_kb=4),
                                 mma(1, 1, 4, 2, stages=3, split_k=2, early=True, l2_kb=1000),
                                 mma(2, 1, 4, 2, stages=4, early=True, a_ring=True),
                                 mma(1, 1, 2, 2, stages=8, split_k=8, a_ring=True),
                                 mma(2, 1, 2, 2, stages=5, split_k=7, early=True, a_ring=True),
                                 mma(1, 1, 8, 2, stages=3, l2_kb=16, a_l1=True),
                                 mma(1, 1, 4, 4, a_l1=True),
                                 mma(1, 1, 8, 2, stages=3, l2_kb=16, trigger_first=True),
                                 mma(2, 1, 4, 2, stages=4, split_k=4, early=True, a_ring=True, a_l1=True,
                                     trigger_first=True)],
                         ids=lambda c: c.tag())
@pytest.mark.parametrize("m", [1, 8, 9, 16], ids=lambda m: f"M{m}")
@pytest.mark.parametrize("static_weight", [False, True], ids=["dynamic_w", "static_w"])
def test_every_config_matches_reference(cfg, m, static_weight):
    _run(m, 1000, 2056, torch.bfloat16, True, True, cfg=cfg, static_weight=static_weight)


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", [mma(1, 1, 4, 4), mma(1, 1, 4, 2, stages=3, split_k=2, early=True, l2_kb=16),
                                 mma(2, 1, 2, 2, stages=4, split_k=8)], ids=lambda c: c.tag())
@pytest.mark.parametrize("m", [1, 9, 16], ids=lambda m: f"M{m}")
def test_fp32_output_matches_unrounded_reference(cfg, m):
    """bf16 operands, fp32 C and residual (the upcast product), in the block's and the cluster's epilogues."""
    _run(m, 1000, 2056, torch.bfloat16, True, True, cfg=cfg, static_weight=True, out_dtype=torch.float32)


_FROM_CACHE = """
import sys, torch
sys.path.insert(0, sys.argv[2])
from k3compile.kernels.cute.compile import STATS
from test_skinny_gemm_cute import mma, _run
_run(int(sys.argv[1]), 1000, 2056, torch.bfloat16, True, True, cfg=mma(1, 1, 4, 2, stages=3))
print(STATS["loaded"], STATS["built"], "cutlass" in sys.modules)
"""


@pytest.mark.gpu
def test_a_cached_kernel_runs_in_a_process_that_never_imports_the_dsl(tmp_path):
    """A built kernel is a shared library TVM-FFI loads: a second process runs it right without importing CuTe DSL."""
    import subprocess
    import sys

    env = {**os.environ, "K3_CUTE_CACHE_DIR": str(tmp_path)}
    here = os.path.dirname(os.path.abspath(__file__))
    first = subprocess.run([sys.executable, "-c", _FROM_CACHE, "3", here], env=env, capture_output=True, text=True)
    assert first.returncode == 0, first.stderr[-3000:]
    assert first.stdout.split()[-3:] == ["0", "1", "True"]   # built (the DSL imported), stored
    again = subprocess.run([sys.executable, "-c", _FROM_CACHE, "3", here], env=env, capture_output=True, text=True)
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stdout.split()[-3:] == ["1", "0", "False"]   # loaded, matches the reference, no DSL


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k", [(1, 896, 7168), (5, 300, 520), (16, 4608, 1536)],
                         ids=["M1-N896-K7168", "M5-N300-K520", "M16-N4608-K1536"])
def test_cuda_graph_capture_and_replay(m, n, k):
    dtype = torch.bfloat16
    a = torch.randn(m, k, device="cuda", dtype=dtype)
    w = torch.randn(n, k, device="cuda", dtype=dtype)
    r = torch.randn(m, n, device="cuda", dtype=dtype)
    cfg = dispatch.cute_config_for(dtype, m, n, k, False, dispatch.gpu_of(a.device).table)
    kc.warmup(dtype, m, cfg, has_residual=True)
    kc.skinny_gemm_cute(a, w, None, r, cfg)  # first call outside capture
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        with torch.cuda.graph(g):
            out = kc.skinny_gemm_cute(a, w, None, r, cfg)
    torch.cuda.current_stream().wait_stream(s)
    for _ in range(3):  # fresh inputs each replay
        a.copy_(torch.randn_like(a))
        w.copy_(torch.randn_like(w))
        r.copy_(torch.randn_like(r))
        out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        ref = skinny_gemm_reference(a.double(), w.double(), None, r.double())
        assert not out.isnan().any()
        assert rel_err(out, ref) < tol(dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", [mma(1, 1, 8, 2, stages=3, early=True, l2_kb=32),
                                 mma(1, 1, 4, 4, early=True, l2_kb=16),
                                 mma(1, 1, 4, 2, stages=4, split_k=2, early=True, l2_kb=16),
                                 mma(1, 1, 4, 2, stages=8, split_k=4, early=True, a_ring=True),
                                 mma(1, 1, 8, 2, stages=4, a_ring=True, a_l1=True, trigger_first=True),
                                 mma(2, 1, 4, 2, stages=4, split_k=4, early=True, a_ring=True, trigger_first=True)],
                         ids=lambda c: c.tag())
@pytest.mark.parametrize("static_weight", [False, True], ids=["dynamic_w", "static_w"])
def test_chained_products_under_graph_replay(cfg, static_weight):
    """Each product reads the one before (PDL with the early trigger, or the trigger first, must still wait for
    its input)."""
    dtype, m, d = torch.bfloat16, 4, 2048
    ws = [torch.randn(d, d, device="cuda", dtype=dtype) / d ** 0.5 for _ in range(4)]
    x = torch.randn(m, d, device="cuda", dtype=dtype)

    def chain():
        h = x
        for w in ws:
            h = kc.skinny_gemm_cute(h, w, None, None, cfg, static_weight=static_weight)
        return h

    chain()  # compile outside capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = chain()
    check_chain_replays(g, x, out, ws, 2e-2)


@pytest.mark.gpu
def test_unsupported_k_reports_fallback():
    a = torch.randn(2, 1001, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(64, 1001, device="cuda", dtype=torch.bfloat16)
    assert "multiple of 8" in kc.supports(a, w)
