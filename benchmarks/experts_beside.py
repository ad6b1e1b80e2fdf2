"""A latent MoE layer's routed experts and its shared experts' chain on the GPU: ``k3::experts_beside`` (the routed
experts on a second stream while the chain runs) against the same op run in turn on one stream, and each half alone.

    python benchmarks/experts_beside.py [--tp 16] [--ms 1,4,8,16] [--format mxfp4|bf16] [--json out.json]

K3's rank shapes (``benchmarks/moe_experts.py``'s: E 896, top-16, latent 3584, I 3072 / TP), hidden 7168, the shared
experts twice the routed width. Medians of CUDA-graph replays of 30 calls (``_common.graph_replay_us``), the providers
timed in interleaved passes; each output checked against the plain reference first. Latency figures (the halves' bytes are a few MB): the step-level
effect is ``benchmarks/decode_step.py``'s, with and without ``--without-passes experts_beside``
(``docs/tuning/decode_step.md``).
"""
import argparse
import os
import sys
from unittest import mock

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import graph_replay_us, interleaved_passes, medians, write_rows  # noqa: E402
from moe_experts import BETAS, make_routing, make_weights, shapes  # noqa: E402

HIDDEN = 7168


def inputs(m: int, tp: int, fmt: str, seed: int = 0):
    """(routed args as ``moe_experts`` takes them, shared args (x, w_gate, w_up, w_down)) on the GPU: the routed
    experts as ``benchmarks/moe_experts.py`` draws them, the shared experts twice their width."""
    s = shapes(tp)
    z, experts, weights = make_routing(m, s, "random", 0, seed)
    g = torch.Generator(device="cuda").manual_seed(seed)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, device="cuda") * scale).to(torch.bfloat16)

    si = 2 * s["i"]
    shared = (randn(m, HIDDEN), randn(si, HIDDEN, scale=HIDDEN ** -0.5), randn(si, HIDDEN, scale=HIDDEN ** -0.5),
              randn(HIDDEN, si, scale=si ** -0.5))
    return (z, experts, weights, *make_weights(s, fmt, seed)), shared


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=int, default=16)
    ap.add_argument("--ms", default="1,4,8,16")
    ap.add_argument("--format", choices=("mxfp4", "bf16"), default="mxfp4")
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    from k3compile.ops import side_stream
    from k3compile.ops.experts_beside import dispatch, experts_beside_op, experts_beside_ref
    from k3compile.ops.moe_experts import moe_experts
    from k3compile.testing import rel_err

    rows = []
    print(f"{'M':>4} {'routed':>8} {'shared':>8} {'in turn':>8} {'beside':>8} {'saved':>7}   (µs, TP {args.tp}, "
          f"{args.format})")
    for m in (int(x) for x in args.ms.split(",")):
        routed, shared = inputs(m, args.tp, args.format, seed=m)
        z, experts, weights, w1, w3, w2, s1, s3, s2 = routed

        def op():   # the three products' weights static, as the step's proof finds them
            return experts_beside_op(z, experts, weights, w1, w3, w2, s1, s3, s2, *BETAS, "auto", 16, *shared, *BETAS,
                                     gate_static_weight=True, up_static_weight=True, down_static_weight=True)

        def in_turn():
            with mock.patch.object(side_stream, "in_turn_reason", lambda *a: "timed in turn"):
                return op()

        ref = experts_beside_ref(*routed, *BETAS, *shared, *BETAS)
        for name, fn in (("beside", op), ("in turn", in_turn)):
            out = fn()
            torch.cuda.synchronize()
            errs = [rel_err(o, r) for o, r in zip(out, ref)]
            assert max(errs) <= 2e-2, f"M {m} {name}: relative errors {errs}"
        timers = {
            "routed": lambda: graph_replay_us(lambda: moe_experts(*routed, *BETAS), iters=30, replays=20, warmup=3),
            "shared": lambda: graph_replay_us(lambda: dispatch.shared_chain(*shared, *BETAS, "auto", 16, *(True,) * 6),
                                              iters=30, replays=20, warmup=3),
            "in turn": lambda: graph_replay_us(in_turn, iters=30, replays=20, warmup=3),
            "beside": lambda: graph_replay_us(op, iters=30, replays=20, warmup=3),
        }
        samples = interleaved_passes(timers, args.passes)
        us = medians(samples)
        rows.append(dict(m=m, tp=args.tp, format=args.format, us=us, samples=samples))
        print(f"{m:>4} {us['routed']:>8.2f} {us['shared']:>8.2f} {us['in turn']:>8.2f} {us['beside']:>8.2f} "
              f"{us['in turn'] - us['beside']:>7.2f}")
    write_rows(args.json, rows)


if __name__ == "__main__":
    main()
