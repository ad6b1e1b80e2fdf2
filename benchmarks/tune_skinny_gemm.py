"""Rebuild the skinny GEMM's table (``k3compile/ops/skinny_gemm/tables/<gpu>.json``) on the GPU at hand.

    python benchmarks/tune_skinny_gemm.py [--shapes 896x7168,...] [--ms 1,2,4,8,16] [--dtypes bfloat16]
                                          [--out PATH] [--merge] [--passes 3] [--replays 15]

For each dtype, M bucket, N x K and static weight off / on it times cuBLAS, the Triton kernel's candidates and the
CuTe kernels' candidates (``candidates``), each checked against a float64 reference first, back to back in CUDA
graphs with the weight rotated out of L2 (docs/measuring.md), and writes the picks: per kernel its fastest
configuration, and the kernels faster than cuBLAS by more than 3% in the order the dispatch tries them
(``_tuning.picks_from_timings``; CuTe is listed only where it is the fastest). ``--merge`` keeps the rows of an
existing table for the shapes not timed now. The router's shape (``CHAIN_TIMED``) is timed elsewhere: its Triton
configuration serves the fp32-output product in the decode step's chain (``benchmarks/upcast_router.py --sweep``),
so the default shapes leave it out and its rows are kept (``--shapes`` naming it re-times it here). Then rerun
``benchmarks/skinny_gemm.py`` to confirm, and record the run in ``benchmarks/results/README.md``.
"""
from __future__ import annotations

import argparse
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _tuning import add_arguments, keep, time_rotated, write_table  # noqa: E402

from k3compile import tables  # noqa: E402
from k3compile.kernels.cute.configs import MmaConfig, WgmmaConfig  # noqa: E402
from k3compile.ops.skinny_gemm import cute_config, dispatch  # noqa: E402

K3_SHAPES = [(4608, 7168), (1536, 7168), (2112, 7168), (2304, 1536), (896, 7168), (3584, 7168),
             (7168, 3584), (7168, 1536), (7168, 768), (20480, 7168)]
ROTATE_BYTES = 640 * 2**20
# shapes whose table rows another benchmark measures, and the note the table keeps about them
CHAIN_TIMED = {(896, 7168): ("The 896 x 7168 rows serve the router's fp32-output product too (the upcast-matmul "
                             "rewrite: CuTe's fp32-output variant of the pick); their Triton configurations were timed "
                             "in the decode step's chain by benchmarks/upcast_router.py --sweep "
                             "(docs/tuning/moe_route.md run 3), kept by "
                             "benchmarks/tune_skinny_gemm.py. ")}


