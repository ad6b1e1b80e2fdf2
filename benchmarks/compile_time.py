"""Compile time of the tiny K3 decode step, with and without the k3 passes, cold and warm.

Every measurement is a new process: cold = empty Inductor cache directory, warm = a second process
on the directory a cold run just filled (it should be an FX-graph-cache hit). Each child builds the
model, prefills eagerly, then times the first compiled decode step (compile + one run) minus a
steady-state step. A separate child times pattern registration alone. Medians over ``--runs``.

    python benchmarks/compile_time.py --runs 3 --out compile_time.json
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

VARIANTS = ("torch.compile", "k3compile")


# --- child side -------------------------------------------------------------------------------

def _child_step(variant: str, config: str, passes: str) -> dict:
    import torch
    from torch._dynamo.utils import counters

    from k3compile.model import KimiK3Config, KimiK3ForConditionalGeneration

    torch.manual_seed(0)
    model = KimiK3ForConditionalGeneration(getattr(KimiK3Config, config)()).eval()
    batch, prompt = 2, 8
    ids = torch.randint(0, model.config.text_config.vocab_size, (batch, prompt))
    cache = model.allocate_cache(batch, prompt + 4)
    with torch.no_grad():
        token = model(ids, cache=cache, logits_to_keep=1).argmax(-1)     # eager prefill
        if variant == "k3compile":
            import k3compile

            k3compile.optimize(model, dynamic=False, passes=passes.split(",") if passes else None)
        else:
            model.compile(dynamic=False)
        t0 = time.perf_counter()
        token = model(token, cache=cache, logits_to_keep=1).argmax(-1)  # compiles the decode step
        first = time.perf_counter() - t0
        t0 = time.perf_counter()
        model(token, cache=cache, logits_to_keep=1)
        steady = time.perf_counter() - t0
    out = {
        "compile_s": first - steady, "step_s": steady,
        "fx_hit": counters["inductor"]["fxgraph_cache_hit"],
        "fx_miss": counters["inductor"]["fxgraph_cache_miss"],
        "aot_hit": counters["aot_autograd"]["autograd_cache_hit"],
    }
    if variant == "k3compile":
        import k3compile

        rep = k3compile.report(model)
        out.update(pass_s=rep.pass_seconds, registration_s=rep.registration_seconds,
                   matches=rep.matches, sources=[g.source for g in rep.graphs])
    return out


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

def run_child(args: list[str], cache_dir: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHINDUCTOR_", "TRITON_CACHE"))}
    env["TORCHINDUCTOR_CACHE_DIR"] = cache_dir
    proc = subprocess.run([sys.executable, __file__, "--child", *args], env=env, capture_output=True,
                          text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"child {args} failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


class Progress:
    """One status line on stderr: done/total, elapsed, an ETA from the mean so far."""

    def __init__(self, total: int):
        self.total, self.done, self.t0 = total, 0, time.perf_counter()

    def step(self, label: str) -> None:
        elapsed = time.perf_counter() - self.t0
        eta = elapsed / self.done * (self.total - self.done) if self.done else float("nan")
        bar = "#" * (20 * self.done // self.total)
        print(f"\r[{bar:<20}] {self.done}/{self.total}  {elapsed:6.0f}s elapsed, ETA {eta:5.0f}s  {label:<40}",
              end="", file=sys.stderr, flush=True)

    def advance(self) -> None:
        self.done += 1


def median(xs):
    return statistics.median(xs) if xs else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--config", default="tiny", help="KimiK3Config factory: tiny | micro")
    ap.add_argument("--passes", default="", help="comma-separated pass names (default: all)")
    ap.add_argument("--out", default="compile_time.json")
    ap.add_argument("--child", nargs="*", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child is not None:
        kind, *rest = args.child
        result = _child_register(*rest) if kind == "register" else _child_step(kind, *rest)
        print(json.dumps(result))
        return

    results = {v: {"cold": [], "warm": []} for v in VARIANTS}
    registration = []
    progress = Progress(args.runs * (2 * len(VARIANTS) + 1))
    for run in range(args.runs):
        for variant in VARIANTS:
            cache_dir = tempfile.mkdtemp(prefix="k3ct-")
            try:
                for phase in ("cold", "warm"):
                    progress.step(f"run {run + 1}: {variant} {phase}")
                    results[variant][phase].append(run_child([variant, args.config, args.passes], cache_dir))
                    progress.advance()
            finally:
                shutil.rmtree(cache_dir, ignore_errors=True)
        progress.step(f"run {run + 1}: registration")
        cache_dir = tempfile.mkdtemp(prefix="k3ct-")
        registration.append(run_child(["register", args.passes], cache_dir))
        shutil.rmtree(cache_dir, ignore_errors=True)
        progress.advance()
    progress.step("done")
    print(file=sys.stderr)

    summary = {}
    for variant in VARIANTS:
        for phase in ("cold", "warm"):
            rs = results[variant][phase]
            summary[f"{variant} {phase}"] = {
                "compile_s": median([r["compile_s"] for r in rs]),
                "pass_s": median([r.get("pass_s", 0.0) for r in rs]),
                "fx_hit": median([r["fx_hit"] for r in rs]),
            }
    base, ours = summary["torch.compile cold"]["compile_s"], summary["k3compile cold"]["compile_s"]
    reg = median([r["registration_s"] for r in registration])
    payload = {"config": args.config, "runs": args.runs, "summary": summary, "registration_s": reg,
               "registration_per_pass_s": registration[-1]["per_pass_s"], "raw": results,
               "cold_overhead": ours / base - 1}
    with open(args.out, "w") as f:
        json.dump(payload, f, indent=2)

    print(f"tiny K3 ({args.config}) decode step, {args.runs} run(s), medians")
    print(f"{'':<24}{'compile (s)':>12}{'our passes (s)':>16}{'FX cache hits':>15}")
    for name, row in summary.items():
        print(f"{name:<24}{row['compile_s']:>12.2f}{row['pass_s']:>16.3f}{row['fx_hit']:>15.0f}")
    print(f"pattern registration (all enabled passes, fresh process): {reg:.3f} s "
          f"{ {k: round(v, 3) for k, v in payload['registration_per_pass_s'].items()} }")
    print(f"cold compile with our passes vs without: {100 * payload['cold_overhead']:+.1f}%")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
