"""The experts-beside fold (patterns/experts_beside.py): a latent MoE layer's routed experts and its shared experts'
chain (two products, the model's SiTU-GLU, the down product) become one ``k3::experts_beside`` after the other passes
made them k3 ops, exactly where the glue is the model's and every product is plain, and the layer equals eager."""
from __future__ import annotations

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from k3compile.model.config import KimiK3Config
from k3compile.model.moe import KimiLatentMoE
from k3compile.ops.experts_beside import EXPERTS_BESIDE
from k3compile.patterns.experts_beside import FACT
from k3compile.testing import eager_then_optimized, rel_err

pytestmark = pytest.mark.usefixtures("no_graph_caches")   # tests/conftest.py

PASSES = ("latent_moe_tail", "moe_experts", "moe_route", "upcast_matmul", "skinny_gemm", "route_beside",
          "experts_beside")
# the interpreter truncates bf16 casts (tests/ops/test_moe_experts.py)
TOL = {torch.float32: 1e-5, torch.bfloat16: 3e-2}


class Layer(torch.nn.Module):
    """A latent MoE layer of the tiny K3 (model/moe.py), its input made in the graph as a mix's output is (the
    static-weight proof can hold). ``tap``: also return the shared experts' gate product (a reader outside the glue)."""

    def __init__(self, dtype, tap=False, **overrides):
        super().__init__()
        cfg = KimiK3Config.tiny(**overrides).text_config
        self.moe = KimiLatentMoE(cfg)
        for p in self.moe.parameters():
            torch.nn.init.normal_(p, std=0.1)
        self.moe.to(dtype)
        self.tap, self.tapped = tap, None
        if tap:
            self.moe.shared_experts.gate_proj.register_forward_hook(self._keep)

    def _keep(self, module, args, out):
        self.tapped = out

    def forward(self, x):
        out = self.moe(torch.tanh(x))
        return (out, self.tapped) if self.tap else out


def compile_and_run(model, x, passes=PASSES):
    return eager_then_optimized(model, x, passes=passes, records=(EXPERTS_BESIDE,))


# each example compiles a graph (seconds): few examples
@settings(max_examples=max(3, settings.default.max_examples // 6))
@given(m=st.integers(1, 16), dtype=st.sampled_from([torch.float32, torch.bfloat16]), seed=st.integers(0, 99))
@example(m=1, dtype=torch.bfloat16, seed=0)    # a decode step
@example(m=5, dtype=torch.float32, seed=1)
def test_routed_and_shared_experts_fold_and_equal_eager(m, dtype, seed):
    torch.manual_seed(seed)
    model = Layer(dtype)
    x = torch.randn(1, m, model.moe.shared_experts.gate_proj.weight.shape[1]).to(dtype)
    out, ref, record = compile_and_run(model, x)
    assert record.matches["experts_beside"] == record.facts[FACT] == 1
    assert record.matches["route_beside"] == 1   # it took the latent down-projection, not a shared product
    (choice,) = EXPERTS_BESIDE.choices()
    assert choice.impl == "in turn" and choice.key[2] == f"N={x.shape[-1]}"
    assert record.facts["static_weight"]["experts_beside"] == {"proven": 3, "not proven": {}}
    assert rel_err(out, ref) <= TOL[dtype]


def test_without_a_latent_projection_nothing_is_folded_or_expected():
    """The routed experts read the layer's input itself and the shared down product takes their output as its
    residual: no chain beside them. The routing beside a product still takes a product of the input."""
    model = Layer(torch.float32, routed_expert_hidden_size=None)
    out, ref, record = compile_and_run(model, torch.randn(1, 2, 128))
    assert record.matches["experts_beside"] == record.facts[FACT] == 0 and record.matches["moe_experts"] == 1
    assert record.matches["route_beside"] == 1
    assert rel_err(out, ref) <= 1e-5


def test_silu_shared_experts_are_not_folded():
    """Kimi Linear's SiLU: the glue is not the SiTU-GLU the op's pattern spells (nor the routed experts' op's)."""
    model = Layer(torch.float32, hidden_act="silu")
    out, ref, record = compile_and_run(model, torch.randn(1, 2, 128))
    assert record.matches["experts_beside"] == record.facts[FACT] == 0
    assert rel_err(out, ref) <= 1e-5


def test_a_shared_product_read_outside_the_glue_is_not_folded():
    model = Layer(torch.float32, tap=True)
    out, ref, record = compile_and_run(model, torch.randn(1, 2, 128))
    assert record.matches["experts_beside"] == 0 and record.matches["moe_experts"] == 1
    assert rel_err(out[0], ref[0]) <= 1e-5 and rel_err(out[1], ref[1]) <= 1e-5


def test_prefill_rows_above_the_small_m_limit_no_fold():
    """M 40: the shared products stay ``mm`` (the skinny-GEMM pass's limit): nothing folded, nothing expected."""
    model = Layer(torch.float32)
    out, ref, record = compile_and_run(model, torch.randn(1, 40, 128))
    assert record.matches["experts_beside"] == record.facts[FACT] == 0 and record.matches["moe_experts"] == 1
    assert rel_err(out, ref) <= 1e-5


def test_without_the_routed_experts_pass_nothing_is_folded_or_expected():
    model = Layer(torch.float32)
    passes = tuple(p for p in PASSES if p != "moe_experts")
    out, ref, record = compile_and_run(model, torch.randn(1, 2, 128), passes=passes)
    assert record.matches["experts_beside"] == 0 and "graph_moe_experts_candidates" not in record.facts
    assert rel_err(out, ref) <= 1e-5
