"""Routed experts: ``k3::moe_experts`` (Triton) against torch.compile of the model's own expert code and the floor.

    python benchmarks/moe_experts.py [--m 1 2 4 8 16 64 256] [--tp 8 16] [--formats bf16 mxfp4]
        [--routing random skewed] [--compile-m 1 8 256] [--autotune-m 1 8] [--sweep-m 1 8 16]
        [--json out.json] [--svg out.svg] [--table out_table.json]
    python benchmarks/moe_experts.py --smoke      # every code path on the CPU (interpreter, tiny widths)

K3 rank shapes (one tensor-parallel rank on one GPU): E 896 experts, top-16, latent L 3584, intermediate I 384
(TP=8) or 192 (TP=16); bf16 weights, or packed MXFP4 (E2M1 codes + one E8M0 scale per 32 inputs).

Routing: sigmoid router scores of random logits, top-16, renormalised (``model/moe.py`` ``route``); ``skewed``:
+4 on the logits of a hot set of 32 experts (a different set in each virtual layer), so tokens share experts.

Providers (each row checked first against the fp32 reference on fresh inputs, the output NaN-poisoned):
- ``k3``: the op through its dispatch (MXFP4 at M <= 16: the CuTe kernels; else the Triton decode kernels to M 16,
  the sorted form above); ``k3-triton``: the Triton kernels where the op runs the CuTe ones;
- ``k3:<tag>`` (``--sweep-m``): the Triton kernels with one configuration each (``tune`` picks);
- ``compile``: ``torch.compile`` (default mode, static shapes) of the model's code: ``experts_gathered`` where
  M·16 <= 896, else ``experts_dense``, as ``KimiLatentMoE`` picks; for MXFP4 a stand-in until the model holds
  packed experts (issue #23): the selected experts dequantised (``reference.dequantize_mxfp4``), then the gathered
  math (gathered Ms only: the dense form would dequantise all 896 experts);
- ``max-autotune``: the same under ``mode="max-autotune-no-cudagraphs"`` (``--autotune-m``: seconds of compile
  per shape);
- ``dense``: the op's cuBLAS fallback (``dispatch.moe_experts_dense``, every token through every expert), M >= 64.

Floor: the bytes of the distinct experts actually selected (counted from each routing; bf16: 3·I·L·2 per expert,
MXFP4: 3·I·L·(1/2 + 1/32)) plus z, the output, the ids and the router weights, at the copy ceiling measured in
the same run (benchmarks/_common.py). Timing (docs/anchors.md): CUDA graphs, median of ``--repeats`` interleaved
passes; every call streams its experts from HBM: one set of weights, ``virtual layers`` of different routings
(enough that a call's experts were last read > 400 MB of traffic ago) run in turn in each replay.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

if "--smoke" in sys.argv:   # before triton is imported: the kernels then run in its interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from k3compile.model.moe import experts_dense, experts_gathered  # noqa: E402
from k3compile.ops.moe_experts import MOE_EXPERTS, moe_experts  # noqa: E402
from k3compile.ops.moe_experts.dispatch import moe_experts_dense  # noqa: E402
from k3compile.ops.moe_experts.reference import dequantize_mxfp4, moe_experts_ref  # noqa: E402
from k3compile.ops.moe_experts.triton import (  # noqa: E402
    MoeConfig, default_config, moe_experts_triton, tuned_config,
)

E, TOP_K, LATENT, FULL_I = 896, 16, 3584, 3072
BETAS = (4.0, 25.0)                      # K3's activation_situ_beta, activation_situ_linear_beta
HOT = 32                                 # skewed routing: the hot set's size
ROTATE_BYTES = 400 * 2**20
SMOKE = "--smoke" in sys.argv
DEVICE = "cpu" if SMOKE else "cuda"

# The configurations --sweep-m times (tune picks among them; docs/tuning/moe_experts.md, run 3, predicts each).
# bf16: the defaults (run 2: 42.9 / 436.8 us at M = 1 / 16), then PDL's early trigger (the down kernel's programs
# resident and preloading w2 while gate/up streams), fatter or thinner down programs, the weight rows form (weights
# as the products' rows: wgmma, every K-loop load pipelined), and the down product with the combine in one kernel
# (a program per token and column tile streaming its A experts in one pipelined loop: no partials, no third launch).
_EARLY = dict(trigger_early=True)
_ROWS = dict(weight_rows=True, trigger_early=True)
_TOKEN = dict(down_by_token=True, trigger_early=True, block_n=16, stages_down=8)
SWEEP = [MoeConfig(), MoeConfig(**_EARLY), MoeConfig(block_n=128, warps_down=8, **_EARLY),
         MoeConfig(block_n=32, **_EARLY), MoeConfig(**_ROWS), MoeConfig(block_i=16, **_ROWS), MoeConfig(**_TOKEN),
         MoeConfig(**dict(_TOKEN, block_n=32, stages_down=6)), MoeConfig(weight_rows=True, **_TOKEN)]
# MXFP4 (bf16 z): the table's pick (halves + byte lookup, run 2: 106.6 / 898.0 us with the in-kernel combine since
# removed), tl.dot_scaled (never timed; its scale bytes now load as words), and the weight rows form with the
# bit-move conversion (E2M1_BF16_BITS): R = 2·block_i rows of w1/w3 and block_n rows of w2 a wgmma tile
_ASM = dict(mxfp4_halves=True, mxfp4_asm=True)
_MXROWS = dict(weight_rows=True, mxfp4_asm=True, trigger_early=True, block_l=256, stages_up=3, block_n=128)
SWEEP_MXFP4 = [MoeConfig(**_ASM), MoeConfig(mxfp4_dot_scaled=True, **_EARLY), MoeConfig(**_MXROWS),
               MoeConfig(stages_down=4, **dict(_MXROWS, stages_up=4)), MoeConfig(block_i=64, warps_up=8, **_MXROWS),
               MoeConfig(block_i=16, warps_up=2, **dict(_MXROWS, stages_up=4))]
# --kernels-m: each kernel of the default configuration alone (its buffers uninitialised: timing only); MXFP4 also
# the weight rows form's two kernels (the sweep's third MXFP4 configuration: compiled once for both)
KERNELS = {"k3[gate_up]": ("gate_up", None), "k3[down]": ("down", None), "k3[combine]": ("combine", None)}
KERNELS_MXFP4 = {"k3[gate_up-rows]": ("gate_up", _MXROWS), "k3[down-rows]": ("down", _MXROWS)}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--m", type=int, nargs="+", default=[1, 2, 4, 8, 16, 64, 256], help="tokens")
    p.add_argument("--tp", type=int, nargs="+", default=[8, 16], help="tensor-parallel size: I = 3072 / tp")
    p.add_argument("--formats", nargs="+", default=["bf16", "mxfp4"], choices=["bf16", "mxfp4"])
    p.add_argument("--routing", nargs="+", default=["random"], choices=["random", "skewed"])
    p.add_argument("--skewed-m", type=int, nargs="*", default=[8], help="Ms that also get the skewed routing")
    p.add_argument("--compile-m", type=int, nargs="*", default=None,
                   help="Ms with the torch.compile anchor (default: every M; MXFP4 gathered Ms only)")
    p.add_argument("--autotune-m", type=int, nargs="*", default=[], help="Ms with max-autotune (bf16, TP 8)")
    p.add_argument("--sweep-m", type=int, nargs="*", default=[], help="Ms at which the SWEEP configurations run")
    p.add_argument("--kernels-m", type=int, nargs="*", default=[], help="Ms at which each kernel is timed alone")
    p.add_argument("--autotune-budget", type=float, default=45.0,
                   help="seconds one max-autotune compile may take (per M); past it the provider is skipped")
    p.add_argument("--prewarm", type=int, default=8,
                   help="processes that compile the swept configurations in parallel before timing (0: none)")
    p.add_argument("--repeats", type=int, default=3, help="interleaved timing passes; a row is their median")
    p.add_argument("--replays", type=int, default=20, help="graph replays per pass")
    p.add_argument("--json", default=None)
    p.add_argument("--svg", default=None, help="the plot: %% of the floor per M, one panel per TP x format")
    p.add_argument("--table", default=None, help="write the measured picks (tables/h200.json's format) here")
    p.add_argument("--smoke", action="store_true", help="every code path on the CPU at tiny widths (no GPU)")
    args = p.parse_args(argv)
    if args.smoke:
        args.m, args.tp, args.sweep_m, args.autotune_m, args.replays, args.repeats = [1, 3, 9], [8], [1], [], 1, 1
        args.compile_m, args.kernels_m = [3], [3]
    return args


# ---------------------------------------------------------------------------------------------
# inputs

def shapes(tp: int) -> dict:
    if SMOKE:
        return dict(e=12, a=4, l=64, i=32)
    return dict(e=E, a=TOP_K, l=LATENT, i=FULL_I // tp)


def expert_bytes(s: dict, fmt: str) -> float:
    per = 2.0 if fmt == "bf16" else 0.5 + 1 / 32
    return 3 * s["i"] * s["l"] * per


def make_weights(s: dict, fmt: str, seed: int = 0):
    """(w1, w3, w2, w1_scale, w3_scale, w2_scale) on the device; products O(1)."""
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    e, i, l = s["e"], s["i"], s["l"]
    if fmt == "bf16":
        def w(rows, cols):
            return (torch.randn(e, rows, cols, generator=g, device=DEVICE) / cols ** 0.5).to(torch.bfloat16)
        return w(i, l), w(i, l), w(l, i), None, None, None

    def codes(rows, cols):
        return torch.randint(0, 256, (e, rows, cols // 2), generator=g, device=DEVICE, dtype=torch.uint8)

    def scale(rows, cols):
        center = 127 - round(math.log2(2.2 * cols ** 0.5))
        return torch.randint(center - 2, center + 3, (e, rows, cols // 32), generator=g, device=DEVICE,
                             dtype=torch.uint8)

    return codes(i, l), codes(i, l), codes(l, i), scale(i, l), scale(i, l), scale(l, i)


def make_routing(m: int, s: dict, routing: str, layer: int, seed: int):
    """z [M, L] bf16, experts [M, 16] int64, weights [M, 16] fp32 from random router logits (module doc)."""
    g = torch.Generator(device=DEVICE).manual_seed(seed * 1000 + layer)
    logits = torch.randn(m, s["e"], generator=g, device=DEVICE)
    if routing == "skewed":
        hot = (torch.arange(HOT, device=DEVICE) * 7 + layer * HOT) % s["e"]
        logits[:, hot] += 4.0
    scores = torch.sigmoid(logits)
    _, experts = torch.topk(scores, s["a"], dim=-1)
    weights = scores.gather(-1, experts)
    weights = weights / weights.sum(-1, keepdim=True)
    z = torch.randn(m, s["l"], generator=g, device=DEVICE).to(torch.bfloat16)
    return z, experts, weights


# ---------------------------------------------------------------------------------------------
# providers: each is (z, experts, weights, w1, w3, w2, s1, s3, s2) -> [M, L]

def k3_op(z, experts, weights, w1, w3, w2, s1, s3, s2):
    return moe_experts(z, experts, weights, w1, w3, w2, s1, s3, s2, *BETAS)


def k3_triton(z, experts, weights, w1, w3, w2, s1, s3, s2):
    return moe_experts(z, experts, weights, w1, w3, w2, s1, s3, s2, *BETAS, backend="triton")


def k3_cute_kernel(only: str):
    def run(z, experts, weights, w1, w3, w2, s1, s3, s2):
        from k3compile.ops.moe_experts.cute import moe_experts_cute

        return moe_experts_cute(z, experts, weights, w1, w3, w2, s1, s3, s2, *BETAS, only=only)
    return run


def k3_config(config: MoeConfig):
    def run(z, experts, weights, w1, w3, w2, s1, s3, s2, out=None):
        return moe_experts_triton(z, experts, weights, w1, w3, w2, s1, s3, s2, *BETAS, config=config, out=out)
    return run


def k3_kernel(only: str, overrides):
    def run(z, experts, weights, w1, w3, w2, s1, s3, s2):
        from k3compile.ops.moe_experts.config import table

        base = tuned_config(table(z.device), z.shape[0], z.dtype, s1 is not None, w1.shape[1], z.shape[1]) or \
            default_config(z.shape[0], z.dtype, s1 is not None, z.is_cuda)
        config = dataclasses.replace(base, **(overrides or {}))
        return moe_experts_triton(z, experts, weights, w1, w3, w2, s1, s3, s2, *BETAS, config=config, only=only)
    return run


def model_float(z, experts, weights, w1, w3, w2, s1, s3, s2):
    """The model's own code, as ``KimiLatentMoE.routed_latent`` picks the form."""
    run = experts_gathered if z.shape[0] * experts.shape[1] <= w1.shape[0] else experts_dense
    return run(z, experts, weights, w1, w3, w2, *BETAS)


