"""The tail of a latent-MoE layer, fused; under tensor parallelism its two all-reduces merged into one.

Matches (post-grad ATen; L latent width, D hidden, M tokens)::

    latent = wait_tensor(all_reduce(y_lat, "sum", g))      # [M, L]  (no collective without TP)
    shared = wait_tensor(all_reduce(y_sh,  "sum", g))      # [M, D]
    x32 = latent.float()
    h   = norm_weight * (x32 * rsqrt(mean(x32², -1) + eps)).to(dtype)        # KimiRMSNorm(L)
    out = mm(h, permute(up_weight)) + shared        # or shared + mm(...), or addmm(shared, h, upᵀ),
                                                    # or addmm(mm(h, upᵀ), a, b) with shared = a @ b

Rewrites to::

    buf            = cat([y_lat, y_sh], 1)                 # [M, L + D], TP only:
    k3::all_reduce_(buf, "sum", g)                         #   in place, NCCL on the current stream
    latent, shared = buf[:, :L], buf[:, L:]
    out = k3::latent_moe_tail(latent, shared, norm_weight, up_weight, eps, backend, small_m_limit)

The fusion is a ``register_replacement`` (fp32 and 16-bit traces, four spellings of the add: without
TP, Inductor's own post-grad patterns fold the shared experts' down-projection and the add into
``addmm(tail_mm, a, b)`` before our pass runs). A structural graph walk (:func:`_tail_at`) backs
the traces: it counts the candidates the guard accepts (``facts``, so ``expected()`` warns only about
tails that should have fused, and lists why others were refused under ``latent_moe_tail_rejected``),
and :func:`postprocess` fuses any accepted tail the traces left (the real-width bf16 decode graph on
the H200 went unmatched by the traces). The collective merge is a graph walk in :func:`postprocess`
over the ``k3::latent_moe_tail`` nodes just made: the group name is a string constant the traced
patterns would bake in.

The pass fires only where the math is the tail's: a 1-D norm weight of the latent's width, an up
weight [D, L], an addend [M, D], one dtype, and M not statically above the small-M limit (a static
prefill M is left to Inductor). The collectives merge only when both are a ``sum`` all-reduce over the
same group, of 2-D tensors with the same rows, each read only through its ``wait_tensor``; other readers
of the reduced tensors then read the slices. The merged all-reduce is ``k3::all_reduce_``
(``k3compile/ops/all_reduce``), not the functional collective: its result is needed at once, and NCCL on
the current stream spares the side-stream fork and join. The tail reads the merged buffer through two
views: the strides Inductor holds a custom op's inputs to are moved to the slices', so no copy kernel sits
between the all-reduce and the tail.
"""
from __future__ import annotations

import functools
import logging

import torch

import k3compile.ops.latent_moe_tail  # noqa: F401  (registers k3::latent_moe_tail: postprocess emits it too)
from k3compile.patterns._common import (TRACE_DTYPES, aten, match_val, pm, reusing_search_traces, statically_known_true,
                                        trace_fn, val)

NAME = "latent_moe_tail"
# ops every pattern calls (the RMSNorm): a graph without one of them is not traced for (patterns/_common.py Group)
REQUIRES = (aten.pow.Tensor_Scalar, aten.mean.dim, aten.rsqrt.default)
log = logging.getLogger("k3compile")

EPS_PLACEHOLDER = 1.2345e-4   # traced in place of eps and turned back into a keyword (must be unique)


def _kimi_rms_norm(x, weight, eps):
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _tail_add_right(latent, shared, norm_weight, up_weight, eps):
    return torch.nn.functional.linear(_kimi_rms_norm(latent, norm_weight, eps), up_weight) + shared


def _tail_add_left(latent, shared, norm_weight, up_weight, eps):
    return shared + torch.nn.functional.linear(_kimi_rms_norm(latent, norm_weight, eps), up_weight)


