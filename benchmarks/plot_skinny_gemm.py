"""Plot benchmarks/skinny_gemm.py's JSON: achieved bandwidth per shape and M, with the copy ceiling.

    python benchmarks/plot_skinny_gemm.py results.json out.png

One panel per weight shape (N × K); x = M; y = achieved TB/s of each provider, counting
(N·K + M·K + M·N)·2 bytes per product; the dashed line is the same run's copy ceiling.
For a --sweep run, "cute" is the best configuration per (shape, M). "+static": with static_weight=True.
"""
import json
import sys
from collections import defaultdict

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

STYLE = {"cublas": ("tab:gray", "o"), "triton": ("tab:blue", "s"), "triton+static": ("tab:cyan", "s"),
         "cute": ("tab:green", "^"), "cute+static": ("tab:olive", "v"),
         "dispatched": ("black", "x"), "dispatched+static": ("tab:purple", "+")}


def main(src, dst):
    d = json.load(open(src))
    ceil = d["copy_ceiling_tbs"]
    best = defaultdict(dict)  # (n, k) -> provider -> m -> µs (best configuration)
    for r in d["rows"]:
        cur = best[(r["n"], r["k"])].setdefault(r["provider"], {})
        cur[r["m"]] = min(r["us"], cur.get(r["m"], float("inf")))
    shapes = sorted(best, key=lambda s: -s[0] * s[1])
    cols = 5
    rows = -(-len(shapes) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4 * cols, 3.2 * rows), sharey=True, squeeze=False)
    for ax, (n, k) in zip(axes.flat, shapes):
        for prov, by_m in best[(n, k)].items():
            ms = sorted(by_m)
            tbs = [(n * k + m * k + m * n) * 2 / (by_m[m] * 1e-6) / 1e12 for m in ms]
            color, marker = STYLE.get(prov, ("tab:red", "."))
            ax.plot(ms, tbs, marker=marker, color=color, label=prov,
                    linestyle=":" if prov.startswith("dispatched") else "-")
        ax.axhline(ceil, color="tab:red", linestyle="--", linewidth=1, label="copy ceiling")
        ax.set_title(f"N={n} K={k} ({n * k * 2 / 1e6:.0f} MB)", fontsize=9)
        ax.set_xscale("log", base=2)
        ax.set_xticks([1, 2, 4, 8, 16], ["1", "2", "4", "8", "16"])
        ax.set_xlabel("M")
        ax.grid(alpha=0.3)
    for ax in axes[:, 0]:
        ax.set_ylabel("achieved TB/s")
    for ax in axes.flat[len(shapes):]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=7, loc="lower right")
    fig.suptitle(f"skinny GEMM, {d.get('dtype', 'bf16')}, {d.get('device', '')}: copy ceiling {ceil:.2f} TB/s")
    fig.tight_layout()
    fig.savefig(dst, dpi=110)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
