"""Rebuild the latent-MoE tail's table (``k3compile/ops/latent_moe_tail/tables/<gpu>.json``) on the GPU at hand.

    python benchmarks/tune_latent_moe_tail.py [--m 1,2,4,8,16] [--widths 7168x3584] [--dtypes bfloat16,float16]
                                              [--out PATH] [--merge] [--passes 3] [--replays 15]

For each dtype, M bucket, D x L and static weight off / on it times the split path (Triton norm + the skinny
GEMM's pick: what the dispatch falls back to), the one-kernel Triton tail's candidates and the CuTe tail's
candidates, each checked against an fp32 reference first, in CUDA graphs with the weight rotated out of L2
(docs/measuring.md), and writes the picks (``_tuning.picks_from_timings``: the one-kernel forms faster than the
split path by more than 3%, CuTe listed only where it is the fastest). Then rerun ``benchmarks/moe_tail.py`` to
confirm, and record the run in ``benchmarks/results/README.md``.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _tuning import add_arguments, keep, time_rotated, write_table  # noqa: E402

from k3compile import tables  # noqa: E402
from k3compile.kernels.cute.configs import WgmmaConfig  # noqa: E402
from k3compile.ops.latent_moe_tail import dispatch  # noqa: E402
from k3compile.ops.latent_moe_tail.triton_config import STREAM_K_TMA, TailConfig  # noqa: E402

EPS = 1e-5
ROTATE_BYTES = 640 * 2**20


def cute_candidates(m: int, d: int, l: int, static: bool, current) -> list:
    """The current pick, the skinny GEMM's mma.sync pick, and wgmma forms whose resident A holds the latent's share:
    the producer warp with 5-8 stages, the MMA warps alone triggering (not static) or the trigger first (static)."""
    from k3compile.ops.skinny_gemm import dispatch as gemm_dispatch

    out = [current, dispatch.cute_config_for(torch.bfloat16, m, d, l, static, None,
                                             gemm_dispatch.gpu_of(torch.device("cuda")).table)]
    for stages in (5, 6, 8):
        for extra in ((dict(trigger_first=True), {}) if static else (dict(mma_trigger=True), {})):
            out.append(WgmmaConfig(block_n=64, block_k=128, stages=stages, producer_warp=True, evict_hints=True,
                                   **extra))
    return list(dict.fromkeys(c for c in out if c is not None and
                              (not isinstance(c, WgmmaConfig) or (c.invalid() is None and c.norm_fits(m, l)))))


def triton_candidates(current) -> list:
    """The current pick, stream-K through TMA, and the grid form (no K split, all tiles by TMA, PDL, early trigger)
    at a few depths and tile widths."""
    out = [current, STREAM_K_TMA, dataclasses.replace(STREAM_K_TMA, reduce="last", pdl=True)]
    for block_n, warps, stages in ((32, 2, 5), (32, 2, 4), (64, 4, 6), (32, 4, 4)):
        out.append(TailConfig(block_n=block_n, block_k=128, split_k=1, num_warps=warps, num_stages=stages, tma=True,
                              pdl=True, early_trigger=True))
    return list(dict.fromkeys(c for c in out if c is not None))


def tune(ms, widths, dtypes, passes: int, replays: int, table) -> dict:
    """(dtype, M bucket, D, L, static) -> {implementation: [(µs, config), ...]} on this GPU."""
    from k3compile.backends import cute_can_run_on
    from k3compile.ops.latent_moe_tail import cute, split, triton_config
    from k3compile.ops.latent_moe_tail.reference import latent_moe_tail_ref
    from k3compile.ops.latent_moe_tail.triton import latent_moe_tail_triton

    has_cute = cute_can_run_on(torch.empty(1, device="cuda")) is None
    timings = {}
    for dtype in dtypes:
        name = str(dtype).removeprefix("torch.")
        for d, l in widths:
            copies = max(2, math.ceil(ROTATE_BYTES / (d * l * 2)))
            ws = [(torch.randn(d, l, device="cuda") / l ** 0.5).to(dtype) for _ in range(copies)]
            g = (1 + 0.1 * torch.randn(l, device="cuda")).to(dtype)
            for m in ms:
                lat, sh = torch.randn(m, l, device="cuda").to(dtype), torch.randn(m, d, device="cuda").to(dtype)
                ref = latent_moe_tail_ref(lat.float(), sh.float(), g.float(), ws[0].float(), EPS).double()
                for static in (False, True):
                    def timed(f):
                        return time_rotated(f, ws, ref, replays, passes)

                    pick = table.get(name, m, d, l, static) if table is not None else None
                    current = pick.configs if pick is not None else {}
                    per = {"split": [(timed(lambda w: split.latent_moe_tail_split(lat, sh, g, w, EPS)), None)],
                           "triton": [(timed(lambda w, c=c: latent_moe_tail_triton(lat, sh, g, w, EPS, c,
                                                                                   static_weight=static)), c)
                                      for c in dict.fromkeys(triton_config.for_dtype(c, dtype)
                                                             for c in triton_candidates(current.get("triton")))]}
                    if has_cute and dtype == torch.bfloat16:
                        per["cute"] = [(timed(lambda w, c=c: cute.latent_moe_tail_cute(lat, sh, g, w, EPS, c,
                                                                                       static_weight=static)), c)
                                       for c in cute_candidates(m, d, l, static, current.get("cute"))]
                    keep(timings, (name, tables.m_bucket(m), d, l, static), per)
            del ws
            torch.cuda.empty_cache()
    return timings


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--m", default="1,2,4,8,16")
    ap.add_argument("--widths", default="7168x3584", help="D x L list (output width x latent width)")
    add_arguments(ap, dtypes="bfloat16,float16")
    args = ap.parse_args(argv)
    widths = [tuple(int(v) for v in s.split("x")) for s in args.widths.split(",")]
    timings = tune([int(m) for m in args.m.split(",")], widths, [getattr(torch, d) for d in args.dtypes.split(",")],
                   args.passes, args.replays, dispatch.table_for(torch.cuda.get_device_name()))
    write_table("latent_moe_tail", dispatch, timings, "split", args.out, args.merge)


if __name__ == "__main__":
    main()