def model_mxfp4_standin(z, experts, weights, w1, w3, w2, s1, s3, s2):
    """Stand-in for the packed model's gathered form (issue #23): the selected experts dequantised, then the math."""
    def deq(codes, scale):
        return dequantize_mxfp4(codes[experts], scale[experts], z.dtype)            # [M, A, rows, cols]
    zc = z[:, None, :, None]
    gate = (deq(w1, s1) @ zc).squeeze(-1)
    up = (deq(w3, s3) @ zc).squeeze(-1)
    from k3compile.model.layers import situ_glu
    h = situ_glu(gate, up, *BETAS)
    y = (deq(w2, s2) @ h[..., None]).squeeze(-1)
    return (y.float() * weights[..., None]).sum(1).to(z.dtype)


def dense_fallback(z, experts, weights, w1, w3, w2, s1, s3, s2):
    return moe_experts_dense(z, experts, weights, w1, w3, w2, *BETAS)


_COMPILED: dict = {}


def compiled(fn, mode=None):
    key = (fn, mode)
    if key not in _COMPILED:
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
        _COMPILED[key] = torch.compile(fn, dynamic=False, mode=mode)
    return _COMPILED[key]


# ---------------------------------------------------------------------------------------------
# measurement

def rel_err(out, ref) -> float:
    if out.isnan().any():
        return float("nan")
    ref = ref.double()
    return ((out.double() - ref).norm() / ref.norm()).item()


