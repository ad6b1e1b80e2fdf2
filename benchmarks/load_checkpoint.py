"""Load time of a checkpoint in the published layout, with and without the non-finite check (``check_finite``),
on the CPU: what the check costs.

Writes a random K3-shaped checkpoint (bf16 weights, routed experts as MXFP4 or bf16) of about ``--mb`` MB, then
loads it ``--runs`` times each way, alternating, in this process (the files stay in the page cache, so the times are
the loader's work: reading the maps, converting, checking). On a shared machine wall times wander, so it reports the
fastest run of each way (the least disturbed) and, separately, the check's own work timed alone: one min/max
reduction per loaded float tensor (what ``check_finite`` adds besides one host sync per file).

    python benchmarks/load_checkpoint.py --mb 400 --runs 11 --out benchmarks/results/load_checkpoint_cpu.json
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch


def make_checkpoint(path: Path, mb: float, experts: str) -> int:
    """A micro-schedule K3 (6 layers) widened until its checkpoint is about ``mb`` MB; returns its size in bytes."""
    from k3compile.model import KimiK3Config, KimiK3ForConditionalGeneration

    scale = max(1, round((mb / (3.2 if experts == "mxfp4" else 7.5)) ** 0.5))        # MB ~ c * scale^2
    config = KimiK3Config.micro(num_hidden_layers=6, hidden_size=128 * scale, num_experts=32,
                                routed_expert_hidden_size=64 * scale, moe_intermediate_size=96 * scale,
                                intermediate_size=320 * scale, vocab_size=4096)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = KimiK3ForConditionalGeneration(config)
    model.to_empty(device="cpu")
    for p in model.parameters():
        p.data.uniform_(-0.05, 0.05)
    model.set_dtype(torch.bfloat16)
    if experts == "mxfp4":
        model.convert_experts("mxfp4")
    model.save_pretrained(path, max_shard_size=64 * 2 ** 20)
    return sum(f.stat().st_size for f in path.glob("*.safetensors"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=float, default=400)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--experts", default="mxfp4", choices=("mxfp4", "bf16"))
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from k3compile.model import KimiK3ForConditionalGeneration

    with tempfile.TemporaryDirectory() as tmp:
        size = make_checkpoint(Path(tmp), args.mb, args.experts)
        times = {True: [], False: []}
        model = KimiK3ForConditionalGeneration.from_pretrained(tmp, progress=False)  # page cache warm
        for _ in range(args.runs):
            for check in (False, True):
                start = time.perf_counter()
                KimiK3ForConditionalGeneration.from_pretrained(tmp, check_finite=check, progress=False)
                times[check].append(time.perf_counter() - start)
    floats = [p.detach() for p in model.parameters() if p.is_floating_point()]
    check_alone = []
    for _ in range(args.runs):
        start = time.perf_counter()
        flags = [torch.stack(torch.aminmax(t)).double() for t in floats]
        torch.isfinite(torch.stack(flags)).all(-1).tolist()
        check_alone.append(time.perf_counter() - start)
    off, on, alone = min(times[False]), min(times[True]), min(check_alone)
    float_mb = sum(t.numel() * t.element_size() for t in floats) / 1e6
    result = dict(checkpoint_mb=size / 1e6, float_mb=float_mb, experts=args.experts, threads=args.threads,
                  runs=args.runs, seconds_check_off=off, seconds_check_on=on, ratio=on / off,
                  seconds_check_alone=alone, check_alone_over_load=alone / off,
                  all_seconds={"off": times[False], "on": times[True], "check_alone": check_alone})
    print(f"checkpoint {size / 1e6:.0f} MB ({float_mb:.0f} MB of floats, experts {args.experts}), {args.threads} "
          f"thread(s), fastest of {args.runs}: load {off:.3f} s without the check, {on:.3f} s with it "
          f"(x{on / off:.3f}); "
          f"the check alone {alone * 1e3:.1f} ms ({alone / off:.1%} of the load)")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
