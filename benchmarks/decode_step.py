"""The Kimi K3 decode step end to end against the weight-stream floor (issue #30): eager, ``torch.compile``,
``max-autotune-no-cudagraphs`` and ``k3compile.optimize`` on one tensor-parallel rank.

    # one TP = 8 rank on one GPU: K3 widths and the rank's shapes, 896 experts, 4 layers, bf16
    python benchmarks/decode_step.py --tp 8 --layers 4 --batch 1,8 --context 1024 --providers compile,optimize
    # every M and both contexts; max-autotune compiles for many minutes (opt in by naming it)
    python benchmarks/decode_step.py --tp 8 --batch 1,2,4,8,16,32,64 --context 1024,65536 \\
        --providers eager,compile,max-autotune,optimize --json step.json --plot step.svg
    # all 93 layers of a TP = 16 rank with MXFP4 experts (~110 GB; python -m k3compile.model.plan --tp 16)
    python benchmarks/decode_step.py --tp 16 --layers 93 --experts mxfp4 --batch 1,8 --providers compile,optimize
    # the same with optimize()'s regions (a compile that does not grow with depth), checked against itself
    python benchmarks/decode_step.py --tp 16 --layers 93 --experts mxfp4 --batch 1 --providers optimize \
        --reference optimize --regions
    # real TP: one process a GPU (NCCL), each building its own rank
    python benchmarks/decode_step.py --world-size 8 --batch 1,8 --providers compile,optimize
    # the whole script on the CPU with a micro config, in seconds (CI)
    python benchmarks/decode_step.py --dry-run

The rank (``--world-size 1``): the model is built on the meta device with ``TPContext(0, tp)``, so every module
has the local shapes of rank 0 of ``--tp``, and its collectives run on a process group of one rank (NCCL on a GPU,
gloo on the CPU): the compiled graph is the TP graph, all-reduces included, at one GPU's cost. Weights are
random (``init_weights``: each rank's slices from the full model's distribution; MXFP4 codes random with scales
of the same RMS), materialised on the device, bf16 (``--dtype``), experts as ``--experts`` (float or mxfp4). With
``--world-size N`` each of N processes builds its rank of TP = N the same way (``tp_decode.launch``).

The cache is filled with seeded random values as if ``--context`` tokens were in it (the MLA latent rows of that
valid prefix, random KDA states; allocated for ``context + --steps`` positions). Per (provider, M, context):

- ``check``: ``--steps`` teacher-forced steps (given random tokens, not sampled), each from that same filled cache,
  their logits against the reference provider's (``--reference``, default ``compile``) for the same tokens: each
  row's relative error ||a - b|| / ||b|| over the vocabulary, the median over (step, row) within ``--tol`` (bf16
  2e-2, fp32 1e-4; ``_common.compare_logits``). The median, not the worst row: in bf16 a row's top-k can pick
  another expert at a near-tie of the router's scores, no error but 10-40% off in that row's logits, for a few
  percent of the tokens a layer (so, over many layers, for most rows: deep models check loosely in 16 bits). The
  worst row, the share within the tolerance and the share keeping the reference's top-1 are reported;
- ``us``: one step under CUDA graphs: the ``--steps`` steps captured in one graph and replayed (``cache.pos``
  rewound before each replay), median over ``--replays``, divided by the steps (the slowest rank's median);
- ``floor``: the bytes the step must move, at the HBM copy ceiling measured in the same run
  (``_common.copy_ceiling_tbps``): every weight of the text tower once, except the routed experts (the distinct
  experts of each MoE layer from the routing of the checked steps, computed eagerly, times one expert's bytes in
  its stored form) and the embedding (the M rows looked up); the MLA latent cache's valid prefix (read) and the
  new rows (written); each KDA state read and written; the logits written. Averaged over the steps;
- ``% floor`` = floor / us, tokens per second = M / us;
- ``kernels`` per step and a breakdown by category (``_breakdown.py``) from a ``torch.profiler`` run of
  ``--profile-steps`` steps outside the graph (each kernel's name and launcher), timed by a profile of replays of
  the same steps in one CUDA graph where its kernels are the same (``breakdown.timed_in_graph`` in the JSON; gaps =
  the graph time minus the kernels' time: the device's idle time in the step).

Prints a table, writes ``--json`` after every point (a run stopped by a time limit keeps what it measured) and a
stacked-bar SVG (``--plot``); exits 1 when a check fails. Points whose cache does not fit are reported and skipped.
"""
from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import statistics
import sys
import time
from contextlib import contextmanager
from pathlib import Path

