"""``k3::attn_res`` in one Triton kernel, a program a token. Pass 1 loads up to ``GROUP`` sources' rows at once
(one round trip for all of them, not one a source), then takes each row's sum of squares and its dot with the
pseudo-query in one reduction (its score); the softmax over the S scores stays in registers; pass 2 reads the rows
again (L1 / L2) for the weighted sum, rounds it to the activations' dtype as the model does and, where the layer
normalises the mix, writes the normalised row times the norm's weight. In place of Inductor's two reductions a mix
(scores; then softmax, sum and norm), each a launch of one or two programs at decode sizes.

``k3::attn_res_add``: the last source is the layer's residual add ``prefix + a``, read as its two addends, added and
rounded to the activations' dtype as the model adds them, and written out (the next layer's partial sum): the add's
own kernel is gone."""
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


@triton.jit
def _add_pairs(a_square, a_dot, b_square, b_dot):
    return a_square + b_square, a_dot + b_dot


@triton.jit
def _plus_addend(x, addend_ptrs, inside, dtype):
    """The residual add ``x + addend``, in fp32 rounded to ``dtype`` as torch adds two 16-bit tensors (to nearest
    even; Triton's interpreter truncates to bf16 instead, so on the CPU a bf16 sum may be one ulp off)."""
    return (x.to(tl.float32) + tl.load(addend_ptrs, mask=inside, other=0.0).to(tl.float32)).to(dtype)


@triton.jit
def _attn_res_kernel(sources, row_strides, proj_ptr, mix_norm_ptr, norm_ptr, out_ptr, out_stride, addend_ptr,
                     addend_stride, sum_ptr, sum_stride, D, eps, norm_eps,
                     S: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, GROUP: tl.constexpr,
                     PAIRED: tl.constexpr, NORM: tl.constexpr, ADDEND: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        # launched before the sources' writer finished: nothing is read before the wait; the next kernel (a
        # product with static weights) may launch once we have passed it and stream its weights meanwhile
        gdc_wait()
        gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_D)
    inside = offs < D
    dtype = sources[S - 1].dtype.element_ty
    query = (tl.load(mix_norm_ptr + offs, mask=inside, other=0.0).to(tl.float32)
             * tl.load(proj_ptr + offs, mask=inside, other=0.0).to(tl.float32))
    slot = tl.arange(0, BLOCK_S)
    scores = tl.full([BLOCK_S], float("-inf"), tl.float32)
    # GROUP sources' rows loaded before any is reduced: GROUP loads in flight, not one round trip a source (a
    # reduction's barrier keeps a later load from being issued ahead of it); as many as the registers hold
    for first in tl.static_range(0, S, GROUP):
        rows = ()
        for s in tl.static_range(first, min(first + GROUP, S)):
            x = tl.load(sources[s] + row * row_strides[s] + offs, mask=inside, other=0.0)
            if ADDEND and s == S - 1:
                x = _plus_addend(x, addend_ptr + row * addend_stride + offs, inside, dtype)
                tl.store(sum_ptr + row * sum_stride + offs, x, mask=inside)
            rows = rows + (x,)
        for i in tl.static_range(len(rows)):
            x = rows[i].to(tl.float32)
            if PAIRED:   # both sums in one reduction: one cross-warp exchange a source, not two
                square, dot = tl.reduce((x * x, x * query), 0, _add_pairs)
            else:
                square, dot = tl.sum(x * x, axis=0), tl.sum(x * query, axis=0)
            scores = tl.where(slot == first + i, dot * tl.rsqrt(square / D + eps), scores)
    alpha = tl.exp(scores - tl.max(scores, axis=0))
    alpha = alpha / tl.sum(alpha, axis=0)
    weights = ()   # each source's weight as a scalar first: no reduction between the loads below
    for s in tl.static_range(S):
        weights = weights + (tl.sum(tl.where(slot == s, alpha, 0.0), axis=0),)
    mix = tl.zeros([BLOCK_D], tl.float32)
    for first in tl.static_range(0, S, GROUP):   # the rows again (from L1 / L2), GROUP at a time
        for s in tl.static_range(first, min(first + GROUP, S)):
            x = tl.load(sources[s] + row * row_strides[s] + offs, mask=inside, other=0.0)
            if ADDEND and s == S - 1:   # the sum again from its addends: no read of our own store
                x = _plus_addend(x, addend_ptr + row * addend_stride + offs, inside, dtype)
            mix += weights[s] * x.to(tl.float32)
        if first + GROUP < S:
            tl.debug_barrier()   # the next group's loads wait for this one's: no more rows live than registers
    mix = mix.to(dtype).to(tl.float32)          # the model's mix is rounded to the activations' dtype
    if NORM:
        normed = (mix * tl.rsqrt(tl.sum(mix * mix, axis=0) / D + norm_eps)).to(dtype).to(tl.float32)
        mix = tl.load(norm_ptr + offs, mask=inside, other=0.0).to(tl.float32) * normed
    tl.store(out_ptr + row * out_stride + offs, mix.to(out_ptr.dtype.element_ty), mask=inside)


