"""Skinny GEMM on the GPU: cuBLAS vs the Triton and CuTe kernels, against the copy ceiling (issues 3 and 4).

    python benchmarks/skinny_gemm.py [--json out.json] [--png out.png] [--ms 1,2,4,8,16] [--shapes 896x7168,...]
                                     [--no-triton] [--sweep] [--replays 15] [--passes 3]

Method (docs/measuring.md): the ceiling is a 2 GiB device-to-device copy measured in the same run; each
product streams its weight from HBM because the timed function walks through enough weight copies
(> 600 MB) that none stays in L2, back to back as a decode layer stack runs them; times are medians of
CUDA-graph replays divided by the number of products per replay; the providers of one (shape, M) are
timed in turn, ``--passes`` times over, and each keeps the median of its passes. Bytes of one product:
(N·K + M·K + M·N) · 2 (weight, activation and output once each). Every kernel is checked against a
float64 reference (NaN-poisoned output) before it is timed.

Each kernel runs twice: with ``static_weight=False`` (the weight is read only after the PDL wait, but for
L2 prefetches) and with ``static_weight=True`` ("+static": what compiled graphs run where the compiler
proved the weight static). "dispatched" is the CuTe kernel with the table's configuration where the table tries
CuTe first, the Triton kernel where it tries Triton first, else cuBLAS (composed from those timings); "op" is
``k3::skinny_gemm`` itself, timed as a unit: its dispatch between CuTe, Triton and cuBLAS, the path compiled
graphs take. The summary prints the issue's four figures for each: median % of the ceiling on weights >= 32 MB
and on 8-32 MB, geomean speedup over cuBLAS, and the router (896×7168) ratio per M.

--sweep times the candidate configurations of ``sweep_candidates`` instead of the table's and reports, per
shape, the best (what a table built from the run would dispatch).
"""
import argparse
import json
import math
import statistics
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import copy_ceiling_tbps, graph_replay_us, interleaved_passes  # noqa: E402

K3_SHAPES = [(4608, 7168), (1536, 7168), (2112, 7168), (2304, 1536), (896, 7168), (3584, 7168),
             (7168, 3584), (7168, 1536), (7168, 768), (20480, 7168)]
ROTATE_BYTES = 640 * 2**20
ROUTER = (896, 7168)


def table():
    """The dispatch's table for this GPU (``k3compile/ops/skinny_gemm/tables/``)."""
    from k3compile.ops.skinny_gemm import dispatch
    return dispatch.gpu_of(torch.device("cuda")).table


