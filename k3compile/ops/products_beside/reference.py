"""``k3::products_beside`` in plain PyTorch: every product as ``k3::skinny_gemm``'s reference computes it."""
from __future__ import annotations

import torch

from k3compile.ops.skinny_gemm.reference import skinny_gemm_reference


def products_beside_ref(x: torch.Tensor, w_main: list, w_side: list, w_chain: list, chain_of: list
                        ) -> list[torch.Tensor]:
    """``[x @ w.T for w in w_main] + side + [side[i] @ w.T for w, i in zip(w_chain, chain_of)]``, where ``side`` is
    ``[x @ w.T for w in w_side]``: fp32 sums, one rounding to x's dtype each."""
    main = [skinny_gemm_reference(x, w) for w in w_main]
    side = [skinny_gemm_reference(x, w) for w in w_side]
    return main + side + [skinny_gemm_reference(side[i], w) for w, i in zip(w_chain, chain_of)]
