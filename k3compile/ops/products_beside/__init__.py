"""``k3compile.ops.products_beside``: the small products of an input on a second stream, beside its large ones
(``k3::products_beside``)."""
from __future__ import annotations

import torch

from .dispatch import PRODUCTS_BESIDE
from .op import products_beside_op
from .reference import products_beside_ref

__all__ = ["products_beside", "products_beside_ref", "PRODUCTS_BESIDE"]


def products_beside(x: torch.Tensor, w_main: list, w_side: list, w_chain: tuple = (), chain_of: tuple = (), *,
                    backend: str = "auto", m_limit: int = 16) -> list[torch.Tensor]:
    """Products of one input, the small ones (and products of their outputs) on a second stream of the device while
    the large ones run (``dispatch.py``).

    Args:
        x: ``[M, K]``, fp32 / bf16 / fp16.
        w_main: the large products' weights, each ``[N, K]`` in x's dtype.
        w_side: the small products' weights, each ``[N, K]``.
        w_chain, chain_of: products of side outputs: ``w_chain[j]`` ``[N', N]`` multiplies side output
            ``chain_of[j]``.
        backend, m_limit: ``k3::skinny_gemm``'s.

    Returns:
        ``[x @ w.T for w in w_main] + [x @ w.T for w in w_side] + [side[i] @ w.T for w, i in chain]``, x's dtype.

    Example::

        q, k, v, g, b, f_a, f = products_beside(x, [q.weight, k.weight, v.weight, g.weight],
                                                [b.weight, f_a.weight], [f_b.weight], [1])
    """
    return products_beside_op(x, list(w_main), list(w_side), list(w_chain), list(chain_of), backend, m_limit)