def sweep_candidates(n, k, dtype=torch.bfloat16):
    """Configurations worth timing for a shape: the table's, the heuristic's, and divisions that won on the
    H200 (cp.async rings for long K, registers for short K; early trigger and L2 prefetch of the block's
    whole weight share, or of a part of it when the weight outgrows L2; split-K clusters for few rows)."""
    from k3compile.kernels.cute.configs import K_STEP, MmaConfig
    from k3compile.ops.skinny_gemm import cute_config, dispatch

    def C(rg, wn, wk, u, **kw):
        return MmaConfig(row_groups=rg, warps_n=wn, warps_k=wk, unroll=u, **kw)

    row_kb = k * 2 * 8 // 1024  # one 8-row group's whole K, in KB
    out = [c for st in (False, True) for m in (1, 16)  # the mma.sync kernel's (a table entry may name the wgmma one)
           for c in (dispatch.cute_config_for(dtype, m, n, k, st, table()), cute_config.mma_heuristic(m, n, k))
           if isinstance(c, MmaConfig)]
    out += [C(1, 1, 8, 2, stages=3, early=True, l2_kb=row_kb), C(1, 1, 8, 2, stages=3, early=True, l2_kb=16),
            C(1, 1, 8, 2, stages=3, split_k=2, early=True, l2_kb=row_kb // 2),
            C(2, 1, 4, 2, stages=4, early=True, l2_kb=2 * row_kb), C(1, 1, 4, 4, early=True, l2_kb=row_kb)]
    seen = []
    for c in out:
        if c not in seen and n >= 8 * c.row_groups * c.split_k and k // (K_STEP * c.unroll * c.split_k) >= c.warps_k:
            seen.append(c)
    return seen


def providers(with_triton=True):
    """name -> fn(a, w, cfg, out) for every kernel that can run here."""
    out = {"cublas": lambda a, w, cfg=None: F.linear(a, w)}
    if with_triton:
        try:
            from k3compile.ops.skinny_gemm.triton import skinny_gemm_triton
            out["triton"] = lambda a, w, cfg=None: skinny_gemm_triton(a, w, static_weight=False)
            out["triton+static"] = lambda a, w, cfg=None: skinny_gemm_triton(a, w, static_weight=True)
        except Exception as e:  # the Triton kernel is another part's; report and go on
            print(f"# triton kernel not benchmarked: {type(e).__name__}: {e}", file=sys.stderr)
    try:  # the op as compiled graphs call it: its own dispatch between CuTe, Triton and cuBLAS
        import k3compile.ops.skinny_gemm  # noqa: F401  (registers k3::skinny_gemm)
        op = torch.ops.k3.skinny_gemm.default
        out["op"] = lambda a, w, cfg=None: op(a, w, None, None, "auto", 16, False)
        out["op+static"] = lambda a, w, cfg=None: op(a, w, None, None, "auto", 16, True)
    except Exception as e:
        print(f"# k3::skinny_gemm not benchmarked: {type(e).__name__}: {e}", file=sys.stderr)
    try:
        from k3compile.backends import cute_can_run_on
        from k3compile.ops.skinny_gemm import cute as kc
        if cute_can_run_on(torch.empty(1, 8, device="cuda", dtype=torch.bfloat16)) is None:
            out["cute"] = lambda a, w, cfg=None: kc.skinny_gemm_cute(a, w, None, None, cfg, static_weight=False)
            out["cute+static"] = lambda a, w, cfg=None: kc.skinny_gemm_cute(a, w, None, None, cfg, static_weight=True)
    except Exception as e:
        print(f"# cute kernel not benchmarked: {type(e).__name__}: {e}", file=sys.stderr)
    return out


def rel_to(out, ref):
    return ((out.double() - ref).norm() / ref.norm()).item()


def time_one(name, f, a, ws, ref, cfg, replays):
    """µs per product, or None (wrong results or an error, reported)."""
    m, n = a.shape[0], ws[0].shape[0]
    try:
        out = f(a, ws[0], cfg)
        err = rel_to(out, ref)
        if not err < 2e-2:  # NaN fails too
            print(f"# {name} {cfg} M{m} N{n}: WRONG rel={err:.2e}", file=sys.stderr)
            return None, err
        us = graph_replay_us(lambda: [f(a, w, cfg) for w in ws], iters=1, replays=replays, warmup=1) / len(ws)
        return us, err
    except Exception as e:
        print(f"# {name} {cfg} M{m} N{n}: {type(e).__name__}: {e}", file=sys.stderr)
        return None, None


def summarise(rows, ceil):
    """The issue's four figures for the dispatched path, static weight off and on."""
    lines = []
    cub = {(r["m"], r["n"], r["k"]): r["us"] for r in rows if r["provider"] == "cublas"}
    for prov in ("dispatched", "dispatched+static", "op", "op+static", "triton", "triton+static"):
        rs = [r for r in rows if r["provider"] == prov and (r["m"], r["n"], r["k"]) in cub]
        if not rs:
            continue
        big = [r["frac"] for r in rs if r["n"] * r["k"] * 2 >= 32e6]
        mid = [r["frac"] for r in rs if 8e6 <= r["n"] * r["k"] * 2 < 32e6]
        sp = [cub[(r["m"], r["n"], r["k"])] / r["us"] for r in rs]
        router = {r["m"]: cub[(r["m"], r["n"], r["k"])] / r["us"] for r in rs if (r["n"], r["k"]) == ROUTER}
        med = lambda v: statistics.median(v) if v else float("nan")  # noqa: E731
        lines.append(f"# {prov:>17}: median {med(big):5.1%} of ceiling on >= 32 MB (n={len(big)}), "
                     f"{med(mid):5.1%} on 8-32 MB (n={len(mid)}); geomean x{math.exp(sum(map(math.log, sp)) / len(sp)):.3f}"
                     f" over cuBLAS (min x{min(sp):.3f}); router " + " ".join(f"M{m}:x{v:.2f}" for m, v in sorted(router.items())))
    return lines


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ms", default="1,2,4,8,16")
    ap.add_argument("--shapes", default=None, help="N×K list, e.g. 896x7168,4608x7168")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--json", default=None)
    ap.add_argument("--png", default=None, help="plot of achieved bandwidth (benchmarks/plot_skinny_gemm.py)")
    ap.add_argument("--replays", type=int, default=15, help="CUDA-graph replays per timing (median)")
    ap.add_argument("--no-triton", action="store_true", help="leave the Triton kernel out")
    ap.add_argument("--passes", type=int, default=3,
                    help="interleaved timings of every provider per (shape, M); the median is kept (not with --sweep)")
    args = ap.parse_args()
    from k3compile.ops.skinny_gemm import dispatch
    dtype = getattr(torch, args.dtype)
    ms = [int(x) for x in args.ms.split(",")]
    shapes = K3_SHAPES if args.shapes is None else [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    torch.manual_seed(0)
    ceil = copy_ceiling_tbps()
    print(f"# copy ceiling: {ceil:.3f} TB/s (2 GiB device-to-device copy, read + write)", flush=True)
    provs = providers(with_triton=not args.no_triton)
    rows = []
    for n, k in shapes:
        copies = max(2, math.ceil(ROTATE_BYTES / (n * k * 2)))
        ws = [torch.randn(n, k, device="cuda", dtype=dtype) / k**0.5 for _ in range(copies)]
        for m in ms:
            a = torch.randn(m, k, device="cuda", dtype=dtype)
            floor_us = (n * k + m * k + m * n) * 2 / (ceil * 1e12) * 1e6
            ref = F.linear(a.double(), ws[0].double())
            runs = []   # (name, f, cfg): every timing of this (shape, M)
            for name, f in provs.items():
                static = name.endswith("+static")
                cfgs = [None]
                if name.startswith("cute"):
                    cfgs = sweep_candidates(n, k, dtype) if args.sweep else \
                        [dispatch.cute_config_for(dtype, m, n, k, static, table())]
                runs += [(name, f, cfg) for cfg in cfgs]
            # the providers take turns over the passes; each keeps its median
            timers = {i: (lambda name=name, f=f, cfg=cfg: time_one(name, f, a, ws, ref, cfg, args.replays))
                      for i, (name, f, cfg) in enumerate(runs)}
            passes = interleaved_passes(timers, 1 if args.sweep else args.passes)
            times = {i: [(us, err) for us, err in out if us is not None] for i, out in passes.items()}
            res = {}
            for i, (name, f, cfg) in enumerate(runs):
                if not times[i]:
                    continue
                us = statistics.median([t for t, _ in times[i]])
                rows.append(dict(provider=name, cfg=None if cfg is None else cfg.tag(), m=m, n=n, k=k, us=us,
                                 us_passes=[t for t, _ in times[i]], frac=floor_us / us,
                                 rel=max(e for _, e in times[i]), sweep=args.sweep and cfg is not None))
                if name not in res or us < res[name][0]:
                    res[name] = (us, cfg)
            cub = res.get("cublas", (float("nan"), None))[0]
            line = f"N{n:>6} K{k:>5} M{m:>2} | floor {floor_us:6.2f} µs | cuBLAS {cub:6.2f} µs {floor_us / cub:5.1%}"
            for name in ("triton", "triton+static", "op", "op+static"):
                if name in res:
                    line += f" | {name} {floor_us / res[name][0]:5.1%} x{cub / res[name][0]:4.2f}"
            for name, disp in (("cute", "dispatched"), ("cute+static", "dispatched+static")):
                if name not in res:
                    continue
                us, cfg = res[name]
                if args.sweep:
                    first = "cute" if us < cub else None
                else:
                    first = (dispatch.order(dtype, m, n, k, table()) or (None,))[0]
                tri = res.get(name.replace("cute", "triton")) if first == "triton" else None
                picked, tag = (us, cfg.tag()) if first == "cute" else (tri[0], "triton") if tri else (cub, "cuBLAS")
                rows.append(dict(provider=disp, m=m, n=n, k=k, us=picked, frac=floor_us / picked, cfg=tag))
                line += f" | {disp} {picked:6.2f} µs {floor_us / picked:5.1%} x{cub / picked:4.2f} [{tag}]"
            print(line, flush=True)
        del ws
        torch.cuda.empty_cache()
        if args.json:  # after every shape, so a run cut short still leaves its figures
            dump(args, ceil, rows)
    for line in summarise(rows, ceil):
        print(line)
    if args.json:
        dump(args, ceil, rows)
        if args.png:
            try:
                from plot_skinny_gemm import main as plot
                plot(args.json, args.png)
            except ImportError as e:  # no matplotlib here: plot the JSON elsewhere
                print(f"# no plot: {e}; run benchmarks/plot_skinny_gemm.py {args.json} {args.png}")


def dump(args, ceil, rows):
    with open(args.json, "w") as fh:
        json.dump(dict(copy_ceiling_tbs=ceil, dtype=args.dtype, device=torch.cuda.get_device_name(),
                       torch=torch.__version__, command=" ".join(sys.argv), rows=rows,
                       summary=summarise(rows, ceil)), fh, indent=1)


if __name__ == "__main__":
    main()