def _tail_addmm(latent, shared, norm_weight, up_weight, eps):
    # Inductor's own post-grad patterns may already have folded ``mm + shared`` into ``addmm``.
    return torch.addmm(shared, _kimi_rms_norm(latent, norm_weight, eps), up_weight.t())


def _tail_shared_addmm(latent, shared_a, shared_b, norm_weight, up_weight, eps):
    # Without TP the shared experts' down-projection ``a @ b`` meets the tail's ``mm`` in one add,
    # which Inductor folds into ``addmm(tail_mm, a, b)``.
    return torch.addmm(torch.nn.functional.linear(_kimi_rms_norm(latent, norm_weight, eps), up_weight),
                       shared_a, shared_b)


def _replace_shared_addmm(backend, limit):
    def replacement(latent, shared_a, shared_b, norm_weight, up_weight, eps):
        return torch.ops.k3.latent_moe_tail(latent, torch.mm(shared_a, shared_b), norm_weight, up_weight,
                                            eps, backend, limit)
    return replacement


def _replace_shared(backend, limit):
    def replacement(latent, shared, norm_weight, up_weight, eps):
        return torch.ops.k3.latent_moe_tail(latent, shared, norm_weight, up_weight, eps, backend, limit)
    return replacement


# (search, replacement factory, takes the shared output as a product a @ b)
SEARCHES = ((_tail_add_right, _replace_shared, False), (_tail_add_left, _replace_shared, False),
            (_tail_addmm, _replace_shared, False), (_tail_shared_addmm, _replace_shared_addmm, True))

M_EX, L_EX, D_EX, K_EX = 4, 24, 16, 20   # example sizes, all distinct; M > 1 (Inductor decomposes M=1 mm)


def get_inputs(dtype: torch.dtype, shared_as_product: bool = False) -> list[torch.Tensor]:
    """latent [M, L], shared [M, D] (or a [M, K], b [K, D]), norm_weight [L], up_weight [D, L]."""
    shared = ([torch.empty(M_EX, K_EX, dtype=dtype), torch.empty(K_EX, D_EX, dtype=dtype)] if shared_as_product
              else [torch.empty(M_EX, D_EX, dtype=dtype)])
    return [torch.empty(M_EX, L_EX, dtype=dtype), *shared,
            torch.empty(L_EX, dtype=dtype), torch.empty(D_EX, L_EX, dtype=dtype)]


def _shared_shape(match: pm.Match):
    """[M, D] of the addend, whether it is a tensor or the product ``a @ b`` (None if neither fits)."""
    if "shared" in match.kwargs:
        shared = match_val(match, "shared")
        return (tuple(shared.shape), shared) if isinstance(shared, torch.Tensor) and shared.dim() == 2 else None
    a, b = match_val(match, "shared_a"), match_val(match, "shared_b")
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dim() == 2 and b.dim() == 2):
        return None
    if a.dtype != b.dtype or not statically_known_true(a.shape[1] == b.shape[0]):
        return None
    return (a.shape[0], b.shape[1]), a


def _can_fuse_tail(match: pm.Match, small_m_limit: int) -> bool:
    """Correctness: the op's shapes and one dtype. Profit: not when M is statically above the limit."""
    latent, norm_weight, up_weight = (match_val(match, k) for k in ("latent", "norm_weight", "up_weight"))
    found = _shared_shape(match)
    if found is None or not all(isinstance(t, torch.Tensor) for t in (latent, norm_weight, up_weight)):
        return False
    shared_shape, shared = found
    if (latent.dim(), norm_weight.dim(), up_weight.dim()) != (2, 1, 2):
        return False
    dtypes = {latent.dtype, shared.dtype, norm_weight.dtype, up_weight.dtype}
    if len(dtypes) != 1 or not latent.dtype.is_floating_point:
        return False
    if len({latent.device, shared.device, norm_weight.device, up_weight.device}) != 1:
        return False
    m, l = latent.shape
    d = up_weight.shape[0]
    same = [(norm_weight.shape[0], l), (up_weight.shape[1], l), (shared_shape[0], m), (shared_shape[1], d)]
    if not all(statically_known_true(a == b) for a, b in same):
        return False
    # Prefill with a static M: norm + addmm inside an opaque op would lose Inductor's fused norm.
    return not statically_known_true(m > small_m_limit)


