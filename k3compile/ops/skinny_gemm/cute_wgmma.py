"""The skinny GEMM as a Hopper warpgroup-MMA (wgmma) CuTe DSL kernel, M ≤ 16: ``C = A · Wᵀ (+ bias) (+ residual)``.

a: [M, K] (M ≤ 16), w: [N, K], bias: [N] or None, residual: [M, N] or None, all bf16 or all fp16, fp32
accumulation, one rounding at the end (as ``reference.py``). One kernel per (dtype, M, configuration, bias?,
residual?, static weight?, fused-norm eps); N, K and the row strides are run-time values. With a fused-norm eps
it is the latent-MoE tail, ``C = rsqrt(mean(A², K) + eps) · ((A·g) · Wᵀ) + residual`` (g a norm weight [K]; the
kernel module says how; ``k3compile/ops/latent_moe_tail/cute.py`` calls it).

Why a second CuTe kernel: the mma.sync kernel (``cute.py``) loads A's fragment per warp, so above M = 4 A's traffic
past L1 sets its speed (NOTE6). Here the operands swap sides (swap-AB): the weight tile is wgmma's M side
(``block_n`` = 64 or 128 rows), A is its N side (8 or 16 rows, rows ≥ M zero-filled by TMA), and both reach shared
memory by TMA into one multi-stage ring (mbarrier pipeline): A's [16, block_k] chunk is read from L2 once per block
per stage, by the TMA unit, whatever M is. The accumulator is tiny (64 × 16 fp32 over a warpgroup: 8 registers a
thread), so the kernel is one warpgroup that streams; its only job is to keep enough weight bytes in flight.

Split-K across a thread-block cluster (``split_k``): the cluster's blocks take contiguous K ranges of the same
rows; each writes its partial tile to shared memory, and after a cluster barrier each block sums its share of the
outputs over every block's tile through distributed shared memory (no workspace, no L2 round trip, CUDA-graph safe).
With ``push_partials`` the partial sums go one way instead: the MMA thread t of every block holds the same outputs'
partials (its accumulator fragment), and owner block ⌊t · owners / 128⌋ sums them; the other blocks' thread t sends
its fragment from registers (``st.async``) into the owner's shared memory, counted on one mbarrier there. The
cluster barrier, the round trip of remote loads and the closing barrier (our shared memory must outlive the others'
reads) all go; the barrier that checks the cluster is up is arrived at the kernel's start and waited on at the end of
the K loop; with ``owners`` below ``split_k`` the blocks that own nothing exit as soon as they have pushed, so their
SMs go to the next kernel's blocks (what most of the router's gain is). The epilogue adds bias / residual and stores
C (on the read path coalesced along N). Options (``WgmmaConfig``): a fifth warp that only issues the TMA loads, L2
eviction hints on them, and the PDL trigger right after the wait.

Register tiles (``reg_stages``): a block's first weight tiles go from the ring to registers before the PDL wait and
their slots take the rest of its share, so a block holds its whole share in less shared memory. Where that lets two
blocks share an SM, the next product's blocks stream their weight while ours finish (the router: 4.1-4.5 µs to
3.4-3.9; ``config.py`` has the measurements).

Programmatic dependent launch: everything before ``griddepcontrol.wait`` is setup; with ``static_weight`` (no
kernel writes W: module parameters) the weight tiles of the first stages are already requested by TMA before the
wait, A's after it. The next kernel may launch once our K loop is done: a block's first trigger counts, so with a
producer warp or norm warps that is when theirs is, stages earlier, unless ``mma_trigger`` leaves it to the MMA warps;
with ``trigger_first`` and a static weight, as the block starts (several products' weights then stream at once).

This module is the host side (configuration, predicates, compile cache, entry points; the measured picks are in
``config.py``'s tables beside the mma.sync kernel's); the kernel is ``cute_wgmma_kernel.py``. cutlass is imported
only inside functions: CI has no CuTe DSL and must still import this module.
"""
# no `from __future__ import annotations`: the DSL evaluates the kernels' annotations
import functools
import hashlib
import os
import struct
from typing import Optional

import torch


from k3compile.kernels.cute.configs import SMEM_LIMIT, VEC, WgmmaConfig, m_pad, push_slot

# L2 cache-policy operands of the TMA loads (the encodings CUTLASS's CacheHintSm90 names)
EVICT_FIRST_POLICY = 0x12F0000000000000
EVICT_LAST_POLICY = 0x14F0000000000000


