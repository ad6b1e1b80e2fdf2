"""Skinny GEMM on the GPU: cuBLAS vs the Triton and CuTe kernels, against the copy ceiling.

    python benchmarks/skinny_gemm.py [--sweep] [--json out.json] [--ms 1,2,4,8,16] [--no-triton]
                                     [--static-weight]

Method (docs/anchors.md): the ceiling is a 2 GiB device-to-device copy measured in the same run;
each product streams its weight from HBM because the timed function walks through enough weight
copies (> 600 MB) that none stays in L2; times are medians of CUDA-graph replays
(triton.testing.do_bench_cudagraph) divided by the number of products per replay.
Bytes of one product: (N·K + M·K + M·N) · 2 (weight, activation and output once each).

--sweep also times every candidate configuration of the CuTe kernel and prints the per-shape best
(the table in k3compile/ops/skinny_gemm/config.py is filled from it); "cute" is then the best
configuration, or cuBLAS where none beat it (what the dispatch does).

Both kernels are timed with ``static_weight=False`` (the weight is touched only after the PDL wait,
but for an L2 prefetch); --static-weight times them as the dispatch runs them where the compiler proved
the weight static (first weight loads issued before the wait; safe only where no kernel writes it).
"""
import argparse
import json
import math
import sys

import torch
import torch.nn.functional as F

K3_SHAPES = [(4608, 7168), (1536, 7168), (2112, 7168), (2304, 1536), (896, 7168), (3584, 7168),
             (7168, 3584), (7168, 1536), (7168, 768), (20480, 7168)]
ROTATE_BYTES = 640 * 2**20


def bench(fn, reps_per_call):
    from triton.testing import do_bench_cudagraph
    return do_bench_cudagraph(fn, rep=10, return_mode="median") * 1e3 / reps_per_call  # µs


from _common import copy_ceiling_tbps  # noqa: E402


def providers(with_triton=True, static=False):
    out = {"cublas": lambda a, w, cfg=None: F.linear(a, w)}
    try:
        if with_triton:
            from k3compile.ops.skinny_gemm.triton import skinny_gemm_triton
            out["triton"] = lambda a, w, cfg=None: skinny_gemm_triton(a, w, static_weight=static)
    except Exception as e:  # the Triton kernel is another part's; report and go on
        print(f"# triton kernel not benchmarked: {type(e).__name__}: {e}", file=sys.stderr)
    try:
        from k3compile.ops.skinny_gemm import cute as kc
        if kc.available(torch.empty(1, 8, device="cuda", dtype=torch.bfloat16),
                        torch.empty(8, 8, device="cuda", dtype=torch.bfloat16)) is None:
            out["cute"] = lambda a, w, cfg=None: kc.skinny_gemm_cute(a, w, cfg=cfg, static_weight=static)
    except Exception as e:
        print(f"# cute kernel not benchmarked: {type(e).__name__}: {e}", file=sys.stderr)
    return out


