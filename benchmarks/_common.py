"""What every GPU benchmark here shares: the same-run HBM copy ceiling (docs/anchors.md, "Method")."""
import torch


def copy_ceiling_tbps() -> float:
    """Bytes read + written per second by a 1 GiB bf16 device-to-device ``copy_`` (2 GiB moved): the 100% line.

    The best of the events-timed and the graph-timed median: on the H200 a graph-timed copy of this size has
    read ~2.7 TB/s in runs where the events-timed one read ~4.2 TB/s, the figure anchors.md measured.
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
