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
