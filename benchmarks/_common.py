"""What every GPU benchmark here shares: the same-run HBM copy ceiling (docs/measuring.md), graph-timed
replays, and providers timed in interleaved passes."""
import torch


def copy_ceiling_tbps() -> float:
    """Bytes read + written per second by a 1 GiB bf16 device-to-device ``copy_`` (2 GiB moved): the 100% line.

    The best of the events-timed and the graph-timed median: on the H200 a graph-timed copy of this size has
    read ~2.7 TB/s in runs where the events-timed one read ~4.2 TB/s, the anchor figure of docs/measuring.md.
    """
    from triton.testing import do_bench, do_bench_cudagraph

    n = 2**30 // 2
    src = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    ms = min(do_bench(lambda: dst.copy_(src), rep=200, return_mode="median"),
             do_bench_cudagraph(lambda: dst.copy_(src), rep=100, return_mode="median"))
    del src, dst
    torch.cuda.empty_cache()
    return 2 * n * 2 / (ms * 1e-3) / 1e12


def graph_replay_us(fn, *, iters: int, replays: int, warmup: int, reset=None) -> float:
    """Median µs of one ``fn()`` when ``iters`` calls are captured in one CUDA graph and replayed ``replays``
    times; under a process group, the slowest rank's median (all ranks of the default group).

    Every rank replays the same fixed count (``do_bench_cudagraph`` picks its count per process, which would let
    the ranks' collectives fall out of step). ``reset()`` runs before each warm-up call, the capture and each
    replay (e.g. to rewind a cache position). Warm-up runs on a side stream, so lazily compiled kernels are built
    before the capture, never inside it.
    """
    import torch.distributed as dist

    reset = reset or (lambda: None)
    ranks = dist.is_available() and dist.is_initialized()
    barrier = dist.barrier if ranks else (lambda: None)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            reset()
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    barrier()
    graph = torch.cuda.CUDAGraph()
    reset()
    with torch.cuda.graph(graph):
        for _ in range(iters):
            fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(replays):
        reset()
        barrier()
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / iters)
    del graph
    median = sorted(times)[len(times) // 2]
    if not ranks:
        return median
    median = torch.tensor([median], device="cuda")
    dist.all_reduce(median, op=dist.ReduceOp.MAX)
    return median.item()


def interleaved_passes(timers: dict, passes: int) -> dict:
    """{key: [each pass's result]}: every timer called once per pass, in turn, pass after pass, so that no
    provider's figure is left to whatever state (clocks, L2, allocator) its one slot in the order meets."""
    samples = {key: [] for key in timers}
    for _ in range(max(1, passes)):
        for key, timer in timers.items():
            samples[key].append(timer())
    return samples


def medians(samples: dict) -> dict:
    """{key: the median of its passes} of ``interleaved_passes``' result."""
    return {key: sorted(v)[len(v) // 2] for key, v in samples.items()}


def write_rows(path, rows: list) -> None:
    """A micro-benchmark's JSON where ``path`` is given: the device, torch, its argv and its rows."""
    import json
    import sys

    if path:
        with open(path, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, argv=sys.argv[1:], rows=rows),
                      f, indent=1)


# Teacher-forced checks (every decode benchmark): each step's logits against a reference's for the same given tokens.
# Free-running greedy tokens fail at bf16 ties and hide real errors behind them. Rows can also differ for a reason
# that is no error: in 16 bits a token's top-k may pick another expert at a near-tie of the router's scores (at K3's
# widths, a few percent of the tokens of a layer), which moves that row's logits by 10-40%. So the check is on the
# median over (step, row) of each row's relative error; the worst row and the share within the tolerance are reported.
LOGITS_TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 2e-2, torch.float32: 1e-4}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64; NaN unless ``out`` is finite."""
    if not torch.isfinite(out).all():
        return float("nan")
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def compare_logits(logits: torch.Tensor, ref: torch.Tensor, tol: float) -> dict:
    """logits, ref [steps, M, V]: each row's relative error ||a - b|| / ||b|| over V; ``ok`` when every logit is finite
    and the median over (step, row) is within ``tol``. Also: the median, 90th percentile and worst error, each
    step's error over [M, V], the share of rows within ``tol`` and the share keeping the reference's top-1."""
    if not torch.isfinite(logits).all():
        nan = float("nan")
        return dict(rel_err=nan, rel_err_p90=nan, rel_err_max=nan, within_tol=0.0, top1_agree=0.0, ok=False,
                    rel_err_steps=[nan] * logits.shape[0])
    a, b = logits.double(), ref.double()
    rows = ((a - b).norm(dim=-1) / b.norm(dim=-1)).flatten()            # [steps * M]
    median = rows.median().item()
    return dict(rel_err=median, rel_err_p90=rows.quantile(0.9).item(), rel_err_max=rows.max().item(),
                rel_err_steps=[rel_err(x, y) for x, y in zip(logits, ref)],
                within_tol=(rows <= tol).double().mean().item(),
                top1_agree=(logits.argmax(-1) == ref.argmax(-1)).double().mean().item(), ok=bool(median <= tol))


def decode_call(model, token: torch.Tensor, cache) -> torch.Tensor:
    """One decode step through ``nn.Module.__call__`` (the compiled path where the model was compiled in place),
    skipping the K3 model's own ``__call__``: it checks the ids on the host, a sync no CUDA graph can hold."""
    return torch.nn.Module.__call__(model, token, cache=cache, logits_to_keep=1)


def within(seconds: float, fn, error):
    """``fn()``, interrupted by raising ``error()`` once it has run ``seconds`` (a SIGALRM timer: main thread only)."""
    import signal

    def alarm(signum, frame):
        raise error()

    previous = signal.signal(signal.SIGALRM, alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        return fn()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
