"""Registers, shared memory and programs an SM of the MLA split kernel's layouts, compiled for sm_90a on the CPU.

Triton's NVIDIA backend compiles without a GPU; ``ptxas -v`` (shipped with Triton) gives the registers and spills,
the compiled kernel's metadata the shared memory. K3's widths (Lk 512, R 64), 16 query rows (T 1, 12 or 6 heads),
bf16, under PDL with the early reads, as the dispatch launches it. Programs an SM: the fewest of what the registers
(64K a SM, allocated per warp in 256s), the shared memory (228 KB a SM, 1 KB of it reserved a program) and the
threads (2,048) allow. The layouts are the tuner's stage 3 candidates (``tune_mla_decode.length_candidates``, from
the committed H200 picks). ``loop``: SASS instructions a warp issues per tile (the tile loop's length); ``/key``:
those of all warps per key, the issue work the stream costs per key.

    python benchmarks/mla_split_occupancy.py                  # the tuner's stage 3 candidates
    python benchmarks/mla_split_occupancy.py --json out.json

The figures are for the Triton installed here; the GPU machine's may differ by a few registers.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
SM_REGS = 65536
SM_SMEM = 228 * 1024
BLOCK_RESERVED = 1024
SM_THREADS = 2048


def programs_per_sm(regs: int, warps: int, smem: int) -> int:
    per_warp = -(-regs * 32 // 256) * 256
    return min(SM_REGS // (per_warp * warps), SM_SMEM // (smem + BLOCK_RESERVED), SM_THREADS // (32 * warps))


def build(config, rows: int = 16, n_split: int = 132) -> dict:
    """Compile the split kernel of ``config`` for sm_90a at K3's widths; registers, spills, shared memory."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from k3compile.ops.mla_decode import triton as mt
    from k3compile.ops.mla_decode.config import row_block

    kernel = mt._mla_split_static if config.static_strides else mt._mla_split
    bf16 = "*bf16"
    ptrs = dict(q_lat=bf16, q_pe=bf16, c_kv=bf16, k_pe=bf16, pos="*i64", start="*i64", o_part="*fp32",
                m_part="*fp32", l_part="*fp32")
    consts = dict(LK=512, R=64, BM=row_block(rows), BL=512, BR=64, BS=config.block_s,
                  PREFETCH=config.prefetch_tiles * config.block_s, EARLY=True, HAS_START=False, UPCAST=False,
                  PDL=True, FULL_TILES=config.full_tiles, stride_cl=1, stride_kr=1, stride_pr=1)
    if config.static_strides:   # K3 at TP 8, T 1: q [B, 1, 12, 192], c_kv [B, S, 512], k_pe [B, S, 64]
        consts.update(T=1, H=rows if rows < 16 else 12, N_SPLIT=n_split, min_tiles=config.min_split_tiles,
                      qk_scale=0.1041, stride_pb=12 * 192, stride_pt=12 * 192, stride_ph=192, stride_cs=512,
                      stride_ks=64)
    names = kernel.arg_names
    sig = {n: "constexpr" if n in consts else ptrs.get(n) or ("i64" if n.startswith("stride") else
           "fp32" if n == "qk_scale" else "i32") for n in names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
             if n in ptrs or (n.startswith("stride") and n not in consts)}
    k = triton.compile(ASTSource(fn=kernel, signature=sig, constexprs=consts, attrs=attrs),
                       target=GPUTarget("cuda", 90, 32),
                       options=dict(num_warps=config.num_warps, num_stages=config.num_stages,
                                    **(dict(maxnreg=config.maxnreg) if config.maxnreg else {})))
    tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.TemporaryDirectory() as tmp:
        ptx, cubin = os.path.join(tmp, "k.ptx"), os.path.join(tmp, "k.cubin")
        Path(ptx).write_text(k.asm["ptx"])
        info = subprocess.run([os.path.join(tools, "ptxas"), "-arch=sm_90a", "-v", ptx, "-o", cubin],
                              capture_output=True, text=True)
        sass = subprocess.run([os.path.join(tools, "nvdisasm"), "-c", cubin], capture_output=True, text=True).stdout
    regs = int(re.search(r"Used (\d+) registers", info.stderr).group(1))
    spills = sum(int(x) for x in re.findall(r"(\d+) bytes spill stores", info.stderr))
    smem = k.metadata.shared
    loop = tile_loop(sass)
    return dict(registers=regs, spills=spills, shared_kb=round(smem / 1024, 1),
                programs_per_sm=programs_per_sm(regs, config.num_warps, smem),
                params=len([n for n in names if n not in consts]), loop_instructions=loop,
                instructions_per_key=round(loop * config.num_warps / config.block_s, 1))


def tile_loop(sass: str) -> int:
    """SASS instructions a warp issues per tile: the first loop (a backward branch to a label) holding tensor-core
    instructions (HMMA), counted once (with ``full_tiles`` the unmasked one; the partial last tile's runs once)."""
    lines = sass.splitlines()
    labels = {m.group(1): i for i, line in enumerate(lines) if (m := re.match(r"^(\.L_x_\d+):", line))}
    for i, line in enumerate(lines):
        m = re.search(r"BRA `\((\.L_x_\d+)\)", line)
        if m and labels.get(m.group(1), i) < i:
            body = [x for x in lines[labels[m.group(1)]:i + 1] if re.match(r"\s*/\*[0-9a-f]{4,}\*/", x)]
            if any("HMMA" in x for x in body):
                return len(body)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", default="")
    args = ap.parse_args(argv)
    os.environ.pop("TRITON_INTERPRET", None)
    sys.path.insert(0, str(HERE))
    sys.path.insert(1, str(HERE.parent))
    import torch
    from tune_mla_decode import length_candidates, tag

    from k3compile.ops.mla_decode.dispatch import load_table, table_key

    table = load_table("NVIDIA H200")     # the tuner's stage 3 starts from the committed picks
    seen, out = set(), []
    print(f"{'layout':<34} {'regs':>5} {'spill':>6} {'smem KB':>8} {'params':>6} {'prog/SM':>7} {'claims':>6} "
          f"{'loop':>5} {'/key':>5}")
    for batch in (1, 8):
        for c in length_candidates(batch, table.get(table_key(torch.bfloat16, 16, batch))):
            key = (c.block_s, c.num_warps, c.num_stages, c.static_strides, c.maxnreg, c.full_tiles)
            if key in seen:
                continue
            seen.add(key)
            r = build(c)
            out.append(dict(layout=tag(c), config=c.to_json(), **r))
            flag = "" if r["programs_per_sm"] >= c.programs_per_sm else " NO"
            print(f"{tag(c):<34} {r['registers']:>5} {r['spills']:>6} {r['shared_kb']:>8} {r['params']:>6} "
                  f"{r['programs_per_sm']:>7} {c.programs_per_sm:>5}{flag:<3} {r['loop_instructions']:>5} "
                  f"{r['instructions_per_key']:>5}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