HERE = Path(__file__).resolve().parent
if "--dry-run" in sys.argv:   # before triton is imported: k3 Triton kernels, if chosen, run in its interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

import torch  # noqa: E402

sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from _breakdown import CATEGORIES, KernelOrigins, ShapeTable, breakdown, device_kernels, graphed_timeline  # noqa: E402
from _common import LOGITS_TOLERANCE, compare_logits, decode_call  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
PROVIDERS = ("eager", "compile", "max-autotune", "optimize")


def _option(text: str) -> tuple:
    """``KEY=VALUE`` -> (key, the value as a Python literal, else the text)."""
    import ast

    key, _, value = text.partition("=")
    try:
        return key, ast.literal_eval(value)
    except (ValueError, SyntaxError):
        return key, value


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tp", type=int, default=8, help="tensor-parallel size whose rank 0 is built (--world-size 1)")
    p.add_argument("--world-size", type=int, default=1, help=">1: real TP, one process a GPU (TP = world size)")
    p.add_argument("--layers", type=int, default=4, help="decoder layers (93: the whole K3)")
    p.add_argument("--num-experts", type=int, default=896)
    p.add_argument("--experts", default=None, help="routed experts' form: mxfp4 or a float (default: --dtype)")
    p.add_argument("--dtype", choices=list(DTYPES), default=None, help="default bf16 (fp32 with --dry-run)")
    p.add_argument("--batch", type=_ints, default=[1, 2, 4, 8, 16, 32, 64], help="M values (sequences)")
    p.add_argument("--context", type=_ints, default=[1024, 65536], help="tokens already in the cache")
    p.add_argument("--providers", default="eager,compile,optimize",
                   help=f"comma-separated, from {','.join(PROVIDERS)} (max-autotune compiles for many minutes)")
    p.add_argument("--reference", default="compile", choices=PROVIDERS, help="whose logits the others must match "
                                                                             "(compiled even when not timed)")
    p.add_argument("--optimize-option", type=_option, action="append", default=[], metavar="KEY=VALUE",
                   help="an Inductor option for optimize()'s compiles only, e.g. triton.cooperative_reductions=True")
    p.add_argument("--regions", action="store_true", help="optimize(regions=True): each distinct decoder block "
                                                            "compiled once (default: optimize()'s, by depth)")
    p.add_argument("--k3-backend", default=None, help="optimize(backend=) (default auto; reference with --dry-run)")
    p.add_argument("--without-passes", default="", help="comma-separated k3 passes optimize() leaves out (an A/B)")
    p.add_argument("--steps", type=int, default=8, help="teacher-forced steps (also the steps of one CUDA graph)")
    p.add_argument("--replays", type=int, default=20)
    p.add_argument("--profile-steps", type=int, default=2, help="steps profiled for the breakdown (0: none)")
    p.add_argument("--tol", type=float, default=None, help="relative logits error allowed (default by dtype)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None)
    p.add_argument("--plot", default=None, help="stacked-bar SVG of the breakdown")
    p.add_argument("--dry-run", action="store_true", help="CPU, micro config, tiny sizes: the code paths only")
    args = p.parse_args(argv)
    args.providers = [s for s in args.providers.split(",") if s]
    bad = [s for s in args.providers if s not in PROVIDERS]
    if bad:
        p.error(f"unknown providers {bad}; choose from {PROVIDERS}")
    from k3compile.patterns import PASS_ORDER

    args.without_passes = [s for s in args.without_passes.split(",") if s]
    if set(args.without_passes) - set(PASS_ORDER):
        p.error(f"unknown passes {sorted(set(args.without_passes) - set(PASS_ORDER))}; choose from {PASS_ORDER}")
    # optimize(passes=): every pass but those, in their order; None: the default
    args.passes = [n for n in PASS_ORDER if n not in args.without_passes] if args.without_passes else None
    if args.dry_run:
        defaults = dict(tp=2, layers=2, num_experts=16, batch=[2], context=[5], steps=2, replays=2,
                        profile_steps=1, dtype="fp32", k3_backend="reference")
        given = {a.split("=")[0].lstrip("-").replace("-", "_") for a in (sys.argv[1:] if argv is None else argv)}
        for key, value in defaults.items():
            if key not in given:
                setattr(args, key, value)
    args.dtype = args.dtype or "bf16"
    args.k3_backend = args.k3_backend or "auto"
    args.experts = args.experts or args.dtype
    if min(args.batch) < 1 or min(args.context) < 1 or args.steps < 1 or args.replays < 1:
        p.error("--batch, --context, --steps and --replays must be >= 1")
    if args.world_size > 1:
        args.tp = args.world_size
    return args


# ---------------------------------------------------------------------------------------------------------------
# the rank's model

def make_config(args):
    from k3compile.model import KimiK3Config

    if args.dry_run:   # micro widths; MXFP4 needs the experts' I / tp to be a multiple of 32
        return KimiK3Config.micro(num_hidden_layers=args.layers, num_experts=args.num_experts,
                                  num_experts_per_token=min(4, args.num_experts), moe_intermediate_size=64)
    return KimiK3Config.slice(num_hidden_layers=args.layers, num_experts=args.num_experts)


def build_rank(config, tp, dtype, experts, device, seed):
    """Rank ``tp.rank`` of ``config``: built on the meta device, cast, experts in ``experts``' form, then the text
    tower materialised on ``device`` and filled by ``init_weights`` (seeded: the replicated weights are equal on
    every rank). The vision tower stays on the meta device (a decode step does not use it)."""
    from k3compile.model import KimiK3ForConditionalGeneration
    from k3compile.model.loading import assign_parameters

    with torch.device("meta"):
        model = KimiK3ForConditionalGeneration(config, tp)
    model.set_dtype(dtype).convert_experts(experts)
    text = model.language_model
    assign_parameters(text, {n: torch.empty(p.shape, dtype=p.dtype, device=device)
                             for n, p in text.named_parameters()})
    torch.manual_seed(seed)
    model.init_weights()
    return model.eval()


def share(model):
    """Another module tree over the same parameter tensors (each provider compiles its own)."""
    return copy.deepcopy(model, memo={id(p): p for p in model.parameters()})


def vocab_slice(model) -> tuple[int, int]:
    """The token ids whose embedding row this rank holds."""
    embed = model.get_input_embeddings()
    start = getattr(embed, "vocab_start", 0)
    return start, start + embed.weight.shape[0]


def fill_cache(cache, context: int, seed: int) -> None:
    """The cache as if ``context`` tokens had been decoded: random MLA latents in rows < context (zeros after),
    random KDA convolution and recurrent states (the recurrent one scaled so a unit key maps to O(1) values)."""
    g = torch.Generator(device=cache.pos.device).manual_seed(seed)
    for state in cache.layers:
        if hasattr(state, "c_kv"):
            for t in state.tensors():
                t.zero_()
                t[:, :context].normal_(generator=g)
        else:
            for t in (state.conv_q, state.conv_k, state.conv_v):
                t.normal_(generator=g)
            state.recurrent.normal_(generator=g).mul_(state.recurrent.shape[-1] ** -0.5)
    cache.pos.fill_(context)


def checked_steps(model, columns, cache, refill) -> torch.Tensor:
    """Teacher-forced steps, each from the same cache state (``refill()`` before it): columns[s] [M, 1] -> logits
    [steps, M, V] fp32. A row that differs in one step (a near-tie in the router) then leaves the others alone."""
    out = []
    with torch.no_grad():
        for c in columns:
            refill()
            out.append(decode_call(model, c, cache)[:, -1].float())
    return torch.stack(out)


# ---------------------------------------------------------------------------------------------------------------
# providers

def make_provider(name: str, base, args, options: dict):
    """The module ``name`` runs: the base model itself (eager) or a compiled one over the same weights."""
    if name == "eager":
        return base
    model = share(base)
    kw = dict(dynamic=False, fullgraph=True, options=dict(options))
    if name == "compile":
        model.compile(**kw)
    elif name == "max-autotune":       # torch.compile takes a mode or options, not both: the mode's options
        kw["options"].update(torch._inductor.list_mode_options("max-autotune-no-cudagraphs"))
        model.compile(**kw)
    else:
        import k3compile

        kw["options"].update(args.optimize_option)
        if args.passes is not None:
            kw["passes"] = args.passes
        k3compile.optimize(model, backend=args.k3_backend, regions=args.regions or None, **kw)
    return model


def pass_matches(model) -> dict:
    """optimize(): each pass's matches in the graph compiled last (this point's decode step)."""
    import k3compile

    graphs = k3compile.report(model).graphs
    record = graphs[-1].record if graphs else None
    return dict(record.matches) if record is not None else {}


# ---------------------------------------------------------------------------------------------------------------
# the floor

@contextmanager
def distinct_experts(model):
    """Yields a list that gets, for each MoE layer call (in order), the number of distinct experts its tokens
    route to (recomputed eagerly from the layer's input by the model's own ``route``)."""
    from k3compile.model.moe import KimiLatentMoE, route

    counts = []

    def hook(module, inputs):
        x = inputs[0].reshape(-1, inputs[0].shape[-1])
        _, experts = route(x, module.gate.weight, module.gate.e_score_correction_bias, module.top_k,
                           module.renormalize, module.scaling)
        counts.append(int(torch.unique(experts).numel()))

    handles = [m.register_forward_pre_hook(hook) for m in model.modules() if isinstance(m, KimiLatentMoE)]
    try:
        yield counts
    finally:
        for h in handles:
            h.remove()


def step_bytes(model, cache, M: int, pos: int, distinct: list[int]) -> dict:
    """Bytes one decode step at cache position ``pos`` must move (module doc), by part."""
    from k3compile.model.moe import KimiLatentMoE

    text = model.language_model
    weights = 0
    for name, p in text.named_parameters():
        if ".experts." not in name:
            rows = M if name.endswith("embed_tokens.weight") else (p.shape[0] if p.dim() else 1)
            weights += rows * (p[0].numel() if p.dim() else 1) * p.element_size()
    moe = [m for m in model.text_model.modules() if isinstance(m, KimiLatentMoE)]
    per_expert = [sum(p[0].numel() * p.element_size() for p in m.experts.parameters()) for m in moe]
    if len(distinct) != len(per_expert):
        raise RuntimeError(f"routing seen for {len(distinct)} MoE layers, the model has {len(per_expert)}")
    experts = sum(d * b for d, b in zip(distinct, per_expert))
    kv = state = 0
    for s in cache.layers:
        if hasattr(s, "c_kv"):
            row = sum(t.shape[-1] * t.element_size() for t in s.tensors())
            kv += M * (pos + 1) * row + M * row                  # the valid prefix and the new token read, written
        else:
            state += 2 * sum(t.numel() * t.element_size() for t in s.tensors())
    vocab = text.lm_head.weight.shape[0]
    logits = M * vocab * text.lm_head.weight.element_size()
    return dict(weights=weights, experts=experts, kv=kv, state=state, logits=logits,
                total=weights + experts + kv + state + logits)


# ---------------------------------------------------------------------------------------------------------------
# timing and profiling

def time_step(model, columns, cache, context: int, replays: int) -> tuple[float, bool, str]:
    """(µs a step, whether under a CUDA graph, why not). CUDA: ``_common.graph_replay_us`` over all the steps;
    where the capture fails, CUDA events around the steps un-graphed. CPU: the median wall time of the steps."""
    def steps():
        for c in columns:
            decode_call(model, c, cache)

    def rewind():
        cache.pos.fill_(context)

    with torch.no_grad():
        if cache.pos.is_cuda:
            from _common import graph_replay_us

            try:
                return graph_replay_us(steps, iters=1, replays=replays, warmup=2, reset=rewind) / len(columns), \
                    True, ""
            except RuntimeError as e:
                why = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
                torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            times = []
            for _ in range(replays):
                rewind()
                start.record()
                steps()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) * 1e3)
            return statistics.median(times) / len(columns), False, why
        times = []
        for _ in range(replays):
            rewind()
            t0 = time.perf_counter()
            steps()
            times.append((time.perf_counter() - t0) * 1e6)
        return statistics.median(times) / len(columns), False, "cpu"


