"""MXFP4, the format K3's routed experts ship in (OCP Microscaling: 4-bit E2M1 elements, one E8M0 scale a group).

A logical matrix [R, C] is stored as ``packed`` uint8 [R, C/2] (element 2j in the low nibble, 2j+1 in the high one)
and ``scale`` uint8 [R, C/32] (one per 32 consecutive columns); value = E2M1(code) * 2^(scale - 127).
E2M1 codes: bit 3 the sign, bits 0-2 the magnitude 0, 0.5, 1, 1.5, 2, 3, 4, 6 (code 8 is -0). E8M0 scale 255
is NaN in the format; a checkpoint holding it is rejected at load (:func:`scale_nan`), and the dequantisation,
which must not look at data on the host, turns it into inf (or 0 for a zero code).

:func:`dequantize_mxfp4` is written in elementwise integer and float ops with scalar constants only (no lookup
table: a tensor constant would become a ``get_attr`` node that Inductor's pattern matcher cannot trace), so a
compiled graph holds it as a plain chain that rewrite patterns can match, and it is exact: every power of two is
built from its exponent bits, never by ``exp2``.
"""
from __future__ import annotations

import math

import torch

GROUP = 32                 # elements per E8M0 scale
MXFP4_GROUP = GROUP
E8M0_BIAS = 127
E8M0_NAN = 255

# E2M1 magnitudes by 3-bit code; bit 3 is the sign
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_VALUES = torch.tensor(E2M1 + tuple(-v for v in E2M1), dtype=torch.float32)   # by 4-bit code


def e2m1_to_float(code: torch.Tensor) -> torch.Tensor:
    """4-bit codes (any integer dtype, values 0..15) -> float32 values, code 8 giving -0.0.

    Twice the magnitude is an integer: k for k < 4, else (2 + (k & 1)) << ((k >> 1) - 1), i.e. 4, 6, 8, 12.
    """
    c = code.to(torch.int32)
    k = c & 7
    shift = ((k >> 1) & 1) + 1                       # (k >> 1) - 1 where k >= 4, never negative
    twice = torch.where(k < 4, k, ((k & 1) | 2) << shift)
    half = torch.where(c > 7, -0.5, 0.5)
    return twice.to(torch.float32) * half


def e8m0_halves(scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """uint8 E8M0 scale s -> two float32 powers of two whose product is 2^(s - 127), each a normal number
    (2^(s - 127) itself is subnormal for s = 0 and a device that flushes subnormals would lose it).

    s = lo + hi with lo = s >> 1: 2^(lo - 63) * 2^(hi - 64), built from the exponent bits.
    """
    s = scale.to(torch.int32)
    lo = s >> 1
    hi = s - lo
    return ((lo + 64) << 23).view(torch.float32), ((hi + 63) << 23).view(torch.float32)


def dequantize_mxfp4(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """packed uint8 [..., R, C/2], scale uint8 [..., R, C/32] -> [..., R, C] in ``dtype``.

    Exact: the float32 product of a code's value and its scale's two halves is rounded once, to ``dtype``.
    """
    if packed.dtype != torch.uint8 or scale.dtype != torch.uint8:
        raise ValueError(f"MXFP4 expects uint8 packed codes and scales, got {packed.dtype} / {scale.dtype}")
    half = packed.shape[-1]
    if (2 * half) % GROUP or scale.shape != (*packed.shape[:-1], 2 * half // GROUP):
        raise ValueError(f"MXFP4 shapes disagree: packed {tuple(packed.shape)}, scale {tuple(scale.shape)} "
                         f"(one scale per {GROUP} values, two values a byte)")
    codes = torch.stack([packed & 0xF, packed >> 4], dim=-1)                 # [..., R, C/2, 2]
    values = e2m1_to_float(codes).reshape(*scale.shape, GROUP)               # [..., R, C/32, 32]
    lo, hi = e8m0_halves(scale)
    values = values * lo[..., None] * hi[..., None]
    return values.reshape(*packed.shape[:-1], 2 * half).to(dtype)


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., R, C] -> (packed uint8 [..., R, C/2], scale uint8 [..., R, C/32]).

    Each group gets the smallest power-of-two scale that puts its largest magnitude at or below 6, then each value
    rounds to the nearest E2M1 magnitude (ties to the smaller one). Exact for values MXFP4 can represent; an
    all-zero group gets scale 0. Finite input only.
    """
    C = w.shape[-1]
    if C % GROUP:
        raise ValueError(f"MXFP4 needs the column count ({C}) to be a multiple of {GROUP}")
    groups = w.float().reshape(*w.shape[:-1], C // GROUP, GROUP)
    amax = groups.abs().amax(-1)
    exponent = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127)          # an all-zero group: -inf -> -127
    scaled = groups / torch.exp2(exponent)[..., None]
    magnitudes = torch.tensor(E2M1, device=w.device)
    code = (scaled.abs()[..., None] - magnitudes).abs().argmin(-1)            # nearest magnitude
    code = code + 8 * ((scaled < 0) & (code > 0)).long()
    code = code.to(torch.uint8).reshape(*w.shape[:-1], C // 2, 2)
    packed = code[..., 0] | (code[..., 1] << 4)
    return packed, (exponent + E8M0_BIAS).to(torch.uint8)


def scale_for_rms(rms: float) -> int:
    """The E8M0 scale byte whose power of two gives uniformly random codes (both nibbles uniform over all 16)
    the RMS nearest ``rms``: random MXFP4 weights distributed like a float init of that RMS (tests, benchmarks)."""
    code_rms = math.sqrt(sum(v * v for v in E2M1) / len(E2M1))
    return int(min(254, max(0, round(math.log2(rms / code_rms)) + E8M0_BIAS)))


def scale_nan(scale: torch.Tensor) -> torch.Tensor:
    """0-dim bool tensor: does any E8M0 scale hold the NaN encoding 255 (checked at load, on the tensor's device)."""
    return (scale == E8M0_NAN).any()


def packed_shapes(rows: int, cols: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """Shapes of the codes and scales of a logical [rows, cols] matrix."""
    if cols % GROUP:
        raise ValueError(f"MXFP4 needs the column count ({cols}) to be a multiple of {GROUP}")
    return (rows, cols // 2), (rows, cols // GROUP)
