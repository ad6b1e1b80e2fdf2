"""KDA decode step on the GPU: k3::kda_decode vs fla's unfused step, plain torch.compile, and the state-traffic floor.

Providers, per (batch B, heads H), K = V = 128, bf16 activations, fp32 state [B, H, 128, 128]:
- ``k3``:        ``k3::kda_decode`` (Triton; in place: conv states + state), one launch.
- ``fla``:       fla's pieces: ``causal_conv1d_update`` (SiLU) for q, k, v, ``fused_recurrent_kda`` (gate, β-sigmoid,
                 q/k L2 norm in kernel; state V-first, written to a new tensor) and ``rms_norm_gated`` (sigmoid).
- ``compile``:   the model's plain decode step (``model/kda.py`` functions) under ``torch.compile``.
- ``floor``:     bytes of the step / the copy bandwidth measured in the same run (a 2 GiB ``copy_``).
Bytes of the step (comment for the floor): state read + write 2·B·H·V·K·4, plus the small per-token
tensors (q, k, v, f, G in, o out: 6·B·P·2; conv states read + write 3·2·B·P·(W-1)·2; β B·H·2).

Every time is the median of ``triton.testing.do_bench_cudagraph`` (decode runs under CUDA graphs). The
correctness check runs first and prints ‖out − ref‖/‖ref‖ per row against ``reference.py`` (fp32 math).

    python benchmarks/kda_decode.py                    # B 1 8 64 256 x H 12 96
    python benchmarks/kda_decode.py --quick            # B 1 64 x H 12, fewer repetitions
    python benchmarks/kda_decode.py --num-warps 4 8 16 # sweep the kernel's warps (k3 rows only)
    python benchmarks/kda_decode.py --configs s1r128w8 s4r32w4 s1r16w4d2   # layouts: V splits, rows a tile,
                                                        # warps, tile loads in flight (see parse_config)
Writes JSON to benchmarks/results/kda_decode.json (``--out``).
"""
from __future__ import annotations

import argparse
import copy
import json
import platform
import sys
import time
from pathlib import Path

import torch

K = V = 128
W = 4
LOWER_BOUND = -5.0
EPS = 1e-5


def make_inputs(B, H, dtype=torch.bfloat16, device="cuda", seed=0):
    g = torch.Generator(device=device).manual_seed(seed)   # on the device: the largest state is 1.6 GB
    P = H * K

    def r(*shape, dt=dtype, scale=1.0):
        return (torch.randn(*shape, generator=g, device=device) * scale).to(dt)

    return dict(
        q=r(B, P), k=r(B, P), v=r(B, P),
        conv_state_q=r(B, P, W - 1), conv_state_k=r(B, P, W - 1), conv_state_v=r(B, P, W - 1),
        conv_weight_q=r(P, 1, W, dt=torch.float32, scale=0.5), conv_weight_k=r(P, 1, W, dt=torch.float32, scale=0.5),
        conv_weight_v=r(P, 1, W, dt=torch.float32, scale=0.5),
        f=r(B, P), A_log=torch.empty(H, device=device).uniform_(1, 16, generator=g).log(),
        dt_bias=r(P, dt=torch.float32, scale=0.5), lower_bound=LOWER_BOUND,
        beta_logits=r(B, H), out_gate=r(B, P), o_norm_weight=1 + r(V, dt=torch.float32, scale=0.1),
        state=r(B, H, V, K, dt=torch.float32, scale=0.1), eps=EPS,
    )


def step_bytes(B, H) -> int:
    P = H * K
    return 2 * B * H * V * K * 4 + 6 * B * P * 2 + 3 * 2 * B * P * (W - 1) * 2 + B * H * 2


def rel(out, ref) -> float:
    out, ref = out.double(), ref.double()
    if out.isnan().any():
        return float("nan")
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


# -- providers: each returns a zero-argument step that reads and updates its own copy of the inputs ----------
def parse_config(name: str):
    """``s4r32w4`` -> KernelConfig(splits=4, rows=32, num_warps=4); ``s1r16w4d2``: 2 tile loads in flight;
    ``p6``: persistent, at most 6 programs per SM; ``cs``: streaming state stores; ``cg``: state loads via L2
    only; ``m80``: at most 80 registers per thread; ``a4``: the tile loop pipelined through shared memory in
    4 stages (e.g. ``s1r16w4d1p6m80``, ``s1r16w4a4``)."""
    import re

    from k3compile.ops.kda_decode.triton import KernelConfig

    m = re.fullmatch(r"s(\d+)r(\d+)w(\d+)(?:d(\d+))?(?:p(\d+))?(cs)?(cg)?(?:m(\d+))?(?:a(\d+))?", name)
    if not m:
        raise SystemExit(f"bad --configs entry {name!r} (want e.g. s4r32w4, s1r16w4d2 or s1r16w4d1p6m80)")
    s, r, w, d, p, cs, cg, mr, a = m.groups()
    return KernelConfig(int(s), int(r), int(w), int(d or 1), int(p or 0), bool(cs), bool(cg), int(mr or 0), int(a or 0))


