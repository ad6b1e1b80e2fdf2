"""Config sweep of the Triton skinny GEMM on one GPU: % of the same-run HBM copy ceiling per config.

    python benchmarks/skinny_gemm_triton_configs.py [--json OUT.json] [--budget-s 100] [--ms 1,4,16] [--shapes 4608x7168,...]
    python benchmarks/skinny_gemm_triton_configs.py --defaults [--json OUT.json]     # what the dispatch picks only
    python benchmarks/skinny_gemm_triton_configs.py --checks [--json OUT.json]       # issue 27's two goals

What the Triton heuristic (k3compile/ops/skinny_gemm/triton_config.py) was read off (docs/tuning/skinny_gemm.md).
``MM_SMOKE_DEVICE=cpu`` with ``TRITON_INTERPRET=1`` checks the logic.

``--defaults``: only the dispatch's picks, with ``static_weight`` off and on (what the dispatch runs where
the compiler proved the weight static; today the same kernel, so the two columns also show the run's noise), on
the >= 32 MB decode shapes at M 1/2/4/8/16 (% of the ceiling, ratio to cuBLAS).

``--checks``: the dispatch's Triton pick (weight not static) and cuBLAS at every K3 shape and M 1/2/4/8/16, then two
lines: CHECK 1, the Triton path after the dispatch's Triton-or-vendor-BLAS choice (``dispatch.order`` without CuTe, as
on a GPU where CuTe cannot run) >= 1.0x cuBLAS at every point (where the dispatch picks cuBLAS the path is cuBLAS:
x1.00); CHECK 2, the Triton kernel's median % of the copy ceiling on the >= 32 MB weights >= 80%. Needs no CuTe DSL.

For every (N, K, M): the current heuristic, dot configs around "n programs per SM" (BLOCK_N 32/64/128,
split-K one-launch or two-launch, num_stages, num_warps) and, for M <= 4, CUDA-core (fma) configs.
Each config is first checked against a float64 torch reference (output poisoned with NaN, called twice so
the one-launch counters must have rearmed), then timed: one CUDA graph of calls walking through > 640 MB of
weight copies (none stays in L2), replayed 15 times, median per product. cuBLAS (F.linear) is timed the same way.
Kernels are compiled first in parallel worker processes (Triton's disk cache), so the sweep itself is quick.
"""
import argparse
import dataclasses
import json
import math
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

_ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
sys.path[:0] = [os.path.join(_ROOT, "benchmarks")] + ([] if "k3compile" in sys.modules else [_ROOT])

SHAPES = [(20480, 7168), (4608, 7168), (3584, 7168), (7168, 3584), (2112, 7168), (896, 7168), (7168, 1536)]
BIG_SHAPES = [(4608, 7168), (3584, 7168), (7168, 3584), (20480, 7168)]  # weights >= 32 MB (issue 3's goal)
ROTATE_BYTES = int(os.environ.get("MM_ROTATE_MB", 640)) * 2**20
T0 = time.time()
DEV = os.environ.get("MM_SMOKE_DEVICE", "cuda")  # "cpu": a logic smoke test under TRITON_INTERPRET=1