def register(pm_pass: pm.PatternMatcherPass, options) -> None:
    trace = reusing_search_traces(trace_fn, [search for search, _, _ in SEARCHES])
    for dtype in TRACE_DTYPES:
        for search, make_replacement, shared_as_product in SEARCHES:
            pm.register_replacement(
                search, make_replacement(options.backend, options.small_m_limit),
                get_inputs(dtype, shared_as_product), trace, pm_pass,
                extra_check=functools.partial(_can_fuse_tail, small_m_limit=options.small_m_limit),
                scalar_workaround={"eps": EPS_PLACEHOLDER}, skip_duplicates=True,
            )


# What the pass manager's warning says where a graph had candidates and none was rewritten.
EXPECTED = "the graph holds a latent-MoE tail of at most {small_m_limit} rows that the guard accepts"
MISSED = "the MoE tail unfused: norm, up-projection and shared add apart (under TP, two all-reduces)"


def expected(summary: dict) -> bool:
    """A K3 with latent-MoE layers, on a graph holding a normed projection with an addend of small M."""
    return summary.get("moe_layers", 0) > 0 and summary.get(FACT, 1) > 0


FACT = "graph_latent_moe_tail_candidates"


def _is_call(node, target) -> bool:
    return isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target is target


def _other(node: torch.fx.Node, one):
    """The other operand of a binary call (``None`` if ``one`` is neither)."""
    a, b = node.args[:2]
    return b if a is one else (a if b is one else None)


def _tail_at(rsqrt: torch.fx.Node, small_m_limit: int):
    """Walk the graph from a ``rsqrt`` to the tail it belongs to, checking the math and the op's
    contract as :func:`_can_fuse_tail` does. Yields ``(found, why_not)``: ``found`` is a dict
    (latent, norm_weight, up_weight, eps, out (the node the tail's value replaces), shared (a node)
    or shared_ab (a, b)) when every check holds, else ``None`` with the reason.

    This is the structural twin of the traced patterns: it counts the candidates (``facts``) and
    rewrites any the traced patterns did not match (``postprocess``), so a graph spelled in a way the
    traces do not know still fuses, and a rejected candidate says why in the record.
    """
    var_eps = rsqrt.args[0]
    if not (_is_call(var_eps, aten.add.Tensor) and isinstance(var_eps.args[1], float)
            and _is_call(var_eps.args[0], aten.mean.dim)):
        return
    mean = var_eps.args[0]
    if not (list(mean.args[1]) in ([-1], [1]) and (mean.args[2:3] == (True,) or mean.kwargs.get("keepdim"))):
        return
    sq = mean.args[0]
    if not (_is_call(sq, aten.pow.Tensor_Scalar) and sq.args[1] == 2):
        return
    x32 = sq.args[0]
    upcast = _is_call(x32, torch.ops.prims.convert_element_type.default) and x32.args[1] == torch.float32
    latent = x32.args[0] if upcast else x32
    v_lat = val(latent)
    if not (isinstance(v_lat, torch.Tensor) and v_lat.dim() == 2 and v_lat.dtype.is_floating_point):
        return
    eps = var_eps.args[1]
    for inner in rsqrt.users:
        if not (_is_call(inner, aten.mul.Tensor) and _other(inner, rsqrt) is x32):
            continue
        converts = [u for u in inner.users if _is_call(u, torch.ops.prims.convert_element_type.default)]
        if v_lat.dtype == torch.float32:
            # An fp32 latent normalised, then rounded to a 16-bit activation dtype: torch < 2.12's
            # joint-graph ``pointless_convert`` folds the model's ``bf16(y_lat).float()`` into
            # ``y_lat`` (fp32), so the bf16 decode graph looks like this. The op then gets
            # ``latent.to(dtype)``: the model's own rounding of y_lat, which Inductor had dropped.
            normed_nodes = [inner] + [u for u in converts if u.args[1] in (torch.bfloat16, torch.float16)]
        else:
            normed_nodes = [u for u in converts if u.args[1] == v_lat.dtype]
        for normed in normed_nodes:
            act_dtype = normed.args[1] if normed is not inner else v_lat.dtype
            for h in normed.users:
                if not _is_call(h, aten.mul.Tensor):
                    continue
                g = _other(h, normed)
                for use in h.users:
                    found, why = _check_tail(latent, g, h, use, eps, small_m_limit, act_dtype)
                    yield found, why


