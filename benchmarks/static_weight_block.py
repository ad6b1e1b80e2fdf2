"""Static weights end to end (GPU): a K3-like block (RMSNorm, four projections of one normed input, a latent-MoE
tail; 257 MB of bf16 weights, more than L2 holds) through optimize() at K3 widths, per M in $M_LIST (default 4),
compiled with the static-weight proof on and off (K3_STATIC_WEIGHT=0): the report's static-weight lines, outputs
vs eager, on/off bit-equality, and both timed (min of 2 alternating medians, 20 calls captured in one CUDA graph).
Phases skip themselves past $BUDGET s. On a CPU it is a smoke test at small widths.

    M_LIST="1 4 8" BUDGET=90 OUT=/tmp python benchmarks/static_weight_block.py
"""
import copy
import json
import os
import sys
import time

T0 = time.time()
BUDGET = float(os.environ.get("BUDGET", "50"))
OUT = os.environ.get("OUT", "static_out")
sys.path.insert(0, os.getcwd())
import torch  # noqa: E402

import k3compile  # noqa: E402
from benchmarks._common import graph_replay_us  # noqa: E402
from k3compile.ops.latent_moe_tail.reference import kimi_rms_norm  # noqa: E402

res = {"phases": {}}


def save(phase):
    res["phases"][phase] = round(time.time() - T0, 1)
    with open(os.path.join(OUT, "static_weight_block.json"), "w") as f:
        json.dump(res, f, indent=1)
    print(f"[{time.time() - T0:5.1f} s] {phase}", flush=True)


DEV = "cuda" if torch.cuda.is_available() else "cpu"   # cpu: a smoke test of this script at small widths
H, L, M, EPS = (7168, 3584, 4, 1e-5) if DEV == "cuda" else (256, 128, 4, 1e-5)
NS = (4096, 4096, 4096, 2048) if DEV == "cuda" else (256, 256, 256, 128)


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = torch.nn.Parameter(1 + 0.1 * torch.randn(H))
        self.projs = torch.nn.ModuleList(torch.nn.Linear(H, n, bias=False) for n in NS)
        self.lat_norm = torch.nn.Parameter(1 + 0.1 * torch.randn(L))
        self.up = torch.nn.Linear(L, H, bias=False)

    def forward(self, x, shared):
        h = kimi_rms_norm(x, self.norm, EPS)
        outs = [p(h) for p in self.projs]                   # back to back: each may stream during the last
        latent = torch.tanh(outs[0][:, :L])                 # made by a kernel of this graph
        tail = torch.nn.functional.linear(kimi_rms_norm(latent, self.lat_norm, EPS), self.up.weight) + shared
        return (*outs, tail)


def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def static_lines(model):
    rep = k3compile.report(model)
    res.setdefault("report", []).append(str(rep))
    return [ln for ln in str(rep).splitlines() if "proven" in ln or "static weight" in ln]


def compile_block(eager, static: bool):
    os.environ["K3_STATIC_WEIGHT"] = "1" if static else "0"
    torch._dynamo.reset()
    return k3compile.optimize(copy.deepcopy(eager), dynamic=False)


torch.manual_seed(0)
eager = Block().to(DEV).to(torch.bfloat16).eval()
M_LIST = [int(m) for m in os.environ.get("M_LIST", "4").split()]
res["rows"] = []
with torch.no_grad():
    for m in M_LIST:
        if time.time() - T0 > BUDGET - 12:
            print(f"M={m}: skipped (budget)")
            continue
        x = torch.randn(m, H, device=DEV, dtype=torch.bfloat16)
        shared = torch.randn(m, H, device=DEV, dtype=torch.bfloat16)
        ref = eager(x, shared)
        row = {"M": m}
        models, outs = {}, {}
        for static in (True, False):   # the first compile of a process is the slow one (imports, CuTe JIT)
            models[static] = compile_block(eager, static)
            outs[static] = models[static](x, shared)
            row[f"lines_{'on' if static else 'off'}"] = static_lines(models[static])
        row["rel_err_vs_eager"] = max(rel(o, r) for o, r in zip(outs[True], ref))
        row["nan"] = any(o.isnan().any().item() for o in outs[True])
        row["bit_equal_on_off"] = all(torch.equal(a, b) for a, b in zip(outs[True], outs[False]))
        print(f"M={m}:", *row["lines_on"][1:], f"| rel err vs eager {row['rel_err_vs_eager']:.2e}, "
              f"bit-equal on/off {row['bit_equal_on_off']}")
        save(f"M={m}: compiled both, checked")
        if DEV == "cuda":
            times = {True: [], False: []}
            for _ in range(2):   # alternate, so drift hits both alike
                for static in (True, False):
                    fn = lambda mod=models[static]: mod(x, shared)  # noqa: E731
                    times[static].append(graph_replay_us(fn, iters=20, replays=10, warmup=3))
            row["us_on"], row["us_off"] = min(times[True]), min(times[False])
            print(f"M={m}: block {row['us_on']:.2f} us static on, {row['us_off']:.2f} us off: "
                  f"{row['us_off'] - row['us_on']:+.2f} us saved")
        res["rows"].append(row)
        save(f"M={m}: done")
print(f"{'M':>3} {'on us':>8} {'off us':>8} {'saved':>7} {'rel err':>9} {'bit-eq':>6} proven")
for r in res["rows"]:
    proven = " ".join(ln.split()[0] + ":" + ln.split()[2] + "/" + ln.split()[4].rstrip(";")
                      for ln in r["lines_on"][1:])
    on, off = r.get("us_on", float("nan")), r.get("us_off", float("nan"))
    print(f"{r['M']:>3} {on:>8.2f} {off:>8.2f} {off - on:>+7.2f} {r['rel_err_vs_eager']:>9.2e} "
          f"{str(r['bit_equal_on_off']):>6} {proven}")
save("done")
