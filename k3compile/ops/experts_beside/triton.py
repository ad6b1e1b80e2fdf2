"""SiTU-GLU between the shared experts' products, one Triton kernel: gate and up [M, I] in, h [M, I] out in their
dtype, fp32 math rounded once (``model/layers.py`` ``situ_glu``; the device function is the routed experts' own,
``k3compile/ops/moe_experts/triton_tiles.py``)."""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from k3compile.backends import triton_pdl_capable
from k3compile.ops.moe_experts.triton_tiles import _situ_glu, gdc_launch_dependents, gdc_wait

BLOCK = 1024   # elements a program: K3's shared width at a rank (384 at TP 16, 768 at TP 8) is one program a token


@triton.jit
def _situ_glu_kernel(gate_ptr, up_ptr, out_ptr, n, beta, linear_beta, HAS_BETA: tl.constexpr,
                     HAS_LINEAR_BETA: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        # launched while the up product may still run: nothing read before the wait; the down product may launch
        # (and stream its weight) once this kernel has passed it
        gdc_wait()
        gdc_launch_dependents()
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < n
    gate = tl.load(gate_ptr + offs, mask=inside, other=0.0).to(tl.float32)
    up = tl.load(up_ptr + offs, mask=inside, other=0.0).to(tl.float32)
    h = _situ_glu(gate, up, beta, linear_beta, HAS_BETA, HAS_LINEAR_BETA)
    tl.store(out_ptr + offs, h.to(out_ptr.dtype.element_ty), mask=inside)


def situ_glu_triton(gate: torch.Tensor, up: torch.Tensor, beta: Optional[float], linear_beta: Optional[float],
                    out: Optional[torch.Tensor] = None, pdl: bool = True) -> torch.Tensor:
    """gate, up [M, I] of one dtype -> h [M, I] (written into ``out`` when given: contiguous, tests pass poisoned
    ones). ``pdl``: launched with programmatic dependent launch where the GPU has it."""
    gate, up = gate.contiguous(), up.contiguous()
    out = torch.empty_like(gate) if out is None else out
    n = gate.numel()
    if n == 0:
        return out
    pdl = pdl and triton_pdl_capable(gate.device)
    _situ_glu_kernel[(triton.cdiv(n, BLOCK),)](
        gate, up, out, n, 0.0 if beta is None else float(beta), 0.0 if linear_beta is None else float(linear_beta),
        HAS_BETA=beta is not None, HAS_LINEAR_BETA=linear_beta is not None, BLOCK=BLOCK, PDL=pdl,
        **({"launch_pdl": True} if pdl else {}), num_warps=4)
    return out