def ceiling_tbps() -> float:
    if SMOKE:
        return 1.0
    from _common import copy_ceiling_tbps

    return copy_ceiling_tbps()


def time_us(run, n_layers: int, replays: int) -> float:
    """µs per layer: ``run`` (all virtual layers) captured in one graph, median replay (wall clock with --smoke)."""
    if SMOKE:
        t0 = time.perf_counter()
        run()
        return (time.perf_counter() - t0) * 1e6 / n_layers
    from _common import graph_replay_us

    return graph_replay_us(run, iters=1, replays=replays, warmup=2) / n_layers


class CompileBudgetExceeded(Exception):
    pass


def bounded(fn, seconds: float):
    """``fn()``, interrupted (CompileBudgetExceeded) once it has run ``seconds`` (main thread; 0: unbounded)."""
    if seconds <= 0 or SMOKE:
        return fn()
    from _common import within

    return within(seconds, fn, lambda: CompileBudgetExceeded(
        f"compile still running after {seconds:.0f} s (--autotune-budget)"))


def check(name, fn, args, ref) -> float:
    """Relative error of ``fn`` on ``args`` (fresh inputs) against ``ref()`` (the fp32 reference's output, made once
    for all providers); the swept kernels write into a NaN-poisoned output (the other providers allocate their own).
    The first call of a compiled provider compiles."""
    if name.startswith("k3["):
        return float("nan")   # one kernel alone: timing only
    if name.startswith("k3:"):
        out = fn(*args, out=torch.full_like(args[0], float("nan")))
    else:
        out = fn(*args)
    return rel_err(out, ref())


