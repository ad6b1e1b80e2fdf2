"""The PTX of every CuTe kernel variant the dispatch tables pick, compiled on this machine (no GPU needed: CuTe DSL
compiles for sm_90a with ``CUTE_DSL_ARCH=sm_90a``), to check that a change of the CuTe code leaves the kernels as
they were.

    python benchmarks/cute_ptx.py --out DIR [--variants FILE] [--only NAME ...]   # DIR/<variant>.ptx, DIR/variants.json
    python benchmarks/cute_ptx.py --compare OLD_DIR NEW_DIR                        # byte for byte, but the symbol

Run ``--out`` on the commit before a change and on the change (``git stash`` / ``git worktree``), then
``--compare``. The variants: for every bfloat16 row of the skinny GEMM's and the latent-MoE tail's tables that names
a CuTe configuration, its M bucket's largest and smallest M (residual on, bias off; the smaller one with neither)
and one float16 compile with bias and residual; the tail's with its norm fused (eps 1e-5); and the heuristics' picks
for a few shapes no table lists. ``--variants`` compiles a list written by an earlier ``--out`` instead.

The comparison replaces the kernel's symbol (it spells the Python module and class that defined the kernel) by
``KERNEL``; every other byte must match.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import re
import shutil
import sys
import tempfile

UNLISTED = [(4096, 4096), (1024, 7168), (7168, 2048), (384, 7168), (12288, 1024), (2048, 7168)]


def _ms(bucket: int) -> list[int]:
    return sorted({bucket, bucket // 2 + 1}) if bucket > 2 else [bucket]


def picked_variants() -> list[dict]:
    """The variants to compile, as {"kernel", "config", "dtype", "m", "bias", "residual", "static", "eps"}."""
    import torch

    from k3compile import tables
    from k3compile.ops.latent_moe_tail import dispatch as tail
    from k3compile.ops.skinny_gemm import cute_config
    from k3compile.ops.skinny_gemm import dispatch as gemm

    picked: dict = {}   # (config, static, eps) -> Ms
    gemm_table, tail_table = gemm.table_for("NVIDIA H200"), tail.table_for("NVIDIA H200")
    for (dt, m, n, k, static), pick in gemm_table.picks.items():
        if dt == "bfloat16" and "cute" in pick.configs:
            picked.setdefault((pick.configs["cute"], static, None), set()).update(_ms(m))
    for n, k in UNLISTED:
        for m in (1, 8, 16):
            for static in (False, True):
                picked.setdefault((cute_config.heuristic(m, n, k, static), static, None), set()).add(m)
    for (dt, m, n, k, static), pick in tail_table.picks.items():
        if dt == "bfloat16" and "cute" in pick.configs:
            cfg = tail.cute_config_for(torch.bfloat16, m, n, k, static, tail_table, gemm_table)
            picked.setdefault((cfg, static, 1e-5), set()).update(_ms(m))
    out = []
    for (cfg, static, eps), ms in picked.items():
        ms = sorted(ms)
        fields = tables.config_fields(cfg, gemm.KERNEL_OF[type(cfg)])
        for i, m in enumerate(ms):
            flags = [(False, True)] if eps is not None or i == len(ms) - 1 else [(False, False)]
            out += [dict(config=fields, dtype="bfloat16", m=m, bias=b, residual=r, static=static, eps=eps)
                    for b, r in flags]
        if eps is None:
            out.append(dict(config=fields, dtype="float16", m=ms[-1], bias=True, residual=True, static=static, eps=None))
    return out


def _config(fields: dict):
    from k3compile.ops.skinny_gemm import dispatch as gemm

    fields = dict(fields)
    kernel = fields.pop("kernel")
    return gemm.KERNELS["cute"][kernel](**fields)


def dump(out_dir: str, variants: list[dict], only: set) -> None:
    """Compile each variant in this process, its PTX to ``out_dir/<variant name>.ptx``."""
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    os.environ["K3_CUTE_CACHE_DIR"] = "0"
    dump_dir = tempfile.mkdtemp(prefix="cute_ptx_")
    os.environ["CUTE_DSL_KEEP"] = "ptx"
    os.environ["CUTE_DSL_DUMP_DIR"] = dump_dir
    import torch

    from k3compile.kernels.cute import compile as cc

    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "variants.json"), "w") as f:
        json.dump(variants, f, indent=1)
    for i, v in enumerate(variants):
        key = (getattr(torch, v["dtype"]), v["m"], _config(v["config"]), v["bias"], v["residual"], v["static"], v["eps"])
        name = cc.variant_name(key)
        if (only and name not in only) or os.path.exists(os.path.join(out_dir, name + ".ptx")):
            continue
        for stale in glob.glob(os.path.join(dump_dir, "*")):
            os.remove(stale)
        cc.build(key)
        (ptx,) = glob.glob(os.path.join(dump_dir, "*.ptx"))
        shutil.move(ptx, os.path.join(out_dir, name + ".ptx"))
        print(f"{i + 1}/{len(variants)} {name}", flush=True)
    shutil.rmtree(dump_dir, ignore_errors=True)


def normalised(ptx: str) -> str:
    """The PTX with the kernel's symbol (which spells the defining module and class) replaced by ``KERNEL``."""
    entry = re.search(r"\.entry\s+([A-Za-z_0-9$]+)\(", ptx)
    return ptx.replace(entry.group(1), "KERNEL") if entry else ptx


def compare(old_dir: str, new_dir: str) -> int:
    """0 when every variant of ``old_dir`` is in ``new_dir`` with the same normalised PTX."""
    old = {os.path.basename(p)[:-4]: p for p in glob.glob(os.path.join(old_dir, "*.ptx"))}
    new = {os.path.basename(p)[:-4]: p for p in glob.glob(os.path.join(new_dir, "*.ptx"))}
    missing = sorted(set(old) - set(new))
    differ = [n for n in sorted(set(old) & set(new)) if normalised(open(old[n]).read()) != normalised(open(new[n]).read())]
    same_bytes = sum(open(old[n], "rb").read() == open(new[n], "rb").read() for n in set(old) & set(new))
    print(f"{len(old)} variants before, {len(new)} after: {len(set(old) & set(new)) - len(differ)} identical "
          f"({same_bytes} byte for byte, the rest but the kernel symbol), {len(differ)} differ, {len(missing)} missing")
    for n in differ + missing:
        print(("differs: " if n in differ else "missing: ") + n)
    return 1 if differ or missing else 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out")
    ap.add_argument("--variants", help="a variants.json of an earlier --out (default: the tables' picks)")
    ap.add_argument("--only", nargs="*", default=[], help="variant names to compile (default: all)")
    ap.add_argument("--compare", nargs=2, metavar=("OLD_DIR", "NEW_DIR"))
    args = ap.parse_args(argv)
    if args.compare:
        return compare(*args.compare)
    if not args.out:
        ap.error("--out or --compare")
    variants = json.load(open(args.variants)) if args.variants else picked_variants()
    dump(args.out, variants, set(args.only))
    return 0


if __name__ == "__main__":
    sys.exit(main())