def candidates(m, n, k):
    """The table's and the heuristic's picks, then the configurations that won somewhere on the H200
    (cp.async rings of several depths, split-K clusters of 2 for few row blocks)."""
    from k3compile.ops.skinny_gemm import config as cc
    seen = [c for c in (cc.TABLE.get((cc.m_bucket(m), n, k)), cc.heuristic(m, n, k)) if c is not None]
    for rg, wn, wk, u, st, ks in [(1, 1, 8, 2, 3, 1), (1, 1, 4, 2, 4, 1), (2, 1, 4, 2, 4, 1), (1, 1, 16, 1, 4, 1),
                                  (1, 1, 8, 1, 8, 1), (1, 1, 4, 4, 1, 1), (1, 1, 8, 4, 1, 1),
                                  (1, 1, 8, 2, 3, 2), (1, 1, 16, 1, 4, 2), (1, 1, 8, 2, 4, 2)]:
        c = cc.SkinnyConfig(rg, wn, wk, u, stages=st, split_k=ks)
        if (c not in seen and n >= 8 * rg * ks and c.smem_bytes() <= 48 * 1024
                and k // (cc.K_STEP * u * ks) >= wk):
            seen.append(c)
    return seen


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ms", default="1,2,4,8,16")
    ap.add_argument("--shapes", default=None, help="N×K list, e.g. 896x7168,4608x7168")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--json", default=None)
    ap.add_argument("--static-weight", action="store_true",
                    help="time the kernels with static_weight=True (what the dispatch runs for proven-static weights)")
    ap.add_argument("--no-triton", action="store_true", help="leave the Triton kernel out")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    ms = [int(x) for x in args.ms.split(",")]
    shapes = K3_SHAPES if args.shapes is None else [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    torch.manual_seed(0)
    ceil = copy_ceiling_tbps()
    print(f"# copy ceiling: {ceil:.3f} TB/s (2 GiB device-to-device copy, read + write)")
    provs = providers(with_triton=not args.no_triton, static=args.static_weight)
    rows, table = [], {}
    for n, k in shapes:
        copies = max(2, math.ceil(ROTATE_BYTES / (n * k * 2)))
        ws = [torch.randn(n, k, device="cuda", dtype=dtype) / k**0.5 for _ in range(copies)]
        for m in ms:
            a = torch.randn(m, k, device="cuda", dtype=dtype)
            nbytes = (n * k + m * k + m * n) * 2
            floor_us = nbytes / (ceil * 1e12) * 1e6
            ref = F.linear(a.double(), ws[0].double())
            res = {}
            for name, f in provs.items():
                cfgs = [None]
                if name == "cute" and args.sweep:
                    cfgs = candidates(m, n, k)
                best = None
                for cfg in cfgs:
                    try:
                        out = f(a, ws[0], cfg)
                        err = ((out.double() - ref).norm() / ref.norm()).item()
                        if not err < 2e-2:
                            print(f"# {name} {cfg} M{m} N{n} K{k}: WRONG rel={err:.2e}", file=sys.stderr)
                            continue
                        us = bench(lambda: [f(a, w, cfg) for w in ws], copies)
                    except Exception as e:
                        print(f"# {name} {cfg} M{m} N{n} K{k}: {type(e).__name__}: {e}", file=sys.stderr)
                        continue
                    rows.append(dict(provider=name, cfg=None if cfg is None else cfg.tag(), m=m, n=n, k=k,
                                     us=us, frac=floor_us / us, rel=err, sweep=args.sweep and name == "cute"))
                    if best is None or us < best[0]:
                        best = (us, cfg)
                if best is not None:
                    res[name] = best
            cub = res.get("cublas", (float("nan"),))[0]
            line = f"N{n:>6} K{k:>5} M{m:>2} | floor {floor_us:6.2f} µs | cuBLAS {cub:6.2f} µs {floor_us / cub:5.1%}"
            for name in ("triton", "cute"):
                if name in res:
                    us = res[name][0]
                    line += f" | {name} {us:6.2f} µs {floor_us / us:5.1%} x{cub / us:4.2f}"
            if "cute" in res:
                best_us, best_cfg = res["cute"]
                if args.sweep:  # what a table built from this sweep would pick
                    picked = min(best_us, cub)
                else:  # what the dispatch picks: the table's config, or cuBLAS where it says None
                    from k3compile.ops.skinny_gemm import config as cc
                    picked = best_us if cc.choose(m, n, k) is not None else cub
                line += f" | dispatched {picked:6.2f} µs {floor_us / picked:5.1%} x{cub / picked:4.2f}"
                line += "" if picked != cub or args.sweep else " [cuBLAS]"
                if args.sweep:
                    table[(m, n, k)] = best_cfg if best_us < cub else None
                    line += f" [{best_cfg.tag() if best_us < cub else 'cuBLAS'}]"
                rows.append(dict(provider="dispatched", m=m, n=n, k=k, us=picked, frac=floor_us / picked,
                                 cfg="cublas" if picked == cub else (best_cfg.tag() if best_cfg else "table")))
            print(line, flush=True)
        del ws
        torch.cuda.empty_cache()
        if args.json:  # after every shape, so a run cut short still leaves its figures
            dump(args, ceil, rows)
    # summary: geometric mean speedup after dispatch, and the ceiling fractions the issue asks for
    disp = [r for r in rows if r["provider"] == "dispatched"]
    cub = {(r["m"], r["n"], r["k"]): r["us"] for r in rows if r["provider"] == "cublas"}
    if disp:
        sp = [cub[(r["m"], r["n"], r["k"])] / r["us"] for r in disp]
        print(f"# dispatched vs cuBLAS: geomean x{math.exp(sum(map(math.log, sp)) / len(sp)):.3f}, "
              f"min x{min(sp):.3f}, max x{max(sp):.3f}")
    for name in ("triton",):
        rs = [r for r in rows if r["provider"] == name]
        if rs:
            sp = [cub[(r["m"], r["n"], r["k"])] / r["us"] for r in rs]
            print(f"# {name} vs cuBLAS: geomean x{math.exp(sum(map(math.log, sp)) / len(sp)):.3f}; "
                  f"median ceiling fraction {sorted(r['frac'] for r in rs)[len(rs) // 2]:.1%}")
    if args.sweep:
        print("# TABLE = {")
        for (m, n, k), c in table.items():
            print(f"#     ({m}, {n}, {k}): {'None' if c is None else 'SkinnyConfig(%d, %d, %d, %d, stages=%d, split_k=%d)' % (c.row_groups, c.warps_n, c.warps_k, c.unroll, c.stages, c.split_k)},")
        print("# }")
    if args.json:
        dump(args, ceil, rows)


def dump(args, ceil, rows):
    with open(args.json, "w") as fh:
        json.dump(dict(copy_ceiling_tbs=ceil, dtype=args.dtype, device=torch.cuda.get_device_name(),
                       torch=torch.__version__, command=" ".join(sys.argv), rows=rows), fh, indent=1)


if __name__ == "__main__":
    main()
