"""Every k3 Triton kernel compiled for AMD's gfx942 (MI300X), the way the project's own launchers launch it on ROCm.

No AMD GPU is needed or used: in a child process (without ``TRITON_INTERPRET``), ``k3compile.testing_hip`` makes
torch a ROCm build with one simulated MI300X and makes Triton record each launch for gfx942 instead of running it.
Each op is called at K3's decode shapes through its public function (the dispatch picks the configuration, as on
the GPU), and its launchers are also given every Triton configuration its H200 table holds; every distinct launch is
then compiled by Triton's AMD backend (two worker processes). The tests read that one report: each launch compiles,
fits gfx9's 64 KiB of LDS, carries no NVIDIA-only feature (PDL, ``maxnreg``, TMA descriptors, inline PTX) and
polls nothing (no spin on loads that gfx942's non-coherent L1 may serve stale); and on this ROCm torch ``auto``
runs Triton (or the vendor BLAS where the skinny GEMM's dispatch says so), a forced ``cute`` raises.

What this cannot show: that the kernels run correctly or fast on an AMD GPU (nothing here ever ran on one).
"""
import json
import os
import subprocess
import sys
import time

import pytest

LDS_BYTES = 64 * 1024   # gfx9's local data share per workgroup

SCRIPT = r"""
import json, sys, time
import torch
from k3compile.testing_hip import compile_for_gfx942, on_sim_gpu, simulated_rocm

t0 = time.time()
report = dict(launches=[], launch_errors=[], choices={})


def gpu(*shape, dtype=torch.bfloat16):   # uninitialised: nothing runs, and K3's weights are large
    return on_sim_gpu(torch.empty(*shape, dtype=dtype))


def launch(rec, case, fn, *args, **kwargs):
    rec.case = case
    try:
        fn(*args, **kwargs)
    except Exception as e:
        report["launch_errors"].append(dict(case=case, error=f"{type(e).__name__}: {str(e)[:800]}"))


def decide(name, impls, args, backend):
    try:
        report["choices"][name] = list(impls.decide(backend, args))
    except Exception as e:
        report["choices"][name] = [type(e).__name__, str(e)[:300]]


DT = dict(bf16=torch.bfloat16, fp16=torch.float16, fp32=torch.float32)
GEMM_SHAPES = [(4608, 7168), (1536, 7168), (2112, 7168), (2304, 1536), (896, 7168), (3584, 7168), (7168, 3584),
               (7168, 1536), (7168, 768), (20480, 7168)]   # benchmarks/skinny_gemm.py's K3_SHAPES
MS = (1, 2, 4, 8, 16)

with simulated_rocm() as rec:
    from k3compile.ops.kda_decode import kda_decode
    from k3compile.ops.kda_decode.dispatch import KDA_DECODE
    from k3compile.ops.latent_moe_tail import latent_moe_tail
    from k3compile.ops.latent_moe_tail import dispatch as tail_dispatch
    from k3compile.ops.latent_moe_tail.split import latent_moe_tail_split
    from k3compile.ops.latent_moe_tail.triton import latent_moe_tail_triton
    from k3compile.ops.mla_decode import mla_decode
    from k3compile.ops.mla_decode.dispatch import MLA_DECODE, load_table as mla_table
    from k3compile.ops.mla_decode.triton import mla_decode_triton
    from k3compile.ops.moe_experts import moe_experts
    from k3compile.ops.moe_experts.dispatch import MOE_EXPERTS
    from k3compile.ops.moe_route import moe_route
    from k3compile.ops.moe_route.triton import moe_route_triton
    from k3compile.ops.skinny_gemm import skinny_gemm
    from k3compile.ops.skinny_gemm import dispatch as gemm_dispatch
    from k3compile.ops.skinny_gemm.triton import skinny_gemm_triton

    # --- the skinny GEMM: K3's products at every decode M, the configurations the dispatch picks on this GPU
    weights = {}
    for dt, dtype in DT.items():
        if dt == "fp16":
            continue   # the configurations of bf16 (triton_config.for_dtype tells 16-bit from fp32 only)
        for n, k in GEMM_SHAPES:
            w = weights[(dt, n, k)] = gpu(n, k, dtype=dtype)
            for m in MS:
                launch(rec, f"skinny_gemm {dt} M{m} N{n} K{k}", skinny_gemm, gpu(m, k, dtype=dtype), w,
                       backend="triton")
    # ... and every Triton configuration of the H200 table, at its own shapes
    h200 = gemm_dispatch.table_for("NVIDIA H200")
    for (dt, m, n, k, static), pick in h200.picks.items():
        cfg = pick.configs.get("triton")
        if cfg is not None and not static:
            dtype = getattr(torch, dt)
            w = weights.get((dt, n, k))
            launch(rec, f"skinny_gemm table {cfg.tag()} {dt} M{m} N{n} K{k}", skinny_gemm_triton,
                   gpu(m, k, dtype=dtype), w if w is not None else gpu(n, k, dtype=dtype), config=cfg)
    a, w = gpu(4, 7168), weights[("bf16", 4608, 7168)]
    for backend in ("auto", "cute"):
        decide(f"skinny_gemm {backend} 4608x7168", gemm_dispatch.SKINNY_GEMM, (a, w, None, None), backend)
    decide("skinny_gemm auto 2304x1536", gemm_dispatch.SKINNY_GEMM,
           (gpu(4, 1536), weights[("bf16", 2304, 1536)], None, None), "auto")

    # --- the latent-MoE tail (L 3584 -> D 7168): the one-kernel form, the split path, an unaligned weight
    for dt, dtype in DT.items():
        up = gpu(7168, 3584, dtype=dtype)
        unaligned = on_sim_gpu(torch.empty(7168 * 3584 + 1, dtype=dtype)[1:].view(7168, 3584))
        for m in MS:
            args = (gpu(m, 3584, dtype=dtype), gpu(m, 7168, dtype=dtype), gpu(3584, dtype=dtype))
            launch(rec, f"latent_moe_tail {dt} M{m}", latent_moe_tail, *args, up, 1e-5, backend="triton")
            launch(rec, f"latent_moe_tail unaligned weight {dt} M{m}", latent_moe_tail, *args, unaligned, 1e-5,
                   backend="triton")
            if dt != "fp16":   # the norm and the skinny GEMM: bf16's configurations
                launch(rec, f"latent_moe_tail split path {dt} M{m}", latent_moe_tail_split, *args, up, 1e-5)
    tail = gpu(4, 3584), gpu(4, 7168), gpu(3584), gpu(7168, 3584)
    for backend in ("auto", "cute"):
        decide(f"latent_moe_tail {backend}", tail_dispatch.LATENT_MOE_TAIL, (*tail, 1e-5, 16), backend)
    tail_h200 = tail_dispatch.table_for("NVIDIA H200")
    for cfg in {p.configs["triton"] for p in tail_h200.picks.values() if "triton" in p.configs}:
        for dt, dtype in DT.items():
            launch(rec, f"latent_moe_tail table {cfg.tag()} {dt}", latent_moe_tail_triton,
                   gpu(4, 3584, dtype=dtype), gpu(4, 7168, dtype=dtype), gpu(3584, dtype=dtype),
                   gpu(7168, 3584, dtype=dtype), 1e-5, cfg)

    # --- the KDA decode step: K3's heads at TP 8 and TP 1, batch 1 to 64 (every layout default_config picks), both
    # gates; and a register cap (a layout option NVIDIA's compiler takes)
    from k3compile.ops.kda_decode.triton import kda_decode_triton
    from k3compile.ops.kda_decode.triton_config import KernelConfig
    for B in (1, 4, 16, 64):
        for H in (12, 96):
            for lb in (-5.0, None):
                K = V = 128
                args = (gpu(B, H * K), gpu(B, H * K), gpu(B, H * V), gpu(B, H * K, 3), gpu(B, H * K, 3),
                        gpu(B, H * V, 3), gpu(H * K, 1, 4, dtype=torch.float32),
                        gpu(H * K, 1, 4, dtype=torch.float32), gpu(H * V, 1, 4, dtype=torch.float32),
                        gpu(B, H * K), gpu(H, dtype=torch.float32), gpu(H * K, dtype=torch.float32), lb,
                        gpu(B, H), gpu(B, H * V), gpu(V, dtype=torch.float32), gpu(B, H, V, K, dtype=torch.float32))
                launch(rec, f"kda_decode B{B} H{H} {'lb' if lb else 'softplus'}", kda_decode, *args, 1e-5, "triton")
                if B == 1 and H == 12 and lb:
                    launch(rec, "kda_decode register cap", kda_decode_triton, *args, 1e-5,
                           config=KernelConfig(8, 16, 4, max_registers=128))
                    for backend in ("auto", "cute"):
                        decide(f"kda_decode {backend}", KDA_DECODE, (*args, 1e-5), backend)

    # --- MLA decode: K3's widths (N 128, R 64, Vd 128, Lk 512), 12 heads a rank, T 1 and 4, B 1 and 8
    def mla_inputs(B, T, dtype=torch.bfloat16):
        q = gpu(B, T, 12, 192, dtype=dtype)
        return (q[..., :128], q[..., 128:], gpu(B, 256, 512, dtype=dtype), gpu(B, 256, 64, dtype=dtype),
                gpu(12, 256, 512, dtype=dtype), on_sim_gpu(torch.tensor(100)), 192 ** -0.5,
                on_sim_gpu(torch.zeros(B, dtype=torch.int64)))
    for B in (1, 8):
        for T in (1, 4):
            launch(rec, f"mla_decode B{B} T{T}", mla_decode, *mla_inputs(B, T), backend="triton")
    for backend in ("auto", "cute"):
        decide(f"mla_decode {backend}", MLA_DECODE, mla_inputs(1, 1), backend)
    for key, cfg in mla_table("NVIDIA H200").items():
        launch(rec, f"mla_decode table {key}", mla_decode_triton, *mla_inputs(8, 1), config=cfg)

    # --- the routed experts: a rank of K3 at TP 8 (E 896, top-16, L 3584, I 384), bf16 and MXFP4 weights
    def moe_inputs(m, mxfp4):
        e, a, l, i = 896, 16, 3584, 384
        experts = on_sim_gpu(torch.arange(m * a).view(m, a) % e)
        if mxfp4:
            u8 = torch.uint8
            return (gpu(m, l), experts, gpu(m, a, dtype=torch.float32), gpu(e, i, l // 2, dtype=u8),
                    gpu(e, i, l // 2, dtype=u8), gpu(e, l, i // 2, dtype=u8), gpu(e, i, l // 32, dtype=u8),
                    gpu(e, i, l // 32, dtype=u8), gpu(e, l, i // 32, dtype=u8))
        return (gpu(m, l), experts, gpu(m, a, dtype=torch.float32), gpu(e, i, l), gpu(e, i, l), gpu(e, l, i),
                None, None, None)
    for m in MS:
        for mxfp4 in (False, True):
            launch(rec, f"moe_experts {'mxfp4' if mxfp4 else 'bf16'} M{m}", moe_experts, *moe_inputs(m, mxfp4),
                   4.0, 25.0, backend="triton")
    for backend in ("auto", "cute"):
        decide(f"moe_experts {backend}", MOE_EXPERTS, (*moe_inputs(1, True), 16), backend)
    # (moe_experts' table applies to a GPU named H200 only, config.gpu_name: nothing of it reaches ROCm. Its MXFP4
    # weight-rows configuration does not compile for gfx942: Triton 3.7's AMD pointer canonicalisation fails.)

    # --- the shared experts' SiTU-GLU beside the routed experts (k3::experts_beside; its products and routed experts
    # are the ops above): K3's shared width at TP 8
    from k3compile.ops.experts_beside.triton import situ_glu_triton
    for m in (1, 16):
        launch(rec, f"experts_beside glue M{m}", situ_glu_triton, gpu(m, 768), gpu(m, 768), 4.0, 25.0)

    # --- the routing tail: K3's router (E 896, top-16), both top-k forms
    for m in (1, 16):
        logits, bias = gpu(m, 896, dtype=torch.float32), gpu(896, dtype=torch.float32)
        launch(rec, f"moe_route M{m}", moe_route, logits, bias, 16, backend="triton")   # the bitonic form
        launch(rec, f"moe_route rounds M{m}", moe_route_triton, logits, bias, 16, 1e-20, 1.0, sorting_network=False)

    # --- the AttnRes mixes and their norms: K3's width, 2 to 16 sources (every launch shape the op picks), the
    # mix alone, a source's two sums in two reductions (the sweep's other form)
    from k3compile.ops.attn_res import attn_res
    from k3compile.ops.attn_res.dispatch import ATTN_RES
    from k3compile.ops.attn_res.triton import attn_res_triton
    d = 7168
    for s in (2, 5, 9, 16):
        for m in (1, 16):
            sources = [gpu(m, 1, d) for _ in range(s)]
            launch(rec, f"attn_res S{s} M{m}", attn_res, sources, gpu(1, d), gpu(d), 1e-6, gpu(d), 1e-6,
                   backend="triton")
        launch(rec, f"attn_res mix S{s}", attn_res, sources, gpu(1, d), gpu(d), 1e-6, backend="triton")
        launch(rec, f"attn_res unpaired S{s}", attn_res_triton, sources, gpu(1, d), gpu(d), 1e-6, gpu(d), 1e-6,
               paired=False)
    decide("attn_res auto", ATTN_RES, ([gpu(1, 1, d)] * 2, gpu(1, d), gpu(d), 1e-6, gpu(d), 1e-6), "auto")
    # ... with the residual add that makes the last source (k3::attn_res_add)
    from k3compile.ops.attn_res import attn_res_add
    for s in (2, 9):
        for m in (1, 16):
            sources = [gpu(m, 1, d) for _ in range(s)]
            launch(rec, f"attn_res_add S{s} M{m}", attn_res_add, sources, gpu(m, 1, d), gpu(1, d), gpu(d), 1e-6,
                   gpu(d), 1e-6, backend="triton")

t1 = time.time()
results = compile_for_gfx942(rec.launches, workers=2)
for l, r in zip(rec.launches, results):
    report["launches"].append(dict(
        case=l.case, kernel=l.kernel.split(":")[1], module=l.kernel.split(":")[0],
        pdl=bool(l.constexpr("PDL")), tma_args=[n for n, s in l.signature.items() if "tensordesc" in str(s)],
        **r))
report["seconds"] = dict(record=round(t1 - t0, 1), compile=round(time.time() - t1, 1),
                         distinct=len({l.key() for l in rec.launches}))
print(json.dumps(report))
"""


