"""Latent-MoE tail: fused ``k3::latent_moe_tail`` vs the unfused sequence, on one or two GPUs.

    # one GPU: RMSNorm(3584) -> up-proj 7168x3584 -> + shared, M = 1..16
    python benchmarks/moe_tail.py [--quick] [--json out.json]
    # the one-kernel Triton tail's configurations vs unfused torch.compile and the split path, per M
    python benchmarks/moe_tail.py --sweep [--m 1 4 16] [--budget 80]
    # two GPUs, NCCL, whole tail: 2 all-reduces + unfused tail vs 1 all-reduce of the concatenation + fused tail
    python benchmarks/moe_tail.py --tp 2 [--quick]

Single-GPU rows: ``fused`` is the op as the pass emits it with ``static_weight`` off (what ``compile+k3`` runs
when the pass cannot prove the weight static, as here: the tail's input is a graph input), ``fused+static``
the same op with ``static_weight=True`` (the weight streamed before the PDL wait: what the model's decode graph
runs where the pass proves it); ``cute`` / ``cute+static`` force the CuTe tail both ways.
``compile(combine)`` / ``compile+k3(combine)``: a second compiled pair (left out with ``--no-combine``) whose
latent is made inside the compiled function by the routed experts' combine,
``latent = (expert_out[M, 16, L].float() * routing_w[M, 16, None]).sum(1).to(bf16)`` (``model/moe.py``'s
``experts_gathered``; K3 routes each token to 16 experts, fp32 weights), as in the model's decode graph: there the
static-weight proof fires (the latent's producer is a kernel of the same graph), so ``compile+k3(combine)``
runs the op with ``static_weight=True``. Both columns of the pair run the same combine; their ratio is printed
against ``compile(combine)``. The headline ``compile`` / ``compile+k3`` columns are unchanged.

Method (docs/measuring.md): CUDA graphs, median; the up-projection weight rotates through enough
copies (> 640 MB) that every call streams it from HBM; a device-to-device copy measured in the same run
is the 100% line. Each row first checks its output against an fp32 reference on fresh random inputs.
Single GPU: ``--repeats`` passes (default 3) over all providers in turn, each a fresh capture; a row is the
median of its passes (one capture of the same kernels can read 0.7-1.5 µs off the others).

Bytes of one tail (the floor): weight D·L + norm weight L + latent M·L + shared M·D + out M·D, each
times the element size; the collectives are not counted in the single-GPU floor.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import socket
import sys
import time
from pathlib import Path

if "--smoke" in sys.argv:   # before triton is imported: the kernels then run in its interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from k3compile.ops.latent_moe_tail import latent_moe_tail  # noqa: E402
from k3compile.ops.latent_moe_tail import LATENT_MOE_TAIL  # noqa: E402
from k3compile.ops.latent_moe_tail.reference import kimi_rms_norm, latent_moe_tail_ref  # noqa: E402
from k3compile.ops.latent_moe_tail.split import kimi_rms_norm_triton, latent_moe_tail_split  # noqa: E402
from k3compile.ops.latent_moe_tail.triton import latent_moe_tail_triton  # noqa: E402
from k3compile.ops.latent_moe_tail.triton_config import TailConfig  # noqa: E402
from k3compile.ops.skinny_gemm import SKINNY_GEMM  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
ROTATE_BYTES = 640 * 2**20
EPS = 1e-5
# --smoke: the same code paths on CPU (gloo, wall-clock timing, tiny widths) to check the script
# itself without a GPU; its numbers mean nothing.
SMOKE = False
DEVICE = "cuda"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--m", type=int, nargs="+", default=[1, 2, 4, 8, 16], help="rows (tokens)")
    p.add_argument("--latent", type=int, default=3584, help="latent width L")
    p.add_argument("--hidden", type=int, default=7168, help="hidden width D")
    p.add_argument("--dtype", choices=list(DTYPES), default="bf16")
    p.add_argument("--tp", type=int, default=1, help="1: single GPU; 2: two processes on two GPUs with NCCL")
    p.add_argument("--sweep", action="store_true", help="time the Triton kernel's configurations")
    p.add_argument("--quick", action="store_true", help="M = 1, 16; fewer repetitions; a smaller sweep")
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile baseline")
    p.add_argument("--no-combine", action="store_true",
                   help="skip the compiled pair whose latent is made by the experts' combine in the graph")
    p.add_argument("--budget", type=float, default=75.0, help="--sweep: seconds before it stops adding configs")
    p.add_argument("--repeats", type=int, default=3,
                   help="single GPU: timing passes over all providers (each a fresh CUDA-graph capture, the "
                        "providers interleaved); each row is the median of its passes")
    p.add_argument("--json", type=str, default=None, help="write the rows here")
    p.add_argument("--smoke", action="store_true", help="run every code path on CPU at tiny widths (no GPU)")
    args = p.parse_args(argv)
    if args.smoke:
        args.latent, args.hidden, args.m = 40, 56, [1, 3]
    if args.quick:
        args.m = [1, 16]
    return args


# ---------------------------------------------------------------------------------------------
# providers: each takes (latent, shared, norm_weight, up_weight) and returns [M, D]

def tail_eager(latent, shared, norm_weight, up_weight):
    """The model's sequence: KimiRMSNorm -> Linear (no bias) -> + shared."""
    return torch.nn.functional.linear(kimi_rms_norm(latent, norm_weight, EPS), up_weight) + shared


