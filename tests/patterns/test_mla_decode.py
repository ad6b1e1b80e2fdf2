"""The MLA decode rewrite on a step function: each decode-step attention (the model's ``mla_attend`` after its cache
write, with and without left padding) becomes ``k3::mla_decode`` and the step equals eager; a near miss beside them
stays as it is.

Caches are off (a hit would skip the pass). Each case compiles one small step (Inductor's CPU code generation);
the micro K3 (a prefill graph left alone, a decode graph rewritten) shares
tests/compiler/test_tiny_k3.py's compiled model.
"""
from __future__ import annotations

import pytest
import torch
import torch._inductor.inductor_prims
from torch._inductor.utils import run_and_get_code

from k3compile.model.mla import mla_attend, write_latent
from k3compile.passes import COMPILE_RECORD, K3Options, K3PostGradPass
from k3compile.testing import rel_err
from k3compile.patterns import mla_decode as pattern

H, N, R, VD, LK, S = 3, 8, 4, 6, 10, 24
SCALE = (N + R) ** -0.5
TOL = {torch.float32: 1e-5, torch.bfloat16: 3e-2}

PREPARE_ONLINE = torch._inductor.inductor_prims.prepare_softmax_online  # an OpOverload (registered on import)

pytestmark = pytest.mark.usefixtures("no_graph_caches")   # tests/conftest.py


def near_miss_attend(q_nope, q_pe, c_kv, k_pe, w_kv_b, pos, scale):
    """``mla_attend`` with a finite mask fill: a query that sees no key would average every key instead of NaN,
    another function (the guard checks the fill is -inf)."""
    N_ = q_nope.shape[-1]
    T_, S_ = q_nope.shape[1], c_kv.shape[1]
    w_k, w_v = w_kv_b[:, :N_], w_kv_b[:, N_:]
    q_lat = torch.einsum("bthn,hnl->bthl", q_nope, w_k)
    scores = torch.einsum("bthl,bsl->bhts", q_lat, c_kv) + torch.einsum("bthr,bsr->bhts", q_pe, k_pe)
    visible = torch.arange(S_)[None, :] <= (pos + torch.arange(T_))[:, None]
    scores = scores.float().mul(scale).masked_fill(~visible, -1e4)
    probs = torch.softmax(scores, dim=-1).to(c_kv.dtype)
    return torch.einsum("bthl,hvl->bthv", torch.einsum("bhts,bsl->bthl", probs, c_kv), w_v)


def layer(attend):
    """One MLA layer's step as the model writes it (model/mla.py ``KimiMLAAttention.forward``, projections given):
    the new latents written at pos.., then the attention over the whole cache (``start``: left padding)."""
    def step(q, kv, c_kv, k_pe, w, pos, *start):
        B, T = q.shape[:2]
        q = q.reshape(B, T, H, N + R)
        write_latent(c_kv, pos, kv[..., :LK])
        write_latent(k_pe, pos, kv[..., LK:])
        o = attend(q[..., :N], q[..., N:], c_kv, k_pe, w.reshape(H, N + VD, LK), pos, SCALE, *start)
        return o.reshape(B, T, -1)
    return step


def make_layer_inputs(B, T, pos, dtype, seed, padded):
    """With ``padded``, row b's first real position (5 b) mod (pos + T): at T = 1 never past pos (the decode token
    is real), at T > 1 possibly past it (left-padding queries, which see their own key)."""
    g = torch.Generator().manual_seed(seed)

    def r(*shape):
        return torch.randn(*shape, generator=g).to(dtype)

    start = [torch.tensor([(5 * b) % (pos + T) for b in range(B)])] if padded else []
    return [r(B, T, H * (N + R)), r(B, T, LK + R), r(B, S, LK), r(B, S, R), r(H * (N + VD), LK) * N ** -0.5,
            torch.tensor(pos)] + start


class OnlineSoftmaxFirst(K3PostGradPass):
    """Inductor's GPU-only online-softmax rewrite, then ours: the graph a GPU compile gives our pass."""
    online = pattern.online_softmax_pass()

    def __call__(self, graph):
        assert self.online.apply(graph) > 0 and graph.find_nodes(op="call_function", target=PREPARE_ONLINE)
        super().__call__(graph)


