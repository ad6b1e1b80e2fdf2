"""The absorbed MLA attention of a decode step, over the valid prefix of the latent cache only.

Matches (post-grad ATen; the model's ``mla_attend``, ``model/mla.py``, traced as the search itself; B batch,
T new tokens (static, at most ``MAX_DECODE_TOKENS``), H heads, S allocated positions, N, R, Vd, Lk)::

    w_k, w_v = w_kv_b[:, :N], w_kv_b[:, N:]                                    # [H, N, Lk], [H, Vd, Lk]
    q_lat    = einsum("bthn,hnl->bthl", q_nope, w_k)                           # [B, T, H, Lk]
    scores   = einsum("bthl,bsl->bhts", q_lat, c_kv) + einsum("bthr,bsr->bhts", q_pe, k_pe)   # [B, H, T, S]
    visible  = arange(S)[None, :] <= (pos + arange(T))[:, None]                # [T, S]
    visible  = (visible & (arange(S) >= first))[:, None]                       # left padding only: first = start
                                                                               # [B, 1, 1], or (T > 1) its minimum
                                                                               # with each query's position
    probs    = softmax(where(~visible, -inf, scores.float() * scale), -1).to(c_kv.dtype)
    out      = einsum("bthl,hvl->bthv", einsum("bhts,bsl->bthl", probs, c_kv), w_v)   # [B, T, H, Vd]

(each einsum a permute / reshape / bmm chain; the softmax amax, sub, exp, sum, div, or on a GPU Inductor's online
form, ``prims.prepare_softmax_online``, sub, exp, div: each form is traced), and rewrites it to::

    out = k3.mla_decode(q_nope, q_pe, c_kv, k_pe, w_kv_b, pos, scale, start or None, backend)

which reads each row's keys ``[start_b, pos + T)`` once instead of the whole allocation twice. The op's rule is the
model's T > 1 rule at every T (a query sees ``[min(start_b, pos + t), pos + t]``); at T = 1 the model uses start_b
alone, which is the same wherever the model's output is finite (start_b <= pos: the decode token is real).

The einsums' decomposition depends on the sizes: a reshape that cannot view becomes clone + reshape where T > 1,
differently for B = 1. So each dtype and form (with and without ``start``) is traced at three (B, T): (2, 1),
(2, 2) and (1, 2); and on a GPU, where Inductor turns a batch-1 ``bmm`` into ``mm``, batch 1 is traced in that form
too, at T = 1 and 2. Each size and dtype is traced only for a graph holding a decode step it stands for, computed
from values of that dtype (``groups``: a trace costs ~0.2 s; on torch 2.13 the fp32 plain-softmax trace of any one
size matched every size tried). The search ignores sizes and other literals; the guard re-checks what that leaves
open: the shapes the op accepts, a static T <= ``MAX_DECODE_TOKENS`` (a longer or symbolic-length prompt stays on
the plain path; a prompt this short is one more thing the op computes), w_kv_b split at N, the mask's fill -inf,
start ``[B]`` integer.

Not matched yet: a graph with a symbolic batch or cache length (Dynamo's recompile for a new batch size or
allocation under ``dynamic=None``). Inductor checks each match by re-tracing the search at the match's sizes, and at
symbolic sizes its ``arange(S)`` becomes ``iota`` of an expression over ``sym_size(c_kv, 1)`` where the graph has the
size as an input; ``expected()`` still counts the step, so the miss is logged.
"""
from __future__ import annotations

import functools
import math
from typing import Optional

import torch

from k3compile.patterns._common import (
    TRACE_DTYPES, Group, aten, is_static_le, match_val, matched_scalar_ok, online_softmax_pass, pm, register_groups,
    reusing_search_traces, statically_known_true, trace_dtypes_of, trace_fn, val, with_online_softmax,
)

NAME = "mla_decode"

# A decode step: one token, or a few when a speculative step verifies its drafts (model/mtp.py: k + 1 = 4).
MAX_DECODE_TOKENS = 8

SCALE_PLACEHOLDER = 0.1234567   # traced in place of the softmax scale, then made a keyword (must be unique)


# -- the search: the model's own function; the replacement ---------------------------------------------------
def _search(q_nope, q_pe, c_kv, k_pe, w_kv_b, pos, scale):
    from k3compile.model.mla import mla_attend

    return mla_attend(q_nope, q_pe, c_kv, k_pe, w_kv_b, pos, scale)


