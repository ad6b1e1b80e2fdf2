"""KDA prefill recurrence on the GPU: ``k3::kda_prefill`` (fla's ``chunk_kda``) vs the model's ``kda_chunked``.

Per (B, T, H), K = V = 128, fp32 q/k/g/beta (as the model hands them over), bf16 v, fp32 state [B, H, V, K]:
- ``k3``:     ``k3::kda_prefill`` with backend "triton" (fla's chunk_kda, state in place).
- ``eager``:  ``kda_chunked`` eagerly (the op's reference path; what the unmatched graph computes, unfused).
Correctness: ‖o − ref‖/‖ref‖ and the same for the end state, vs ``kda_chunked`` in fp32.
Times: median of ``triton.testing.do_bench`` (prefill is not graph-captured), µs and tokens/µs.

    python benchmarks/kda_prefill.py                       # T 512 2048 8192 x H 12, B 1
    python benchmarks/kda_prefill.py --tokens 1024 --heads 12 96 --batch 1 4
Writes JSON to benchmarks/results/kda_prefill.json (``--out``).
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

K = V = 128


def make_inputs(B, T, H, seed=0, device="cuda"):
    g = torch.Generator(device=device).manual_seed(seed)

    def r(*shape):
        return torch.randn(*shape, generator=g, device=device)

    q = torch.nn.functional.normalize(r(B, T, H, K), dim=-1) * K ** -0.5
    k = torch.nn.functional.normalize(r(B, T, H, K), dim=-1)
    return dict(q=q, k=k, v=r(B, T, H, V).bfloat16(), g=-5.0 * torch.sigmoid(r(B, T, H, K)),
                beta=torch.sigmoid(r(B, T, H)), state=0.1 * r(B, H, V, K))


def rel(out, ref) -> float:
    out, ref = out.double(), ref.double()
    if out.isnan().any():
        return float("nan")
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, nargs="+", default=[1])
    ap.add_argument("--tokens", type=int, nargs="+", default=[512, 2048, 8192])
    ap.add_argument("--heads", type=int, nargs="+", default=[12], help="12 = 96 heads / TP 8")
    ap.add_argument("--rep-ms", type=int, default=100)
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "kda_prefill.json"))
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    import triton.testing

    from k3compile.model.kda import kda_chunked
    from k3compile.ops.kda_prefill import KDA_PREFILL, kda_prefill

    rows = []
    print(f"{'B':>3} {'T':>6} {'H':>3} {'k3 µs':>10} {'eager µs':>10} {'speedup':>8} {'tok/µs':>7} "
          f"{'rel o':>9} {'rel state':>9}  impl")
    for H in args.heads:
        for B in args.batch:
            for T in args.tokens:
                x = make_inputs(B, T, H)
                ref_state = x["state"].clone()
                ref = kda_chunked(**{**x, "state": ref_state})
                state = x["state"].clone()
                out = kda_prefill(**{**x, "state": state}, backend="triton")
                err_o, err_s = rel(out, ref), rel(state, ref_state)
                impl = ",".join(sorted({c.impl for c in KDA_PREFILL.choices()}))
                work = {**x, "state": x["state"].clone()}
                k3_us = triton.testing.do_bench(lambda: kda_prefill(**work, backend="triton"),
                                                rep=args.rep_ms) * 1e3
                eager_us = triton.testing.do_bench(lambda: kda_chunked(**work), rep=args.rep_ms) * 1e3
                print(f"{B:>3} {T:>6} {H:>3} {k3_us:>10.1f} {eager_us:>10.1f} {eager_us / k3_us:>8.2f} "
                      f"{B * T / k3_us:>7.2f} {err_o:>9.2e} {err_s:>9.2e}  {impl}")
                rows.append({"B": B, "T": T, "H": H, "k3_us": k3_us, "eager_us": eager_us,
                             "speedup_vs_eager": eager_us / k3_us, "rel_out": err_o, "rel_state": err_s,
                             "impl": impl})
                del x, work, ref, out
                torch.cuda.empty_cache()
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "python": platform.python_version(),
            "K": K, "V": V, "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "argv": sys.argv[1:]}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
