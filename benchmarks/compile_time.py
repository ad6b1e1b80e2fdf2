"""Compile time of the K3 decode step: plain ``torch.compile`` against ``k3compile.optimize``, cold and warm, by depth.

Every measurement is a new process: cold = empty Inductor, Triton and CuTe caches (``TORCHINDUCTOR_CACHE_DIR``,
``TRITON_CACHE_DIR``, ``K3_CUTE_CACHE_DIR`` in a fresh directory), warm = a second process on the directories the
cold one filled. Each child builds the model, fills its cache, then times the first compiled decode step (compile,
k3 kernel builds at their first call, one run) minus a steady step, and splits that time (``split``):

- ``dynamo``: Dynamo's tracing (its ``entire_frame_compile`` less ``backend_compile``),
- ``aot``: AOTAutograd (``backend_compile`` less ``inductor_compile``, less what k3compile's build-ahead spent there),
- ``inductor``: Inductor (``inductor_compile``: lowering, code generation, Inductor's own kernel builds) less ours,
- ``passes``: our post-grad passes (``report(model).pass_seconds``),
- ``k3 kernels``: what k3 kernels added to the critical path: the build-ahead's planning and its wait for the worker
  processes once Inductor had finished (``k3compile/precompile.py``), then the k3 ops' first calls (their Triton /
  CuTe JIT builds or disk-cache loads; ``report(model).kernel_build_seconds``),
- ``other``: the rest of the first step (guards, the run itself, cudagraph-free launch overheads).

Each run's JSON also keeps ``phases``: every phase torch timed, how often it was entered and its seconds (how many
region bodies Dynamo traced rather than reused, how many kernels Inductor built, ...): where the time per extra layer
goes.

The kernel table beside it: CuTe kernels built ahead by the worker processes (and their summed build time, which ran
beside Inductor), found already built (cache hits), failed; and CuTe kernels the first step built or loaded itself.

Variants: ``torch.compile`` (``model.compile(dynamic=False)``), ``optimize-whole`` (``optimize()``'s default,
``regions=False``: one graph as long as the model; kernels built ahead where ``optimize`` does by default: a GPU with
CuTe DSL), ``optimize-whole-noprecompile`` (the same with ``precompile=False``: every kernel built at its first call),
``optimize-whole-notriton`` (the default with ``K3_PRECOMPILE_TRITON=0``: only the CuTe kernels built ahead, our ops'
Triton kernels at their first calls), ``optimize-regions`` (``regions=True``: each distinct block of the layers compiled once).

    # CPU (the 2-core machine): tiny K3, 2 and 8 layers, the passes on the references
    python benchmarks/compile_time.py --layers 2,8 --runs 1 --out compile_time.json
    # one H200: a TP = 8 rank's shapes at K3 widths (8 experts), 4 layers, with and without the build-ahead, against
    # torch.compile, cold and warm (the no-build-ahead variant cold only: its warm start is the same as with it)
    python benchmarks/compile_time.py --device cuda --layers 4 --variants \
        torch.compile,optimize-whole,optimize-whole-noprecompile --warm-variants torch.compile,optimize-whole \
        --out compile_time_h200.json
    # all 93 layers with regions (whole-graph variants of 93 layers compile for many minutes: opt in by naming them)
    python benchmarks/compile_time.py --device cuda --layers 93 --variants optimize-regions --out compile_time_93.json

``--child-timeout`` bounds each child and ``--budget`` all of them (default 520 s on cuda); a child cut short is
reported as such, and children past the budget are skipped.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
VARIANTS = ("torch.compile", "optimize-whole", "optimize-whole-noprecompile", "optimize-whole-notriton",
            "optimize-regions")
PHASES = ("cold", "warm")
SPLIT = ("dynamo", "aot", "inductor", "passes", "k3 kernels", "other")


# --- child side -------------------------------------------------------------------------------

def _group(args):
    """A process group of this process alone on the GPU (the TP rank's collectives run on it), else nothing."""
    import contextlib

    import torch

    if args.device == "cpu":
        return contextlib.nullcontext()
    sys.path.insert(0, str(HERE))
    from decode_step import world_of_one
    from tp_decode import NO_MULTICAST

    os.environ.update(NO_MULTICAST)
    return world_of_one(torch.device("cuda", torch.cuda.current_device()))


def _build(args, group_name):
    """(model, cache, token [B, 1]) for ``args``."""
    import torch

    from k3compile.model import KimiK3Config, KimiK3ForConditionalGeneration

    torch.manual_seed(0)
    if args.device == "cpu":
        model = KimiK3ForConditionalGeneration(KimiK3Config.tiny(num_hidden_layers=args.layers)).eval()
        ids = torch.randint(0, model.config.text_config.vocab_size, (args.batch, 8))
        cache = model.allocate_cache(args.batch, 8 + 4)
        with torch.no_grad():
            token = model(ids, cache=cache, logits_to_keep=1).argmax(-1)     # eager prefill
        return model, cache, token
    from decode_step import build_rank, fill_cache, vocab_slice

    from k3compile.model import TPContext

    device = torch.device("cuda", torch.cuda.current_device())
    name = group_name
    config = KimiK3Config.slice(num_hidden_layers=args.layers, num_experts=args.experts)
    model = build_rank(config, TPContext(rank=0, world=args.tp, group_name=name), torch.bfloat16, "bf16", device, 0)
    cache = model.allocate_cache(args.batch, args.context + 4, device=device)
    fill_cache(cache, args.context, 0)
    lo, hi = vocab_slice(model)
    token = torch.randint(lo, hi, (args.batch, 1), device=device)
    return model, cache, token


def _cpu_seconds() -> float:
    """CPU seconds of this process and its finished children (the C++ compiler, Inductor's workers): on a shared
    machine a compile's CPU time moves less with the other users' load than its wall time does."""
    import resource

    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def _sync():
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def child(args) -> dict:
    import torch
    from torch._dynamo.utils import calculate_time_spent, counters

    import k3compile

    with _group(args) as group_name, torch.no_grad():
        model, cache, token = _build(args, group_name)
        if args.variant == "torch.compile":
            model.compile(dynamic=False)
        else:
            if args.variant.endswith("-notriton"):   # our ops' Triton kernels left to their first calls
                os.environ["K3_PRECOMPILE_TRITON"] = "0"
            k3compile.optimize(model, backend=args.backend, dynamic=False, regions=args.variant == "optimize-regions",
                               precompile=False if args.variant.endswith("-noprecompile") else None)
        _sync()
        cpu0 = _cpu_seconds()
        t0 = time.perf_counter()
        token = model(token, cache=cache, logits_to_keep=1).argmax(-1)   # compiles the decode step
        _sync()
        first = time.perf_counter() - t0
        cpu = _cpu_seconds() - cpu0
        t0 = time.perf_counter()
        model(token, cache=cache, logits_to_keep=1)
        _sync()
        steady = time.perf_counter() - t0
    spent = calculate_time_spent()
    frame, backend, inductor = (spent.get(k, 0.0) for k in ("entire_frame_compile", "backend_compile",
                                                             "inductor_compile"))
    reuse = getattr(k3compile.regions, "_reuse_options", None)   # absent before regions reused bodies
    out = {"compile_s": first - steady, "step_s": steady, "first_cpu_s": cpu,
           "fx_hit": counters["inductor"]["fxgraph_cache_hit"], "fx_miss": counters["inductor"]["fxgraph_cache_miss"],
           "aot_hit": counters["aot_autograd"]["autograd_cache_hit"], "torch": torch.__version__,
           "phases": phases(), "region_reuse": bool(reuse and reuse())}
    passes = first_calls = plan = plan_in_pass = waited = 0.0
    if args.variant != "torch.compile":
        rep = k3compile.report(model)
        passes, first_calls = rep.pass_seconds, rep.kernel_build_seconds
        ahead = rep.precompiled
        plan, plan_in_pass = sum(r.plan_seconds for r in ahead), sum(r.plan_in_pass_seconds for r in ahead)
        waited = sum(r.waited_seconds for r in ahead)
        out.update(matches=rep.matches, sources=[g.source for g in rep.graphs], regions=rep.regions,
                   registration_s=rep.registration_seconds,   # of "passes": tracing the patterns
                   graph_regions=[g.regions for g in rep.graphs], kernel_keys=sum(
                       1 for c in rep.choices if c.first_call_seconds is not None),
                   # the first call's host time per op and implementation (their JIT builds or cache loads)
                   first_calls=_first_calls(rep.choices),
                   ahead=dict(compiled=rep.kernels_compiled, cached=rep.kernel_cache_hits,
                              failed=rep.kernel_failures, build_s=rep.kernel_compile_seconds,
                              wall_s=sum(r.wall_seconds for r in ahead), workers=max([r.workers for r in ahead] or [0]),
                              calls=sum(r.calls for r in ahead), unplanned=[u for r in ahead for u in r.unplanned],
                              why=sorted({g.precompile.why for g in rep.graphs if g.precompile is not None})))
        from k3compile.passes import _REGISTERED

        # the pattern groups this process traced (a group is traced only for a graph that calls the ops it needs)
        out["traced_groups"] = sorted({f"{name}: {state.groups[name][i].name}" for state in _REGISTERED.values()
                                       for name, i in state.done})
        try:
            from k3compile.kernels.cute.compile import STATS

            out["cute"] = dict(STATS)   # this process's own: the first step's loads and builds
        except ImportError:   # pragma: no cover - cutlass absent: the module still imports
            pass
    out["split"] = {"dynamo": frame - backend, "aot": backend - inductor - (plan - plan_in_pass) - waited,
                    "inductor": inductor - passes - plan_in_pass, "passes": passes,
                    "k3 kernels": plan + waited + first_calls, "other": first - steady - frame - first_calls}
    return out


def _first_calls(choices) -> dict:
    """{"op (impl)": [first calls, seconds]}."""
    out: dict = {}
    for c in choices:
        if c.first_call_seconds is not None:
            n, t = out.get(f"{c.op} ({c.impl})", (0, 0.0))
            out[f"{c.op} ({c.impl})"] = [n + 1, round(t + c.first_call_seconds, 3)]
    return out


def phases() -> dict:
    """{phase: [times entered, seconds]} of every phase torch times (``torch._dynamo.utils.compilation_time_metrics``:
    e.g. ``invoke_subgraph_trace``, one entry a region body Dynamo traced rather than reused; ``compile_file``, one a
    C++ kernel built; ``GraphLowering.run``, Inductor's lowering). A phase that nests in itself (the recursive graph
    passes) counts its inner entries twice."""
    from torch._dynamo.utils import compilation_time_metrics

    return {name: [len(times), round(sum(times), 3)] for name, times in sorted(compilation_time_metrics.items())}


def _child_register(passes: str) -> dict:
    import k3compile  # noqa: F401
    from k3compile.passes import K3Options, _register
    from k3compile.patterns import PASS_ORDER

    names = passes.split(",") if passes else list(PASS_ORDER)
    per_pass = {}
    for name in names:
        per_pass[name] = _register(K3Options(passes=(name,)))[1]
    return {"registration_s": sum(per_pass.values()), "per_pass_s": per_pass}


# --- parent side ------------------------------------------------------------------------------

def run_child(argv: list[str], cache_dir: str, timeout: float) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHINDUCTOR_", "TRITON_CACHE"))}
    env.update(TORCHINDUCTOR_CACHE_DIR=os.path.join(cache_dir, "inductor"),
               TRITON_CACHE_DIR=os.path.join(cache_dir, "triton"), K3_CUTE_CACHE_DIR=os.path.join(cache_dir, "cute"))
    for name in ("OMP_NUM_THREADS", "TORCHINDUCTOR_COMPILE_THREADS"):   # kept: the caller's thread limits
        if name in os.environ:
            env[name] = os.environ[name]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, __file__, "--child", *argv], env=env, capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s", "wall_s": time.perf_counter() - t0}
    if proc.returncode != 0:
        return {"error": proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"exit {proc.returncode}",
                "stderr": proc.stderr[-4000:], "wall_s": time.perf_counter() - t0}
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    out["wall_s"] = time.perf_counter() - t0
    return out


