"""K3's routing tail on the GPU (E 896 experts, top-16, renormalised): ``torch.compile`` of the model's code after
the router's product (a fused sigmoid + bias, ATen's radix top-k and its sort, a gather-and-normalise kernel)
against ``k3::moe_route`` (one Triton kernel) in both of its top-k forms.

    python benchmarks/moe_route.py [--ms 1,8,64,256] [--json out.json]

Medians of CUDA-graph replays of 50 calls (``_common.graph_replay_us``); each output is checked first: the op's
experts are the top-k of the reference keys (tests/ops/test_moe_route.py ``assert_is_top_k``) and its weights the
reference's for those experts. The row of logits is a few KB: these are latency figures, no floor applies.
"""
import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import graph_replay_us  # noqa: E402

E, TOP_K, EPS = 896, 16, 1e-20


def route_tail(logits, bias):
    """model/moe.py ``route`` after its product (k3compile.ops.moe_route.reference is the same code)."""
    from k3compile.ops.moe_route.reference import moe_route_ref

    return moe_route_ref(logits, bias, TOP_K, EPS, 1.0)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ms", default="1,8,64,256")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    from k3compile.ops.moe_route.triton import moe_route_triton

    compiled = torch.compile(route_tail, dynamic=False)
    rows = []
    print(f"{'M':>5} {'torch.compile':>14} {'op topk':>9} {'op rounds':>10} {'x compile':>10}")
    for m in (int(x) for x in args.ms.split(",")):
        g = torch.Generator(device="cuda").manual_seed(m)
        logits = torch.randn(m, E, device="cuda", generator=g) * 4
        bias = torch.randn(E, device="cuda", generator=g) * 0.1
        ref_w, ref_e = route_tail(logits, bias)
        for network in (True, False):
            w, e = moe_route_triton(logits, bias, TOP_K, EPS, 1.0, sorting_network=network)
            key = torch.sigmoid(logits) + bias
            picked = key.gather(-1, e)
            assert (picked[:, 1:] <= picked[:, :-1] + 1e-6).all(), "not descending"
            assert (key.scatter(-1, e, float("-inf")).amax(-1) <= picked[:, -1] + 1e-6).all(), "not the top-k"
            s = torch.sigmoid(logits).gather(-1, e)
            torch.testing.assert_close(w, s / (s.sum(-1, keepdim=True) + EPS))
        us = {"torch.compile": graph_replay_us(lambda: compiled(logits, bias), iters=50, replays=20, warmup=3)}
        for name, network in (("op topk", True), ("op rounds", False)):
            us[name] = graph_replay_us(lambda: moe_route_triton(logits, bias, TOP_K, EPS, 1.0, sorting_network=network),
                                       iters=50, replays=20, warmup=3)
        rows.append(dict(m=m, e=E, top_k=TOP_K, us=us))
        print(f"{m:>5} {us['torch.compile']:>14.2f} {us['op topk']:>9.2f} {us['op rounds']:>10.2f} "
              f"{us['torch.compile'] / us['op topk']:>10.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
