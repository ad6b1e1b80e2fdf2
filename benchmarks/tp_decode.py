"""Tensor-parallel Kimi K3 decode: ``k3compile.optimize`` vs plain ``torch.compile``, one process per rank.

    # eight GPUs of one host (NCCL, one GPU a rank), a real-width slice, M = 1..16
    python benchmarks/tp_decode.py --backend nccl --world-size 8 --config slice --json tp8.json
    # two GPUs (nvidia-h200-x2), same slice
    python benchmarks/tp_decode.py --backend nccl --world-size 2 --config slice --json tp2.json
    # the graph and logits checks only, on CPU processes (gloo); --eager-prefill compiles decode only
    python benchmarks/tp_decode.py --backend gloo --world-size 8 --config micro --batch 1,4 --steps 3

Every rank builds the same seeded full model and keeps its own shard of the full state dict
(``model.loading.convert_checkpoint``, as a checkpoint load would). Two modules share those shards:

- ``unfused``: the plain model under ``torch.compile`` (no k3 pass);
- ``fused``: ``k3compile.optimize`` (all passes).

For each M in ``--batch`` (M = batch, one token per sequence in decode) both prefill a short random
prompt and decode ``--steps`` given random tokens (teacher-forced: the same input tokens for both, whatever
either would have picked). Checks, on every rank:

- each step's logits (the prefill's last position, then every decode step) against the unfused run's
  (``_common.compare_logits``: each row's relative error over the vocabulary, the median over (step, row) within
  the dtype's tolerance; the worst row and how many rows keep the unfused top-1 are printed: free-running greedy
  tokens would differ at bf16 ties and hide real errors);
- the optimized decode graph holds one all-reduce per MoE layer fewer than the unfused one (the latent
  MoE tail reduces the routed latent and the shared experts' output in one collective), and the
  unfused graph holds exactly the model's all-reduces (embedding + attention + dense MLP + 2 per MoE layer).

The graphs are read by a post-grad pass that only counts: alone for ``unfused``, chained after ours
(``optimize`` runs a pass given in ``options`` after its own) for ``fused``. It has no ``uuid``, so
Inductor bypasses its caches for these graphs and every graph is counted.

With NCCL, the decode step of each is then timed under an explicitly captured CUDA graph (median of
replays, slowest rank), with NVLink multicast off (``NCCL_NVLS_ENABLE=0``,
``TORCH_SYMM_MEM_DISABLE_MULTICAST=1``, ``NVSHMEM_DISABLE_NVLS=1``, set before NCCL starts).
Rank 0 prints one table and writes ``--json``; the exit code is 1 on any mismatch.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import LOGITS_TOLERANCE, compare_logits, decode_call, graph_replay_us  # noqa: E402

# NVLink multicast can take a shared host's GPUs out of service: off before NCCL initialises.
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
ALL_REDUCE = ("_c10d_functional.all_reduce", "k3.all_reduce_")   # functional, and the merged one of the tail pass
TAIL_OP = "k3.latent_moe_tail"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world-size", type=int, default=2, help="tensor-parallel ranks (processes)")
    p.add_argument("--backend", choices=("nccl", "gloo"), default="nccl",
                   help="nccl: one GPU a rank, timed; gloo: CPU processes, checks only")
    p.add_argument("--config", choices=("micro", "tiny", "slice"), default="slice")
    p.add_argument("--layers", type=int, default=4, help="--config slice: decoder layers")
    p.add_argument("--experts", type=int, default=32, help="--config slice: routed experts")
    p.add_argument("--batch", type=lambda s: [int(m) for m in s.split(",")], default=[1, 2, 4, 8, 16],
                   help="comma-separated M values (decode batch)")
    p.add_argument("--steps", type=int, default=8, help="teacher-forced decode steps after the prefill")
    p.add_argument("--prompt", type=int, default=8, help="prompt length of the prefill")
    p.add_argument("--eager-prefill", action="store_true",
                   help="run the prefill eagerly (compile only the decode graphs: a quicker check)")
    p.add_argument("--dtype", choices=list(DTYPES), default=None, help="default: bf16 with nccl, fp32 with gloo")
    p.add_argument("--k3-backend", default="auto", help="kernel implementations of the k3 ops (optimize(backend=))")
    p.add_argument("--iters", type=int, default=8, help="decode steps captured in one CUDA graph")
    p.add_argument("--replays", type=int, default=30, help="timed replays of that graph")
    p.add_argument("--no-time", action="store_true", help="skip the CUDA-graph timing")
    p.add_argument("--tol", type=float, default=None, help="relative logits error allowed (default by dtype)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=str, default=None, help="rank 0 writes the rows here")
    args = p.parse_args(argv)
    if args.dtype is None:
        args.dtype = "bf16" if args.backend == "nccl" else "fp32"
    if args.world_size < 1 or args.steps < 1 or args.prompt < 1 or min(args.batch) < 1:
        p.error("--world-size, --steps, --prompt and every --batch value must be >= 1")
    return args


# ---------------------------------------------------------------------------------------------
# the model

def _heads_for(world: int, heads: int) -> int:
    """``heads`` if it splits over ``world`` ranks, else the next multiple of ``world``."""
    return heads if heads % world == 0 else world * -(-heads // world)


def make_config(args, world: int):
    from k3compile.model import KimiK3Config

    if args.config == "slice":
        return KimiK3Config.slice(num_hidden_layers=args.layers, num_experts=args.experts)
    # test sizes have 6 heads: at a world size they do not split over, take the next multiple
    heads = _heads_for(world, 6)
    overrides = {} if heads == 6 else dict(num_attention_heads=heads, num_key_value_heads=heads,
                                           linear_num_heads=heads)
    return getattr(KimiK3Config, args.config)(**overrides)


def collective_plan(text, world: int = 2) -> dict:
    """All-reduces of one forward: one for the vocabulary-split embedding, one per attention layer, one per
    dense MLP, two per latent-MoE layer (routed latent and shared experts), of which the fused tail saves
    one. None at world size 1. (The logits' all-gather is not an all-reduce.)"""
    layers = text.num_hidden_layers
    moe = sum(text.is_moe_layer(i) for i in range(layers))
    if moe and not (text.num_shared_experts and text.routed_expert_hidden_size):
        raise ValueError("the all-reduce check expects latent-MoE layers with shared experts")
    if world == 1:
        return dict(layers=layers, moe_layers=moe, unfused=0, fused=0)
    unfused = 1 + layers + (layers - moe) + 2 * moe
    return dict(layers=layers, moe_layers=moe, unfused=unfused, fused=unfused - moe)


def build_shards(args, tp, device, dtype):
    """This rank's shards of a seeded full model (same seed, same weights on every rank)."""
    from k3compile.model import KimiK3ForConditionalGeneration
    from k3compile.model.loading import convert_checkpoint

    config = make_config(args, tp.world)
    torch.manual_seed(args.seed)
    with torch.device(device):
        full = KimiK3ForConditionalGeneration(config).eval()
    checksum = sum(p.detach().sum(dtype=torch.float64).item() for p in full.parameters())
    with torch.device("meta"):
        shape_only = KimiK3ForConditionalGeneration(config, tp)
    state = convert_checkpoint(shape_only, full.state_dict(), dtype, tp)
    del full
    return config, state, checksum


def load_shards(config, state, tp):
    from k3compile.model import KimiK3ForConditionalGeneration

    with torch.device("meta"):
        model = KimiK3ForConditionalGeneration(config, tp)
    model.load_state_dict(state, strict=True, assign=True)   # both variants share the weight tensors
    return model.eval()


# ---------------------------------------------------------------------------------------------
# graph counting

def _op_name(node: torch.fx.Node) -> str:
    """``namespace.op`` of a call; a mutating op wrapped by functionalization counts as itself."""
    target = node.target
    if "auto_functionalized" in str(target) and node.args:
        target = node.args[0]
    return str(target).rsplit(".", 1)[0]


class CollectiveCounter(CustomGraphPass):
    """Counts collectives and k3 ops in each post-grad graph, under the label of the current phase."""

    def __init__(self):
        self.phase = None
        self.graphs: dict[str, list[dict]] = {}

    def __call__(self, graph: torch.fx.Graph) -> None:
        ops = Counter(_op_name(n) for n in graph.nodes if n.op == "call_function")
        counts = {"all_reduce": sum(n for name, n in ops.items() if name.startswith(ALL_REDUCE)),
                  "latent_moe_tail": ops.get(TAIL_OP, 0),
                  "k3_ops": {name: n for name, n in ops.items() if name.startswith("k3.")}}
        self.graphs.setdefault(self.phase, []).append(counts)

    def uuid(self):
        return None   # no identity: Inductor bypasses its caches, so this pass sees every graph

    def take(self, phase: str) -> dict:
        graphs = self.graphs.pop(phase, [])
        if len(graphs) != 1:
            raise RuntimeError(f"{phase}: expected one compiled graph, counted {len(graphs)}")
        return graphs[0]


# ---------------------------------------------------------------------------------------------
# decoding and timing

@torch.no_grad()
def teacher_forced(model, counter, ids, tokens, label, eager_prefill=False, spare=0):
    """Prefill ``ids`` [M, T] (compiled, or eagerly through ``forward``), then one decode step for each column of
    ``tokens`` [M, steps] (given, not sampled). Returns (logits [1 + steps, M, V] fp32: the prefill's last position
    then each step's, the cache (with ``spare`` free positions left), decode-graph counts)."""
    M, T = ids.shape
    cache = model.allocate_cache(M, T + tokens.shape[1] + spare)
    counter.graphs.clear()
    counter.phase = f"{label}/prefill"
    prefill = model.forward if eager_prefill else model   # forward() bypasses the in-place compile
    logits = [prefill(ids, cache=cache, logits_to_keep=1)[:, -1].float()]
    if not eager_prefill:
        counter.take(counter.phase)
    counter.phase = f"{label}/decode"
    for s in range(tokens.shape[1]):
        logits.append(decode_call(model, tokens[:, s:s + 1].contiguous(), cache)[:, -1].float())
    decode = counter.take(counter.phase)
    return torch.stack(logits), cache, decode


def time_decode_step(model, counter, token, cache, iters, replays):
    """Median µs of one decode step, ``iters`` steps captured in one CUDA graph, replayed
    ``replays`` times from the same cache position; the slowest rank's median, and how many graphs
    were compiled meanwhile (0 unless the timed step is not the checked one)."""
    counter.phase = "timing"
    pos0 = int(cache.pos)
    if pos0 + iters > cache.max_len:
        raise ValueError(f"cache of {cache.max_len} positions cannot hold {iters} more steps after {pos0}")

    def steps():   # one capture holds ``iters`` decode steps, each from the position the previous left
        for _ in range(iters):
            decode_call(model, token, cache)

    with torch.no_grad():
        us = graph_replay_us(steps, iters=1, replays=replays, warmup=2, reset=lambda: cache.pos.fill_(pos0))
    return us / iters, len(counter.graphs.pop("timing", []))


# ---------------------------------------------------------------------------------------------
# one rank

def launch(run, world: int, backend: str, *run_args) -> dict:
    """``run(rank, world, device, *run_args)`` in ``world`` processes of one process group (``nccl``: one GPU a
    rank, NVLink multicast off; ``gloo``: CPU processes); returns what rank 0's ``run`` returned (JSON)."""
    import torch.multiprocessing as mp

    os.environ.update(NO_MULTICAST)
    if backend == "nccl":
        if torch.cuda.device_count() < world:
            raise SystemExit(f"{world} ranks with nccl need as many GPUs, found {torch.cuda.device_count()}")
    else:
        os.environ.setdefault("TRITON_INTERPRET", "1")        # k3 Triton kernels, if chosen, on CPU
        os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")   # no compile pools per rank
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    result = Path(tempfile.mkdtemp(prefix="tp_ranks_")) / "rank0.json"
    mp.spawn(_rank_process, args=(world, port, backend, run, run_args, str(result)), nprocs=world, join=True)
    return json.loads(result.read_text())


def _rank_process(rank: int, world: int, port: int, backend: str, run, run_args, result_path: str) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), **NO_MULTICAST)
    if backend == "nccl":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
        dist.init_process_group("nccl", rank=rank, world_size=world, device_id=device)
    else:
        torch.set_num_threads(1)   # every rank shares the host's cores
        device = torch.device("cpu")
        dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        out = run(rank, world, device, *run_args)
        if rank == 0:
            Path(result_path).write_text(json.dumps(out, default=str))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def decode_rank(rank: int, world: int, device, args) -> dict:
    rows, ok = run_rank(rank, world, args, device)
    return dict(rows=rows, ok=ok)


