"""K3's router, ``F.linear(x.float(), w.float())`` with a bf16 w [896, 7168], on the GPU (issue 30): plain
torch.compile of that expression against ``k3compile.optimize`` of it (the upcast-matmul pass:
``k3::skinny_gemm`` on the bf16 weight with a fp32 output), the op alone, and the op's Triton kernel alone.

    python benchmarks/upcast_router.py [--ms 1,2,4,8,16] [--json out.json]

Both compiles are ``dynamic=True`` (one compile each serves every M; the op dispatches at run time), so the
whole run takes well under a minute. Method as benchmarks/skinny_gemm.py: medians of CUDA-graph replays of
calls over enough weight copies (640 MB) that none stays in L2, per call; the ceiling is the measured copy
rate. Bytes of one call: N·K·2 (the bf16 weight, once) + M·K·2 + M·N·4; the plain path moves N·K·(2 + 4 + 4)
(the cast reads bf16 and writes fp32, the product reads the fp32). Every output is checked against float64
first. Prints one line per M: µs of each provider, % of the ceiling for the op, and the speedup of optimize()
over torch.compile.

    python benchmarks/upcast_router.py --sweep [--ms 1,8]

times the router as the decode step runs it instead: behind a kernel launched without PDL (Inductor's, here a
multiply that makes its input) and ahead of ``k3::moe_route``, one weight copy a step, for Triton configurations
of the product (the heuristic's, then PDL, the early trigger, preloaded tiles, TMA, K splits, the polled tail)
each with the routing kernel launched with and without PDL: µs a (multiply, product, routing) step, best first.
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


def sweep_configs(m: int, sms: int) -> list:
    """The Triton configurations of the router's product worth timing in the chain (``--sweep``)."""
    import dataclasses

    from k3compile.ops.skinny_gemm import triton_config as tc

    base = tc.heuristic(m, N, K, sms)
    out = [base, dataclasses.replace(base, pdl=True), dataclasses.replace(base, pdl=True, early_trigger=True),
           dataclasses.replace(base, pdl=True, preload=2), dataclasses.replace(base, pdl=True, **tc.POLLED_TAIL)]
    for split in (2, 4, 8, 16):
        for warps in (2, 4):
            for block_n in (32, 64):
                out.append(tc.TritonConfig(block_m=16, block_n=block_n, block_k=128, split_k=split, num_warps=warps,
                                           num_stages=4, one_launch=True, tma=True, pdl=True, prefetch_lines=0,
                                           early_trigger=True, **({"poll": True} if split > 1 else {})))
    return list(dict.fromkeys(out))


def sweep(ms, ws) -> list:
    """``--sweep``: the chain (multiply, product, routing) per config and routing launch, µs a step."""
    from k3compile.backends import sm_count
    from k3compile.ops.moe_route.triton import moe_route_triton
    from k3compile.ops.skinny_gemm.triton import skinny_gemm_triton

    rows = []
    bias = torch.randn(N, device="cuda") * 0.1
    for m in ms:
        x = torch.randn(m, K, device="cuda").bfloat16()
        ref = x.double() @ ws[0].double().T
        alone = graph_replay_us(lambda: [x * 1.0 for _ in ws], iters=1, replays=15, warmup=1) / len(ws)
        results = []
        for cfg in sweep_configs(m, sm_count(x.device)):
            for route_pdl in (False, True):
                def step(w, cfg=cfg, route_pdl=route_pdl):
                    logits = skinny_gemm_triton(x * 1.0, w, config=cfg, static_weight=True, out_dtype=torch.float32)
                    return logits, moe_route_triton(logits, bias, 16, 1e-20, 1.0, pdl=route_pdl)
                try:
                    err = rel_err(step(ws[0])[0], ref)
                    if not err < 1e-5:
                        print(f"# {cfg.tag()} M{m}: WRONG rel={err:.2e}", file=sys.stderr)
                        continue
                    us = graph_replay_us(lambda: [step(w) for w in ws], iters=1, replays=15, warmup=1) / len(ws)
                except Exception as e:   # a configuration that does not build here
                    print(f"# {cfg.tag()} M{m}: {type(e).__name__}: {str(e)[:160]}", file=sys.stderr)
                    continue
                results.append(dict(m=m, config=cfg.tag(), route_pdl=route_pdl, us=us, us_less_multiply=us - alone))
        results.sort(key=lambda r: r["us"])
        print(f"# M{m}: the multiply alone {alone:.2f} us a step; (multiply, product, routing) best first:")
        for r in results:
            print(f"M{m:<3} {r['us']:7.2f} us  {r['us_less_multiply']:7.2f} us less the multiply  "
                  f"route pdl {int(r['route_pdl'])}  {r['config']}")
        rows.extend(results)
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ms", default="1,2,4,8,16")
    ap.add_argument("--json", default=None)
    ap.add_argument("--sweep", action="store_true", help="the router in its decode-step chain, per configuration")
    args = ap.parse_args()
    import k3compile
    from k3compile.ops.skinny_gemm import SKINNY_GEMM

    torch.manual_seed(0)
    ws = [(torch.randn(N, K, device="cuda") / K ** 0.5).bfloat16() for _ in range(ROTATE_BYTES // (N * K * 2))]
    ceil = copy_ceiling_tbps()
    if args.sweep:
        rows = sweep([int(v) for v in args.ms.split(",")], ws)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, sweep=rows), f, indent=1)
        return
    plain = torch.compile(router, dynamic=True)
    # backend="auto": CuTe where the table puts it first at the 16-bit shape (the router: every M), else Triton;
    # only this pass (registering all takes ~20 s)
    optimized = k3compile.optimize(router, dynamic=True, passes=["upcast_matmul"])
    op = torch.ops.k3.skinny_gemm.default
    providers = {
        "torch.compile": plain,
        "optimize": optimized,
        "op": lambda x, w: op(x, w, None, None, "auto", 16, False, torch.float32),
        "op+static": lambda x, w: op(x, w, None, None, "auto", 16, True, torch.float32),
        "triton+static": lambda x, w: op(x, w, None, None, "triton", 16, True, torch.float32),
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
