"""The routed experts of a (latent) MoE layer -> ``k3::moe_experts``.

Matches (post-grad ATen; M tokens, A experts per token, E experts, L latent, I intermediate) the two forms
``model/moe.py`` writes, from the top-k ids and fp32 weights and the latent input to the fp32 combine::

    gathered (few tokens):                               dense (many tokens):
      gate = bmm(w1[experts], z)     [M·A, I, 1]           combine = scatter(zeros[M, E], 1, experts, weights)
      up   = bmm(w3[experts], z)                           gate = einsum("ml,eil->emi", z, w1)   [E, M, I]
      h    = situ_glu(gate, up)      (fp32, rounded)       up   = einsum("ml,eil->emi", z, w3)
      y    = bmm(w2[experts], h)     [M·A, L, 1]           h    = situ_glu(gate, up)
      out  = Σ_a y·weights[..., a]   (fp32)                y    = einsum("emi,eli->eml", h, w2)    [E, M, L]
      out  = out.to(z.dtype)                               out  = Σ_e y·combine[:, e]               (fp32)

    situ_glu(g, u) = (beta·tanh(g/beta)·σ(g) · linear_beta·tanh(u/linear_beta)).to(dtype), in fp32

Rewrites to::

    out = k3::moe_experts(z, experts, weights, w1, w3, w2, None, None, None, beta, linear_beta, backend,
                          small_m_limit)                          # [M, L] in z's dtype

and, where Inductor dropped the model's final cast (torch < 2.12's ``pointless_convert`` folds
``bf16(out).float()`` when the latent norm reads it), ``k3::moe_experts(...).float()``: the model's rounding.

How it matches: each form is the model's own code (a copy below: a model that computes something else must not
match), traced as Inductor's inference graph looks when our pass sees it -- ``make_fx`` with Inductor's
decompositions, then Inductor's joint-graph passes (they fold permute pairs and, on a GPU, turn a batch-1
``bmm`` into ``mm``), ``view_to_reshape`` (:func:`_trace_as_inductor`). Those spellings depend on the device
and on ``coordinate_descent_tuning`` (``mode="max-autotune"`` decomposes a ``bmm`` with one column into mul +
sum), so each form is registered per device kind (CPU, and CUDA where a GPU exists) and tuning setting, in
fp32 and bf16 (fp16 traces like bf16), with and without the final cast. Sizes are ignored by the first match;
``register_replacement`` then re-traces the search at the match's own shapes, dtypes and device with the same
function and requires the graph to be exactly that trace (every op, size, permutation and user count), so a
near miss is never rewritten. The guard checks the op's contract.

Packed MXFP4 experts (``model/moe.py`` ``experts_gathered_mxfp4`` / ``experts_dense_mxfp4``: codes and E8M0
scales dequantised by ``model/mxfp4.py``'s integer ops, copied here) rewrite to the op's MXFP4 form,
``k3::moe_experts(z, experts, weights, w1_packed, w3_packed, w2_packed, w1_scale, w3_scale, w2_scale, ...)``.
The dense MXFP4 form only where it dequantises every expert in one chunk (``model.moe.dense_chunk_experts``: the
tiny K3; K3's rank holds 14 chunks at TP=8): several chunks make a graph whose size follows E, which no traced
pattern spells; ``facts`` lists them as rejected, not as candidates.

Not matched: another activation (SiLU: Kimi Linear), a combine without the router weights, weights of another
dtype than z. Routing (sigmoid, top-k, renormalisation, scaling) stays outside: the op takes the ids and weights
as the graph computed them.
"""
from __future__ import annotations

import functools

import torch

from k3compile.patterns._common import (LOW_PRECISION, Group, aten, match_val, matched_scalar_ok, pm,
                                        register_groups, reusing_search_traces, statically_known_true, val)

NAME = "moe_experts"

# traced in place of the activation constants and turned back into keywords (unique values)
BETA_PLACEHOLDER = 3.1415
LINEAR_BETA_PLACEHOLDER = 27.1828
SCALARS = {"beta": BETA_PLACEHOLDER, "linear_beta": LINEAR_BETA_PLACEHOLDER}

KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# example sizes, all distinct and > 1, with M·A > E (the dense form's own condition; the trace does not care);
# the gathered form is traced at M = 1 too: there z's broadcast over the slots is a view, elsewhere a copy
M_EX, A_EX, E_EX, I_EX, L_EX = 5, 3, 4, 24, 40


# --- the model's math (model/moe.py, model/layers.py), copied: the pattern is what it computes -------------

def _situ_glu(gate, up, beta, linear_beta):
    g, u = gate.float(), up.float()
    act = beta * torch.tanh(g / beta) * torch.sigmoid(g)
    u = linear_beta * torch.tanh(u / linear_beta)
    return (act * u).to(gate.dtype)


def _gathered_fp32(z, experts, weights, w1, w3, w2, beta, linear_beta):
    # ``z[:, None, :, None]`` and ``w[experts]`` spelled as the ATen ops they trace to (unsqueeze, index): fake CUDA
    # tensors on a machine without CUDA (tests) take these, not Python indexing
    zc = z.unsqueeze(1).unsqueeze(3)                                       # [M, 1, L, 1]
    gate = (aten.index.Tensor(w1, [experts]) @ zc).squeeze(-1)             # [M, A, I]
    up = (aten.index.Tensor(w3, [experts]) @ zc).squeeze(-1)
    h = _situ_glu(gate, up, beta, linear_beta)
    y = (aten.index.Tensor(w2, [experts]) @ h.unsqueeze(3)).squeeze(-1)    # [M, A, L]
    return (y.float() * weights.unsqueeze(2)).sum(1)


def _gathered(z, experts, weights, w1, w3, w2, beta, linear_beta):
    return _gathered_fp32(z, experts, weights, w1, w3, w2, beta, linear_beta).to(z.dtype)


def _dense_fp32(z, experts, weights, w1, w3, w2, beta, linear_beta):
    combine = torch.zeros(z.shape[0], w1.shape[0], dtype=torch.float32, device=z.device)
    combine = combine.scatter(1, experts, weights)                         # [M, E]
    gate = torch.einsum("ml,eil->emi", z, w1)                              # [E, M, I]
    up = torch.einsum("ml,eil->emi", z, w3)
    h = _situ_glu(gate, up, beta, linear_beta)
    y = torch.einsum("emi,eli->eml", h, w2)                                # [E, M, L]
    return (y.float() * combine.t().unsqueeze(2)).sum(0)


def _dense(z, experts, weights, w1, w3, w2, beta, linear_beta):
    return _dense_fp32(z, experts, weights, w1, w3, w2, beta, linear_beta).to(z.dtype)


# MXFP4 (model/mxfp4.py): E2M1 codes from integer ops, the E8M0 scale as two normal powers of two

def _e2m1_to_float(code):
    c = code.to(torch.int32)
    k = c & 7
    shift = ((k >> 1) & 1) + 1
    twice = torch.where(k < 4, k, ((k & 1) | 2) << shift)
    half = torch.where(c > 7, -0.5, 0.5)
    return twice.to(torch.float32) * half


def _e8m0_halves(scale):
    s = scale.to(torch.int32)
    lo = s >> 1
    hi = s - lo
    return ((lo + 64) << 23).view(torch.float32), ((hi + 63) << 23).view(torch.float32)


def _dequantize_mxfp4(packed, scale, dtype):
    codes = torch.stack([packed & 0xF, packed >> 4], dim=-1)                 # [..., R, C/2, 2]
    values = _e2m1_to_float(codes).reshape(*scale.shape, 32)                 # [..., R, C/32, 32]
    lo, hi = _e8m0_halves(scale)
    values = values * lo.unsqueeze(lo.dim()) * hi.unsqueeze(hi.dim())      # lo[..., None]: the ATen op it traces to
    return values.reshape(*packed.shape[:-1], 2 * packed.shape[-1]).to(dtype)