def median(xs):
    return statistics.median(xs) if xs else float("nan")


def summarize(results: dict) -> dict:
    """Medians per (layers, variant, phase) over the runs that finished."""
    summary = {}
    for (layers, variant, phase), runs in results.items():
        ok = [r for r in runs if "error" not in r]
        row = {"layers": layers, "variant": variant, "phase": phase, "runs": len(ok),
               "errors": [r["error"] for r in runs if "error" in r]}
        if ok:
            row.update(compile_s=median([r["compile_s"] for r in ok]), fx_hit=median([r["fx_hit"] for r in ok]),
                       split={k: median([r["split"][k] for r in ok]) for k in SPLIT},
                       wall_s=median([r["wall_s"] for r in ok]), regions=ok[-1].get("regions", ""),
                       kernel_keys=ok[-1].get("kernel_keys"), cute=ok[-1].get("cute"), ahead=ok[-1].get("ahead"),
                       traced_groups=ok[-1].get("traced_groups"),
                       registration_s=median([r.get("registration_s", 0.0) for r in ok]),
                       phases=ok[-1].get("phases"), graph_regions=ok[-1].get("graph_regions"),
                       first_cpu_s=median([r.get("first_cpu_s", float("nan")) for r in ok]))
        summary[f"{layers} layers, {variant}, {phase}"] = row
    return summary


