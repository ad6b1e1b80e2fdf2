"""Upcast matmul: a small-M product of a 16-bit weight upcast to fp32 -> ``k3::skinny_gemm`` on the 16-bit weight
with a fp32 output.

Matches, in the post-grad graph (a16: [M, K] and w16: [N, K] bf16 / fp16, w16 a graph input -- a parameter --,
bias16: [N]), what ``F.linear(x.float(), w.float()[, b.float()])`` traces to (K3's router, model/moe.py ``route``,
on a 16-bit model; its x is the 16-bit hidden state, so the fp32-activation form ``linear(x32, w.float())`` does
not occur there and is left to the skinny-GEMM pass):

    mm(convert(a16, f32), permute(convert(w16, f32), [1, 0]))                        -> skinny_gemm(a16, w16,
    addmm(convert(bias16, f32), convert(a16, f32), permute(convert(w16, f32), [1, 0]))   bias16?, out_dtype=f32)

Rewrites to ``k3::skinny_gemm(a16, w16, bias16, out_dtype=torch.float32)`` [M, N] fp32: the same exact products
(a 16-bit product is exact in fp32), summed in fp32, never rounded to 16 bits, so every use of the output --
one that rounds it to 16 bits too -- sees what it saw. The per-call cast kernel that wrote the weight in fp32
(2x its bytes, then read back by the product) is gone, and with the parameter as ``w`` the static-weight proof
(k3compile/static_weights.py) holds for the product.

Guard: a16, w16 (and bias16) one 16-bit dtype; w16 a placeholder or ``get_attr`` (a computed [N, K] operand is no
weight and its cast no per-step waste of one); bias [N]; M <= ``options.small_m_limit`` when static, a symbolic M
unless provably above it (the op sends larger M to the upcast product at run time). An fp32 model holds no casts:
its products are plain ``mm`` for the skinny-GEMM pass, and this pass is not expected there.

Order: before ``skinny_gemm``, which would otherwise claim the fp32 ``mm`` with the cast left in place.
"""
from __future__ import annotations

import functools
import inspect
from typing import Optional

import torch

import k3compile.ops.skinny_gemm  # noqa: F401  (registers k3::skinny_gemm)
from k3compile.patterns._common import LOW_PRECISION, aten, guard_or_false, pm, val
from k3compile.patterns.skinny_gemm import decompositions, small_m, trace_literal_mm, transposed_weight

NAME = "upcast_matmul"
# ops every pattern calls (the upcast): a graph without one is not traced for (patterns/_common.py Group)
REQUIRES = (torch.ops.prims.convert_element_type.default,)
HALF_DTYPES = (torch.bfloat16, torch.float16)
_CONVERT = torch.ops.prims.convert_element_type.default

# example sizes: all distinct, so no two dimensions are confused while tracing
_M, _K, _N = 6, 8, 10


# --- search functions (traced into patterns) --------------------------------------------------

def _mm_upcast(a, w):
    return aten.mm(a.float(), aten.permute(w.float(), [1, 0]))


def _addmm_upcast(bias, a, w):
    return aten.addmm(bias.float(), a.float(), aten.permute(w.float(), [1, 0]))


# --- replacements (closures over the options baked into the graph) ------------------------------

def _replacements(backend: str, m_limit: int) -> dict:
    op = torch.ops.k3.skinny_gemm.default

    def mm(a, w):
        return op(a, w, None, None, backend, m_limit, out_dtype=torch.float32)

    def addmm(bias, a, w):
        return op(a, w, bias, None, backend, m_limit, out_dtype=torch.float32)

    return dict(mm=mm, addmm=addmm)


def get_inputs(dtype: torch.dtype, kind: str) -> list[torch.Tensor]:
    """Example inputs for tracing, all 16-bit: (bias?, a, w)."""
    a = torch.empty(_M, _K, dtype=dtype)
    w = torch.empty(_N, _K, dtype=dtype)
    return {"mm": [a, w], "addmm": [torch.empty(_N, dtype=dtype), a, w]}[kind]


_PATTERNS = ((_mm_upcast, "mm"), (_addmm_upcast, "addmm"))


# --- guard ------------------------------------------------------------------------------------

def _graph_input(node) -> bool:
    """A placeholder (a parameter lifted into the graph) or a ``get_attr`` (a frozen one)."""
    return isinstance(node, torch.fx.Node) and node.op in ("placeholder", "get_attr")