def _search_padded(q_nope, q_pe, c_kv, k_pe, w_kv_b, pos, start, scale):
    from k3compile.model.mla import mla_attend

    return mla_attend(q_nope, q_pe, c_kv, k_pe, w_kv_b, pos, scale, start)


def _replacement(backend: str):
    def replacement(q_nope, q_pe, c_kv, k_pe, w_kv_b, pos, scale):
        return torch.ops.k3.mla_decode.default(q_nope, q_pe, c_kv, k_pe, w_kv_b, pos, scale, None, backend)
    return replacement


def _replacement_padded(backend: str):
    def replacement(q_nope, q_pe, c_kv, k_pe, w_kv_b, pos, start, scale):
        return torch.ops.k3.mla_decode.default(q_nope, q_pe, c_kv, k_pe, w_kv_b, pos, scale, start, backend)
    return replacement


# -- example inputs and the guard ---------------------------------------------------------------------------
H_EX, N_EX, R_EX, VD_EX, LK_EX, S_EX = 3, 8, 4, 6, 10, 12   # distinct sizes: no two dims of a trace confused
TRACE_SHAPES = ((2, 1), (2, 2), (1, 2))                        # (B, T): see the module docstring
GPU_BATCH_ONE_SHAPES = ((1, 1), (1, 2))                        # batch 1 as a GPU graph has it (bmm_to_mm_pass)


def get_inputs(dtype: torch.dtype, B: int, T: int, padded: bool = False) -> list:
    """q_nope, q_pe as slices of one projection (as the model takes them), the cache, w_kv_b, pos (and start)."""
    q = torch.empty(B, T, H_EX, N_EX + R_EX, dtype=dtype)
    return [q[..., :N_EX], q[..., N_EX:], torch.empty(B, S_EX, LK_EX, dtype=dtype),
            torch.empty(B, S_EX, R_EX, dtype=dtype), torch.empty(H_EX, N_EX + VD_EX, LK_EX, dtype=dtype),
            torch.empty((), dtype=torch.int64)] + ([torch.empty(B, dtype=torch.int64)] if padded else [])


def _has_shape(t: torch.Tensor, shape: tuple) -> bool:
    return t.dim() == len(shape) and all(statically_known_true(a == b) for a, b in zip(t.shape, shape))


def _splits_w_kv_b_at_n(match: pm.Match, N) -> bool:
    """The search's two slices of w_kv_b (their bounds are wildcards in the search) are [0, N) and [N, end)."""
    w = match.kwargs["w_kv_b"]
    bounds = sorted((n.args[2], n.args[3]) for n in match.nodes
                    if n.target == aten.slice.Tensor and n.args[0] is w and n.args[1] == 1)
    if len(bounds) != 2:
        return False
    (a0, a1), (b0, b1) = bounds
    return (a0 == 0 and statically_known_true(a1 == N) and statically_known_true(b0 == N)
            and statically_known_true(b1 >= val(w).shape[1]))


def _can_mla_decode(match: pm.Match) -> bool:
    """Correctness only: the shapes k3::mla_decode accepts, a decode-step T, the mask and the split of w_kv_b."""
    names = ("q_nope", "q_pe", "c_kv", "k_pe", "w_kv_b", "pos")
    t = {n: match_val(match, n) for n in names}
    if not all(isinstance(x, torch.Tensor) for x in t.values()) or not matched_scalar_ok(match, "scale"):
        return False
    q_nope, c_kv, w_kv_b, pos = t["q_nope"], t["c_kv"], t["w_kv_b"], t["pos"]
    if q_nope.dim() != 4 or c_kv.dim() != 3 or w_kv_b.dim() != 3 or t["k_pe"].dim() != 3:
        return False
    B, T, H, N = q_nope.shape
    S, Lk = c_kv.shape[1:]
    R = t["k_pe"].shape[-1]
    if not (is_static_le(T, MAX_DECODE_TOKENS) and statically_known_true(w_kv_b.shape[1] > N)):
        return False
    want = {"q_pe": (B, T, H, R), "k_pe": (B, S, R), "w_kv_b": (H, w_kv_b.shape[1], Lk)}
    if not all(_has_shape(t[n], shape) for n, shape in want.items()):
        return False
    if pos.dim() != 0 or pos.dtype not in (torch.int64, torch.int32) or len({x.device for x in t.values()}) != 1:
        return False
    if any(t[n].dtype not in TRACE_DTYPES + (torch.float16,) for n in names[:5]):
        return False
    if "start" in match.kwargs:
        start = match_val(match, "start")
        if not (isinstance(start, torch.Tensor) and _has_shape(start, (B,)) and start.device == pos.device
                and start.dtype in (torch.int64, torch.int32)):
            return False
    fills = [n.args[1] for n in match.nodes if n.target == aten.full.default]
    return bool(fills) and all(f == -math.inf for f in fills) and _splits_w_kv_b_at_n(match, N)


