"""Where ``k3::products_beside`` runs its small products: on a second stream, beside the large ones.

A KDA layer's input projections at decode size are four large products of one input (q, k, v and the output gate,
each streaming its weight near the copy ceiling behind the one before it under PDL) and a chain of small ones (the
beta and gate-rank products, then the gate's up-projection of the second), which cost their launches, not their
bytes. Here the small chain runs on the device's side stream while the large products run on the current one, which
waits for the chain before the op returns (``k3compile/ops/side_stream.py``; in turn where that says so). The chain
runs the Triton kernel beside ``SIDE_TRITON_FROM_BYTES`` of large weights or more (its blocks leave the large
products' SMs their room, but the chain takes longer alone than the dispatch's CuTe kernels), the dispatch's pick
below; measured in ``docs/tuning/decode_step.md``.

Every product dispatches as ``k3::skinny_gemm`` does, with the flags the static-weight proof set on this op
(``k3compile/static_weights.py``): the chained products' inputs are made inside the op, after ``x``, on the side
stream, and are proven through ``x`` as the latent tail's inner GEMM is.
"""
from __future__ import annotations

from k3compile.backends import Impl, OpImpls, register_op_impls, triton_can_run_on
from k3compile.ops.side_stream import beside
from k3compile.ops.skinny_gemm import dispatch as skinny_gemm_dispatch
from k3compile.ops.skinny_gemm.op import skinny_gemm_op

from .reference import products_beside_ref

# large weights (bytes, the main products together) from which the side chain runs the Triton kernel: hidden beside
# a TP 8 rank's 88 MB of KDA products, not beside a TP 16 rank's 44 MB (H200)
SIDE_TRITON_FROM_BYTES = 64 << 20


def side_backend(x, w_main, backend: str) -> str:
    """The side chain's ``k3::skinny_gemm`` backend (module doc)."""
    if backend != "auto" or x.device.type != "cuda" or triton_can_run_on(x) is not None:
        return backend
    large = sum(w.numel() * w.element_size() for w in w_main)
    return "triton" if large >= SIDE_TRITON_FROM_BYTES else backend


def _flags(w_main, w_side, w_chain, main_static_weight, main_trigger_first, side_static_weight,
           chain_static_weight) -> tuple[list, list, list, list]:
    """(main static, main trigger-first, side static, chain static) flag lists, the schema's None as its defaults."""
    def given(flags, n: int, default: bool) -> list:
        return [default] * n if flags is None else list(flags)

    return (given(main_static_weight, len(w_main), False), given(main_trigger_first, len(w_main), True),
            given(side_static_weight, len(w_side), False), given(chain_static_weight, len(w_chain), False))


def side_chain(x, w_side, w_chain, chain_of, backend, m_limit, side_static, chain_static) -> list:
    side = [skinny_gemm_op(x, w, None, None, backend, m_limit, s) for w, s in zip(w_side, side_static)]
    return side + [skinny_gemm_op(side[i], w, None, None, backend, m_limit, s)
                   for w, i, s in zip(w_chain, chain_of, chain_static)]


def main_products(x, w_main, backend, m_limit, static, trigger_first) -> list:
    return [skinny_gemm_op(x, w, None, None, backend, m_limit, s, None, t)
            for w, s, t in zip(w_main, static, trigger_first)]


def run(x, w_main, w_side, w_chain, chain_of, backend, m_limit, main_static_weight=None, main_trigger_first=None,
        side_static_weight=None, chain_static_weight=None) -> list:
    """The op's outputs (main products, side products, chained products), the side chain beside the main products
    where it can be (module doc); the choice recorded for the report."""
    main_static, trigger, side_static, chain_static = _flags(w_main, w_side, w_chain, main_static_weight,
                                                            main_trigger_first, side_static_weight,
                                                            chain_static_weight)
    key = (x.device.type, "N=" + "+".join(str(w.shape[0]) for w in w_main),
           "side=" + "+".join(str(w.shape[0]) for w in w_side))
    sb = side_backend(x, w_main, backend)
    side, main = beside(x, backend,
                        lambda: side_chain(x, w_side, w_chain, chain_of, sb, m_limit, side_static, chain_static),
                        lambda: main_products(x, w_main, backend, m_limit, main_static, trigger),
                        PRODUCTS_BESIDE, key, "the small products", run)
    return main + side


def kernels(x, w_main, w_side, w_chain, chain_of, backend="auto", m_limit=16, main_static_weight=None,
            main_trigger_first=None, side_static_weight=None, chain_static_weight=None) -> list:
    """The kernels a call builds at its first call (``k3compile/precompile.py``): every product's (a chained
    product's input, made inside the op, as a stand-in of its shape: planning reads metadata)."""
    from k3compile.call_sites import stand_in

    main_static, trigger, side_static, chain_static = _flags(w_main, w_side, w_chain, main_static_weight,
                                                            main_trigger_first, side_static_weight,
                                                            chain_static_weight)
    sb = side_backend(x, w_main, backend)
    out = []
    for w, s, t in zip(w_main, main_static, trigger):
        out += skinny_gemm_dispatch.kernels(x, w, None, None, backend, m_limit, s, None, t)
    for w, s in zip(w_side, side_static):
        out += skinny_gemm_dispatch.kernels(x, w, None, None, sb, m_limit, s, None, True)
    for w, i, s in zip(w_chain, chain_of, chain_static):
        a = stand_in((x.shape[0], w_side[i].shape[0]), x.dtype, x.device)
        out += skinny_gemm_dispatch.kernels(a, w, None, None, sb, m_limit, s, None, True)
    return out


PRODUCTS_BESIDE = register_op_impls(OpImpls("products_beside", reference=Impl(products_beside_ref), plan=kernels,
                                            composes=("skinny_gemm",)))
