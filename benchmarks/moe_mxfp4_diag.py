"""Where the MXFP4 routed experts' gate/up time goes (issue #28), one H200, K3 TP=8 shapes (E 896, top-16, L 3584,
I 384), random routing, CUDA graphs over enough routings ("layers") that every call streams its experts from HBM.

Rows printed (variant, M, µs per call, % of the gate/up floor, rel err of h against the reference's h):
- ``copy``: the floor's own yardstick, the same-run 1 GiB device copy (benchmarks/_common.py copy_ceiling_tbps);
  the floor is the bytes of the distinct selected experts' w1 + w3 codes and scales, plus z and h, at that rate;
- ``gemv-load-r{R}-w{W}``: every one of those bytes read by a program per (pair, R rows of w1 and of w3), its whole
  slab loaded at once (``triton_gemv`` MODE 0): what this grid reaches for bytes alone;
- ``gemv-conv`` (MODE 1, + the conversion), ``gemv-r{R}-w{W}`` (MODE 2, the GEMV candidate itself, h checked);
- ``rows-{load,triv,full}-i{BI}-l{BL}-w{W}s{S}``: the weight rows form of ``triton.py``'s gate/up kernel (the
  wgmma form) as a copy here with one knob, MODE: ``load`` the same loads (codes as 16-byte words, scales, z)
  xor-summed, no conversion, no product (Triton pipelines no load that feeds no dot: these loads are plain, not
  cp.async); ``triv`` the product with a trivial conversion (a byte shifted into a bf16: the loads still feed a
  dot, so Triton pipelines them as in the real kernel); ``full`` the real conversion (``E2M1_BF16_BITS`` PTX) and
  product;
- ``op-gate_up[...]``: the production gate/up kernel alone (``moe_experts_triton(only="gate_up")``) with the table's
  pick and the rows configurations run 3 measured; ``op[...]``: the whole op (rel err of out).

Run from the repository root: ``python benchmarks/moe_mxfp4_diag.py`` (--m 1 16, --seconds per variant).
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time
import traceback

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from k3compile.ops.moe_experts.config import MoeConfig, default_config, table, tuned_config  # noqa: E402
from k3compile.ops.moe_experts.reference import gate_up_ref, moe_experts_ref  # noqa: E402
from k3compile.ops.moe_experts.triton import moe_experts_triton  # noqa: E402
from k3compile.ops.moe_experts.triton_gemv import GEMV_MAX_M, gate_up_gemv  # noqa: E402
from k3compile.ops.moe_experts.triton_tiles import (E2M1_BF16_BITS, _chunk_pairs, _e8m0_bf16,  # noqa: E402
                                                    _my_expert)

E, A, L, I = 896, 16, 3584, 384
BETAS = (4.0, 25.0)
DEVICE = "cuda"


# ---------------------------------------------------------------------------------------------------------------
# the weight rows gate/up kernel with an ablation knob (triton.py's _gate_up_kernel, ROWS, decode, EVEN_K, ASM)

@triton.jit
def _rows_ablation_kernel(p_z, p_ids, p_w1, p_w3, p_s1, p_s3, p_h, p_sink, M, A, I, L,
                          s_zm, s_1e, s_1i, s_3e, s_3i, s_s1e, s_s1i, s_s3e, s_s3i, s_hp,
                          BLOCK_M: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_L: tl.constexpr,
                          BLOCK_A: tl.constexpr, MODE: tl.constexpr):
    """MODE 0: loads only; 1: loads, a trivial conversion and the product; 2: the real conversion and product."""
    slot = tl.program_id(0)
    i_i = tl.program_id(1)
    e, runs, start, chunks, count = _my_expert(p_ids, p_ids, slot, M, A, False, BLOCK_M, BLOCK_A)
    if runs:
        R: tl.constexpr = 2 * BLOCK_I
        G: tl.constexpr = BLOCK_L // 32
        e64 = e.to(tl.int64)
        o_r = tl.arange(0, R)
        o_ir = i_i * BLOCK_I + o_r % BLOCK_I
        p_wr = tl.where(o_r >= BLOCK_I, p_w3 + e64 * s_3e + o_ir * s_3i, p_w1 + e64 * s_1e + o_ir * s_1i)
        p_sr = tl.where(o_r >= BLOCK_I, p_s3 + e64 * s_s3e + o_ir * s_s3i, p_s1 + e64 * s_s1e + o_ir * s_s1i)
        pairs, m_j = _chunk_pairs(p_ids, p_ids, e, start, 0, count, M, A, False, BLOCK_M, BLOCK_A)
        p_zj = p_z + (pairs // A)[:, None] * s_zm
        m_z = m_j[:, None]
        o_g = tl.arange(0, G)
        acc = tl.zeros([R, BLOCK_M], dtype=tl.float32)
        x_w = tl.zeros([R, G, 4], dtype=tl.int32)
        x_s = tl.zeros([R, G], dtype=tl.int32)
        x_z = tl.zeros([BLOCK_M, BLOCK_L], dtype=tl.float32)
        for l0 in range(0, L, BLOCK_L):
            g0 = l0 // 32 + o_g
            o_k = l0 + tl.arange(0, BLOCK_L)
            b_s = tl.load(p_sr[:, None] + g0[None, :], eviction_policy="evict_first")
            b_z = tl.load(p_zj + o_k[None, :], mask=m_z, other=0.)
            if MODE == 0:
                p_w32 = p_wr.to(tl.pointer_type(tl.int32), bitcast=True)
                b_w = tl.load(p_w32[:, None, None] + (g0[None, :, None] * 4 + tl.arange(0, 4)[None, None, :]),
                              eviction_policy="evict_first")
                x_w = x_w ^ b_w
                x_s = x_s + b_s.to(tl.int32)
                x_z = x_z + b_z.to(tl.float32)
            else:
                b_c = tl.load(p_wr[:, None, None] + (g0[None, :, None] * 16 + tl.arange(0, 16)[None, None, :]),
                              eviction_policy="evict_first")                          # [R, G, 16] uint8
                z_e, z_o = tl.split(tl.reshape(b_z, (BLOCK_M, BLOCK_L // 2, 2)))
                if MODE == 1:
                    lo = tl.reshape((b_c.to(tl.int16) << 7).to(tl.bfloat16, bitcast=True), (R, BLOCK_L // 2))
                    hi = lo
                else:
                    b_sb = tl.broadcast_to(_e8m0_bf16(b_s)[:, :, None], (R, G, 16))
                    lo, hi = tl.inline_asm_elementwise(E2M1_BF16_BITS, "=r,=r,r,r", [b_c, b_sb],
                                                       dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=2)
                    lo = tl.reshape(lo, (R, BLOCK_L // 2))
                    hi = tl.reshape(hi, (R, BLOCK_L // 2))
                acc = tl.dot(lo, tl.trans(z_e), acc)
                acc = tl.dot(hi, tl.trans(z_o), acc)
        if MODE == 0:
            total = tl.sum(tl.sum(tl.sum(x_w, 2), 1), 0) + tl.sum(tl.sum(x_s, 1), 0)
            tl.store(p_sink + slot * tl.num_programs(1) + i_i, total.to(tl.float32) + tl.sum(tl.sum(x_z, 1), 0))
        else:
            dtype = p_z.dtype.element_ty
            acc_g, acc_u = tl.split(tl.permute(tl.reshape(acc, (2, BLOCK_I, BLOCK_M)), (1, 2, 0)))
            o_i = i_i * BLOCK_I + tl.arange(0, BLOCK_I)
            p_hi = p_h + pairs[None, :].to(tl.int64) * s_hp + o_i[:, None]
            gate = acc_g.to(dtype).to(tl.float32)
            up = acc_u.to(dtype).to(tl.float32)
            b_h = 4.0 * (2.0 * tl.sigmoid(gate / 2.0) - 1.0) * tl.sigmoid(gate) * (25.0 * (
                2.0 * tl.sigmoid(up / 12.5) - 1.0))      # SiTU-GLU with the K3 betas 4 and 25
            tl.store(p_hi, b_h.to(dtype), mask=m_j[None, :] & (o_i < I)[:, None])


def rows_ablation(z, experts, w1, w3, s1, s3, h, sink, *, mode, block_i, block_l, warps, stages):
    m = z.shape[0]
    grid = (m * A, triton.cdiv(I, block_i))
    _rows_ablation_kernel[grid](z, experts.reshape(-1), w1, w3, s1, s3, h, sink, m, A, I, L,
                                z.stride(0), w1.stride(0), w1.stride(1), w3.stride(0), w3.stride(1), s1.stride(0),
                                s1.stride(1), s3.stride(0), s3.stride(1), h.stride(0),
                                BLOCK_M=max(16, triton.next_power_of_2(m)), BLOCK_I=block_i, BLOCK_L=block_l,
                                BLOCK_A=A, MODE=mode, num_warps=warps, num_stages=stages)


# ---------------------------------------------------------------------------------------------------------------
# inputs, reference, timing

def make_weights(seed=0):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    center = 127 - round(math.log2(2.2 * L ** 0.5))

    def codes():
        return torch.randint(0, 256, (E, I, L // 2), generator=g, device=DEVICE, dtype=torch.uint8)

    def scales(rows, cols):
        return torch.randint(center - 2, center + 3, (E, rows, cols // 32), generator=g, device=DEVICE,
                             dtype=torch.uint8)

    w2 = torch.randint(0, 256, (E, L, I // 2), generator=g, device=DEVICE, dtype=torch.uint8)
    s2 = torch.randint(127 - round(math.log2(2.2 * I ** 0.5)) - 2, 127 - round(math.log2(2.2 * I ** 0.5)) + 3,
                       (E, L, I // 32), generator=g, device=DEVICE, dtype=torch.uint8)
    return codes(), codes(), w2, scales(I, L), scales(I, L), s2


def make_routing(m, layer):
    g = torch.Generator(device=DEVICE).manual_seed(1000 * m + layer)
    scores = torch.sigmoid(torch.randn(m, E, generator=g, device=DEVICE))
    _, experts = torch.topk(scores, A, dim=-1)
    weights = scores.gather(-1, experts)
    weights = weights / weights.sum(-1, keepdim=True)
    z = torch.randn(m, L, generator=g, device=DEVICE).to(torch.bfloat16)
    return z, experts, weights


def rel_err(out, ref):
    if out.isnan().any():
        return float("nan")
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


class StepTimeout(Exception):
    pass


def limited(seconds, fn):
    from _common import within

    return within(seconds, fn, lambda: StepTimeout(f"still running after {seconds} s"))


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--m", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--seconds", type=float, default=20.0, help="limit of each variant (compile + check + timing)")
    ap.add_argument("--replays", type=int, default=30)
    ap.add_argument("--budget", type=float, default=200.0, help="seconds after which no variant starts")
    ap.add_argument("--only", default="", help="run only the variants whose name contains this")
    args = ap.parse_args(argv)
    from _common import copy_ceiling_tbps, graph_replay_us

    t_start = time.time()
    print(torch.__version__, triton.__version__, torch.cuda.get_device_name(), flush=True)
    ceiling = copy_ceiling_tbps()
    print(f"copy ceiling {ceiling:.3f} TB/s", flush=True)
    w1, w3, w2, s1, s3, s2 = make_weights()
    rows_out = []

    for m in args.m:
        n_layers = 24 if m == 1 else 8         # > 400 MB of experts between two reads of the same layer
        layers = [make_routing(m, k) for k in range(n_layers)]
        distinct = sum(int(torch.unique(ex).numel()) for _, ex, _ in layers) / n_layers
        bytes_ = distinct * 2 * I * (L // 2 + L // 32) + m * L * 2 + m * A * I * 2
        floor_us = bytes_ / (ceiling * 1e12) * 1e6
        print(f"M {m}: {distinct:.1f} distinct experts, gate/up bytes {bytes_ / 1e6:.2f} MB, floor {floor_us:.2f} us",
              flush=True)
        rows_out.append(("copy (floor)", m, floor_us, 100.0, float("nan")))
        hs = [torch.empty(m * A, I, dtype=torch.bfloat16, device=DEVICE) for _ in layers]
        sink = torch.empty(m * A * 384, dtype=torch.float32, device=DEVICE)
        z0, ex0, wt0 = make_routing(m, 999)
        h_ref = gate_up_ref(z0, ex0, w1, w3, s1, s3, *BETAS)
        out_ref = moe_experts_ref(z0, ex0, wt0, w1, w3, w2, s1, s3, s2, *BETAS) if m <= 16 else None

        variants = {}   # name -> (fn(z, experts, weights, h) -> checked tensor or None, what it returns)
        if m <= GEMV_MAX_M:
            for r, w in ((1, 4), (2, 8), (4, 8), (8, 8)):
                variants[f"gemv-load-r{r}-w{w}"] = (lambda z, ex, wt, h, r=r, w=w: gate_up_gemv(
                    z, ex, w1, w3, s1, s3, *BETAS, rows=r, num_warps=w, mode=0, h=h, sink=sink), None)
            variants["gemv-conv-r2-w8"] = (lambda z, ex, wt, h: gate_up_gemv(
                z, ex, w1, w3, s1, s3, *BETAS, rows=2, num_warps=8, mode=1, h=h, sink=sink), None)
            for r, w in ((1, 4), (2, 4), (2, 8), (4, 8)):   # 164-244 registers, no spills (sm_90, Triton 3.7)
                variants[f"gemv-r{r}-w{w}"] = (lambda z, ex, wt, h, r=r, w=w: gate_up_gemv(
                    z, ex, w1, w3, s1, s3, *BETAS, rows=r, num_warps=w, h=h), "h")
        for bi, bl, w, s in ((32, 256, 4, 3), (32, 256, 4, 4), (16, 256, 2, 4), (32, 512, 4, 3), (64, 256, 8, 3),
                             ):
            for mode, tag in ((0, "load"), (1, "triv"), (2, "full")):
                variants[f"rows-{tag}-i{bi}-l{bl}-w{w}s{s}"] = (
                    lambda z, ex, wt, h, bi=bi, bl=bl, w=w, s=s, mode=mode: rows_ablation(
                        z, ex, w1, w3, s1, s3, h, sink, mode=mode, block_i=bi, block_l=bl, warps=w, stages=s),
                    "h" if mode == 2 else None)
        pick = tuned_config(table(torch.device(DEVICE)), m, torch.bfloat16, True, I, L) or \
            default_config(m, torch.bfloat16, True, True)
        configs = {"table": pick,
                   "rows-i32-l256-w4s3": MoeConfig(block_i=32, block_l=256, stages_up=3, block_n=128, mxfp4_asm=True,
                                                   weight_rows=True, trigger_early=True),
                   "rows-i16-l256-w2s4": MoeConfig(block_i=16, block_l=256, warps_up=2, stages_up=4, block_n=128,
                                                   mxfp4_asm=True, weight_rows=True, trigger_early=True)}
        ops = {}
        for name, config in configs.items():
            ops[f"op-gate_up[{name}]"] = (lambda z, ex, wt, h, c=config: moe_experts_triton(
                z, ex, wt, w1, w3, w2, s1, s3, s2, *BETAS, config=c, only="gate_up"), None)
            ops[f"op[{name}]"] = (lambda z, ex, wt, h, c=config: moe_experts_triton(
                z, ex, wt, w1, w3, w2, s1, s3, s2, *BETAS, config=c), "out")
        variants = {**ops, **variants}   # the production kernels first: the baseline whatever the budget leaves
        print(f"M {m}: table pick {pick.tag()}", flush=True)

        for name, (fn, checks) in variants.items():
            if args.only and args.only not in name:
                continue
            if time.time() - t_start > args.budget:
                print(f"  {name:34s} M{m:<3d} skipped (--budget {args.budget:.0f} s spent)", flush=True)
                continue
            t0 = time.time()
            try:
                def measure():
                    err = float("nan")
                    h = torch.full((m * A, I), float("nan"), dtype=torch.bfloat16, device=DEVICE)
                    got = fn(z0, ex0, wt0, h)
                    torch.cuda.synchronize()
                    if checks == "h":
                        err = rel_err(h, h_ref)
                    elif checks == "out":
                        err = rel_err(got, out_ref)

                    def run():
                        for k, (z, ex, wt) in enumerate(layers):
                            fn(z, ex, wt, hs[k])
                    us = graph_replay_us(run, iters=1, replays=args.replays, warmup=2) / n_layers
                    return us, err
                us, err = limited(args.seconds, measure)
                rows_out.append((name, m, us, 100 * floor_us / us, err))
                print(f"  {name:34s} M{m:<3d} {us:9.2f} us {100 * floor_us / us:6.1f}%  err {err:.2e}"
                      f"  ({time.time() - t0:.1f} s)", flush=True)
            except Exception as exc:   # noqa: BLE001 (every variant reports, none stops the run)
                print(f"  {name:34s} M{m:<3d} FAILED ({time.time() - t0:.1f} s): {type(exc).__name__}: "
                      f"{str(exc)[:300]}", flush=True)
                if not isinstance(exc, StepTimeout):
                    traceback.print_exc(limit=2)
                torch.cuda.synchronize()

    print(f"\nall rows ({time.time() - t_start:.0f} s)\n{'variant':36s} {'M':>3s} {'us':>9s} {'%floor':>7s} "
          f"{'rel err':>9s}")
    for name, m, us, pct, err in rows_out:
        print(f"{name:36s} {m:3d} {us:9.2f} {pct:7.1f} {err:9.2e}")


if __name__ == "__main__":
    main()