def tail_fused(latent, shared, norm_weight, up_weight):
    """The op as the pass emits it (backend auto: what ran and why is printed under "choices")."""
    return latent_moe_tail(latent, shared, norm_weight, up_weight, EPS)


def tail_one_kernel(latent, shared, norm_weight, up_weight):
    """The one-kernel Triton tail, the configuration the op's dispatch gives it on this GPU."""
    from k3compile.backends import sm_count
    from k3compile.ops.latent_moe_tail import dispatch

    m, l = latent.shape
    cfg = dispatch.triton_config_for(latent.dtype, m, up_weight.shape[0], l, False, dispatch.table_of(latent.device),
                                     sm_count(latent.device))
    return latent_moe_tail_triton(latent, shared, norm_weight, up_weight, EPS, cfg)


def tail_split(latent, shared, norm_weight, up_weight):
    """Triton RMSNorm, then the skinny GEMM's own pick (CuTe / Triton / cuBLAS) with the shared add."""
    return latent_moe_tail_split(latent, shared, norm_weight, up_weight, EPS)


def tail_cute(latent, shared, norm_weight, up_weight):
    """The CuTe tail (skinny GEMM with the norm fused), forced: the op's auto takes it only where measured faster."""
    return latent_moe_tail(latent, shared, norm_weight, up_weight, EPS, backend="cute")


TOPK = 16   # routed experts per token in K3 (num_experts_per_token): the combine's width


def tail_eager_combine(expert_out, routing_w, shared, norm_weight, up_weight):
    """The decode graph's form: the routed experts' weighted combine (as ``model/moe.py`` writes it: fp32
    product and sum, cast back) makes the latent, then the tail."""
    latent = (expert_out.float() * routing_w[..., None]).sum(1).to(expert_out.dtype)
    return tail_eager(latent, shared, norm_weight, up_weight)


def make_expert_inputs(m, l, dtype, seed):
    """expert_out [M, TOPK, L] in ``dtype``, softmax routing weights [M, TOPK] in fp32, and the fp32 latent
    they make."""
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    expert_out = torch.randn(m, TOPK, l, generator=g, device=DEVICE).to(dtype)
    routing_w = torch.softmax(torch.randn(m, TOPK, generator=g, device=DEVICE), -1)
    return expert_out, routing_w, (expert_out.float() * routing_w[..., None]).sum(1)


def with_combine(compiled, expert_out, routing_w):
    """A provider of the usual signature that feeds ``compiled`` the experts' outputs instead of ``latent``."""
    return lambda latent, shared, norm_weight, up_weight: compiled(expert_out, routing_w, shared, norm_weight,
                                                                   up_weight)


def static_proofs(compiled) -> str:
    """What the static-weight proof found in the graphs compiled so far for ``compiled`` (k3compile.report)."""
    import k3compile

    return str(k3compile.report(compiled).static_weight.get("latent_moe_tail", "none"))


def op_takes_static_weight() -> bool:
    """Whether ``k3::latent_moe_tail`` has the ``static_weight`` argument (the static-weight pass's plumbing)."""
    return any(a.name == "static_weight" for a in torch.ops.k3.latent_moe_tail.default._schema.arguments)


def tail_fused_static(latent, shared, norm_weight, up_weight):
    """The op with ``static_weight=True``: the caller promises no kernel writes the weight (a parameter)."""
    return torch.ops.k3.latent_moe_tail(latent, shared, norm_weight, up_weight, EPS, static_weight=True)


