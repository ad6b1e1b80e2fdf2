"""The latent-MoE tail as two kernels: a Triton RMSNorm, then the up-projection with the shared add.

    normed = KimiRMSNorm(latent)                              # [M, L], one small Triton kernel
    out    = normed @ up_weightᵀ + shared                      # one of (SplitConfig.gemm):
             "pick":   the skinny GEMM's own pick for this product (CuTe / Triton / cuBLAS: its table), what the
                       op's dispatch runs (``skinny_gemm.dispatch.run_auto``)
             "triton": the Triton skinny kernel with a given configuration (PDL: it starts under the norm)
             "addmm":  out = shared (copied by the norm kernel); out.addmm_(normed, up_weightᵀ)
                       (cuBLAS, beta = 1: shared added before the one rounding; two kernels, not addmm's three)

The up-projection weight (7168×3584 bf16, 51 MB) dominates; the norm writes M·L elements (a few KB), so
splitting it off costs a launch, not bandwidth. With ``SplitConfig.pdl`` (sm_90+) the norm kernel is
launched with programmatic dependent launch and lets the GEMM launch right after its own wait, so a PDL
GEMM's programs are resident, and streaming their weight, while the norm runs.

Why the GEMM may always stream ``up_weight`` before its PDL wait here (``static_weight=True``), whatever
the caller proved: the norm kernel is the GEMM's stream predecessor and triggers only after its own wait
(or, launched without PDL, starts only once everything before it completed). So when the GEMM starts,
every kernel before the norm has completed, and the only kernel that can still run is the norm, which
writes nothing but ``normed``, a buffer allocated here. That is step 1 of ``k3compile/static_weights.py``
applied inside the op (with its assumption: no kernel before ours triggers before its own wait); step 2
(a kernel of the same graph made the activation) holds by construction: the norm made it.

The op's dispatch runs :class:`SplitConfig`'s defaults (the skinny GEMM's pick, no PDL). Two kernels cost the
norm's whole time, about 2.5 µs at M = 16 on an H200 (``docs/tuning/latent_moe_tail.md``): that is why the
one-kernel forms exist.

The norm rounds as the model does: normalise in fp32, cast to the activation dtype, multiply by the
weight in that dtype (``reference.kimi_rms_norm``); the GEMM accumulates in fp32 and adds ``shared``
before its single rounding.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from .triton_tiles import gdc_launch_dependents, gdc_wait, pdl_capable

MAX_NORM_BLOCK = 8192   # one tile covers K3's latent (3584); wider rows loop
GEMMS = ("pick", "triton", "addmm")


@dataclass(frozen=True, kw_only=True)
class SplitConfig:
    """How the two-kernel tail runs (``benchmarks/moe_tail.py`` compares them).

    gemm: "pick" | "triton" | "addmm" (module docstring). triton: the skinny kernel's configuration for "triton"
    (``skinny_gemm.triton_config.TritonConfig``; None: its heuristic's). pdl: the norm kernel launched with PDL
    (sm_90+), triggering right after its wait.
    """
    gemm: str = "pick"
    pdl: bool = False
    triton: Optional[object] = None

    def __post_init__(self):
        if self.gemm not in GEMMS:
            raise ValueError(f"gemm must be one of {GEMMS}, got {self.gemm!r}")

    def tag(self) -> str:
        cfg = f"[{self.triton.tag()}]" if self.gemm == "triton" and self.triton is not None else ""
        return f"split-{self.gemm}{cfg}" + ("-pdl" if self.pdl else "")


@triton.jit
def _kimi_rms_norm_kernel(p_x, p_g, p_y, p_s, p_c, L, D, eps, s_xm, s_xk, s_ym, s_yk, s_sm, s_sd, s_cm, s_cd,
                          BLOCK: tl.constexpr, PDL: tl.constexpr, COPY: tl.constexpr):
    # one program per row: the row's sum of squares, then the scaled row (and with COPY: the row of s to c)
    if PDL:
        gdc_wait()   # the latent is the previous kernel's output
        # the GEMM may launch now: see the module docstring for why it may then read its weight
        gdc_launch_dependents()
    i_m = tl.program_id(0).to(tl.int64)
    if COPY:
        for d0 in range(0, D, BLOCK):
            o_d = d0 + tl.arange(0, BLOCK)
            b_s = tl.load(p_s + i_m * s_sm + o_d * s_sd, mask=o_d < D)
            tl.store(p_c + i_m * s_cm + o_d * s_cd, b_s, mask=o_d < D)
    p_x += i_m * s_xm
    p_y += i_m * s_ym
    b_ss = tl.zeros([BLOCK], dtype=tl.float32)
    for k0 in range(0, L, BLOCK):
        o_k = k0 + tl.arange(0, BLOCK)
        b_x = tl.load(p_x + o_k * s_xk, mask=o_k < L, other=0.).to(tl.float32)
        b_ss += b_x * b_x
    b_rstd = tl.rsqrt(tl.sum(b_ss, axis=0) / L + eps)
    for k0 in range(0, L, BLOCK):
        o_k = k0 + tl.arange(0, BLOCK)
        m_k = o_k < L
        b_x = tl.load(p_x + o_k * s_xk, mask=m_k, other=0.)
        b_g = tl.load(p_g + o_k, mask=m_k, other=0.)
        # the model's rounding: normalised value in the activation dtype, then times the weight
        b_n = (b_x.to(tl.float32) * b_rstd).to(b_x.dtype)
        b_y = (b_n.to(tl.float32) * b_g.to(tl.float32)).to(b_x.dtype)
        tl.store(p_y + o_k * s_yk, b_y, mask=m_k)


def kimi_rms_norm_triton(latent: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                         out: Optional[torch.Tensor] = None, pdl: bool = False,
                         copy: Optional[tuple[torch.Tensor, torch.Tensor]] = None) -> torch.Tensor:
    """``KimiRMSNorm`` of ``latent`` [M, L] with weight [L] (one dtype); ``out`` [M, L] unless given.
    ``pdl``: launched with programmatic dependent launch where the GPU has it (the next kernel may then
    launch as soon as this one has waited for its input). ``copy=(src, dst)``: also copies ``src`` [M, D]
    into ``dst`` [M, D] (same dtype) in the same kernel."""
    m, l = latent.shape
    if out is None:
        out = torch.empty((m, l), dtype=latent.dtype, device=latent.device)
    if m == 0 or l == 0:
        return out
    if not norm_weight.is_contiguous():
        norm_weight = norm_weight.contiguous()
    block = min(MAX_NORM_BLOCK, triton.next_power_of_2(l))
    src, dst = copy if copy is not None else (out, out)
    pdl = pdl and pdl_capable(latent.device)
    # Triton launches on the current device: make it the tensors' (TP ranks, a model on cuda:1)
    on_device = torch.cuda.device(latent.device) if latent.device.type == "cuda" else contextlib.nullcontext()
    with on_device:
        _kimi_rms_norm_kernel[(m,)](
            latent, norm_weight, out, src, dst, l, src.shape[1], float(eps),
            latent.stride(0), latent.stride(1), out.stride(0), out.stride(1),
            src.stride(0), src.stride(1), dst.stride(0), dst.stride(1),
            BLOCK=block, PDL=pdl, COPY=copy is not None, num_warps=8 if block >= 4096 else 4,
            **(dict(launch_pdl=True) if pdl else {}),
        )
    return out


def latent_moe_tail_split(latent: torch.Tensor, shared: torch.Tensor, norm_weight: torch.Tensor,
                          up_weight: torch.Tensor, eps: float, config: SplitConfig = SplitConfig()) -> torch.Tensor:
    """Triton norm, then the up-projection with ``shared`` added. The GEMM always streams ``up_weight`` before its
    PDL wait (``static_weight=True``; the module docstring says why), whatever the caller proved."""
    from k3compile.ops.skinny_gemm import dispatch as gemm_dispatch  # noqa: PLC0415  (an op package of its own)

    m, l = latent.shape
    if m == 0:   # no norm kernel runs: nothing guards the weight (and there is nothing to compute)
        return gemm_dispatch.run_auto(latent.new_empty(latent.shape), up_weight, None, shared)
    if config.gemm == "addmm":
        out = torch.empty_like(shared, memory_format=torch.contiguous_format)
        normed = kimi_rms_norm_triton(latent, norm_weight, eps, pdl=config.pdl, copy=(shared, out))
        return out.addmm_(normed, up_weight.t())
    normed = kimi_rms_norm_triton(latent, norm_weight, eps, pdl=config.pdl)
    if config.gemm == "triton":
        from k3compile.ops.skinny_gemm.triton import skinny_gemm_triton  # noqa: PLC0415

        return skinny_gemm_triton(normed, up_weight, None, shared, config=config.triton, static_weight=True)
    return gemm_dispatch.run_auto(normed, up_weight, None, shared, static_weight=True)