def _gathered_mxfp4_fp32(z, experts, weights, w1_packed, w1_scale, w3_packed, w3_scale, w2_packed, w2_scale, beta,
                         linear_beta):
    def selected(packed, scale):
        return _dequantize_mxfp4(aten.index.Tensor(packed, [experts]), aten.index.Tensor(scale, [experts]), z.dtype)

    zc = z.unsqueeze(1).unsqueeze(3)                                       # [M, 1, L, 1]
    gate = (selected(w1_packed, w1_scale) @ zc).squeeze(-1)                # [M, A, I]
    up = (selected(w3_packed, w3_scale) @ zc).squeeze(-1)
    h = _situ_glu(gate, up, beta, linear_beta)
    y = (selected(w2_packed, w2_scale) @ h.unsqueeze(3)).squeeze(-1)       # [M, A, L]
    return (y.float() * weights.unsqueeze(2)).sum(1)


def _gathered_mxfp4(z, experts, weights, w1_packed, w1_scale, w3_packed, w3_scale, w2_packed, w2_scale, beta,
                    linear_beta):
    return _gathered_mxfp4_fp32(z, experts, weights, w1_packed, w1_scale, w3_packed, w3_scale, w2_packed, w2_scale,
                                beta, linear_beta).to(z.dtype)


def _dense_mxfp4_fp32(z, experts, weights, w1_packed, w1_scale, w3_packed, w3_scale, w2_packed, w2_scale, beta,
                      linear_beta):
    # the model's experts_dense_mxfp4 with every expert in one chunk (its chunks' full slice traces to nothing)
    return _dense_fp32(z, experts, weights, _dequantize_mxfp4(w1_packed, w1_scale, z.dtype),
                       _dequantize_mxfp4(w3_packed, w3_scale, z.dtype), _dequantize_mxfp4(w2_packed, w2_scale, z.dtype),
                       beta, linear_beta)


def _dense_mxfp4(z, experts, weights, w1_packed, w1_scale, w3_packed, w3_scale, w2_packed, w2_scale, beta,
                 linear_beta):
    return _dense_mxfp4_fp32(z, experts, weights, w1_packed, w1_scale, w3_packed, w3_scale, w2_packed, w2_scale,
                             beta, linear_beta).to(z.dtype)


def _replacement(backend: str, limit: int, keep_fp32: bool):
    def replacement(z, experts, weights, w1, w3, w2, beta, linear_beta):
        out = torch.ops.k3.moe_experts(z, experts, weights, w1, w3, w2, None, None, None, beta, linear_beta,
                                       backend, limit)
        return out.float() if keep_fp32 else out
    return replacement


def _replacement_mxfp4(backend: str, limit: int, keep_fp32: bool):
    def replacement(z, experts, weights, w1_packed, w1_scale, w3_packed, w3_scale, w2_packed, w2_scale, beta,
                    linear_beta):
        out = torch.ops.k3.moe_experts(z, experts, weights, w1_packed, w3_packed, w2_packed, w1_scale, w3_scale,
                                       w2_scale, beta, linear_beta, backend, limit)
        return out.float() if keep_fp32 else out
    return replacement


# (search, ends in fp32: the model's final cast dropped, example rows, packed MXFP4 experts)
SEARCHES = ((_gathered, False, M_EX, False), (_gathered_fp32, True, M_EX, False), (_gathered, False, 1, False),
            (_gathered_fp32, True, 1, False), (_dense, False, M_EX, False), (_dense_fp32, True, M_EX, False),
            (_gathered_mxfp4, False, M_EX, True), (_gathered_mxfp4_fp32, True, M_EX, True),
            (_gathered_mxfp4, False, 1, True), (_gathered_mxfp4_fp32, True, 1, True),
            (_dense_mxfp4, False, M_EX, True), (_dense_mxfp4_fp32, True, M_EX, True))
# MXFP4 example widths: multiples of 32, every derived size distinct from the others
I_MX, L_MX = 64, 224