@pytest.fixture(scope="module")
def report():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in [env.get("PYTHONPATH")] if p])
    start = time.time()
    run = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=900,
                         cwd=root)
    assert run.returncode == 0, run.stderr[-4000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    out["seconds"]["total"] = round(time.time() - start, 1)
    if os.environ.get("K3_ROCM_REPORT"):   # the whole report, for a look at what each launch compiled to
        with open(os.environ["K3_ROCM_REPORT"], "w") as f:
            json.dump(out, f, indent=1)
    print("gfx942 compile report:", out["seconds"], f"{len(out['launches'])} launches")
    return out


def _failures(report, bad) -> list:
    return sorted({f"{l['case']}: {l['kernel']}: {bad(l)}" for l in report["launches"] if bad(l)})


def test_every_launch_binds_for_hip(report):
    """Triton accepts each launch's keywords on HIP (an NVIDIA-only option such as ``maxnreg`` or ``launch_pdl``
    raises there) and the launchers take the ROCm path without error."""
    assert not report["launch_errors"], report["launch_errors"][:5]
    ops = {l["case"].split()[0] for l in report["launches"]}
    assert ops == {"skinny_gemm", "latent_moe_tail", "kda_decode", "mla_decode", "moe_experts", "experts_beside",
                   "moe_route", "attn_res", "attn_res_add"}


def test_every_kernel_compiles_for_gfx942(report):
    assert not _failures(report, lambda l: l.get("error")), _failures(report, lambda l: l.get("error"))[:5]


def test_local_memory_fits_gfx9(report):
    over = _failures(report, lambda l: f"{l['shared']} B of LDS" if l.get("shared", 0) > LDS_BYTES else None)
    assert not over, over[:10]


def test_no_nvidia_only_feature_reaches_hip(report):
    def nvidia_only(l):
        return ", ".join(w for w, bad in (("PDL", l["pdl"]), ("TMA descriptor", l["tma_args"] or l.get("tma")),
                                          ("inline asm", l.get("inline_asm"))) if bad)
    found = _failures(report, nvidia_only)
    assert not found, found[:10]


def test_no_polling_on_hip(report):
    """No load loop waits on another workgroup's plain or volatile stores: gfx942's L1 is not coherent with them."""
    polls = _failures(report, lambda l: "spins on loads" if l.get("volatile_loads") or l.get("spin_loops") else None)
    assert not polls, polls[:10]


def test_backend_choice_on_rocm(report):
    """``auto``: Triton (the skinny GEMM: the vendor BLAS where this GPU has no measurements and the weight is small);
    a forced ``cute``: BackendUnavailableError, CuTe being NVIDIA-only."""
    c = report["choices"]
    for op in ("kda_decode", "mla_decode", "moe_experts", "attn_res", "skinny_gemm auto 4608x7168"):
        key = op if " " in op else f"{op} auto"
        assert c[key][0] == "triton", (key, c[key])
    assert c["skinny_gemm auto 2304x1536"][0] == "aten", c["skinny_gemm auto 2304x1536"]
    assert "gfx942" in c["skinny_gemm auto 2304x1536"][1]
    assert c["latent_moe_tail auto"][0] == "aten", c["latent_moe_tail auto"]   # the split path: Triton kernels
    for op in ("kda_decode", "mla_decode", "moe_experts", "latent_moe_tail", "skinny_gemm cute 4608x7168"):
        key = op if " " in op else f"{op} cute"
        assert c[key][0] == "BackendUnavailableError", (key, c[key])
