"""What the tuners (``tune_skinny_gemm.py``, ``tune_latent_moe_tail.py``) share: turning timings into a table's
picks (``k3compile/tables.py``), and timing a candidate on the GPU.

``picks_from_timings`` is plain Python (tests/ops/test_tuners.py checks, on the CPU, that what it makes is what
the dispatch reads back).
"""
from __future__ import annotations

import json
import math
import os
import statistics
import sys
from typing import Any, Callable, Mapping, Optional

from k3compile import tables
from k3compile.tables import Pick

MARGIN = 0.03   # a kernel must beat the fallback by more than this to be listed (run-to-run noise is ~1-2%)


def picks_from_timings(timings: Mapping[tuple, Mapping[str, list]], fallback: str, impl_order: tuple[str, ...],
                       margin: float = MARGIN) -> dict:
    """The table's picks from measured times.

    ``timings``: (dtype, M bucket, N, K, static) -> {implementation: [(µs, config), ...]}, the fallback's entry
    ``[(µs, None)]``. Per implementation its fastest configuration; the order lists the implementations faster
    than the fallback by more than ``margin``, fastest first, within what the dispatch can express: it tries
    ``impl_order[0]`` only first, so that one is listed only where it is the fastest of all. The order is decided
    on the timings without a static weight (the dispatch decides before it knows) and shared by both rows of a
    shape; each row keeps its own configurations.
    """
    best = {key: {impl: min(runs, key=lambda r: r[0]) for impl, runs in per.items() if runs}
            for key, per in timings.items()}
    picks = {}
    for key, per in best.items():
        dtype, m, n, k, static = key
        decide = best.get((dtype, m, n, k, False), per)
        base = decide[fallback][0]
        faster = sorted((us, impl) for impl, (us, _) in decide.items()
                        if impl != fallback and us < base * (1 - margin))
        order = [impl for _, impl in faster]
        if order and order[0] != impl_order[0]:
            order = [impl for impl in order if impl != impl_order[0]]
        order = [impl for impl in impl_order if impl in order]   # the dispatch's order (the first is first anyway)
        configs = {impl: cfg for impl, (_, cfg) in per.items() if impl != fallback and cfg is not None}
        picks[key] = Pick(tuple(order), configs)
    return picks


def geomean(values) -> float:
    values = list(values)
    return math.exp(sum(map(math.log, values)) / len(values)) if values else float("nan")


def time_us(fn: Callable[[], Any], check: Optional[Callable[[], float]], reps: int, replays: int,
            passes: int = 1) -> Optional[float]:
    """Median µs of ``fn()`` (CUDA graphs of ``reps`` calls, ``replays`` replays, over ``passes`` passes), or None
    where ``check()`` (the relative error of one call, NaN failing) is not below 2e-2 or the call raises."""
    import sys

    from _common import graph_replay_us

    try:
        if check is not None:
            err = check()
            if not err < 2e-2:
                print(f"#   wrong result (rel {err:.2e}): not timed", file=sys.stderr)
                return None
        runs = [graph_replay_us(fn, iters=reps, replays=replays, warmup=1) for _ in range(passes)]
    except Exception as e:   # a configuration that does not build here (shared memory, registers) is passed over
        print(f"#   {type(e).__name__}: {str(e)[:200]}", file=sys.stderr)
        return None
    return statistics.median(runs)


def time_rotated(f: Callable, ws: list, ref, replays: int, passes: int) -> Optional[float]:
    """µs per call of ``f(w)`` walking the weight copies ``ws`` (none stays in L2), after checking ``f(ws[0])``
    against ``ref``; None where it is wrong or fails."""
    err = lambda: ((f(ws[0]).double() - ref).norm() / ref.norm()).item()  # noqa: E731
    us = time_us(lambda: [f(w) for w in ws], err, 1, replays, passes)
    return None if us is None else us / len(ws)


def keep(timings: dict, key: tuple, per: dict) -> None:
    """Store one shape's timings (the failed runs dropped) under ``key`` and print each implementation's best."""
    per = {impl: [(us, c) for us, c in runs if us is not None] for impl, runs in per.items()}
    timings[key] = per
    best = {impl: min(runs, key=lambda r: r[0]) for impl, runs in per.items() if runs}
    dtype, m, n, k, static = key
    print(f"{dtype} M<={m} N{n} K{k} static={int(static)}: " + "  ".join(
        f"{impl} {us:.2f} µs" + (f" [{c.tag()}]" if c is not None else "") for impl, (us, c) in best.items()),
        flush=True)


def add_arguments(parser, dtypes: str) -> None:
    """The options every tuner takes."""
    parser.add_argument("--dtypes", default=dtypes)
    parser.add_argument("--out", default=None, help="default: the dispatch's table path for this GPU")
    parser.add_argument("--merge", action="store_true", help="keep an existing table's rows for shapes not timed now")
    parser.add_argument("--passes", type=int, default=3)
    parser.add_argument("--replays", type=int, default=15)


def write_table(op: str, dispatch, timings: dict, fallback: str, out: Optional[str], merge: bool,
                note: str = "") -> str:
    """The picks of ``timings`` as this GPU's table of ``op`` (``dispatch``: the op's dispatch module), checked with
    the reader the dispatch uses, written to ``out`` (default: where the dispatch looks for it), ``note`` before the
    command line in its note; its path."""
    import torch

    from k3compile.backends import sm_count

    name = torch.cuda.get_device_name()
    out = out or os.path.join(os.path.dirname(dispatch.__file__), "tables", tables.gpu_slug(name) + ".json")
    picks = picks_from_timings(timings, fallback, tuple(dispatch.KERNELS))
    if merge and os.path.exists(out):
        timed = {(k[0], k[2], k[3]) for k in picks}
        picks = {**{key: p for key, p in tables.load(out, dispatch.KERNELS).picks.items()
                    if (key[0], key[2], key[3]) not in timed}, **picks}
    text = tables.dumps(op, name, sm_count(torch.device("cuda")), picks, dispatch.KERNEL_OF,
                        f"benchmarks/tune_{op}.py", f"{note}written by: {' '.join(sys.argv)}")
    tables.parse(json.loads(text), dispatch.KERNELS)   # what the dispatch will read
    with open(out, "w") as f:
        f.write(text)
    print(f"wrote {len(picks)} picks to {out}")
    return out
