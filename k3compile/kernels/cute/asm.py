"""PTX the CuTe DSL does not spell, as DSL operations the skinny GEMM kernels call (``mma.py``, ``wgmma.py``).

A kernel module: it imports cutlass at its top and is loaded only when a kernel is built (``compile.py``).
"""
# no `from __future__ import annotations`: the DSL evaluates the operations' annotations
import cutlass
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op


@dsl_user_op
def mma_16816(a, b, c, is_fp16: bool, *, loc=None, ip=None):
    """One m16n8k16 MMA: a = 4 packed 32-bit A registers, b = 2 B registers, c = 4 fp32."""
    ty = "f16" if is_fp16 else "bf16"
    res = llvm.inline_asm(
        llvm.StructType.get_literal([T.f32()] * 4),
        [x.ir_value(loc=loc, ip=ip) for x in (*a, *b, *c)],
        f"mma.sync.aligned.m16n8k16.row.col.f32.{ty}.{ty}.f32 "
        "{$0,$1,$2,$3}, {$4,$5,$6,$7}, {$8,$9}, {$10,$11,$12,$13};",
        "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f",
        has_side_effects=False, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT,
        loc=loc, ip=ip,
    )
    return [cutlass.Float32(llvm.extractvalue(T.f32(), res, [i], loc=loc, ip=ip)) for i in range(4)]


@dsl_user_op
def dsmem_sum_f32(addr, ranks: int, *, loc=None, ip=None):
    """Sum over the cluster's blocks 0..ranks-1 of the fp32 at shared-memory address ``addr`` in each, added in rank
    order from 0.0: every remote load is issued before the first add, so they share one round trip."""
    regs = " ".join(f".reg .b32 ra{r}; .reg .f32 va{r};" for r in range(ranks))
    maps = " ".join(f"mapa.shared::cluster.u32 ra{r}, $1, {r};" for r in range(ranks))
    loads = " ".join(f"ld.shared::cluster.f32 va{r}, [ra{r}];" for r in range(ranks))
    adds = " ".join(f"add.rn.f32 $0, {'0f00000000' if r == 0 else '$0'}, va{r};" for r in range(ranks))
    res = llvm.inline_asm(
        T.f32(),
        [addr.ir_value(loc=loc, ip=ip)],
        "{ " + " ".join((regs, maps, loads, adds)) + " }",
        "=f,r",
        has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT,
        loc=loc, ip=ip,
    )
    return cutlass.Float32(res)


@dsl_user_op
def prefetch_bulk_l2(addr, nbytes, *, loc=None, ip=None):
    """``nbytes`` (a multiple of 16) of global memory from ``addr`` (16-byte aligned) into L2, one instruction (the
    TMA unit walks the range)."""
    llvm.inline_asm(
        None,
        [addr.ir_value(loc=loc, ip=ip), nbytes.ir_value(loc=loc, ip=ip)],
        "cp.async.bulk.prefetch.L2.global [$0], $1;",
        "l,r",
        has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT,
        loc=loc, ip=ip,
    )


@dsl_user_op
def st_async_v4_f32(addr, v0, v1, v2, v3, rank, bar, *, loc=None, ip=None):
    """Store 4 fp32 at the 16-byte aligned shared address ``addr`` of the cluster's block ``rank`` and count their 16
    bytes on that block's mbarrier ``bar`` (the same shared addresses as ours: the blocks share one layout)."""
    llvm.inline_asm(
        None, [addr.ir_value(loc=loc, ip=ip)] + [v.ir_value(loc=loc, ip=ip) for v in (v0, v1, v2, v3)]
        + [rank.ir_value(loc=loc, ip=ip), bar.ir_value(loc=loc, ip=ip)],
        "{ .reg .b32 ra, rb; mapa.shared::cluster.u32 ra, $0, $5; mapa.shared::cluster.u32 rb, $6, $5; "
        "st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.f32 [ra], {$1, $2, $3, $4}, [rb]; }",
        "r,f,f,f,f,r,r", has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT,
        loc=loc, ip=ip,
    )
