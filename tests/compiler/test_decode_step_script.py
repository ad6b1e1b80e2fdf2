"""benchmarks/decode_step.py and benchmarks/_breakdown.py: the floor's byte count, the kernel categories, the plot
(cheap), and the script's --dry-run on the CPU, one rank and two (slow)."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "decode_step.py"


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


decode_step = _load("decode_step", SCRIPT)
bd = _load("_breakdown", ROOT / "benchmarks" / "_breakdown.py")


@pytest.fixture(scope="module")
def micro():
    """A micro K3 rank built as the script builds it (TP 1: no process group needed), and a filled cache."""
    from k3compile.model import TPContext

    args = decode_step.parse_args(["--dry-run", "--tp", "1"])
    model = decode_step.build_rank(decode_step.make_config(args), TPContext(), torch.float32, "fp32",
                                   torch.device("cpu"), 0)
    cache = model.allocate_cache(3, 9)
    decode_step.fill_cache(cache, 6, 0)
    return model, cache


def test_dry_run_defaults_and_what_is_given():
    args = decode_step.parse_args(["--dry-run", "--batch", "1,3"])
    assert (args.tp, args.layers, args.dtype, args.k3_backend, args.batch, args.context) == \
        (2, 2, "fp32", "reference", [1, 3], [5])
    assert decode_step.parse_args(["--world-size", "4"]).tp == 4
    with pytest.raises(SystemExit):
        decode_step.parse_args(["--providers", "compile,tensorrt"])
    args = decode_step.parse_args(["--without-passes", "attn_res,moe_route"])
    assert args.without_passes == ["attn_res", "moe_route"]
    assert args.passes and not {"attn_res", "moe_route"} & set(args.passes)
    assert decode_step.parse_args([]).passes is None
    with pytest.raises(SystemExit):
        decode_step.parse_args(["--without-passes", "attn_rez"])


def test_regions_reach_optimize_and_nothing_else(monkeypatch):
    import k3compile

    seen = []
    monkeypatch.setattr(k3compile, "optimize", lambda model, **kw: seen.append(kw) or model)
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self, **kw: seen.append(("compile", kw)))
    for argv in ([], ["--regions"]):
        args = decode_step.parse_args(["--dry-run", *argv])
        for name in ("optimize", "compile"):
            decode_step.make_provider(name, torch.nn.Linear(2, 2), args, {})
    assert [kw["regions"] for kw in seen if isinstance(kw, dict)] == [None, True]   # None: optimize()'s default
    assert all("regions" not in kw[1] for kw in seen if isinstance(kw, tuple))


def test_fill_cache_valid_prefix_only(micro):
    model, cache = micro
    assert int(cache.pos) == 6
    mla = [s for s in cache.layers if hasattr(s, "c_kv")]
    assert mla and all(s.c_kv[:, :6].abs().sum() > 0 and not s.c_kv[:, 6:].any() for s in mla)


def test_step_bytes_weights_experts_cache_logits(micro):
    model, cache = micro
    text = model.language_model
    M, pos = 3, 6
    moe = [m for m in text.modules() if type(m).__name__ == "KimiLatentMoE"]
    distinct = [5] * len(moe)
    got = decode_step.step_bytes(model, cache, M, pos, distinct)
    embed = text.model.embed_tokens.weight
    dense = sum(p.numel() * p.element_size() for n, p in text.named_parameters() if ".experts." not in n)
    assert got["weights"] == dense - embed.numel() * embed.element_size() + M * embed.shape[1] * embed.element_size()
    ex = moe[0].experts
    per_expert = sum(getattr(ex, w)[0].numel() * 4 for w in ("w1", "w2", "w3"))
    assert got["experts"] == 5 * per_expert * len(moe)
    mla = [s for s in cache.layers if hasattr(s, "c_kv")]
    row = (mla[0].c_kv.shape[-1] + mla[0].k_pe.shape[-1]) * 4
    assert got["kv"] == len(mla) * M * (pos + 2) * row
    assert got["logits"] == M * text.lm_head.weight.shape[0] * 4
    assert got["total"] == sum(v for k, v in got.items() if k != "total")


def test_distinct_experts_one_count_per_moe_layer(micro):
    model, cache = micro
    text = model.config.text_config
    decode_step.fill_cache(cache, 6, 0)
    with decode_step.distinct_experts(model) as counts:
        decode_step.decode_call(model, torch.tensor([[1], [2], [3]]), cache)
    moe_layers = sum(text.is_moe_layer(i) for i in range(text.num_hidden_layers))
    assert len(counts) == moe_layers
    assert all(text.num_experts_per_token <= c <= min(3 * text.num_experts_per_token, text.num_experts)
               for c in counts)


@pytest.mark.parametrize("frames, gemm, want", [
    ([("x/model/moe.py", "forward"), ("x/model/moe.py", "_gathered")], False, "experts"),
    ([("x/model/mxfp4.py", "dequantize_mxfp4")], False, "experts"),
    ([("x/model/moe.py", "route")], True, "router"),
    ([("x/model/kda.py", "decode"), ("x/model/layers.py", "rms_norm")], False, "AttnRes and norms"),
    ([("x/model/kda.py", "decode")], True, "dense GEMMs"),
    ([("x/model/kda.py", "kda_recurrent_step")], False, "KDA"),
    ([("x/model/mla.py", "mla_attend")], True, "MLA"),
    ([("x/model/parallel.py", "all_reduce")], False, "collectives"),
    ([("x/model/modeling.py", "forward")], False, "glue"),
    ([("x/other/kda.py", "decode")], False, None),
], ids=["experts", "mxfp4", "router", "norm-in-kda", "kda-proj", "kda", "mla-core", "collective", "glue", "not-model"])
def test_category_of_model_frames(frames, gemm, want):
    assert bd.category_of(frames, gemm) == want


def _event(name, parent=None, shapes=None, stack=None):
    return SimpleNamespace(name=name, cpu_parent=parent, input_shapes=shapes, stack=stack)


def test_categorize_by_launcher_shapes_and_frames(micro):
    model, cache = micro
    shapes = bd.ShapeTable(model, cache)
    origins = bd.KernelOrigins()
    origins.categories["triton_poi_fused_add_0"] = "KDA"
    E, D = model.language_model.model.layers[1].block_sparse_moe.gate.weight.shape
    ex = model.language_model.model.layers[1].block_sparse_moe.experts.w1
    frame = _event("model/kda.py(52): kda_recurrent_step")
    cases = [
        ("ncclDevKernel_AllReduce_Sum_bf16", _event("aten::empty"), "collectives"),
        ("triton_poi_fused_add_0", _event("triton_poi_fused_add_0"), "KDA"),
        ("cpp_fused_add_0", _event("graph_3_cpp_fused_add_0"), "glue"),      # not recorded: no origin known
        ("k", _event("aten::copy_", _event("k3::kda_decode")), "KDA"),
        ("k", _event("k3::skinny_gemm", shapes=[[2, D], [E, D]]), "router"),
        ("nvjet_tst_64x8", _event("aten::mm", shapes=[[2, D], [D, E]]), "router"),
        ("gemv2T_kernel", _event("aten::bmm", shapes=[[32, ex.shape[1], ex.shape[2]], [32, ex.shape[2], 1]]),
         "experts"),
        ("nvjet_tst_64x8", _event("aten::mm", shapes=[[2, 7], [7, 11]]), "dense GEMMs"),
        ("elementwise_kernel", _event("aten::mul", frame), "KDA"),
        ("elementwise_kernel", _event("aten::mul"), "glue"),
    ]
    for kernel, launcher, want in cases:
        assert bd.categorize(kernel, launcher, origins, shapes) == want, (kernel, launcher.name)


def test_breakdown_gaps_fill_the_step():
    kernels = [("ncclDevKernel_x", 3.0, _event("c10d::allreduce_")), ("k", 5.0, _event("k3::kda_decode")),
               ("k", 5.0, _event("k3::kda_decode")), ("e", 1.0, _event("aten::add"))]
    out = bd.breakdown(kernels, steps=2, step_us=10.0, origins=bd.KernelOrigins(), shapes=SimpleNamespace())
    assert out["us"]["collectives"] == 1.5 and out["us"]["KDA"] == 5.0 and out["us"]["glue"] == 0.5
    assert out["us"]["gaps"] == 3.0 and out["kernels_per_step"] == 2 and out["kernel_us"] == 7.0
    assert set(out["us"]) == set(bd.CATEGORIES)
    assert out["top"][0] == dict(kernel="k", category="KDA", us=5.0, launches=1.0)
    assert out["sequence"] == [dict(kernel="ncclDevKernel_x", category="collectives", us=3.0),
                               dict(kernel="k", category="KDA", us=5.0)]     # the first of the two steps


def _profiled(name, id_=0, linked=0, start=0.0, end=0.0, device=True):
    cpu, cuda = torch.autograd.DeviceType.CPU, torch.autograd.DeviceType.CUDA
    return SimpleNamespace(name=name, id=id_, linked_correlation_id=linked, device_type=cuda if device else cpu,
                           time_range=SimpleNamespace(start=start, end=end), kernels=[], cpu_children=[])


def test_device_timeline_charges_each_kernel_only_the_time_no_earlier_one_covered():
    """A PDL kernel launched while its predecessor runs, waiting, then running past it: charged from the
    predecessor's end; a kernel wholly inside another's span: nothing; idle time: nobody's. The sum is the busy time."""
    gemm, norm = _profiled("k3::skinny_gemm", id_=7, device=False), _profiled("triton_red_fused_0", id_=9, device=False)
    runtime = _profiled("cudaLaunchKernel", id_=7, linked=9, device=False)   # a runtime event: never a launcher
    events = [gemm, norm, runtime,
              _profiled("gemm_a", linked=7, start=0.0, end=10.0),
              _profiled("gemm_b", linked=7, start=2.0, end=14.0),    # launched early, ran past gemm_a
              _profiled("inside", linked=9, start=3.0, end=5.0),     # covered by both
              _profiled("after_idle", linked=9, start=20.0, end=21.5)]
    out = bd.device_timeline(events)
    assert [(n, us) for n, us, _ in out] == [("gemm_a", 10.0), ("gemm_b", 4.0), ("inside", 0.0), ("after_idle", 1.5)]
    assert [launcher.name for _, _, launcher in out] == ["k3::skinny_gemm"] * 2 + ["triton_red_fused_0"] * 2
    assert bd.device_kernels(events, on_device=True) == out


