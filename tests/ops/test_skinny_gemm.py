"""``k3::skinny_gemm`` the op: what runs and is recorded on the CPU, input checks, the fake, opcheck. The kernels:
test_skinny_gemm_triton.py, test_skinny_gemm_cute*.py; the dispatch's tables: test_skinny_gemm_dispatch.py."""
from __future__ import annotations

import pytest
import torch

from k3compile.backends import BackendUnavailableError, triton_interpret
from k3compile.ops.skinny_gemm import SKINNY_GEMM, skinny_gemm
from k3compile.ops.skinny_gemm.reference import skinny_gemm_reference
from k3compile.testing import rel_err

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float64: 1e-12}


def make_inputs(m, n, k, dtype):
    """a [M, K], w [N, K], bias [N], residual [M, N] on the CPU."""
    g = torch.Generator().manual_seed(0)
    return (torch.randn(m, k, generator=g).to(dtype), torch.randn(n, k, generator=g).to(dtype),
            torch.randn(n, generator=g).to(dtype), torch.randn(m, n, generator=g).to(dtype))


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
    a, w, b, r = make_inputs(3, 20, 40, torch.bfloat16)
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
    a, w, b, r = make_inputs(3, 20, 40, torch.bfloat16)
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


@pytest.mark.skipif(not triton_interpret(), reason="CPU tensors reach Triton only under TRITON_INTERPRET=1")
def test_op_fp32_output_of_bf16_runs_triton_and_equals_the_upcast_product(fresh_records):
    a, w, b, _ = make_inputs(3, 20, 40, torch.bfloat16)
    out = skinny_gemm(a, w, b, out_dtype=torch.float32)
    assert out.dtype == torch.float32
    assert rel_err(out, torch.nn.functional.linear(a.float(), w.float(), b.float())) < TOL[torch.float32]
    choice = _only_choice(fresh_records)
    assert choice.impl == "triton" and choice.key[-1] == torch.float32


def test_cute_takes_a_fp32_output_of_16_bit_operands_with_a_fp32_residual_only():
    from k3compile.ops.skinny_gemm import cute

    a, w = torch.randn(4, 64, dtype=torch.bfloat16), torch.randn(8, 64, dtype=torch.bfloat16)
    assert cute.supports(a, w) is None and cute.supports(a, w, None, None, torch.float32) is None
    assert cute.supports(a, w, None, torch.randn(4, 8), torch.float32) is None
    assert "residual must be" in cute.supports(a, w, None, torch.randn(4, 8, dtype=torch.bfloat16), torch.float32)
    assert "residual must be" in cute.supports(a, w, None, torch.randn(4, 8))
    assert "output of" in cute.supports(a, w, None, None, torch.float16)


def test_op_fp32_output_above_the_limit_runs_the_upcast_product(fresh_records):
    a, w, b, _ = make_inputs(40, 20, 24, torch.bfloat16)
    out = skinny_gemm(a, w, b, m_limit=16, out_dtype=torch.float32)
    assert out.dtype == torch.float32
    assert rel_err(out, torch.nn.functional.linear(a.float(), w.float(), b.float())) < TOL[torch.float32]
    assert _only_choice(fresh_records).impl == "aten"


@pytest.mark.parametrize("dtype,out_dtype,residual,match", [
    pytest.param(torch.float32, torch.bfloat16, None, "only a 16-bit product", id="fp32-to-bf16"),
    pytest.param(torch.bfloat16, torch.float64, None, "only a 16-bit product", id="bf16-to-fp64"),
    pytest.param(torch.bfloat16, torch.float32, torch.bfloat16, "residual dtype", id="bf16-residual-fp32-out"),
])
def test_op_bad_output_dtype_raises_clear_error(dtype, out_dtype, residual, match):
    a, w = torch.randn(4, 16, dtype=dtype), torch.randn(8, 16, dtype=dtype)
    r = None if residual is None else torch.randn(4, 8, dtype=residual)
    with pytest.raises(ValueError, match=match):
        skinny_gemm(a, w, None, r, out_dtype=out_dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 8, 16], ids=lambda m: f"M{m}")
def test_op_fp32_output_on_gpu_router_shape_runs_cute(fresh_records, m):
    """K3's router on the GPU: the table puts CuTe first at its 16-bit shape, and CuTe stores the fp32 sums."""
    from k3compile.kernels.cute.compile import unavailable

    a = torch.randn(m, 7168, device="cuda").bfloat16()
    w = (torch.randn(896, 7168, device="cuda") / 7168 ** 0.5).bfloat16()
    out = skinny_gemm(a, w, out_dtype=torch.float32)
    assert rel_err(out, torch.nn.functional.linear(a.double(), w.double())) < TOL[torch.float32]
    choice = _only_choice(fresh_records)
    assert choice.impl == ("cute" if unavailable() is None else "triton"), choice


def test_op_fake_gives_shape_and_dtype():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        out = skinny_gemm(torch.empty(5, 16, dtype=torch.bfloat16), torch.empty(7, 16, dtype=torch.bfloat16))
    assert out.shape == (5, 7) and out.dtype == torch.bfloat16
    with FakeTensorMode():
        out = skinny_gemm(torch.empty(5, 16, dtype=torch.bfloat16), torch.empty(7, 16, dtype=torch.bfloat16),
                          out_dtype=torch.float32)
    assert out.shape == (5, 7) and out.dtype == torch.float32


def test_op_passes_opcheck():
    a, w, b, r = make_inputs(3, 20, 40, torch.float32)
    torch.library.opcheck(torch.ops.k3.skinny_gemm.default, (a, w, b, r, "reference", 16),
                          test_utils=("test_schema", "test_faketensor"))
    a, w, b, _ = make_inputs(3, 20, 40, torch.bfloat16)
    torch.library.opcheck(torch.ops.k3.skinny_gemm.default, (a, w, b, r, "reference", 16),
                          dict(out_dtype=torch.float32), test_utils=("test_schema", "test_faketensor"))
