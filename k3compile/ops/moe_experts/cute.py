"""The routed experts' CuTe implementation (NVIDIA sm_90+): MXFP4 weights, bf16 activations, the decode form (M <= 16).

Three launches, back to back with PDL: the gate/up and the down products of ``cute_gate_up.py`` and ``cute_down.py``
(mma.sync, the codes read straight into registers), then the Triton combine (``triton_down._combine_kernel``: each
token's slots summed in order, fp32). Everything else (float weights, more tokens, other dtypes) stays with the Triton
kernels (``dispatch.py``).

The kernels are compiled per variant (product, M, A, configuration, SiTU-GLU's constants, the ids' dtype) with
symbolic E, widths and strides, and cached in memory and on disk as the skinny GEMM's are (``KIND`` of
``k3compile/kernel_cache.py``; ``k3compile/kernels/cute/compile.py`` says how). Nothing here imports cutlass at its
top.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import struct
import weakref
from typing import Optional

import torch

from k3compile import kernel_cache
from k3compile.backends import Reason, cute_importable
from k3compile.kernel_module import KernelModule
from k3compile.kernels.cute import compile as cute_compile

KIND = "cute_moe"
MAX_M = 16   # the kernels: blocks of 8 tokens, one MMA (N = 8) each
MAX_I = 512   # the down kernel holds each token's h row in registers
MAX_A = 32
_GATE_UP = KernelModule(f"{__package__}.cute_gate_up", cute_importable)
_DOWN = KernelModule(f"{__package__}.cute_down", cute_importable)
_SOURCES = (*(os.path.join(os.path.dirname(os.path.abspath(__file__)), f)
              for f in ("cute_gate_up.py", "cute_down.py", "e2m1_bits.py")),
            os.path.abspath(__file__),
            os.path.join(os.path.dirname(os.path.abspath(cute_compile.__file__)), "asm.py"))


@dataclasses.dataclass(frozen=True)
class Mxfp4MmaConfig:
    """The gate/up product's work division (``cute_gate_up.Mxfp4GateUpMma``): ``warps_k`` warps a block over slices of
    K, ``row_groups`` groups of 8 rows of w1 and w3 a block, ``unroll`` K steps of loads in flight a warp; ``prefetch``:
    the next ``unroll`` steps' loads issued before a chunk converts (two chunks' registers); ``scan_unrolled``: the
    prologue's look for an earlier pair of the same expert reads all M·A ids at once, not 32 a round trip;
    ``compact``: the MMA's 8 columns are only the tokens that chose the expert (from that scan's ids: it needs
    ``scan_unrolled``), in rounds of 8 where more chose it, not every token of the call."""
    warps_k: int = 4
    row_groups: int = 1
    unroll: int = 2
    prefetch: bool = False
    scan_unrolled: bool = False
    compact: bool = False

    def __post_init__(self):
        _check_compact(self)

    def tag(self) -> str:
        return (f"k{self.warps_k}r{self.row_groups}u{self.unroll}" + ("p" if self.prefetch else "")
                + ("s" if self.scan_unrolled else "") + ("c" if self.compact else ""))


@dataclasses.dataclass(frozen=True)
class Mxfp4DownConfig:
    """The down product's work division (``cute_gate_up.Mxfp4DownMma``): ``warps`` a block, each taking
    ``row_groups`` groups of 16 rows at a time, ``groups`` times; ``scan_unrolled``: as the gate/up product's, and
    before the PDL wait (the ids precede the op); ``compact``: as the gate/up product's; ``ahead``: the first group's
    codes loaded with h's rows, and each next group's while one multiplies (two groups' registers)."""
    warps: int = 4
    row_groups: int = 2
    groups: int = 2
    scan_unrolled: bool = False
    compact: bool = False
    ahead: bool = False

    def __post_init__(self):
        _check_compact(self)

    def tag(self) -> str:
        return (f"w{self.warps}r{self.row_groups}g{self.groups}" + ("s" if self.scan_unrolled else "")
                + ("c" if self.compact else "") + ("a" if self.ahead else ""))


def _check_compact(cfg) -> None:
    if cfg.compact and not cfg.scan_unrolled:
        raise ValueError(f"{type(cfg).__name__}: compact takes its tokens from the unrolled scan's ids "
                         "(scan_unrolled=True)")


# Measured at K3 TP 8 on the H200 (docs/tuning/moe_experts.md runs 8, 10, 12, 13 and 14): every pick compact (the
# MMA's columns only the expert's tokens: the op 1.0-1.7x faster than with every token's column, M 1 to 16);
# gate/up's K = L (3584) over 4 warps a block at M <= 2, the next chunk's loads issued before the current one
# converts; over 2 from M 3 (fewer, longer warps amortise the prologue), one step of loads in flight past M 8
# (125.7 against 129.5 µs at M 16); down's K = I held whole, 64 rows a block to M 8, 128 past it (89.5 against 98.9
# µs at M 16)
GATE_UP_CONFIG = Mxfp4MmaConfig(warps_k=4, row_groups=1, unroll=1, prefetch=True, scan_unrolled=True, compact=True)
GATE_UP_CONFIG_MANY = Mxfp4MmaConfig(warps_k=2, row_groups=1, unroll=2, scan_unrolled=True, compact=True)
GATE_UP_CONFIG_SIXTEEN = Mxfp4MmaConfig(warps_k=2, row_groups=1, unroll=1, scan_unrolled=True, compact=True)
# at TP 16 (I 192: half the rows to divide) 4 K-warps a block without the prefetch at M 8 (35.1 against 37.7 µs);
# M 1-4 and 16 keep TP 8's (within 2%), M 5-7 unmeasured: the nearer measured M's pick (run 17)
GATE_UP_PICKS = {   # I -> [(the largest M, the configuration)]; other I: TP 8's
    384: [(2, GATE_UP_CONFIG), (8, GATE_UP_CONFIG_MANY), (16, GATE_UP_CONFIG_SIXTEEN)],
    192: [(2, GATE_UP_CONFIG), (6, GATE_UP_CONFIG_MANY),
          (8, Mxfp4MmaConfig(warps_k=4, row_groups=1, unroll=1, scan_unrolled=True, compact=True)),
          (16, GATE_UP_CONFIG_SIXTEEN)],
}
DOWN_CONFIG = Mxfp4DownConfig(warps=4, row_groups=1, groups=2, scan_unrolled=True, compact=True)
DOWN_CONFIG_SIXTEEN = Mxfp4DownConfig(warps=4, row_groups=2, groups=2, scan_unrolled=True, compact=True)
# at TP 16 (I 192: K in a step and a half step) the loads ahead win where a block's chain is the kernel's time (M 1:
# one group a warp, 5.3 against 6.4 µs for the TP 8 pick; M 4 16.8 against 17.3), but at M 2 eight warps of one group
# (8.9 against 10.2); four groups a warp from M 8 (31.0 against 33.1), two row groups at a time too from M 12 (42.9
# against 44.8, M 16 55.6 against 57.7); M 3, 5-7 and 9-11 unmeasured, the neighbouring M's pick (runs 16, 18)
DOWN_PICKS = {   # I -> [(the largest M, the configuration)]; other I: TP 8's
    384: [(8, DOWN_CONFIG), (16, DOWN_CONFIG_SIXTEEN)],
    192: [(1, Mxfp4DownConfig(4, 1, 1, scan_unrolled=True, compact=True, ahead=True)),
          (2, Mxfp4DownConfig(8, 1, 1, scan_unrolled=True, compact=True)),
          (7, Mxfp4DownConfig(4, 1, 2, scan_unrolled=True, compact=True, ahead=True)),
          (8, Mxfp4DownConfig(4, 1, 4, scan_unrolled=True, compact=True)),
          (16, Mxfp4DownConfig(4, 2, 4, scan_unrolled=True, compact=True))],
}
_FORCED: tuple = (None, None)   # configs_forced's (gate/up, down)


@contextlib.contextmanager
def configs_forced(gate_up: Optional[Mxfp4MmaConfig] = None, down: Optional[Mxfp4DownConfig] = None):
    """Every M takes these work divisions (those not given: the picks) while inside: tests and sweeps."""
    global _FORCED
    saved, _FORCED = _FORCED, (gate_up, down)
    try:
        yield
    finally:
        _FORCED = saved


def _pick(picks: dict, m: int, i_width: int):
    """``picks``' configuration (I -> [(the largest M, the configuration)]) for M at width I; unmeasured I: TP 8's."""
    return next(cfg for last, cfg in picks.get(i_width, picks[384]) if m <= last)


def gate_up_config(m: int, i_width: int = 384) -> Mxfp4MmaConfig:
    return _FORCED[0] if _FORCED[0] is not None else _pick(GATE_UP_PICKS, m, i_width)


def down_config(m: int, i_width: int = 384) -> Mxfp4DownConfig:
    return _FORCED[1] if _FORCED[1] is not None else _pick(DOWN_PICKS, m, i_width)


def unavailable() -> Reason:
    """None where CuTe DSL can build and load the kernels, decided as for the skinny GEMM's
    (``kernels/cute/compile.py``: its install mark stands for the DSL's import, so a warm start loads cached kernels
    without importing it); this kernel module itself imports at its first build."""
    return cute_compile.unavailable()


def supports(z, experts, weights, w1, w3, w2, w1_scale, w3_scale, w2_scale, small_m_limit) -> Reason:
    """None where the CuTe kernels take this call, else why not."""
    m, l = z.shape
    if w1_scale is None:
        return "float weights (the CuTe kernels take MXFP4 codes)"
    if z.dtype != torch.bfloat16:
        return f"{z.dtype} activations (the CuTe kernels take bf16)"
    if not 1 <= m <= min(MAX_M, small_m_limit):
        return f"M={m} outside 1..{min(MAX_M, small_m_limit)} (the decode form's tokens are the MMA's N)"
    if not 1 <= experts.shape[1] <= MAX_A:
        return f"{experts.shape[1]} experts per token outside 1..{MAX_A} (the down kernel's slot masks are 32-bit)"
    if w1.shape[1] > MAX_I:
        return f"I={w1.shape[1]} above {MAX_I} (the down kernel holds h's rows whole in registers)"
    if z.stride(1) != 1 or z.stride(0) % 8 or z.data_ptr() % 16:
        return f"z must be row-major with 16-byte aligned rows (strides {z.stride()})"
    for name, t in (("w1", w1), ("w3", w3), ("w2", w2)):
        if t.stride(2) != 1 or t.stride(1) % 16 or t.stride(0) % 16 or t.data_ptr() % 16:
            return f"{name} codes must be row-major with 16-byte aligned rows (strides {t.stride()})"
    for name, t in (("w1_scale", w1_scale), ("w3_scale", w3_scale), ("w2_scale", w2_scale)):
        if t.stride(2) != 1:
            return f"{name} must have unit stride along its groups (strides {t.stride()})"
    return None


def variant(mode: str, m: int, a: int, cfg, beta, linear_beta, ids_dtype: torch.dtype, n_steps: int = 0,
            big_scales: bool = True) -> tuple:
    """The key of one compiled kernel. Down: no SiTU-GLU constants, and the steps of 64 its K (I) takes.
    ``big_scales``: the variant exact for scale bytes above 128 too (``cute_gate_up.py``)."""
    if mode == "down":
        return (mode, m, a, cfg, None, None, ids_dtype, n_steps, big_scales)
    return (mode, m, a, cfg, None if beta is None else float(beta),
            None if linear_beta is None else float(linear_beta), ids_dtype, 0, big_scales)


def _exact(x) -> str:
    return "n" if x is None else struct.pack(">d", x).hex()


def variant_name(key) -> str:
    mode, m, a, cfg, beta, linear_beta, ids_dtype, n_steps, big = key
    return (f"k3_moe_mxfp4_{mode}_m{m}_a{a}_{cfg.tag()}_b{_exact(beta)}_lb{_exact(linear_beta)}"
            f"_{str(ids_dtype).split('.')[-1]}_s{n_steps}_x{int(big)}")


@functools.cache
def fingerprint() -> str:
    return cute_compile.sources_fingerprint(_SOURCES)


def directory() -> Optional[str]:
    root = cute_compile.directory()
    return None if root is None else os.path.join(os.path.dirname(root), "moe-" + fingerprint())


def fake_args(mode: str, m: int, a: int, ids_dtype: torch.dtype):
    """(x, ids, weights, w0, w1, s0, s1, out, stream) with symbolic E, rows, widths and strides, as ``moe_experts_cute``
    calls them."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_stream, make_fake_tensor

    p = m * a
    ids_t = {torch.int64: cutlass.Int64, torch.int32: cutlass.Int32}[ids_dtype]
    k = cute.sym_int(divisibility=32)
    x = make_fake_tensor(cutlass.BFloat16, (m if mode == "gate_up" else p, k), (cute.sym_int64(divisibility=8), 1),
                         assumed_align=16)
    ids = make_fake_tensor(ids_t, (p,), (1,), assumed_align=4)
    wts = make_fake_tensor(cutlass.Float32, (p,), (1,), assumed_align=4)
    e, n = cute.sym_int(), cute.sym_int()

    def codes():
        return make_fake_tensor(cutlass.Uint8, (e, n, cute.sym_int(divisibility=16)),
                                (cute.sym_int64(divisibility=16), cute.sym_int64(divisibility=16), 1),
                                assumed_align=16)

    def scales():
        return make_fake_tensor(cutlass.Uint8, (e, n, cute.sym_int()), (cute.sym_int64(), cute.sym_int64(), 1),
                                assumed_align=1)

    w0, w1, s0, s1 = codes(), codes(), scales(), scales()
    out_t = cutlass.BFloat16 if mode == "gate_up" else cutlass.Float32
    out = make_fake_tensor(out_t, (p, n), (cute.sym_int64(), 1), assumed_align=4)
    return x, ids, wts, w0, w1, s0, s1, out, make_fake_stream(use_tvm_ffi_env_stream=True)


def build(key):
    import cutlass.cute as cute

    mode, m, a, cfg, beta, linear_beta, ids_dtype, n_steps, big = key
    if mode == "down":
        kernel = _DOWN.Mxfp4DownMma(m, a, cfg.warps, cfg.row_groups, cfg.groups, n_steps, big, cfg.scan_unrolled,
                                    cfg.compact, cfg.ahead)
    else:
        kernel = _GATE_UP.Mxfp4GateUpMma(m, a, cfg.warps_k, cfg.row_groups, cfg.unroll, beta, linear_beta, big,
                                         cfg.prefetch, cfg.scan_unrolled, cfg.compact)
    return cute.compile(kernel, *fake_args(mode, m, a, ids_dtype), options="--enable-tvm-ffi")


def warm_up() -> None:
    _GATE_UP.module()
    _DOWN.module()


STATS = kernel_cache.register(KIND, kernel_cache.Builder(
    build, cute_compile.export, cute_compile.load, variant_name, directory,
    worker_env=cute_compile.worker_env, warm_up=warm_up))


def _ids_dtype(experts: torch.Tensor) -> torch.dtype:
    return torch.int32 if experts.dtype == torch.int32 else torch.int64


def down_steps(i_width: int) -> int:
    """Steps of 64 the down kernel holds h for (its K is I), which it takes two at a time (``cute_down.py``)."""
    return (i_width + 63) // 64


# scale tensors seen, by id: (a weak reference, the version and address then, whether a byte was above 128)
_SEEN: dict = {}


def big_scales(*scales: torch.Tensor) -> bool:
    """Whether the calls on these E8M0 scales need the variants exact above a scale of 2^1 (byte 128): True unless
    every byte of each was read at most 128 at its current version (read once a tensor, outside CUDA-graph capture;
    inside a capture, where the device may not be read, an unseen tensor takes the exact variants)."""
    big = False
    for s in scales:
        hit = _SEEN.get(id(s))
        if hit is not None and hit[0]() is s and hit[1:3] == (s._version, s.data_ptr()):
            big = big or hit[3]
            continue
        if (s.is_cuda and torch.cuda.is_current_stream_capturing()) or kernel_cache.is_dry_running():
            return True   # (a dry run: no data to read, and its kernels do nothing)
        seen = bool((s > 128).any())
        _SEEN[id(s)] = (weakref.ref(s), s._version, s.data_ptr(), seen)
        big = big or seen
    return big


def kernels(z, experts, w1, beta, linear_beta, big: bool = True) -> list:
    """[(kind, key)] of the two products a call with these arguments builds at its first call."""
    m, a = experts.shape
    ids = _ids_dtype(experts)
    return [(KIND, variant("gate_up", m, a, gate_up_config(m, w1.shape[1]), beta, linear_beta, ids, 0, big)),
            (KIND, variant("down", m, a, down_config(m, w1.shape[1]), None, None, ids, down_steps(w1.shape[1]),
                           big))]


def moe_experts_cute(z: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, w1: torch.Tensor,
                     w3: torch.Tensor, w2: torch.Tensor, w1_scale: torch.Tensor, w3_scale: torch.Tensor,
                     w2_scale: torch.Tensor, beta: Optional[float] = None, linear_beta: Optional[float] = None, *,
                     out: Optional[torch.Tensor] = None, only: Optional[str] = None) -> torch.Tensor:
    """The routed experts by the CuTe kernels (shapes as ``k3::moe_experts``, ``supports`` holds). ``out`` [M, L] is
    allocated unless given; ``only`` ("gate_up", "down", "combine") launches that kernel alone (timing)."""
    from .triton import pdl_capable
    from .triton_down import _combine_kernel

    m, l = z.shape
    a = experts.shape[1]
    i_width = w1.shape[1]
    if not 1 <= m <= MAX_M:
        raise ValueError(f"moe_experts_cute: M={m} outside 1..{MAX_M}")
    if out is None:
        out = torch.empty((m, l), dtype=z.dtype, device=z.device)
    ids = experts.reshape(-1)
    if ids.dtype not in (torch.int32, torch.int64):
        ids = ids.long()
    ids = ids.contiguous()
    wts = weights.reshape(-1).float().contiguous()
    h = torch.empty((m * a, i_width), dtype=z.dtype, device=z.device)
    part = torch.empty((m * a, l), dtype=torch.float32, device=z.device)
    up_fn, down_fn = (kernel_cache.get(kind, key) for kind, key in
                      kernels(z, experts, w1, beta, linear_beta, big_scales(w1_scale, w3_scale, w2_scale)))
    with torch.cuda.device(z.device):
        if only in (None, "gate_up"):
            up_fn(z, ids, wts, w1, w3, w1_scale, w3_scale, h)
        if only in (None, "down"):
            down_fn(h, ids, wts, w2, w2, w2_scale, w2_scale, part)
        if only in (None, "combine"):
            block_n = 128
            pdl = pdl_capable(z.device)
            _combine_kernel[(m, (l + block_n - 1) // block_n)](
                part, ids, out, m, a, w1.shape[0], l, out.stride(0), out.stride(1),
                BLOCK_N=block_n, BLOCK_A=1 << (a - 1).bit_length(), PDL=pdl, num_warps=4,
                **(dict(launch_pdl=True) if pdl else {}))
    return out