def ratios(summary: dict) -> dict:
    """The issue's goals where both sides ran: cold / warm optimize over torch.compile, deep over shallow."""
    def get(layers, variant, phase):
        row = summary.get(f"{layers} layers, {variant}, {phase}", {})
        return row.get("compile_s")

    out = {}
    layers = sorted({row["layers"] for row in summary.values()})
    for n in layers:
        for phase in PHASES:
            for variant in VARIANTS[1:]:
                ours, base = get(n, variant, phase), get(n, "torch.compile", phase)
                if ours is not None and base:
                    out[f"{n} layers {phase}: {variant} / torch.compile"] = ours / base
    if len(layers) > 1:
        for variant in VARIANTS:
            deep, shallow = get(layers[-1], variant, "cold"), get(layers[0], variant, "cold")
            if deep is not None and shallow:
                out[f"{variant} cold: {layers[-1]} layers / {layers[0]} layers"] = deep / shallow
    return out


def table(summary: dict) -> str:
    head = f"{'layers':>6} {'variant':<27} {'phase':<5} {'compile s':>9} " + " ".join(f"{k:>10}" for k in SPLIT)
    lines = [head + f" {'FX hits':>7} {'k3 keys':>7}  regions"]
    for row in summary.values():
        if not row["runs"]:
            lines.append(f"{row['layers']:>6} {row['variant']:<27} {row['phase']:<5} {'-':>9}  {row['errors'][0]}")
            continue
        split = " ".join(f"{row['split'][k]:>10.1f}" for k in SPLIT)
        keys = row.get("kernel_keys")
        lines.append(f"{row['layers']:>6} {row['variant']:<27} {row['phase']:<5} {row['compile_s']:>9.1f} {split} "
                     f"{row['fx_hit']:>7.0f} {'-' if keys is None else keys:>7}  {row.get('regions') or ''}")
    return "\n".join(lines)


