"""The measured picks as data (``k3compile/tables.py``): what the tuners write is what the dispatch reads, the
committed tables are in the writer's form, and a malformed table is refused with the reason."""
from __future__ import annotations

import copy
import importlib.util
import json
import os

import pytest
import torch

from k3compile import tables
from k3compile.kernels.cute.configs import MmaConfig, WgmmaConfig
from k3compile.ops.latent_moe_tail import dispatch as tail_dispatch
from k3compile.ops.latent_moe_tail.triton_config import TailConfig
from k3compile.ops.skinny_gemm import dispatch as gemm_dispatch
from k3compile.ops.skinny_gemm.triton_config import TritonConfig

BENCHMARKS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "benchmarks")
OPS = [gemm_dispatch, tail_dispatch]


def _benchmark(name):
    """A benchmarks/ module (they put their folder on sys.path for their helpers; so does this)."""
    import sys

    if BENCHMARKS not in sys.path:
        sys.path.insert(0, BENCHMARKS)
    spec = importlib.util.spec_from_file_location(name, os.path.join(BENCHMARKS, name + ".py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("dispatch", OPS, ids=["skinny_gemm", "latent_moe_tail"])
def test_committed_tables_are_in_the_writers_form(dispatch):
    """Each committed table re-dumps to its own text: one configuration and one pick a line, sorted."""
    folder = os.path.join(os.path.dirname(dispatch.__file__), "tables")
    for name in os.listdir(folder):
        path = os.path.join(folder, name)
        doc = json.load(open(path))
        table = tables.load(path, dispatch.KERNELS)
        text = tables.dumps(doc["op"], doc["gpu"], doc["sms"], table.picks, dispatch.KERNEL_OF, doc["tuner"],
                            doc["note"])
        assert text == open(path).read(), name


def test_gpu_names_find_their_table_else_the_fallback():
    assert tables.gpu_slug("NVIDIA H200") == "h200" and tables.gpu_slug("NVIDIA H100 80GB HBM3") == "h100_80gb_hbm3"
    folder = os.path.dirname(gemm_dispatch.__file__)
    assert tables.table_path(folder, "NVIDIA H200").endswith("tables/h200.json")
    assert tables.table_path(folder, "NVIDIA B200").endswith(f"tables/{tables.FALLBACK_GPU}.json")


def _timings():
    """Two shapes' timings, as a tuner gathers them: µs per (implementation, configuration)."""
    mma, wg = MmaConfig(warps_k=8, unroll=2, stages=3), WgmmaConfig(block_n=64, block_k=128, stages=6)
    tri = TritonConfig(block_m=16, block_n=32, block_k=128, split_k=1)
    return {
        # CuTe fastest (wgmma), Triton too beats cuBLAS by > 3%; with a static weight the mma.sync form wins
        ("bfloat16", 4, 7168, 3584, False): {"cublas": [(10.0, None)], "cute": [(8.0, mma), (7.0, wg)],
                                              "triton": [(9.0, tri)]},
        ("bfloat16", 4, 7168, 3584, True): {"cublas": [(10.0, None)], "cute": [(6.5, mma), (6.9, wg)],
                                             "triton": [(9.0, tri)]},
        # Triton fastest, CuTe second: CuTe is not listed (the dispatch tries it first or not at all); within 3%
        # of cuBLAS is no win
        ("bfloat16", 16, 20480, 7168, False): {"cublas": [(80.0, None)], "cute": [(75.0, mma)],
                                                "triton": [(70.0, tri)]},
        ("bfloat16", 16, 20480, 7168, True): {"cublas": [(80.0, None)], "cute": [(60.0, mma)],
                                               "triton": [(79.0, tri)]},
    }


def test_picks_from_timings_orders_as_the_dispatch_tries():
    picks = _benchmark("_tuning").picks_from_timings(_timings(), "cublas", ("cute", "triton"))
    assert picks[("bfloat16", 4, 7168, 3584, False)].order == ("cute", "triton")
    assert picks[("bfloat16", 4, 7168, 3584, False)].configs["cute"].tag() == "wg-n64-k128-s6-c1"
    assert picks[("bfloat16", 4, 7168, 3584, True)].configs["cute"] == MmaConfig(warps_k=8, unroll=2, stages=3)
    # the order comes from the timings without a static weight, for both rows
    assert picks[("bfloat16", 16, 20480, 7168, False)].order == picks[("bfloat16", 16, 20480, 7168, True)].order \
        == ("triton",)


def test_what_the_tuner_writes_is_what_the_dispatch_reads():
    picks = _benchmark("_tuning").picks_from_timings(_timings(), "cublas", ("cute", "triton"))
    text = tables.dumps("skinny_gemm", "NVIDIA H200", 132, picks, gemm_dispatch.KERNEL_OF,
                        "benchmarks/tune_skinny_gemm.py")
    table = tables.parse(json.loads(text), gemm_dispatch.KERNELS)
    assert table.picks == picks
    assert gemm_dispatch.order(torch.bfloat16, 3, 7168, 3584, table) == ("cute", "triton")
    assert gemm_dispatch.cute_config_for(torch.bfloat16, 3, 7168, 3584, True, table) == \
        MmaConfig(warps_k=8, unroll=2, stages=3)


def test_the_tail_tuner_writes_what_the_tail_dispatch_reads():
    wg, tri = WgmmaConfig(block_n=64, block_k=128, stages=6, producer_warp=True), TailConfig(block_n=32, split_k=1)
    timings = {("bfloat16", 8, 7168, 3584, s): {"split": [(16.0, None)], "cute": [(13.0, wg)], "triton": [(15.0, tri)]}
               for s in (False, True)}
    picks = _benchmark("_tuning").picks_from_timings(timings, "split", ("cute", "triton"))
    text = tables.dumps("latent_moe_tail", "NVIDIA H200", 132, picks, tail_dispatch.KERNEL_OF,
                        "benchmarks/tune_latent_moe_tail.py")
    table = tables.parse(json.loads(text), tail_dispatch.KERNELS)
    assert table.get("bfloat16", 5, 7168, 3584, False).order == ("cute", "triton")
    assert tail_dispatch.triton_config_for(torch.bfloat16, 5, 7168, 3584, True, table, 132) == tri


def test_the_gemm_tuner_keeps_the_router_rows_another_benchmark_timed(monkeypatch):
    """``tune_skinny_gemm.py`` leaves the router's 896 x 7168 out of its default shapes and merges its rows from the
    table (their Triton configurations come from the decode step's chain), unless ``--shapes`` names it."""
    tune = _benchmark("tune_skinny_gemm")
    seen = {}
    monkeypatch.setattr(tune.torch.cuda, "get_device_name", lambda: "NVIDIA H200")
    monkeypatch.setattr(tune, "tune", lambda shapes, *a: seen.update(shapes=shapes) or {})
    monkeypatch.setattr(tune, "write_table", lambda *a, note="": seen.update(merge=a[5], note=note))
    tune.main([])
    assert (896, 7168) not in seen["shapes"] and (1536, 7168) in seen["shapes"]
    assert seen["merge"] and "upcast_router.py --sweep" in seen["note"]
    tune.main(["--shapes", "896x7168,1536x7168"])
    assert seen["shapes"] == [(896, 7168), (1536, 7168)] and not seen["merge"] and seen["note"] == ""
    tune.main(["--shapes", "1536x7168", "--merge"])
    assert seen["shapes"] == [(1536, 7168)] and seen["merge"] and "upcast_router" in seen["note"]


@pytest.mark.parametrize("name", ["tune_skinny_gemm", "tune_latent_moe_tail", "tune_moe_experts"])
def test_tuners_import_without_a_gpu(name):
    assert callable(_benchmark(name).main)


def test_the_moe_tuner_writes_what_the_moe_dispatch_reads(tmp_path):
    """``tune_moe_experts.picks``: a candidate replaces the table's pick where it is faster by more than the margin
    and correct; the table's pick stays otherwise; ``config.tuned_config`` reads back each M's pick."""
    from k3compile.ops.moe_experts.config import MoeConfig, tuned_config

    tune = _benchmark("tune_moe_experts")
    base, split, fast_wrong = MoeConfig(), MoeConfig(split_l=4, trigger_early=True), MoeConfig(gemv=True)
    forms = {}
    rows = []
    for m, us in ((1, {"k3": 40.0, "k3:split": 30.0, "k3:wrong": 10.0}), (2, {"k3": 50.0, "k3:split": 49.9})):
        for name, t in us.items():
            forms[("mxfp4", m, name)] = {"k3": base, "k3:split": split, "k3:wrong": fast_wrong}[name]
            rows.append(dict(format="mxfp4", m=m, provider=name, us=t,
                             rel_err=float("nan") if name == "k3:wrong" else 1e-3))
    entries = tune.picks(rows, forms)
    path = tmp_path / "h200.json"
    tune.write_picks(path, entries)
    table = json.loads(path.read_text())
    pick = lambda m: tuned_config(table, m, torch.bfloat16, True, 384, 3584)   # noqa: E731
    assert pick(1) == split and pick(2) == base                      # 49.9 vs 50.0: within the margin
    assert [e["default_us"] for e in entries] == [40.0, 50.0]
    assert tuned_config(table, 16, torch.bfloat16, False, 384, 3584) is not None   # the committed entries kept


def _doc():
    return json.load(open(os.path.join(os.path.dirname(gemm_dispatch.__file__), "tables", "h200.json")))


def _break(how):
    doc = copy.deepcopy(_doc())
    row = doc["picks"][0]
    if how == "duplicate":
        doc["picks"].append(dict(row))
    elif how == "misnamed":
        name = row["cute"]
        doc["configs"]["wrong-name"] = doc["configs"].pop(name)
        for r in doc["picks"]:
            r.update({impl: "wrong-name" for impl in ("cute", "triton") if r.get(impl) == name})
    elif how == "unknown-kernel":
        doc["configs"][row["cute"]]["kernel"] = "cute_sm100"
    elif how == "order":
        for r in doc["picks"]:
            if r["order"] == ["cute", "triton"]:
                r["order"] = ["triton", "cute"]
    elif how == "static-orders-differ":
        row["order"] = [] if row["order"] else ["triton"]
    elif how == "wrong-implementation":
        row["triton"] = row["cute"]
    return doc


@pytest.mark.parametrize("how,match", [("duplicate", "two picks"), ("misnamed", "spells"),
                                       ("unknown-kernel", "unknown kernel"), ("order", "not in the op's order"),
                                       ("static-orders-differ", "one order"),
                                       ("wrong-implementation", "cannot run")])
def test_a_malformed_table_is_refused(how, match):
    with pytest.raises(ValueError, match=match):
        tables.parse(_break(how), gemm_dispatch.KERNELS)