def k3_step(x, num_warps=None, config=None):
    from k3compile.ops.kda_decode.triton import kda_decode_triton

    args = dict(x)
    return lambda: kda_decode_triton(**args, num_warps=num_warps, config=config)


def fla_step(x):
    """fla's kernels for the same math: three conv updates, the fused recurrence, the gated norm."""
    from fla.modules.causal_conv1d import causal_conv1d_update
    from fla.modules.norm.fused_norm_gate import rms_norm_gated
    from fla.ops.kda import fused_recurrent_kda

    B, H = x["beta_logits"].shape
    # fla keeps W inputs per channel ([B, P, W], oldest first) and drops slot 0 on each step
    caches = [torch.cat([torch.zeros_like(x[n][..., :1]), x[n]], -1).contiguous()
              for n in ("conv_state_q", "conv_state_k", "conv_state_v")]
    weights = [x[n][:, 0].contiguous() for n in ("conv_weight_q", "conv_weight_k", "conv_weight_v")]
    state = x["state"]

    def run():
        q, _ = causal_conv1d_update(x["q"], caches[0], weight=weights[0], activation="silu")
        k, _ = causal_conv1d_update(x["k"], caches[1], weight=weights[1], activation="silu")
        v, _ = causal_conv1d_update(x["v"], caches[2], weight=weights[2], activation="silu")
        o, _ = fused_recurrent_kda(
            q.view(B, 1, H, K), k.view(B, 1, H, K), v.view(B, 1, H, V), x["f"].view(B, 1, H, K),
            x["beta_logits"].view(B, 1, H), A_log=x["A_log"], dt_bias=x["dt_bias"], initial_state=state,
            output_final_state=True, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
            use_beta_sigmoid_in_kernel=True, lower_bound=LOWER_BOUND, state_v_first=True)
        y = rms_norm_gated(o.view(B * H, V), x["out_gate"].view(B * H, V), x["o_norm_weight"], None,
                           activation="sigmoid", eps=EPS)
        return y.view(B, H * V)
    return run


def plain_step_fn():
    from k3compile.model.kda import (
        gated_rms_norm, kda_gate_lower_bound, l2_normalize, kda_recurrent_step, short_conv_decode,
    )

    def step(q, k, v, conv_state_q, conv_state_k, conv_state_v, conv_weight_q, conv_weight_k, conv_weight_v,
             f, A_log, dt_bias, lower_bound, beta_logits, out_gate, o_norm_weight, state, eps):
        B, H = beta_logits.shape
        q = short_conv_decode(q, conv_state_q, conv_weight_q)
        k = short_conv_decode(k, conv_state_k, conv_weight_k)
        v = short_conv_decode(v, conv_state_v, conv_weight_v)
        g = kda_gate_lower_bound(f.view(B, H, K), A_log, dt_bias, lower_bound)
        beta = torch.sigmoid(beta_logits.float())
        q = l2_normalize(q.view(B, H, K)) * K ** -0.5
        k = l2_normalize(k.view(B, H, K))
        o = kda_recurrent_step(q, k, v.view(B, H, V).float(), g, beta, state)
        return gated_rms_norm(o, out_gate.view(B, H, V), o_norm_weight, eps).view(B, H * V)
    return step


_COMPILED = []


def compile_step(x):
    if not _COMPILED:   # one compiled function; a graph per (B, H)
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
        _COMPILED.append(torch.compile(plain_step_fn(), fullgraph=True, dynamic=False))
    fn = _COMPILED[0]
    args = dict(x)
    return lambda: fn(**args)


# -- measurement ------------------------------------------------------------------------------------------------
def copy_bandwidth(rep_ms: int) -> float:
    """Bytes read + written per second (B/s) by the shared same-run copy measurement."""
    from _common import copy_ceiling_tbps

    return copy_ceiling_tbps() * 1e12


def bench(fn, rep_ms: int) -> float:
    import triton.testing

    fn()  # compile / autotune outside capture
    torch.cuda.synchronize()
    return triton.testing.do_bench_cudagraph(fn, rep=rep_ms) * 1e3   # µs


