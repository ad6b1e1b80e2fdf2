"""MLA decode on the GPU: k3::mla_decode against torch.compile of the plain attention and the valid-prefix floor.

Per (TP, batch B, valid length L, allocation S), K3's MLA at one decode step (T = 1, bf16; N 128, R 64, Vd 128,
Lk 512; 96 heads: 12 a rank at TP 8, 6 at TP 16):
- ``k3``:      ``k3::mla_decode`` through its public function, ``backend="triton"`` (the layout ``dispatch.py`` picks).
- ``compile``: the model's plain ``mla_attend`` (``model/mla.py``) under ``torch.compile(dynamic=False)``: every
               position of the allocation is read, twice.
- ``floor``:   the valid prefix's latent bytes, B·L·(Lk + R)·2 (c_kv and k_pe rows 0 .. L-1 of each sequence), at the
               copy ceiling measured in the same run (``_common.copy_ceiling_tbps``).
Times are CUDA-graph replay medians (``_common.graph_replay_us``). The k3 graph walks ``rotation`` copies of the
cache (and of w_kv_b), one call each, until the valid bytes a replay reads pass 256 MB (the H200's L2 is 60 MB),
within a memory budget; rows whose rotation stays under 2x the L2 are marked ``l2``. The weight (3 MB at TP 8) is
outside the floor. Before timing, k3's output is checked against ``reference.py`` on each point's first rotation
slot, with every cache row past the valid length set to NaN, and at one point per shape against the compiled
plain code.

    python benchmarks/mla_decode.py                     # TP 8, 16; B 1-64; L 1K-128K in 128K; B 1, 8 in 1M
    python benchmarks/mla_decode.py --quick             # TP 8; B 1 8 64; L 1K 4K 8K 32K 128K; 1M at B 1
    python benchmarks/mla_decode.py --dry-run           # CPU, TRITON_INTERPRET=1, tiny widths: the code paths only

Writes JSON (``--out``, default benchmarks/results/mla_decode_h200.json) and, where matplotlib imports, a PNG beside
it; prints a table and the issue's goals (#25) against what was measured.
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import os
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
K = 1024
L2_BYTES = 60 * 2**20                 # H200
ROTATE_BYTES = 256 * 2**20            # valid bytes a replay should read at least
MEM_BUDGET = 48 * 2**30               # caches allocated for the rotation of one (TP, B, allocation)
MAX_ROTATION = 128


@dataclass(frozen=True)
class Widths:
    N: int = 128
    R: int = 64
    Vd: int = 128
    Lk: int = 512
    heads: int = 96

    @property
    def scale(self) -> float:
        return (self.N + self.R) ** -0.5


K3 = Widths()
TINY = Widths(N=16, R=16, Vd=16, Lk=32, heads=4)


def latent_bytes(B: int, L: int, w: Widths) -> int:
    """What a step must read: c_kv and k_pe rows 0 .. L-1 of each sequence, bf16."""
    return B * L * (w.Lk + w.R) * 2


class Pool:
    """``rotation`` independent caches of B sequences (one allocation each) and as many w_kv_b and queries; the
    rows 0 .. fill-1 random, the rest NaN (never read by k3; the plain code reads them, which costs it no time)."""

    def __init__(self, B: int, H: int, alloc: int, fill: int, rotation: int, w: Widths, device, seed=0):
        g = torch.Generator(device=device).manual_seed(seed)
        self.B, self.H, self.alloc, self.rotation, self.w = B, H, alloc, rotation, w
        bf16 = dict(dtype=torch.bfloat16, device=device)
        self.c_kv = torch.full((rotation * B, alloc, w.Lk), float("nan"), **bf16)
        self.k_pe = torch.full((rotation * B, alloc, w.R), float("nan"), **bf16)
        self.c_kv[:, :fill].normal_(generator=g)
        self.k_pe[:, :fill].normal_(generator=g)
        q = torch.randn(rotation, B, 1, H, w.N + w.R, generator=g, **bf16)
        self.q_nope, self.q_pe = q[..., :w.N], q[..., w.N:]
        self.w_kv_b = torch.randn(rotation, H, w.N + w.Vd, w.Lk, generator=g, **bf16) * w.N ** -0.5
        self.pos = torch.zeros((), dtype=torch.int64, device=device)

    def args(self, i: int) -> tuple:
        sl = slice(i * self.B, (i + 1) * self.B)
        return (self.q_nope[i], self.q_pe[i], self.c_kv[sl], self.k_pe[sl], self.w_kv_b[i], self.pos, self.w.scale)

    def set_length(self, L: int) -> None:
        self.pos.fill_(L - 1)            # T = 1: the new token at L - 1, keys 0 .. L-1


def rotation_for(B: int, L: int, alloc: int, w: Widths, most: int = MAX_ROTATION) -> int:
    """Copies to walk: enough that a replay reads ROTATE_BYTES of valid rows, within MEM_BUDGET and ``most``."""
    per_copy = B * alloc * (w.Lk + w.R) * 2
    want = math.ceil(ROTATE_BYTES / latent_bytes(B, L, w))
    return max(1, min(want, most, MEM_BUDGET // per_copy))


# -- providers --------------------------------------------------------------------------------------------------
def k3_call(args: tuple, config=None):
    """k3::mla_decode on one rotation slot: the public op, or (``config``) the Triton launch with that layout."""
    if config is None:
        from k3compile.ops.mla_decode import mla_decode

        return lambda: mla_decode(*args, backend="triton")
    from k3compile.ops.mla_decode.triton import mla_decode_triton

    return lambda: mla_decode_triton(*args, config=config)


def k3_config(pool) -> dict:
    """The Triton layout ``dispatch.py`` picks for the pool's shapes (the table's entry or the default)."""
    from k3compile.ops.mla_decode.dispatch import triton_config

    q_nope, c_kv = pool.args(0)[0], pool.args(0)[2]
    return triton_config(c_kv, q_nope.shape[1] * q_nope.shape[2], q_nope.shape[0]).to_json()


def _layout_tag(c: dict) -> str:
    """keys/warps/stages, programs an SM, fewest tiles a split, read-back form, shapes compiled in, whole tiles
    unmasked, register cap, split cap: "32/4/3 p2 t4 fused", "64/8/3 p1 t2 st full"."""
    return (f"{c['block_s']}/{c['num_warps']}/{c['num_stages']} p{c['programs_per_sm']} t{c['min_split_tiles']}"
            f"{' fused' if c['fused_readback'] else ''}{' st' if c.get('static_strides') else ''}"
            f"{' full' if c.get('full_tiles') else ''}{' r%d' % c['maxnreg'] if c.get('maxnreg') else ''}"
            f"{' s%d' % c['max_splits'] if c.get('max_splits') else ''}")


_COMPILED = []


def compiled_plain():
    if not _COMPILED:   # one compiled function; a graph per (B, H, allocation)
        from k3compile.model.mla import mla_attend

        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
        _COMPILED.append(torch.compile(mla_attend, fullgraph=True, dynamic=False))
    return _COMPILED[0]


# -- timing -----------------------------------------------------------------------------------------------------
def time_rotation(pool: Pool, make_call, replays: int, dry_run: bool) -> float:
    """µs per call: one call per rotation slot captured in one CUDA graph, replayed."""
    calls = [make_call(pool.args(i)) for i in range(pool.rotation)]
    if dry_run:
        t0 = time.perf_counter()
        for c in calls:
            c()
        return (time.perf_counter() - t0) * 1e6 / len(calls)
    from _common import graph_replay_us

    cycle = itertools.cycle(calls)
    return graph_replay_us(lambda: next(cycle)(), iters=len(calls), replays=replays, warmup=len(calls))


def time_once(fn, replays: int, dry_run: bool) -> float:
    if dry_run:
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e6
    from _common import graph_replay_us

    return graph_replay_us(fn, iters=1, replays=replays, warmup=2)


def rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    if not torch.isfinite(out).all():
        return float("nan")
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def check_k3(pool: Pool, L: int) -> float:
    """k3 on slot 0 against the reference on the rows it may read (row by row: the fp32 copies stay small)."""
    from k3compile.ops.mla_decode.reference import mla_decode_ref

    q_nope, q_pe, c_kv, k_pe, w_kv_b, pos, scale = pool.args(0)
    out = k3_call(pool.args(0))()
    ref = torch.cat([mla_decode_ref(q_nope[b:b + 1], q_pe[b:b + 1], c_kv[b:b + 1, :L], k_pe[b:b + 1, :L], w_kv_b,
                                    pos, scale) for b in range(pool.B)])
    return rel(out, ref)


# -- the sweep --------------------------------------------------------------------------------------------------
def shapes(args) -> list[tuple[int, int, list[int]]]:
    """(TP, allocation, batches) groups, each swept over its lengths."""
    groups = [(tp, args.alloc, args.batch) for tp in args.tp]
    if args.big_alloc:
        groups.append((args.tp[0], args.big_alloc, args.big_batch))
    return groups


def lengths_for(alloc: int, args) -> list[int]:
    ls = args.lengths if alloc == args.alloc else args.big_lengths
    return [L for L in ls if L <= alloc]


def run(args) -> dict:
    w = TINY if args.dry_run else K3
    device = "cpu" if args.dry_run else "cuda"
    if args.dry_run:
        bw = 1e12
    else:
        from _common import copy_ceiling_tbps

        bw = copy_ceiling_tbps() * 1e12
    print(f"copy ceiling: {bw / 1e12:.2f} TB/s (2 GiB copy_, read + write)", flush=True)
    meta = dict(device=torch.cuda.get_device_name() if not args.dry_run else "cpu (dry run)", torch=torch.__version__,
                python=platform.python_version(), copy_bytes_per_s=bw, widths=dataclasses.asdict(w), argv=sys.argv[1:],
                time=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), rotate_bytes=ROTATE_BYTES, l2_bytes=L2_BYTES)
    try:
        import triton
        meta["triton"] = triton.__version__
    except ImportError:
        pass
    rows = []

    def save():   # after every group: a run stopped by its time limit keeps what it measured
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(dict(meta=meta, rows=rows, summary=summarise(rows)), indent=1))

    print(f"\n{'TP':>3} {'H':>3} {'B':>3} {'alloc':>7} {'L':>7} | {'k3 µs':>9} {'floor µs':>9} {'% floor':>8} | "
          f"{'compile µs':>10} {'x compile':>9} | {'rot':>4} {'check':>8} | layout", flush=True)
    for tp, alloc, batches in shapes(args):
        H = w.heads // tp
        for B in batches:
            lengths = lengths_for(alloc, args)
            if not lengths:
                continue
            rotation = rotation_for(B, lengths[0], alloc, w, args.max_rotation)
            try:
                pool = Pool(B, H, alloc, max(lengths), rotation, w, device)
            except torch.OutOfMemoryError as e:
                print(f"  TP{tp} B{B} alloc {alloc}: out of memory for the rotation ({e})", flush=True)
                continue
            compared = False      # k3 against the compiled plain code: once per (TP, B, allocation)
            for L in lengths:
                pool.set_length(L)
                err = check_k3(pool, L)
                n = rotation_for(B, L, alloc, w, args.max_rotation)
                view = _Prefix(pool, n)
                k3_us = time_rotation(view, lambda a: k3_call(a), args.replays, args.dry_run)
                floor_us = latent_bytes(B, L, w) / bw * 1e6
                row = dict(tp=tp, H=H, B=B, alloc=alloc, L=L, k3_us=k3_us, floor_us=floor_us,
                           frac_floor=floor_us / k3_us, rotation=n, rotated_bytes=n * latent_bytes(B, L, w),
                           l2=n * latent_bytes(B, L, w) < 2 * L2_BYTES, rel_err=err, config=k3_config(pool))
                if args.compile and L in args.compile_lengths and B in args.compile_batch:
                    fn = compiled_plain() if not args.dry_run else _plain()
                    a = pool.args(0)
                    try:
                        row["compile_us"] = time_once(lambda: fn(*a), args.replays, args.dry_run)
                        row["x_compile"] = row["compile_us"] / k3_us
                        if not compared:
                            row["rel_err_vs_compile"] = rel(k3_call(a)(), _clean(fn, a).float())
                            compared = True
                    except torch.OutOfMemoryError as e:
                        row["compile_error"] = f"out of memory ({e})"
                rows.append(row)
                comp = (f"{row['compile_us']:>10.1f} {row['x_compile']:>9.1f}" if "compile_us" in row
                        else f"{'':>10} {'':>9}")
                flag = " WRONG" if not err < 3e-2 else ""
                print(f"{tp:>3} {H:>3} {B:>3} {alloc:>7} {L:>7} | {k3_us:>9.2f} {floor_us:>9.2f} "
                      f"{100 * floor_us / k3_us:>7.1f}% | {comp} | {n:>3}{'*' if row['l2'] else ' '} "
                      f"{err:>8.1e}{flag} | {_layout_tag(row['config'])}", flush=True)
            del pool
            if not args.dry_run:
                torch.cuda.empty_cache()
            save()
    save()
    return dict(meta=meta, rows=rows, summary=summarise(rows))


class _Prefix:
    """The first ``n`` rotation slots of a pool (shorter lengths need more slots: the pool holds the most)."""

    def __init__(self, pool: Pool, n: int):
        self.pool, self.rotation = pool, min(n, pool.rotation)

    def args(self, i):
        return self.pool.args(i)


def _plain():
    from k3compile.model.mla import mla_attend
    return mla_attend


def _clean(fn, a: tuple) -> torch.Tensor:
    """The plain code's output on the same inputs with the NaN rows zeroed (it reads them all: 0·NaN = NaN)."""
    q_nope, q_pe, c_kv, k_pe, w_kv_b, pos, scale = a
    return fn(q_nope, q_pe, torch.nan_to_num(c_kv, nan=0.0), torch.nan_to_num(k_pe, nan=0.0), w_kv_b, pos, scale)


