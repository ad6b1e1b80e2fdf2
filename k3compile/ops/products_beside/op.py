"""``k3::products_beside``: schema, checks and fake; ``dispatch.py`` decides where the small products run."""
from __future__ import annotations

from typing import Optional

import torch

from . import dispatch


def _shape(t: torch.Tensor) -> tuple:
    return tuple(t.shape)


def check_args(x: torch.Tensor, w_main: list, w_side: list, w_chain: list, chain_of: list, m_limit: int,
               flags: dict) -> None:
    """ValueError on arguments no implementation could compute."""
    check = torch._check_value
    check(x.dim() == 2, lambda: f"products_beside: x must be 2-D, got {_shape(x)}")
    check(len(w_main) >= 1 and len(w_side) >= 1,
          lambda: f"products_beside: needs main and side products, got {len(w_main)} and {len(w_side)}")
    check(len(w_chain) == len(chain_of),
          lambda: f"products_beside: {len(w_chain)} chained weights but {len(chain_of)} chain_of indices")
    for i in chain_of:
        check(0 <= i < len(w_side), lambda: f"products_beside: chain_of {list(chain_of)} outside the side products")
    for name, ws in (("w_main", w_main), ("w_side", w_side)):
        for w in ws:
            check(w.dim() == 2 and w.shape[1] == x.shape[1],
                  lambda: f"products_beside: {name} weight {_shape(w)} does not take x {_shape(x)}")
    for w, i in zip(w_chain, chain_of):
        check(w.dim() == 2 and w.shape[1] == w_side[i].shape[0],
              lambda: f"products_beside: chained weight {_shape(w)} does not take side product {i}'s output "
                      f"[M, {w_side[i].shape[0]}]")
    weights = [*w_main, *w_side, *w_chain]
    check(all(w.dtype == x.dtype for w in weights),
          lambda: f"products_beside: weights {sorted({str(w.dtype) for w in weights})} must be x's dtype {x.dtype}")
    devices = {t.device for t in (x, *weights)}
    check(len(devices) == 1, lambda: f"products_beside: inputs on several devices: {sorted(map(str, devices))}")
    check(m_limit >= 1, lambda: f"products_beside: m_limit must be >= 1, got {m_limit}")
    for name, n in (("main_static_weight", len(w_main)), ("main_trigger_first", len(w_main)),
                    ("side_static_weight", len(w_side)), ("chain_static_weight", len(w_chain))):
        check(flags[name] is None or len(flags[name]) == n,
              lambda: f"products_beside: {name} has {len(flags[name])} flags for {n} products")


@torch.library.custom_op("k3::products_beside", mutates_args=())
def products_beside_op(x: torch.Tensor, w_main: list[torch.Tensor], w_side: list[torch.Tensor],
                       w_chain: list[torch.Tensor], chain_of: list[int], backend: str = "auto", m_limit: int = 16,
                       main_static_weight: Optional[list[bool]] = None,
                       main_trigger_first: Optional[list[bool]] = None,
                       side_static_weight: Optional[list[bool]] = None,
                       chain_static_weight: Optional[list[bool]] = None) -> list[torch.Tensor]:
    flags = dict(main_static_weight=main_static_weight, main_trigger_first=main_trigger_first,
                 side_static_weight=side_static_weight, chain_static_weight=chain_static_weight)
    check_args(x, w_main, w_side, w_chain, chain_of, m_limit, flags)
    return dispatch.run(x, w_main, w_side, w_chain, chain_of, backend, m_limit, **flags)


@products_beside_op.register_fake
def _(x, w_main, w_side, w_chain, chain_of, backend="auto", m_limit=16, main_static_weight=None,
      main_trigger_first=None, side_static_weight=None, chain_static_weight=None):
    flags = dict(main_static_weight=main_static_weight, main_trigger_first=main_trigger_first,
                 side_static_weight=side_static_weight, chain_static_weight=chain_static_weight)
    check_args(x, w_main, w_side, w_chain, chain_of, m_limit, flags)
    m = x.shape[0]
    return ([x.new_empty(m, w.shape[0]) for w in w_main] + [x.new_empty(m, w.shape[0]) for w in w_side]
            + [x.new_empty(m, w.shape[0]) for w in w_chain])
