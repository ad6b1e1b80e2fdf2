"""k3::route_beside: the router's product and routing beside another product of the same input, against its plain
reference (the model's ``route`` on the upcast product, and the product); its checks; on the GPU, the two streams
inside a CUDA graph replayed on fresh inputs equal the same op run in turn, bit for bit."""
from __future__ import annotations

from unittest import mock

import pytest
import torch
from hypothesis import example, given, settings, strategies as st

from k3compile.ops.route_beside import ROUTE_BESIDE, route_beside, route_beside_ref
from k3compile.ops import side_stream
from k3compile.testing import rel_err


def inputs(m, k, e, n, dtype, seed, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(m, k, generator=g).to(dtype)
    router_w = (torch.randn(e, k, generator=g) / k ** 0.5).to(dtype)
    bias = torch.randn(e, generator=g) * 0.1
    w = (torch.randn(n, k, generator=g) / k ** 0.5).to(dtype)
    return [t.to(device) for t in (a, router_w, bias, w)]


def separated(a, router_w, bias, top_k) -> bool:
    """The k-th and (k+1)-th keys apart by more than the products' rounding: the top-k is not decided by it."""
    keys = torch.sigmoid(a.float() @ router_w.float().T) + bias
    if top_k == keys.shape[1]:
        return True
    top = keys.topk(top_k + 1, dim=-1).values
    return bool((top[:, -2] - top[:, -1] > 1e-4).all())


@settings(max_examples=max(8, settings.default.max_examples // 3))   # interpreted kernels
@given(m=st.integers(1, 20), k=st.integers(8, 96), e=st.integers(2, 40), k_frac=st.floats(0, 1),
       n=st.integers(1, 80), dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
       renorm=st.booleans(), scaling=st.sampled_from([1.0, 2.5]), backend=st.sampled_from(["reference", "triton"]),
       seed=st.integers(0, 99))
@example(m=1, k=64, e=32, k_frac=0.5, n=48, dtype=torch.bfloat16, renorm=True, scaling=2.5, backend="triton", seed=0)
@example(m=17, k=40, e=9, k_frac=1.0, n=3, dtype=torch.float32, renorm=False, scaling=1.0, backend="triton", seed=1)
def test_op_equals_reference(m, k, e, k_frac, n, dtype, renorm, scaling, backend, seed):
    top_k = 1 + round(k_frac * (e - 1))
    a, router_w, bias, w = inputs(m, k, e, n, dtype, seed)
    if not separated(a, router_w, bias, top_k):
        return   # a near-tie the two products' summation orders may break either way
    eps = 1e-20 if renorm else None
    weights, experts, y = route_beside(a, router_w, bias, top_k, w, eps, scaling, backend=backend,
                                       route_backend=backend)
    ref_w, ref_e, ref_y = route_beside_ref(a, router_w, bias, top_k, eps, scaling, w)
    assert experts.dtype == torch.int64 and torch.equal(experts, ref_e)
    torch.testing.assert_close(weights, ref_w, rtol=1e-5, atol=1e-6)
    assert y.dtype == dtype and y.shape == (m, n) and not y.isnan().any()
    # the 16-bit product: fp32 accumulation rounded once (the interpreter truncates: one ulp either way)
    assert rel_err(y, ref_y) <= (1e-5 if dtype == torch.float32 else 2 * torch.finfo(dtype).eps)


def test_on_the_cpu_the_chains_run_in_turn_and_say_why():
    ROUTE_BESIDE.clear()
    route_beside(*inputs(2, 16, 8, 12, torch.float32, 0)[:3], 2, inputs(2, 16, 8, 12, torch.float32, 0)[3])
    (choice,) = ROUTE_BESIDE.choices()
    assert choice.impl == "in turn" and "cpu" in choice.reason


def test_fake_gives_the_outputs_shapes_and_dtypes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        a, router_w, bias, w = (torch.empty(3, 64, dtype=torch.bfloat16), torch.empty(10, 64, dtype=torch.bfloat16),
                                torch.empty(10), torch.empty(20, 64, dtype=torch.bfloat16))
        weights, experts, y = torch.ops.k3.route_beside(a, router_w, bias, 4, 1e-20, 1.0, w)
    assert (weights.shape, weights.dtype) == ((3, 4), torch.float32)
    assert (experts.shape, experts.dtype) == ((3, 4), torch.int64)
    assert (y.shape, y.dtype) == ((3, 20), torch.bfloat16)


@pytest.mark.parametrize("bad, match", [
    (dict(w=torch.randn(5, 15)), "disagree on K"),
    (dict(router_w=torch.randn(8, 16, dtype=torch.bfloat16)), "must be a's dtype"),
    (dict(bias=torch.randn(7)), r"bias must be \[E=8\]"),
    (dict(bias=torch.randn(8, dtype=torch.float64)), "bias must be"),
    (dict(top_k=9), r"top_k must be in \[1, E=8\]"),
    (dict(top_k=0), "top_k must be"),
    (dict(a=torch.randn(2, 3, 16)), "must be 2-D"),
])
def test_bad_arguments_raise(bad, match):
    args = dict(a=torch.randn(2, 16), router_w=torch.randn(8, 16), bias=torch.randn(8), top_k=2, w=torch.randn(5, 16))
    args.update(bad)
    with pytest.raises(ValueError, match=match):
        route_beside(**args)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 8, 40])
def test_gpu_two_streams_in_a_graph_equal_the_chains_in_turn(m):
    """K3's widths at a TP 16 rank (K 7168, E 896, top-16, the latent down-projection's 3584 rows), the op captured
    in a CUDA graph behind the kernel that writes its input, replayed on fresh inputs; each replay equals the op run
    in turn on one stream, bit for bit (the same kernels), with the outputs poisoned before each replay. M 40 takes
    the products' large-M path."""
    a, router_w, bias, w = inputs(m, 7168, 896, 3584, torch.bfloat16, m, "cuda")
    src = torch.empty_like(a)
    ROUTE_BESIDE.clear()
    for _ in range(2):   # build the kernels, then a warm call
        route_beside(a, router_w, bias, 16, w, 1e-20, 2.5)
    assert {c.impl for c in ROUTE_BESIDE.choices()} == {"two streams"}
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        a.copy_(src)   # the input's writer right ahead, as the mix is in the step
        outs = route_beside(a, router_w, bias, 16, w, 1e-20, 2.5)
    for seed in range(3):
        src.copy_(inputs(m, 7168, 896, 3584, torch.bfloat16, 100 + seed, "cuda")[0])
        for o in outs:
            o.fill_(-1 if o.dtype == torch.int64 else float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        with mock.patch.object(side_stream, "in_turn_reason", lambda *args: "forced"):
            ref = route_beside(src, router_w, bias, 16, w, 1e-20, 2.5)
        for o, r in zip(outs, ref):
            assert torch.equal(o, r)
        ref_w, ref_e, ref_y = route_beside_ref(src, router_w, bias, 16, 1e-20, 2.5, w)
        assert torch.equal(outs[1].sort(-1).values, ref_e.sort(-1).values) or not separated(src, router_w, bias, 16)
        assert rel_err(outs[2], ref_y) <= 2 * torch.finfo(torch.bfloat16).eps
