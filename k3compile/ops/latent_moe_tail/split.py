"""The latent-MoE tail as two kernels: a Triton RMSNorm, then the up-projection with the shared add.

    normed = KimiRMSNorm(latent)                              # [M, L], one small Triton kernel
    out    = normed @ up_weightᵀ + shared                      # one of (SplitConfig.gemm):
             "op":     k3::skinny_gemm(normed, up_weight, residual=shared)  (CuTe / Triton / cuBLAS, recorded)
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

Which configuration runs where is measured (:data:`SPLIT_TUNED`); elsewhere :class:`SplitConfig`'s
defaults (no PDL, the skinny-GEMM op).

Why two kernels cost the norm's whole time (H200, M = 16, one graph replay under the profiler, TAIL5 run 1):
the shipped form ran 18.9 µs per tail = norm 2.4 + GEMM 15.5 + two gaps of 0.3-0.9, against 14.9 for the
GEMM alone. Nothing overlaps the norm: launched without PDL it starts once the previous GEMM has completed,
and the GEMM, PDL-launched and told the weight is static, still reads nothing before its wait (the Triton
skinny kernel's configurations preload no weight tile: that measured slower), so it streams only once the
norm is done. The PDL norm (``SplitConfig("triton", pdl=True)``) removes the gaps, not the norm: 17.1 µs.
The one-kernel tail (``triton.py``) ran 15.2 µs in the same run.

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

from .triton import gdc_launch_dependents, gdc_wait, m_bucket, pdl_capable

MAX_NORM_BLOCK = 8192   # one tile covers K3's latent (3584); wider rows loop
GEMMS = ("op", "triton", "addmm")


@dataclass(frozen=True)
class SplitConfig:
    """How the two-kernel tail runs (swept on the GPU; see :data:`SPLIT_TUNED`).

    gemm: "op" | "triton" | "addmm" (module docstring). triton: the skinny kernel's configuration for
    "triton" (``k3compile.ops.skinny_gemm.triton.TritonConfig``; None: its own choice). pdl: the norm kernel
    launched with PDL (sm_90+), triggering right after its wait. backend: for "op", the skinny-GEMM op's
    backend instead of the tail's (e.g. "cute": its CuTe kernel where the op's table would take cuBLAS).
    """
    gemm: str = "op"
    pdl: bool = False
    triton: Optional[object] = None
    backend: Optional[str] = None

    def __post_init__(self):
        if self.gemm not in GEMMS:
            raise ValueError(f"gemm must be one of {GEMMS}, got {self.gemm!r}")

    def tag(self) -> str:
        cfg = f"[{self.triton.tag()}]" if self.gemm == "triton" and self.triton is not None else ""
        return f"split-{self.gemm}{cfg}" + (f"-{self.backend}" if self.backend else "") + ("-pdl" if self.pdl else "")


# (dtype, M bucket, D, L) -> the configuration measured fastest on one H200; others take SplitConfig().
SPLIT_TUNED: dict[tuple[str, int, int, int], SplitConfig] = {}


def split_config(m: int, d: int, l: int, dtype: torch.dtype, on_gpu: bool = True) -> SplitConfig:
    """The measured entry for this shape (GPU tensors only), else the defaults."""
    if not on_gpu:
        return SplitConfig()
    return SPLIT_TUNED.get((str(dtype).removeprefix("torch."), m_bucket(m), d, l), SplitConfig())


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
                          up_weight: torch.Tensor, eps: float, backend: str = "auto",
                          m_limit: int = 16, static_weight: bool = False,
                          config: Optional[SplitConfig] = None) -> torch.Tensor:
    """Triton norm, then the up-projection with ``shared`` added (``config``: :func:`split_config`'s).

    With ``gemm="op"``: ``k3::skinny_gemm(normed, up_weight, None, shared, backend, m_limit)``, which picks
    CuTe, Triton or cuBLAS and records its choice under ``skinny_gemm``. The GEMM always gets
    ``static_weight=True`` (module docstring: the norm kernel is the only one that can still run when it
    starts), so the caller's ``static_weight`` changes nothing here; it is accepted for the op's dispatch."""
    from k3compile.ops.skinny_gemm import skinny_gemm_op  # noqa: PLC0415  (an op package of its own)

    m, l = latent.shape
    if config is None:
        config = split_config(m, up_weight.shape[0], l, latent.dtype, latent.device.type == "cuda")
    if m == 0:   # no norm kernel runs: nothing guards the weight (and there is nothing to compute)
        return skinny_gemm_op(latent.new_empty(latent.shape), up_weight, None, shared, backend, m_limit)
    if config.gemm == "addmm":
        out = torch.empty_like(shared, memory_format=torch.contiguous_format)
        normed = kimi_rms_norm_triton(latent, norm_weight, eps, pdl=config.pdl, copy=(shared, out))
        return out.addmm_(normed, up_weight.t())
    normed = kimi_rms_norm_triton(latent, norm_weight, eps, pdl=config.pdl)
    if config.gemm == "triton":
        from k3compile.ops.skinny_gemm.triton import skinny_gemm_triton  # noqa: PLC0415

        return skinny_gemm_triton(normed, up_weight, None, shared, config=config.triton, static_weight=True)
    return skinny_gemm_op(normed, up_weight, None, shared, config.backend or backend, m_limit, static_weight=True)
