"""Where ``k3::experts_beside`` runs the routed experts: on a second stream, beside the shared experts' chain.

A latent MoE layer's routed experts (``k3::moe_experts``: gate/up, down and the combine, latency-bound at decode
sizes: 16 experts' weights stream through few blocks) and its shared experts (two products of the layer's input,
SiTU-GLU, the down product) depend on nothing of each other. Here the routed experts run on the device's side stream
while the shared chain runs on the current one, which waits for them before the op returns. Measured on one H200 at
a TP 16 rank in CUDA graphs (docs/tuning/decode_step.md): 16.7 / 42.2 / 71.7 µs a layer at M 1 / 4 / 8 against
25.1 / 50.2 / 82.1 in turn; the shared chain on the side stream instead gained about half as much.

The second stream and its rules: ``k3compile/ops/side_stream.py``. In turn on one stream where that says so. The
routed experts dispatch as ``k3::moe_experts`` does; the three products as ``k3::skinny_gemm`` does, with the flags
the static-weight proof set on this op (``k3compile/static_weights.py``); the SiTU-GLU between them is one Triton
kernel where Triton runs, else the reference's ops.
"""
from __future__ import annotations

import torch

from k3compile.backends import Impl, OpImpls, register_op_impls, triton_can_run_on
from k3compile.ops.moe_experts import dispatch as moe_experts_dispatch
from k3compile.ops.moe_experts.op import moe_experts_op
from k3compile.ops.side_stream import beside
from k3compile.ops.skinny_gemm import dispatch as skinny_gemm_dispatch
from k3compile.ops.skinny_gemm.op import skinny_gemm_op

from .reference import experts_beside_ref, situ_glu_ref


def situ_glu(gate: torch.Tensor, up: torch.Tensor, beta, linear_beta, backend: str) -> torch.Tensor:
    """The SiTU-GLU between the shared products: the Triton kernel where Triton runs on them, else the reference."""
    if backend != "reference" and triton_can_run_on(gate, up) is None:
        from .triton import situ_glu_triton

        return situ_glu_triton(gate, up, beta, linear_beta)
    return situ_glu_ref(gate, up, beta, linear_beta)


def shared_chain(x, w_gate, w_up, w_down, beta, linear_beta, backend, m_limit, gate_static_weight,
                 gate_trigger_first, up_static_weight, up_trigger_first, down_static_weight, down_trigger_first):
    """``down(situ_glu(gate(x), up(x)))`` on the current stream."""
    gate = skinny_gemm_op(x, w_gate, None, None, backend, m_limit, gate_static_weight, None, gate_trigger_first)
    up = skinny_gemm_op(x, w_up, None, None, backend, m_limit, up_static_weight, None, up_trigger_first)
    h = situ_glu(gate, up, beta, linear_beta, backend)
    return skinny_gemm_op(h, w_down, None, None, backend, m_limit, down_static_weight, None, down_trigger_first)


def run(z, experts, weights, w1, w3, w2, w1_scale, w3_scale, w2_scale, beta, linear_beta, experts_backend,
        small_m_limit, x, w_gate, w_up, w_down, shared_beta, shared_linear_beta, backend, m_limit, *flags):
    """The op's outputs ``(routed, shared)``, the routed experts beside the shared chain where they can be (module
    doc); the choice recorded for the report."""
    key = (z.device.type, f"E={w1.shape[0]}", f"N={w_down.shape[0]}")
    return beside(z, backend,
                  lambda: moe_experts_op(z, experts, weights, w1, w3, w2, w1_scale, w3_scale, w2_scale, beta,
                                         linear_beta, experts_backend, small_m_limit),
                  lambda: shared_chain(x, w_gate, w_up, w_down, shared_beta, shared_linear_beta, backend, m_limit,
                                       *flags),
                  EXPERTS_BESIDE, key, "the routed experts", run)


def kernels(z, experts, weights, w1, w3, w2, w1_scale, w3_scale, w2_scale, beta, linear_beta, experts_backend,
            small_m_limit, x, w_gate, w_up, w_down, shared_beta, shared_linear_beta, backend="auto", m_limit=16,
            gate_static_weight=False, gate_trigger_first=True, up_static_weight=False, up_trigger_first=True,
            down_static_weight=False, down_trigger_first=True) -> list:
    """The kernels a call builds at its first call (``k3compile/precompile.py``): the routed experts' and the three
    products' (the down product's input, made inside the op, as a stand-in of its shape: planning reads metadata)."""
    from k3compile.call_sites import stand_in

    h = stand_in((x.shape[0], w_gate.shape[0]), x.dtype, x.device)
    return (moe_experts_dispatch.kernels(z, experts, weights, w1, w3, w2, w1_scale, w3_scale, w2_scale, beta,
                                         linear_beta, experts_backend, small_m_limit)
            + skinny_gemm_dispatch.kernels(x, w_gate, None, None, backend, m_limit, gate_static_weight, None,
                                           gate_trigger_first)
            + skinny_gemm_dispatch.kernels(x, w_up, None, None, backend, m_limit, up_static_weight, None,
                                           up_trigger_first)
            + skinny_gemm_dispatch.kernels(h, w_down, None, None, backend, m_limit, down_static_weight, None,
                                           down_trigger_first))


EXPERTS_BESIDE = register_op_impls(OpImpls("experts_beside", reference=Impl(experts_beside_ref), plan=kernels,
                                           composes=("skinny_gemm", "moe_experts")))
