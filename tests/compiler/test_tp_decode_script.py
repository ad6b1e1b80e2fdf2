"""benchmarks/tp_decode.py: its helpers (cheap), and the script itself at TP=2 on two gloo processes (slow)."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "tp_decode.py"


def _load_script():
    spec = importlib.util.spec_from_file_location("tp_decode", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


tp_decode = _load_script()


@given(world=st.integers(1, 16), heads=st.integers(1, 128))
def test_heads_for_splits_over_world(world, heads):
    got = tp_decode._heads_for(world, heads)
    assert got % world == 0 and heads <= got < heads + world
    if heads % world == 0:
        assert got == heads


@pytest.mark.parametrize("world", [1, 2, 8, 16], ids=lambda w: f"TP{w}")
def test_micro_config_builds_sharded_at_world(world):
    from k3compile.model import KimiK3ForConditionalGeneration, TPContext

    args = tp_decode.parse_args(["--config", "micro", "--world-size", str(world), "--backend", "gloo"])
    config = tp_decode.make_config(args, world)
    with torch.device("meta"):
        model = KimiK3ForConditionalGeneration(config, TPContext(rank=world - 1, world=world))
    assert model.text_model.layers[0].self_attn.num_heads * world == config.text_config.linear_attn_config["num_heads"]


def test_collective_plan_micro_one_all_reduce_saved_per_moe_layer():
    from k3compile.model import KimiK3Config

    plan = tp_decode.collective_plan(KimiK3Config.micro().text_config)
    # the embedding + 4 attention layers + 1 dense MLP + 2 per MoE layer (3): the fused tail saves one per MoE layer
    assert plan == dict(layers=4, moe_layers=3, unfused=12, fused=9)


def test_counter_counts_all_reduces_and_wrapped_k3_ops():
    from torch._higher_order_ops.auto_functionalize import auto_functionalized

    g = torch.fx.Graph()
    x = g.placeholder("x")
    for _ in range(3):
        ar = g.call_function(torch.ops._c10d_functional.all_reduce.default, (x, "sum", "0"))
        x = g.call_function(torch.ops._c10d_functional.wait_tensor.default, (ar,))
    g.call_function(torch.ops.aten.relu.default, (x,))
    g.call_function(auto_functionalized, (torch.ops.aten.relu_.default,), {"self": x})
    counter = tp_decode.CollectiveCounter()
    counter.phase = "decode"
    counter(g)
    counts = counter.take("decode")
    assert counts["all_reduce"] == 3 and counts["latent_moe_tail"] == 0
    assert tp_decode._op_name(list(g.nodes)[-1]) == "aten.relu_"
    with pytest.raises(RuntimeError, match="expected one compiled graph"):
        counter.take("decode")            # taken once; a phase without a graph is an error
    assert counter.uuid() is None         # no identity: Inductor's caches are bypassed, every graph counted


def test_compare_logits_median_row_ties_flips_and_nan():
    from _common import compare_logits   # importable once tp_decode is loaded (its folder is on sys.path)

    ref = torch.randn(3, 4, 50, generator=torch.Generator().manual_seed(0))
    near = ref + 1e-3 * torch.randn(ref.shape, generator=torch.Generator().manual_seed(1))
    out = compare_logits(near, ref, 1e-2)
    assert out["ok"] and len(out["rel_err_steps"]) == 3 and out["rel_err"] < 1e-2 and out["within_tol"] == 1.0
    tie = ref.clone()                                   # one row's top two swapped: a tie, not an error
    top2 = ref[1, 0].topk(2).indices
    tie[1, 0, top2[0]], tie[1, 0, top2[1]] = ref[1, 0, top2[1]], ref[1, 0, top2[0]]
    out = compare_logits(tie, ref, 1e-2)
    assert out["ok"] and out["top1_agree"] == pytest.approx(11 / 12)
    flip = near.clone()                                 # one row 30% off (another expert at a near-tie): passes
    flip[2, 3] += 0.3 * ref[2, 3].norm() * torch.nn.functional.normalize(torch.randn(50), dim=0)
    out = compare_logits(flip, ref, 1e-2)
    assert out["ok"] and out["rel_err_max"] > 0.2 and out["within_tol"] == pytest.approx(11 / 12)
    assert out["rel_err_steps"][2] > out["rel_err_steps"][0]
    wrong = ref * 1.5                                   # every row off: an error
    out = compare_logits(wrong, ref, 1e-2)
    assert not out["ok"] and out["rel_err"] == pytest.approx(0.5)
    near[0, 0, 0] = float("nan")
    out = compare_logits(near, ref, 10.0)
    assert not out["ok"] and out["rel_err"] != out["rel_err"]


@pytest.mark.slow
@pytest.mark.deep   # ~80 s; the teacher-forced comparison is tested above, TP fusion by test_latent_moe_tail_compiled
def test_script_tp2_gloo_micro_teacher_forced_logits_and_all_reduces(tmp_path):
    out = tmp_path / "tp2.json"
    cmd = [sys.executable, str(SCRIPT), "--backend", "gloo", "--world-size", "2", "--config", "micro",
           "--batch", "1", "--steps", "2", "--eager-prefill", "--json", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900,
                          env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["ok"] and result["meta"]["env"]["NCCL_NVLS_ENABLE"] == "0"
    (row,) = result["rows"]
    assert len(row["ranks"]) == 2
    for rank in row["ranks"]:
        assert rank["logits_finite"] and rank["logits_ok"] and rank["logits_rel_err"] < 1e-5
        assert len(rank["logits_rel_err_steps"]) == 3 and rank["top1_agree"] == 1.0     # prefill + 2 steps
        assert (rank["unfused_all_reduce"], rank["fused_all_reduce"], rank["fused_tails"]) == (12, 9, 3)
    assert "M AR unfused" in proc.stdout and "MISMATCH" not in proc.stdout