def summarise(rows: list) -> dict:
    """The issue's goals (#25) against the rows: % of the floor at L >= 8K and B >= 8; x compile at 4K in 128K;
    µs at B 1, 1K."""
    big = [r for r in rows if r["L"] >= 8 * K and r["B"] >= 8]
    at4k = [r for r in rows if r["L"] == 4 * K and r["alloc"] == 128 * K and "x_compile" in r]
    b1 = [r for r in rows if r["L"] == K and r["B"] == 1]
    out = {}
    if big:
        worst = min(big, key=lambda r: r["frac_floor"])
        out["floor_L8K_B8_min"] = dict(frac=worst["frac_floor"], at=_where(worst), goal=0.85)
        out["floor_L8K_B8_median"] = sorted(r["frac_floor"] for r in big)[len(big) // 2]
    if at4k:
        worst = min(at4k, key=lambda r: r["x_compile"])
        out["x_compile_4K_in_128K_min"] = dict(x=worst["x_compile"], at=_where(worst), goal=20)
    if b1:
        worst = max(b1, key=lambda r: r["k3_us"])
        out["B1_1K_us_max"] = dict(us=worst["k3_us"], at=_where(worst), goal=10)
    out["wrong"] = [_where(r) for r in rows if not r["rel_err"] < 3e-2]
    return out


def _where(r: dict) -> str:
    return f"TP{r['tp']} B{r['B']} L{r['L']} alloc {r['alloc']}"


def report_goals(summary: dict) -> None:
    print("\ngoals (#25, one H200):")
    if "floor_L8K_B8_min" in summary:
        s = summary["floor_L8K_B8_min"]
        print(f"  >= 85% of the valid-prefix floor at L >= 8K, B >= 8: worst {100 * s['frac']:.1f}% ({s['at']}), "
              f"median {100 * summary['floor_L8K_B8_median']:.1f}% -> {'met' if s['frac'] >= 0.85 else 'NOT met'}")
    if "x_compile_4K_in_128K_min" in summary:
        s = summary["x_compile_4K_in_128K_min"]
        print(f"  >= 20x torch.compile at 4K in 128K: worst x{s['x']:.1f} ({s['at']}) -> "
              f"{'met' if s['x'] >= 20 else 'NOT met'}")
    if "B1_1K_us_max" in summary:
        s = summary["B1_1K_us_max"]
        print(f"  B 1, 1K within 10 µs: {s['us']:.2f} µs ({s['at']}) -> {'met' if s['us'] <= 10 else 'NOT met'}")
    print(f"  outputs off the reference: {summary['wrong'] or 'none'}")


def plot(result: dict, png: str) -> None:
    """Per TP at the 128K allocation: µs against L for each B (k3 solid, floor dashed, compile dots)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        print(f"# no plot ({e}): the JSON holds every figure")
        return
    rows = result["rows"]
    tps = sorted({r["tp"] for r in rows})
    fig, axes = plt.subplots(1, len(tps), figsize=(7 * len(tps), 5), squeeze=False)
    for ax, tp in zip(axes[0], tps):
        allocs = sorted({r["alloc"] for r in rows if r["tp"] == tp})
        for alloc in allocs:
            sub = [r for r in rows if r["tp"] == tp and r["alloc"] == alloc]
            for i, B in enumerate(sorted({r["B"] for r in sub})):
                rb = sorted((r for r in sub if r["B"] == B), key=lambda r: r["L"])
                color = f"C{i}"
                tag = "" if alloc == allocs[0] else f" (alloc {alloc // K}K)"
                ls = "-" if alloc == allocs[0] else "-."
                ax.plot([r["L"] for r in rb], [r["k3_us"] for r in rb], ls, color=color, marker="o", ms=3,
                        label=f"k3 B{B}{tag}")
                if alloc == allocs[0]:
                    ax.plot([r["L"] for r in rb], [r["floor_us"] for r in rb], "--", color=color, lw=0.8)
                rc = [r for r in rb if "compile_us" in r]
                ax.plot([r["L"] for r in rc], [r["compile_us"] for r in rc], ":", color=color, marker="x")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("valid length L (tokens)")
        ax.set_ylabel("µs per MLA decode step (CUDA graph median)")
        ax.set_title(f"TP {tp}: k3 (solid), floor (dashed), torch.compile plain (x)")
        ax.legend(fontsize=7, ncol=2)
        ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    print(f"wrote {png}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tp", type=int, nargs="+", default=[8, 16])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    ap.add_argument("--lengths", type=int, nargs="+", default=[K * 2**i for i in range(8)], help="1K .. 128K")
    ap.add_argument("--alloc", type=int, default=128 * K)
    ap.add_argument("--big-alloc", type=int, default=1024 * K, help="0: none")
    ap.add_argument("--big-batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--big-lengths", type=int, nargs="+", default=[K, 8 * K, 128 * K])
    ap.add_argument("--no-compile", dest="compile", action="store_false")
    ap.add_argument("--compile-batch", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--compile-lengths", type=int, nargs="+", default=[K, 4 * K, 32 * K, 128 * K])
    ap.add_argument("--replays", type=int, default=20)
    ap.add_argument("--max-rotation", type=int, default=MAX_ROTATION)
    ap.add_argument("--quick", action="store_true", help="TP 8; B 1 8 64; L 1K 4K 8K 32K 128K; 1M at B 1")
    ap.add_argument("--dry-run", action="store_true", help="CPU, interpreter, tiny widths: exercises the code only")
    ap.add_argument("--out", default=str(HERE / "results" / "mla_decode_h200.json"))
    args = ap.parse_args(argv)
    if args.quick:
        args.tp, args.batch, args.lengths = [8], [1, 8, 64], [K, 4 * K, 8 * K, 32 * K, 128 * K]
        args.big_batch, args.big_lengths, args.compile_lengths = [1], [K, 128 * K], [4 * K, 128 * K]
    if args.dry_run:
        os.environ.setdefault("TRITON_INTERPRET", "1")
        args.tp, args.batch, args.alloc, args.lengths = [2], [1, 2], 96, [1, 40, 96]
        args.big_alloc, args.big_batch, args.big_lengths = 160, [1], [1, 160]
        args.compile_batch, args.compile_lengths, args.max_rotation = [1, 2], [40, 160], 2
        if args.out == str(HERE / "results" / "mla_decode_h200.json"):
            args.out = "/tmp/mla_decode_dry_run.json"
    elif not torch.cuda.is_available():
        print("needs a CUDA GPU (or --dry-run)", file=sys.stderr)
        return 2
    sys.path.insert(0, str(HERE))
    sys.path.insert(1, str(HERE.parent))
    result = run(args)
    report_goals(result["summary"])
    print(f"\nwrote {args.out}")
    plot(result, str(Path(args.out).with_suffix(".png")))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
