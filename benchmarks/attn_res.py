"""A Block AttnRes mix and the RMSNorm after it on the GPU, K3's width (D 7168, bf16): ``torch.compile`` of the
model's code (``model/attn_res.py`` ``attn_res`` then ``model/layers.py`` ``rms_norm``: two Inductor reductions)
against ``k3::attn_res`` (one Triton kernel, a program a token), launched plainly and with PDL.

    python benchmarks/attn_res.py [--ms 1,8,64] [--sources 2,5,9] [--json out.json] [--sweep | --add]

Medians of CUDA-graph replays of 50 calls (``_common.graph_replay_us``); each output is checked against the op's
reference first. The floor is the bytes a call must move (S source rows read, the row written, three weight vectors)
at the same run's copy ceiling: at decode sizes a few KB a call, so the figures are launch and reduction latency.
Back to back, a PDL launch overlaps the call before it: ``op pdl`` is what a chain of such calls costs a call, not
one call alone. ``--sweep`` times the kernel's launch shapes instead (sources loaded at once x warps, no PDL):
``triton.py`` ``launch_shape`` is its pick. ``--add`` times the mix with the residual add that makes its last source
(``prefix + a``): ``torch.compile`` of both, the add as a kernel of its own then ``k3::attn_res`` (what the step ran
before the ``attn_res_add`` pass, both with PDL where they have it), and ``k3::attn_res_add``.
"""
import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import copy_ceiling_tbps, graph_replay_us  # noqa: E402

D, EPS = 7168, 1e-6


def mix_and_norm(sources, proj, mix_norm, norm):
    from k3compile.model.attn_res import attn_res
    from k3compile.model.layers import rms_norm

    return rms_norm(attn_res(sources[-1], sources[:-1], proj, mix_norm, EPS), norm, EPS)