def cute_candidates(m: int, n: int, k: int, static: bool, current) -> list:
    """The CuTe configurations worth timing: the current table's and the heuristics' picks, the mma.sync divisions
    that won on the H200, and wgmma forms (row tiles of 64 / 128, split-K clusters with pushed partials, the
    producer warp; with a static weight the trigger first and register tiles)."""
    out = [current, cute_config.mma_heuristic(m, n, k)]
    if static:
        out.append(cute_config.register_tile_heuristic(m, n, k))
    row_kb = k * 2 * 8 // 1024
    for kw in (dict(warps_k=8, unroll=2, stages=3, early=True, l2_kb=16), dict(warps_k=4, unroll=4, early=True,
               l2_kb=row_kb), dict(warps_k=8, unroll=2, stages=3, split_k=2, early=True, l2_kb=row_kb // 2),
               dict(warps_k=8, unroll=2, stages=3, l2_kb=16, a_ring=True, a_l1=True)):
        out.append(MmaConfig(**kw))
    tf = dict(trigger_first=True) if static else {}
    for block_n in (64, 128):
        for split in (1, 2, 4, 8):
            for block_k, stages in ((128, 6), (64, 8), (128, 4)):
                out.append(WgmmaConfig(block_n=block_n, block_k=block_k, stages=stages, split_k=split,
                                       producer_warp=True, evict_hints=True, push_partials=split > 1, **tf))
    seen = []
    for c in out:
        ok = c is not None and (isinstance(c, MmaConfig) or (c.invalid() is None and c.share_fits(k)))
        if ok and c not in seen:
            seen.append(c)
    return seen


def triton_candidates(m: int, n: int, k: int, sms: int, current) -> list:
    """The Triton configurations worth timing: the current pick, the heuristic's, and its neighbours in depth and
    warps."""
    import dataclasses

    from k3compile.ops.skinny_gemm import triton_config

    base = triton_config.heuristic(m, n, k, sms)
    out = [current, base]
    for stages in (3, 4, 5):
        for warps in (2, 4):
            out.append(dataclasses.replace(base, num_stages=stages, num_warps=warps))
    return list(dict.fromkeys(c for c in out if c is not None))


def tune(shapes, ms, dtypes, passes: int, replays: int, table) -> dict:
    """(dtype, M bucket, N, K, static) -> {implementation: [(µs, config), ...]} on this GPU."""
    import torch.nn.functional as F

    from k3compile.backends import cute_can_run_on, sm_count
    from k3compile.ops.skinny_gemm import cute
    from k3compile.ops.skinny_gemm.triton import skinny_gemm_triton

    sms = sm_count(torch.device("cuda"))
    has_cute = cute_can_run_on(torch.empty(1, device="cuda")) is None
    timings = {}
    for dtype in dtypes:
        for n, k in shapes:
            copies = max(2, math.ceil(ROTATE_BYTES / (n * k * 2)))
            ws = [torch.randn(n, k, device="cuda", dtype=dtype) / k ** 0.5 for _ in range(copies)]
            for m in ms:
                a = torch.randn(m, k, device="cuda", dtype=dtype)
                ref = F.linear(a.double(), ws[0].double())
                for static in (False, True):
                    def timed(f):
                        return time_rotated(f, ws, ref, replays, passes)

                    per = {"cublas": [(timed(lambda w: F.linear(a, w)), None)]}
                    name = str(dtype).removeprefix("torch.")
                    pick = table.get(name, m, n, k, static) if table is not None else None
                    current = pick.configs if pick is not None else {}
                    per["triton"] = [(timed(lambda w, c=c: skinny_gemm_triton(a, w, config=c, static_weight=static)),
                                      c) for c in triton_candidates(m, n, k, sms, current.get("triton"))]
                    if has_cute and dtype in (torch.bfloat16, torch.float16):
                        per["cute"] = [(timed(lambda w, c=c: cute.skinny_gemm_cute(a, w, None, None, c,
                                                                                   static_weight=static)), c)
                                       for c in cute_candidates(m, n, k, static, current.get("cute"))]
                    keep(timings, (name, tables.m_bucket(m), n, k, static), per)
            del ws
            torch.cuda.empty_cache()
    return timings


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default=None, help="N x K list, e.g. 896x7168,4608x7168 (default: K3's)")
    ap.add_argument("--ms", default="1,2,4,8,16")
    add_arguments(ap, dtypes="bfloat16")
    args = ap.parse_args(argv)
    shapes = K3_SHAPES if args.shapes is None else [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    named = [] if args.shapes is None else shapes
    kept = [s for s in CHAIN_TIMED if s not in named]
    shapes = [s for s in shapes if s not in kept]
    timings = tune(shapes, [int(m) for m in args.ms.split(",")], [getattr(torch, d) for d in args.dtypes.split(",")],
                   args.passes, args.replays, dispatch.table_for(torch.cuda.get_device_name()))
    # kept shapes' rows come from the existing table (a merge), and so does every untimed shape's then
    write_table("skinny_gemm", dispatch, timings, "cublas", args.out, args.merge or bool(kept),
                note="".join(CHAIN_TIMED[s] for s in kept))


if __name__ == "__main__":
    main()
