"""Tuner of ``k3::moe_experts``' decode form (M <= 16): the table's pick against candidate configurations, per format
and M; writes the faster picks into a copy of ``k3compile/ops/moe_experts/tables/h200.json``.

    python benchmarks/tune_moe_experts.py [--m 1 2 4 8 16] [--formats bf16 mxfp4] [--json out.json]
        [--table out_h200.json] [--budget 200]
    python benchmarks/tune_moe_experts.py --smoke      # every code path on the CPU (interpreter, tiny widths)

K3's rank at TP=8 on one GPU (E 896, top-16, L 3584, I 384), random routing, bf16 z; weights bf16 or MXFP4. Timing,
virtual layers, the floor and the checks are ``benchmarks/moe_experts.py``'s (``run_point``): CUDA graphs, the
median of interleaved passes, every call streaming its experts from HBM; each provider first checked against the
fp32 reference on fresh inputs (NaN-poisoned output). Providers: ``k3`` (the op as dispatched: the table's pick,
its tag under "form") and ``k3:<tag>`` (each candidate of ``CANDIDATES`` for that format and M).

The table: per (format, M) the fastest correct provider; a candidate replaces the table's pick only where it is
faster by more than ``MARGIN`` (else the pick stays, its entry written for that M with the time measured now).
Entries of other Ms, formats, widths and the dense entries are kept.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
import time
from pathlib import Path

if "--smoke" in sys.argv:   # before triton is imported: the kernels then run in its interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import moe_experts as bench  # noqa: E402
from k3compile.ops.moe_experts.config import TABLES, MoeConfig, default_config, table, tuned_config  # noqa: E402

MARGIN = 0.01   # a candidate must beat the table's pick by more than this (interleaved passes: ~0.5-1% noise)
TP = 8

# The candidates, most promising first (a run cut short by --budget keeps the first). Registers, occupancy and which
# loads pipeline (ptxas for sm_90a, Triton 3.7, at these widths) and the predictions: docs/tuning/moe_experts.md, run 5.
_E = dict(trigger_early=True)
# bf16: gate/up with 3 stages holds 96 registers (5 programs an SM, 2 slices: 384 programs at M 1, one wave)
_B3 = dict(stages_up=3, **_E)
# MXFP4 (bf16 z): weight rows and the bit-move conversion. Only tiles that give each thread >= 4 scale bytes a step
# keep every load of the K loop asynchronous (gate/up 2·block_i x block_l/32, down block_n x block_k/32 bytes over
# the threads): i32-l256 on 4 warps, i16-l256 on 2; down n128-k128 on 4. The register caps take gate/up from 174 to
# 128 registers (4 programs an SM; 8 B of spills) and down from 220 to 128 (3; 36 B)
_MX = dict(weight_rows=True, mxfp4_asm=True, block_i=32, block_l=256, stages_up=3, block_n=128, block_k=128,
           stages_down=3, **_E)
_MXR = dict(_MX, maxnreg_up=128, maxnreg_down=128)
CANDIDATES = {
    "bf16": {
        1: [MoeConfig(split_l=2, **_B3), MoeConfig(split_l=4, **_B3), MoeConfig(split_l=2, block_n=32, **_B3),
            MoeConfig(block_l=64, stages_up=4, split_l=4, **_E),
            MoeConfig(weight_rows=True, warps_up=8, split_l=2, **_B3),
            MoeConfig(gemv=True, weight_rows=True, block_i=16, block_l=64, stages_up=1, split_l=4, block_n=32,
                      stages_down=1, **_E)],
        2: [MoeConfig(split_l=2, **_B3), MoeConfig(split_l=2, block_n=32, **_B3),
            MoeConfig(block_l=64, stages_up=4, split_l=4, **_E),
            MoeConfig(weight_rows=True, warps_up=8, split_l=2, **_B3)],
        4: [MoeConfig(split_l=2, **_B3), MoeConfig(**_B3)],
        8: [MoeConfig(**_B3), MoeConfig(split_l=2, **_B3)],
        16: [MoeConfig(stages_up=3), MoeConfig(**_B3)],
    },
    "mxfp4": {
        1: [MoeConfig(split_l=2, **_MXR), MoeConfig(split_l=4, **_MXR), MoeConfig(split_l=7, **_MXR),
            MoeConfig(**dict(_MX, block_i=16, warps_up=2), split_l=2), MoeConfig(split_l=2, **_MX),
            MoeConfig(**dict(_MX, block_i=16, warps_up=4, stages_up=1, block_n=32, warps_down=8, stages_down=1),
                      split_l=7, gemv=True)],
        2: [MoeConfig(split_l=2, **_MXR), MoeConfig(split_l=4, **_MXR),
            MoeConfig(**dict(_MX, block_i=16, warps_up=2), split_l=2)],
        4: [MoeConfig(split_l=2, **_MXR), MoeConfig(split_l=4, **_MXR), MoeConfig(**_MXR)],
        8: [MoeConfig(**_MXR), MoeConfig(split_l=2, **_MXR)],
        16: [MoeConfig(**_MXR), MoeConfig(**_MX)],
    },
}


def candidates(fmt: str, m: int) -> list:
    """The candidates measured at ``m``: those listed for the largest listed M <= m."""
    per = CANDIDATES[fmt]
    return per[max(k for k in per if k <= m)] if any(k <= m for k in per) else []


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--m", type=int, nargs="+", default=[1, 2, 4, 8, 16], help="tokens (decode form: <= 16)")
    p.add_argument("--formats", nargs="+", default=["bf16", "mxfp4"], choices=["bf16", "mxfp4"])
    p.add_argument("--repeats", type=int, default=3, help="interleaved timing passes; a row is their median")
    p.add_argument("--replays", type=int, default=20, help="graph replays per pass")
    p.add_argument("--prewarm", type=int, default=12, help="processes compiling the candidates first (0: none)")
    p.add_argument("--budget", type=float, default=200.0, help="seconds after which no new (format, M) starts")
    p.add_argument("--json", default=None)
    p.add_argument("--table", default=None, help="the table to merge the picks into (made from the committed "
                                                 "tables/h200.json where it does not exist)")
    p.add_argument("--smoke", action="store_true", help="every code path on the CPU at tiny widths (no GPU)")
    args = p.parse_args(argv)
    if max(args.m) > 16:
        p.error("the decode form takes M <= 16")
    args.autotune_budget = 0.0   # run_point's knob for max-autotune providers (none here)
    if args.smoke:
        args.m, args.repeats, args.replays = [1, 2], 1, 1
    return args


def table_pick(m: int, fmt: str, s: dict) -> MoeConfig:
    """The configuration the op's dispatch runs for this call (``triton.moe_experts_triton``'s choice)."""
    device = torch.device(bench.DEVICE)
    return tuned_config(table(device), m, torch.bfloat16, fmt == "mxfp4", s["i"], s["l"]) or \
        default_config(m, torch.bfloat16, fmt == "mxfp4", device.type == "cuda")


def picks(rows: list, forms: dict) -> list:
    """The table's entries (``tables/h200.json`` "configs"): per (format, M) the table's pick unless a correct
    candidate beat it by more than MARGIN."""
    out = []
    for fmt, m in sorted({(r["format"], r["m"]) for r in rows}):
        here = [r for r in rows if (r["format"], r["m"]) == (fmt, m) and r["rel_err"] < 2e-2]   # NaN fails too
        base = next((r for r in here if r["provider"] == "k3"), None)
        if base is None:
            continue
        best = min(here, key=lambda r: r["us"])
        win = best if best["us"] < base["us"] * (1 - MARGIN) else base
        s = bench.shapes(TP)
        out.append(dict(dtype="bfloat16", format="float" if fmt == "bf16" else "mxfp4", I=s["i"], L=s["l"], m=m,
                        config=dataclasses.asdict(forms[(fmt, m, win["provider"])]), us=round(win["us"], 2),
                        default_us=round(base["us"], 2)))
    return out


def write_picks(path: Path, entries: list) -> None:
    """Merge ``entries`` into the table at ``path``, a copy of the committed ``tables/h200.json`` where none is."""
    if not path.exists():
        shutil.copy(TABLES / "h200.json", path)
    bench.write_table(path, entries)


def print_rows(rows: list) -> None:
    print(f"{'fmt':>6} {'M':>3} {'experts':>7} {'floor us':>9} {'provider':>8} {'us':>8} {'%floor':>7} "
          f"{'x table':>7} {'rel err':>9}  form")
    for r in rows:
        base = next((x["us"] for x in rows if (x["format"], x["m"], x["provider"]) == (r["format"], r["m"], "k3")),
                    None)
        speed = f"{base / r['us']:.3f}" if base else "-"
        print(f"{r['format']:>6} {r['m']:>3} {r['distinct_experts']:>7.1f} {r['floor_us']:>9.2f} "
              f"{'table' if r['provider'] == 'k3' else 'new':>8} {r['us']:>8.2f} {r['pct_floor']:>6.1f}% {speed:>7} "
              f"{r['rel_err']:>9.2e}  {r['form']}")


def main(argv=None):
    args = parse_args(argv)
    ceiling = bench.ceiling_tbps()
    import triton

    info = dict(device="cpu (smoke)" if bench.SMOKE else torch.cuda.get_device_name(), torch=torch.__version__,
                triton=triton.__version__, copy_ceiling_tbs=ceiling, argv=sys.argv[1:])
    print(f"{info['device']}  torch {info['torch']}  triton {info['triton']}  copy ceiling {ceiling:.2f} TB/s",
          flush=True)
    s = bench.shapes(TP)
    t_start = time.time()
    tasks = {}   # one compile per (format, configuration) for the Ms that share kernels (gemv: one per M)
    for fmt in args.formats:
        for m in args.m:
            for c in candidates(fmt, m):
                tasks.setdefault((fmt, c, m if c.gemv else 0), (fmt, TP, dataclasses.asdict(c), []))[3].append(m)
    bench.prewarm(args, list(tasks.values()), timeout=90)
    rows, forms = [], {}
    for fmt in args.formats:
        weights = bench.make_weights(s, fmt)
        for m in args.m:
            if time.time() - t_start > args.budget:
                print(f"{fmt} M{m}: skipped (--budget {args.budget:.0f} s spent)", flush=True)
                continue
            t0 = time.time()
            pick = table_pick(m, fmt, s)
            providers = {"k3": bench.k3_op}
            forms[(fmt, m, "k3")] = pick
            for c in candidates(fmt, m)[:2 if args.smoke else None]:
                providers[f"k3:{c.tag()}"] = bench.k3_config(c)
                forms[(fmt, m, f"k3:{c.tag()}")] = c
            point = bench.run_point(args, s, fmt, weights, m, "random", providers, ceiling)
            for r in point:
                r["form"] = forms[(fmt, m, r["provider"])].tag()
            rows += point
            print_rows(point)
            print(f"   ({time.time() - t0:.1f} s; {time.time() - t_start:.0f} s so far)", flush=True)
            if args.json:   # after every point: a run cut short keeps what it measured
                Path(args.json).write_text(json.dumps(dict(info, rows=rows), indent=1))
            if args.table:   # likewise the picks so far
                write_picks(Path(args.table), picks(rows, forms))
        del weights
        if not bench.SMOKE:
            torch.cuda.empty_cache()
    chosen = picks(rows, forms)
    print("picks (format, M: table's pick -> the pick; us):")
    for e in chosen:
        base = forms[("bf16" if e["format"] == "float" else "mxfp4", e["m"], "k3")]
        new = MoeConfig(**e["config"])
        print(f"  {e['format']:>6} M{e['m']:<3} {'kept ' if new == base else 'NEW  '} {new.tag()}  "
              f"{e['default_us']} -> {e['us']}")
    if args.json:
        Path(args.json).write_text(json.dumps(dict(info, rows=rows, picks=chosen), indent=1))
    if args.table:
        write_picks(Path(args.table), chosen)
        print(f"table: {args.table}")


if __name__ == "__main__":
    main()
