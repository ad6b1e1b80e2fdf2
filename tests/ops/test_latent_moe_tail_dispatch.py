"""k3::latent_moe_tail's dispatch (``dispatch.py``) on the CPU: what runs under ``auto`` and forced backends, what is
recorded, and the H200 table's picks. The CuTe tail is wired in through a stand-in here (CI has no GPU); its kernel
is tested in test_latent_moe_tail_cute.py. Shape by shape against the Python tables this replaced:
test_dispatch_decisions.py."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from k3compile import tables
from k3compile.backends import BackendUnavailableError
from k3compile.kernels.cute.configs import MmaConfig, WgmmaConfig
from k3compile.ops.latent_moe_tail import LATENT_MOE_TAIL, dispatch, latent_moe_tail
from k3compile.ops.latent_moe_tail.reference import latent_moe_tail_ref, latent_moe_tail_unfused
from k3compile.ops.latent_moe_tail.triton_config import STREAM_K_TMA, TailConfig
from k3compile.ops.skinny_gemm import SKINNY_GEMM
from k3compile.testing import latent_moe_tail_inputs as make_inputs, rel_err

H200 = dispatch.table_for("NVIDIA H200")
TOL = 3e-2   # bf16 under the interpreter (test_latent_moe_tail.py says why)


def truth(latent, shared, norm_weight, up_weight, eps):
    return latent_moe_tail_ref(latent.float(), shared.float(), norm_weight.float(), up_weight.float(), eps)





class _Cuda:
    """What the profitability predicates read of a CUDA tensor (CI has none)."""

    def __init__(self, shape, dtype=torch.bfloat16):
        self.shape, self.dtype, self.device = torch.Size(shape), dtype, torch.device("cuda", 0)


@pytest.fixture
def on_h200(monkeypatch):
    monkeypatch.setattr(dispatch, "_cuda_table", lambda index: H200)
    monkeypatch.setattr(dispatch, "sm90_nvidia", lambda device: True)
    return H200


def _profitable(impl, m, l=3584, d=7168, dtype=torch.bfloat16):
    args = (_Cuda((m, l), dtype), _Cuda((m, d), dtype), _Cuda((l,), dtype), _Cuda((d, l), dtype), 1e-5, 16)
    return (dispatch._cute_profitable if impl == "cute" else dispatch._triton_profitable)(*args)


def test_auto_on_cpu_runs_the_one_kernel_recorded(tail_records):
    """CPU CI: CuTe cannot run (recorded why), the one-kernel Triton tail runs; nothing else is recorded."""
    args = make_inputs(4, 64, 48, torch.bfloat16)
    out = latent_moe_tail(*args, 1e-5)
    assert rel_err(out, truth(*args, 1e-5)) < TOL
    (main,) = tail_records()
    assert main.impl == "triton" and main.reason.startswith("cute: ") and main.key == "cpu bfloat16 M=4 L=64 D=48"
    assert SKINNY_GEMM.choices() == []


def test_split_path_where_the_one_kernel_measured_slower(monkeypatch, tail_records):
    """Where the one-kernel tail declines, auto takes the split path (OpImpls' ``aten``), recorded with the reason;
    its GEMM runs as the skinny GEMM's own auto pick, not recorded as a skinny_gemm choice."""
    monkeypatch.setattr(LATENT_MOE_TAIL, "triton", dataclasses.replace(
        LATENT_MOE_TAIL.triton, profitable=lambda *args: "measured slower (test)"))
    args = make_inputs(4, 64, 48, torch.bfloat16)
    out = latent_moe_tail(*args, 1e-5)
    assert rel_err(out, truth(*args, 1e-5)) < TOL
    (main,) = tail_records()
    assert main.impl == "aten" and "measured slower (test)" in main.reason
    assert SKINNY_GEMM.choices() == []


def test_forced_triton_runs_the_one_kernel_even_where_it_measured_slower(monkeypatch, tail_records):
    monkeypatch.setattr(LATENT_MOE_TAIL, "triton", dataclasses.replace(
        LATENT_MOE_TAIL.triton, profitable=lambda *args: "measured slower (test)"))
    latent_moe_tail(*make_inputs(4, 64, 48, torch.bfloat16), 1e-5, backend="triton")
    assert [c.impl for c in tail_records("triton")] == ["triton"]


def test_h200_one_kernel_forms_where_measured(on_h200):
    """bf16 at K3's widths: CuTe ahead of the Triton tail at every M; the Triton tail ahead of the split path at M 1,
    4, 8 and 16, not 2 (unmeasured); fp16: the split path; other widths unmeasured: the split path."""
    for m, triton_wins in ((1, True), (2, False), (3, True), (4, True), (5, True), (8, True), (9, True), (16, True)):
        assert _profitable("cute", m) is None
        assert (_profitable("triton", m) is None) == triton_wins, m
    assert "split path measured faster" in _profitable("triton", 4, dtype=torch.float16)
    assert "not measured faster" in _profitable("cute", 4, dtype=torch.float16)
    assert "not measured" in _profitable("triton", 4, l=1024)
    assert "not measured" in _profitable("cute", 1, l=1024)


def test_grid_form_needs_tma(on_h200, monkeypatch):
    """M 5-16's one-kernel form was measured with its tiles by TMA: before sm_90 the split path runs there; the
    stream-K form of M 1-4 stays."""
    monkeypatch.setattr(dispatch, "sm90_nvidia", lambda device: False)
    assert "needs TMA" in _profitable("triton", 16)
    assert _profitable("triton", 1) is None


def test_triton_config_static_row_first():
    """``static_weight`` reads the static row of the table (its configuration may differ); fp16 normalises first."""
    plain, static = TailConfig(block_n=64), TailConfig(block_n=128, block_k=128, stream_k=True, pdl=True)
    picks = {("bfloat16", 4, 7168, 3584, False): tables.Pick(("triton",), {"triton": plain}),
             ("bfloat16", 4, 7168, 3584, True): tables.Pick(("triton",), {"triton": static})}
    table = dataclasses.replace(H200, picks=picks)
    assert dispatch.triton_config_for(torch.bfloat16, 4, 7168, 3584, False, table, 132) == plain
    assert dispatch.triton_config_for(torch.bfloat16, 3, 7168, 3584, True, table, 132) == static
    assert dispatch.triton_config_for(torch.bfloat16, 2, 7168, 3584, False, table, 132) == STREAM_K_TMA
    assert dispatch.triton_config_for(torch.float16, 2, 7168, 3584, False, table, 132).prenorm
    assert dispatch.triton_config_for(torch.bfloat16, 4, 7168, 3584, False, table, 0) != plain   # interpreter


def test_cute_config_table_else_the_gemm_mma_pick():
    """The table's form where the latent's K share fits its resident A; elsewhere the skinny GEMM's mma.sync pick
    (its wgmma entries were measured without the norm warps)."""
    gemm = dispatch.gemm_dispatch.table_for("NVIDIA H200")
    for static in (False, True):
        assert dispatch.cute_config_for(torch.bfloat16, 16, 7168, 3584, static, H200, gemm) is \
            H200.get("bfloat16", 16, 7168, 3584, static).configs["cute"]
    assert isinstance(gemm.get("bfloat16", 16, 896, 7168, False).configs["cute"], WgmmaConfig)
    assert isinstance(dispatch.cute_config_for(torch.bfloat16, 16, 896, 7168, False, H200, gemm), MmaConfig)
    small = WgmmaConfig(block_n=64, block_k=128, stages=6)
    fits = 128 * small.norm_a_tiles(16)
    table = dataclasses.replace(H200, picks={("bfloat16", 16, 1024, l, s): tables.Pick(("cute",), {"cute": small})
                                             for l in (fits, fits + 8) for s in (False, True)})
    assert dispatch.cute_config_for(torch.bfloat16, 16, 1024, fits, False, table, gemm) == small
    assert isinstance(dispatch.cute_config_for(torch.bfloat16, 16, 1024, fits + 8, False, table, gemm), MmaConfig)


def test_h200_table_wgmma_entries_fit_their_shapes():
    for (dt, m, d, l, static), pick in H200.picks.items():
        cfg = pick.configs.get("cute")
        if isinstance(cfg, WgmmaConfig):
            assert cfg.invalid() is None and cfg.norm_fits(m, l), (m, d, l, cfg.tag())


# ------------------------------------------------------------------------------ a stand-in CuTe tail on CPU tensors

@pytest.fixture
def fake_cute(monkeypatch, tail_records):
    """A CuTe tail that 'runs' on CPU tensors: the reference behind cute.py's entry point."""
    calls = []

    def run(latent, shared, norm_weight, up_weight, eps, cfg, static_weight=False):
        calls.append(latent.shape[0])
        return latent_moe_tail_unfused(latent, shared, norm_weight, up_weight, eps)

    monkeypatch.setattr(LATENT_MOE_TAIL, "cute", dataclasses.replace(LATENT_MOE_TAIL.cute, available=lambda *a: None))
    monkeypatch.setattr(dispatch.cute, "latent_moe_tail_cute", run)
    return calls


def test_cute_not_taken_by_auto_until_measured_faster(fake_cute, tail_records):
    latent_moe_tail(*make_inputs(4, 64, 48, torch.bfloat16), 1e-5)
    assert fake_cute == []
    (main,) = tail_records(impl="triton")
    assert "cute: not measured faster" in main.reason, main


def test_cute_taken_by_auto_where_measured_faster(fake_cute, monkeypatch, tail_records):
    table = dataclasses.replace(H200, picks={("bfloat16", 4, 48, 64, s): tables.Pick(("cute",), {})
                                             for s in (False, True)})
    monkeypatch.setattr(dispatch, "table_of", lambda device: table)
    args = make_inputs(3, 64, 48, torch.bfloat16)
    out = latent_moe_tail(*args, 1e-5)
    assert fake_cute == [3] and rel_err(out, truth(*args, 1e-5)) < TOL
    assert [(c.impl, c.reason) for c in tail_records()] == [("cute", "preferred")]
    latent_moe_tail(*make_inputs(5, 64, 48, torch.bfloat16), 1e-5)   # M bucket 8: not measured
    assert fake_cute == [3]


def test_forced_cute_runs_where_it_can(fake_cute, tail_records):
    args = make_inputs(2, 64, 48, torch.bfloat16)
    out = latent_moe_tail(*args, 1e-5, backend="cute")
    assert fake_cute == [2] and rel_err(out, truth(*args, 1e-5)) < TOL
    # above the small-M limit even a forced cute falls to the reference, recorded
    latent_moe_tail(*make_inputs(17, 64, 48, torch.bfloat16), 1e-5, backend="cute")
    (ref,) = tail_records("cute", "reference")
    assert "small-M limit" in ref.reason and fake_cute == [2]


def test_cute_declining_falls_back_recorded(fake_cute, monkeypatch, tail_records):
    monkeypatch.setattr(dispatch.cute, "supports", lambda *args: "fp16 declined (test)")
    args = make_inputs(2, 64, 48, torch.float16)
    out = latent_moe_tail(*args, 1e-5, backend="cute")
    assert fake_cute == [] and rel_err(out, truth(*args, 1e-5)) < 5e-3
    (main,) = tail_records("cute", "triton")
    assert "fp16 declined (test)" in main.reason


def test_cute_without_cutlass(tail_records):
    """CI: auto records why CuTe cannot run; a forced cute raises (the user asked for the impossible)."""
    args = make_inputs(2, 64, 48, torch.bfloat16)
    latent_moe_tail(*args, 1e-5)
    (main,) = tail_records(impl="triton")
    assert main.reason.startswith("cute: ")
    with pytest.raises(BackendUnavailableError, match="latent_moe_tail"):
        latent_moe_tail(*args, 1e-5, backend="cute")
