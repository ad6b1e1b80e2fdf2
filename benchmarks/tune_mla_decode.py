"""Tune the Triton MLA decode's layout on this GPU and write ``k3compile/ops/mla_decode/tables/<gpu>.json``.

The table maps (cache dtype, query rows bucket, batch bucket) -- ``dispatch.table_key`` -- to the ``TritonConfig``
with the lowest geometric-mean time over a few valid lengths in a 128K allocation (K3 widths, bf16, CUDA-graph
medians over rotated caches as in ``benchmarks/mla_decode.py``). Two stages keep it short:

1. the split kernel's layout at batch 1, 8 and 64, lengths 8K and 64K: a handful of (keys per tile, warps, stages,
   programs per SM) chosen so that the programs the split count assumes fit an SM at once (``layouts``; the
   reasoning and the sm_90a figures are in docs/tuning/mla_decode.md), and the default without PDL, without and
   with more L2 prefetch (what those gain shows in the log);
2. per batch bucket, the split rule and read-back (fewest tiles a split; for batch <= 4 also the fused combine +
   read-back) under the layout stage 1 picked at the nearest of those batches, lengths 1K, 8K, 128K.

Every candidate's output is checked against the default's on the first length before it is timed (a wrong one is
logged and dropped). A pick goes into the table only where it beats ``config.default_config`` by more than
``--min-gain``. Batch buckets run 1, 8, 64 first; past ``--budget-s`` the remaining ones are skipped (they keep the
default; the log says so). The table is written after every bucket.

``--by-length`` runs a third stage alone, against the table in the tree: the split kernel's layouts for short
lengths and for the stream (``length_candidates``: 8 warps, the shapes and strides compiled in, whole tiles
unmasked, 32-key tiles, a grid capped at the splits a short length keeps active, two programs an SM) at batch 1 over 1K, 2K,
4K and 64K, and at batch 8 over 8K and 64K, each output checked against the pick's at every length. Per (batch,
length) the fastest candidate becomes a pick keyed by length (``dispatch.table_key(..., length)``: it applies to
caches allocated for at most that length) where it beats the batch's pick by more than ``--min-gain``; the batch's
own pick is replaced only by a candidate without a split cap that is no slower at any length and faster on the
geometric mean. It prints a table a batch (µs, a row a candidate, ``*``
on the fastest of each length) and writes it as JSON (``--length-json``).

    python benchmarks/tune_mla_decode.py                       # rows 16 (12 or 6 heads, T = 1), batch 1-64
    python benchmarks/tune_mla_decode.py --rows 16 64          # also T x H = 48 (12 heads, T = 4)
    python benchmarks/tune_mla_decode.py --by-length           # stage 3 alone (about 2 minutes on an H200)
    python benchmarks/tune_mla_decode.py --dry-run             # CPU, interpreter, tiny widths: the code only
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
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
BATCH_ORDER = (1, 8, 64, 2, 4, 16, 32)      # the goals' batches first: a run out of time still has them
LAYOUT_BATCHES = (1, 8, 64)
FUSED_MAX_BATCH = 4


def layouts(rows: int):
    """The split kernel's layouts worth timing, each with the programs an SM it can hold (sm_90a, K3 widths; the
    figures are docs/tuning/mla_decode.md's): the default first, then the same four or more tiles an SM in flight by
    other shapes, fewer in flight (the previous default), and the default without PDL / with other L2 prefetch."""
    from k3compile.ops.mla_decode.config import TritonConfig, default_config

    base = default_config(rows)
    yield base
    if rows <= 16:
        for block_s, warps, stages, per_sm in ((64, 4, 2, 2), (16, 4, 5, 2), (32, 4, 2, 2), (32, 4, 4, 1),
                                               (64, 4, 3, 1), (32, 8, 4, 1), (64, 8, 3, 1)):
            yield TritonConfig(block_s=block_s, num_warps=warps, num_stages=stages, programs_per_sm=per_sm)
    else:
        for block_s, stages in ((32, 3), (16, 4), (64, 2)):
            yield dataclasses.replace(base, block_s=block_s, num_stages=stages)
    yield dataclasses.replace(base, pdl=False)
    yield dataclasses.replace(base, prefetch_tiles=0)
    yield dataclasses.replace(base, prefetch_tiles=4)


def split_rules(layout, batch: int):
    """The split rule and read-back under a layout: fewest tiles a split; the fused read-back for few rows."""
    fused = (False, True) if batch <= FUSED_MAX_BATCH else (False,)
    for tiles, fuse in itertools.product((1, 2, 4, 8), fused):
        yield dataclasses.replace(layout, min_split_tiles=tiles, fused_readback=fuse)


LENGTHS_OF = {1: (K, 2 * K, 4 * K, 64 * K), 8: (8 * K, 64 * K)}    # --by-length: batch -> valid lengths
SHORT_SPLITS = 16          # a grid capped at the splits 1K keeps active with 64-key splits


def length_candidates(batch: int, base=None):
    """Stage 3's layouts at ``batch`` (1: short lengths, 8: the stream), ``base`` (the batch's pick) first, then it
    with the shapes compiled in, and with whole tiles unmasked; sm_90a registers, shared memory and instructions a
    tile of each: ``benchmarks/mla_split_occupancy.py``."""
    from k3compile.ops.mla_decode.config import TritonConfig, default_config

    base = base or default_config(16, batch)
    yield base
    yield dataclasses.replace(base, static_strides=True)
    yield dataclasses.replace(base, static_strides=True, full_tiles=True)
    c = functools.partial(TritonConfig, static_strides=True, full_tiles=True, programs_per_sm=1,
                          min_split_tiles=base.min_split_tiles, fused_readback=base.fused_readback)
    if batch <= 2:      # the serial work of a few programs: more warps on a tile, smaller tiles over more splits
        yield c(block_s=64, num_warps=8, num_stages=3, static_strides=False, full_tiles=False)
        yield c(block_s=64, num_warps=8, num_stages=3)
        yield c(block_s=32, num_warps=8, num_stages=3, min_split_tiles=2)
        yield c(block_s=32, num_warps=8, num_stages=3, min_split_tiles=1)
        yield c(block_s=32, num_warps=4, num_stages=3, min_split_tiles=2)
        yield c(block_s=32, num_warps=8, num_stages=3, min_split_tiles=2, max_splits=SHORT_SPLITS)
        yield c(block_s=64, num_warps=8, num_stages=3, min_split_tiles=1, max_splits=SHORT_SPLITS)
    else:               # bytes in flight: more tiles a program, or two programs an SM
        yield c(block_s=64, num_warps=8, num_stages=3)
        yield c(block_s=32, num_warps=8, num_stages=5)
        yield c(block_s=64, num_warps=4, num_stages=2, programs_per_sm=2)
        yield c(block_s=32, num_warps=4, num_stages=3, programs_per_sm=2)
        yield c(block_s=16, num_warps=4, num_stages=6, programs_per_sm=2)
        yield c(block_s=16, num_warps=8, num_stages=6, programs_per_sm=2)
        yield c(block_s=32, num_warps=8, num_stages=3, programs_per_sm=2)     # 128 registers without a cap
        yield c(block_s=64, num_warps=8, num_stages=2, programs_per_sm=2, maxnreg=128)


def tag(c) -> str:
    """A layout in a few characters: keys/warps/stages, programs an SM, fewest tiles a split, fused read-back,
    L2 prefetch tiles (where not 2), PDL off, shapes compiled in, whole tiles unmasked, register cap, split cap:
    "32/4/3p2 t4 fused", "32/4/3p2 t4 pf0", "32/4/3p2 t4 nopdl", "32/8/3p2 t1 st full r128", "32/8/3p1 t2 st s16"."""
    return (f"{c.block_s}/{c.num_warps}/{c.num_stages}p{c.programs_per_sm} t{c.min_split_tiles}"
            f"{' fused' if c.fused_readback else ''}{'' if c.prefetch_tiles == 2 else f' pf{c.prefetch_tiles}'}"
            f"{'' if c.pdl else ' nopdl'}{' st' if c.static_strides else ''}{' full' if c.full_tiles else ''}"
            f"{f' r{c.maxnreg}' if c.maxnreg else ''}"
            f"{f' s{c.max_splits}' if c.max_splits else ''}")


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
    ap.add_argument("--budget-s", type=float, default=110, help="skip the batch buckets left after this many seconds")
    ap.add_argument("--out", default="", help="also write the table here (default: only under tables/)")
    ap.add_argument("--log", default="", help="every candidate's times as JSON")
    ap.add_argument("--by-length", action="store_true", help="stage 3 alone: layouts by length, at batch 1 and 8")
    ap.add_argument("--length-json", default="", help="--by-length: its µs tables as JSON")
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
    batches = (1, 2) if args.dry_run else BATCH_ORDER
    layout_batches = (1, 2) if args.dry_run else LAYOUT_BATCHES
    most = 1 if args.dry_run else bench.MAX_ROTATION
    log = []

    def score(pool, config, lengths, expect=None) -> float:
        """Geometric mean of µs over ``lengths``; inf where the layout does not build or run, or (``expect``: the
        default's output at the first length) its output differs."""
        total = 0.0
        for i, L in enumerate(lengths):
            pool.set_length(L)
            where = dict(B=pool.B, H=pool.H, L=L, config=config.to_json())
            try:
                if i == 0 and expect is not None:
                    err = bench.rel(bench.k3_call(pool.args(0), config)(), expect)
                    if not err < 1e-2:
                        log.append(dict(where, error=f"output off the default's by {err:.2e}"))
                        return math.inf
                view = bench._Prefix(pool, bench.rotation_for(pool.B, L, alloc, w, most))
                us = bench.time_rotation(view, lambda a: bench.k3_call(a, config), args.replays, args.dry_run)
            except Exception as e:   # shared memory over the limit, a failed build: not a candidate
                log.append(dict(where, error=f"{type(e).__name__}: {e}"))
                return math.inf
            log.append(dict(where, us=us))
            total += math.log(us)
        return math.exp(total / len(lengths))

    def best(pool, candidates, lengths, label):
        """(µs, config) of the default (first) and of the fastest candidate that matches the default's output."""
        pool.set_length(lengths[0])
        expect = bench.k3_call(pool.args(0), candidates[0])().clone()
        scored = [(score(pool, c, lengths, None if i == 0 else expect), c) for i, c in enumerate(candidates)]
        print(f"  {label}: " + ", ".join(f"{tag(c)} {us:.2f}" for us, c in scored), flush=True)
        return scored[0], min(scored, key=lambda x: x[0])

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

    def pool_for(B, H, T, lengths):
        pool = bench.Pool(B, H, alloc, alloc, bench.rotation_for(B, lengths[0], alloc, w, most), w, device)
        _with_tokens(pool, T, w, device)
        return pool

    if args.by_length:
        return by_length(args, bench, pool_for, w, alloc, most, log)
    t0 = time.time()
    for rows in args.rows:
        H, T = max(1, w.heads // 8), 1 if rows <= 16 else 4          # TP 8's heads; 4 tokens for 48 rows
        best_layout = {}
        for B in layout_batches:
            pool = pool_for(B, H, T, layout_lengths)
            _, (us, best_layout[B]) = best(pool, list(layouts(rows)), layout_lengths,
                                           f"rows {rows} B {B} layouts, µs geomean of {layout_lengths}")
            print(f"rows {rows} B {B}: layout {tag(best_layout[B])} ({us:.2f} µs geomean; {time.time() - t0:.0f} s)",
                  flush=True)
            del pool
            _free(args.dry_run)
        for B in batches:
            key = table_key(torch.bfloat16, rows, B)
            if time.time() - t0 > args.budget_s:
                notes[key] = dict(skipped=f"over the {args.budget_s:.0f} s budget: the default applies")
                print(f"{key}: skipped (over the {args.budget_s:.0f} s budget)", flush=True)
                continue
            near = min(layout_batches, key=lambda b: abs(math.log(b) - math.log(B)))
            pool = pool_for(B, H, T, split_lengths)
            base_config = default_config(rows, B)
            candidates = [base_config] + [c for c in split_rules(best_layout[near], B) if c != base_config]
            (base, _), (us, pick) = best(pool, candidates, split_lengths, f"{key}, µs geomean of {split_lengths}")
            gain = base / us - 1
            if gain > args.min_gain:
                picks[key] = pick.to_json()
            notes[key] = dict(default_us=base, pick_us=us, pick=pick.to_json(), kept=gain > args.min_gain)
            print(f"{key}: default {base:.2f} µs, best {us:.2f} µs ({100 * gain:+.1f}%) {tag(pick)}"
                  f"{'' if gain > args.min_gain else ' -> default kept'} ({time.time() - t0:.0f} s)", flush=True)
            del pool
            _free(args.dry_run)
            write()
    write()
    print(f"wrote {'' if args.dry_run else TABLES / (gpu_name() + '.json')} {args.out} in {time.time() - t0:.0f} s")
    return 0


def by_length(args, bench, pool_for, w, alloc: int, most: int, log: list) -> int:
    """Stage 3 (module docstring): each candidate's µs at each (batch, length), checked against the batch's pick at
    every length; picks keyed by length, and the batch's pick where one candidate wins at every length."""
    from k3compile.ops.mla_decode.config import TritonConfig, default_config
    from k3compile.ops.mla_decode.dispatch import table_key

    path = TABLES / f"{gpu_name()}.json" if not args.dry_run else None
    table = json.loads(path.read_text()) if path is not None and path.exists() else dict(picks={}, measured={})
    picks = {k: TritonConfig(**v) for k, v in table["picks"].items()}
    lengths_of = {1: (1, 40, 96), 8: (40, 96)} if args.dry_run else LENGTHS_OF
    report, t0 = {}, time.time()
    if args.dry_run:
        bw = 1e12
    else:   # the floor's 100% line, measured in this run
        from _common import copy_ceiling_tbps

        bw = copy_ceiling_tbps() * 1e12
    print(f"copy ceiling {bw / 1e12:.2f} TB/s", flush=True)
    for B, lengths in lengths_of.items():
        key = table_key(torch.bfloat16, 16, B)
        base = picks.get(key, default_config(16, B))
        candidates = list(dict.fromkeys(length_candidates(B, base)))
        pool = pool_for(B, max(1, w.heads // 8), 1, lengths)
        expect = {}
        for L in lengths:
            pool.set_length(L)
            expect[L] = bench.k3_call(pool.args(0), base)().clone()
        us = {}
        for c in candidates:
            for L in lengths:
                pool.set_length(L)
                where = dict(B=B, L=L, config=c.to_json())
                try:
                    err = bench.rel(bench.k3_call(pool.args(0), c)(), expect[L])
                    if not err < 1e-2:   # NaN (an unwritten element, a read past the prefix) fails too
                        raise ValueError(f"output off the pick's by {err:.2e}")
                    view = bench._Prefix(pool, bench.rotation_for(B, L, alloc, w, most))
                    us[c, L] = bench.time_rotation(view, lambda a: bench.k3_call(a, c), args.replays, args.dry_run)
                    log.append(dict(where, us=us[c, L]))
                except Exception as e:   # over the shared memory, a failed build, a wrong output: not a candidate
                    us[c, L] = math.inf
                    log.append(dict(where, error=f"{type(e).__name__}: {str(e)[:300]}"))
                    print(f"  B {B} L {L} {tag(c)}: {type(e).__name__}: {str(e)[:200]}", flush=True)
        del pool
        _free(args.dry_run)
        floors = {L: bench.latent_bytes(B, L, w) / bw * 1e6 for L in lengths}
        report[B] = _length_picks(args, B, lengths, candidates, us, picks, key, floors)
        print(f"  ({time.time() - t0:.0f} s)", flush=True)
        # after every batch: a run stopped by its time limit keeps what it measured
        table.update(picks={k: c.to_json() for k, c in picks.items()}, by_length=report,
                     by_length_command=" ".join(["python", "benchmarks/tune_mla_decode.py"] + sys.argv[1:]),
                     by_length_time=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
        text = json.dumps(table, indent=1)
        for out in ([path] if path is not None else []) + ([Path(args.out)] if args.out else []):
            out.write_text(text)
        if args.length_json:
            Path(args.length_json).write_text(json.dumps(report, indent=1))
        if args.log:
            Path(args.log).write_text(json.dumps(log, indent=0))
    print(f"wrote {path or ''} {args.out} in {time.time() - t0:.0f} s")
    return 0


def _length_picks(args, B: int, lengths, candidates, us: dict, picks: dict, key: str, floors=None) -> dict:
    """Print batch ``B``'s table and update ``picks``: by length where the fastest beats the batch's pick (the first
    candidate) by ``--min-gain``; the batch's pick where a candidate without a split cap is no slower at any length
    (1%) and faster on the geometric mean by ``--min-gain``. Returns the table as JSON."""
    from k3compile.ops.mla_decode.dispatch import table_key

    base = candidates[0]
    fastest = {L: min(candidates, key=lambda c: us[c, L]) for L in lengths}
    print(f"\nB {B}, µs (* fastest at the length; first row: the table's pick for batch {B})")
    print(f"{'layout':<30}" + "".join(f"{L:>10}" for L in lengths) + f"{'geomean':>10}")
    gm = {c: math.exp(sum(math.log(us[c, L]) for L in lengths) / len(lengths)) for c in candidates}
    for c in candidates:
        print(f"{tag(c):<30}" + "".join(f"{us[c, L]:>9.2f}{'*' if fastest[L] == c else ' '}" for L in lengths)
              + f"{gm[c]:>10.2f}")
    print(f"{'pick / fastest':<30}" + "".join(f"{us[base, L] / us[fastest[L], L]:>10.2f}" for L in lengths))
    if floors:   # the valid prefix's bytes at the copy ceiling
        print(f"{'floor µs':<30}" + "".join(f"{floors[L]:>10.2f}" for L in lengths))
        print(f"{'fastest % floor':<30}" + "".join(f"{100 * floors[L] / us[fastest[L], L]:>9.1f}%" for L in lengths))
    for L in lengths:
        best = fastest[L]
        gain = us[base, L] / us[best, L] - 1
        if gain > args.min_gain:
            picks[table_key(torch.bfloat16, 16, B, L)] = best
        print(f"{table_key(torch.bfloat16, 16, B, L)}: {tag(best)} {us[best, L]:.2f} µs ({100 * gain:+.1f}% on the "
              f"pick){'' if gain > args.min_gain else ' -> no length pick'}")
    whole = [c for c in candidates[1:] if not c.max_splits and all(us[c, L] <= 1.01 * us[base, L] for L in lengths)
             and gm[base] / gm[c] - 1 > args.min_gain]
    if whole:
        picks[key] = min(whole, key=gm.get)
        print(f"{key}: {tag(base)} -> {tag(picks[key])} ({100 * (gm[base] / gm[picks[key]] - 1):+.1f}% geomean, "
              "no slower at any length)")
    else:
        print(f"{key}: {tag(base)} kept (no candidate faster on the geomean and no slower at every length)")
    return dict(lengths=list(lengths), pick=tag(picks.get(key, base)),
                floor_us=[(floors or {}).get(L) for L in lengths],
                rows=[dict(layout=tag(c), config=c.to_json(), us=[us[c, L] for L in lengths]) for c in candidates])


def _free(dry_run: bool) -> None:
    if not dry_run:
        torch.cuda.empty_cache()


def _with_tokens(pool, T: int, w, device) -> None:
    """Queries of T tokens (the pool makes one): for the rows-64 bucket (T = 4 at 12 heads)."""
    if T == 1:
        return
    q = torch.randn(pool.rotation, pool.B, T, pool.H, w.N + w.R, device=device).to(torch.bfloat16)
    pool.q_nope, pool.q_pe = q[..., :w.N], q[..., w.N:]
    pool.set_length = lambda L, pos=pool.pos: pos.fill_(L - T)


if __name__ == "__main__":
    raise SystemExit(main())