def check(B, H, providers) -> dict:
    """‖out − ref‖/‖ref‖ of every provider's output and state after one step, vs reference.py."""
    from k3compile.ops.kda_decode.reference import kda_decode_ref

    base = make_inputs(B, H, seed=1)
    ref_in = copy.deepcopy(base)
    ref = kda_decode_ref(**ref_in)
    errs = {}
    for name, make in providers.items():
        x = copy.deepcopy(base)
        out = make(x)()
        state = x["state"]
        errs[name] = {"out": rel(out, ref), "state": rel(state, ref_in["state"]) if name != "fla" else None}
        if name != "fla":   # fla's conv caches live in its own layout
            errs[name]["conv"] = max(rel(x[n], ref_in[n]) for n in ("conv_state_q", "conv_state_k", "conv_state_v"))
    return errs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64, 256])
    ap.add_argument("--heads", type=int, nargs="+", default=[12, 96], help="12 = 96 heads / TP 8")
    ap.add_argument("--providers", nargs="+", default=["k3", "fla", "compile"])
    ap.add_argument("--num-warps", type=int, nargs="*", default=[], help="k3 kernel warps to sweep")
    ap.add_argument("--configs", nargs="*", default=[],
                    help="k3 kernel layouts to sweep: sSPLITSrROWSwWARPS[dDEPTH], e.g. s1r128w8 s1r16w4d2")
    ap.add_argument("--quick", action="store_true", help="B 1 64, H 12, short repetitions")
    ap.add_argument("--rep-ms", type=int, default=200)
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "kda_decode.json"))
    args = ap.parse_args(argv)
    if args.quick:
        args.batch, args.heads, args.rep_ms = [1, 64], [12], 50
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

    makers = {"k3": k3_step, "fla": fla_step, "compile": compile_step}
    providers = {}
    for p in args.providers:
        if p == "k3" and args.configs:
            for c in args.configs:
                providers[f"k3/{c}"] = (lambda cfg: lambda x: k3_step(x, config=cfg))(parse_config(c))
        elif p == "k3" and args.num_warps:
            for nw in args.num_warps:
                providers[f"k3/w{nw}"] = (lambda nw: lambda x: k3_step(x, nw))(nw)
        else:
            providers[p] = makers[p]
    try:
        import fla  # noqa: F401
    except Exception as e:  # fla missing: drop its rows, say so
        print(f"fla unavailable ({e}); skipping its rows")
        providers = {k: v for k, v in providers.items() if k != "fla"}

    bw = copy_bandwidth(args.rep_ms)
    print(f"copy ceiling: {bw / 1e12:.2f} TB/s (2 GiB copy_, read + write)")
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "python": platform.python_version(),
            "copy_bytes_per_s": bw, "K": K, "V": V, "W": W, "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "argv": sys.argv[1:]}
    try:
        import triton
        meta["triton"] = triton.__version__
    except Exception:
        pass
    rows = []

    def save():  # after every shape: a run stopped by its time limit keeps what it measured
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))

    print("\ncorrectness (rel. error vs reference.py, bf16 activations, fp32 state):")
    for H in args.heads:
        for B in args.batch:
            for name, e in check(B, H, providers).items():
                s = "n/a" if e["state"] is None else f"{e['state']:.2e}"
                c = f"  conv states {e['conv']:.2e}" if "conv" in e else ""
                print(f"  B={B:<4} H={H:<3} {name:<14} out {e['out']:.2e}  state {s}{c}")
                rows.append({"kind": "check", "B": B, "H": H, "provider": name, **e})
            torch.cuda.empty_cache()
    save()

    print(f"\n{'B':>4} {'H':>3} {'provider':<14} {'µs':>9} {'floor µs':>9} {'× floor':>8} {'% ceiling':>9} "
          f"{'vs fla':>7} {'vs compile':>10}")
    for H in args.heads:
        for B in args.batch:
            floor_us = step_bytes(B, H) / bw * 1e6
            times = {}
            for name, make in providers.items():
                x = make_inputs(B, H)
                try:
                    times[name] = bench(make(x), args.rep_ms)
                except Exception as e:  # keep the other rows
                    print(f"  {name} failed at B={B} H={H}: {type(e).__name__}: {e}")
                del x
                torch.cuda.empty_cache()
            for name, us in times.items():
                vs_fla = times.get("fla", float("nan")) / us
                vs_compile = times.get("compile", float("nan")) / us
                print(f"{B:>4} {H:>3} {name:<14} {us:>9.2f} {floor_us:>9.2f} {us / floor_us:>8.2f} "
                      f"{100 * floor_us / us:>8.1f}% {vs_fla:>7.2f} {vs_compile:>10.2f}")
                rows.append({"kind": "time", "B": B, "H": H, "provider": name, "us": us, "floor_us": floor_us,
                             "x_floor": us / floor_us, "speedup_vs_fla": vs_fla, "speedup_vs_compile": vs_compile})
            save()
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
