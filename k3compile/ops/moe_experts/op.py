"""``k3::moe_experts``: schema, input checks, fake, and the call through ``dispatch.py``.

One op for both weight formats the plain model holds (``model/moe.py``):

- float stacks: ``w1``, ``w3`` [E, I, L] and ``w2`` [E, L, I] in z's dtype, the three scales ``None``;
- packed MXFP4: ``w1``, ``w3`` uint8 codes [E, I, L/2], ``w2`` [E, L, I/2], with E8M0 scales ``w1_scale``,
  ``w3_scale`` uint8 [E, I, L/32] and ``w2_scale`` [E, L, I/32] (all three or none).

``beta`` / ``linear_beta`` are SiTU-GLU's constants (``None``: SiLU / an uncapped up projection). ``backend`` and
``small_m_limit`` are baked in by the pass: up to ``small_m_limit`` rows the decode kernels run, above them the
prefill form ``dispatch.py`` picks.
"""
from __future__ import annotations

from typing import Optional

import torch

from .dispatch import MOE_EXPERTS, choose

FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
MXFP4_GROUP = 32


def is_mxfp4(w1_scale, w3_scale, w2_scale) -> bool:
    """Whether the call carries MXFP4 codes (all three scales given); a partial set is an error (check_inputs)."""
    return w1_scale is not None


def _shape(t) -> tuple:
    return tuple(t.shape)


def check_inputs(z, experts, weights, w1, w3, w2, w1_scale, w3_scale, w2_scale, small_m_limit) -> None:
    """Shapes, dtypes and devices no implementation could compute: a clear ValueError.

    ``torch._check_value`` keeps the checks valid on the symbolic sizes of the fake implementation.
    Expert ids are values, not checked here: the reference raises on one outside [0, E), the kernels never
    read out of bounds (the tokens of such a pair come out NaN).
    """
    check = torch._check_value
    check(z.dim() == 2, lambda: f"moe_experts: z must be [M, L], got {_shape(z)}")
    check(z.dtype.is_floating_point, lambda: f"moe_experts: z must be floating, got {z.dtype}")
    check(experts.dim() == 2 and not experts.dtype.is_floating_point and experts.dtype != torch.bool,
          lambda: f"moe_experts: experts must be integer ids [M, A], got {_shape(experts)} {experts.dtype}")
    check(weights.dim() == 2 and weights.dtype.is_floating_point,
          lambda: f"moe_experts: weights must be floating [M, A], got {_shape(weights)} {weights.dtype}")
    m, l = z.shape
    check(experts.shape[0] == m and weights.shape[0] == m and experts.shape[1] == weights.shape[1],
          lambda: f"moe_experts: z {_shape(z)}, experts {_shape(experts)}, weights {_shape(weights)} disagree")
    scales = (w1_scale, w3_scale, w2_scale)
    given = [s is not None for s in scales]
    check(all(given) or not any(given),
          lambda: f"moe_experts: give all three MXFP4 scales or none (got w1/w3/w2 scale: {given})")
    check(w1.dim() == 3 and w3.dim() == 3 and w2.dim() == 3,
          lambda: f"moe_experts: w1, w3, w2 must be 3-D stacks, got {_shape(w1)}, {_shape(w3)}, {_shape(w2)}")
    e, i = w1.shape[0], w1.shape[1]
    if all(given):
        for name, t in (("w1", w1), ("w3", w3), ("w2", w2)) + tuple(
                zip(("w1_scale", "w3_scale", "w2_scale"), scales)):
            check(t.dtype == torch.uint8,
                  lambda name=name, t=t: f"moe_experts: MXFP4 {name} must be uint8, got {t.dtype}")
        check(l % MXFP4_GROUP == 0 and i % MXFP4_GROUP == 0,
              lambda: f"moe_experts: MXFP4 needs L={l} and I={i} to be multiples of {MXFP4_GROUP}")
        expect = {"w1": (w1, (e, i, l // 2)), "w3": (w3, (e, i, l // 2)), "w2": (w2, (e, l, i // 2)),
                  "w1_scale": (w1_scale, (e, i, l // MXFP4_GROUP)), "w3_scale": (w3_scale, (e, i, l // MXFP4_GROUP)),
                  "w2_scale": (w2_scale, (e, l, i // MXFP4_GROUP))}
    else:
        for name, t in (("w1", w1), ("w3", w3), ("w2", w2)):
            check(t.dtype == z.dtype,
                  lambda name=name, t=t: f"moe_experts: {name} dtype {t.dtype} != z dtype {z.dtype}")
        expect = {"w1": (w1, (e, i, l)), "w3": (w3, (e, i, l)), "w2": (w2, (e, l, i))}
    for name, (t, shape) in expect.items():
        check(t.dim() == 3 and all(a == b for a, b in zip(t.shape, shape)),
              lambda name=name, t=t, shape=shape: f"moe_experts: {name} must be {list(shape)}, got {list(t.shape)}")
    tensors = (z, experts, weights, w1, w3, w2) + tuple(s for s in scales if s is not None)
    devices = {t.device for t in tensors}
    check(len(devices) == 1, lambda: f"moe_experts: inputs on several devices: {sorted(map(str, devices))}")
    check(small_m_limit >= 1, lambda: f"moe_experts: small_m_limit must be >= 1, got {small_m_limit}")


@torch.library.custom_op("k3::moe_experts", mutates_args=())
def moe_experts_op(z: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, w1: torch.Tensor,
                   w3: torch.Tensor, w2: torch.Tensor, w1_scale: Optional[torch.Tensor],
                   w3_scale: Optional[torch.Tensor], w2_scale: Optional[torch.Tensor], beta: Optional[float],
                   linear_beta: Optional[float], backend: str = "auto", small_m_limit: int = 16) -> torch.Tensor:
    check_inputs(z, experts, weights, w1, w3, w2, w1_scale, w3_scale, w2_scale, small_m_limit)
    fn = choose(backend, z, experts, weights, w1, w3, w2, w1_scale, w3_scale, w2_scale, small_m_limit)
    return fn(z, experts, weights, w1, w3, w2, w1_scale, w3_scale, w2_scale, beta, linear_beta, small_m_limit)


@moe_experts_op.register_fake
def _(z, experts, weights, w1, w3, w2, w1_scale, w3_scale, w2_scale, beta, linear_beta, backend="auto",
      small_m_limit=16):
    check_inputs(z, experts, weights, w1, w3, w2, w1_scale, w3_scale, w2_scale, small_m_limit)
    return torch.empty_like(z, memory_format=torch.contiguous_format)


__all__ = ["moe_experts_op", "MOE_EXPERTS", "check_inputs", "is_mxfp4", "FLOAT_DTYPES"]