def cdiv(a, b):
    return -(-a // b)


def pow2(x):
    return 1 << max(0, (x - 1).bit_length())


def eff_split(k, bk, split):
    """The split the kernel really runs: K slices are whole BLOCK_K multiples."""
    return cdiv(k, cdiv(cdiv(k, split), bk) * bk)


def candidates(m, n, k, sms, defaults=False):
    """(config, static_weight) pairs to time; the first is what the dispatch picks (its table on this GPU, else
    the heuristic) for a weight not proven static."""
    from k3compile.ops.skinny_gemm import dispatch
    from k3compile.ops.skinny_gemm.triton_config import TritonConfig

    gpu = dispatch.gpu_of(torch.device("cuda"))
    pick = dispatch.triton_config_for(torch.bfloat16, m, n, k, gpu._replace(sms=sms))
    if defaults:
        return [(pick, False), (pick, True)]
    out = [pick]

    def add(c):
        if c not in out and c.block_m >= m:
            out.append(c)

    def split_for(bn, bk, per_sm):
        s = max(1, min(round(per_sm * sms / cdiv(n, bn)), k // (2 * bk), 32))
        return eff_split(k, bk, s)

    def exact_split(bn, bk):  # the smallest split whose grid is a whole number of waves, if any
        tiles = cdiv(n, bn)
        for s in range(1, min(k // (2 * bk), 32) + 1):
            if eff_split(k, bk, s) == s and (tiles * s) % sms == 0:
                return s
        return None

    bm = max(16, pow2(m))
    for bn in (32, 64, 128):
        for per_sm in (2, 4, 8):
            add(TritonConfig(block_m=bm, block_n=bn, block_k=128, split_k=split_for(bn, 128, per_sm), num_warps=4,
                             num_stages=None, one_launch=True))
        s = exact_split(bn, 128)
        if s:
            add(TritonConfig(block_m=bm, block_n=bn, block_k=128, split_k=s, num_warps=4, num_stages=None,
                             one_launch=True))
    s4 = split_for(64, 128, 4)
    add(TritonConfig(block_m=bm, block_n=64, block_k=128, split_k=s4, num_warps=4, num_stages=None,
                     one_launch=False))          # what the second launch costs
    for st in (2, 4, 5):
        add(TritonConfig(block_m=bm, block_n=64, block_k=128, split_k=s4, num_warps=4, num_stages=st, one_launch=True))
    add(TritonConfig(block_m=bm, block_n=32, block_k=128, split_k=split_for(32, 128, 4), num_warps=4, num_stages=4,
                     one_launch=True))
    add(TritonConfig(block_m=bm, block_n=32, block_k=128, split_k=split_for(32, 128, 8), num_warps=4, num_stages=5,
                     one_launch=True))
    add(TritonConfig(block_m=bm, block_n=128, block_k=128, split_k=split_for(128, 128, 4), num_warps=8,
                     num_stages=None, one_launch=True))
    add(TritonConfig(block_m=bm, block_n=64, block_k=256, split_k=split_for(64, 256, 4), num_warps=4, num_stages=3,
                     one_launch=True))
    add(TritonConfig(block_m=bm, block_n=64, block_k=64, split_k=split_for(64, 64, 8), num_warps=4, num_stages=4,
                     one_launch=True))
    for bn, per_sm, st in ((32, 4, None), (64, 4, None), (64, 8, None), (128, 4, None), (64, 4, 5), (32, 8, 5)):
        add(TritonConfig(block_m=bm, block_n=bn, block_k=128, split_k=split_for(bn, 128, per_sm), num_warps=4,
                         num_stages=st, one_launch=True, tma=True))
    # programmatic dependent launch: weight lines prefetched into L2 while the previous product finishes
    # (the next kernel is let in after the K loop since the 03:02 run, where it was let in at the start)
    for bn, per_sm, st, tma, lines in ((32, 4, None, True, 8), (32, 4, None, True, 32), (32, 4, None, False, 8),
                                       (64, 4, None, True, 8), (32, 8, None, True, 8), (32, 2, None, True, 16)):
        add(TritonConfig(block_m=bm, block_n=bn, block_k=128, split_k=split_for(bn, 128, per_sm), num_warps=4,
                         num_stages=st, one_launch=True, tma=tma, pdl=True,
                         prefetch_lines=lines))
    # the early trigger (the next product let in right after our wait): only while the grid fits one wave
    for per_sm in (3.4, 2.5):
        s = max(1, min(int(per_sm * sms) // cdiv(n, 32), k // (2 * 128), 32))
        add(TritonConfig(block_m=bm, block_n=32, block_k=128, split_k=eff_split(k, 128, s), num_warps=4,
                         num_stages=None, one_launch=True, tma=True, pdl=True, prefetch_lines=0,
                         early_trigger=True))
    # (CUDA-core fma configs: never within 5 points of the best in the 03:02 run; no longer swept)
    # the co-resident grids (two consecutive products fit on the SMs) around the pick: depth and warps
    base = out[0]
    if base.poll:  # a split pick's polled tail against the arrival counter and the early trigger it replaced
        add(dataclasses.replace(base, poll=False, early_trigger=True, prefetch_lines=0))
        add(dataclasses.replace(base, prefetch_lines=4))
    if base.pdl and base.early_trigger:
        for st in (3, 4, 5):
            for w in (2, 4):
                add(dataclasses.replace(base, num_stages=st, num_warps=w))
    return [(c, False) for c in out]   # static_weight changes no Triton pick


def spec(x):
    return 1 if x == 1 else (16 if x % 16 == 0 else 0)


def compile_key(m, k, cfg, static):
    """What makes Triton compile a new binary: constexprs and how the ints specialise (== 1, % 16);
    N, K, K_PER_SPLIT and the strides are multiples of 16 for every shape here. The split count itself
    is a runtime int."""
    s = eff_split(k, cfg.block_k, cfg.split_k)
    return (spec(m), spec(s), s > 1, dataclasses.replace(cfg, split_k=1), static and cfg.pdl)


def _compile_one(job):
    m, k, cfg, static = job
    import torch
    from k3compile.ops.skinny_gemm.triton import skinny_gemm_triton
    try:
        a = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
        w = torch.randn(cfg.block_n * 4, k, device=DEV, dtype=torch.bfloat16)
        skinny_gemm_triton(a, w, config=cfg, static_weight=static)
        if DEV == "cuda":
            torch.cuda.synchronize()
        return None
    except Exception as e:
        return f"{type(e).__name__}: {str(e)[:200]}"


def precompile(jobs, workers):
    from concurrent.futures import ProcessPoolExecutor
    import multiprocessing as mp
    keys = {}
    for job in jobs:
        keys.setdefault(compile_key(*job), job)
    t = time.time()
    try:
        with ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn")) as ex:
            errs = list(ex.map(_compile_one, keys.values()))
        bad = [(j, e) for j, e in zip(keys.values(), errs) if e]
        for (m, k, cfg, _), e in bad[:10]:
            print(f"# compile M{m} {cfg.tag()}: {e}", file=sys.stderr)
        print(f"# precompiled {len(keys)} kernels in {time.time() - t:.1f}s with {workers} workers "
              f"({len(bad)} failed)", flush=True)
    except Exception as e:  # the sweep still works, compiling as it goes
        print(f"# parallel precompile failed ({type(e).__name__}: {e}); compiling inline", file=sys.stderr)


def graph_us(fn, calls, replays=15):
    """Median µs per product of one CUDA graph holding ``calls`` products (fn makes them all)."""
    if DEV == "cpu":
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e6 / calls
    from _common import graph_replay_us

    return graph_replay_us(fn, iters=1, replays=replays, warmup=1) / calls


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ms", default=None, help="default 1,4,16; 1,2,4,8,16 with --defaults")
    ap.add_argument("--defaults", action="store_true", help="time only the dispatch's picks (static off/on)")
    ap.add_argument("--checks", action="store_true",
                    help="the dispatch's picks at every K3 shape: CHECK 1 (>= 1.0x cuBLAS), CHECK 2 (>= 80%%)")
    ap.add_argument("--shapes", default=None)
    ap.add_argument("--json", default=os.path.join(os.environ.get("OUT", "."), "mm_sweep.json"))
    ap.add_argument("--budget-s", type=float, default=100.0, help="stop sweeping (keep heuristic + cuBLAS) after this")
    ap.add_argument("--workers", type=int, default=min(14, max(1, (os.cpu_count() or 4) - 2)))
    args = ap.parse_args()
    from _common import copy_ceiling_tbps
    if DEV == "cpu":
        copy_ceiling_tbps = lambda: 4.0  # noqa: E731
        torch.cuda.get_device_properties = lambda i: type("P", (), dict(multi_processor_count=4))
        torch.cuda.get_device_name = lambda *a: "cpu"
        torch.cuda.get_device_capability = lambda *a: (9, 0)
        torch.cuda.synchronize = torch.cuda.empty_cache = lambda *a: None
    from k3compile.ops.skinny_gemm.triton import skinny_gemm_triton

    args.defaults = args.defaults or args.checks   # the dispatch's picks only
    ms = [int(x) for x in (args.ms or ("1,2,4,8,16" if args.defaults else "1,4,16")).split(",")]
    from skinny_gemm import K3_SHAPES
    shapes = ((K3_SHAPES if args.checks else BIG_SHAPES if args.defaults else SHAPES) if args.shapes is None
              else [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")])
    dtype = torch.bfloat16
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    plan = {(n, k, m): candidates(m, n, k, sms, args.defaults)[:1 if args.checks else None] for n, k in shapes
            for m in ms}
    print(f"# {torch.cuda.get_device_name()} SMs={sms} torch {torch.__version__}; "
          f"{sum(map(len, plan.values()))} (shape, config) points", flush=True)
    precompile([(m, k, c, st) for (n, k, m), cs in plan.items() for c, st in cs], args.workers)
    ceil = copy_ceiling_tbps()
    print(f"# copy ceiling {ceil:.3f} TB/s; t={time.time() - T0:.0f}s", flush=True)
    rows, best = [], {}
    torch.manual_seed(0)
    for n, k in shapes:
        copies = max(2, math.ceil(ROTATE_BYTES / (n * k * 2)))
        ws = [torch.randn(n, k, device=DEV, dtype=dtype) / k**0.5 for _ in range(copies)]
        for m in ms:
            a = torch.randn(m, k, device=DEV, dtype=dtype)
            floor_us = (n * k + m * k + m * n) * 2 / (ceil * 1e12) * 1e6
            ref = F.linear(a.double(), ws[0].double())
            cub = graph_us(lambda: [F.linear(a, w) for w in ws], copies)
            rows.append(dict(provider="cublas", m=m, n=n, k=k, us=cub, frac=floor_us / cub))
            print(f"N{n:>6} K{k:>5} M{m:>2} floor {floor_us:6.2f}us  cuBLAS {cub:6.2f}us {floor_us / cub:6.1%}",
                  flush=True)
            res = []
            for i, (cfg, static) in enumerate(plan[(n, k, m)]):
                if i > 0 and time.time() - T0 > args.budget_s:
                    print("#   (time budget spent: remaining configs skipped)")
                    break
                try:
                    errs = []
                    for _ in range(2):  # twice: the one-launch counters must be back at zero
                        out = torch.full((m, n), float("nan"), device=DEV, dtype=dtype)
                        skinny_gemm_triton(a, ws[0], config=cfg, out=out, static_weight=static)
                        errs.append(((out.double() - ref).norm() / ref.norm()).item())
                    err = max(errs)
                    if not err < 2e-2:
                        print(f"#   {cfg.tag()}: WRONG rel={err:.2e}", flush=True)
                        rows.append(dict(provider="triton", cfg=cfg.tag(), static=static, m=m, n=n, k=k, wrong=err))
                        continue
                    us = graph_us(lambda: [skinny_gemm_triton(a, w, config=cfg, static_weight=static) for w in ws],
                                  copies)
                except Exception as e:
                    print(f"#   {cfg.tag()}: {type(e).__name__}: {str(e)[:300]}", flush=True)
                    continue
                frac = floor_us / us
                res.append((us, cfg, static))
                rows.append(dict(provider="triton", cfg=cfg.tag(), config=cfg.__dict__, heuristic=i == 0, static=static,
                                 grid=cdiv(n, cfg.block_n) * eff_split(k, cfg.block_k,
                                                                       cfg.split_k), m=m, n=n, k=k, us=us, frac=frac, rel=err))
                grid = cdiv(n, cfg.block_n) * eff_split(k, cfg.block_k, cfg.split_k)
                print(f"    {'H ' if i == 0 else '  '}{cfg.tag() + (' S' if static else ''):<34} grid {grid:>5} "
                      f"{us:7.2f}us {frac:6.1%} x{cub / us:4.2f} rel {err:.1e}", flush=True)
            if res:
                us, cfg, static = min(res, key=lambda t: t[0])
                h = res[0][0] if (res[0][1], res[0][2]) == plan[(n, k, m)][0] else float("nan")
                best[(n, k, m)] = (us, cfg)
                print(f"  BEST N{n} K{k} M{m}: {cfg.tag()}{' static' if static else ''} {us:.2f}us "
                      f"{floor_us / us:.1%} of ceiling (heuristic {floor_us / h:.1%}, cuBLAS {floor_us / cub:.1%})",
                      flush=True)
        del ws
        torch.cuda.empty_cache()
        dump(args.json, ceil, sms, rows)
    if args.defaults:  # the dispatch's picks against the ceiling and cuBLAS
        cubs = {(r["n"], r["k"], r["m"]): r["us"] for r in rows if r["provider"] == "cublas"}
        print("# N x K      M | cuBLAS        | triton (weight not static) | triton (static weight)")
        for r0 in rows:
            if r0["provider"] != "cublas":
                continue
            key = (r0["n"], r0["k"], r0["m"])
            line = f"# {r0['n']:>5}x{r0['k']:<5} {r0['m']:>2} | {r0['us']:6.2f}us {r0['frac']:5.1%} |"
            for static in (False, True):
                t = [r for r in rows if r["provider"] == "triton" and "us" in r and r["static"] == static
                     and (r["n"], r["k"], r["m"]) == key]
                line += (f" {t[0]['us']:6.2f}us {t[0]['frac']:5.1%} x{cubs[key] / t[0]['us']:4.2f} |" if t
                         else " -- |")
            print(line)
    if args.checks:
        print_checks(rows, sms)
    print("# summary: best config per point")
    for (n, k, m), (us, cfg) in best.items():
        print(f"#   ({m}, {n}, {k}): {cfg!r},  # {us:.2f} us")
    dump(args.json, ceil, sms, rows)
    print(f"# done in {time.time() - T0:.0f}s")


def print_checks(rows, sms):
    """Issue 27's two goals, one line each: the Triton path after the dispatch's choice against cuBLAS at every
    point, and the Triton kernel's median share of the copy ceiling on the >= 32 MB weights."""
    from k3compile.ops.skinny_gemm import dispatch

    gpu = dispatch.gpu_of(torch.device("cuda"))
    cub = {(r["n"], r["k"], r["m"]): r for r in rows if r["provider"] == "cublas"}
    tri = {(r["n"], r["k"], r["m"]): r for r in rows if r["provider"] == "triton" and "us" in r and not r["static"]}
    ratios, missing = {}, []
    for key, c in cub.items():
        n, k, m = key
        if "triton" not in dispatch.order(torch.bfloat16, m, n, k, gpu.table):
            ratios[key] = 1.0   # the dispatch runs cuBLAS here
        elif key in tri:
            ratios[key] = c["us"] / tri[key]["us"]
        else:
            missing.append(key)   # dispatched to a Triton kernel that did not run correctly
    worst = min(ratios, key=ratios.get) if ratios else None
    picked = sum(1 for key in ratios if key in tri and "triton" in dispatch.order(torch.bfloat16, key[2], key[0],
                                                                                    key[1], gpu.table))
    ok = bool(ratios) and not missing and ratios[worst] >= 1.0
    print(f"CHECK 1 the Triton path after dispatch >= 1.00x cuBLAS at every K3 shape and M: {'PASS' if ok else 'FAIL'}"
          + (f" (min x{ratios[worst]:.3f} at {worst[0]}x{worst[1]} M{worst[2]}; Triton dispatched at {picked} of "
             f"{len(cub)} points, cuBLAS at the rest{'; no result at ' + str(missing) if missing else ''})"
             if worst else " (nothing measured)"))
    big = [tri[key]["frac"] for key in tri if key[:2] in BIG_SHAPES]
    med = statistics.median(big) if big else float("nan")
    low = min((key for key in tri if key[:2] in BIG_SHAPES), key=lambda key: tri[key]["frac"], default=None)
    print(f"CHECK 2 the Triton kernel >= 80% of the copy ceiling on >= 32 MB weights (median of {len(big)}): "
          f"{'PASS' if med >= 0.80 else 'FAIL'} (median {med:.1%}"
          + (f", min {tri[low]['frac']:.1%} at {low[0]}x{low[1]} M{low[2]})" if low else ")"))


def dump(path, ceil, sms, rows):
    with open(path, "w") as fh:
        json.dump(dict(copy_ceiling_tbs=ceil, sms=sms, device=torch.cuda.get_device_name(), torch=torch.__version__,
                       command=" ".join(sys.argv), rows=rows), fh, indent=1)


if __name__ == "__main__":
    main()