def _up_weight(node):
    return node.args[0] if _is_call(node, aten.permute.default) and list(node.args[1]) == [1, 0] else None


def _check_tail(latent, g, h, use, eps, small_m_limit, act_dtype):
    """``use`` reads ``h``: the up-projection and its addend, then the op's contract (``act_dtype``:
    the dtype the normalised latent is rounded to; the latent is cast to it when it is wider)."""
    found = dict(latent=latent, norm_weight=g, eps=eps, cast_latent=val(latent).dtype != act_dtype)
    if _is_call(use, aten.addmm.default) and use.args[1] is h and not use.kwargs:
        found.update(up_weight=_up_weight(use.args[2]), shared=use.args[0], out=use)
    elif _is_call(use, aten.mm.default) and use.args[0] is h:
        found["up_weight"] = _up_weight(use.args[1])
        adds = [u for u in use.users if _is_call(u, aten.add.Tensor) and len(u.args) == 2 and not u.kwargs]
        addmms = [u for u in use.users if _is_call(u, aten.addmm.default) and u.args[0] is use and not u.kwargs]
        if adds:
            found.update(shared=_other(adds[0], use), out=adds[0])
        elif addmms:
            found.update(shared_ab=tuple(addmms[0].args[1:3]), out=addmms[0])
        else:
            return None, None   # a norm and a projection, no addend: not a tail
    else:
        return None, None   # h read by something else: not a tail (not counted)
    if found["up_weight"] is None:
        return None, "up-projection weight is not permute(w)"
    if len(found["out"].args) > 3 or found["out"].kwargs:
        return None, "addmm with alpha/beta"
    v = {k: val(found[k]) for k in ("latent", "norm_weight", "up_weight")}
    if "shared" in found:
        v_sh = val(found["shared"])
        sh_shape = tuple(v_sh.shape) if isinstance(v_sh, torch.Tensor) and v_sh.dim() == 2 else None
    else:
        a, b = (val(n) for n in found["shared_ab"])
        ok = all(isinstance(t, torch.Tensor) and t.dim() == 2 for t in (a, b))
        v_sh = a if ok else None
        sh_shape = (a.shape[0], b.shape[1]) if ok and statically_known_true(a.shape[1] == b.shape[0]) else None
        if ok and a.dtype != b.dtype:
            sh_shape = None
    if not all(isinstance(t, torch.Tensor) for t in v.values()):
        return None, None   # a scalar scale, not a norm weight: not a tail
    if sh_shape is None:
        return None, "addend is not a 2-D tensor [M, D]"
    lat, nw, up = v["latent"], v["norm_weight"], v["up_weight"]
    if (nw.dim(), up.dim()) != (1, 2):
        return None, f"norm weight {nw.dim()}-D / up weight {up.dim()}-D"
    dtypes = {act_dtype, v_sh.dtype, nw.dtype, up.dtype}   # the latent enters the op as act_dtype
    if len(dtypes) != 1:
        return None, f"dtypes differ: latent {act_dtype}, shared {v_sh.dtype}, norm weight {nw.dtype}, up {up.dtype}"
    if len({lat.device, v_sh.device, nw.device, up.device}) != 1:
        return None, "devices differ"
    m, l = lat.shape
    same = [(nw.shape[0], l), (up.shape[1], l), (sh_shape[0], m), (sh_shape[1], up.shape[0])]
    if not all(statically_known_true(a == b) for a, b in same):
        return None, "widths differ"
    if statically_known_true(m > small_m_limit):
        return None, None   # prefill with a static M: left to Inductor, not a candidate
    return found, None


