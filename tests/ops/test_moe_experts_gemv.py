"""k3::moe_experts' MXFP4 GEMV gate/up kernel (``triton_gemv.py``, a candidate for M <= 4) against the reference's
h (the model's roundings: gate and up, then h, in z's dtype). CPU: under TRITON_INTERPRET=1 (conftest)."""
from __future__ import annotations

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from k3compile.ops.moe_experts.reference import gate_up_ref
from k3compile.ops.moe_experts.triton_gemv import gate_up_gemv
from k3compile.testing import moe_experts_inputs, rel_err

K3_BETAS = (4.0, 25.0)
TOL = {torch.float32: 2e-5, torch.bfloat16: 4e-2}


@settings(max_examples=max(6, settings.default.max_examples // 4), deadline=None)
@given(m=st.integers(1, 4), a=st.integers(1, 3), e=st.integers(1, 5), i=st.integers(1, 40),
       l=st.sampled_from([32, 64, 96, 160]), dtype=st.sampled_from(["fp32", "bf16"]),
       routing=st.sampled_from(["random", "repeat", "one"]), rows=st.sampled_from([1, 4, 8]),
       seed=st.integers(0, 2**16))
@example(m=1, a=3, e=5, i=24, l=96, dtype="bf16", routing="random", rows=4, seed=0)     # K3 decode, I % rows == 0
@example(m=3, a=2, e=2, i=13, l=64, dtype="fp32", routing="repeat", rows=8, seed=1)     # duplicates, ragged I
@example(m=4, a=3, e=4, i=16, l=160, dtype="fp32", routing="one", rows=4, seed=2)       # one expert, L/32 = 5
def test_gemv_gate_up_matches_reference(m, a, e, i, l, dtype, routing, rows, seed):
    dt = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    if routing == "random" and a > e:
        a = e
    z, experts, _, w1, w3, _, s1, s3, _ = moe_experts_inputs(m, a, e, i, l, dt, routing, mxfp4=True, seed=seed)
    h = torch.full((m * a, i), float("nan"), dtype=dt)
    gate_up_gemv(z, experts, w1, w3, s1, s3, *K3_BETAS, rows=rows, h=h)
    assert rel_err(h, gate_up_ref(z, experts, w1, w3, s1, s3, *K3_BETAS)) < TOL[dt], \
        f"M{m}-A{a}-E{e}-I{i}-L{l}-{dtype}-{routing}-r{rows}"


def test_gemv_gate_up_extreme_scales_and_every_code():
    """Every code, and scales from the E8M0 edge 0 (2^-127) up, give what the reference gives; 255 is NaN."""
    e, i, l = 1, 2, 512
    z = torch.ones(1, l)
    codes = torch.arange(256, dtype=torch.uint8).reshape(1, 1, 256).repeat(e, i, 1)
    scales = torch.tensor([0, 120, 127, 130, 140, 100, 127, 127, 127, 127, 127, 127, 127, 127, 127, 127],
                          dtype=torch.uint8).reshape(1, 1, 16).repeat(e, i, 1)
    experts = torch.zeros(1, 1, dtype=torch.int64)
    h = torch.full((1, i), float("nan"))
    gate_up_gemv(z, experts, codes, codes, scales, scales, None, None, h=h)
    assert rel_err(h, gate_up_ref(z, experts, codes, codes, scales, scales, None, None)) < 1e-6
    scales[0, 1, 3] = 255
    gate_up_gemv(z, experts, codes, codes, scales, scales, None, None, h=h)
    assert h[0, 1].isnan() and not h[0, 0].isnan()


def test_gemv_rejects_many_tokens():
    z, experts, _, w1, w3, _, s1, s3, _ = moe_experts_inputs(5, 2, 3, 8, 64, torch.float32, mxfp4=True)
    with pytest.raises(ValueError, match="M=5"):
        gate_up_gemv(z, experts, w1, w3, s1, s3, *K3_BETAS)