def kernel_table(summary: dict) -> str:
    """CuTe kernels per run: built ahead by the workers (their summed build time, their wall time), found already
    built, failed; then built and loaded by the first step itself."""
    head = (f"{'layers':>6} {'variant':<27} {'phase':<5} {'ahead':>5} {'build s':>8} {'wall s':>7} {'workers':>7} "
            f"{'hits':>5} {'failed':>6} {'1st-call built':>14} {'loaded':>6}")
    lines = [head]
    for row in summary.values():
        ahead, cute = row.get("ahead"), row.get("cute")
        if not row["runs"] or (ahead is None and cute is None):
            continue
        ahead = ahead or {}
        cute = cute or {}
        lines.append(f"{row['layers']:>6} {row['variant']:<27} {row['phase']:<5} {ahead.get('compiled', 0):>5} "
                     f"{ahead.get('build_s', 0.0):>8.1f} {ahead.get('wall_s', 0.0):>7.1f} {ahead.get('workers', 0):>7} "
                     f"{ahead.get('cached', 0):>5} {len(ahead.get('failed') or {}):>6} "
                     f"{cute.get('built', '-'):>14} {cute.get('loaded', '-'):>6}"
                     + (f"  ({'; '.join(ahead['why'])})" if ahead.get("why") and not ahead.get("compiled")
                        and not ahead.get("cached") else ""))
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--layers", default="", help="comma-separated depths (default: cpu 2,8; cuda 4)")
    ap.add_argument("--variants", default="", help=f"comma-separated of {VARIANTS} (default: all)")
    ap.add_argument("--warm-variants", default="", help="the variants whose warm start is timed too (default: all)")
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--backend", default="", help="optimize(backend=...) (default: cpu reference, cuda auto)")
    ap.add_argument("--tp", type=int, default=8, help="cuda: the TP degree whose rank-0 shapes are built")
    ap.add_argument("--experts", type=int, default=8, help="cuda: routed experts (the graph does not depend on it)")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--context", type=int, default=256, help="cuda: tokens in the cache before the step")
    ap.add_argument("--child-timeout", type=float, default=420.0, help="seconds a child may run")
    ap.add_argument("--budget", type=float, default=0.0, help="seconds all children may run (default: cuda 520, "
                                                              "cpu unbounded)")
    ap.add_argument("--registration", action="store_true", help="also time pattern registration alone")
    ap.add_argument("--out", default="compile_time.json")
    ap.add_argument("--child", nargs="*", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child is not None:
        if args.child[0] == "register":
            print(json.dumps(_child_register(*args.child[1:])))
            return
        args.variant, args.layers = args.child[0], int(args.child[1])
        args.backend = args.backend or ("reference" if args.device == "cpu" else "auto")
        print(json.dumps(child(args)))
        return

    depths = [int(x) for x in (args.layers or ("2,8" if args.device == "cpu" else "4")).split(",")]
    variants = (args.variants or ",".join(VARIANTS)).split(",")
    warm = set((args.warm_variants or ",".join(variants)).split(","))
    budget = args.budget or (520.0 if args.device == "cuda" else float("inf"))
    unknown = (set(variants) | warm) - set(VARIANTS)
    if unknown:
        raise SystemExit(f"unknown variant(s) {sorted(unknown)}; known: {VARIANTS}")
    common = ["--device", args.device, "--tp", str(args.tp), "--experts", str(args.experts), "--batch",
              str(args.batch), "--context", str(args.context)] + (["--backend", args.backend] if args.backend else [])
    results: dict = {}
    start = time.perf_counter()
    for _ in range(args.runs):
        for layers in depths:
            for variant in variants:
                cache_dir = tempfile.mkdtemp(prefix="k3ct-")
                try:
                    for phase in PHASES if variant in warm else PHASES[:1]:
                        left = budget - (time.perf_counter() - start)
                        if left < 30:
                            r = {"error": f"skipped: the {budget:.0f} s budget was spent"}
                        else:
                            r = run_child([variant, str(layers), *common], cache_dir, min(args.child_timeout, left))
                        results.setdefault((layers, variant, phase), []).append(r)
                        print(f"[{time.perf_counter() - start:6.0f} s] {layers} layers {variant} {phase}: "
                              + (f"{r['compile_s']:.1f} s" if "error" not in r else r["error"]),
                              file=sys.stderr, flush=True)
                        if "error" in r:
                            break   # a warm run needs a cold one that finished
                finally:
                    shutil.rmtree(cache_dir, ignore_errors=True)
    registration = None
    if args.registration:
        cache_dir = tempfile.mkdtemp(prefix="k3ct-")
        registration = run_child(["register", ""], cache_dir, args.child_timeout)
        shutil.rmtree(cache_dir, ignore_errors=True)

    summary = summarize(results)
    payload = {"device": args.device, "argv": sys.argv[1:], "summary": summary, "ratios": ratios(summary),
               "registration": registration,
               "raw": {f"{k[0]} layers, {k[1]}, {k[2]}": v for k, v in results.items()},
               "total_wall_s": time.perf_counter() - start}
    with open(args.out, "w") as f:
        json.dump(payload, f, indent=2)
    what = "tiny K3" if args.device == "cpu" else f"K3 slice, TP {args.tp} rank shapes, {args.experts} experts, bf16"
    print(f"{what}, decode step (batch {args.batch}), {args.runs} run(s), medians; seconds")
    print(table(summary))
    print("CuTe kernels")
    print(kernel_table(summary))
    for name, value in payload["ratios"].items():
        print(f"{name}: {value:.2f}x")
    for key, row in summary.items():
        if row.get("traced_groups"):
            print(f"pattern groups traced ({key}; {row['registration_s']:.1f} s of its passes): "
                  f"{'; '.join(row['traced_groups'])}")
    if registration and "error" not in registration:
        print(f"pattern registration (all passes, fresh process): {registration['registration_s']:.2f} s")
    print(f"wrote {args.out} ({payload['total_wall_s']:.0f} s in all)")


if __name__ == "__main__":
    main()