def _tails(graph: torch.fx.Graph, small_m_limit: int):
    for node in list(graph.nodes):
        if _is_call(node, aten.rsqrt.default):
            yield from _tail_at(node, small_m_limit)


REJECTED = "latent_moe_tail_rejected"


def facts(graph: torch.fx.Graph, options) -> dict:
    """How many tails this graph holds before rewriting that the guard accepts (M not statically
    above the small-M limit, one dtype, the op's shapes), and why the others were refused."""
    n, why_not = 0, []
    for found, reason in _tails(graph, options.small_m_limit):
        n += found is not None
        if reason:
            why_not.append(reason)
    return {FACT: n, **({REJECTED: sorted(set(why_not))} if why_not else {})}


def _rewrite_walked(graph: torch.fx.Graph, options) -> int:
    """Fuse the tails the traced patterns left (a spelling they do not know); returns how many."""
    op = torch.ops.k3.latent_moe_tail.default
    n = 0
    for found, _ in list(_tails(graph, options.small_m_limit)):
        if found is None:
            continue
        out = found["out"]
        with graph.inserting_before(out):
            if "shared_ab" in found:
                a, b = found["shared_ab"]
                shared = graph.call_function(aten.mm.default, (a, b))
                shared.meta["val"] = torch.mm(val(a), val(b))
            else:
                shared = found["shared"]
            latent = found["latent"]
            if found["cast_latent"]:
                v_sh = val(shared)
                latent = graph.call_function(torch.ops.prims.convert_element_type.default, (latent, v_sh.dtype))
                latent.meta["val"] = val(found["latent"]).to(v_sh.dtype)
            args = (latent, shared, found["norm_weight"], found["up_weight"], float(found["eps"]),
                    options.backend, options.small_m_limit)
            fused = graph.call_function(op, args)
        fused.meta["val"] = op(*(val(a) if isinstance(a, torch.fx.Node) else a for a in args))
        out.replace_all_uses_with(fused)
        graph.erase_node(out)
        n += 1
    if n:
        graph.eliminate_dead_code()
        log.debug("%s: %d tails fused by the graph walk (not by a traced pattern)", NAME, n)
    return n


# ----------------------------------------------------------------------------------------------
# The collective merge (tensor-parallel form)

c10d = torch.ops._c10d_functional


def _reduced_input(node):
    """(all_reduce node, its input, reduce op, group) when ``node`` is ``wait_tensor(all_reduce(x))``."""
    if not (isinstance(node, torch.fx.Node) and node.op == "call_function"
            and node.target is c10d.wait_tensor.default):
        return None
    ar = node.args[0]
    if not (isinstance(ar, torch.fx.Node) and ar.op == "call_function" and ar.target is c10d.all_reduce.default):
        return None
    if len(ar.users) != 1:
        return None
    inp, reduce_op, group = ar.args[:3]
    return ar, inp, reduce_op, group


def _static_int(x):
    return x if isinstance(x, int) else None


