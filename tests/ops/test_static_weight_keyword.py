"""``static_weight`` on ``k3::skinny_gemm`` and ``k3::latent_moe_tail``: a launch detail.

- the results equal those without it (CPU: the reference, and Triton under TRITON_INTERPRET=1, where PDL
  is off and the keyword changes nothing);
- it reaches the CuTe and Triton kernel functions as ``static_weight=True``, and nothing else (the
  reference, cuBLAS); an empty activation never passes it;
- the kernel choice and its key do not depend on it; old calls without it stay valid.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

from k3compile.ops.latent_moe_tail import dispatch as tail_dispatch
from k3compile.ops.latent_moe_tail import triton as tail_triton
from k3compile.ops.skinny_gemm import dispatch as gemm_dispatch
from k3compile.ops.skinny_gemm import triton as gemm_triton
from k3compile.testing import rel_err

GEMM = torch.ops.k3.skinny_gemm
TAIL = torch.ops.k3.latent_moe_tail


@given(m=st.integers(1, 16), n=st.sampled_from([8, 24, 64]), k=st.sampled_from([16, 32, 96]),
       residual=st.booleans(), backend=st.sampled_from(["reference", "triton"]))
@example(m=4, n=64, k=96, residual=True, backend="triton")
def test_skinny_gemm_static_weight_equal_results(m, n, k, residual, backend):
    a, w = torch.randn(m, k), torch.randn(n, k)
    r = torch.randn(m, n) if residual else None
    plain = GEMM(a, w, None, r, backend, 16)
    static = GEMM(a, w, None, r, backend, 16, True)
    ref = a @ w.T + (r if residual else 0)
    assert torch.equal(static, plain)
    assert rel_err(static, ref) < 1e-5


@given(m=st.integers(1, 16), backend=st.sampled_from(["reference", "triton"]))
@example(m=8, backend="triton")
def test_latent_moe_tail_static_weight_equal_results(m, backend):
    l, d = 32, 48
    latent, shared = torch.randn(m, l), torch.randn(m, d)
    g, w = torch.rand(l) + 0.5, torch.randn(d, l)
    plain = TAIL(latent, shared, g, w, 1e-5, backend, 16)
    static = TAIL(latent, shared, g, w, 1e-5, backend, 16, True)
    assert torch.equal(static, plain)
    ref = latent * torch.rsqrt(latent.pow(2).mean(-1, keepdim=True) + 1e-5) * g @ w.T + shared
    assert rel_err(static, ref) < 1e-5


def _spy(calls, result_of):
    def spy(*args, **kwargs):
        calls.append(kwargs.get("static_weight", False))
        return result_of(*args)
    return spy


def test_skinny_gemm_keyword_reaches_triton_only_when_proven(monkeypatch):
    calls = []
    monkeypatch.setattr(gemm_triton, "skinny_gemm_triton", _spy(calls, lambda a, w, b, r: a @ w.T))
    a, w = torch.randn(2, 16), torch.randn(8, 16)
    GEMM(a, w, None, None, "triton", 16, True)
    GEMM(a, w, None, None, "triton", 16)
    GEMM(torch.randn(0, 16), w, None, None, "triton", 16, True)   # empty: no kernel made its input
    assert calls == [True, False, False]


def test_skinny_gemm_cute_receives_the_keyword(monkeypatch):
    calls = []
    monkeypatch.setattr(gemm_dispatch.cute, "skinny_gemm_cute", _spy(calls, lambda a, w, b, r, cfg: a @ w.T))
    a, w = torch.randn(2, 16), torch.randn(8, 16)
    gemm_dispatch._cute(a, w, None, None, static_weight=True)
    gemm_dispatch._cute(a, w, None, None)
    assert calls == [True, False]


def test_tail_keyword_reaches_its_kernels(monkeypatch):
    """The one-kernel forms get the caller's keyword; the split path streams its weight early whatever it is
    (test_latent_moe_tail_split.py)."""
    calls = []
    tail = lambda lat, sh, g, w, eps, cfg: lat @ w.T + sh  # noqa: E731
    monkeypatch.setattr(tail_triton, "latent_moe_tail_triton", _spy(calls, tail))
    monkeypatch.setattr(tail_dispatch.cute, "latent_moe_tail_cute", _spy(calls, tail))
    lat, sh, g, w = torch.randn(2, 16), torch.randn(2, 8), torch.ones(16), torch.randn(8, 16)
    tail_dispatch._triton(lat, sh, g, w, 1e-5, 16, static_weight=True)
    tail_dispatch._cute(lat, sh, g, w, 1e-5, 16, static_weight=True)
    tail_dispatch._cute(lat, sh, g, w, 1e-5, 16)
    assert calls == [True, True, False]


def test_choice_key_does_not_change():
    a, w = torch.randn(3, 40), torch.randn(24, 40)
    before = {c.key for c in gemm_dispatch.SKINNY_GEMM.choices()}
    GEMM(a, w, None, None, "reference", 16)
    GEMM(a, w, None, None, "reference", 16, True)
    new = [c for c in gemm_dispatch.SKINNY_GEMM.choices() if c.key not in before]
    assert len(new) == 1 and new[0].calls == 2


def test_old_calls_and_fakes_stay_valid():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        a, w = torch.empty(2, 16), torch.empty(8, 16)
        assert GEMM(a, w, None, None, "auto", 16, True).shape == (2, 8)
        lat, sh, g, uw = torch.empty(2, 16), torch.empty(2, 8), torch.empty(16), torch.empty(8, 16)
        assert TAIL(lat, sh, g, uw, 1e-5, "auto", 16, True).shape == (2, 8)
    # optional arguments append after static_weight (out_dtype since the upcast_matmul pass): positions stay valid
    args = {a.name: a for a in GEMM.default._schema.arguments}
    names = [a.name for a in GEMM.default._schema.arguments]
    assert names.index("static_weight") == 6 and args["static_weight"].default_value is False
    assert all(a.default_value is not None or a.type.kind() == "OptionalType"
               for a in GEMM.default._schema.arguments[7:])
    assert TAIL.default._schema.arguments[-1].default_value is False


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 4, 16], ids=lambda m: f"M{m}-N7168-K3584-bf16")
def test_gpu_static_weight_equal_results(m):
    a = torch.randn(m, 3584, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(7168, 3584, device="cuda", dtype=torch.bfloat16) / 60
    r = torch.randn(m, 7168, device="cuda", dtype=torch.bfloat16)
    for backend in ("cute", "triton"):
        plain = GEMM(a, w, None, r, backend, 16)
        static = GEMM(a, w, None, r, backend, 16, True)
        assert torch.equal(static, plain), backend
    g = torch.rand(3584, device="cuda", dtype=torch.bfloat16) + 0.5
    for backend in ("cute", "triton"):
        plain = TAIL(a, r, g, w, 1e-5, backend, 16)          # latent [M, 3584], up_weight [7168, 3584]
        static = TAIL(a, r, g, w, 1e-5, backend, 16, True)
        assert torch.equal(static, plain), backend