def _trace(*args, gpu_joint: Optional[pm.PatternMatcherPass] = None, **kwargs) -> torch.fx.GraphModule:
    """``trace_fn``, then the passes Inductor ran on the model's graph before ours (ours and any user pass are not
    re-entered): they merge permutes, move clones and turn ``masked_fill``'s fill into ``full([], -inf)``, and the
    model's graph is matched as they left it. ``gpu_joint``: the joint-graph rewrites Inductor applies on a GPU only,
    run after its joint-graph passes as it does."""
    from torch._inductor import config as inductor_config
    from torch._inductor.fx_passes.joint_graph import joint_graph_passes
    from torch._inductor.fx_passes.post_grad import post_grad_passes

    gm = trace_fn(*args, **kwargs)
    with inductor_config.patch(joint_custom_pre_pass=None, joint_custom_post_pass=None,
                               post_grad_custom_pre_pass=None, post_grad_custom_post_pass=None):
        gm = joint_graph_passes(gm) or gm
        if gpu_joint is not None:
            gpu_joint.apply(gm.graph)
            gm.graph.eliminate_dead_code()
            gm.recompile()
        post_grad_passes(gm, is_inference=True)
    gm.graph.eliminate_dead_code()
    gm.recompile()
    return gm


def bmm_to_mm_pass() -> pm.PatternMatcherPass:
    """Inductor's joint-graph rewrite of a ``bmm`` whose batch is 1 into ``squeeze``, ``mm``, ``unsqueeze``
    (torch/_inductor/fx_passes/joint_graph.py ``bmm_to_mm``), without its device check: Inductor applies it to GPU
    graphs only, where it turns the batch-1 decode step's score and value products (batched over B) into ``mm``."""
    batch_one = pm.PatternMatcherPass()

    def batch_is_one(match: pm.Match) -> bool:
        return all(statically_known_true(val(match.kwargs[k]).shape[0] == 1) for k in ("a", "b"))

    pm.register_replacement(lambda a, b: torch.bmm(a, b),
                            lambda a, b: torch.mm(a.squeeze(0), b.squeeze(0)).unsqueeze(0),
                            [torch.empty(1, 2, 3), torch.empty(1, 3, 4)], pm.fwd_only, batch_one,
                            extra_check=batch_is_one)
    return batch_one


def _register_traces(pm_pass: pm.PatternMatcherPass, options, trace, shapes, dtypes=TRACE_DTYPES) -> None:
    forms = ((_search, _replacement(options.backend), False),
             (_search_padded, _replacement_padded(options.backend), True))
    trace = reusing_search_traces(trace, (_search, _search_padded))
    for dtype in dtypes:
        for B, T in shapes:
            for search, replacement, padded in forms:
                pm.register_replacement(
                    search, replacement, get_inputs(dtype, B, T, padded), trace, pm_pass,
                    extra_check=_can_mla_decode, skip_duplicates=True,
                    scalar_workaround={"scale": SCALE_PLACEHOLDER},
                )


def _decode_steps(graph: torch.fx.Graph) -> set:
    """(B, T, trace dtypes) of each decode step's masked scores in ``graph`` (B None where symbolic; the dtypes
    ``trace_dtypes_of`` the scores)."""
    out = set()
    for node in graph.find_nodes(op="call_function", target=aten.where.self):
        if _is_decode_mask(node):
            B, _, T, _ = val(node).shape
            out.add((B if isinstance(B, int) else None, int(T), trace_dtypes_of(node.args[2])))
    return out