def _merge_collectives(graph: torch.fx.Graph, tail: torch.fx.Node) -> bool:
    import k3compile.ops.all_reduce  # noqa: F401  (registers k3::all_reduce_)
    lat_wait, sh_wait = tail.args[0], tail.args[1]
    lat, sh = _reduced_input(lat_wait), _reduced_input(sh_wait)
    if lat is None or sh is None or lat_wait is sh_wait:
        return False
    (lat_ar, lat_in, lat_op, lat_group), (sh_ar, sh_in, sh_op, sh_group) = lat, sh
    if lat_op != "sum" or sh_op != "sum" or lat_group != sh_group:
        return False
    v_lat, v_sh = val(lat_in), val(sh_in)
    if v_lat is None or v_sh is None or v_lat.dim() != 2 or v_sh.dim() != 2:
        return False
    if v_lat.dtype != v_sh.dtype or v_lat.device != v_sh.device:
        return False
    # Concatenating along the width needs the same rows: a sequence-parallel layout (rows split over
    # ranks) or anything else with different M stays as it is.
    if not statically_known_true(v_lat.shape[0] == v_sh.shape[0]):
        return False
    l, d = _static_int(v_lat.shape[1]), _static_int(v_sh.shape[1])
    if l is None or d is None:
        return False

    order = {n: i for i, n in enumerate(graph.nodes)}
    later = max(lat_ar, sh_ar, key=order.__getitem__)
    # the merged result exists only from ``later`` on: every reader must come after it
    if any(order[u] < order[later] for w in (lat_wait, sh_wait) for u in w.users):
        return False
    # One in-place all-reduce of the fresh concatenation, on the current stream (k3::all_reduce_: the
    # functional collective's side-stream fork and join cost 2-3.5 us per layer in a CUDA graph on two
    # H200s); the readers read the slices after it.
    with graph.inserting_before(later):
        cat = graph.call_function(aten.cat.default, ([lat_in, sh_in], 1))
        reduce = graph.call_function(torch.ops.k3.all_reduce_.default, (cat, lat_op, lat_group))
        new_lat = graph.call_function(aten.slice.Tensor, (cat, 1, 0, l))
        new_sh = graph.call_function(aten.slice.Tensor, (cat, 1, l, l + d))
    v_cat = torch.cat([v_lat, v_sh], 1)
    reduce.meta["val"] = None
    for node, v in ((cat, v_cat), (new_lat, v_cat[:, :l]), (new_sh, v_cat[:, l:])):
        node.meta["val"] = v
    lat_wait.replace_all_uses_with(new_lat)
    sh_wait.replace_all_uses_with(new_sh)
    for user in {*new_lat.users, *new_sh.users}:
        _refresh_eager_input_vals(user, (new_lat, new_sh))
    for node in (lat_wait, sh_wait, lat_ar, sh_ar):
        graph.erase_node(node)
    return True


def _refresh_eager_input_vals(user: torch.fx.Node, slices) -> None:
    """Record, for a reader of the merged buffer, the strides of the slices it now reads.

    A custom op traced by make_fx (our pattern's replacement) keeps in ``meta["eager_input_vals"]``
    the fake inputs it was traced with, and Inductor copies each input to exactly those strides
    (custom ops default to ``needs_exact_strides``). Those were the contiguous all-reduce results;
    the slices have row stride L + D, so Inductor would add a copy kernel per slice between the
    all-reduce and the tail. With the slices' own strides it passes two views of the reduced buffer.
    """
    eager = user.meta.get("eager_input_vals")
    if eager is None:
        return

    def fresh(arg, eager_arg):
        return val(arg) if any(arg is s for s in slices) else eager_arg

    args, kwargs = eager
    args = tuple(fresh(a, e) for a, e in zip(user.args, args)) + tuple(args[len(user.args):])
    kwargs = {k: fresh(user.kwargs.get(k), e) for k, e in kwargs.items()}
    user.meta["eager_input_vals"] = (args, kwargs)


def postprocess(graph: torch.fx.Graph, options) -> int:
    """Fuse the tails the traced patterns missed, then merge the two all-reduces feeding each fused
    tail. Returns the tails fused here (a merge does not add to the count: one per tail)."""
    walked = _rewrite_walked(graph, options)
    merged = sum(_merge_collectives(graph, node) for node in list(graph.nodes)
                 if node.op == "call_function" and node.target is torch.ops.k3.latent_moe_tail.default)
    if merged:
        log.debug("%s: merged %d all-reduce pairs", NAME, merged)
    return walked


__all__ = ["NAME", "EXPECTED", "MISSED", "register", "expected", "facts", "postprocess", "get_inputs"]
