"""k3::experts_beside: the routed experts beside the shared experts' chain, against its plain reference (the routed
experts' reference and the model's shared MLP); the SiTU-GLU kernel into poisoned outputs; the op's checks; on the
GPU, the two streams inside a CUDA graph replayed on fresh inputs equal the same op run in turn."""
from __future__ import annotations

from unittest import mock

import pytest
import torch
from hypothesis import example, given, settings, strategies as st

from k3compile.ops.experts_beside import EXPERTS_BESIDE, experts_beside, experts_beside_ref
from k3compile.ops import side_stream
from k3compile.ops.experts_beside import dispatch
from k3compile.ops.experts_beside.reference import situ_glu_ref
from k3compile.ops.experts_beside.triton import situ_glu_triton
from k3compile.testing import moe_experts_inputs, rel_err

K3_BETAS = (4.0, 25.0)
# the routed experts' Triton kernels round four times in bf16 (tests/ops/test_moe_experts.py); the shared chain
# three times, and the interpreter truncates its bf16 casts
TOL = {torch.float32: 2e-5, torch.bfloat16: 4e-2, torch.float16: 8e-3}


def shared_inputs(m, d, si, dtype, seed, device="cpu"):
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(m, d, generator=g, device=device).to(dtype)
    w_gate, w_up = ((torch.randn(si, d, generator=g, device=device) / d ** 0.5).to(dtype) for _ in range(2))
    w_down = (torch.randn(d, si, generator=g, device=device) / si ** 0.5).to(dtype)
    return x, w_gate, w_up, w_down


def call(routed, shared, betas=K3_BETAS, shared_betas=K3_BETAS, backend="triton"):
    z, experts, weights, w1, w3, w2, s1, s3, s2 = routed
    return experts_beside(z, experts, weights, w1, w3, w2, *shared, s1, s3, s2, *betas, *shared_betas,
                          experts_backend=backend, backend=backend)


def reference(routed, shared, betas=K3_BETAS, shared_betas=K3_BETAS):
    return experts_beside_ref(*routed, *betas, *shared, *shared_betas)


@settings(max_examples=max(6, settings.default.max_examples // 3))   # interpreted MoE kernels: seconds a case
@given(m=st.integers(1, 6), a=st.integers(1, 3), e=st.integers(2, 6), d=st.integers(8, 48), si=st.integers(1, 40),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]), mxfp4=st.booleans(),
       silu=st.booleans(), backend=st.sampled_from(["reference", "triton"]), seed=st.integers(0, 99))
@example(m=1, a=2, e=4, d=48, si=24, dtype=torch.bfloat16, mxfp4=True, silu=False, backend="triton", seed=0)
@example(m=5, a=3, e=3, d=17, si=7, dtype=torch.float32, mxfp4=False, silu=True, backend="triton", seed=1)
def test_op_equals_reference(m, a, e, d, si, dtype, mxfp4, silu, backend, seed):
    a = min(a, e)
    i, l = (32, 64) if mxfp4 else (24, 40)
    routed = moe_experts_inputs(m, a, e, i, l, dtype, mxfp4=mxfp4, seed=seed)
    shared = shared_inputs(m, d, si, dtype, seed)
    shared_betas = (None, None) if silu else K3_BETAS
    y_routed, y_shared = call(routed, shared, shared_betas=shared_betas, backend=backend)
    ref_routed, ref_shared = reference(routed, shared, shared_betas=shared_betas)
    assert (y_routed.shape, y_routed.dtype) == ((m, l), dtype) and (y_shared.shape, y_shared.dtype) == ((m, d), dtype)
    assert rel_err(y_routed, ref_routed) <= TOL[dtype] and rel_err(y_shared, ref_shared) <= TOL[dtype]


@given(m=st.integers(1, 9), n=st.integers(1, 2500), dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       beta=st.sampled_from([None, 4.0]), linear_beta=st.sampled_from([None, 25.0]), seed=st.integers(0, 99))
@example(m=1, n=384, dtype=torch.bfloat16, beta=4.0, linear_beta=25.0, seed=0)    # K3's TP 16 width, one token
@example(m=3, n=1100, dtype=torch.float32, beta=4.0, linear_beta=25.0, seed=1)    # programs past one block
def test_situ_glu_kernel_writes_every_element(m, n, dtype, beta, linear_beta, seed):
    g = torch.Generator().manual_seed(seed)
    gate, up = (torch.randn(m, n, generator=g).mul(3).to(dtype) for _ in range(2))
    out = torch.full((m, n), float("nan"), dtype=dtype)
    situ_glu_triton(gate, up, beta, linear_beta, out=out)
    ref = situ_glu_ref(gate, up, beta, linear_beta)
    # one rounding either way (the interpreter truncates a bf16 cast); tanh as 2σ(2x) - 1: ~1e-7 absolute, which
    # is ~1e-6 relative for a small up / linear_beta
    assert not out.isnan().any() and rel_err(out, ref) <= (1e-5 if dtype == torch.float32 else 2 ** -7)


def test_on_the_cpu_the_chains_run_in_turn_and_say_why():
    EXPERTS_BESIDE.clear()
    call(moe_experts_inputs(2, 2, 4, 24, 40, torch.float32), shared_inputs(2, 16, 8, torch.float32, 0))
    (choice,) = EXPERTS_BESIDE.choices()
    assert choice.impl == "in turn" and "cpu" in choice.reason


