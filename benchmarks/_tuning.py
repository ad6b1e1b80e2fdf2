"""What the tuners (``tune_skinny_gemm.py``, ``tune_latent_moe_tail.py``) share: turning timings into a table's
picks (``k3compile/tables.py``), and timing a candidate on the GPU.

``picks_from_timings`` is plain Python (tests/ops/test_tuners.py checks, on the CPU, that what it makes is what
the dispatch reads back).
"""
from __future__ import annotations

import math
import statistics
from typing import Any, Callable, Mapping, Optional

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