def tail_cute_static(latent, shared, norm_weight, up_weight):
    """The CuTe tail forced, ``static_weight=True``."""
    return torch.ops.k3.latent_moe_tail(latent, shared, norm_weight, up_weight, EPS, backend="cute",
                                        static_weight=True)


def cute_tail_runs(dtype) -> bool:
    from k3compile.backends import cute_can_run_on
    from k3compile.ops.latent_moe_tail import cute as cute_tail

    lat, sh, g, (w,) = make_inputs(1, 64, 64, dtype, 1)
    why = cute_can_run_on(lat, sh, g, w) or cute_tail.supports(lat, sh, g, w, EPS)
    print(f"CuTe tail: {why or 'runs'}")
    return why is None


def tail_norm_only(latent, shared, norm_weight, up_weight):
    """The split path's first kernel alone (its cost on top of the skinny GEMM); not a tail."""
    return kimi_rms_norm_triton(latent, norm_weight, EPS)


def make_inputs(m, l, d, dtype, n_weights, seed=0):
    device = DEVICE
    g = torch.Generator(device=device).manual_seed(seed)
    latent = torch.randn(m, l, generator=g, device=device).to(dtype)
    shared = torch.randn(m, d, generator=g, device=device).to(dtype)
    norm_weight = (1 + 0.1 * torch.randn(l, generator=g, device=device)).to(dtype)
    weights = [(torch.randn(d, l, generator=g, device=device) / math.sqrt(l)).to(dtype) for _ in range(n_weights)]
    return latent, shared, norm_weight, weights


def rel_err(out, ref):
    ref = ref.double()
    if out.isnan().any():
        return float("nan")
    return ((out.double() - ref).norm() / ref.norm()).item()


def n_rotations(d, l, dtype):
    return 2 if SMOKE else max(1, math.ceil(ROTATE_BYTES / (d * l * dtype.itemsize)))


def bench(fn, rep):
    """Median ms of ``fn`` under a CUDA graph (wall clock of one call with --smoke)."""
    if SMOKE:
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    import triton.testing

    return triton.testing.do_bench_cudagraph(fn, rep=rep, return_mode="median")


def device_name():
    return "cpu (smoke)" if SMOKE else torch.cuda.get_device_name()


def synchronize():
    if not SMOKE:
        torch.cuda.synchronize()


def tail_bytes(m, l, d, dtype):
    return (d * l + l + m * l + 2 * m * d) * dtype.itemsize


def copy_ceiling_tbps(rep):
    """The 100% line: the shared same-run copy measurement (benchmarks/_common.py)."""
    if SMOKE:
        return 1.0
    from _common import copy_ceiling_tbps as measure

    return measure()


# ---------------------------------------------------------------------------------------------
def compiled_pair(fn):
    """``fn`` under plain ``torch.compile`` and under ``k3compile.optimize`` (the latent-MoE tail pass
    only), static shapes. Both share ``fn``'s code object, so the recompile limit is raised for the M
    sweep: past it Dynamo would quietly run the sweep's last sizes eagerly."""
    import k3compile

    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    return (torch.compile(fn, dynamic=False),
            k3compile.optimize(fn, passes=["latent_moe_tail"], dynamic=False))


def pass_matches(providers) -> str:
    """The latent-MoE tail matches of each graph compiled so far for ``compile+k3`` ("n/a" without it)."""
    import k3compile

    if "compile+k3" not in providers:
        return "n/a"
    return str([g.record.matches.get("latent_moe_tail") for g in k3compile.report(providers["compile+k3"]).graphs])


# one GPU

