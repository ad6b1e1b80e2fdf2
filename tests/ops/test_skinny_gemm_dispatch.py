"""k3::skinny_gemm's dispatch (``dispatch.py``) on the CPU: the H200 table, the order and configuration it gives,
the heuristics for what it does not list, and what the CuTe implementation is handed. The decisions themselves,
shape by shape, against the Python tables they replaced: test_dispatch_decisions.py."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, strategies as st

from k3compile import tables
from k3compile.kernels.cute.configs import MAX_THREADS, SMEM_LIMIT, MmaConfig, WgmmaConfig
from k3compile.ops.skinny_gemm import cute, cute_config, dispatch

H200 = dispatch.table_for("NVIDIA H200")


def _cuda(m, n, k, dtype=torch.bfloat16):
    """CUDA tensors without a GPU (the predicates read device, dtype, shapes and strides)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode()
    with mode:
        return mode, torch.empty(m, k, device="cuda", dtype=dtype), torch.empty(n, k, device="cuda", dtype=dtype)


@pytest.fixture
def on_h200(monkeypatch):
    """CUDA tensors see the H200 table and 132 SMs."""
    monkeypatch.setattr(dispatch, "_cuda_gpu", lambda index: dispatch.Gpu(H200, 132))
    return H200


def test_h200_table_configurations_are_launchable():
    """Every configuration the table names passes its kernel's checks at the shapes it is picked for."""
    assert any(isinstance(p.configs.get("cute"), WgmmaConfig) for p in H200.picks.values())
    for (dt, m, n, k, static), pick in H200.picks.items():
        cfg = pick.configs.get("cute")
        if isinstance(cfg, MmaConfig):
            assert 32 <= cfg.threads <= MAX_THREADS and cfg.smem_bytes(m) <= SMEM_LIMIT
        elif cfg is not None:
            assert cfg.invalid() is None and cfg.share_fits(k), (dt, m, n, k, cfg.tag())


def test_table_lists_every_shape_for_both_static_values_with_one_order():
    for (dt, m, n, k, static), pick in H200.picks.items():
        assert H200.picks[(dt, m, n, k, not static)].order == pick.order


@given(m=st.integers(1, 16), n=st.integers(1, 40000), k=st.integers(1, 3000).map(lambda x: 8 * x),
       static=st.booleans())
def test_cute_config_is_launchable_for_any_shape(m, n, k, static):
    cfg = dispatch.cute_config_for(torch.bfloat16, m, n, k, static, H200)
    if isinstance(cfg, MmaConfig):
        assert 32 <= cfg.threads <= MAX_THREADS and cfg.smem_bytes(m) <= SMEM_LIMIT
    else:
        assert cfg.invalid() is None and cfg.share_fits(k)


def test_unlisted_shapes_take_register_tiles_with_a_static_weight_only():
    assert H200.get("bfloat16", 1, 1024, 7168, True) is None
    assert dispatch.cute_config_for(torch.bfloat16, 1, 1024, 7168, True, H200) == \
        cute_config.register_tile_heuristic(1, 1024, 7168)
    assert isinstance(dispatch.cute_config_for(torch.bfloat16, 1, 1024, 7168, False, H200), MmaConfig)
    # nothing fits two blocks an SM: the mma.sync kernel
    assert dispatch.cute_config_for(torch.bfloat16, 16, 7168, 2048, True, H200) == \
        cute_config.mma_heuristic(16, 7168, 2048)


def test_listed_shapes_take_the_table_pick():
    pick = H200.get("bfloat16", 5, 1536, 7168, True)
    assert dispatch.cute_config_for(torch.bfloat16, 5, 1536, 7168, True, H200) is pick.configs["cute"]
    assert dispatch.order(torch.bfloat16, 5, 1536, 7168, H200) == pick.order


@pytest.mark.parametrize("m,n,k", [(1, 1024, 7168), (3, 777, 1000), (16, 4096, 4096), (8, 7168, 2048)],
                         ids=["M1-N1024-K7168", "M3-N777-K1000", "M16-N4096-K4096", "M8-N7168-K2048"])
def test_unlisted_shapes_try_cute_then_triton_where_it_beats_cublas(m, n, k):
    want = ("cute", "triton") if dispatch.triton_beats_cublas(m, n, k) else ("cute",)
    assert dispatch.order(torch.bfloat16, m, n, k, H200) == want


def test_where_triton_measured_faster_cute_declines_and_triton_runs(on_h200):
    """bf16 20480 x 7168, M 1-8: the Triton kernel ahead of CuTe (and both of cuBLAS); fp16 keeps CuTe (the
    float16 rows repeat the bf16 picks without that measurement)."""
    for m in (1, 2, 4, 8):
        assert H200.get("bfloat16", m, 20480, 7168, False).order == ("triton",)
        _, a, w = _cuda(m, 20480, 7168)
        assert "Triton kernel measured faster" in dispatch._cute_profitable(a, w, None, None)
        assert dispatch._triton_profitable(a, w, None, None) is None
        _, a16, w16 = _cuda(m, 20480, 7168, torch.float16)
        assert dispatch._cute_profitable(a16, w16, None, None) is None


def test_where_cublas_measured_faster_the_kernel_declines(on_h200):
    assert H200.get("bfloat16", 16, 20480, 7168, False).order == ("triton",)   # Triton beats cuBLAS, CuTe does not
    _, a, w = _cuda(1, 7168, 1536)
    assert H200.get("bfloat16", 1, 7168, 1536, False).order == ("cute",)
    assert "cuBLAS measured faster" in dispatch._triton_profitable(a, w, None, None)


