"""The KDA decode rewrite on a step function (the model's own functions, two layers in one graph): both gate forms
fire, the compiled step equals eager with its states updated in place and no copy of them left in the output code
(only the generated code can show that), and near misses do not fire. The whole micro K3 (every KDA layer of its
decode graph, none of its prefill; the prefill pass beside it) is in tests/compiler/test_tiny_k3.py, sharing its
compiled model.

Caches are off (a hit would skip the pass); each test compiles one small step function through tests/conftest.py's
PassHarness.
"""
from __future__ import annotations

import copy

import pytest
import torch
from torch._inductor.utils import run_and_get_code

from k3compile.model.kda import (
    gated_rms_norm, kda_gate_lower_bound, kda_gate_softplus, kda_recurrent_step, l2_normalize, short_conv_decode,
)
from k3compile.testing import assert_kda_states_not_copied, rel_err as rel

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


# ---------------------------------------------------------------------------------------------------
# One step function: both gate forms and dtypes; near misses

B, H, K, W = 2, 3, 16, 4
P = H * K


def make_inputs(act_dtype, param_dtype, seed=0):
    g = torch.Generator().manual_seed(seed)

    def r(*shape, dt=act_dtype, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(dt)

    return [r(B, P), r(B, P), r(B, P), r(B, P), r(B, H), r(B, P),                        # q k v f b G projections
            r(B, P, W - 1), r(B, P, W - 1), r(B, P, W - 1),                              # conv states
            r(P, 1, W, dt=param_dtype, scale=0.5), r(P, 1, W, dt=param_dtype, scale=0.5),
            r(P, 1, W, dt=param_dtype, scale=0.5),
            torch.empty(H).uniform_(1, 16, generator=g).log().to(param_dtype), r(P, dt=param_dtype),
            (1 + r(K, dt=param_dtype, scale=0.1)), r(B, H, K, K, dt=torch.float32)]


def model_step(lower_bound, l2_eps=1e-6):
    """The model's own decode step (model/kda.py functions), on one layer's tensors."""
    def step(qp, kp, vp, fp, bp, gp, cq, ck, cv, wq, wk, wv, A_log, dt_bias, onw, state):
        q = short_conv_decode(qp, cq, wq)
        k = short_conv_decode(kp, ck, wk)
        v = short_conv_decode(vp, cv, wv)
        f = fp.reshape(B, H, K)
        g = (kda_gate_lower_bound(f, A_log, dt_bias, lower_bound) if lower_bound is not None
             else kda_gate_softplus(f, A_log, dt_bias))
        beta = torch.sigmoid(bp.float())
        q = l2_normalize(q.reshape(B, H, K), l2_eps) * K ** -0.5
        k = l2_normalize(k.reshape(B, H, K), l2_eps)
        o = kda_recurrent_step(q, k, v.reshape(B, H, K).float(), g, beta, state)
        return gated_rms_norm(o, gp.reshape(B, H, K), onw, 1e-5).reshape(B, P)
    return step


def two_steps(first, second):
    """Two layers' steps in one graph (the second on its own states), outputs summed."""
    def fn(inputs_a, inputs_b):
        return first(*inputs_a) + second(*inputs_b)
    return fn


def compile_count_and_check(pass_harness, fn, inputs_a, inputs_b, dtype):
    """Compile ``fn`` with the kda_decode pass only: outputs and the states (updated in place) equal eager, no state
    copied; returns the matches, each one a ``k3::kda_decode`` call in place of the step's ATen ops."""
    ref_a, ref_b = copy.deepcopy(inputs_a), copy.deepcopy(inputs_b)
    ref = fn(ref_a, ref_b)
    harness = pass_harness(backend="triton", passes=("kda_decode",))
    out, (code,) = run_and_get_code(harness.compile(fn, fullgraph=True), inputs_a, inputs_b)
    assert rel(out, ref) < TOL[dtype]
    for got, want in zip(inputs_a + inputs_b, ref_a + ref_b):        # states updated in place, as eager
        assert rel(got, want) < TOL[dtype] or want.norm() == 0
    assert_kda_states_not_copied(code)
    assert harness.facts("graph_kda_decode_convs") == [6]     # two steps, three one-token conv windows each
    n = harness.matches("kda_decode")
    harness.check(added={torch.ops.k3.kda_decode.default: n})
    return n


@pytest.mark.parametrize("act,param", [("bf16", "fp32"), ("fp32", "fp32")], ids=["bf16-fp32params", "fp32"])
def test_both_gate_forms_fire_and_equal_eager(act, param, pass_harness):
    dt = {"bf16": torch.bfloat16, "fp32": torch.float32}
    fn = two_steps(model_step(-5.0), model_step(None))
    inputs_a, inputs_b = make_inputs(dt[act], dt[param], 0), make_inputs(dt[act], dt[param], 1)
    n = compile_count_and_check(pass_harness, fn, inputs_a, inputs_b, dt[act])
    assert n == 2


def test_near_misses_do_not_fire(pass_harness):
    """Another L2-norm eps is another function: the step must stay unfused (and correct); a true step
    beside it still fuses. A model cast whole to bf16 (bf16 parameters) is the third trace."""
    bf16 = torch.bfloat16
    fn = two_steps(model_step(-5.0, l2_eps=1e-5), model_step(-5.0))
    n = compile_count_and_check(pass_harness, fn, make_inputs(bf16, bf16, 0), make_inputs(bf16, bf16, 1), bf16)
    assert n == 1


@pytest.mark.parametrize("act,param,group", [(torch.float32, torch.float32, "float32 activations"),
                                             (torch.bfloat16, torch.bfloat16, "bfloat16 activations")],
                         ids=["fp32", "bf16"])
def test_a_decode_graph_traces_only_its_activation_dtypes_searches(act, param, group, pass_harness):
    """A group an activation dtype (``pattern.groups``), traced for a graph whose conv windows are computed from
    values of that dtype: a bf16 decode step does not trace the fp32 searches, and still matches."""
    from k3compile import passes
    from k3compile.passes import K3Options

    fresh = 300 + (act == torch.bfloat16)   # options no other test registers
    harness = pass_harness(backend="reference", passes=("kda_decode",), small_m_limit=fresh)
    before = len(passes.REGISTRATIONS)
    harness.compile(model_step(-5.0), fullgraph=True)(*make_inputs(act, param))
    groups = passes._REGISTERED[K3Options(backend="reference", passes=("kda_decode",), small_m_limit=fresh)]
    assert {groups.groups["kda_decode"][i].name for _, i in passes.REGISTRATIONS[before:]} == {group}
    assert harness.matches("kda_decode") == 1
