"""Nsight Compute counters of the k3 ops' kernels at K3 rank shapes (GPU; needs ``ncu`` on the PATH): where a
kernel's time goes when its figure is far from its floor -- bytes (DRAM %), instruction issue (issued IPC, warp
instructions per SM), or latency (warps a scheduler holds, how many are eligible, the top stall reasons).

Each case runs in a child process under ``ncu --profile-from-start off``: the op is called until its kernels are
built, then once between ``cudaProfilerStart`` / ``Stop``, so only that call's kernels are profiled (each replayed by
ncu, caches flushed between passes: durations are cold-cache and at ncu's locked clocks, not the benchmarks' figures).

    python benchmarks/profile_kernels.py                        # the default cases below
    python benchmarks/profile_kernels.py --cases moe:mxfp4:1 mla:1:1024 --out profile.json

Cases: ``moe:<bf16|mxfp4|mxfp4-cute>:<M>[:<I>]`` (``k3::moe_experts`` at TP 8: E 896, top-16, L 3584, I 384 unless
given (192: TP 16), random routing; the Triton kernels at the table's configuration, or with ``mxfp4-cute`` the CuTe
kernels, M <= 16) and ``mla:<B>:<valid length>`` (``k3::mla_decode`` at TP 8: 12 heads, a 128K allocation).
"""
from __future__ import annotations

import argparse
import csv
import io
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile

DEFAULT_CASES = ("moe:mxfp4:1", "moe:mxfp4:16", "moe:mxfp4-cute:1", "moe:mxfp4-cute:8", "moe:bf16:1", "mla:1:1024",
                 "mla:8:8192")
METRICS = {   # column name -> ncu raw metric (the first of a tuple that ncu reports)
    "µs": "gpu__time_duration.sum",
    "dram %": ("gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed",
               "dram__throughput.avg.pct_of_peak_sustained_elapsed"),
    "issued ipc": "sm__inst_issued.avg.per_cycle_active",
    "warps/sched": "smsp__warps_active.avg.per_cycle_active",
    "eligible": "smsp__warps_eligible.avg.per_cycle_active",
    "regs": "launch__registers_per_thread",
    "grid": "launch__grid_size",
    "sm active cyc": "sm__cycles_active.avg",
    "elapsed cyc": "gpc__cycles_elapsed.max",
}
STALL = "smsp__average_warps_issue_stalled_"
SECTIONS = ("SpeedOfLight", "ComputeWorkloadAnalysis", "MemoryWorkloadAnalysis", "Occupancy", "LaunchStats",
            "WarpStateStats", "SchedulerStats")