def test_a_wgmma_pick_is_what_the_cute_implementation_compiles(monkeypatch, on_h200):
    """A table pick naming the wgmma kernel reaches ``cute.skinny_gemm_cute`` with that configuration (and the
    static-weight flag), whatever its M within the bucket; a fp32 output of the same operands runs the same
    configuration's fp32-output variant."""
    wg = WgmmaConfig(block_n=64, block_k=64, stages=8, split_k=2)
    picks = dict(H200.picks)
    for static in (False, True):
        picks[("bfloat16", 16, 640, 1024, static)] = tables.Pick(("cute",), {"cute": wg})
    table = dataclasses.replace(H200, picks=picks)
    monkeypatch.setattr(dispatch, "_cuda_gpu", lambda index: dispatch.Gpu(table, 132))
    calls = []
    monkeypatch.setattr(cute, "compile_kernel",
                        lambda dtype, m, cfg, *flags, out_fp32=False: calls.append((m, cfg, *flags, out_fp32))
                        or (lambda *args: None))
    mode, a, w = _cuda(12, 640, 1024)
    assert dispatch._cute_profitable(a, w, None, None) is None
    assert dispatch._cute_profitable(a, w, None, None, torch.float32) is None
    with mode:
        out = dispatch._cute(a, w, None, None, static_weight=True)
        out32 = dispatch._cute(a, w, None, None, torch.float32, static_weight=True)
    assert out.shape == (12, 640) and out32.dtype == torch.float32
    assert calls == [(12, wg, False, False, True, False), (12, wg, False, False, True, True)]


def test_trigger_first_false_keeps_the_tiles_and_drops_the_early_trigger(monkeypatch, on_h200):
    """Under Inductor's PDL codegen the proof passes ``trigger_first=False``: the table's static pick runs with the
    same tiles, launching the next kernel only after its wait; the kernel key (and so precompile's plan) follows."""
    (dt, m, n, k, _), pick = next((key, p) for key, p in H200.picks.items()
                                  if key[4] and getattr(p.configs.get("cute"), "trigger_first", False))
    tf = pick.configs["cute"]
    calls = []
    monkeypatch.setattr(cute, "compile_kernel",
                        lambda dtype, m_, cfg, *flags, **kw: calls.append(cfg) or (lambda *args: None))
    mode, a, w = _cuda(m, n, k, getattr(torch, dt))
    with mode:
        dispatch._cute(a, w, None, None, static_weight=True)
        dispatch._cute(a, w, None, None, static_weight=True, trigger_first=False)
    assert calls == [tf, dataclasses.replace(tf, trigger_first=False)]
    keys = [dispatch._cute_kernels(a, w, None, None, static_weight=True, trigger_first=t)[0][1] for t in (True, False)]
    assert keys[0] != keys[1] and [c.trigger_first for k_ in keys for c in k_ if c in (tf, calls[1])] == [True, False]


def test_run_auto_decides_as_the_op_and_records_nothing(monkeypatch):
    dispatch.SKINNY_GEMM.clear()
    a, w, r = torch.randn(3, 40), torch.randn(20, 40), torch.randn(3, 20)
    out = dispatch.run_auto(a, w, None, r)
    assert torch.allclose(out, a @ w.T + r, atol=1e-5) and dispatch.SKINNY_GEMM.choices() == []
    impl, _ = dispatch.SKINNY_GEMM.decide("auto", (a, w, None, r))
    assert dispatch.SKINNY_GEMM.decide_once("auto", dispatch.key(a, w, None, r), (a, w, None, r)) == impl


# --------------------------------------------------------------------------------------------------
# an architecture with no measurements (ROCm's gfx942): the vendor BLAS but for large 16-bit weights

@pytest.mark.parametrize("n,k,dtype,impl", [
    (2304, 1536, torch.bfloat16, "aten"),     # Triton x0.77 of cuBLAS on the H200
    (7168, 1536, torch.bfloat16, "aten"),     # x0.91
    (2112, 7168, torch.bfloat16, "aten"),     # 30 MB: under the 32 MiB rule
    (4608, 7168, torch.bfloat16, "triton"),   # x1.12-1.22
    (20480, 7168, torch.float16, "triton"),
    (20480, 7168, torch.float32, "aten"),     # fp32: never measured against the vendor BLAS
], ids=lambda v: str(v).removeprefix("torch."))
def test_unmeasured_architecture_runs_the_vendor_blas_but_for_large_weights(monkeypatch, n, k, dtype, impl):
    monkeypatch.setattr(dispatch, "_cuda_gpu", lambda index: dispatch.Gpu(None, 304, "gfx942"))
    monkeypatch.setattr(dispatch, "cute_can_run_on", lambda *tensors: "CuTe DSL is NVIDIA-only")
    mode, a, w = _cuda(4, n, k, dtype)
    with mode:
        pick, why = dispatch.SKINNY_GEMM.decide("auto", (a, w, None, None))
    assert pick == impl, why
    if impl == "aten":
        assert "no measurements for gfx942" in why


def test_fallback_table_stands_in_for_its_architecture_only():
    assert dispatch.table_for("NVIDIA H100 80GB HBM3", "sm_90") is H200 or \
        dispatch.table_for("NVIDIA H100 80GB HBM3", "sm_90").path == H200.path
    assert dispatch.table_for("AMD Instinct MI300X", "gfx942") is None
    assert dispatch.table_for("NVIDIA B200", "sm_100") is None
    assert dispatch.order(torch.bfloat16, 4, 4608, 7168, None) == ("triton",)
