"""Skinny GEMM in Triton: ``out[M, N] = a[M, K] @ w[N, K]^T (+ bias[N]) (+ residual[M, N])``.

Decode GEMMs have a handful of rows and a large weight, so the kernel is a weight stream: each
program owns a ``BLOCK_N`` slice of the output columns (all M rows at once) and, when there are too
few column tiles to fill the GPU, a ``1/SPLIT_K`` slice of K. Split-K partial sums go to an fp32
workspace that a second small kernel reduces, adding the epilogue. Accumulation is fp32 always;
fp32 inputs use IEEE products (no TF32). Any M <= ``MAX_M``, N and K; tails are masked.

Runs on CUDA/ROCm tensors, and on CPU tensors under ``TRITON_INTERPRET=1`` (tests).
"""
from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from k3compile.backends import is_rocm, Reason, triton_can_run_on

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_M = 64  # beyond this the whole-M register tile spills; callers use cuBLAS there


@triton.jit
def _skinny_gemm_kernel(
    a_ptr, w_ptr, bias_ptr, res_ptr, out_ptr, ws_ptr,
    M, N, K, K_PER_SPLIT,
    stride_am, stride_ak, stride_wn, stride_wk, stride_rm, stride_rn, stride_om, stride_on,
    HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, SPLIT_K: tl.constexpr, PRECISION: tl.constexpr,
    UPCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    i_n = tl.program_id(0)
    i_k = tl.program_id(1)
    o_m = tl.arange(0, BLOCK_M)
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_m = o_m < M
    m_n = o_n < N
    k_lo = i_k * K_PER_SPLIT
    k_hi = tl.minimum(k_lo + K_PER_SPLIT, K)

    # int64 row offsets: a weight of N*K elements may exceed 2**31
    p_a = a_ptr + o_m[:, None].to(tl.int64) * stride_am
    p_w = w_ptr + o_n[:, None].to(tl.int64) * stride_wn
    b_acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        o_k = k0 + tl.arange(0, BLOCK_K)
        m_k = o_k < k_hi
        b_a = tl.load(p_a + o_k[None, :] * stride_ak, mask=m_m[:, None] & m_k[None, :], other=0.0)
        b_w = tl.load(p_w + o_k[None, :] * stride_wk, mask=m_n[:, None] & m_k[None, :], other=0.0)
        if UPCAST:
            b_a = b_a.to(tl.float32)
            b_w = b_w.to(tl.float32)
        b_acc += tl.dot(b_a, tl.trans(b_w), input_precision=PRECISION)

    m_out = m_m[:, None] & m_n[None, :]
    if SPLIT_K > 1:
        p_ws = ws_ptr + (i_k * M + o_m[:, None]) * N + o_n[None, :]
        tl.store(p_ws, b_acc, mask=m_out)
    else:
        if HAS_BIAS:
            b_acc += tl.load(bias_ptr + o_n, mask=m_n, other=0.0).to(tl.float32)[None, :]
        if HAS_RES:
            p_r = res_ptr + o_m[:, None] * stride_rm + o_n[None, :] * stride_rn
            b_acc += tl.load(p_r, mask=m_out, other=0.0).to(tl.float32)
        p_o = out_ptr + o_m[:, None] * stride_om + o_n[None, :] * stride_on
        tl.store(p_o, b_acc.to(out_ptr.dtype.element_ty), mask=m_out)


@triton.jit
def _split_k_reduce_kernel(
    ws_ptr, bias_ptr, res_ptr, out_ptr,
    M, N, stride_rm, stride_rn, stride_om, stride_on,
    HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    i_n = tl.program_id(0)
    o_m = tl.arange(0, BLOCK_M)
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_n = o_n < N
    m_out = (o_m < M)[:, None] & m_n[None, :]
    b_acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for s in range(SPLIT_K):
        b_acc += tl.load(ws_ptr + (s * M + o_m[:, None]) * N + o_n[None, :], mask=m_out, other=0.0)
    if HAS_BIAS:
        b_acc += tl.load(bias_ptr + o_n, mask=m_n, other=0.0).to(tl.float32)[None, :]
    if HAS_RES:
        b_acc += tl.load(res_ptr + o_m[:, None] * stride_rm + o_n[None, :] * stride_rn,
                         mask=m_out, other=0.0).to(tl.float32)
    tl.store(out_ptr + o_m[:, None] * stride_om + o_n[None, :] * stride_on,
             b_acc.to(out_ptr.dtype.element_ty), mask=m_out)


@dataclass(frozen=True)
class TritonConfig:
    block_m: int
    block_n: int
    block_k: int
    split_k: int
    num_warps: int = 4


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


@functools.lru_cache(maxsize=4096)
def choose_config(m: int, n: int, k: int, sm_count: int) -> TritonConfig:
    """Heuristic: whole M in one tile (>= 16 for tensor-core dots), K blocks that keep the
    two input tiles around 32 KiB of registers, and split-K until ~2 programs per SM.
    ``sm_count`` 0 means no GPU (interpreter): no split, fewer, larger programs."""
    block_m = max(16, triton.next_power_of_2(m))
    block_k = 128 if block_m <= 16 else 64
    block_k = min(block_k, max(16, triton.next_power_of_2(k)))
    block_n = 64 if n >= 64 or sm_count else max(16, triton.next_power_of_2(n))
    n_tiles = triton.cdiv(n, block_n)
    split_k = 1
    if sm_count:
        k_blocks = triton.cdiv(k, block_k)
        want = max(1, (2 * sm_count) // n_tiles)
        split_k = max(1, min(want, k_blocks // 4, 16))  # >= 4 K blocks per split
    return TritonConfig(block_m, block_n, block_k, split_k)


def supports(a, w, bias=None, residual=None) -> Reason:
    """None if the kernel handles these operands, else why not (any strides and offsets are fine)."""
    if a.dim() != 2 or w.dim() != 2:
        return f"needs 2-D a and w, got {a.dim()}-D and {w.dim()}-D"
    if a.dtype not in SUPPORTED_DTYPES:
        return f"dtype {a.dtype} not in {SUPPORTED_DTYPES}"
    for name, t in (("w", w), ("bias", bias), ("residual", residual)):
        if t is not None and t.dtype != a.dtype:
            return f"{name} dtype {t.dtype} != a dtype {a.dtype}"
    if a.shape[0] > MAX_M:
        return f"M={a.shape[0]} > {MAX_M}"
    return None


def profitable(a, w, bias=None, residual=None) -> Reason:
    """None where the kernel beats cuBLAS, else the reason. Measured on the H200 (benchmarks/results/
    skinny_gemm_h200_sweep.json, M = 1..16): ahead by 4-19% when N >= 2048 and K >= 4096 (e.g. 2112x7168,
    4608x7168, 20480x7168), 3-15% behind on narrower products (896x7168, 7168x1536, 2304x1536). ROCm has no
    measurement and no CuTe: Triton stays the path there, as it does for CPU tensors under the interpreter."""
    if a.device.type != "cuda" or is_rocm():
        return None
    n, k = w.shape
    if n >= 2048 and k >= 4096:
        return None
    return f"cuBLAS measured faster for N={n} K={k} (Triton wins at N >= 2048 and K >= 4096 on the H200)"


def available(a, w, bias=None, residual=None) -> Reason:
    return triton_can_run_on(a, w, bias, residual)


def skinny_gemm_triton(
    a: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor] = None,
    residual: Optional[torch.Tensor] = None, *, config: Optional[TritonConfig] = None,
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """``a[M, K] @ w[N, K]^T + bias[N] + residual[M, N]`` -> new ``[M, N]`` tensor in ``a.dtype``.

    a, w, bias, residual: same dtype (fp16 / bf16 / fp32), same device, any strides; M <= 64.
    ``config`` overrides the heuristic (tests, benchmarks); ``out`` ([M, N], a.dtype) receives the
    result instead of a new tensor (tests poison it with NaN first). Example::

        out = skinny_gemm_triton(x, layer.weight, layer.bias, residual=h)
    """
    reason = supports(a, w, bias, residual)
    if reason is not None:
        raise ValueError(f"skinny_gemm_triton: {reason}")
    m, k = a.shape
    n = w.shape[0]
    if w.shape[1] != k or (bias is not None and bias.shape != (n,)) or (
            residual is not None and residual.shape != (m, n)):
        raise ValueError(f"skinny_gemm_triton: shapes a{tuple(a.shape)} w{tuple(w.shape)} "
                         f"bias{None if bias is None else tuple(bias.shape)} "
                         f"residual{None if residual is None else tuple(residual.shape)} do not agree")
    if out is None:
        out = torch.empty((m, n), dtype=a.dtype, device=a.device)
    elif out.shape != (m, n) or out.dtype != a.dtype or out.device != a.device:
        raise ValueError(f"skinny_gemm_triton: out must be [{m}, {n}] {a.dtype} on {a.device}")
    if m == 0 or n == 0:
        return out
    if config is None:
        sms = _sm_count(a.device.index or 0) if a.device.type == "cuda" else 0
        config = choose_config(m, n, k, sms)
    k_per_split = triton.cdiv(triton.cdiv(k, config.split_k), config.block_k) * config.block_k
    split_k = max(1, triton.cdiv(k, k_per_split)) if k else 1
    ws = (torch.empty((split_k, m, n), dtype=torch.float32, device=a.device) if split_k > 1 else out)
    res = residual if residual is not None else out
    r_strides = (res.stride(0), res.stride(1))
    # Triton 3.7's interpreter computes 16-bit tl.dot wrongly; fp32 products of 16-bit inputs
    # are exact, so upcasting there gives the same result the GPU's 16-bit MMA does.
    upcast = a.device.type == "cpu" and a.dtype != torch.float32
    flags = dict(HAS_BIAS=bias is not None, HAS_RES=residual is not None, SPLIT_K=split_k)
    with torch.cuda.device(a.device) if a.device.type == "cuda" else contextlib.nullcontext():
        _skinny_gemm_kernel[(triton.cdiv(n, config.block_n), split_k)](
            a, w, bias if bias is not None else out, res, out, ws,
            m, n, k, k_per_split,
            a.stride(0), a.stride(1), w.stride(0), w.stride(1), *r_strides,
            out.stride(0), out.stride(1),
            # fp32: IEEE products (no TF32); 16-bit: the target's default (ROCm rejects "tf32")
            PRECISION="ieee" if a.dtype == torch.float32 or upcast else None, UPCAST=upcast,
            BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
            num_warps=config.num_warps, **flags,
        )
        if split_k > 1:
            _split_k_reduce_kernel[(triton.cdiv(n, config.block_n),)](
                ws, bias if bias is not None else out, res, out,
                m, n, *r_strides, out.stride(0), out.stride(1),
                BLOCK_M=config.block_m, BLOCK_N=config.block_n, num_warps=config.num_warps, **flags,
            )
    return out