def test_fake_gives_the_outputs_shapes_and_dtypes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        routed = moe_experts_inputs(3, 2, 4, 32, 64, torch.bfloat16, mxfp4=True)
        shared = [torch.empty(3, 48, dtype=torch.bfloat16), torch.empty(20, 48, dtype=torch.bfloat16),
                  torch.empty(20, 48, dtype=torch.bfloat16), torch.empty(40, 20, dtype=torch.bfloat16)]
        y_routed, y_shared = call(routed, shared)
    assert (y_routed.shape, y_routed.dtype) == ((3, 64), torch.bfloat16)
    assert (y_shared.shape, y_shared.dtype) == ((3, 40), torch.bfloat16)


@pytest.mark.parametrize("bad, match", [
    (dict(x=torch.randn(3, 16)), "disagree on M"),
    (dict(w_up=torch.randn(9, 16)), "disagree"),
    (dict(w_down=torch.randn(16, 7)), "disagree"),
    (dict(w_gate=torch.randn(8, 16, dtype=torch.bfloat16)), "must be x's dtype"),
    (dict(x=torch.randn(2, 16, dtype=torch.float64)), "must be fp32, bf16 or fp16"),
    (dict(x=torch.randn(2, 1, 16)), "must be 2-D"),
    (dict(experts=torch.zeros(2, 2)), "experts must be integer ids"),
])
def test_bad_arguments_raise(bad, match):
    z, experts, weights, w1, w3, w2 = moe_experts_inputs(2, 2, 4, 24, 40, torch.float32)[:6]
    args = dict(z=z, experts=experts, weights=weights, w1=w1, w3=w3, w2=w2, x=torch.randn(2, 16),
                w_gate=torch.randn(8, 16), w_up=torch.randn(8, 16), w_down=torch.randn(16, 8))
    args.update(bad)
    with pytest.raises(ValueError, match=match):
        experts_beside(**args, backend="reference", experts_backend="reference")


def test_plan_is_the_routed_experts_and_the_three_products(monkeypatch):
    """Planning on stand-ins (a GPU's shapes, nothing allocated) composes the routed experts' plan and the three
    products' plans, the down product's on the op's own SiTU-GLU output, each product with its own flags."""
    from k3compile.call_sites import stand_in
    from k3compile.ops.moe_experts import dispatch as moe_experts_dispatch
    from k3compile.ops.skinny_gemm import dispatch as skinny_gemm_dispatch

    planned = []
    monkeypatch.setattr(moe_experts_dispatch, "kernels", lambda z, *rest: planned.append(("experts", z.shape)) or
                        ["experts"])
    monkeypatch.setattr(skinny_gemm_dispatch, "kernels", lambda a, w, *rest: planned.append(
        (tuple(a.shape), a.dtype, tuple(w.shape), rest[4], rest[6])) or [f"product {len(planned) - 1}"])
    m, d, si = 3, 7168, 384
    drawn = moe_experts_inputs(m, 2, 4, 32, 64, torch.bfloat16, mxfp4=True)
    routed = [stand_in(t.shape, t.dtype, "cuda") for t in drawn]
    x, w_gate, w_up = (stand_in(s, torch.bfloat16, "cuda") for s in ((m, d), (si, d), (si, d)))
    w_down = stand_in((d, si), torch.bfloat16, "cuda")
    builds = dispatch.kernels(*routed[:9], *K3_BETAS, "auto", 16, x, w_gate, w_up, w_down, *K3_BETAS, "auto", 16,
                              True, False, False, True, True, True)
    assert builds == ["experts", "product 1", "product 2", "product 3"]
    assert planned == [("experts", (m, 64)), ((m, d), torch.bfloat16, (si, d), True, False),
                       ((m, d), torch.bfloat16, (si, d), False, True), ((m, si), torch.bfloat16, (d, si), True, True)]


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 8, 16, 40])
def test_gpu_two_streams_in_a_graph_equal_the_chains_in_turn(m):
    """K3's widths at a TP 16 rank (E 896, top-16, latent 3584, I 192 in MXFP4; the shared experts 384 x 7168), the
    op captured in a CUDA graph behind the kernels that write its inputs, replayed on fresh inputs with the outputs
    poisoned before each replay; each replay equals the op run in turn on one stream and the reference. M 16 is the
    decode form's largest (two blocks of 8 tokens); M 40 takes the routed experts' sorted form and the products' large-M
    path."""
    routed = list(moe_experts_inputs(m, 16, 896, 192, 3584, torch.bfloat16, mxfp4=True, seed=m, device="cuda"))
    shared = list(shared_inputs(m, 7168, 384, torch.bfloat16, m, "cuda"))
    z_src, x_src = torch.empty_like(routed[0]), torch.empty_like(shared[0])
    EXPERTS_BESIDE.clear()
    for _ in range(2):   # build the kernels, then a warm call
        call(routed, shared, backend="auto")
    assert {c.impl for c in EXPERTS_BESIDE.choices()} == {"two streams"}
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        routed[0].copy_(z_src)    # the inputs' writers right ahead, as in the step
        shared[0].copy_(x_src)
        outs = call(routed, shared, backend="auto")
    for seed in range(3):
        z_src.copy_(torch.randn(z_src.shape, device="cuda", generator=torch.Generator("cuda").manual_seed(seed)))
        x_src.copy_(torch.randn(x_src.shape, device="cuda", generator=torch.Generator("cuda").manual_seed(50 + seed)))
        for o in outs:
            o.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        fresh_routed, fresh_shared = [z_src.clone(), *routed[1:]], [x_src.clone(), *shared[1:]]
        with mock.patch.object(side_stream, "in_turn_reason", lambda *args: "forced"):
            in_turn = call(fresh_routed, fresh_shared, backend="auto")
        ref = reference(fresh_routed, fresh_shared)
        for o, t, r in zip(outs, in_turn, ref):
            assert rel_err(o, t) <= 2 ** -8 and rel_err(o, r) <= 2e-2