def get_inputs(dtype: torch.dtype, device: str = "cpu", m: int = M_EX, mxfp4: bool = False) -> list:
    """z [M, L], experts [M, A] int64, weights [M, A] fp32, then w1 / w3 [E, I, L], w2 [E, L, I]; or (mxfp4) each
    as uint8 codes and scales: w1_packed [E, I, L/2], w1_scale [E, I, L/32], w3..., w2_packed [E, L, I/2], ..."""
    l = L_MX if mxfp4 else L_EX
    head = [torch.empty(m, l, dtype=dtype, device=device), torch.zeros(m, A_EX, dtype=torch.int64, device=device),
            torch.empty(m, A_EX, dtype=torch.float32, device=device)]
    if not mxfp4:
        return head + [torch.empty(E_EX, I_EX, L_EX, dtype=dtype, device=device),
                       torch.empty(E_EX, I_EX, L_EX, dtype=dtype, device=device),
                       torch.empty(E_EX, L_EX, I_EX, dtype=dtype, device=device)]

    def codes(rows, cols):
        return [torch.zeros(E_EX, rows, cols // 2, dtype=torch.uint8, device=device),
                torch.zeros(E_EX, rows, cols // 32, dtype=torch.uint8, device=device)]
    return head + codes(I_MX, L_MX) + codes(I_MX, L_MX) + codes(L_MX, I_MX)


# --- tracing as Inductor's inference graph looks ---------------------------------------------------------

def _trace_as_inductor(fn, args, *, coordinate_descent: bool, **kwargs) -> torch.fx.GraphModule:
    """``fwd_only`` (make_fx with Inductor's decompositions under ``coordinate_descent_tuning=coordinate_descent``),
    then Inductor's joint-graph passes, ``view_to_reshape``, dead code removed, as Inductor's own graph: no user
    passes, no padding. Constant folding (it turns MXFP4's scalar ``where`` operands into ``full``) runs ops on the
    device for real, so a machine without CUDA tracing the CUDA spelling (tests) goes without it."""
    from torch._guards import detect_fake_mode
    from torch._inductor import config
    from torch._inductor.fx_passes.joint_graph import joint_graph_passes
    from torch._inductor.fx_passes.post_grad import view_to_reshape
    from torch._inductor.virtualized import V

    on_absent_gpu = any(isinstance(a, torch.Tensor) and a.device.type == "cuda" for a in args) and \
        not torch.cuda.is_available()
    patches = dict(coordinate_descent_tuning=coordinate_descent, shape_padding=False, joint_custom_pre_pass=None,
                   joint_custom_post_pass=None, pattern_matcher=True)
    if on_absent_gpu:
        patches["joint_graph_constant_folding"] = False
    with config.patch(patches):
        gm = pm.fwd_only(fn, args, **kwargs)
        fake = detect_fake_mode([n.meta.get("val") for n in gm.graph.nodes])
        with V.set_fake_mode(fake) if fake is not None else _nullcontext():
            joint_graph_passes(gm)
    view_to_reshape(gm)
    gm.graph.eliminate_dead_code()
    gm.recompile()
    return gm


def _nullcontext():
    import contextlib

    return contextlib.nullcontext()


# --- guard ------------------------------------------------------------------------------------------------

def _can_moe_experts(match: pm.Match) -> bool:
    """Correctness only (the op is never slower than the model's two forms): the op's shapes, z's dtype on
    every weight, integer ids, float router weights and constants, one device."""
    z, experts, weights, w1, w3, w2 = (match_val(match, k) for k in ("z", "experts", "weights", "w1", "w3", "w2"))
    if not all(isinstance(t, torch.Tensor) for t in (z, experts, weights, w1, w3, w2)):
        return False
    if not all(matched_scalar_ok(match, c) for c in SCALARS):
        return False
    if (z.dim(), experts.dim(), weights.dim(), w1.dim(), w3.dim(), w2.dim()) != (2, 2, 2, 3, 3, 3):
        return False
    if z.dtype not in KERNEL_DTYPES or any(w.dtype != z.dtype for w in (w1, w3, w2)):
        return False
    if experts.dtype.is_floating_point or experts.dtype == torch.bool or not weights.dtype.is_floating_point:
        return False
    if len({t.device for t in (z, experts, weights, w1, w3, w2)}) != 1:
        return False
    m, l = z.shape
    e, i = w1.shape[0], w1.shape[1]
    same = [(experts.shape[0], m), (weights.shape[0], m), (weights.shape[1], experts.shape[1]),
            (w1.shape[2], l), (tuple(w3.shape), (e, i, l)), (tuple(w2.shape), (e, l, i))]
    return all(statically_known_true(a == b) if not isinstance(a, tuple) else
               all(statically_known_true(p == q) for p, q in zip(a, b)) for a, b in same)


def _can_moe_experts_mxfp4(match: pm.Match) -> bool:
    """The op's MXFP4 contract: uint8 codes and scales of the shapes z's width and w1's rows imply (L and I
    multiples of 32), integer ids, float router weights and constants, one device."""
    names = ("w1_packed", "w1_scale", "w3_packed", "w3_scale", "w2_packed", "w2_scale")
    z, experts, weights = (match_val(match, k) for k in ("z", "experts", "weights"))
    packed = [match_val(match, k) for k in names]
    if not all(isinstance(t, torch.Tensor) for t in (z, experts, weights, *packed)):
        return False
    if not all(matched_scalar_ok(match, c) for c in SCALARS):
        return False
    if (z.dim(), experts.dim(), weights.dim()) != (2, 2, 2) or any(t.dim() != 3 for t in packed):
        return False
    if z.dtype not in KERNEL_DTYPES or any(t.dtype != torch.uint8 for t in packed):
        return False
    if experts.dtype.is_floating_point or experts.dtype == torch.bool or not weights.dtype.is_floating_point:
        return False
    if len({t.device for t in (z, experts, weights, *packed)}) != 1:
        return False
    m, l = z.shape
    e, i = packed[0].shape[0], packed[0].shape[1]
    expect = [(e, i, l // 2), (e, i, l // 32), (e, i, l // 2), (e, i, l // 32), (e, l, i // 2), (e, l, i // 32)]
    same = [(experts.shape[0], m), (weights.shape[0], m), (weights.shape[1], experts.shape[1]), (l % 32, 0),
            (i % 32, 0)] + [(p, q) for t, shape in zip(packed, expect) for p, q in zip(t.shape, shape)]
    return all(statically_known_true(a == b) for a, b in same)


# --- registration -----------------------------------------------------------------------------------------

def _trace_variants() -> list[tuple[str, bool]]:
    """(device kind, coordinate-descent tuning) spellings to register: CPU; and CUDA, with max-autotune's
    decomposition and without, where torch has CUDA (a CPU-only machine never compiles a CUDA graph)."""
    variants = [("cpu", False)]
    if torch.cuda.is_available():
        variants += [("cuda", False), ("cuda", True)]
    return variants


# The forms, each registered only for a graph that calls the ops every pattern of the form calls (Group): the
# gathered forms index the experts' weights, the dense ones scatter the router weights into the combine, the MXFP4
# ones unpack the codes with integer ops and view the scale's bits as floats.
_UNPACK = (aten.bitwise_and.Scalar, aten.__rshift__.Scalar, aten.view.dtype)
FORMS = {
    "gathered": ((aten.index.Tensor,), (_gathered, _gathered_fp32)),
    "dense": ((aten.scatter.src,), (_dense, _dense_fp32)),
    "gathered_mxfp4": ((aten.index.Tensor, *_UNPACK), (_gathered_mxfp4, _gathered_mxfp4_fp32)),
    "dense_mxfp4": ((aten.scatter.src, *_UNPACK), (_dense_mxfp4, _dense_mxfp4_fp32)),
}


def _register_form(pm_pass: pm.PatternMatcherPass, options, device: str, coordinate_descent: bool, form: str):
    searches = FORMS[form][1]
    trace = reusing_search_traces(functools.partial(_trace_as_inductor, coordinate_descent=coordinate_descent),
                                  searches)
    for dtype in (torch.float32, LOW_PRECISION):
        for search, keep_fp32, m, mxfp4 in SEARCHES:
            if search not in searches or (keep_fp32 and dtype == torch.float32):
                continue   # an fp32 model's final cast is no cast: the first search is this one
            replacement = (_replacement_mxfp4 if mxfp4 else _replacement)(options.backend, options.small_m_limit,
                                                                         keep_fp32)
            pm.register_replacement(
                search, replacement, get_inputs(dtype, device, m, mxfp4), trace, pm_pass,
                extra_check=_can_moe_experts_mxfp4 if mxfp4 else _can_moe_experts,
                scalar_workaround=SCALARS, skip_duplicates=True,
            )


def _compiling_with(facts, coordinate_descent: bool) -> bool:
    """Whether the compile our pass runs in has Inductor's coordinate-descent setting (max-autotune's), which
    decides how its decompositions spell the graph."""
    from torch._inductor import config

    return bool(config.coordinate_descent_tuning) == coordinate_descent


def groups(options, variants=None) -> list[Group]:
    """One group per (device kind, coordinate-descent setting, form) (see ``FORMS``); a CUDA graph traces only the
    setting it is compiled under (~1-2 s of tracing a form), the CPU spelling is traced without it."""
    import k3compile.ops.moe_experts  # noqa: F401  (registers k3::moe_experts)

    return [Group(f"{form} {device}{' coordinate-descent' if cd else ''}",
                  functools.partial(_register_form, options=options, device=device, coordinate_descent=cd, form=form),
                  requires=FORMS[form][0], device=device,
                  when=functools.partial(_compiling_with, coordinate_descent=cd) if device == "cuda" else None)
            for device, cd in variants or _trace_variants() for form in FORMS]


def register(pm_pass: pm.PatternMatcherPass, options, variants=None) -> None:
    register_groups(pm_pass, groups(options, variants))


FACT = "graph_moe_experts_candidates"


def _is_call(node, target) -> bool:
    return isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target is target


def _integer_ids(node) -> bool:
    v = val(node)
    return isinstance(v, torch.Tensor) and v.dim() == 2 and not v.dtype.is_floating_point


def _dense_in_chunks(scatter: torch.fx.Node) -> bool:
    """Whether the per-expert outputs this combine weighs are a concatenation (the dense MXFP4 form dequantising
    its experts in several chunks: a graph whose size follows E, which no traced pattern spells)."""
    todo, seen = [scatter], set()
    while todo:
        node = todo.pop()
        for user in node.users:
            if user in seen:
                continue
            seen.add(user)
            if _is_call(user, aten.mul.Tensor):
                other = user.args[0] if user.args[1] in seen or user.args[1] is node else user.args[1]
                while _is_call(other, torch.ops.prims.convert_element_type.default):
                    other = other.args[0]
                return _is_call(other, aten.cat.default)
            if _is_call(user, aten.permute.default) or _is_call(user, aten.unsqueeze.default):
                todo.append(user)
    return False


REJECTED = "moe_experts_rejected"


def facts(graph: torch.fx.Graph, options) -> dict:
    """Candidates before rewriting: gathered forms (an integer [M, A] index gathering three or more 3-D stacks:
    float, or MXFP4 codes and scales) and dense forms (router weights scattered into zeros by integer ids, a
    [M, E] combine), except the dense MXFP4 form in several chunks, listed under ``moe_experts_rejected``."""
    gathered = {}
    for node in graph.find_nodes(op="call_function", target=aten.index.Tensor):
        w, idx = node.args[0], node.args[1]
        v_w = val(w)
        if len(idx) == 1 and isinstance(v_w, torch.Tensor) and v_w.dim() == 3 and _integer_ids(idx[0]):
            gathered[idx[0]] = gathered.get(idx[0], 0) + 1
    dense, rejected = 0, []
    for node in graph.find_nodes(op="call_function", target=aten.scatter.src):
        zeros, dim, ids = node.args[:3]
        if _is_call(zeros, aten.full.default) and zeros.args[1] == 0 and dim == 1 and _integer_ids(ids):
            if _dense_in_chunks(node):
                rejected.append("the dense MXFP4 form in several chunks of experts (the graph's size follows E)")
            else:
                dense += 1
    return {FACT: sum(n >= 3 for n in gathered.values()) + dense, **({REJECTED: sorted(set(rejected))} if rejected
                                                                     else {})}


# What the pass manager's warning says where a graph had candidates and none was rewritten.
EXPECTED = "the model has MoE layers and the graph holds the routed experts' computation"
MISSED = ("the routed experts as Inductor compiles the model's gathered or dense form, not k3::moe_experts (each "
          "selected expert's weights streamed once for all its tokens)")


def expected(summary: dict) -> bool:
    """A K3 with MoE layers, on a graph holding the routed experts' computation."""
    return summary.get("moe_layers", 0) > 0 and summary.get(FACT, 0) > 0


__all__ = ["NAME", "EXPECTED", "MISSED", "register", "expected", "facts", "get_inputs", "REJECTED"]