def run_point(args, s, fmt, weights, m, routing, providers, ceiling) -> list:
    layer_bytes, distinct = [], []
    per_expert = expert_bytes(s, fmt)
    n_layers = 2
    while True:   # enough virtual layers that a call's experts were last read > ROTATE_BYTES ago
        layers = [make_routing(m, s, routing, layer, seed=m) for layer in range(n_layers)]
        distinct = [int(torch.unique(ex).numel()) for _, ex, _ in layers]
        layer_bytes = [d * per_expert + m * s["l"] * 2 * 2 + m * s["a"] * 12 for d in distinct]
        if SMOKE or sum(layer_bytes) - max(layer_bytes) >= ROTATE_BYTES or n_layers >= 16:
            break
        n_layers *= 2
    floor_us = sum(layer_bytes) / len(layer_bytes) / (ceiling * 1e12) * 1e6
    rows, runs, errs, compile_s = [], {}, {}, {}
    inputs = (*make_routing(m, s, routing, layer=99, seed=7), *weights)
    refs = []

    def ref():
        if not refs:
            refs.append(moe_experts_ref(*inputs, *BETAS))
        return refs[0]

    for name, fn in providers.items():
        t0 = time.time()
        try:
            budget = args.autotune_budget if name == "max-autotune" else 0
            errs[name] = bounded(lambda: check(name, fn, inputs, ref), budget)
        except Exception as e:   # one provider that cannot run (a compile error) must not take the others with it
            print(f"   {name}: {type(e).__name__}: {str(e)[:300]} ({time.time() - t0:.1f} s)", flush=True)
            continue
        if name in ("compile", "max-autotune"):
            compile_s[name] = time.time() - t0
            print(f"   {name}: compiled and checked in {compile_s[name]:.1f} s", flush=True)
        outs = [None] * n_layers

        def run(fn=fn, outs=outs):
            for j, (z, experts, wts) in enumerate(layers):
                outs[j] = fn(z, experts, wts, *weights)
        run()
        runs[name] = run
    if not SMOKE:
        torch.cuda.synchronize()
    from _common import interleaved_passes

    samples = interleaved_passes({name: (lambda run=run: time_us(run, n_layers, args.replays))
                                  for name, run in runs.items()}, args.repeats)
    times = {name: sorted(v)[len(v) // 2] for name, v in samples.items()}
    for name, us in times.items():
        rows.append(dict(tp=FULL_I // s["i"] if not SMOKE else 8, format=fmt, routing=routing, m=m, provider=name,
                         us=us, us_passes=samples[name], floor_us=floor_us, pct_floor=100 * floor_us / us,
                         distinct_experts=sum(distinct) / len(distinct), layers=n_layers, rel_err=errs[name],
                         compile_s=compile_s.get(name),
                         speedup_vs_compile=times["compile"] / us if "compile" in times else None,
                         speedup_vs_autotune=times["max-autotune"] / us if "max-autotune" in times else None))
    return rows


def providers_for(args, tp, fmt, m) -> dict:
    s = shapes(tp)
    gathered = m * s["a"] <= s["e"]
    out = {"k3": k3_op}
    if fmt == "mxfp4" and not SMOKE:   # CuTe kernels: a GPU only
        from k3compile.ops.moe_experts.cute import MAX_M

        if m <= MAX_M:   # the op runs the CuTe kernels there: the Triton ones beside them
            out["k3-triton"] = k3_triton
            if m in args.kernels_m:
                out.update({f"k3[cute:{only}]": k3_cute_kernel(only) for only in ("gate_up", "down", "combine")})
    if m in args.sweep_m:
        for cfg in (SWEEP if fmt == "bf16" else SWEEP_MXFP4):
            out[f"k3:{cfg.tag()}"] = k3_config(cfg)
    if m in args.kernels_m:
        kernels = dict(KERNELS, **(KERNELS_MXFP4 if fmt == "mxfp4" else {}))
        out.update({name: k3_kernel(only, overrides) for name, (only, overrides) in kernels.items()})
    want_compile = args.compile_m is None or m in args.compile_m
    if want_compile and fmt == "bf16":
        out["compile"] = compiled(model_float)
    elif want_compile and gathered:
        out["compile"] = compiled(model_mxfp4_standin)
    if fmt == "bf16" and tp == 8 and m in args.autotune_m:
        out["max-autotune"] = compiled(model_float, "max-autotune-no-cudagraphs")
    if fmt == "bf16" and not gathered:
        out["dense"] = dense_fallback
    return out


def _prewarm_one(task) -> float:
    """Compile one swept configuration's kernels (a worker process): the K3 widths with 16 experts, so every
    argument Triton specialises on (alignments, multiples of 16, the constexprs) is that of the timed calls and the
    timed process finds the kernels in Triton's on-disk cache."""
    fmt, tp, config, ms = task
    t0 = time.time()
    s = dict(shapes(tp), e=16)
    weights = make_weights(s, fmt)
    for m in ms:
        z, experts, wts = make_routing(m, s, "random", layer=0, seed=0)
        moe_experts_triton(z, experts, wts, *weights, *BETAS, config=MoeConfig(**config))
    torch.cuda.synchronize()
    return time.time() - t0


def prewarm(args, tasks: Optional[list] = None, timeout: float = 75) -> None:
    """Compile every swept configuration (``tasks``: (format, tp, config dict, Ms) each; default: the SWEEP lists at
    ``--sweep-m``) in ``args.prewarm`` processes at once (each is three kernels, seconds of compile: in one process
    they would take most of a benchmark step's time limit)."""
    if tasks is None:
        tasks = [(fmt, tp, dataclasses.asdict(c), sorted(set(args.sweep_m)))
                 for tp in args.tp for fmt in args.formats for c in (SWEEP if fmt == "bf16" else SWEEP_MXFP4)]
    if SMOKE or args.prewarm <= 0 or not tasks:
        return
    import multiprocessing

    t0 = time.time()
    pool = multiprocessing.get_context("spawn").Pool(min(args.prewarm, len(tasks)))
    try:
        done = pool.map_async(_prewarm_one, tasks).get(timeout=timeout)
        print(f"prewarm: {len(done)} configurations compiled in {time.time() - t0:.1f} s "
              f"({args.prewarm} processes; slowest {max(done):.1f} s)", flush=True)
    except Exception as e:   # the timed process compiles whatever is missing
        print(f"prewarm: {type(e).__name__}: {str(e)[:200]} after {time.time() - t0:.1f} s", flush=True)
    finally:
        pool.terminate()


# ---------------------------------------------------------------------------------------------
# output

def print_table(rows):
    print(f"{'tp':>3} {'fmt':>6} {'routing':>7} {'M':>4} {'experts':>7} {'floor us':>9}  {'provider':<44}"
          f"{'us':>9} {'%floor':>7} {'x compile':>9} {'x autotune':>10} {'rel err':>9}")
    for r in rows:
        sc = f"{r['speedup_vs_compile']:.2f}" if r["speedup_vs_compile"] else "-"
        sa = f"{r['speedup_vs_autotune']:.2f}" if r["speedup_vs_autotune"] else "-"
        print(f"{r['tp']:>3} {r['format']:>6} {r['routing']:>7} {r['m']:>4} {r['distinct_experts']:>7.1f} "
              f"{r['floor_us']:>9.1f}  {r['provider']:<44}{r['us']:>9.1f} {r['pct_floor']:>6.1f}% {sc:>9} {sa:>10} "
              f"{r['rel_err']:>9.2e}")


def write_svg(rows, path):
    """% of the floor against M (log2), one panel per (TP, format), random routing; no matplotlib needed."""
    panels = sorted({(r["tp"], r["format"]) for r in rows if r["routing"] == "random"})
    colors = {"k3": "#1f77b4", "compile": "#7f7f7f", "max-autotune": "#ff7f0e", "dense": "#2ca02c"}
    w, h, pad = 360, 260, 40
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w * len(panels)}" height="{h + 30}" '
             'font-family="sans-serif" font-size="11">']
    ms = sorted({r["m"] for r in rows})
    for k, (tp, fmt) in enumerate(panels):
        x0 = k * w

        def px(m):
            return x0 + pad + (w - 2 * pad) * (math.log2(m) / max(1, math.log2(max(ms)))) if m > 0 else x0 + pad

        def py(pct):
            return h - pad + 0 - (h - 2 * pad) * min(pct, 110) / 110

        parts.append(f'<text x="{x0 + pad}" y="15">TP={tp} {fmt}: % of the selected-experts floor</text>')
        parts.append(f'<line x1="{x0 + pad}" y1="{py(100)}" x2="{x0 + w - pad}" y2="{py(100)}" stroke="black" '
                     'stroke-dasharray="4"/>')
        for pct in (0, 25, 50, 75, 100):
            parts.append(f'<text x="{x0 + 5}" y="{py(pct) + 4}">{pct}</text>')
        for m in ms:
            parts.append(f'<text x="{px(m) - 6}" y="{h - pad + 15}">{m}</text>')
        for j, (prov, color) in enumerate(colors.items()):
            pts = sorted((r["m"], r["pct_floor"]) for r in rows
                         if (r["tp"], r["format"], r["routing"], r["provider"]) == (tp, fmt, "random", prov))
            if not pts:
                continue
            parts.append(f'<polyline fill="none" stroke="{color}" stroke-width="2" points="'
                         + " ".join(f"{px(m):.1f},{py(p):.1f}" for m, p in pts) + '"/>')
            parts.append(f'<text x="{x0 + w - pad - 70}" y="{30 + 12 * j}" fill="{color}">{prov}</text>')
    parts.append(f'<text x="5" y="{h + 25}">x: tokens M (log scale); dashed: the floor (bytes of the distinct '
                 'selected experts + activations at the same-run copy ceiling)</text></svg>')
    Path(path).write_text("\n".join(parts))


