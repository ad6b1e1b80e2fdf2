"""Where ``k3::route_beside`` runs the routing beside the product.

The router's product, then the routing (``k3::moe_route``), and the latent MoE's down-projection, a product of the
same input, depend on nothing of each other past the router's product. In one stream the routing kernel (one
program a token: a few µs of latency on a handful of SMs) holds up the products behind it. Here the router's product
runs on the current stream as it would (behind the kernel before it, its weight streamed under PDL), then the routing
runs on a second stream of the device while the other product streams its weight on the current one, which waits
for the routing before the op returns. Measured on one H200 at a TP 16 rank (docs/tuning/decode_step.md): the three
kernels 18.8 against 22.1-23.1 µs in turn; the router's product on the second stream too gained nothing (it loses
its PDL overlap and shares the SMs with the other product).

The second stream and its rules: ``k3compile/ops/side_stream.py``.

In turn, on one stream: tensors not on a CUDA (or ROCm) device, ``backend="reference"``, no rows, and a dry run
(``k3compile/triton_ahead.py``: nothing launches). The products and the routing each dispatch as their own ops do
(``k3::skinny_gemm``, ``k3::moe_route``), with the flags the static-weight proof set on this op
(``k3compile/static_weights.py``).
"""
from __future__ import annotations

import torch

from k3compile.backends import Impl, OpImpls, register_op_impls
from k3compile.ops.moe_route.op import moe_route_op
from k3compile.ops.side_stream import beside
from k3compile.ops.skinny_gemm import dispatch as skinny_gemm_dispatch
from k3compile.ops.skinny_gemm.op import skinny_gemm_op

from .reference import route_beside_ref


def run(a, router_w, bias, top_k, renorm_eps, scaling, w, backend, route_backend, m_limit, router_static_weight,
        router_trigger_first, static_weight, trigger_first):
    """The op's outputs ``(weights, experts, a @ w.T)``, the routing beside the product where it can be (module doc);
    the choice recorded for the report."""
    logits = skinny_gemm_op(a, router_w, None, None, backend, m_limit, router_static_weight, torch.float32,
                            router_trigger_first)
    key = (a.device.type, f"E={router_w.shape[0]}", f"N={w.shape[0]}")
    (weights, experts), out = beside(
        a, backend, lambda: moe_route_op(logits, bias, top_k, renorm_eps, scaling, route_backend),
        lambda: skinny_gemm_op(a, w, None, None, backend, m_limit, static_weight, None, trigger_first),
        ROUTE_BESIDE, key, "the routing", run)
    return weights, experts, out


def kernels(a, router_w, bias, top_k, renorm_eps, scaling, w, backend="auto", route_backend="auto", m_limit=16,
            router_static_weight=False, router_trigger_first=True, static_weight=False, trigger_first=True) -> list:
    """The kernels a call builds at its first call: its two products' (``k3compile/precompile.py``)."""
    return (skinny_gemm_dispatch.kernels(a, router_w, None, None, backend, m_limit, router_static_weight,
                                         torch.float32, router_trigger_first)
            + skinny_gemm_dispatch.kernels(a, w, None, None, backend, m_limit, static_weight, None, trigger_first))


ROUTE_BESIDE = register_op_impls(OpImpls("route_beside", reference=Impl(route_beside_ref), plan=kernels,
                                         composes=("skinny_gemm", "moe_route")))
