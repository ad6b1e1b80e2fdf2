"""The Triton path of ``k3::kda_prefill``: fla's ``chunk_kda`` (fla-core 0.6.0).

How our arguments map onto it: q arrives L2-normalised and already scaled by K^-0.5, so ``scale=1`` and
no in-kernel L2 norm; g is the per-token log-decay (``use_gate_in_kernel=False``; fla takes the chunk
cumsum itself); beta is post-sigmoid; the state is our V-first ``[B, H, V, K]`` fp32 layout
(``state_v_first=True``), handed in as the initial state and the final state copied back into it, so the
decode step continues from it. Everything is fed in fp32, as the reference computes.

fla's kernels need a GPU: its recurrence kernel does not run under the Triton interpreter, so CPU tensors
fall back to the reference (recorded) rather than failing a forced ``backend="triton"``.
"""
from __future__ import annotations

import functools

import torch

from k3compile.backends import Reason, triton_can_run_on

# fla's chunk_kda asserts K <= 256; its value tiles are written for head dims up to 256 as well.
MAX_HEAD_DIM = 256


@functools.cache
def fla_importable() -> Reason:
    try:
        from fla.ops.kda import chunk_kda  # noqa: F401
    except Exception as e:  # pragma: no cover - depends on the machine
        return f"fla's chunk_kda does not import ({type(e).__name__}: {e})"
    return None


def fla_available(q, k, v, g, beta, state, chunk_size) -> Reason:
    return fla_importable() or triton_can_run_on(q, k, v, g, beta, state)


def fla_supports(q, k, v, g, beta, state, chunk_size) -> Reason:
    if q.device.type != "cuda":
        return f"tensors on {q.device.type}: fla's chunk_kda kernels need a GPU (not the Triton interpreter)"
    B, T, H, K = q.shape
    V = v.shape[-1]
    if K > MAX_HEAD_DIM or V > MAX_HEAD_DIM:
        return f"head dims K={K}, V={V} > {MAX_HEAD_DIM} (fla's chunk_kda limit)"
    if T == 0 or B == 0:
        return "empty batch or sequence"
    if state.dtype != torch.float32:
        return f"state dtype {state.dtype} (fla takes an fp32 initial state)"
    return None


def kda_prefill_fla(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                    state: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """``chunk_size`` is the reference's; fla picks its own chunk (the result is the same recurrence)."""
    from fla.ops.kda import chunk_kda

    o, final = chunk_kda(q.float(), k.float(), v.float(), g.float(), beta.float(), scale=1.0,
                         initial_state=state.contiguous(), output_final_state=True, state_v_first=True)
    state.copy_(final)
    return o.float()