def bench_single(args):
    dtype = DTYPES[args.dtype]
    l, d = args.latent, args.hidden
    rep = 20 if args.quick else 100
    ceiling = copy_ceiling_tbps(rep)
    n_rot = n_rotations(d, l, dtype)
    print(f"device: {device_name()}  torch {torch.__version__}  copy ceiling {ceiling:.2f} TB/s  "
          f"weights rotated: {n_rot} x {d * l * dtype.itemsize / 2**20:.0f} MiB")
    providers = {"eager": tail_eager, "fused": tail_fused, "fused-1kernel": tail_one_kernel, "split": tail_split}
    static = op_takes_static_weight()
    if static:
        providers["fused+static"] = tail_fused_static
    else:
        print("k3::latent_moe_tail has no static_weight argument: the fused+static rows are left out")
    if not SMOKE and cute_tail_runs(dtype):
        providers["cute"] = tail_cute
        if static:
            providers["cute+static"] = tail_cute_static
    if not args.no_compile:
        providers["compile"], providers["compile+k3"] = compiled_pair(tail_eager)
    combine = {} if args.no_compile or args.no_combine else dict(
        zip(("compile(combine)", "compile+k3(combine)"), compiled_pair(tail_eager_combine)))

    rows = []
    for m in args.m:
        # correctness first, on fresh inputs (one weight)
        lat, sh, g, (w,) = make_inputs(m, l, d, dtype, 1, seed=1000 + m)
        ref = latent_moe_tail_ref(lat.float(), sh.float(), g.float(), w.float(), EPS)
        errs = {name: rel_err(fn(lat, sh, g, w), ref) for name, fn in providers.items()}
        providers_timed = dict(providers, **{"norm only": tail_norm_only})
        errs["norm only"] = rel_err(tail_norm_only(lat, sh, g, w), kimi_rms_norm(lat.float(), g.float(), EPS))
        if combine:
            e_out, r_w, lat32 = make_expert_inputs(m, l, dtype, seed=2000 + m)
            ref = latent_moe_tail_ref(lat32, sh.float(), g.float(), w.float(), EPS)
            errs.update({name: rel_err(with_combine(fn, e_out, r_w)(lat, sh, g, w), ref)
                         for name, fn in combine.items()})
        print(f"M={m:<3} rel err vs fp32: " + "  ".join(f"{k}={v:.2e}" for k, v in errs.items())
              + f"  k3 pass matches: {pass_matches(providers)}")
        if combine:
            print(f"      compile+k3(combine): static-weight proof {static_proofs(combine['compile+k3(combine)'])}")

        lat, sh, g, ws = make_inputs(m, l, d, dtype, n_rot, seed=m)
        if combine:
            e_out, r_w, _ = make_expert_inputs(m, l, dtype, seed=m)
            providers_timed.update({name: with_combine(fn, e_out, r_w) for name, fn in combine.items()})
        floor_us = tail_bytes(m, l, d, dtype) / (ceiling * 1e12) * 1e6
        runs = {}
        for name, fn in providers_timed.items():
            def run(fn=fn):
                for w in ws:
                    fn(lat, sh, g, w)
            run()  # compile / warm up outside the graph
            runs[name] = run
        synchronize()
        # One capture can read 0.7-1.5 µs off other captures of the same kernels (H200: the op at M = 4 16.30 µs
        # against 15.58 / 15.59 in the next two passes; `compile+k3`, which runs exactly the op, 16.9 against the
        # op's 15.4 in an earlier run): passes over all providers in turn, each row the median of its captures.
        # The passes share the time one long capture took.
        from _common import interleaved_passes

        rep_pass = max(10, rep // max(1, args.repeats))
        samples = interleaved_passes({name: (lambda run=run: bench(run, rep_pass) * 1e3 / n_rot)
                                      for name, run in runs.items()}, args.repeats)
        times = {name: sorted(us)[len(us) // 2] for name, us in samples.items()}
        for name, us in times.items():
            # the combine pair against its own compile column (its floor leaves out the experts' outputs)
            base = "compile(combine)" if name in combine else "compile"
            rows.append(dict(mode="tp1", m=m, l=l, d=d, dtype=args.dtype, provider=name, us=us,
                             us_passes=samples[name], pct_ceiling=100 * floor_us / us, rel_err=errs[name],
                             speedup_vs_eager=times["eager"] / us,
                             speedup_vs_compile=times[base] / us if base in times else None))
    print_table(rows)
    if combine:
        print("(combine) rows: latent made by the experts' combine inside the compiled graph; their x compile is "
              "against compile(combine)")
    print("choices:", [(c.impl, c.reason) for c in LATENT_MOE_TAIL.choices()])
    print("skinny_gemm choices:", [(c.key[2] if isinstance(c.key, tuple) else c.key, c.impl, c.reason)
                                   for c in SKINNY_GEMM.choices()])
    return rows, dict(copy_ceiling_tbps=ceiling, rotations=n_rot)


def sweep_configs(quick):
    """The fused kernel's configurations, likeliest first (the sweep stops at its time budget).

    First the split-K grid with all tiles by TMA and PDL (early trigger; H200, M=16: n32-k128-s1-w2-st5
    15.7 µs, w2-st4 16.2, k256-w4-st3 16.4, n64-w4-st4 16.8, w4-st4 17.3, s2-w2-st4 23.2),
    then stream-K (persistent, one wave): one launch with PDL, then the two-launch forms of the second
    H200 sweep, then the split-K grid's best from the first (n128-k128-s4-w8-st4-last-swap: 19.3 / 19.6 /
    20.4 µs at M = 1 / 4 / 16)."""
    C = TailConfig

    def sk(ctas, bn, bk, nw, ns, tma=False, reduce="kernel", pdl=False, pdl_tiles=1):
        return C(block_n=bn, block_k=bk, num_warps=nw, num_stages=ns, stream_k=True, ctas_per_sm=ctas, tma=tma,
                 reduce=reduce,
                 pdl=pdl, pdl_tiles=pdl_tiles)

    def grid(bn, bk, split, nw=2, ns=5, early=True):   # split-K grid, all tiles by TMA, PDL
        return C(block_n=bn, block_k=bk, split_k=split, num_warps=nw, num_stages=ns, tma=True, pdl=True,
                 early_trigger=early)

    cfgs = [
        grid(32, 128, 1), grid(32, 128, 1, ns=4), grid(32, 256, 1, 4, 3), grid(64, 128, 1, 4, 4),
        grid(32, 128, 1, 4, 4), grid(32, 128, 2, ns=4),
        sk(1, 128, 128, 8, 4, True, "last", True), sk(1, 128, 128, 8, 4, True, "last", True, 3),
        sk(1, 128, 128, 8, 4, True, "last"), sk(1, 128, 128, 8, 4, True, "kernel", True),
        sk(1, 128, 128, 8, 4), sk(1, 128, 128, 8, 4, True), sk(2, 128, 64, 4, 5), sk(2, 128, 64, 4, 5, True),
        sk(1, 128, 128, 8, 5, True), sk(2, 64, 128, 4, 4, True), sk(1, 128, 128, 8, 5), sk(2, 64, 128, 4, 4),
        sk(1, 128, 256, 8, 3, True), sk(1, 256, 64, 8, 4, True), C(block_n=128, block_k=128, split_k=4, num_warps=8, num_stages=4, swap_ab=True),
        sk(2, 64, 64, 4, 8, True), sk(1, 128, 64, 8, 8, True), sk(1, 128, 128, 8, 6, True), sk(3, 64, 64, 4, 6, True),
        sk(1, 128, 128, 4, 4, True), sk(2, 128, 64, 8, 5, True), sk(1, 128, 256, 8, 3), sk(1, 256, 64, 8, 4),
        sk(4, 64, 64, 4, 4, True), sk(2, 64, 64, 4, 8), sk(1, 128, 64, 8, 8),
    ]
    return cfgs[:8] if quick else cfgs


def check_graph_replay(cfg, m, l, d, dtype, replays=3):
    """The fused kernel captured once in a CUDA graph, replayed on fresh inputs: each replay must match
    the reference (the arrival counters of reduce="last" must be back at 0 after every launch)."""
    lat, sh, g, (w,) = make_inputs(m, l, d, dtype, 1, seed=77)
    out = torch.empty(m, d, dtype=dtype, device=DEVICE)
    latent_moe_tail_triton(lat, sh, g, w, EPS, cfg, out=out)   # counters made outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        latent_moe_tail_triton(lat, sh, g, w, EPS, cfg, out=out)
    worst = 0.0
    for r in range(replays):
        lat2, sh2, _, _ = make_inputs(m, l, d, dtype, 1, seed=78 + r)
        lat.copy_(lat2)
        sh.copy_(sh2)
        out.fill_(float("nan"))
        graph.replay()
        worst = max(worst, rel_err(out, latent_moe_tail_ref(lat.float(), sh.float(), g.float(), w.float(), EPS)))
    return worst


def bench_sweep(args):
    """Every configuration of the fused kernel at each M, against unfused torch.compile and the op's
    split path (Triton norm + the skinny GEMM's pick); rows sorted per M, best first. Stops adding
    configurations when ``--budget`` seconds have passed (the baselines always run)."""
    dtype = DTYPES[args.dtype]
    l, d = args.latent, args.hidden
    rep = 20 if args.quick else 50
    t_start = time.time()
    ceiling = copy_ceiling_tbps(rep)
    n_rot = n_rotations(d, l, dtype)
    print(f"device: {device_name()}  torch {torch.__version__}  copy ceiling {ceiling:.2f} TB/s  "
          f"weights rotated: {n_rot}")
    baselines = {"split": tail_split}
    if not args.no_compile:
        baselines["compile"] = torch.compile(tail_eager, dynamic=False)
    inputs = {m: make_inputs(m, l, d, dtype, n_rot, seed=m) for m in args.m}
    refs = {m: latent_moe_tail_ref(*(t.float() for t in inputs[m][:3]), inputs[m][3][0].float(), EPS)
            for m in args.m}
    floors = {m: tail_bytes(m, l, d, dtype) / (ceiling * 1e12) * 1e6 for m in args.m}
    rows = []

    def measure(m, name, fn, config=None):
        lat, sh, g, ws = inputs[m]
        err = rel_err(fn(lat, sh, g, ws[0]), refs[m])

        def run():
            for w in ws:
                fn(lat, sh, g, w)
        run()
        synchronize()
        us = bench(run, rep) * 1e3 / n_rot
        row = dict(mode="sweep", m=m, l=l, d=d, dtype=args.dtype, provider=name, us=us,
                   pct_ceiling=100 * floors[m] / us, rel_err=err, config=config)
        rows.append(row)
        return row

    for m in args.m:
        for name, fn in baselines.items():
            r = measure(m, name, fn)
            print(f"  M{m} {name}: {r['us']:.2f} us ({r['rel_err']:.0e})", flush=True)
    for cfg in sweep_configs(args.quick):
        if time.time() - t_start > args.budget:
            print(f"budget of {args.budget:.0f} s reached: remaining configurations skipped")
            break
        line = []
        for m in args.m:
            try:
                r = measure(m, "fused:" + cfg.tag(), lambda lat, sh, g, w, cfg=cfg: latent_moe_tail_triton(
                    lat, sh, g, w, EPS, cfg), config=cfg.__dict__)
                line.append(f"M{m} {r['us']:.2f} us ({r['rel_err']:.0e})")
            except Exception as e:   # a configuration that does not compile (shared memory) is skipped
                line.append(f"M{m} {type(e).__name__}: {str(e)[:160]}")
                break
        print(f"  {cfg.tag():<32} " + "  ".join(line), flush=True)

    extra = {}
    fused = [r for r in rows if r["provider"].startswith("fused:") and r["rel_err"] < 2e-2]
    if fused and not SMOKE:
        # the fastest configuration, and the fastest with arrival counters (they must reset themselves)
        last = [r for r in fused if not r["config"]["stream_k"] and r["config"]["reduce"] == "last"
                and r["config"]["split_k"] > 1]
        picks = {r["provider"]: TailConfig(**r["config"]) for r in
                 [min(fused, key=lambda r: r["us"])] + ([min(last, key=lambda r: r["us"])] if last else [])}
        for name, cfg in picks.items():
            try:
                errs = {m: check_graph_replay(cfg, m, l, d, dtype) for m in args.m}
                extra[f"graph_replay_rel_err {cfg.tag()}"] = errs
                print(f"CUDA graph replays of {cfg.tag()}: rel err {errs}")
            except Exception as e:
                print(f"CUDA graph replay of {cfg.tag()} failed: {type(e).__name__}: {str(e)[:300]}")
    best_bf16 = min(fused, key=lambda r: r["us"]) if fused else None
    if best_bf16 is not None and dtype == torch.bfloat16 and time.time() - t_start < args.budget + 15:
        # fp16 runs PRENORM (each program first reads the whole latent row): is it still ahead of split?
        cfg16 = TailConfig(**dict(best_bf16["config"], prenorm=True))
        for m in args.m:
            lat, sh, g, ws = inputs[m]
            inputs[m] = (lat.half(), sh.half(), g.half(), [w.half() for w in ws])
            for name, fn in (("fp16 split", baselines["split"]),
                             ("fp16 fused:" + cfg16.tag(), lambda lat, sh, g, w: latent_moe_tail_triton(
                                 lat, sh, g, w, EPS, cfg16))):
                r = measure(m, name, fn, config=cfg16.__dict__ if "fused" in name else None)
                print(f"  M{m} {name}: {r['us']:.2f} us ({r['rel_err']:.0e})", flush=True)
            inputs[m] = None
    for other in ("fp16", "fp32"):   # correctness only, default configuration (fp16: PRENORM)
        dt = DTYPES[other]
        lat, sh, g, (w,) = make_inputs(4, l, d, dt, 1, seed=5)
        try:
            extra[f"rel_err_{other}_M4"] = rel_err(
                latent_moe_tail_triton(lat, sh, g, w, EPS),
                latent_moe_tail_ref(lat.float(), sh.float(), g.float(), w.float(), EPS))
        except Exception as e:
            print(f"{other} default config: {type(e).__name__}: {str(e)[:300]}")
    print("other dtypes, default config, M=4: " + "  ".join(f"{k}={v:.1e}" for k, v in extra.items()
                                                             if k.startswith("rel_err")))

    print(f"{'M':>3} {'provider':<44} {'us':>7} {'% ceil':>7} {'x compile':>9} {'x split':>8} {'rel err':>8}")
    for m in args.m:
        per_m = sorted((r for r in rows if r["m"] == m and not r["provider"].startswith("fp16")), key=lambda r: r["us"])
        base = {r["provider"]: r["us"] for r in per_m}
        for r in per_m:
            r["speedup_vs_compile"] = base["compile"] / r["us"] if "compile" in base else None
            r["speedup_vs_split"] = base["split"] / r["us"]
        shown = [r for r in per_m if not r["provider"].startswith("fused:")] + \
                [r for r in per_m if r["provider"].startswith("fused:")][:8]
        for r in sorted(shown, key=lambda r: r["us"]):
            xc = r["speedup_vs_compile"]
            print(f"{m:>3} {r['provider']:<44} {r['us']:>7.2f} {r['pct_ceiling']:>7.1f} "
                  f"{xc if xc is not None else float('nan'):>9.2f} {r['speedup_vs_split']:>8.2f} {r['rel_err']:>8.1e}")
    n_cfg = len({r["provider"] for r in rows if r["provider"].startswith("fused:")})
    print(f"{n_cfg} configurations in {time.time() - t_start:.0f} s")
    return rows, dict(copy_ceiling_tbps=ceiling, rotations=n_rot, **extra)


def print_table(rows):
    print(f"{'mode':<5} {'M':>3} {'provider':<19} {'us':>8} {'% ceil':>7} {'x eager':>8} {'x compile':>9} {'rel err':>9}")
    for r in rows:
        xc = r.get("speedup_vs_compile")
        xe = r.get("speedup_vs_eager")
        print(f"{r['mode']:<5} {r['m']:>3} {r['provider']:<19} {r['us']:>8.1f} "
              f"{r['pct_ceiling'] if r.get('pct_ceiling') is not None else float('nan'):>7.1f} "
              f"{xe if xe is not None else float('nan'):>8.2f} {xc if xc is not None else float('nan'):>9.2f} "
              f"{r['rel_err']:>9.1e}")


# ---------------------------------------------------------------------------------------------
# two GPUs: the whole tail with its collectives

def time_graph_collective(fn, iters, replays):
    """Median µs of ``fn`` captured ``iters`` times in one CUDA graph, replayed ``replays`` times.

    Every rank replays the same fixed count (``do_bench_cudagraph`` picks its count per process,
    which would let the ranks' collectives fall out of step). Returns the slowest rank's median.
    """
    if SMOKE:
        fn()
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e6
    from _common import graph_replay_us

    return graph_replay_us(fn, iters=iters, replays=replays, warmup=3)


def tp_worker(rank, world, port, args, result_path):
    import torch.distributed as dist

    global SMOKE, DEVICE
    SMOKE, DEVICE = args.smoke, "cpu" if args.smoke else "cuda"
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), NCCL_NVLS_ENABLE="0")
    if SMOKE:
        dist.init_process_group("gloo", rank=rank, world_size=world)
    else:
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", rank))
    dtype = DTYPES[args.dtype]
    l, d = args.latent, args.hidden
    n_rot = n_rotations(d, l, dtype)
    graph_reps, replays = (1, 20) if args.quick else (2, 50)   # a graph holds graph_reps x n_rot tails
    say = print if rank == 0 else (lambda *a, **k: None)
    comm = "gloo" if SMOKE else f"NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}, NCCL_NVLS_ENABLE=0"
    say(f"TP={world}, {comm}, {device_name()}, weights rotated: {n_rot}")

    def two_allreduces(lat, sh):
        lat, sh = lat.clone(), sh.clone()   # as Inductor lowers a functional all_reduce
        dist.all_reduce(lat)
        dist.all_reduce(sh)
        return lat, sh

    def one_allreduce(lat, sh):
        buf = torch.cat([lat, sh], dim=1)
        dist.all_reduce(buf)
        return buf.split([l, d], dim=1)

    group_name = dist.group.WORLD.group_name

    def model_tail(lat, sh, g, w):
        """The tail as the model writes it under TP (functional collectives), for torch.compile."""
        from torch.distributed import _functional_collectives as funcol
        lat = funcol.all_reduce(lat, "sum", group_name)
        sh = funcol.all_reduce(sh, "sum", group_name)
        return tail_eager(lat, sh, g, w)

    variants = {
        "2AR": lambda lat, sh, g, w: two_allreduces(lat, sh),
        "1AR(cat)": lambda lat, sh, g, w: one_allreduce(lat, sh),
        "2AR+eager": lambda lat, sh, g, w: tail_eager(*two_allreduces(lat, sh), g, w),
        "1AR+fused": lambda lat, sh, g, w: tail_fused(*one_allreduce(lat, sh), g, w),
    }
    if not args.no_compile:
        variants["compile"], variants["compile+k3"] = compiled_pair(model_tail)

    rows = []
    for m in args.m:
        # correctness: each rank holds different partials; the reference sums them in fp32
        lat, sh, g, (w,) = make_inputs(m, l, d, dtype, 1, seed=100 * m + rank)
        g.copy_(make_inputs(m, l, d, dtype, 1, seed=7)[2])      # replicated weights
        w.copy_(make_inputs(m, l, d, dtype, 1, seed=7)[3][0])
        lat32, sh32 = lat.float(), sh.float()
        dist.all_reduce(lat32)
        dist.all_reduce(sh32)
        ref = latent_moe_tail_ref(lat32, sh32, g.float(), w.float(), EPS)
        errs = {}
        for name in ("2AR+eager", "1AR+fused", "compile", "compile+k3"):
            if name in variants:
                try:
                    errs[name] = rel_err(variants[name](lat, sh, g, w), ref)
                except Exception as e:   # deterministic, so every rank drops the same variant
                    say(f"{name} failed: {type(e).__name__}: {str(e)[:300]}")
                    variants.pop(name)
        say(f"M={m:<3} rel err vs fp32 (rank 0): " + "  ".join(f"{k}={v:.2e}" for k, v in errs.items())
            + f"  k3 pass matches: {pass_matches(variants)}")

        lat, sh, g, ws = make_inputs(m, l, d, dtype, n_rot, seed=m)
        times = {}
        for name, fn in variants.items():
            def run(fn=fn):
                for w in ws:
                    fn(lat, sh, g, w)
            times[name] = time_graph_collective(run, iters=graph_reps, replays=replays) / n_rot
        for name, us in times.items():
            base = "compile" if "compile" in times else "2AR+eager"
            rows.append(dict(mode=f"tp{world}", m=m, l=l, d=d, dtype=args.dtype, provider=name, us=us,
                             pct_ceiling=None, rel_err=errs.get(name, float("nan")),
                             speedup_vs_eager=times["2AR+eager"] / us, speedup_vs_compile=times[base] / us))
    if rank == 0:
        print_table(rows)
        print("choices:", [(c.impl, c.reason) for c in LATENT_MOE_TAIL.choices()])
        Path(result_path).write_text(json.dumps(rows))
    dist.barrier()
    dist.destroy_process_group()


def bench_tp(args):
    import tempfile

    import torch.multiprocessing as mp

    if not args.smoke and torch.cuda.device_count() < args.tp:
        raise SystemExit(f"--tp {args.tp} needs {args.tp} GPUs, found {torch.cuda.device_count()}")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    result = Path(tempfile.mkdtemp()) / "tp_rows.json"
    mp.spawn(tp_worker, args=(args.tp, port, args, str(result)), nprocs=args.tp, join=True)
    return json.loads(result.read_text()), dict(nccl_nvls_enable=0)


def main(argv=None):
    global SMOKE, DEVICE
    args = parse_args(argv)
    SMOKE, DEVICE = args.smoke, "cpu" if args.smoke else "cuda"
    if not SMOKE and not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU (or --smoke)")
    t0 = time.time()
    if args.tp > 1:
        rows, meta = bench_tp(args)
    elif args.sweep:
        rows, meta = bench_sweep(args)
    else:
        rows, meta = bench_single(args)
    meta.update(device=device_name(), torch=torch.__version__, argv=sys.argv[1:],
                seconds=time.time() - t0)
    if args.json:
        Path(args.json).write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
        print("wrote", args.json)


if __name__ == "__main__":
    main()