def run_rank(rank, world, args, device):
    import torch.distributed as dist

    import k3compile
    from k3compile.model import TPContext

    say = (lambda *a: print(*a, flush=True)) if rank == 0 else (lambda *a: None)
    tp = TPContext.from_group()
    dtype = DTYPES[args.dtype]
    t0 = time.perf_counter()
    config, state, checksum = build_shards(args, tp, device, dtype)
    sums = [None] * world
    dist.all_gather_object(sums, checksum)
    if len(set(sums)) != 1:
        raise RuntimeError(f"ranks built different full models (parameter sums {sums})")
    text = config.text_config
    plan = collective_plan(text, world)
    say(f"TP={world} {args.backend} on {device.type}, config {args.config}: {text.num_hidden_layers} layers "
        f"({plan['moe_layers']} MoE, {text.num_experts} experts), hidden {text.hidden_size}, heads "
        f"{text.num_attention_heads}/{text.linear_attn_config['num_heads']}, {args.dtype}; built in "
        f"{time.perf_counter() - t0:.1f} s")

    counter_u, counter_f = CollectiveCounter(), CollectiveCounter()
    unfused = load_shards(config, state, tp)
    unfused.compile(dynamic=False, fullgraph=True, options={"post_grad_custom_post_pass": counter_u})
    fused = load_shards(config, state, tp)
    k3compile.optimize(fused, backend=args.k3_backend, dynamic=False, fullgraph=True,
                       options={"post_grad_custom_post_pass": counter_f})   # chained after ours

    timed = args.backend == "nccl" and not args.no_time
    tol = args.tol if args.tol is not None else LOGITS_TOLERANCE[dtype]
    spare = args.iters + 1 if timed else 1
    rows, ok = [], True
    for m in args.batch:
        torch._dynamo.reset()   # a fresh compile per M: every graph passes through the counters
        ids = torch.randint(0, text.vocab_size, (m, args.prompt),
                            generator=torch.Generator().manual_seed(args.seed + m)).to(device)
        tokens = torch.randint(0, text.vocab_size, (m, args.steps),
                               generator=torch.Generator().manual_seed(args.seed + 1000 + m)).to(device)
        t1 = time.perf_counter()
        logits_u, cache_u, graph_u = teacher_forced(unfused, counter_u, ids, tokens, "unfused", args.eager_prefill,
                                                    spare)
        t2 = time.perf_counter()
        logits_f, cache_f, graph_f = teacher_forced(fused, counter_f, ids, tokens, "fused", args.eager_prefill, spare)
        t3 = time.perf_counter()
        finite = bool(torch.isfinite(logits_u).all() and torch.isfinite(logits_f).all())
        same = compare_logits(logits_f, logits_u, tol)
        row = dict(m=m, logits_ok=same["ok"], logits_finite=finite, logits_rel_err=same["rel_err"],
                   logits_rel_err_max=same["rel_err_max"],
                   logits_rel_err_steps=same["rel_err_steps"], top1_agree=same["top1_agree"],
                   unfused_all_reduce=graph_u["all_reduce"], fused_all_reduce=graph_f["all_reduce"],
                   fused_tails=graph_f["latent_moe_tail"], fused_k3_ops=graph_f["k3_ops"],
                   fused_pass_matches=decode_matches(fused),
                   seconds_unfused=t2 - t1, seconds_fused=t3 - t2)
        if timed:
            last = tokens[:, -1:].contiguous()
            row["unfused_us"], row["unfused_timing_recompiles"] = time_decode_step(
                unfused, counter_u, last, cache_u, args.iters, args.replays)
            row["fused_us"], row["fused_timing_recompiles"] = time_decode_step(
                fused, counter_f, last, cache_f, args.iters, args.replays)
        per_rank = [None] * world
        dist.all_gather_object(per_rank, row)
        good = check(per_rank, plan)
        ok &= good
        say(f"M={m}: unfused {t2 - t1:.1f} s, fused {t3 - t2:.1f} s (compile + {args.steps} steps), "
            f"{'ok' if good else 'MISMATCH'}")
        if any(r.get("unfused_timing_recompiles") or r.get("fused_timing_recompiles") for r in per_rank):
            say(f"M={m}: note: a graph was compiled while timing; the timed step is not the checked one")
        rows.append(dict(per_rank[0], ranks=per_rank, expected=plan, ok=good))
        del cache_u, cache_f
    say(table(rows, world))
    if not ok:
        say("MISMATCH: see the rows marked above")
    return rows, ok


