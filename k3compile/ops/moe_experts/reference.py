"""Plain PyTorch routed experts (spec §6.2 step 3), any device: the ground truth the kernels are tested against.

Shape legend: M tokens, A experts per token (top-k), E experts, L latent width, I expert intermediate width.

    for each token m and slot a, with e = experts[m, a]:
        gate = w1[e] @ z[m],  up = w3[e] @ z[m]                         # [I]
        h    = situ_beta(gate) · linear_beta·tanh(up / linear_beta)     # SiTU-GLU (model/layers.py situ_glu)
        y    = w2[e] @ h                                                # [L]
    out[m] = Σ_a weights[m, a] · y                                      # fp32, cast to z's dtype

Math in fp32, rounded to z's dtype exactly where the model rounds (``model/moe.py`` ``experts_gathered``):
gate and up after their products, h after the activation, y after the down product; the combine stays fp32
until the final cast. ``beta=None`` is plain SiLU and ``linear_beta=None`` leaves ``up`` uncapped
(Kimi Linear).

MXFP4 weights (``w*_scale`` given): codes uint8 [E, rows, cols/2] (element 2j in the low nibble, 2j+1 in
the high; E2M1: bit 3 sign, magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6) and E8M0 scales uint8 [E, rows, cols/32]:
value = E2M1(code) · 2^(scale − 127) (/work/shared/docs spec §3), dequantised to z's dtype as the model does.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

MXFP4_GROUP = 32
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def dequantize_mxfp4(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """codes uint8 [..., C/2] and E8M0 scales uint8 [..., C/32] -> [..., C] in ``dtype`` (fp32 math, one rounding).
    A scale byte of 255 (E8M0 NaN) gives NaN."""
    table = torch.tensor(E2M1_MAGNITUDES + tuple(-v for v in E2M1_MAGNITUDES), dtype=torch.float32,
                         device=packed.device)
    codes = torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(-2)              # [..., C]
    values = table[codes.long()]
    exponent = scale.float() - 127.0
    factor = torch.where(scale == 255, torch.nan, torch.exp2(exponent))
    return (values * factor.repeat_interleave(MXFP4_GROUP, dim=-1)).to(dtype)


def _situ_glu(gate: torch.Tensor, up: torch.Tensor, beta: Optional[float], linear_beta: Optional[float]):
    """fp32 in, fp32 out: ``situ_beta(gate) · linear_beta·tanh(up / linear_beta)`` (``beta=None``: SiLU)."""
    act = F.silu(gate) if beta is None else beta * torch.tanh(gate / beta) * torch.sigmoid(gate)
    if linear_beta is not None:
        up = linear_beta * torch.tanh(up / linear_beta)
    return act * up


def expert_weights(w: torch.Tensor, scale: Optional[torch.Tensor], e: int, dtype: torch.dtype) -> torch.Tensor:
    """Expert ``e``'s matrix in ``dtype``: the float stack's slice, or its MXFP4 codes dequantised."""
    return w[e] if scale is None else dequantize_mxfp4(w[e], scale[e], dtype)


def check_expert_ids(experts: torch.Tensor, num_experts: int) -> None:
    """ValueError naming the first expert id outside [0, E) (reads the ids on the host)."""
    bad = (experts < 0) | (experts >= num_experts)
    if bool(bad.any()):
        where = tuple(int(i) for i in bad.nonzero()[0])
        raise ValueError(f"moe_experts: expert id {int(experts[where])} at {where} is outside [0, {num_experts})")


def _expert_pairs(flat: torch.Tensor):
    """(expert id, its (token, slot) pair indices) for each distinct id of the flat [M·A] ids, in id order."""
    for e in torch.unique(flat).tolist():
        yield e, (flat == e).nonzero().squeeze(1)


def gate_up_ref(z: torch.Tensor, experts: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor,
                w1_scale: Optional[torch.Tensor] = None, w3_scale: Optional[torch.Tensor] = None,
                beta: Optional[float] = None, linear_beta: Optional[float] = None) -> torch.Tensor:
    """h [M·A, I] in z's dtype: the activation of every (token, slot) pair, one distinct expert at a time (both
    products rounded to z's dtype, as the model rounds them). Ids are not checked here."""
    dtype = z.dtype
    a = experts.shape[1]
    h = torch.empty(experts.numel(), w1.shape[1], dtype=dtype, device=z.device)
    for e, pairs in _expert_pairs(experts.reshape(-1)):
        x = z[torch.div(pairs, a, rounding_mode="floor")].float()                   # [R, L]
        gate = (x @ expert_weights(w1, w1_scale, e, dtype).float().t()).to(dtype).float()   # [R, I]
        up = (x @ expert_weights(w3, w3_scale, e, dtype).float().t()).to(dtype).float()
        h[pairs] = _situ_glu(gate, up, beta, linear_beta).to(dtype)
    return h


def moe_experts_ref(z: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, w1: torch.Tensor,
                    w3: torch.Tensor, w2: torch.Tensor, w1_scale: Optional[torch.Tensor] = None,
                    w3_scale: Optional[torch.Tensor] = None, w2_scale: Optional[torch.Tensor] = None,
                    beta: Optional[float] = None, linear_beta: Optional[float] = None) -> torch.Tensor:
    """The routed experts of M tokens, one distinct expert at a time (each expert's weights read once).

    z [M, L]; experts [M, A] integer ids in [0, E) (else ValueError); weights [M, A] (fp32 math);
    float weights w1, w3 [E, I, L], w2 [E, L, I] in z's dtype, or MXFP4 codes with scales (module doc).
    Returns [M, L] in z's dtype.
    """
    check_expert_ids(experts, w1.shape[0])
    dtype = z.dtype
    m, a = experts.shape
    h = gate_up_ref(z, experts, w1, w3, w1_scale, w3_scale, beta, linear_beta)    # [M·A, I]
    ys = torch.zeros(m * a, z.shape[1], dtype=torch.float32, device=z.device)     # y of every (token, slot)
    for e, pairs in _expert_pairs(experts.reshape(-1)):
        ys[pairs] = (h[pairs].float() @ expert_weights(w2, w2_scale, e, dtype).float().t()).to(dtype).float()
    # the combine as the model writes it: weight every slot, sum over the slots in order
    return (ys.view(m, a, -1) * weights.float()[..., None]).sum(1).to(dtype)
