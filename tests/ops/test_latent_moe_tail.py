"""k3::latent_moe_tail: the Triton kernel and the op's dispatch against the fp32 reference.

On CPU the Triton kernel runs under TRITON_INTERPRET=1 (set by conftest). The interpreter
(triton 3.7) truncates fp32 -> bf16 where a GPU rounds to nearest, so bf16 errors here are about
twice the GPU's; the tolerances cover both.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

from k3compile.backends import BackendUnavailableError
from k3compile.ops.latent_moe_tail import latent_moe_tail
from k3compile.ops.latent_moe_tail.op import LATENT_MOE_TAIL
from k3compile.ops.latent_moe_tail.reference import (
    kimi_rms_norm, latent_moe_tail_ref, latent_moe_tail_unfused,
)
from k3compile.ops.latent_moe_tail.split import kimi_rms_norm_triton, latent_moe_tail_split
from k3compile.ops.latent_moe_tail.triton import TailConfig, latent_moe_tail_triton
from k3compile.ops.skinny_gemm import SKINNY_GEMM

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
TOL = {torch.float32: 1e-5, torch.bfloat16: 3e-2, torch.float16: 5e-3, torch.float64: 1e-12}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert not out.isnan().any(), "NaN in the output (unwritten element or bad math)"
    ref = ref.double()
    return ((out.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def make_inputs(m, l, d, dtype, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    latent = (torch.randn(m, l, generator=g) * scale).to(dtype)
    shared = torch.randn(m, d, generator=g).to(dtype)
    norm_weight = (1 + 0.1 * torch.randn(l, generator=g)).to(dtype)
    up_weight = (torch.randn(d, l, generator=g) / l ** 0.5).to(dtype)
    return latent, shared, norm_weight, up_weight


def truth(latent, shared, norm_weight, up_weight, eps):
    """fp32 ground truth, not rounded to the input dtype (the comparison should not see that rounding twice)."""
    return latent_moe_tail_ref(latent.float(), shared.float(), norm_weight.float(), up_weight.float(), eps)


@given(m=st.integers(1, 16), l=st.integers(1, 300), d=st.integers(1, 160),
       dtype=st.sampled_from(list(DTYPES)), eps=st.sampled_from([1e-6, 1e-5, 1e-2]),
       prenorm=st.booleans(), block_n=st.sampled_from([16, 32, 64]), block_k=st.sampled_from([16, 64, 128]),
       seed=st.integers(0, 2**16))
@example(m=1, l=3584, d=64, dtype="bf16", eps=1e-5, prenorm=False, block_n=32, block_k=128, seed=0)
@example(m=16, l=3584, d=64, dtype="bf16", eps=1e-5, prenorm=False, block_n=32, block_k=128, seed=1)
@example(m=3, l=257, d=33, dtype="fp16", eps=1e-5, prenorm=True, block_n=16, block_k=64, seed=2)
def test_triton_matches_reference(m, l, d, dtype, eps, prenorm, block_n, block_k, seed):
    dt = DTYPES[dtype]
    args = make_inputs(m, l, d, dt, seed)
    out = torch.full((m, d), float("nan"), dtype=dt)
    latent_moe_tail_triton(*args, eps, TailConfig(block_n=block_n, block_k=block_k, prenorm=prenorm), out=out)
    assert rel_err(out, truth(*args, eps)) < TOL[dt], f"M{m}-L{l}-D{d}-{dtype}-eps{eps}-prenorm{prenorm}"


# the interpreter truncates fp32 -> bf16 / fp16 (a GPU rounds): one unit in the last place of the dtype
NORM_TOL = {torch.float32: 1e-6, torch.bfloat16: 2 ** -7, torch.float16: 2 ** -10}


@given(m=st.integers(1, 16), l=st.integers(1, 300), dtype=st.sampled_from(list(DTYPES)),
       eps=st.sampled_from([1e-6, 1e-5, 1e-2]), strided=st.booleans(), seed=st.integers(0, 2**16))
@example(m=1, l=3584, dtype="bf16", eps=1e-5, strided=False, seed=0)
@example(m=16, l=3584, dtype="bf16", eps=1e-5, strided=True, seed=1)
def test_triton_norm_matches_model_norm(m, l, dtype, eps, strided, seed):
    """The split path's first kernel rounds as the model's KimiRMSNorm (normalised value, then weight)."""
    dt = DTYPES[dtype]
    latent, _, norm_weight, _ = make_inputs(m, l, 1, dt, seed)
    if strided:
        latent = torch.cat([latent, latent], 1)[:, ::2]
    out = torch.full((m, l), float("nan"), dtype=dt)
    kimi_rms_norm_triton(latent, norm_weight, eps, out=out)
    ref = kimi_rms_norm(latent, norm_weight, eps)
    # elementwise: each value within a few units in the last place of the model's value
    assert not out.isnan().any()
    worst = ((out.double() - ref.double()).abs() / ref.double().abs().clamp_min(1e-3)).max().item()
    assert worst <= 4 * NORM_TOL[dt], f"M{m}-L{l}-{dtype}-eps{eps}-strided{strided}: {worst}"


@given(m=st.integers(1, 16), l=st.integers(1, 300), d=st.integers(1, 160),
       dtype=st.sampled_from(list(DTYPES)), eps=st.sampled_from([1e-6, 1e-5]), seed=st.integers(0, 2**16))
@example(m=1, l=3584, d=64, dtype="bf16", eps=1e-5, seed=0)
@example(m=16, l=3584, d=64, dtype="bf16", eps=1e-5, seed=1)
def test_split_norm_then_skinny_gemm_matches_reference(m, l, d, dtype, eps, seed):
    """Triton norm + k3::skinny_gemm (its Triton kernel, residual = shared) against the fp32 truth."""
    dt = DTYPES[dtype]
    args = make_inputs(m, l, d, dt, seed)
    out = latent_moe_tail_split(*args, eps, backend="triton")
    assert rel_err(out, truth(*args, eps)) < TOL[dt], f"M{m}-L{l}-D{d}-{dtype}-eps{eps}"


def test_triton_impl_is_norm_plus_skinny_gemm_recorded():
    """backend='triton': the tail records 'triton', and the GEMM it ran records its own choice."""
    LATENT_MOE_TAIL.clear()
    SKINNY_GEMM.clear()
    args = make_inputs(4, 64, 48, torch.bfloat16)
    out = latent_moe_tail(*args, 1e-5, backend="triton")
    assert rel_err(out, truth(*args, 1e-5)) < TOL[torch.bfloat16]
    (tail,) = _choice(torch.bfloat16, "triton")
    (gemm,) = [c for c in SKINNY_GEMM.choices() if c.backend == "triton"]
    assert (tail.impl, gemm.impl) == ("triton", "triton"), (tail, gemm)


@pytest.mark.parametrize("dtype", list(DTYPES), ids=list(DTYPES))
@pytest.mark.parametrize("layout", ["latent-T", "weight-T", "shared-strided"])
def test_triton_non_contiguous(layout, dtype):
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


def test_fp16_large_latent_prenorm():
    """Unnormalised x·g would overflow fp16 in the factored form; the fp16 default normalises first."""
    args = make_inputs(2, 128, 32, torch.float16, scale=3000.0)
    out = latent_moe_tail(*args, 1e-5)
    assert rel_err(out, truth(*args, 1e-5)) < TOL[torch.float16]


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


def _choice(key_dtype, backend="auto"):
    name = str(key_dtype).removeprefix("torch.")
    return [c for c in LATENT_MOE_TAIL.choices() if f" {name} " in c.key and c.backend == backend]


@pytest.mark.parametrize("m,limit,impl", [(1, 16, "triton"), (16, 16, "triton"), (17, 16, "reference"),
                                          (8, 4, "reference"), (4, 4, "triton"), (8, 64, "triton")],
                         ids=["M1-lim16", "M16-lim16", "M17-lim16", "M8-lim4", "M4-lim4", "M8-lim64"])
def test_dispatch_by_m(m, limit, impl):
    LATENT_MOE_TAIL.clear()
    args = make_inputs(m, 40, 24, torch.float32)
    out = latent_moe_tail(*args, 1e-5, small_m_limit=limit)
    assert rel_err(out, truth(*args, 1e-5)) < TOL[torch.float32]
    (choice,) = _choice(torch.float32)
    assert choice.impl == impl, choice
    if impl == "reference":
        assert "small-M limit" in choice.reason


def test_dtype_the_kernel_lacks_falls_back_recorded():
    LATENT_MOE_TAIL.clear()
    args = make_inputs(3, 40, 24, torch.float64)
    out = latent_moe_tail(*args, 1e-5, backend="triton")
    assert rel_err(out, truth(*args, 1e-5)) < 1e-6
    (choice,) = _choice(torch.float64, "triton")
    assert choice.impl == "reference" and "float64" in choice.reason, choice


def test_forced_triton_without_interpreter_raises(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    LATENT_MOE_TAIL.clear()
    with pytest.raises(BackendUnavailableError, match="latent_moe_tail"):
        latent_moe_tail(*make_inputs(2, 40, 24, torch.float32), 1e-5, backend="triton")
    LATENT_MOE_TAIL.clear()
    out = latent_moe_tail(*make_inputs(2, 40, 24, torch.float32), 1e-5, backend="auto")
    assert _choice(torch.float32)[0].impl == "reference" and not out.isnan().any()
    LATENT_MOE_TAIL.clear()


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


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", list(DTYPES), ids=list(DTYPES))
@pytest.mark.parametrize("m", [1, 2, 4, 8, 16, 17], ids=lambda m: f"M{m}-L3584-D7168")
def test_cuda_real_widths(m, dtype):
    """The single-kernel variant and the op's split path (norm + skinny GEMM) at K3's widths."""
    dt = DTYPES[dtype]
    args = [t.cuda() for t in make_inputs(m, 3584, 7168, dt, seed=m)]
    LATENT_MOE_TAIL.clear()
    out = torch.full((m, 7168), float("nan"), dtype=dt, device="cuda")
    if m <= 16:
        latent_moe_tail_triton(*args, 1e-5, out=out)
    else:
        out = latent_moe_tail(*args, 1e-5)
    ref = truth(*(t.cpu() for t in args), 1e-5)
    assert rel_err(out.cpu(), ref) < {torch.float32: 1e-4, torch.bfloat16: 1e-2, torch.float16: 2e-3}[dt]
    # through the op: Triton norm + skinny GEMM on the GPU (or the reference above the limit), recorded
    SKINNY_GEMM.clear()
    out = latent_moe_tail(*args, 1e-5)
    assert rel_err(out.cpu(), ref) < {torch.float32: 1e-4, torch.bfloat16: 1e-2, torch.float16: 2e-3}[dt]
    (choice,) = LATENT_MOE_TAIL.choices()
    assert choice.impl == ("triton" if m <= 16 else "reference"), choice
    if m <= 16:   # the GEMM's own choice: CuTe or Triton where they run and win, else cuBLAS (aten)
        assert [c.impl for c in SKINNY_GEMM.choices()] in (["cute"], ["triton"], ["aten"]), SKINNY_GEMM.choices()