def _can_upcast_matmul(match: pm.Match, limit: int) -> bool:
    a, w, bias = val(match.kwargs["a"]), val(match.kwargs["w"]), val(match.kwargs.get("bias"))
    if a is None or w is None or a.dim() != 2 or w.dim() != 2:
        return False
    if a.dtype not in HALF_DTYPES or any(t is not None and t.dtype != a.dtype for t in (w, bias)):
        return False   # an fp32 (or fp64) source: no upcast of a 16-bit weight
    if not _graph_input(match.kwargs["w"]):
        return False
    if bias is not None and not (bias.dim() == 1 and guard_or_false(bias.shape[0] == w.shape[0])):
        return False   # addmm broadcasts its first operand; the op takes a [N] bias only
    return small_m(a.shape[0], limit)


# --- registration -----------------------------------------------------------------------------

def _search_pattern(search, inputs) -> pm.PatternExpr:
    """The traced search as a pattern whose ``a.float()`` may have other users: one ``x.float()`` often feeds several
    products (and, as a literal, the upcast's dtype and the permutation match exactly). The matcher's default
    pattern wants each inner node used only inside the match, and it re-traces the search per match unless handed
    the pattern, as here (it does not depend on the sizes)."""
    gm = trace_literal_mm(search, inputs)
    pattern = pm.fx_to_pattern(gm, argnames=list(inspect.signature(search).parameters))
    stack = [pattern]
    while stack:
        p = stack.pop()
        if isinstance(p, pm.CallFunction):
            if _CONVERT in p.fns and isinstance(p.args[0], pm.KeywordArg) and p.args[0].name == "a":
                p.users = pm.MULTIPLE
            stack.extend(p.args)
    return pattern


def register(pm_pass: pm.PatternMatcherPass, options) -> None:
    """One 16-bit trace only: in an fp32 trace the casts vanish and the search would be the skinny-GEMM pass's
    plain ``mm``. bf16 and fp16 trace alike (the source dtype is not in the pattern; the guard reads it)."""
    replacements = _replacements(options.backend, options.small_m_limit)
    check = functools.partial(_can_upcast_matmul, limit=options.small_m_limit)
    for search, kind in _PATTERNS:
        inputs = get_inputs(LOW_PRECISION, kind)
        pm.register_replacement(
            search, replacements[kind], inputs, trace_literal_mm, pm_pass, extra_check=check,
            search_fn_pattern=_search_pattern(search, inputs), skip_duplicates=True,
        )


# What the pass manager's warning says where a graph had candidates and none was rewritten.
EXPECTED = ("the graph holds products of a 16-bit weight upcast to fp32 (linear(x.float(), w.float()), e.g. the MoE "
            "router) of at most {small_m_limit} rows")
MISSED = ("a cast kernel writing each such weight in fp32 on every call, then an fp32 GEMM reading it back, "
          "with no static-weight proof")


def expected(summary: dict) -> bool:
    """A graph with a small-M (or symbolic-M) product of an upcast 16-bit graph-input weight should produce a match;
    an fp32 model's graph holds none."""
    return summary.get("graph_upcast_gemms", 0) > 0


def _upcast_source(node) -> Optional[torch.fx.Node]:
    """The 16-bit node ``node`` upcasts to fp32 (``convert_element_type(src, float32)``), else None."""
    if not (isinstance(node, torch.fx.Node) and node.target == _CONVERT and node.args[1] == torch.float32):
        return None
    src = val(node.args[0])
    return node.args[0] if src is not None and src.dtype in HALF_DTYPES else None


def _candidate(a_node, b_node, limit: int) -> bool:
    a16 = _upcast_source(a_node)
    w16 = _upcast_source(b_node.args[0]) if transposed_weight(b_node) else None
    a = val(a16)
    return (a is not None and _graph_input(w16) and a.dim() == 2 and val(w16).dtype == a.dtype
            and small_m(a.shape[0], limit))


def facts(graph: torch.fx.Graph, options) -> dict:
    """Read before any rewrite: how many mm / addmm nodes multiply an upcast 16-bit activation by the transpose of
    an upcast 16-bit graph input with a small or symbolic M (a subset of skinny_gemm's ``graph_small_m_gemms``)."""
    limit = options.small_m_limit
    n = 0
    for node in graph.find_nodes(op="call_function", target=aten.mm.default):
        n += _candidate(node.args[0], node.args[1], limit)
    for node in graph.find_nodes(op="call_function", target=aten.addmm.default):
        n += _upcast_source(node.args[0]) is not None and _candidate(node.args[1], node.args[2], limit)
    return {"graph_upcast_gemms": n}


__all__ = ["NAME", "EXPECTED", "MISSED", "register", "expected", "facts", "get_inputs", "decompositions"]