def test_device_kernels_fall_back_to_whole_durations_without_linked_device_events():
    op = _profiled("aten::mm", id_=3, device=False)
    op.kernels = [SimpleNamespace(name="nvjet", duration=4.0)]
    assert bd.device_timeline([op]) is None
    assert bd.device_kernels([op], on_device=True) == [("nvjet", 4.0, op)]


def test_breakdown_lists_the_skinny_gemms_by_weight_shape():
    """Kernels of k3::skinny_gemm calls summed per weight shape (two launches of a 1536 x 7168 bf16 weight at 5.5 µs
    each: 11 µs and 4.0 TB/s a step), whatever launched them underneath the op."""
    gemm = _event("k3::skinny_gemm", shapes=[[1, 7168], [1536, 7168], [], []])
    gemm.input_dtypes = ["c10::BFloat16", "c10::BFloat16", "", ""]
    inner = _event("cudaLaunchKernel", gemm)
    kernels = [("wgmma", 5.5, inner), ("wgmma", 5.5, gemm), ("e", 1.0, _event("aten::add"))]
    out = bd.breakdown(kernels, steps=1, step_us=20.0, origins=bd.KernelOrigins(),
                       shapes=SimpleNamespace(gemm=lambda s: "dense GEMMs"))
    assert out["skinny_gemms"] == [dict(weight="1536x7168", category="dense GEMMs", us=11.0, launches=2.0,
                                        tbps=round(2 * 1536 * 7168 * 2 / 11.0 / 1e6, 3))]


