"""Skinny GEMM: small-M matrix products (+ bias, + residual) -> ``k3::skinny_gemm``.

Matches, in the post-grad graph (w: [N, K] as ``nn.Linear`` stores it, a: [M, K]):

    mm(a, permute(w, [1, 0]))                                   -> skinny_gemm(a, w)
    addmm(bias, a, permute(w, [1, 0]))     bias: [N] or [1, N]  -> skinny_gemm(a, w, bias)
    addmm(r, a, permute(w, [1, 0]))        r: [M, N]            -> skinny_gemm(a, w, None, r)
      (Inductor's own post-grad patterns fold ``mm + add`` into this form on CPU)
    add(mm | addmm(...), r)            r: [M, N]                -> skinny_gemm(a, w, bias?, r)
    add(reshape(mm | addmm(...), S), r)    r: S = [..., N]      -> reshape(skinny_gemm(a, w, bias?, r.reshape(M, N)), S)
    (and the add with its operands swapped)

Guard: M <= ``options.small_m_limit`` when M is static (decided at compile time); a symbolic M
matches unless it is provably above the limit, and the op dispatches at run time (skinny kernel up
to the limit, ``torch.addmm`` above). No broadcasting bias or residual, one dtype throughout,
fp16 / bf16 / fp32 only.

Not seen: products Inductor decomposes into pointwise ops before any post-grad pass -- K = 1; on
CPU M = N = 1. On a GPU with coordinate-descent tuning (``mode="max-autotune*"``), Inductor's ``aten.mm``
decomposition (torch/_inductor/decomposition.py) turns an M = 1 (or N = 1) product into
``(a.unsqueeze(2) * w.T.unsqueeze(0)).sum(1)`` while AOTAutograd traces, long before this pass; so
``decompositions`` below hands ``optimize`` a per-compile override of that one entry which leaves the
products this pass will rewrite as ``mm`` (Inductor's global table and config stay untouched), and the
search functions are traced with ``mm`` kept whole (``trace_literal_mm``: the matcher re-traces them
per match under the same config).

Order: last in ``PASS_ORDER``, so the latent-MoE tail and KDA passes claim their GEMMs first (and the upcast
pass its ``linear(x.float(), w.float())``). Within
this pass, the pattern matcher visits nodes from the graph's end, so an ``add`` with its residual is
seen before the ``mm`` it consumes: the fused forms win over the bare ``mm``.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

import k3compile.ops.skinny_gemm  # noqa: F401  (registers k3::skinny_gemm)
from k3compile.patterns._common import (
    TRACE_DTYPES, aten, guard_or_false, pm, reusing_search_traces, statically_known_true, trace_fn, val,
)

NAME = "skinny_gemm"
# ops every pattern calls (the weight's transpose): a graph without one is not traced for (patterns/_common.py Group)
REQUIRES = (aten.permute.default,)
KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

# example sizes: all distinct, so no two dimensions are confused while tracing
_M, _K, _N, _B = 6, 8, 10, 2


# --- search functions (traced into patterns) --------------------------------------------------

def _mm(a, w):
    return aten.mm(a, aten.permute(w, [1, 0]))


def _addmm(bias, a, w):
    return aten.addmm(bias, a, aten.permute(w, [1, 0]))


def _mm_res(a, w, r):
    return _mm(a, w) + r


def _res_mm(a, w, r):
    return r + _mm(a, w)


def _addmm_res(bias, a, w, r):
    return _addmm(bias, a, w) + r


def _res_addmm(bias, a, w, r):
    return r + _addmm(bias, a, w)


def _mm_nd_res(a, w, r):
    return _mm(a, w).reshape(r.shape) + r


def _res_mm_nd(a, w, r):
    return r + _mm(a, w).reshape(r.shape)


def _addmm_nd_res(bias, a, w, r):
    return _addmm(bias, a, w).reshape(r.shape) + r


def _res_addmm_nd(bias, a, w, r):
    return r + _addmm(bias, a, w).reshape(r.shape)


# --- replacements (closures over the options baked into the graph) ------------------------------

def _replacements(backend: str, m_limit: int) -> dict:
    op = torch.ops.k3.skinny_gemm.default

    def mm(a, w):
        return op(a, w, None, None, backend, m_limit)

    def addmm(bias, a, w):
        if bias.dim() == 2 and not statically_known_true(bias.shape[0] == 1):
            return op(a, w, None, bias, backend, m_limit)   # a full [M, N] "bias" is a residual
        return op(a, w, bias.reshape(w.shape[0]), None, backend, m_limit)

    def mm_res(a, w, r):
        return op(a, w, None, r, backend, m_limit)

    def addmm_res(bias, a, w, r):
        return op(a, w, bias.reshape(w.shape[0]), r, backend, m_limit)

    def mm_nd_res(a, w, r):
        return op(a, w, None, r.reshape(a.shape[0], w.shape[0]), backend, m_limit).reshape(r.shape)

    def addmm_nd_res(bias, a, w, r):
        r2 = r.reshape(a.shape[0], w.shape[0])
        return op(a, w, bias.reshape(w.shape[0]), r2, backend, m_limit).reshape(r.shape)

    return dict(mm=mm, addmm=addmm, mm_res=mm_res, addmm_res=addmm_res,
                mm_nd_res=mm_nd_res, addmm_nd_res=addmm_nd_res)


def get_inputs(dtype: torch.dtype, kind: str) -> list[torch.Tensor]:
    """Example inputs for tracing: (bias?, a, w, r?) with r 2-D or 3-D."""
    a = torch.empty(_M, _K, dtype=dtype)
    w = torch.empty(_N, _K, dtype=dtype)
    bias = torch.empty(_N, dtype=dtype)
    r2 = torch.empty(_M, _N, dtype=dtype)
    r3 = torch.empty(_B, _M // _B, _N, dtype=dtype)
    return {
        "mm": [a, w], "addmm": [bias, a, w], "mm_res": [a, w, r2], "addmm_res": [bias, a, w, r2],
        "mm_nd_res": [a, w, r3], "addmm_nd_res": [bias, a, w, r3],
    }[kind]


# (search, replacement kind) -- residual forms first only for readability; the matcher's node
# order is what makes them win (see the module doc).
_PATTERNS = (
    (_mm_res, "mm_res"), (_res_mm, "mm_res"),
    (_addmm_res, "addmm_res"), (_res_addmm, "addmm_res"),
    (_mm_nd_res, "mm_nd_res"), (_res_mm_nd, "mm_nd_res"),
    (_addmm_nd_res, "addmm_nd_res"), (_res_addmm_nd, "addmm_nd_res"),
    (_mm, "mm"), (_addmm, "addmm"),
)


# --- guard ------------------------------------------------------------------------------------

def small_m(m, limit: int) -> bool:
    """A static M decides now; a symbolic M matches unless provably above the limit (run-time dispatch)."""
    if isinstance(m, int):
        return m <= limit
    return not statically_known_true(m > limit)


def _same_shape(x, shape) -> bool:
    return len(x) == len(shape) and all(guard_or_false(p == q) for p, q in zip(x, shape))


def _bias_fits(shape, m, n, alone: bool) -> bool:
    """addmm broadcasts its first operand; the op takes a [N] bias (also given as [1, N]) or, when no
    other residual is fused, a full [M, N] one as the residual. Anything else ([M, 1], scalar) is refused."""
    if _same_shape(shape, (n,)) or _same_shape(shape, (1, n)):
        return True
    return alone and _same_shape(shape, (m, n))


def _can_skinny_gemm(match: pm.Match, limit: int) -> bool:
    a, w = val(match.kwargs["a"]), val(match.kwargs["w"])
    bias, r = val(match.kwargs.get("bias")), val(match.kwargs.get("r"))
    if a is None or w is None or a.dim() != 2 or w.dim() != 2:
        return False
    if a.dtype not in KERNEL_DTYPES or any(t is not None and t.dtype != a.dtype for t in (w, bias, r)):
        return False
    m, n = a.shape[0], w.shape[0]
    if bias is not None and not _bias_fits(bias.shape, m, n, alone=r is None):
        return False
    if r is not None:
        out = val(match.output_node())
        if out is None or out.dtype != a.dtype or not _same_shape(r.shape, out.shape):
            return False  # broadcasting or type-promoting residual add
        if r.dim() != 2 and not guard_or_false(r.numel() == m * n):
            return False
    return small_m(m, limit)


# --- registration -----------------------------------------------------------------------------

def trace_literal_mm(fn, args, **kwargs) -> torch.fx.GraphModule:
    """``trace_fn`` with ``aten.mm`` left undecomposed. The matcher re-traces a search function on each
    match's own fake values (device, shapes) under the compile's config; under max-autotune Inductor's
    table would turn an M = 1 ``mm`` on a GPU into mul + sum there, and the match would be refused."""
    from torch._inductor.decomposition import select_decomp_table

    base = kwargs.pop("get_decomp_fn", None) or select_decomp_table
    kwargs["get_decomp_fn"] = lambda: {op: fn_ for op, fn_ in base().items() if op is not aten.mm.default}
    return trace_fn(fn, args, **kwargs)


def register(pm_pass: pm.PatternMatcherPass, options) -> None:
    replacements = _replacements(options.backend, options.small_m_limit)
    check = functools.partial(_can_skinny_gemm, limit=options.small_m_limit)
    trace = reusing_search_traces(trace_literal_mm, [search for search, _ in _PATTERNS])
    for dtype in TRACE_DTYPES:
        for search, kind in _PATTERNS:
            pm.register_replacement(
                search, replacements[kind], get_inputs(dtype, kind), trace, pm_pass,
                extra_check=check, skip_duplicates=True,
            )


# What the pass manager's warning says where a graph had candidates and none was rewritten.
EXPECTED = "the graph holds linear-layer products of at most {small_m_limit} rows"
MISSED = "those products on Inductor's GEMM (cuBLAS on a GPU), not k3::skinny_gemm's weight-streaming kernels"


def expected(summary: dict) -> bool:
    """Any model's graph with a small-M (or symbolic-M) product of a linear layer's weight should produce a match,
    counting none of those the upcast pass claims first (``graph_upcast_gemms``: patterns/upcast_matmul.py, a
    subset of these; the key is there only where that pass is enabled)."""
    return summary.get("graph_small_m_gemms", 0) > summary.get("graph_upcast_gemms", 0)


def facts(graph: torch.fx.Graph, options) -> dict:
    """Read before any rewrite: how many mm / addmm nodes of a transposed 2-D weight (``linear``) have a small
    or symbolic M."""
    limit = options.small_m_limit
    n = 0
    for node in graph.find_nodes(op="call_function", target=aten.mm.default):
        n += _candidate(node.args[0], node.args[1], limit)
    for node in graph.find_nodes(op="call_function", target=aten.addmm.default):
        n += _candidate(node.args[1], node.args[2], limit)
    return {"graph_small_m_gemms": n}


def transposed_weight(b_node) -> bool:
    """``b_node`` is ``permute(w, [1, 0])``: the [K, N] operand ``linear`` makes of an [N, K] weight."""
    return (isinstance(b_node, torch.fx.Node) and b_node.target == aten.permute.default
            and list(b_node.args[1]) == [1, 0])


def _candidate(a_node, b_node, limit: int) -> bool:
    a = val(a_node)
    return (transposed_weight(b_node) and a is not None and a.dim() == 2 and a.dtype in KERNEL_DTYPES
            and small_m(a.shape[0], limit))


# --- max-autotune: keep what this pass rewrites out of Inductor's mm -> mul + sum decomposition ----

def _claimable_mm(a, b, limit: int) -> bool:
    """``mm(a, b)`` of the kind the patterns above rewrite: 2-D, a kernel dtype, small M, and ``b`` the
    transpose of an [N, K] weight (stride 1 along K) as ``linear`` makes it; on a GPU (where the
    coordinate-descent decomposition applies), K != 1 (that one becomes an outer product, never ours)."""
    return (a.dim() == 2 and b.dim() == 2 and a.device.type not in ("cpu", "mps")
            and a.dtype in KERNEL_DTYPES and b.dtype == a.dtype
            and statically_known_true(b.stride(0) == 1) and not statically_known_true(a.shape[1] == 1)
            and small_m(a.shape[0], limit))


@dataclass(frozen=True)
class KeepSkinnyMM:
    """Inductor's decomposition of ``op`` (aten.mm), except for the products this pass rewrites,
    which stay ``mm``. A module-level dataclass: Inductor may pickle the decomposition table."""
    op: torch._ops.OpOverload
    limit: int

    def __call__(self, a, b, *args, **kwargs):
        if torch._inductor.config.coordinate_descent_tuning and _claimable_mm(a, b, self.limit):
            return NotImplemented  # no decomposition: the op stays, the pattern above sees it
        from torch._inductor.decomposition import decompositions

        return decompositions[self.op](a, b, *args, **kwargs)


def decompositions(options) -> dict:
    """Per-compile overrides of Inductor's decomposition table (read under the compile's config).

    Only under coordinate-descent tuning (``mode="max-autotune*"``), the one setting under which
    Inductor decomposes a small-M ``mm`` into pointwise ops; otherwise nothing is overridden."""
    if not torch._inductor.config.coordinate_descent_tuning:
        return {}
    return {aten.mm.default: KeepSkinnyMM(aten.mm.default, options.small_m_limit)}


__all__ = ["NAME", "EXPECTED", "MISSED", "register", "expected", "facts", "get_inputs", "small_m",
           "decompositions", "trace_literal_mm", "transposed_weight"]
