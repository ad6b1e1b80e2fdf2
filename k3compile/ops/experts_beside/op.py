"""``k3::experts_beside``: schema, checks and fake; ``dispatch.py`` decides where the routed experts run."""
from __future__ import annotations

from typing import Optional

import torch

from k3compile.ops.moe_experts.op import FLOAT_DTYPES, _shape, check_inputs as check_experts_inputs

from . import dispatch


def check_shared_args(z: torch.Tensor, x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor,
                      w_down: torch.Tensor, m_limit: int) -> None:
    """ValueError on a shared-experts chain no implementation could compute (the routed experts' arguments are
    ``k3::moe_experts``'s, checked by its own checks)."""
    check = torch._check_value
    check(x.dim() == 2 and w_gate.dim() == 2 and w_up.dim() == 2 and w_down.dim() == 2,
          lambda: f"experts_beside: x, w_gate, w_up and w_down must be 2-D, got {_shape(x)}, {_shape(w_gate)}, "
                  f"{_shape(w_up)} and {_shape(w_down)}")
    check(x.dtype in FLOAT_DTYPES, lambda: f"experts_beside: x must be fp32, bf16 or fp16, got {x.dtype}")
    check(all(w.dtype == x.dtype for w in (w_gate, w_up, w_down)),
          lambda: f"experts_beside: w_gate {w_gate.dtype}, w_up {w_up.dtype} and w_down {w_down.dtype} must be "
                  f"x's dtype {x.dtype}")
    check(x.shape[0] == z.shape[0], lambda: f"experts_beside: x {_shape(x)} and z {_shape(z)} disagree on M")
    check(w_gate.shape[1] == x.shape[1] and w_up.shape[1] == x.shape[1] and w_up.shape[0] == w_gate.shape[0]
          and w_down.shape[1] == w_gate.shape[0],
          lambda: f"experts_beside: x {_shape(x)}, w_gate {_shape(w_gate)}, w_up {_shape(w_up)} and w_down "
                  f"{_shape(w_down)} disagree")
    devices = {t.device for t in (z, x, w_gate, w_up, w_down)}
    check(len(devices) == 1, lambda: f"experts_beside: inputs on several devices: {sorted(map(str, devices))}")
    check(m_limit >= 1, lambda: f"experts_beside: m_limit must be >= 1, got {m_limit}")


def check_args(z, experts, weights, w1, w3, w2, w1_scale, w3_scale, w2_scale, small_m_limit, x, w_gate, w_up,
               w_down, m_limit) -> None:
    check_experts_inputs(z, experts, weights, w1, w3, w2, w1_scale, w3_scale, w2_scale, small_m_limit)
    check_shared_args(z, x, w_gate, w_up, w_down, m_limit)


@torch.library.custom_op("k3::experts_beside", mutates_args=())
def experts_beside_op(z: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, w1: torch.Tensor,
                      w3: torch.Tensor, w2: torch.Tensor, w1_scale: Optional[torch.Tensor],
                      w3_scale: Optional[torch.Tensor], w2_scale: Optional[torch.Tensor], beta: Optional[float],
                      linear_beta: Optional[float], experts_backend: str, small_m_limit: int, x: torch.Tensor,
                      w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor, shared_beta: Optional[float],
                      shared_linear_beta: Optional[float], backend: str = "auto", m_limit: int = 16,
                      gate_static_weight: bool = False, gate_trigger_first: bool = True,
                      up_static_weight: bool = False, up_trigger_first: bool = True,
                      down_static_weight: bool = False, down_trigger_first: bool = True
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    check_args(z, experts, weights, w1, w3, w2, w1_scale, w3_scale, w2_scale, small_m_limit, x, w_gate, w_up, w_down,
               m_limit)
    return dispatch.run(z, experts, weights, w1, w3, w2, w1_scale, w3_scale, w2_scale, beta, linear_beta,
                        experts_backend, small_m_limit, x, w_gate, w_up, w_down, shared_beta, shared_linear_beta,
                        backend, m_limit, gate_static_weight, gate_trigger_first, up_static_weight, up_trigger_first,
                        down_static_weight, down_trigger_first)


@experts_beside_op.register_fake
def _(z, experts, weights, w1, w3, w2, w1_scale, w3_scale, w2_scale, beta, linear_beta, experts_backend,
      small_m_limit, x, w_gate, w_up, w_down, shared_beta, shared_linear_beta, backend="auto", m_limit=16,
      gate_static_weight=False, gate_trigger_first=True, up_static_weight=False, up_trigger_first=True,
      down_static_weight=False, down_trigger_first=True):
    check_args(z, experts, weights, w1, w3, w2, w1_scale, w3_scale, w2_scale, small_m_limit, x, w_gate, w_up, w_down,
               m_limit)
    return (torch.empty_like(z, memory_format=torch.contiguous_format), x.new_empty(x.shape[0], w_down.shape[0]))
