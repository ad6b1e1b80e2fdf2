"""``k3::moe_route`` in one Triton kernel: one program a token holds its row of E keys (score + bias) in registers,
(key, reversed index) packed in one int64 so one comparison orders both, and takes the top-k by Triton's bitonic
``tl.topk`` (or, where this Triton lacks it, by k rounds of a full-row max), so the experts come out in descending
order, ties to the lower id; the weights are the unbiased scores of the picked experts."""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

try:  # grid dependency control (PDL), Triton >= 3.4
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover
    gdc_launch_dependents = gdc_wait = None

from k3compile.backends import triton_pdl_capable

HAS_TOPK = hasattr(tl, "topk")   # Triton's bitonic top-k


@triton.jit
def _moe_route_kernel(logits_ptr, bias_ptr, weights_ptr, experts_ptr, stride_m, E,
                      renorm_eps, scaling, TOP_K: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
                      RENORM: tl.constexpr, SORTING_NETWORK: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        # launched before the router's product finished: nothing is read before the wait; the next kernel may
        # launch once we have passed it (it waits for our stores itself), as every PDL kernel of ours does
        gdc_wait()
        gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_E)
    inside = offs < E
    x = tl.load(logits_ptr + row * stride_m + offs, mask=inside, other=0.0)
    key = tl.sigmoid(x) + tl.load(bias_ptr + offs, mask=inside, other=0.0)
    key = tl.where(key != key, float("inf"), key)          # NaN ranks first, as in torch.topk
    # (key, lowest index) as one int64 whose order is theirs, so one comparison orders both: the fp32 bits made
    # order-preserving as int32 (negatives' magnitude bits flipped) above, the reversed index below
    bits = key.to(tl.int32, bitcast=True)
    ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    packed = (ordered.to(tl.int64) << 32) | (BLOCK_E - 1 - offs).to(tl.int64)
    packed = tl.where(inside, packed, -9223372036854775808)
    slot = tl.arange(0, BLOCK_K)
    if SORTING_NETWORK:
        # bitonic top-k (tl.topk): sorted groups of k merged by halving
        top = tl.topk(packed, BLOCK_K)
        picked = BLOCK_E - 1 - (top & 0xFFFFFFFF).to(tl.int32)
    else:
        picked = tl.zeros([BLOCK_K], dtype=tl.int32)
        for j in tl.static_range(TOP_K):
            best = tl.max(packed, axis=0)
            idx = BLOCK_E - 1 - (best & 0xFFFFFFFF).to(tl.int32)
            picked = tl.where(slot == j, idx, picked)
            packed = tl.where(offs == idx, -9223372036854775808, packed)
    taken = slot < TOP_K
    # the unbiased scores of the picked experts, read back (the row is in L1)
    weight = tl.sigmoid(tl.load(logits_ptr + row * stride_m + picked, mask=taken, other=0.0))
    if RENORM:
        weight = weight / (tl.sum(tl.where(taken, weight, 0.0), axis=0) + renorm_eps)
    weight = weight * scaling
    tl.store(weights_ptr + row * TOP_K + slot, weight, mask=taken)
    tl.store(experts_ptr + row * TOP_K + slot, picked.to(tl.int64), mask=taken)


def moe_route_triton(logits: torch.Tensor, bias: torch.Tensor, top_k: int, renorm_eps: Optional[float],
                     scaling: float, out: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
                     sorting_network: bool = True, pdl: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """The op's arguments (checked by the op) -> (weights [M, top_k] fp32, experts [M, top_k] int64), written into
    ``out`` when given (contiguous; tests pass poisoned ones). ``sorting_network``: Triton's bitonic ``tl.topk``
    (where it exists) rather than k rounds of a full-row max (with four warps a row 8% faster on the H200 at E 896,
    k 16, M 1-64: docs/tuning/moe_route.md). ``pdl``: launched with programmatic dependent launch where the GPU has it
    (sm_90+ NVIDIA), so that its launch overlaps the router's product (0.6-1.0 µs a layer in the decode step's chain
    on the H200: docs/tuning/moe_route.md run 3)."""
    m, e = logits.shape
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    bias = bias.contiguous()
    weights, experts = out if out is not None else (
        torch.empty(m, top_k, device=logits.device, dtype=torch.float32),
        torch.empty(m, top_k, device=logits.device, dtype=torch.int64))
    if m == 0:
        return weights, experts
    block_e = triton.next_power_of_2(e)
    block_k = min(block_e, max(2, triton.next_power_of_2(top_k)))   # tl.topk cannot reduce a row to one element
    pdl = pdl and triton_pdl_capable(logits.device)
    _moe_route_kernel[(m,)](
        logits, bias, weights, experts, logits.stride(0), e,
        0.0 if renorm_eps is None else float(renorm_eps), float(scaling),
        TOP_K=top_k, BLOCK_E=block_e, BLOCK_K=block_k, RENORM=renorm_eps is not None,
        SORTING_NETWORK=sorting_network and HAS_TOPK, PDL=pdl, **({"launch_pdl": True} if pdl else {}),
        # four warps from the first: each round's in-thread max and mask are over a quarter of a one-warp row, which
        # outweighs the cross-warp step (E 896, k 16 on the H200: 5.3 against 8.0 µs; docs/tuning/moe_route.md)
        num_warps=max(4, min(8, block_e // 1024)),
    )
    return weights, experts
