"""How close can a kernel that only streams its weight get to the copy ceiling, back to back as a decode stack runs
its products? The limit the skinny GEMM's PDL options chase (docs/tuning/skinny_gemm.md cites it).

    python benchmarks/probe_weight_stream.py [--json out.json]

Each program sums its contiguous chunk of one weight copy (32 or 64 KB, 128-bit loads) and stores one fp32, so the
only traffic is the weight; the timed graph walks > 640 MB of copies (none stays in L2), CUDA-graph medians per
product, the same-run 2 GiB copy as the 100% line (docs/measuring.md). Four launch forms:

- ``plain``: no PDL (each kernel starts when the one before has completed);
- ``pdl-post-wait``: PDL, loads after ``gdc_wait`` (the weight may be the previous kernel's output), trigger after it;
- ``pdl-pre-trigafter``: loads before the wait (a static weight), trigger after the wait (where ``early`` puts it);
- ``pdl-pre-trigfirst``: loads before the wait, trigger as the program starts (``trigger_first``): the next product
  may launch while this one streams, so several products' weights are in flight at once.

Every output is checked against a float32 sum of its chunk before timing.
"""
import argparse
import json
import math
import os
import statistics
import sys

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import copy_ceiling_tbps, graph_replay_us  # noqa: E402

SHAPES = [(384, 7168), (7168, 768), (896, 7168), (1536, 7168), (2112, 7168), (4608, 7168), (20480, 7168)]
FORMS = {  # name: (pdl, loads before the wait, trigger first)
    "plain": (False, True, False), "pdl-post-wait": (True, False, False),
    "pdl-pre-trigafter": (True, True, False), "pdl-pre-trigfirst": (True, True, True)}
CHUNKS = [(2048, 8, 4), (2048, 16, 4), (4096, 8, 8)]  # elements per load, loads per program, warps


@triton.jit
def _stream_sum(w_ptr, out_ptr, BLOCK: tl.constexpr, CHUNKS: tl.constexpr, PDL: tl.constexpr, PRE: tl.constexpr,
                TRIGGER_FIRST: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    base = w_ptr + pid * (CHUNKS * BLOCK)
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], tl.float32)
    if PDL and TRIGGER_FIRST:
        gdc_launch_dependents()
    if PRE:
        for c in tl.static_range(CHUNKS):
            acc += tl.load(base + c * BLOCK + offs, cache_modifier=".cg").to(tl.float32)
    if PDL:
        gdc_wait()
        if not TRIGGER_FIRST:
            gdc_launch_dependents()
    if not PRE:
        for c in tl.static_range(CHUNKS):
            acc += tl.load(base + c * BLOCK + offs, cache_modifier=".cg").to(tl.float32)
    tl.store(out_ptr + pid, tl.sum(acc))


def time_form(ws, out, block, chunks, warps, form):
    pdl, pre, first = FORMS[form]
    grid = (ws[0].numel() // (block * chunks),)
    extra = {"launch_pdl": True} if pdl else {}

    def products():
        for w in ws:
            _stream_sum[grid](w, out, BLOCK=block, CHUNKS=chunks, PDL=pdl, PRE=pre, TRIGGER_FIRST=first,
                              num_warps=warps, **extra)

    out.fill_(float("nan"))
    products()
    ref = ws[-1].view(grid[0], -1).float().sum(1)
    if not torch.allclose(out, ref, rtol=1e-3, atol=1e-1):  # NaN fails too
        raise AssertionError(f"{form}: wrong sums")
    return statistics.median(graph_replay_us(products, iters=1, replays=15, warmup=1) / len(ws) for _ in range(3))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    ceil = copy_ceiling_tbps()
    print(f"# copy ceiling {ceil:.3f} TB/s; torch {torch.__version__}, triton {triton.__version__}, "
          f"{torch.cuda.get_device_name()}", flush=True)
    rows = []
    for n, k in SHAPES:
        nbytes = n * k * 2
        copies = max(2, math.ceil(640 * 2**20 / nbytes))
        ws = [torch.randn(n * k, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
        floor = nbytes / (ceil * 1e12) * 1e6
        line = [f"{n}x{k} {nbytes / 1e6:6.1f} MB floor {floor:6.2f} us |"]
        for block, chunks, warps in CHUNKS:
            per = block * chunks
            out = torch.empty(n * k // per, device="cuda", dtype=torch.float32)
            for form in FORMS:
                us = time_form(ws, out, block, chunks, warps, form)
                rows.append(dict(n=n, k=k, program_kb=per * 2 // 1024, warps=warps, form=form, us=us, frac=floor / us))
                line.append(f"{per * 2 // 1024}K/{warps}w/{form} {us:6.2f} {floor / us:5.1%}")
        print(" ".join(line), flush=True)
        del ws
        torch.cuda.empty_cache()
    if args.json:
        json.dump(dict(ceiling_tbps=ceil, rows=rows), open(args.json, "w"), indent=1)


if __name__ == "__main__":
    main()
