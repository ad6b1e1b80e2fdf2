"""K3's router, ``F.linear(x.float(), w.float())`` with a bf16 w [896, 7168], on the GPU (issue 30): plain
torch.compile of that expression against ``k3compile.optimize`` of it (the upcast-matmul pass:
``k3::skinny_gemm`` on the bf16 weight with a fp32 output) and the op alone.

    python benchmarks/upcast_router.py [--ms 1,2,4,8,16] [--json out.json]

Both compiles are ``dynamic=True`` (one compile each serves every M; the op dispatches at run time), so the
whole run takes well under a minute. Method as benchmarks/skinny_gemm.py: medians of CUDA-graph replays of
calls over enough weight copies (640 MB) that none stays in L2, per call; the ceiling is the measured copy
rate. Bytes of one call: N·K·2 (the bf16 weight, once) + M·K·2 + M·N·4; the plain path moves N·K·(2 + 4 + 4)
(the cast reads bf16 and writes fp32, the product reads the fp32). Every output is checked against float64
first. Prints one line per M: µs of each provider, % of the ceiling for the op, and the speedup of optimize()
over torch.compile.
"""
import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import copy_ceiling_tbps, graph_replay_us, rel_err  # noqa: E402

N, K = 896, 7168
ROTATE_BYTES = 640 * 2**20


def router(x, w):
    return F.linear(x.float(), w.float())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ms", default="1,2,4,8,16")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    import k3compile
    from k3compile.ops.skinny_gemm import SKINNY_GEMM

    torch.manual_seed(0)
    ws = [(torch.randn(N, K, device="cuda") / K ** 0.5).bfloat16() for _ in range(ROTATE_BYTES // (N * K * 2))]
    ceil = copy_ceiling_tbps()
    plain = torch.compile(router, dynamic=True)
    # backend="auto": CuTe refuses the fp32 output, Triton runs; only this pass (registering all takes ~20 s)
    optimized = k3compile.optimize(router, dynamic=True, passes=["upcast_matmul"])
    op = torch.ops.k3.skinny_gemm.default
    providers = {
        "torch.compile": plain,
        "optimize": optimized,
        "op": lambda x, w: op(x, w, None, None, "auto", 16, False, torch.float32),
        "op+static": lambda x, w: op(x, w, None, None, "auto", 16, True, torch.float32),
    }
    rows = []
    print(f"# router {N}x{K} bf16 weight, fp32 output; copy ceiling {ceil:.2f} TB/s; {len(ws)} weight copies")
    for m in (int(v) for v in args.ms.split(",")):
        x = torch.randn(m, K, device="cuda").bfloat16()
        ref = x.double() @ ws[0].double().T
        us = {}
        for name, f in providers.items():
            err = rel_err(f(x, ws[0]), ref)
            if not err < 1e-5:   # fp32 sums of exact products; NaN fails too
                print(f"# {name} M{m}: WRONG rel={err:.2e}", file=sys.stderr)
                continue
            us[name] = graph_replay_us(lambda f=f: [f(x, w) for w in ws], iters=1, replays=15, warmup=1) / len(ws)
        op_bytes = N * K * 2 + m * K * 2 + m * N * 4
        frac = op_bytes / (us["op+static"] * 1e-6) / (ceil * 1e12) if "op+static" in us else float("nan")
        speedup = us["torch.compile"] / us["optimize"] if {"torch.compile", "optimize"} <= us.keys() else float("nan")
        print(f"M{m:<3} " + "  ".join(f"{k} {v:6.2f} us" for k, v in us.items())
              + f"  op+static {frac:5.1%} of ceiling  optimize x{speedup:.2f} over torch.compile")
        rows.append(dict(m=m, n=N, k=K, us=us, frac_of_ceiling=frac, speedup=speedup))
    kernels = sorted({(c.impl, c.reason) for c in SKINNY_GEMM.choices()})
    for impl, reason in kernels:
        print(f"# k3::skinny_gemm ran {impl}: {reason}")
    print("# upcast_matmul matches in optimize()'s graph:", k3compile.report(optimized).matches.get("upcast_matmul"))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), ceiling_tbps=ceil, torch=torch.__version__,
                           rows=rows, kernels=kernels), f, indent=1)


if __name__ == "__main__":
    main()