def _rows(x: torch.Tensor, d: int) -> torch.Tensor:
    """x as [rows, d] with unit stride along d (a view where the layout allows)."""
    rows = x.reshape(-1, d)
    return rows if rows.stride(1) == 1 or rows.shape[0] == 0 else rows.contiguous()


def attn_res_triton(sources: list[torch.Tensor], proj_weight: torch.Tensor, mix_norm_weight: torch.Tensor,
                    eps: float, norm_weight: Optional[torch.Tensor], norm_eps: float,
                    out: Optional[torch.Tensor] = None, pdl: bool = True, group: Optional[int] = None,
                    num_warps: Optional[int] = None, paired: bool = True) -> torch.Tensor:
    """The op's arguments (checked by the op) -> the mix, or its normalised row, [..., D]; written into ``out`` when
    given (tests pass poisoned ones). ``pdl``: launched with programmatic dependent launch where the GPU has it.
    ``group`` (sources loaded at once) and ``num_warps``: the launch's shape, by default ``launch_shape``'s;
    ``paired``: a source's two sums in one reduction (``benchmarks/attn_res.py --sweep`` compares both)."""
    out = _output(sources, norm_weight, out)
    _launch(sources, None, None, proj_weight, mix_norm_weight, eps, norm_weight, norm_eps, out, pdl, group,
            num_warps, paired)
    return out


def attn_res_add_triton(sources: list[torch.Tensor], addend: torch.Tensor, proj_weight: torch.Tensor,
                        mix_norm_weight: torch.Tensor, eps: float, norm_weight: Optional[torch.Tensor],
                        norm_eps: float, out: Optional[torch.Tensor] = None, sum_out: Optional[torch.Tensor] = None,
                        pdl: bool = True, group: Optional[int] = None, num_warps: Optional[int] = None,
                        paired: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """``k3::attn_res_add``'s arguments -> (as :func:`attn_res_triton`, ``sources[-1] + addend`` [..., D]); written
    into ``out`` and ``sum_out`` (contiguous) when given."""
    out = _output(sources, norm_weight, out)
    if sum_out is None:
        sum_out = torch.empty(sources[-1].shape, device=sources[-1].device, dtype=sources[-1].dtype)
    _launch(sources, addend, sum_out, proj_weight, mix_norm_weight, eps, norm_weight, norm_eps, out, pdl, group,
            num_warps, paired)
    return out, sum_out


def _output(sources, norm_weight, out):
    if out is not None:
        return out
    dtype = sources[0].dtype if norm_weight is None else torch.promote_types(norm_weight.dtype, sources[0].dtype)
    return torch.empty(sources[0].shape, device=sources[0].device, dtype=dtype)


def _launch(sources, addend, sum_out, proj_weight, mix_norm_weight, eps, norm_weight, norm_eps, out, pdl, group,
            num_warps, paired) -> None:
    d = sources[0].shape[-1]
    rows = [_rows(s, d) for s in sources]
    m = rows[0].shape[0]
    if m == 0:
        return
    out_rows = out.view(-1, d)
    # without an addend its pointers are the last source's, never read (ADDEND is a constexpr)
    addend_rows = _rows(addend, d) if addend is not None else rows[-1]
    sum_rows = sum_out.view(-1, d) if sum_out is not None else out_rows
    block_d = triton.next_power_of_2(d)
    default_group, default_warps = launch_shape(block_d, len(rows) + (addend is not None))
    pdl = pdl and triton_pdl_capable(sources[0].device)
    _attn_res_kernel[(m,)](
        tuple(rows), tuple(r.stride(0) for r in rows), proj_weight.reshape(-1).contiguous(),
        mix_norm_weight.contiguous(), norm_weight.contiguous() if norm_weight is not None else mix_norm_weight,
        out_rows, out_rows.stride(0), addend_rows, addend_rows.stride(0), sum_rows, sum_rows.stride(0),
        d, float(eps), float(norm_eps),
        S=len(rows), BLOCK_S=max(2, triton.next_power_of_2(len(rows))), BLOCK_D=block_d,
        GROUP=group or default_group, PAIRED=paired, NORM=norm_weight is not None, ADDEND=addend is not None,
        PDL=pdl, **({"launch_pdl": True} if pdl else {}), num_warps=num_warps or default_warps,
    )


def launch_shape(block_d: int, sources: int) -> tuple[int, int]:
    """(sources loaded at once, warps) for ``sources`` rows a token (an addend counts as one): 32 values a thread
    (eight warps a row of 8192 beat 16 and 32); every row at once up to five sources, four at a time beyond (eight
    spill: at nine sources 7.9 against 6.8 µs; ``benchmarks/attn_res.py --sweep``, H200)."""
    return (sources if sources <= 5 else 4), max(1, min(16, block_d // 1024))