def test_kernel_origins_from_inductor_codegen():
    """A compiled RMSNorm (the model's own): Inductor's kernel for it is recorded as a norm."""
    from k3compile.model.layers import rms_norm

    origins = bd.KernelOrigins()
    fn = torch.compile(lambda x, w: rms_norm(x, w, 1e-6), backend="inductor", options={"fx_graph_cache": False})
    with origins.recording():
        fn(torch.randn(2, 8), torch.ones(8))
    assert origins.categories and set(origins.categories.values()) == {"AttnRes and norms"}
    assert all(name.startswith(("cpp_", "triton_")) for name in origins.categories)


def test_plot_is_svg_with_a_bar_segment_per_category(tmp_path):
    rows = [dict(provider=p, m=1, context=1024, us=100.0, floor_us=40.0,
                 breakdown=dict(us={**dict.fromkeys(bd.CATEGORIES, 10.0), "gaps": 20.0})) for p in ("compile", "opt")]
    path = tmp_path / "b.svg"
    assert decode_step.plot(rows, str(path)).startswith("wrote")
    root = ET.parse(path).getroot()
    rects = [e for e in root.iter() if e.tag.endswith("rect")]
    assert len(rects) == 2 * len(bd.CATEGORIES) + len(bd.CATEGORIES)      # bar segments + legend
    assert "no breakdown" in decode_step.plot([], str(tmp_path / "none.svg"))


