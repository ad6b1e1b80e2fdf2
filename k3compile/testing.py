"""Helpers the test suite (and GPU benchmarks' correctness checks) share."""
import torch


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """‖out − ref‖ / ‖ref‖ in float64. A NaN anywhere in ``out`` fails: an unwritten (NaN-poisoned) element or
    bad math must never pass as a large-but-finite error."""
    assert not torch.isnan(out).any(), "NaN in the output (unwritten element or bad math)"
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def check_chain_replays(graph, x: torch.Tensor, out: torch.Tensor, weights: list, max_rel: float,
                        replays: int = 3) -> None:
    """Replay a captured chain of skinny products (each reading the one before: ``x @ w0ᵀ @ w1ᵀ …``) on fresh
    ``x``, ``out`` NaN-poisoned before each replay; it must match the chain rounded to x's dtype after every
    product, as the kernels round (a PDL kernel that read its input before the previous one wrote it fails here)."""
    for _ in range(replays):
        x.copy_(torch.randn_like(x))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref = x.double()
        for w in weights:
            ref = (ref @ w.double().T).to(x.dtype).double()
        assert rel_err(out, ref) < max_rel


def latent_moe_tail_inputs(m: int, l: int, d: int, dtype: torch.dtype, seed: int = 0, scale: float = 1.0):
    """Random (latent [m, l], shared [m, d], norm weight [l], up weight [d, l]) for the latent-MoE tail, drawn
    on the CPU from ``seed``; ``scale`` multiplies the latent (large values probe fp16 overflow)."""
    g = torch.Generator().manual_seed(seed)
    latent = (torch.randn(m, l, generator=g) * scale).to(dtype)
    shared = torch.randn(m, d, generator=g).to(dtype)
    norm_weight = (1 + 0.1 * torch.randn(l, generator=g)).to(dtype)
    up_weight = (torch.randn(d, l, generator=g) / l ** 0.5).to(dtype)
    return latent, shared, norm_weight, up_weight


def ptx_in_a_fresh_process(script: str, flavours: dict) -> dict:
    """Run ``script`` (which compiles kernels with ``triton.compile`` for a GPU target — Triton's NVIDIA backend
    needs no GPU — and prints one JSON line of name -> PTX) on ``json.dumps(flavours)``, in a process without
    ``TRITON_INTERPRET`` (under it nothing is compiled) that imports this checkout of k3compile; returns that JSON."""
    import json
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in [env.get("PYTHONPATH")] if p])
    run = subprocess.run([sys.executable, "-c", script, json.dumps(flavours)], env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    return json.loads(run.stdout.strip().splitlines()[-1])
