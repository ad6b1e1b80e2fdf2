"""``k3::products_beside``: an input's large products on the current stream and its small ones (and products of their
outputs) on a second stream, equal to every product computed alone (``reference.py``)."""
from __future__ import annotations

from unittest import mock

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from k3compile.ops import side_stream
from k3compile.ops.products_beside import PRODUCTS_BESIDE, dispatch, products_beside, products_beside_ref
from k3compile.testing import rel_err

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 5e-3}


def inputs(m, k, main, side, chain, dtype, seed=0, device="cpu"):
    """x [m, k] and weights of ``main`` / ``side`` rows; ``chain``: (side index, rows) of each chained product."""
    g = torch.Generator(device).manual_seed(seed)

    def randn(*shape):
        return (torch.randn(*shape, generator=g, device=device) * shape[-1] ** -0.5).to(dtype)

    x = randn(m, k) * k ** 0.5
    return (x, [randn(n, k) for n in main], [randn(n, k) for n in side],
            [randn(n, side[i]) for i, n in chain], [i for i, _ in chain])


@settings(max_examples=max(8, settings.default.max_examples // 2))   # interpreted kernels: about a second a case
@given(m=st.integers(1, 20), k=st.integers(1, 80), main=st.lists(st.integers(1, 70), min_size=1, max_size=4),
       side=st.lists(st.integers(1, 20), min_size=1, max_size=3), chain=st.lists(st.integers(1, 40), max_size=2),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
       backend=st.sampled_from(["reference", "triton", "auto"]), seed=st.integers(0, 99))
@example(m=1, k=64, main=[48, 48, 48, 48], side=[3, 8], chain=[48], dtype=torch.bfloat16, backend="triton", seed=0)
@example(m=17, k=33, main=[20], side=[5], chain=[], dtype=torch.float32, backend="auto", seed=1)  # above m_limit
def test_op_equals_reference(m, k, main, side, chain, dtype, backend, seed):
    chain = [(j % len(side), n) for j, n in enumerate(chain)]
    x, w_main, w_side, w_chain, chain_of = inputs(m, k, main, side, chain, dtype, seed)
    out = products_beside(x, w_main, w_side, w_chain, chain_of, backend=backend)
    ref = products_beside_ref(x, w_main, w_side, w_chain, chain_of)
    assert len(out) == len(ref) == len(main) + len(side) + len(chain)
    for o, r in zip(out, ref):
        assert o.shape == r.shape and o.dtype == r.dtype
        assert rel_err(o, r) <= TOL[dtype]


def test_on_the_cpu_the_chains_run_in_turn_and_say_why():
    PRODUCTS_BESIDE.clear()
    products_beside(*inputs(2, 16, [8, 8], [2], [(0, 8)], torch.float32), backend="reference")
    (choice,) = PRODUCTS_BESIDE.choices()
    assert choice.impl == "in turn" and choice.key == ("cpu", "N=8+8", "side=2")


def test_fake_gives_the_outputs_shapes_and_dtypes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        outs = products_beside(*inputs(3, 48, [40, 40], [6, 16], [(1, 40)], torch.bfloat16))
    assert [(tuple(o.shape), o.dtype) for o in outs] == [((3, n), torch.bfloat16) for n in (40, 40, 6, 16, 40)]


@pytest.mark.parametrize("bad, match", [
    (dict(w_main=[]), "needs main and side products"),
    (dict(w_side=[]), "needs main and side products"),
    (dict(w_main=[torch.randn(8, 15)]), "does not take x"),
    (dict(w_chain=[torch.randn(8, 3)]), "does not take side product 0"),
    (dict(chain_of=[1]), "outside the side products"),
    (dict(chain_of=[]), "chained weights but 0 chain_of"),
    (dict(w_side=[torch.randn(2, 16, dtype=torch.bfloat16)]), "must be x's dtype"),
    (dict(x=torch.randn(2, 1, 16)), "must be 2-D"),
])
def test_bad_arguments_raise(bad, match):
    args = dict(x=torch.randn(2, 16), w_main=[torch.randn(8, 16)], w_side=[torch.randn(2, 16)],
                w_chain=[torch.randn(8, 2)], chain_of=[0])
    args.update(bad)
    with pytest.raises(ValueError, match=match):
        products_beside(**args, backend="reference")


def test_flags_of_another_length_raise():
    x, w_main, w_side, w_chain, chain_of = inputs(2, 16, [8, 8], [2], [], torch.float32)
    with pytest.raises(ValueError, match="main_static_weight has 1 flags for 2 products"):
        torch.ops.k3.products_beside(x, w_main, w_side, w_chain, chain_of, "reference", 16, [True])


def test_the_side_chain_runs_triton_only_beside_enough_large_weights(monkeypatch):
    """64 MiB of large weights (a TP 8 rank's q, k, v and gate: 88 MB) take the Triton kernel on the side; a TP 16
    rank's (44 MB) the dispatch's pick; an explicit backend is kept."""
    from k3compile.call_sites import stand_in

    monkeypatch.setattr(dispatch, "triton_can_run_on", lambda *t: None)
    x = stand_in((1, 7168), torch.bfloat16, "cuda")
    tp8 = [stand_in((1536, 7168), torch.bfloat16, "cuda")] * 4
    tp16 = [stand_in((768, 7168), torch.bfloat16, "cuda")] * 4
    assert dispatch.side_backend(x, tp8, "auto") == "triton"
    assert dispatch.side_backend(x, tp16, "auto") == "auto"
    assert dispatch.side_backend(x, tp8, "cute") == "cute"
    assert dispatch.side_backend(stand_in((1, 7168), torch.bfloat16, "cpu"), tp8, "auto") == "auto"


def test_plan_is_every_product_with_its_flags(monkeypatch):
    """Planning on stand-ins composes each product's plan: the main ones with their flags and the dispatch's backend,
    the side ones with the side chain's, the chained one on a stand-in of its side output."""
    from k3compile.call_sites import stand_in
    from k3compile.ops.skinny_gemm import dispatch as skinny_gemm_dispatch

    planned = []
    monkeypatch.setattr(dispatch, "triton_can_run_on", lambda *t: None)
    monkeypatch.setattr(skinny_gemm_dispatch, "kernels", lambda a, w, bias, res, backend, m_limit, static, od, tf:
                        planned.append((tuple(a.shape), tuple(w.shape), backend, static, tf)) or [len(planned)])
    x = stand_in((2, 7168), torch.bfloat16, "cuda")
    w_main = [stand_in((1536, 7168), torch.bfloat16, "cuda")] * 4
    w_side = [stand_in((128, 7168), torch.bfloat16, "cuda"), stand_in((12, 7168), torch.bfloat16, "cuda")]
    w_chain = [stand_in((1536, 128), torch.bfloat16, "cuda")]
    builds = dispatch.kernels(x, w_main, w_side, w_chain, [0], "auto", 16, [True, True, False, True],
                              [False] * 4, [True, False], [True])
    assert builds == [1, 2, 3, 4, 5, 6, 7]
    assert planned == [((2, 7168), (1536, 7168), "auto", s, False) for s in (True, True, False, True)] + [
        ((2, 7168), (128, 7168), "triton", True, True), ((2, 7168), (12, 7168), "triton", False, True),
        ((2, 128), (1536, 128), "triton", True, True)]


@pytest.mark.gpu
@pytest.mark.parametrize("tp, m", [(8, 1), (8, 8), (16, 1), (16, 16), (16, 40)])
def test_gpu_two_streams_in_a_graph_equal_the_products_in_turn(tp, m):
    """A KDA layer's input projections at a TP ``tp`` rank (q, k, v and the output gate 12288 / tp x 7168; beta 96 /
    tp rows, the gate's rank 128 rows and its up-projection), the op captured in a CUDA graph behind the kernel that
    writes its input, replayed on fresh inputs with the outputs poisoned before each replay; each replay equals the
    op run in turn on one stream and the reference. M 40: every product's large-M path."""
    p = 12288 // tp
    x, w_main, w_side, w_chain, chain_of = inputs(m, 7168, [p] * 4, [96 // tp, 128], [(1, p)], torch.bfloat16, m,
                                                  "cuda")
    x_src = torch.empty_like(x)
    PRODUCTS_BESIDE.clear()
    for _ in range(2):   # build the kernels, then a warm call
        products_beside(x, w_main, w_side, w_chain, chain_of)
    assert {c.impl for c in PRODUCTS_BESIDE.choices()} == {"two streams"}
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        x.copy_(x_src)   # the input's writer right ahead, as in the step
        outs = products_beside(x, w_main, w_side, w_chain, chain_of)
    for seed in range(3):
        x_src.copy_(torch.randn(x_src.shape, device="cuda", generator=torch.Generator("cuda").manual_seed(seed)))
        for o in outs:
            o.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        fresh = x_src.clone()
        with mock.patch.object(side_stream, "in_turn_reason", lambda *args: "forced"):
            in_turn = products_beside(fresh, w_main, w_side, w_chain, chain_of)
        ref = products_beside_ref(fresh, w_main, w_side, w_chain, chain_of)
        for o, t, r in zip(outs, in_turn, ref):
            assert rel_err(o, t) <= 2 ** -8 and rel_err(o, r) <= 2e-2