def decode_matches(model) -> dict:
    """Per k3 pass, its matches in the graph compiled last (the decode step), from the report."""
    import k3compile

    record = k3compile.report(model).graphs[-1].record
    return dict(record.matches) if record is not None else {}


def check(per_rank: list[dict], plan: dict) -> bool:
    """Every rank: finite logits within tolerance of the unfused run's, the unfused graph holds the model's
    all-reduces and the fused one one per MoE layer fewer."""
    return all(r["logits_finite"] and r["logits_ok"] and r["unfused_all_reduce"] == plan["unfused"]
               and r["fused_all_reduce"] == plan["fused"]
               for r in per_rank)


def table(rows: list[dict], world: int) -> str:
    head = (f"{'M':>3} {'AR unfused':>10} {'AR fused':>9} {'want':>5} {'tails':>5} {'logits':>7} "
            f"{'logits rel':>10} {'top-1':>6} {'unfused us':>10} {'fused us':>9} {'speedup':>7}  ranks")
    lines = [head]
    for r in rows:
        ranks = r["ranks"]
        ar_u = "/".join(sorted({str(x["unfused_all_reduce"]) for x in ranks}))
        ar_f = "/".join(sorted({str(x["fused_all_reduce"]) for x in ranks}))
        tails = "/".join(sorted({str(x["fused_tails"]) for x in ranks}))
        logits = ("NaN" if not all(x["logits_finite"] for x in ranks)
                  else "ok" if all(x["logits_ok"] for x in ranks) else "DIFFER")
        rel = max(x["logits_rel_err"] for x in ranks)
        top1 = min(x["top1_agree"] for x in ranks)
        us_u, us_f = r.get("unfused_us"), r.get("fused_us")
        timing = (f"{us_u:>10.1f} {us_f:>9.1f} {us_u / us_f:>7.2f}" if us_u and us_f
                  else f"{'-':>10} {'-':>9} {'-':>7}")
        lines.append(f"{r['m']:>3} {ar_u:>10} {ar_f:>9} {r['expected']['fused']:>5} {tails:>5} {logits:>7} "
                     f"{rel:>10.2e} {100 * top1:>5.0f}% {timing}  {len(ranks)}/{world} "
                     f"{'ok' if r['ok'] else 'MISMATCH'}")
    lines.append("AR: all-reduce nodes (functional and k3::all_reduce_) in the decode graph (all ranks); want: the "
                 "fused count expected; tails: k3::latent_moe_tail nodes; logits: the teacher-forced steps within "
                 "tolerance of the unfused run's (logits rel: the median row's relative error; top-1: rows keeping "
                 "its argmax); us: one decode step under a CUDA graph, slowest rank")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------

def main(argv=None) -> int:
    args = parse_args(argv)
    t0 = time.time()
    out = launch(decode_rank, args.world_size, args.backend, args)
    if args.json:
        meta = dict(argv=sys.argv[1:] if argv is None else list(argv), world_size=args.world_size,
                    backend=args.backend, config=args.config, dtype=args.dtype, k3_backend=args.k3_backend,
                    torch=torch.__version__, seconds=time.time() - t0,
                    device=torch.cuda.get_device_name() if args.backend == "nccl" else "cpu",
                    nccl=".".join(map(str, torch.cuda.nccl.version())) if args.backend == "nccl" else None,
                    env={k: os.environ[k] for k in NO_MULTICAST})
        Path(args.json).write_text(json.dumps(dict(meta=meta, rows=out["rows"], ok=out["ok"]), indent=1))
        print("wrote", args.json)
    return 0 if out["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