# --------------------------------------------------------------------------------------------------
# compiling (the memory and disk cache is cute_compile.py's, under this kernel's own fingerprint)

@functools.cache
def _source_fingerprint() -> str:
    """What a cached kernel depends on: the kernel's source and what builds it (not the tables: a variant's name
    spells its configuration), the DSL version and the target arch."""
    import inspect

    from k3compile.ops.skinny_gemm import cute_compile

    h = hashlib.sha256()
    with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "cute_wgmma_kernel.py"), "rb") as fh:
        h.update(fh.read())
    for obj in (WgmmaConfig, m_pad, push_slot, _fake_args, _variant_name, _build, compile_kernel):
        h.update(inspect.getsource(obj).encode())
    h.update(repr((VEC, SMEM_LIMIT, EVICT_FIRST_POLICY, EVICT_LAST_POLICY)).encode())
    h.update(cute_compile.dsl_and_arch().encode())
    return "wg" + h.hexdigest()[:14]


def _variant_name(key) -> str:
    dtype, m, cfg, has_bias, has_res, static_w, eps = key
    norm = "" if eps is None else "_norm" + struct.pack(">d", eps).hex()   # the exact eps, name-safe
    return (f"k3_wgmma_{str(dtype).split('.')[-1]}_m{m}_{cfg.tag().replace('-', '_')}"
            f"_b{int(has_bias)}_r{int(has_res)}_s{int(static_w)}{norm}")


def _fake_args(dtype: torch.dtype, m: int, has_bias: bool, has_res: bool, has_norm: bool = False):
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_stream, make_fake_tensor

    from k3compile.ops.skinny_gemm.cute_compile import cute_dtype

    cd = cute_dtype(dtype)
    n, k = cute.sym_int(), cute.sym_int(divisibility=VEC)
    lda, ldw = cute.sym_int64(divisibility=VEC), cute.sym_int64(divisibility=VEC)
    # A's row count is left dynamic: a static extent of 1 collapses its TMA to 1-D (an illegal instruction on the
    # H200 with the 2-D swizzled box); the kernel's M is the compile-time ``m`` all the same
    a = make_fake_tensor(cd, (cute.sym_int(), k), (lda, 1), assumed_align=16)
    w = make_fake_tensor(cd, (n, k), (ldw, 1), assumed_align=16)
    c = make_fake_tensor(cd, (m, n), (cute.sym_int64(), 1), assumed_align=2)
    bias = make_fake_tensor(cd, (n,), (1,), assumed_align=2) if has_bias else None
    res = make_fake_tensor(cd, (m, n), (cute.sym_int64(), 1), assumed_align=2) if has_res else None
    g = make_fake_tensor(cd, (k,), (1,), assumed_align=16) if has_norm else None   # the fused tail's norm weight
    return a, w, c, bias, res, g, make_fake_stream(use_tvm_ffi_env_stream=True)


def compile_kernel(dtype: torch.dtype, m: int, cfg: WgmmaConfig, has_bias: bool, has_res: bool,
                   static_weight: bool = False, norm_eps: Optional[float] = None):
    """The compiled kernel for this variant: from memory, else from disk, else compiled (and saved). It is called as
    ``fn(a, w, out, bias, residual, g)``, like the mma.sync kernel (``cute_compile.compile_kernel`` forwards a
    ``WgmmaConfig`` here); ``norm_eps``: the fused latent-MoE tail (``g`` the norm weight, else None)."""
    from k3compile.ops.skinny_gemm.cute_compile import cached_kernel

    key = (dtype, m, cfg, has_bias, has_res, static_weight, None if norm_eps is None else float(norm_eps))
    return cached_kernel(key, _variant_name(key), _source_fingerprint(), lambda: _build(key))


def _build(key):
    import cutlass.cute as cute

    from k3compile.ops.skinny_gemm.cute_compile import cute_dtype
    from k3compile.ops.skinny_gemm.cute_wgmma_kernel import kernel_class

    dtype, m, cfg, has_bias, has_res, static_w, eps = key
    bad = cfg.invalid()
    if bad:
        raise ValueError(f"WgmmaConfig {cfg.tag()}: {bad}")
    kern = kernel_class()(cute_dtype(dtype), m, cfg, has_bias, has_res, static_w, eps)
    return cute.compile(kern, *_fake_args(dtype, m, has_bias, has_res, eps is not None), options="--enable-tvm-ffi")