def profile_kernels(model, columns, cache, context: int, steps: int, eager: bool, graph_replays: int = 5):
    """(kernels, whether timed in a CUDA graph): the kernels of ``steps`` un-graphed steps
    (``_breakdown.device_kernels``: names and launchers), on a GPU timed by ``graph_replays`` replays of the same
    steps captured in one CUDA graph (``_breakdown.graphed_timeline``; un-graphed, the host's launches stretch and
    overlap kernels differently from the timed step), where the capture works and runs the same kernels."""
    from torch.profiler import ProfilerActivity, profile

    on_device = cache.pos.is_cuda
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_device else [])
    cache.pos.fill_(context)
    with torch.no_grad(), profile(activities=activities, record_shapes=True, with_stack=eager) as prof:
        for c in columns[:steps]:
            decode_call(model, c, cache)
        if on_device:
            torch.cuda.synchronize()
    kernels = device_kernels(prof.events(), on_device)
    if not (on_device and graph_replays):
        return kernels, False
    try:
        with torch.no_grad():
            graph = torch.cuda.CUDAGraph()
            cache.pos.fill_(context)
            with torch.cuda.graph(graph):
                for c in columns[:steps]:
                    decode_call(model, c, cache)
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(graph_replays):   # no rewind between (its fill would join the kernels): the cache
                    graph.replay()               # holds the positions of every replay (the caller's bound)
                torch.cuda.synchronize()
        graphed = graphed_timeline(kernels, prof.events(), graph_replays)
    except RuntimeError:
        torch.cuda.synchronize()
        graphed = None
    return (graphed, True) if graphed is not None else (kernels, False)


