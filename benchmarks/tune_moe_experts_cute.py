"""The CuTe MXFP4 experts kernels (``k3compile/ops/moe_experts/cute.py``) alone under a few work divisions (GPU).

    python benchmarks/tune_moe_experts_cute.py [I] [--compact-only] [--down-only | --gate-up-only] [--ahead]
        [--ms=1,8] [--configs=w4r1g2sc,...]
    # I = 384 (TP 8, the default) or 192 (TP 16); --ms: the M values (default 1, 4, 8, 16); --ahead: down's
    # divisions with their groups' loads ahead too; --configs: only the divisions with these tags

K3 rank widths (E 896, top-16, L 3584), M 1, 4, 8 and 16, random routing; each row first checked against the fp32
reference (its relative error printed), then timed as 40 calls on 40 different routings in one CUDA graph (the
experts stream from HBM, not L2), the best of 5 replays, µs a call. The picks live in ``cute.py``
(``gate_up_config``, ``down_config``); ``docs/tuning/moe_experts.md`` has the runs (8, 10, 12-16).
"""
import dataclasses
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from k3compile.ops.moe_experts import cute  # noqa: E402
from k3compile.ops.moe_experts.reference import moe_experts_ref  # noqa: E402
from k3compile.testing import rel_err  # noqa: E402

torch.manual_seed(0)
E, A, L, I = 896, 16, 3584, int(sys.argv[1]) if len(sys.argv) > 1 and sys.argv[1].isdigit() else 384
dev = "cuda"


def codes(r, c):
    return torch.randint(0, 256, (E, r, c // 2), dtype=torch.uint8, device=dev)


def scl(r, c):   # bytes <= 128: the variants without the second multiply, as a real checkpoint takes
    return torch.randint(118, 122, (E, r, c // 32), dtype=torch.uint8, device=dev)


w1, w3, w2 = codes(I, L), codes(I, L), codes(L, I)
s1, s3, s2 = scl(I, L), scl(I, L), scl(L, I)
BET = (4.0, 25.0)
GU = [cute.Mxfp4MmaConfig(4, 1, 2), cute.Mxfp4MmaConfig(2, 1, 2), cute.Mxfp4MmaConfig(2, 1, 1),
      cute.Mxfp4MmaConfig(4, 1, 1, prefetch=True), cute.Mxfp4MmaConfig(4, 1, 1, prefetch=True, scan_unrolled=True),
      cute.Mxfp4MmaConfig(2, 1, 2, scan_unrolled=True), cute.Mxfp4MmaConfig(2, 1, 1, scan_unrolled=True),
      # compact: the MMA's columns only the expert's tokens
      cute.Mxfp4MmaConfig(4, 1, 1, prefetch=True, scan_unrolled=True, compact=True),
      cute.Mxfp4MmaConfig(2, 1, 2, scan_unrolled=True, compact=True),
      cute.Mxfp4MmaConfig(2, 1, 1, scan_unrolled=True, compact=True),
      cute.Mxfp4MmaConfig(4, 1, 2, scan_unrolled=True, compact=True)]
DN = [cute.Mxfp4DownConfig(4, 1, 2), cute.Mxfp4DownConfig(4, 1, 2, scan_unrolled=True),
      cute.Mxfp4DownConfig(4, 1, 2, scan_unrolled=True, compact=True),
      cute.Mxfp4DownConfig(4, 2, 2, scan_unrolled=True, compact=True),
      cute.Mxfp4DownConfig(8, 1, 1, scan_unrolled=True, compact=True)]

if I < 384:
    # at TP 16 a block of down's 64 rows holds 6.5 KB of codes (13 at I = 384): larger blocks amortise its prologue;
    # gate/up has half the rows to divide, so more K-warps a block are candidates too
    DN += [cute.Mxfp4DownConfig(4, 1, 4, scan_unrolled=True, compact=True),
           cute.Mxfp4DownConfig(4, 2, 4, scan_unrolled=True, compact=True),
           cute.Mxfp4DownConfig(8, 1, 2, scan_unrolled=True, compact=True),
           cute.Mxfp4DownConfig(8, 2, 2, scan_unrolled=True, compact=True),
           cute.Mxfp4DownConfig(2, 2, 4, scan_unrolled=True, compact=True)]
    GU += [cute.Mxfp4MmaConfig(4, 1, 1, scan_unrolled=True, compact=True)]
# more K-warps a block: at M 1 a block's chain of K steps is the kernel's latency (16 experts fill few SMs' warps)
GU += [cute.Mxfp4MmaConfig(8, 1, 1, scan_unrolled=True, compact=True),
       cute.Mxfp4MmaConfig(8, 1, 1, prefetch=True, scan_unrolled=True, compact=True)]
if "--compact-only" in sys.argv:   # the forms the picks are drawn from
    GU, DN = [c for c in GU if c.compact], [c for c in DN if c.compact]
if "--down-only" in sys.argv:
    GU = []
if "--gate-up-only" in sys.argv:
    DN = []
if "--ahead" in sys.argv:   # each compact down division with its groups' loads ahead too, and one group a warp
    DN += [dataclasses.replace(c, ahead=True) for c in DN if c.compact]
    DN += [cute.Mxfp4DownConfig(4, 1, 1, scan_unrolled=True, compact=True, ahead=True)]
MS = next((tuple(int(v) for v in a[5:].split(",")) for a in sys.argv if a.startswith("--ms=")), (1, 4, 8, 16))
TAGS = next((set(a[10:].split(",")) for a in sys.argv if a.startswith("--configs=")), None)
if TAGS is not None:   # only these (their tags), from every form above
    GU, DN = [c for c in GU if c.tag() in TAGS], [c for c in DN if c.tag() in TAGS]


def time_config(which, zs, ids, wts, ref):
    """(µs a call of ``which`` alone, the best of 5 replays of one graph of R routings; the op's relative error)."""
    out = cute.moe_experts_cute(zs[0], ids[0], wts[0], w1, w3, w2, s1, s3, s2, *BET)
    err = rel_err(out, ref)

    def fn(r):
        return cute.moe_experts_cute(zs[r], ids[r], wts[r], w1, w3, w2, s1, s3, s2, *BET, only=which)
    for r in range(len(zs)):
        fn(r)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for r in range(len(zs)):
            fn(r)
    best = 1e9
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        best = min(best, a.elapsed_time(b) * 1000 / len(zs))
    return best, err


for m in MS:
    R = 40
    zs = [torch.randn(m, L, device=dev).to(torch.bfloat16) for _ in range(R)]
    ids = [torch.stack([torch.randperm(E, device=dev)[:A] for _ in range(m)]) for _ in range(R)]
    wts = [torch.rand(m, A, device=dev) + 0.1 for _ in range(R)]
    ref = moe_experts_ref(zs[0], ids[0], wts[0], w1, w3, w2, s1, s3, s2, *BET)
    for which, cfgs in (("gate_up", GU), ("down", DN)):
        for cfg in cfgs:
            try:
                with cute.configs_forced(**{which: cfg}):
                    best, err = time_config(which, zs, ids, wts, ref)
                print(f"I{I} M{m} {which:8s} {cfg.tag():10s} {best:7.1f} us  err {err:.1e}", flush=True)
            except Exception as ex:
                print(f"I{I} M{m} {which:8s} {cfg.tag():10s} FAILED {type(ex).__name__}: {str(ex)[:200]}", flush=True)