def _run(args, tmp_path, timeout=900):
    out = tmp_path / "step.json"
    cmd = [sys.executable, str(SCRIPT), "--dry-run", "--json", str(out), *args]
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1", "TORCHINDUCTOR_COMPILE_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text()), proc.stdout


@pytest.mark.slow
def test_dry_run_one_rank_every_provider_checked_and_broken_down(tmp_path):
    svg = tmp_path / "step.svg"
    result, stdout = _run(["--plot", str(svg)], tmp_path)
    assert result["ok"] and "all checks passed" in stdout and svg.exists()
    rows = {r["provider"]: r for r in result["rows"]}
    assert set(rows) == {"eager", "compile", "optimize"}
    assert rows["compile"]["check"]["reference"] and result["meta"]["tp"] == 2
    for r in rows.values():
        assert "error" not in r and r["check"]["ok"] and r["us"] > 0 and r["kernels_per_step"] > 0
        assert set(r["breakdown"]["us"]) == set(bd.CATEGORIES) and r["floor_bytes"]["experts"] > 0
    assert rows["eager"]["check"]["rel_err"] < 1e-4 and rows["optimize"]["check"]["rel_err"] < 1e-4
    assert rows["optimize"]["pass_matches"]["kda_decode"] == 1
    assert rows["optimize"]["pass_matches"]["attn_res"] == 4   # each layer's two mixes (the first's one), the final


@pytest.mark.slow
def test_dry_run_two_ranks_through_tp_decode_launch(tmp_path):
    result, _ = _run(["--world-size", "2", "--providers", "eager", "--reference", "eager"], tmp_path)
    assert result["ok"] and result["meta"]["world_size"] == 2
    (row,) = result["rows"]
    assert row["ranks_ok"] == [True, True] and row["us"] > 0


def test_graphed_timeline_times_the_launched_kernels_by_the_graph_replays():
    """Names and launchers from the un-graphed steps, exclusive µs from the replays (their mean); copies that a graph
    profile does not show are dropped from both; a replay with another kernel sequence gives None."""
    gemm, norm = _profiled("k3::skinny_gemm", id_=7, device=False), _profiled("triton_red_fused_0", id_=9, device=False)
    launched = [("gemm", 9.0, gemm), ("Memset (Device)", 1.0, None), ("norm", 4.0, norm)]
    replays = [_profiled("gemm", start=0.0, end=5.0), _profiled("norm", start=4.0, end=6.0),     # PDL overlap
               _profiled("gemm", start=10.0, end=17.0), _profiled("norm", start=18.0, end=19.0)]  # idle 17-18
    out = bd.graphed_timeline(launched, replays, 2)
    assert [(n, us) for n, us, _ in out] == [("gemm", 6.0), ("norm", 1.0)]
    assert [launcher for _, _, launcher in out] == [gemm, norm]
    assert bd.graphed_timeline(launched, replays[:3], 2) is None
    assert bd.graphed_timeline(launched, replays[:3] + [_profiled("other", start=18.0, end=19.0)], 2) is None