def child(case: str) -> None:
    """Build the case's inputs, warm its kernels up, then one profiled call."""
    import torch

    kind, *args = case.split(":")
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(0)
    if kind == "moe":
        from k3compile.ops.moe_experts.triton import moe_experts_triton

        fmt, m = args[0], int(args[1])
        E, A, L, I = 896, 16, 3584, int(args[2]) if len(args) > 2 else 384

        def scales(rows, cols, width):
            c = 127 - round(math.log2(2.2 * width ** 0.5))
            return torch.randint(c - 2, c + 3, (E, rows, cols // 32), generator=g, device=dev, dtype=torch.uint8)

        def codes(rows, cols):
            return torch.randint(0, 256, (E, rows, cols // 2), generator=g, device=dev, dtype=torch.uint8)

        def dense(rows, cols):
            return torch.randn(E, rows, cols, generator=g, device=dev).to(torch.bfloat16) * cols ** -0.5

        if fmt.startswith("mxfp4"):
            w = (codes(I, L), codes(I, L), codes(L, I), scales(I, L, L), scales(I, L, L), scales(L, I, I))
        else:
            w = (dense(I, L), dense(I, L), dense(L, I), None, None, None)
        scores = torch.sigmoid(torch.randn(m, E, generator=g, device=dev))
        experts = scores.topk(A, dim=-1).indices
        weights = scores.gather(-1, experts)
        weights = weights / weights.sum(-1, keepdim=True)
        z = torch.randn(m, L, generator=g, device=dev).to(torch.bfloat16)

        def call():
            if fmt == "mxfp4-cute":
                from k3compile.ops.moe_experts.cute import moe_experts_cute

                return moe_experts_cute(z, experts, weights, *w, beta=4.0, linear_beta=25.0)
            return moe_experts_triton(z, experts, weights, *w, beta=4.0, linear_beta=25.0)
    elif kind == "mla":
        from k3compile.ops.mla_decode import mla_decode

        B, valid = int(args[0]), int(args[1])
        S, H, N, R, Vd, Lk = 131072, 12, 128, 64, 128, 512
        bf = dict(device=dev, dtype=torch.bfloat16)
        q_nope, q_pe = torch.randn(B, 1, H, N, **bf), torch.randn(B, 1, H, R, **bf)
        c_kv, k_pe = torch.randn(B, S, Lk, **bf), torch.randn(B, S, R, **bf)
        w_kv_b = torch.randn(H, N + Vd, Lk, **bf) * Lk ** -0.5
        pos = torch.tensor(valid - 1, device=dev)

        def call():
            return mla_decode(q_nope, q_pe, c_kv, k_pe, w_kv_b, pos, (N + R) ** -0.5, backend="triton")
    else:
        raise SystemExit(f"unknown case {case!r}")
    for _ in range(3):
        call()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    call()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


def profile(case: str, ncu: str, workdir: str, timeout: float) -> list[dict]:
    """The case's kernels, one dict of metrics each (in launch order)."""
    rep = os.path.join(workdir, case.replace(":", "_"))
    cmd = [ncu, "--profile-from-start", "off", "-f", "-o", rep]
    for s in SECTIONS:
        cmd += ["--section", s]
    cmd += [sys.executable, os.path.abspath(__file__), "--child", case]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if run.returncode != 0 or not os.path.exists(rep + ".ncu-rep"):
        raise RuntimeError(f"ncu failed (rc {run.returncode}): {(run.stdout + run.stderr)[-1500:]}")
    raw = subprocess.run([ncu, "--import", rep + ".ncu-rep", "--page", "raw", "--csv", "--print-units", "base"],
                         capture_output=True, text=True, check=True).stdout
    return parse_raw(raw)


def parse_raw(raw: str) -> list[dict]:
    """``ncu --page raw --csv --print-units base`` output: a header of metric names, a row of units, a row a kernel."""
    rows = list(csv.reader(io.StringIO(raw)))
    header, body = rows[0], rows[2:]   # rows[1]: units
    kernels = []
    for row in body:
        rec = dict(zip(header, row))
        k = {"kernel": rec.get("Kernel Name", "?").split("(")[0]}
        for name, metric in METRICS.items():
            found = [_num(rec.get(m)) for m in ((metric,) if isinstance(metric, str) else metric)]
            k[name] = next((v for v in found if v is not None), None)
        if k["µs"] is not None:
            k["µs"] /= 1e3   # ns
        if k["issued ipc"] is not None and k["sm active cyc"] is not None:   # warp instructions an SM issued
            k["k instr/SM"] = k["issued ipc"] * k["sm active cyc"] / 1e3
        stalls = {m[len(STALL):].split("_per_issue_active")[0]: _num(v) for m, v in rec.items()
                  if m.startswith(STALL) and "_per_issue_active" in m and _num(v)}
        k["stalls"] = dict(sorted(stalls.items(), key=lambda kv: -kv[1])[:4])
        kernels.append(k)
    return kernels


def _num(v):
    try:
        return float(str(v).replace(",", ""))
    except (TypeError, ValueError):
        return None


def show(case: str, kernels: list[dict]) -> None:
    print(f"\n{case}")
    cols = list(METRICS) + ["k instr/SM"]
    print(f"  {'kernel':<26}" + "".join(f"{c:>14}" for c in cols) + "   top stalls (cycles per issued instruction)")
    for k in kernels:
        vals = "".join(f"{k[c]:>14.3g}" if k.get(c) is not None else f"{'-':>14}" for c in cols)
        stalls = ", ".join(f"{n} {v:.2f}" for n, v in k["stalls"].items())
        print(f"  {k['kernel'][:26]:<26}{vals}   {stalls}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", nargs="*", default=list(DEFAULT_CASES))
    ap.add_argument("--timeout", type=float, default=150.0, help="seconds a case may take")
    ap.add_argument("--out", default="", help="JSON of every case's kernels")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        child(args.child)
        return 0
    ncu = shutil.which("ncu")
    if ncu is None:
        print("ncu (Nsight Compute) is not on the PATH")
        return 1
    result, failed = {}, 0
    with tempfile.TemporaryDirectory() as workdir:
        for case in args.cases:
            try:
                result[case] = profile(case, ncu, workdir, args.timeout)
                show(case, result[case])
            except (RuntimeError, subprocess.TimeoutExpired) as e:
                failed += 1
                print(f"\n{case}: {e}")
            if args.out:
                with open(args.out, "w") as f:
                    json.dump(result, f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