def inputs(s, m, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    sources = [torch.randn(m, 1, D, device="cuda", generator=g).bfloat16() * (1 + i) for i in range(s)]
    proj = torch.randn(1, D, device="cuda", generator=g).bfloat16()
    mix_norm, norm = (1 + 0.1 * torch.randn(2, D, device="cuda", generator=g)).bfloat16()
    return sources, proj, mix_norm, norm


def close(out, ref) -> bool:
    """Within two bf16 ulps of the row's scale (the mix is rounded to bf16 before the norm, as the model does)."""
    return bool(((out.float() - ref).abs() <= 2 ** -7 * ref.abs().amax(-1, keepdim=True) + 2 ** -8 * ref.abs()).all())


def sweep(source_counts, ms):
    from k3compile.ops.attn_res.reference import attn_res_ref
    from k3compile.ops.attn_res.triton import attn_res_triton

    shapes = [(g, w, paired) for paired in (False, True) for w in (8, 16) for g in (2, 4, 8)]
    print("µs a call; columns: sources loaded at once / warps, p: both sums of a source in one reduction")
    labels = [f"{g}/{w}" + ("p" if p else "") for g, w, p in shapes]
    print(f"{'S':>3} {'M':>4} " + " ".join(f"{label:>7}" for label in labels))
    for s in source_counts:
        for m in ms:
            sources, proj, mix_norm, norm = inputs(s, m, m * 16 + s)
            ref = attn_res_ref(sources, proj, mix_norm, EPS, norm, EPS).float()
            for g, w, p in shapes:
                out = attn_res_triton(sources, proj, mix_norm, EPS, norm, EPS, group=g, num_warps=w, paired=p)
                assert close(out, ref), f"output off at {g}/{w}{'p' if p else ''}"
            us = [graph_replay_us(lambda: attn_res_triton(sources, proj, mix_norm, EPS, norm, EPS, pdl=False, group=g,
                                                          num_warps=w, paired=p), iters=50, replays=20, warmup=3)
                  for g, w, p in shapes]
            best = min(us)
            print(f"{s:>3} {m:>4} " + " ".join(f"{u:>6.2f}{'*' if u == best else ' '}" for u in us))


def add_and_mix(prefix, a, blocks, proj, mix_norm, norm):
    partial = prefix + a
    return mix_and_norm([*blocks, partial], proj, mix_norm, norm), partial


def time_add(source_counts, ms):
    """The residual add and the mix (module doc, ``--add``): rows of µs a call, each output checked first."""
    from k3compile.ops.attn_res.reference import attn_res_add_ref
    from k3compile.ops.attn_res.triton import attn_res_add_triton, attn_res_triton

    rows = []
    print(f"{'S':>3} {'M':>5} {'torch.compile':>14} {'add + op':>9} {'attn_res_add':>13} {'saved':>6}")
    for s in source_counts:
        for m in ms:
            sources, proj, mix_norm, norm = inputs(s + 1, m, m * 16 + s)
            blocks, prefix, a = sources[:-2], sources[-2], sources[-1]
            torch._dynamo.reset()
            compiled = torch.compile(add_and_mix, dynamic=False)
            ref, ref_partial = attn_res_add_ref([*blocks, prefix], a, proj, mix_norm, EPS, norm, EPS)
            out, partial = attn_res_add_triton([*blocks, prefix], a, proj, mix_norm, EPS, norm, EPS)
            assert torch.equal(partial, ref_partial) and close(out, ref.float()), "attn_res_add off"
            c_out, c_partial = compiled(prefix, a, blocks, proj, mix_norm, norm)
            assert torch.equal(c_partial, ref_partial) and close(c_out, ref.float()), "torch.compile off"
            us = {"torch.compile": graph_replay_us(lambda: compiled(prefix, a, blocks, proj, mix_norm, norm),
                                                   iters=50, replays=20, warmup=3),
                  "add + op": graph_replay_us(lambda: attn_res_triton([*blocks, prefix + a], proj, mix_norm, EPS,
                                                                      norm, EPS), iters=50, replays=20, warmup=3),
                  "attn_res_add": graph_replay_us(lambda: attn_res_add_triton([*blocks, prefix], a, proj, mix_norm,
                                                                              EPS, norm, EPS),
                                                  iters=50, replays=20, warmup=3)}
            rows.append(dict(sources=s, m=m, d=D, us=us))
            print(f"{s:>3} {m:>5} {us['torch.compile']:>14.2f} {us['add + op']:>9.2f} {us['attn_res_add']:>13.2f} "
                  f"{us['add + op'] - us['attn_res_add']:>6.2f}")
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ms", default="1,8,64")
    ap.add_argument("--sources", default="2,5,9")
    ap.add_argument("--json", default=None)
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--add", action="store_true", help="the mix with the residual add before it (module doc)")
    args = ap.parse_args()
    if args.sweep:
        return sweep([int(x) for x in args.sources.split(",")], [int(x) for x in args.ms.split(",")])
    if args.add:
        rows = time_add([int(x) for x in args.sources.split(",")], [int(x) for x in args.ms.split(",")])
        if args.json:
            with open(args.json, "w") as f:
                json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, add_rows=rows), f,
                          indent=1)
        return None
    from k3compile.ops.attn_res.reference import attn_res_ref
    from k3compile.ops.attn_res.triton import attn_res_triton

    ceiling = copy_ceiling_tbps()
    rows = []
    print(f"copy ceiling {ceiling:.2f} TB/s")
    print(f"{'S':>3} {'M':>5} {'torch.compile':>14} {'op':>7} {'op pdl':>7} {'floor':>7} {'x compile':>10}")
    for s in (int(x) for x in args.sources.split(",")):
        for m in (int(x) for x in args.ms.split(",")):
            sources, proj, mix_norm, norm = inputs(s, m, m * 16 + s)
            torch._dynamo.reset()   # a compile a point: past Dynamo's recompile limit it would run eager
            compiled = torch.compile(mix_and_norm, dynamic=False)
            ref = attn_res_ref(sources, proj, mix_norm, EPS, norm, EPS).float()
            outs = (attn_res_triton(sources, proj, mix_norm, EPS, norm, EPS), compiled(sources, proj, mix_norm, norm))
            assert all(close(out, ref) for out in outs), "output off"
            us = {"torch.compile": graph_replay_us(lambda: compiled(sources, proj, mix_norm, norm),
                                                   iters=50, replays=20, warmup=3)}
            for name, pdl in (("op", False), ("op pdl", True)):
                us[name] = graph_replay_us(lambda: attn_res_triton(sources, proj, mix_norm, EPS, norm, EPS, pdl=pdl),
                                           iters=50, replays=20, warmup=3)
            floor = ((s + 1) * m + 3) * D * 2 / (ceiling * 1e12) * 1e6
            rows.append(dict(sources=s, m=m, d=D, us=us, floor_us=floor))
            print(f"{s:>3} {m:>5} {us['torch.compile']:>14.2f} {us['op']:>7.2f} {us['op pdl']:>7.2f} {floor:>7.2f} "
                  f"{us['torch.compile'] / us['op']:>10.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, copy_ceiling_tbps=ceiling,
                           rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
