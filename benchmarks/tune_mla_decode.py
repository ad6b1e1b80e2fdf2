"""Tune the Triton MLA decode's layout on this GPU and write ``k3compile/ops/mla_decode/tables/<gpu>.json``.

The table maps (cache dtype, query rows bucket, batch bucket) -- ``dispatch.table_key`` -- to the ``TritonConfig``
with the lowest geometric-mean time over a few valid lengths in a 128K allocation (K3 widths, bf16, CUDA-graph
medians over rotated caches as in ``benchmarks/mla_decode.py``). Two stages keep it short:

1. the tile layout (keys per tile, warps, pipeline stages; and the default without PDL) at batch 1, 8 and 64,
   lengths 8K and 64K, with the default split rule;
2. per batch bucket, the split rule (programs per SM, fewest tiles a split) under the layout stage 1 picked at the
   nearest of those batches, lengths 1K, 8K, 128K.

A pick goes into the table only where it beats ``config.default_config`` by more than ``--min-gain``; every
candidate's time goes to the log (``--log``).

    python benchmarks/tune_mla_decode.py                       # rows 16 (12 or 6 heads, T = 1), batch 1-64
    python benchmarks/tune_mla_decode.py --rows 16 64          # also T x H = 48 (12 heads, T = 4)
    python benchmarks/tune_mla_decode.py --dry-run             # CPU, interpreter, tiny widths: the code only
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import os
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
TABLES = HERE.parent / "k3compile" / "ops" / "mla_decode" / "tables"
K = 1024
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
LAYOUT_BATCHES = (1, 8, 64)


def layouts(rows: int):
    """Tile layouts, and the default without PDL (what PDL gains shows in the log)."""
    from k3compile.ops.mla_decode.config import TritonConfig, default_config

    warps = (4, 8) if rows <= 16 else (8,)
    for block_s, nw, stages in itertools.product((16, 32, 64), warps, (2, 3, 4)):
        yield TritonConfig(block_s=block_s, num_warps=nw, num_stages=stages)
    yield dataclasses.replace(default_config(rows), pdl=False)


def splits(layout):
    for per_sm, tiles in itertools.product((1, 2, 4), (1, 2, 4, 8)):
        yield dataclasses.replace(layout, programs_per_sm=per_sm, min_split_tiles=tiles)


def gpu_name() -> str:
    """The table's file name: the model token of the device name ("NVIDIA H200" -> "h200")."""
    name = torch.cuda.get_device_name().lower().replace("nvidia", "").strip()
    return name.split()[0] if name else "gpu"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[16], help="T x H buckets: 16 (T 1), 64 (T 4 at 12 heads)")
    ap.add_argument("--alloc", type=int, default=128 * K)
    ap.add_argument("--replays", type=int, default=10)
    ap.add_argument("--min-gain", type=float, default=0.02, help="keep the default unless this much faster")
    ap.add_argument("--out", default="", help="also write the table here (default: only under tables/)")
    ap.add_argument("--log", default="", help="every candidate's times as JSON")
    ap.add_argument("--dry-run", action="store_true")
    args = ap.parse_args(argv)
    if args.dry_run:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    elif not torch.cuda.is_available():
        print("needs a CUDA GPU (or --dry-run)", file=sys.stderr)
        return 2
    sys.path.insert(0, str(HERE))
    sys.path.insert(1, str(HERE.parent))
    import mla_decode as bench
    from k3compile.ops.mla_decode.config import default_config
    from k3compile.ops.mla_decode.dispatch import table_key

    w = bench.TINY if args.dry_run else bench.K3
    device = "cpu" if args.dry_run else "cuda"
    alloc = 96 if args.dry_run else args.alloc
    layout_lengths = [40, 96] if args.dry_run else [8 * K, 64 * K]
    split_lengths = [1, 40, 96] if args.dry_run else [K, 8 * K, 128 * K]
    batches = (1, 2) if args.dry_run else BATCH_BUCKETS
    layout_batches = (1, 2) if args.dry_run else LAYOUT_BATCHES
    most = 1 if args.dry_run else bench.MAX_ROTATION
    log = []

    def score(pool, config, lengths) -> float:
        """Geometric mean of µs over ``lengths``; inf where the layout does not build or run."""
        total = 0.0
        for L in lengths:
            pool.set_length(L)
            view = bench._Prefix(pool, bench.rotation_for(pool.B, L, alloc, w, most))
            try:
                us = bench.time_rotation(view, lambda a: bench.k3_call(a, config), args.replays, args.dry_run)
            except Exception as e:   # shared memory over the limit, a failed build: not a candidate
                log.append(dict(B=pool.B, H=pool.H, L=L, config=config.to_json(), error=f"{type(e).__name__}: {e}"))
                return math.inf
            log.append(dict(B=pool.B, H=pool.H, L=L, config=config.to_json(), us=us))
            total += math.log(us)
        return math.exp(total / len(lengths))

    picks, notes = {}, {}
    device_name = "cpu (dry run)" if args.dry_run else torch.cuda.get_device_name()

    def write() -> None:
        """After every batch bucket: a run stopped by its time limit keeps the picks it made."""
        table = dict(device=device_name, command=" ".join(["python", "benchmarks/tune_mla_decode.py"] + sys.argv[1:]),
                     time=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                     note="geometric-mean µs over the split lengths; picks kept only where faster than the default",
                     picks=picks, measured=notes)
        text = json.dumps(table, indent=1)
        if not args.dry_run:
            TABLES.mkdir(parents=True, exist_ok=True)
            (TABLES / f"{gpu_name()}.json").write_text(text)
        if args.out:
            Path(args.out).write_text(text)
        if args.log:
            Path(args.log).write_text(json.dumps(log, indent=0))

    t0 = time.time()
    for rows in args.rows:
        H, T = max(1, w.heads // 8), 1 if rows <= 16 else 4          # TP 8's heads; 4 tokens for 48 rows
        best_layout = {}
        for B in layout_batches:
            pool = bench.Pool(B, H, alloc, alloc, bench.rotation_for(B, layout_lengths[0], alloc, w, most), w, device)
            _with_tokens(pool, T, w, device)
            scored = [(score(pool, c, layout_lengths), c) for c in layouts(rows)]
            best_layout[B] = min(scored, key=lambda x: x[0])[1]
            print(f"rows {rows} B {B}: layout {best_layout[B].to_json()} ({min(scored, key=lambda x: x[0])[0]:.2f} µs "
                  f"geomean; {time.time() - t0:.0f} s)", flush=True)
            del pool
        for B in batches:
            near = min(layout_batches, key=lambda b: abs(math.log(b) - math.log(B)))
            pool = bench.Pool(B, H, alloc, alloc, bench.rotation_for(B, split_lengths[0], alloc, w, most), w, device)
            _with_tokens(pool, T, w, device)
            base = score(pool, default_config(rows), split_lengths)
            us, pick = min(((score(pool, c, split_lengths), c) for c in splits(best_layout[near])), key=lambda x: x[0])
            key = table_key(torch.bfloat16, rows, B)
            gain = base / us - 1
            if gain > args.min_gain:
                picks[key] = pick.to_json()
            notes[key] = dict(default_us=base, pick_us=us, pick=pick.to_json(), kept=gain > args.min_gain)
            print(f"{key}: default {base:.2f} µs, best {us:.2f} µs ({100 * gain:+.1f}%) {pick.to_json()}"
                  f"{'' if gain > args.min_gain else ' -> default kept'} ({time.time() - t0:.0f} s)", flush=True)
            del pool
            if not args.dry_run:
                torch.cuda.empty_cache()
            write()
    print(f"wrote {'' if args.dry_run else TABLES / (gpu_name() + '.json')} {args.out}")
    return 0


def _with_tokens(pool, T: int, w, device) -> None:
    """Queries of T tokens (the pool makes one): for the rows-64 bucket (T = 4 at 12 heads)."""
    if T == 1:
        return
    q = torch.randn(pool.rotation, pool.B, T, pool.H, w.N + w.R, device=device).to(torch.bfloat16)
    pool.q_nope, pool.q_pe = q[..., :w.N], q[..., w.N:]
    pool.set_length = lambda L, pos=pool.pos: pos.fill_(L - T)


if __name__ == "__main__":
    raise SystemExit(main())