# ---------------------------------------------------------------------------------------------------------------
# one rank

def run_point(M: int, context: int, base, models: dict, args, device, origins: KernelOrigins, ceiling) -> list:
    """Every provider at one (M, context): a row each."""
    dtype = DTYPES[args.dtype]
    tol = args.tol if args.tol is not None else LOGITS_TOLERANCE[dtype]
    lo, hi = vocab_slice(base)
    g = torch.Generator().manual_seed(args.seed + 7919 * M + context)
    tokens = torch.randint(lo, hi, (M, args.steps), generator=g).to(device)
    columns = [tokens[:, s:s + 1].contiguous() for s in range(args.steps)]
    cache = base.allocate_cache(M, context + args.steps)
    shapes = ShapeTable(base, cache)

    def refill():
        fill_cache(cache, context, args.seed)

    per_step = []                                   # eager: each step's routing (for the floor) and logits
    t0 = time.perf_counter()
    with distinct_experts(base) as counts:
        eager_logits = checked_steps(base, columns, cache, refill)
    moe = len(counts) // len(columns)
    for s in range(len(columns)):
        per_step.append(step_bytes(base, cache, M, context, counts[s * moe:(s + 1) * moe]))
    eager_s = time.perf_counter() - t0
    floor_bytes = {k: statistics.mean(b[k] for b in per_step) for k in per_step[0]}
    floor_us = floor_bytes["total"] / (ceiling * 1e12) * 1e6 if ceiling else None

    order = [args.reference] + [p for p in args.providers if p != args.reference]
    ref_logits, rows = None, []
    profiles = []   # (row, model, eager, its kernels' categories): profiled once every provider is timed
    for name in order:
        row = dict(provider=name, m=M, context=context, floor_us=floor_us, floor_bytes=floor_bytes,
                   timed=name in args.providers)
        try:
            model = models[name]
            origins.clear()
            t0 = time.perf_counter()
            with origins.recording():
                logits = eager_logits if name == "eager" else checked_steps(model, columns, cache, refill)
            row["first_steps_s"] = eager_s if name == "eager" else time.perf_counter() - t0   # compile + steps
            if name == "optimize":
                row["pass_matches"] = pass_matches(model)
            if ref_logits is None:
                ref_logits = logits
                row["check"] = dict(rel_err=0.0, top1_agree=1.0, reference=True, ok=bool(torch.isfinite(logits).all()))
            else:
                row["check"] = compare_logits(logits, ref_logits, tol)
            if name not in args.providers:
                rows.append(row)
                continue
            fill_cache(cache, context, args.seed)
            us, graphed, why = time_step(model, columns, cache, context, args.replays)
            row.update(us=us, cuda_graph=graphed, tokens_per_s=M * 1e6 / us)
            if why:
                row["timing_note"] = why
            if floor_us:
                row["pct_floor"] = 100.0 * floor_us / us
            if args.profile_steps:
                profiles.append((row, model, name == "eager", dict(origins.categories)))
        except Exception as e:   # one provider failing leaves the others' figures
            row["error"] = f"{type(e).__name__}: {str(e)[:500]}"
            if device.type == "cuda" and isinstance(e, torch.OutOfMemoryError):
                torch.cuda.empty_cache()
        rows.append(row)
    # after every timing: a provider timed after a profiler session ran 10% slower (docs/measuring.md)
    for row, model, eager, categories in profiles:
        try:
            origins.categories = categories
            n = min(args.profile_steps, len(columns))
            kernels, graphed = profile_kernels(model, columns, cache, context, n, eager=eager,
                                               graph_replays=min(5, len(columns) // n))
            row["breakdown"] = breakdown(kernels, n, row["us"], origins, shapes)
            row["breakdown"]["timed_in_graph"] = graphed
            row["kernels_per_step"] = row["breakdown"]["kernels_per_step"]
        except Exception as e:
            row["error"] = f"profile: {type(e).__name__}: {str(e)[:500]}"
    del cache
    return rows


def run_rank(rank: int, world: int, device, args, tp) -> dict:
    """Build the rank, then every point. Returns the result (rank 0's rows, every rank's check)."""
    import torch.distributed as dist

    say = (lambda *a: print(*a, flush=True)) if rank == 0 else (lambda *a: None)
    t0 = time.perf_counter()
    config = make_config(args)
    dtype = DTYPES[args.dtype]
    base = build_rank(config, tp, dtype, args.experts, device, args.seed)
    text = config.text_config
    nbytes = sum(p.numel() * p.element_size() for p in base.language_model.parameters())
    say(f"rank {tp.rank} of TP {tp.world} ({'world of one' if world == 1 else f'{world} processes'}) on "
        f"{device}: {text.num_hidden_layers} layers, {text.num_experts} experts ({args.experts}), {args.dtype}, "
        f"{nbytes / 1e9:.2f} GB of weights, built in {time.perf_counter() - t0:.1f} s")
    ceiling = None
    if device.type == "cuda":
        from _common import copy_ceiling_tbps

        ceiling = copy_ceiling_tbps()
        say(f"copy ceiling {ceiling:.2f} TB/s")
    # On the GPU every graph is generated here (no FX cache), so its kernels get their categories; the dry run
    # keeps the cache (its figures mean nothing) and profiles Inductor's C++ kernels.
    options = {"cpp.enable_kernel_profile": True} if args.dry_run else {"fx_graph_cache": False}
    names = list(dict.fromkeys([args.reference] + args.providers))
    models = {name: make_provider(name, base, args, options) for name in names}
    meta = dict(argv=sys.argv[1:], tp=tp.world, world_size=world, layers=text.num_hidden_layers,
                experts=text.num_experts, experts_form=args.experts, dtype=args.dtype, k3_backend=args.k3_backend,
                vocab=text.vocab_size, steps=args.steps, replays=args.replays, reference=args.reference,
                weight_bytes=nbytes, copy_ceiling_tbps=ceiling, optimize_options=dict(args.optimize_option),
                regions=args.regions or None, torch=torch.__version__,   # None: optimize()'s default, by depth
                device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (dry run)")
    rows, ok = [], True
    for context in args.context:
        for M in args.batch:
            torch._dynamo.reset()      # each point compiles its own graphs
            try:
                point = run_point(M, context, base, models, args, device, KernelOrigins(), ceiling)
            except torch.OutOfMemoryError as e:
                point = [dict(provider="*", m=M, context=context, error=f"OutOfMemoryError: {str(e)[:200]}")]
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
            if world > 1:
                ranks = [None] * world
                dist.all_gather_object(ranks, [row_ok(r) for r in point])
                for r, oks in zip(point, zip(*ranks)):
                    r["ranks_ok"] = list(oks)
            for r in point:
                ok &= all(r.get("ranks_ok", [row_ok(r)]))
                say(line(r))
            rows += point
            if rank == 0 and args.json:
                write_json(args.json, dict(meta=meta, rows=rows, ok=ok))
    meta["seconds"] = time.perf_counter() - t0
    result = dict(meta=meta, rows=rows, ok=ok, goals=goals(rows, text.num_hidden_layers))
    say(table(rows))
    say("\n".join(g["line"] for g in result["goals"]))
    if rank == 0:
        if args.json:
            write_json(args.json, result)
            say(f"wrote {args.json}")
        if args.plot:
            say(plot(rows, args.plot))
    say("all checks passed" if ok else "MISMATCH: see the rows above")
    return result


def row_ok(r: dict) -> bool:
    """The row's check passed, or its point did not fit in memory (skipped, not wrong)."""
    if "error" in r:
        return r["error"].startswith("OutOfMemoryError")
    return bool(r["check"]["ok"])


def write_json(path: str, result: dict) -> None:
    tmp = f"{path}.tmp"
    Path(tmp).write_text(json.dumps(result, indent=1, default=str))
    os.replace(tmp, path)


# ---------------------------------------------------------------------------------------------------------------
# output

def line(r: dict) -> str:
    head = f"{r['provider']:>12} M={r['m']:<3} ctx={r['context']:<6}"
    if "error" in r:
        return f"{head} ERROR {r['error']}"
    c = r["check"]
    check = "reference" if c.get("reference") else \
        f"rows' rel err median {c['rel_err']:.1e} (max {c['rel_err_max']:.1e}), top-1 {100 * c['top1_agree']:.0f}%"
    check += "" if c["ok"] else " MISMATCH"
    if "us" not in r:
        return f"{head} {check} (not timed; {r['first_steps_s']:.1f} s to compile and run)"
    floor = f", {r['pct_floor']:.1f}% of floor {r['floor_us']:.1f} us" if r.get("pct_floor") else ""
    graph = "" if r["cuda_graph"] else f" [no CUDA graph: {r.get('timing_note', '')}]"
    kernels = f", {r['kernels_per_step']:.0f} kernels" if "kernels_per_step" in r else ""
    return (f"{head} {r['us']:9.1f} us{floor}, {r['tokens_per_s']:.0f} tok/s{kernels}; {check}; "
            f"first steps {r['first_steps_s']:.1f} s{graph}")


def table(rows: list) -> str:
    timed = [r for r in rows if "us" in r]
    cats = [c for c in CATEGORIES if any(r.get("breakdown", {}).get("us", {}).get(c) for r in timed)]
    head = f"{'provider':>12} {'M':>3} {'ctx':>6} {'us':>9} {'floor':>8} {'%':>5} {'tok/s':>8} {'kern':>5} " \
           + " ".join(f"{c[:9]:>9}" for c in cats)
    out = [head]
    for r in timed:
        b = r.get("breakdown", {}).get("us", {})
        floor = f"{r['floor_us']:8.1f} {r['pct_floor']:5.1f}" if r.get("pct_floor") else f"{'-':>8} {'-':>5}"
        out.append(f"{r['provider']:>12} {r['m']:>3} {r['context']:>6} {r['us']:9.1f} {floor} "
                   f"{r['tokens_per_s']:8.0f} {r.get('kernels_per_step', 0):5.0f} "
                   + " ".join(f"{b.get(c, 0):9.1f}" for c in cats))
    out.append("us: one step under a CUDA graph; floor: its bytes at the copy ceiling; kern: kernels a step; "
               "then us a step by category (torch.profiler of the step's CUDA-graph replays, else of un-graphed steps; "
               "each kernel charged the time no earlier kernel covered; gaps = graph time - kernel time)")
    return "\n".join(out)


def goals(rows: list, layers: int) -> list[dict]:
    """Issue #30's goals per point, where optimize() and torch.compile were both timed: optimize() >= 1.5x compile at
    M = 1 and >= 2x at M = 8, faster than max-autotune, >= 80% of the floor at M <= 16, kernels per layer at most
    half of compile's."""
    by = {(r["m"], r["context"], r["provider"]): r for r in rows if "us" in r}
    out = []
    for m, ctx in dict.fromkeys((r["m"], r["context"]) for r in rows if "us" in r):
        opt, comp, tuned = (by.get((m, ctx, p)) for p in ("optimize", "compile", "max-autotune"))
        if opt is None or comp is None:
            continue
        g = dict(m=m, context=ctx, speedup=comp["us"] / opt["us"], pct_floor=opt.get("pct_floor"),
                 kernels_per_layer=opt.get("kernels_per_step", 0) / layers,
                 compile_kernels_per_layer=comp.get("kernels_per_step", 0) / layers)
        want = {1: 1.5, 8: 2.0}.get(m)
        text = f"goals M={m} ctx={ctx}: optimize x{g['speedup']:.2f} of torch.compile" + \
               (f" (goal {want})" if want else "")
        if tuned is not None:
            g["vs_max_autotune"] = tuned["us"] / opt["us"]
            text += f", x{g['vs_max_autotune']:.2f} of max-autotune (goal > 1)"
        if g["pct_floor"] is not None:
            text += f", {g['pct_floor']:.0f}% of the floor" + (" (goal 80)" if m <= 16 else "")
        text += f", {g['kernels_per_layer']:.1f} kernels a layer against {g['compile_kernels_per_layer']:.1f} " \
                f"(goal at most half)"
        g["line"] = text
        out.append(g)
    return out


COLORS = {"experts": "#4e79a7", "router": "#f28e2b", "dense GEMMs": "#e15759", "KDA": "#76b7b2", "MLA": "#59a14f",
          "AttnRes and norms": "#edc948", "collectives": "#b07aa1", "glue": "#ff9da7", "gaps": "#bab0ac"}


def plot(rows: list, path: str) -> str:
    """A stacked bar per (point, provider): µs a step by category, the floor as a black tick. Plain SVG."""
    bars = [r for r in rows if "breakdown" in r]
    if not bars:
        return f"no breakdown to plot; {path} not written"
    top = max(max(r["us"], r.get("floor_us") or 0) for r in bars)
    width, height, left, bottom, bar = 60 + 34 * len(bars) + 200, 420, 60, 330, 26
    scale = (bottom - 30) / top
    svg = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" '
           f'font-size="10">', f'<line x1="{left}" y1="{bottom}" x2="{width - 200}" y2="{bottom}" stroke="black"/>']
    for tick in range(5):
        us = top * tick / 4
        y = bottom - us * scale
        svg.append(f'<text x="{left - 4}" y="{y + 3:.1f}" text-anchor="end">{us:.0f}</text>')
    for i, r in enumerate(bars):
        x, y = left + 8 + 34 * i, bottom
        for cat in CATEGORIES:
            h = r["breakdown"]["us"].get(cat, 0) * scale
            if h > 0:
                y -= h
                svg.append(f'<rect x="{x}" y="{y:.1f}" width="{bar}" height="{h:.1f}" fill="{COLORS[cat]}">'
                           f'<title>{r["provider"]} M={r["m"]} ctx={r["context"]}: {cat} '
                           f'{r["breakdown"]["us"][cat]:.1f} us</title></rect>')
        if r.get("floor_us"):
            fy = bottom - r["floor_us"] * scale
            svg.append(f'<line x1="{x - 3}" y1="{fy:.1f}" x2="{x + bar + 3}" y2="{fy:.1f}" stroke="black" '
                       f'stroke-width="2"/>')
        label = f'{r["provider"]} M{r["m"]} {r["context"] // 1024 if r["context"] >= 1024 else r["context"]}' \
                f'{"K" if r["context"] >= 1024 else ""}'
        svg.append(f'<text transform="translate({x + bar / 2:.1f},{bottom + 8}) rotate(60)">{label}</text>')
    for j, cat in enumerate(CATEGORIES):
        y = 30 + 16 * j
        svg.append(f'<rect x="{width - 190}" y="{y - 9}" width="10" height="10" fill="{COLORS[cat]}"/>'
                   f'<text x="{width - 175}" y="{y}">{cat}</text>')
    svg.append(f'<text x="{width - 190}" y="{30 + 16 * len(CATEGORIES)}">black tick: the floor</text>')
    svg.append(f'<text x="{left}" y="14">us a decode step by category</text></svg>')
    Path(path).write_text("\n".join(svg))
    return f"wrote {path}"


# ---------------------------------------------------------------------------------------------------------------

@contextmanager
def world_of_one(device):
    """A process group of this process alone (NCCL on a GPU, gloo on the CPU); yields its name."""
    import torch.distributed as dist

    kw = dict(device_id=device) if device.type == "cuda" else {}
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=dist.HashStore(), rank=0,
                            world_size=1, **kw)
    try:
        yield dist.group.WORLD.group_name
    finally:
        dist.destroy_process_group()


def rank_main(rank: int, world: int, device, args) -> dict:
    """One process of ``--world-size N`` (``tp_decode.launch``): rank ``rank`` of TP = N."""
    from k3compile.model import TPContext

    return run_rank(rank, world, device, args, TPContext.from_group())


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.world_size > 1:
        from tp_decode import launch

        result = launch(rank_main, args.world_size, "gloo" if args.dry_run else "nccl", args)
        return 0 if result["ok"] else 1
    from k3compile.model import TPContext
    from tp_decode import NO_MULTICAST

    os.environ.update(NO_MULTICAST)
    if args.dry_run:
        device = torch.device("cpu")
        torch.set_num_threads(1)
    elif not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU (or --dry-run)")
    else:
        device = torch.device("cuda", torch.cuda.current_device())
    with world_of_one(device) as group:
        result = run_rank(0, 1, device, args, TPContext(rank=0, world=args.tp, group_name=group))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