def compile_and_count(attends, B, T, dtype, backend, pass_cls=K3PostGradPass):
    """Layers ``attends`` -- (attention, padded) pairs -- in one graph (each on its own cache), compiled with the
    pass: (matches, graph facts), after checking the outputs and the caches equal eager's."""
    steps = [layer(a) for a, _ in attends]

    def fn(*per_layer):
        return torch.cat([step(*args) for step, args in zip(steps, per_layer)], -1)

    inputs = [make_layer_inputs(B, T, S - T - 3, dtype, seed, padded) for seed, (_, padded) in enumerate(attends)]
    eager_inputs = [[t.clone() for t in args] for args in inputs]
    ref = fn(*eager_inputs)
    torch._dynamo.reset()
    COMPILE_RECORD.take()
    pass_ = pass_cls(K3Options(backend=backend, passes=("mla_decode",)))
    compiled = torch.compile(fn, fullgraph=True, dynamic=False, options={"post_grad_custom_post_pass": pass_})
    out, (code,) = run_and_get_code(compiled, *inputs)
    (record,) = COMPILE_RECORD.take()
    assert rel_err(out, ref) < TOL[dtype]
    for got, want in zip(inputs, eager_inputs):                  # the cache writes stay in the graph
        assert torch.equal(got[2], want[2]) and torch.equal(got[3], want[3])
    assert code.count("torch.ops.k3.mla_decode.default(") == record.matches["mla_decode"]
    return record.matches["mla_decode"], record.facts["graph_mla_decode_masks"]


@pytest.mark.parametrize("dtype,B,T,backend", [
    (torch.float32, 2, 1, "triton"),       # a decode step: the Triton kernel (interpreted) on strided query slices
    (torch.bfloat16, 1, 2, "reference"),   # two tokens (verifying a draft), batch 1: the third trace
    (torch.float32, 3, 4, "reference"),    # four tokens, batch 3: the second trace
], ids=["fp32-B2-T1-triton", "bf16-B1-T2", "fp32-B3-T4"])
def test_each_decode_attention_fires_and_the_near_miss_does_not(dtype, B, T, backend):
    layers = [(mla_attend, False), (mla_attend, True), (near_miss_attend, False)]      # plain, left-padded, miss
    matches, masks = compile_and_count(layers, B, T, dtype, backend)
    assert (matches, masks) == (2, 2)


@pytest.mark.skipif(pattern.online_softmax_pass() is None, reason="this torch has no online-softmax rewrite")
def test_decode_attention_fires_on_the_gpu_softmax_form():
    """On a GPU Inductor turns the softmax into ``prepare_softmax_online`` before our pass (post_grad.py's
    ``prepare_softmax_*``): the step still matches (the H200 run missed it before the online trace). No near miss
    here: Inductor's CPU backend cannot lower the online form, which a GPU graph only has."""
    layers = [(mla_attend, False), (mla_attend, True)]
    assert compile_and_count(layers, 2, 1, torch.bfloat16, "reference", OnlineSoftmaxFirst) == (2, 2)


@pytest.mark.skipif(pattern.online_softmax_pass() is None, reason="this torch has no online-softmax rewrite")
@pytest.mark.parametrize("T", [1, 2], ids=lambda t: f"T{t}")
def test_decode_attention_fires_on_the_gpu_batch_one_form(monkeypatch, T):
    """On a GPU Inductor also turns a ``bmm`` of batch 1 into ``squeeze``, ``mm``, ``unsqueeze`` (joint_graph.py
    ``bmm_to_mm``, GPU only): the H200's batch-1 decode step matched nothing before that form was traced. Inductor's
    own rewrite is made to fire here (its device check patched, after our patterns are registered)."""
    from torch._inductor.fx_passes import joint_graph

    from k3compile.passes import _register

    _register(K3Options(backend="reference", passes=("mla_decode",)))
    monkeypatch.setattr(joint_graph, "check_device", lambda a, b, device=None: True)
    layers = [(mla_attend, False), (mla_attend, True)]
    assert compile_and_count(layers, 1, T, torch.bfloat16, "reference", OnlineSoftmaxFirst) == (2, 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("B,T,sizes", [(2, 1, {"B 2 T 1"}), (3, 4, {"B 2 T 2"}), (1, 2, {"B 1 T 2"}),
                                       (1, 1, {"B 2 T 1", "B 1 T 2"})], ids=["B2-T1", "B3-T4", "B1-T2", "B1-T1"])
def test_a_decode_graph_traces_only_the_searches_of_its_sizes(B, T, sizes, dtype):
    """Each trace size and dtype is a group of its own (``pattern.groups``), traced for a graph holding a decode step
    of its size computed in its dtype only: a batch-2 bf16 decode step traces the (2, 1) bf16 searches, not the
    forty of every size, dtype and form."""
    from k3compile import passes

    options = K3Options(backend="reference", passes=("mla_decode",),
                        small_m_limit=200 + 10 * B + T + (dtype == torch.bfloat16))   # fresh
    from k3compile.patterns._common import fake_mode

    with fake_mode():   # the graph our pass gets: traced, then Inductor's passes before ours
        graph = pattern._trace(layer(mla_attend), make_layer_inputs(B, T, S - T - 3, dtype, 0, False)).graph
    assert pattern.facts(graph, options)["graph_mla_decode_masks"] == 1
    before = len(passes.REGISTRATIONS)
    passes._register(options, graph)
    groups = passes._REGISTERED[options].groups["mla_decode"]
    name = str(dtype).removeprefix("torch.")
    assert {groups[i].name for _, i in passes.REGISTRATIONS[before:]} == {f"plain softmax, {s}, {name}"
                                                                         for s in sizes}
