"""k3::skinny_gemm: the Triton kernel against the fp32 reference, and the op's dispatch records.

On CPU the Triton kernel runs under TRITON_INTERPRET=1 (set by conftest); its 16-bit products are
computed in fp32 there (exact, as on the GPU's MMA) because the interpreter's 16-bit ``tl.dot`` is
wrong, and it truncates fp32 -> bf16 where a GPU rounds: tolerances cover both.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

from k3compile.backends import BackendUnavailableError, triton_interpret
from k3compile.ops.skinny_gemm import SKINNY_GEMM, skinny_gemm
from k3compile.ops.skinny_gemm.reference import skinny_gemm_reference
from k3compile.ops.skinny_gemm.triton import TritonConfig, choose_config, skinny_gemm_triton, supports
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


def run_triton(a, w, b, r, config=None):
    out = torch.full((a.shape[0], w.shape[0]), float("nan"), dtype=a.dtype, device=a.device)
    return skinny_gemm_triton(a, w, b, r, config=config, out=out)


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


@given(
    m=st.integers(1, 64), n=st.integers(1, 160), k=st.integers(1, 300),
    dtype=st.sampled_from(sorted(DTYPES)), bias=st.booleans(), residual=st.booleans(),
    split_k=st.sampled_from([1, 2, 3]), block_n=st.sampled_from([16, 32, 64]), seed=st.integers(0, 2**16),
)
@example(m=1, n=2112, k=64, dtype="bf16", bias=False, residual=True, split_k=1, block_n=64, seed=0)
@example(m=16, n=128, k=512, dtype="bf16", bias=True, residual=True, split_k=3, block_n=64, seed=1)
def test_triton_matches_reference_random_shapes(m, n, k, dtype, bias, residual, split_k, block_n, seed):
    dt = DTYPES[dtype]
    a, w, b, r = make_inputs(m, n, k, dt, bias, residual, seed)
    block_m = max(16, 1 << (m - 1).bit_length())
    config = TritonConfig(block_m, block_n, 32 if k > 16 else 16, split_k)
    out = run_triton(a, w, b, r, config)
    assert rel_err(out, skinny_gemm_reference(a, w, b, r)) < TOL[dt]


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
    with pytest.raises(ValueError, match="dtype"):
        skinny_gemm_triton(a, w)
    with pytest.raises(ValueError, match="do not agree"):
        skinny_gemm_triton(torch.randn(4, 16), torch.randn(8, 15))


def test_config_heuristic_splits_k_only_on_gpu():
    assert choose_config(4, 2112, 7168, 0).split_k == 1
    cfg = choose_config(4, 2112, 7168, 132)
    assert cfg.split_k > 1 and cfg.block_m == 16
    assert choose_config(40, 7168, 2048, 132).block_m == 64


@pytest.fixture
def fresh_records():
    SKINNY_GEMM.clear()
    yield SKINNY_GEMM
    SKINNY_GEMM.clear()


def _only_choice(records):
    (choice,) = records.choices()
    return choice


@pytest.mark.skipif(not triton_interpret(), reason="CPU tensors reach Triton only under TRITON_INTERPRET=1")
def test_op_auto_on_cpu_runs_triton_under_interpreter(fresh_records):
    a, w, b, r = make_inputs(3, 20, 40, torch.bfloat16, device="cpu")
    out = skinny_gemm(a, w, b, r)
    assert rel_err(out, skinny_gemm_reference(a, w, b, r)) < TOL[torch.bfloat16]
    choice = _only_choice(fresh_records)
    assert choice.impl == "triton" and "cute:" in choice.reason


def test_op_unsupported_dtype_falls_back_to_reference_with_reason(fresh_records):
    a, w, b, r = make_inputs(3, 20, 40, torch.float64)
    out = skinny_gemm(a, w, b, r, backend="triton")
    assert rel_err(out, skinny_gemm_reference(a, w, b, r)) < TOL[torch.float64]
    choice = _only_choice(fresh_records)
    assert choice.impl == "reference" and "dtype torch.float64" in choice.reason


def test_op_forced_cute_on_cpu_raises(fresh_records):
    a, w, b, r = make_inputs(3, 20, 40, torch.bfloat16, device="cpu")
    with pytest.raises(BackendUnavailableError, match="cute"):
        skinny_gemm(a, w, b, r, backend="cute")


def test_op_rows_above_limit_use_addmm_and_record_it(fresh_records):
    a, w, b, r = make_inputs(40, 20, 24, torch.float32)
    out = skinny_gemm(a, w, b, r, m_limit=16)
    assert rel_err(out, skinny_gemm_reference(a, w, b, r)) < TOL[torch.float32]
    choice = _only_choice(fresh_records)
    assert choice.impl == "aten" and "M=40 > m_limit=16" in choice.reason


def test_op_non_contiguous_inputs_stay_correct(fresh_records):
    a = torch.randn(16, 9)[::2]                        # [8, 9], row stride 18
    w = torch.randn(9, 30).T                           # [30, 9]
    out = skinny_gemm(a, w)
    assert rel_err(out, skinny_gemm_reference(a, w)) < TOL[torch.float32]


@pytest.mark.parametrize("bad,match", [
    pytest.param(dict(w=torch.randn(8, 15)), "disagree on K", id="K-mismatch"),
    pytest.param(dict(bias=torch.randn(1, 8)), "bias", id="bias-2d"),
    pytest.param(dict(residual=torch.randn(8)), "residual", id="residual-1d"),
    pytest.param(dict(w=torch.randn(8, 16, dtype=torch.bfloat16)), "dtype", id="mixed-dtype"),
])
def test_op_bad_input_raises_clear_error(bad, match):
    args = dict(a=torch.randn(4, 16), w=torch.randn(8, 16), bias=None, residual=None) | bad
    with pytest.raises(ValueError, match=match):
        skinny_gemm(args["a"], args["w"], args["bias"], args["residual"])


def test_op_fake_gives_shape_and_dtype():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        out = skinny_gemm(torch.empty(5, 16, dtype=torch.bfloat16), torch.empty(7, 16, dtype=torch.bfloat16))
    assert out.shape == (5, 7) and out.dtype == torch.bfloat16


def test_op_passes_opcheck():
    a, w, b, r = make_inputs(3, 20, 40, torch.float32)
    torch.library.opcheck(torch.ops.k3.skinny_gemm.default, (a, w, b, r, "reference", 16),
                          test_utils=("test_schema", "test_faketensor"))