def best_configs(rows) -> list:
    """Per (format, TP, M) the fastest swept configuration: the "configs" entries of ``tables/<gpu>.json``
    (``triton.tuned_config`` reads them)."""
    import dataclasses

    tags = {f"k3:{c.tag()}": c for c in SWEEP + SWEEP_MXFP4}
    best = {}
    for r in rows:
        if r["provider"] in tags and r["routing"] == "random" and r["rel_err"] < 2e-2:   # NaN fails too
            key = (r["format"], r["tp"], r["m"])
            if key not in best or r["us"] < best[key]["us"]:
                best[key] = r
    out = []
    for (fmt, tp, m), r in sorted(best.items()):
        s = shapes(tp)
        out.append(dict(dtype="bfloat16", format="float" if fmt == "bf16" else "mxfp4", I=s["i"], L=s["l"], m=m,
                        config=dataclasses.asdict(tags[r["provider"]]), us=round(r["us"], 2),
                        default_us=next((round(x["us"], 2) for x in rows if (x["format"], x["tp"], x["m"],
                                         x["provider"], x["routing"]) == (fmt, tp, m, "k3", "random")), None)))
    return out


def dense_entries(rows) -> list:
    """Per TP (bf16): the smallest M from which the dense form through cuBLAS beat the kernels at every larger M
    measured (``dispatch.dense_faster`` reads these); none where it never did."""
    out = []
    for tp in sorted({r["tp"] for r in rows}):
        times = {}
        for r in rows:
            if (r["tp"], r["format"], r["routing"]) == (tp, "bf16", "random") and r["provider"] in ("k3", "dense"):
                times.setdefault(r["m"], {})[r["provider"]] = r["us"]
        ms = sorted(m for m, t in times.items() if len(t) == 2)
        wins = [m for i, m in enumerate(ms) if all(times[x]["dense"] < times[x]["k3"] for x in ms[i:])]
        if wins:
            s = shapes(tp)
            out.append(dict(dtype="bfloat16", format="float", E=s["e"], I=s["i"], L=s["l"], A=s["a"],
                            dense_from_m=wins[0]))
    return out