def _traces_for(B: Optional[int], T: int, batch_one_form: bool) -> set:
    """The trace sizes (module doc) whose patterns a decode step of B x T tokens is spelt like: B > 1 as (2, 1) or
    (2, 2) by T, B 1 as (1, 2) (at T 1 also (2, 1)), and on a GPU B 1 in the batch-1 ``mm`` form as (1, T); a
    symbolic B as any."""
    if batch_one_form:
        return set(GPU_BATCH_ONE_SHAPES) if B is None else {(1, min(T, 2))} if B == 1 else set()
    if B is None:
        return set(TRACE_SHAPES)
    if B > 1:
        return {(2, 1) if T == 1 else (2, 2)}
    return {(2, 1), (1, 2)} if T == 1 else {(1, 2)}


def _wants(facts, shape: tuple, dtype: torch.dtype, batch_one_form: bool) -> bool:
    return any(shape in _traces_for(B, T, batch_one_form) and dtype in dtypes
               for B, T, dtypes in facts.derived(_decode_steps))


def groups(options) -> list[Group]:
    """The softmax as the model writes it (a CPU graph: ``amax`` ... ``div``), and Inductor's online form (a GPU
    graph: ``prims.prepare_softmax_online``), the latter also with batch-1 ``bmm``'s as ``mm``'s: a group a form,
    trace size and dtype, each only for a graph that calls its softmax's op and holds a decode step of its size
    computed in its dtype (:func:`_traces_for`, ``trace_dtypes_of``: a bf16 B 2 decode graph on a GPU traces 2 of
    the 40 searches)."""
    import k3compile.ops.mla_decode  # noqa: F401  (registers k3::mla_decode)

    def sized(name, trace, shapes, requires, batch_one_form=False):
        return [Group(f"{name}, B {b} T {t}, {str(dtype).removeprefix('torch.')}",
                      functools.partial(_register_traces, options=options, trace=trace, shapes=((b, t),),
                                        dtypes=(dtype,)),
                      requires=requires,
                      when=functools.partial(_wants, shape=(b, t), dtype=dtype, batch_one_form=batch_one_form))
                for b, t in shapes for dtype in TRACE_DTYPES]

    out = sized("plain softmax", _trace, TRACE_SHAPES, (aten.amax.default,))
    online = online_softmax_pass()
    if online is not None:
        op = getattr(torch.ops.prims, "prepare_softmax_online", None)
        requires = (op.default,) if op is not None else ()
        out += sized("online softmax", with_online_softmax(_trace), TRACE_SHAPES, requires)
        out += sized("online softmax, batch-1 mm",
                     with_online_softmax(functools.partial(_trace, gpu_joint=bmm_to_mm_pass())),
                     GPU_BATCH_ONE_SHAPES, requires, batch_one_form=True)
    return out


def register(pm_pass: pm.PatternMatcherPass, options) -> None:
    register_groups(pm_pass, groups(options))


def _is_decode_mask(node: torch.fx.Node) -> bool:
    """``where(mask, -inf, scores)`` over [B, H, T, S] fp32 scores with a static T <= MAX_DECODE_TOKENS."""
    fill, v = node.args[1], val(node)
    return (isinstance(fill, torch.fx.Node) and fill.target == aten.full.default and fill.args[1] == -math.inf
            and v is not None and v.dim() == 4 and v.dtype == torch.float32
            and is_static_le(v.shape[2], MAX_DECODE_TOKENS))


def facts(graph: torch.fx.Graph, options) -> dict:
    """Read before any rewrite: how many masked attention scores of a decode step (T <= MAX_DECODE_TOKENS) the
    graph holds (one per MLA layer of a decode graph; a prefill's T is larger)."""
    nodes = graph.find_nodes(op="call_function", target=aten.where.self)
    return {"graph_mla_decode_masks": sum(1 for n in nodes if _is_decode_mask(n))}


# What the pass manager's warning says where a graph had candidates and none was rewritten.
EXPECTED = "the model has MLA layers and the graph holds a decode step's masked attention scores"
MISSED = ("the MLA attention over the whole allocated latent cache, not k3::mla_decode's split-KV kernel over each "
          "sequence's valid keys")


def expected(model_summary: dict) -> bool:
    """A K3 / Kimi Linear model with MLA layers, on a graph with a decode step's masked scores."""
    return (bool(model_summary.get("is_k3")) and model_summary.get("mla_layers", 0) > 0
            and model_summary.get("graph_mla_decode_masks", 1) > 0)
