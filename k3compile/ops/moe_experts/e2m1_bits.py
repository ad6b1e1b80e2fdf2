"""The bit recipe by which the CuTe MXFP4 kernels (``cute_gate_up.py``, ``cute_down.py``) turn eight E2M1 codes into
bf16 bit patterns, and the same recipe on integer tensors so that the CPU tests can check it against
``reference.dequantize_mxfp4``.

A 32-bit word holds eight codes, element j in bits 4j..4j+3 (bit 3 of a code its sign). Output register k (0..3)
holds elements k and k + 4 (low and high bf16). Nibbles k and k + 4 of a word x, masked (``MASK``) and multiplied
by ``MUL``, land as two non-overlapping copies: the magnitude bits of one at 6..8 / 22..24 (bf16's two lowest exponent
bits and its top mantissa bit) and the sign bit of the other at 15 / 31; ``BF16_BITS`` keeps just those. The pattern
is worth value · 2^-126 (zero and 0.5 subnormal), so one bf16x2 multiply by 2^(scale - 1) gives the dequantised
value exactly. Words w and w >> 8 give the four pairs.
"""
from __future__ import annotations

MASK = (0x000F000F, 0x00F000F0)
MUL = ((1 << 6) + (1 << 12), (1 << 2) + (1 << 8))
BF16_BITS = 0x81C081C0
PAIRS = ((0, 0), (0, 1), (8, 0), (8, 1))   # output register k: (right shift of the word, recipe)


def e2m1x8_ptx() -> str:
    """PTX: $4 the word, $5 the bf16x2 factor -> $0..$3 (fma with -0.0: the product's value and sign)."""
    body = ["{ .reg .b32 x8, t, nz; mov.b32 nz, 0x80008000; shr.b32 x8, $4, 8;"]
    for out, (shift, k) in enumerate(PAIRS):
        src = "$4" if shift == 0 else "x8"
        body.append(f"and.b32 t, {src}, {MASK[k]:#x}; mul.lo.u32 t, t, {MUL[k]:#x}; and.b32 t, t, {BF16_BITS:#x}; "
                    f"fma.rn.bf16x2 ${out}, t, $5, nz;")
    return " ".join(body) + " }"


def e2m1x8_bits(words):
    """The recipe on an int64 tensor of 32-bit words: [..., 4] int64 of bf16x2 bit patterns (before the factor)."""
    import torch

    out = []
    for shift, k in PAIRS:
        t = ((words >> shift) & MASK[k]) * MUL[k]
        out.append(t & 0xFFFFFFFF & BF16_BITS)
    return torch.stack(out, dim=-1)