def write_table(path: Path, configs: list, dense: Optional[list] = None, rows: Sequence = ()) -> None:
    """Merge this run's picks into ``path`` (``tables/<gpu>.json``'s format): entries of the same dtype, format,
    widths and M replaced, dense entries (unless None: kept) replaced for the widths this run measured in bf16, the
    rest kept."""
    table = json.loads(path.read_text()) if path.exists() else {}

    def key(e):
        return (e["dtype"], e["format"], e["I"], e["L"], e["m"])

    kept = {key(e): e for e in table.get("configs", [])}
    kept.update({key(e): e for e in configs})
    table["configs"] = sorted(kept.values(), key=key)
    if dense is not None:
        measured = {(shapes(r["tp"])["i"], shapes(r["tp"])["l"]) for r in rows if r["format"] == "bf16"}
        table["dense"] = [e for e in table.get("dense", []) if (e["I"], e["L"]) not in measured] + dense
    path.write_text(json.dumps(table, indent=1) + "\n")


def main(argv=None):
    args = parse_args(argv)
    ceiling = ceiling_tbps()
    info = dict(device="cpu (smoke)" if SMOKE else torch.cuda.get_device_name(), torch=torch.__version__,
                copy_ceiling_tbs=ceiling)
    import triton

    info["triton"] = triton.__version__
    print(f"{info['device']}  torch {info['torch']}  triton {info['triton']}  copy ceiling {ceiling:.2f} TB/s")
    rows = []
    t_start = time.time()
    prewarm(args)
    for tp in args.tp:
        s = shapes(tp)
        for fmt in args.formats:
            weights = make_weights(s, fmt)
            for m in args.m:
                for routing in args.routing + (["skewed"] if m in args.skewed_m and "skewed" not in args.routing
                                               else []):
                    t0 = time.time()
                    providers = providers_for(args, tp, fmt, m)
                    point = run_point(args, s, fmt, weights, m, routing, providers, ceiling)
                    rows += point
                    print_table(point)
                    if args.json:   # after every point: a run cut short keeps what it measured
                        Path(args.json).write_text(json.dumps(dict(info, rows=rows), indent=1))
                    if args.table and m in args.sweep_m:   # the picks so far, likewise (dense ones at the end)
                        write_table(Path(args.table), best_configs(rows))
                    print(f"   ({time.time() - t0:.1f} s; {time.time() - t_start:.0f} s so far)", flush=True)
            del weights
            if not SMOKE:
                torch.cuda.empty_cache()
    print("\nchoices:")
    for c in MOE_EXPERTS.choices():
        print(f"  {c.key}: {c.impl} ({c.reason})")
    print("\nall rows:")
    print_table(rows)
    if args.json:
        Path(args.json).write_text(json.dumps(dict(info, rows=rows, best_configs=best_configs(rows)), indent=1))
    if args.svg:
        write_svg(rows, args.svg)
    if args.table:
        write_table(Path(args.table), best_configs(rows), dense_entries(rows), rows)


if __name__ == "__main__":
    main()
