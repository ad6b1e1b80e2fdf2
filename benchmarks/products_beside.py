"""A KDA layer's input projections on the GPU: ``k3::products_beside`` (the small products on a second stream, beside
q, k, v and the output gate) against the same op in turn on one stream, the side chain through each backend, and the
large products alone.

    python benchmarks/products_beside.py [--tp 8,16] [--ms 1,8] [--passes 3] [--json out.json]

K3's rank shapes: hidden 7168; q, k, v and the gate 12288 / TP rows each; beta 96 / TP rows; the gate's rank product
128 rows and its up-projection 12288 / TP x 128. Each form runs behind the skinny GEMM that writes its input (the KDA
layer's input comes from a kernel of ours under PDL in the step), the producer's own time taken off; medians of
CUDA-graph replays of 30 calls (``_common.graph_replay_us``), the forms timed in interleaved passes, every output
checked against the plain reference first. The step-level effect is ``benchmarks/decode_step.py``'s, with and without
``--without-passes products_beside`` (``docs/tuning/decode_step.md``).
"""
import argparse
import os
import sys
from unittest import mock

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import graph_replay_us, interleaved_passes, medians, write_rows  # noqa: E402

HIDDEN, HEADS, HEAD_DIM = 7168, 96, 128


def inputs(m: int, tp: int, seed: int = 0):
    """(producer input, producer weight, w_main, w_side, w_chain, chain_of) on the GPU, bf16."""
    g = torch.Generator(device="cuda").manual_seed(seed)

    def randn(*shape):
        return (torch.randn(*shape, generator=g, device="cuda") * shape[-1] ** -0.5).to(torch.bfloat16)

    p = HEADS * HEAD_DIM // tp
    return (randn(m, p) * p ** 0.5, randn(HIDDEN, p), [randn(p, HIDDEN) for _ in range(4)],
            [randn(HEADS // tp, HIDDEN), randn(HEAD_DIM, HIDDEN)], [randn(p, HEAD_DIM)], [1])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", default="8,16")
    ap.add_argument("--ms", default="1,8")
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    from k3compile.ops import side_stream
    from k3compile.ops.products_beside import dispatch, products_beside_op, products_beside_ref
    from k3compile.testing import rel_err

    skinny = torch.ops.k3.skinny_gemm.default
    rows = []
    forms = ("large alone", "in turn", "beside", "beside cute", "beside triton")
    print(f"{'TP':>3} {'M':>3} " + " ".join(f"{f:>13}" for f in forms) + "   (µs behind the producer)")
    for tp in (int(t) for t in args.tp.split(",")):
        for m in (int(x) for x in args.ms.split(",")):
            x_in, w_prev, w_main, w_side, w_chain, chain_of = inputs(m, tp, seed=m)
            flags = dict(main_static_weight=[True] * 4, side_static_weight=[True] * 2, chain_static_weight=[True])

            def producer():
                return skinny(x_in, w_prev, None, None, "auto", 16, True)

            def op(x):   # every weight static, as the step's proof finds them
                return products_beside_op(x, w_main, w_side, w_chain, chain_of, "auto", 16, **flags)

            def in_turn(x):
                with mock.patch.object(side_stream, "in_turn_reason", lambda *a: "timed in turn"):
                    return op(x)

            def side_on(backend):
                def run(x):
                    with mock.patch.object(dispatch, "side_backend", lambda *a: backend):
                        return op(x)
                return run

            def large(x):
                return [skinny(x, w, None, None, "auto", 16, True) for w in w_main]

            runs = {"large alone": large, "in turn": in_turn, "beside": op, "beside cute": side_on("auto"),
                    "beside triton": side_on("triton")}
            x = producer()
            ref = products_beside_ref(x, w_main, w_side, w_chain, chain_of)
            for name, fn in runs.items():
                out = fn(x)
                torch.cuda.synchronize()
                errs = [rel_err(o, r) for o, r in zip(out, ref)]
                assert max(errs) <= 2e-2, f"TP {tp} M {m} {name}: relative errors {errs}"

            def timer(fn):
                return lambda: graph_replay_us(lambda: fn(producer()), iters=30, replays=20, warmup=3)

            samples = interleaved_passes({"producer": lambda: graph_replay_us(producer, iters=30, replays=20,
                                                                              warmup=3),
                                          **{k: timer(f) for k, f in runs.items()}}, args.passes)
            med = medians(samples)
            us = {k: med[k] - med["producer"] for k in forms}
            rows.append(dict(tp=tp, m=m, us=us, producer_us=med["producer"], samples=samples))
            print(f"{tp:>3} {m:>3} " + " ".join(f"{us[f]:>13.2f}" for f in forms))
    write_rows(args.json, rows)


if __name__ == "__main__":
    main()
