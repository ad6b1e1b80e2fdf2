"""The KDA decode step (one token), fused into one in-place op.

Matches (post-grad ATen; B batch, H heads, K = V head dim, P = H*K, W conv width; the model's plain step,
``model/kda.py``, with its in-place state updates functionalised)::

    for x, c, w in (q, conv_q, wq), (k, conv_k, wk), (v, conv_v, wv):          # [B, P], [B, P, W-1], [P, 1, W]
        window = cat([c, x[..., None]], -1)
        x'     = silu((window.float() * w[:, 0].float()).sum(-1)).to(x.dtype)
        c_new  = copy(c, window[..., 1:])
    g     = lb * sigmoid(exp(A_log)[:, None] * (f.float() + dt_bias.reshape(H, K)))   # K3, or
          = -exp(A_log)[:, None] * softplus(f.float() + dt_bias.reshape(H, K))       # Kimi Linear
    beta  = sigmoid(b.float())                                                      # [B, H]
    q, k  = l2norm(q') * K**-0.5, l2norm(k')                                         # [B, H, K] fp32
    S     = state * exp(g)[:, :, None, :];  u = beta * (v' - S @ k);  S_new = S + u kᵀ;  o = S_new @ q
    out   = (o * rsqrt(mean(o²) + eps) * o_norm_w * sigmoid(G.float())).to(G.dtype)  # [B, H, V]
    ... copy_(conv_q, c_new_q); copy_(conv_k, c_new_k); copy_(conv_v, c_new_v); copy_(state, S_new)

Rewrites to::

    out, conv_q', conv_k', conv_v', state' = auto_functionalized(k3.kda_decode, q, k, v, conv_q, ..., state)

so the trailing ``copy_`` epilogue takes the op's results, and Inductor's re-inplacing pass turns the
functionalised op back into the in-place one: no copy of a state remains in the compiled code.

One whole-step pattern per gate form (and per dtype trace) rather than small chained patterns: the step's
parts share their intermediates (q', k' feed both the update and the output), so a chain of partial ops
would need the same fusion pass at the end; the whole-step search is the documented fallback of
design.md. The guard re-checks what the sizes-agnostic search cannot: the op's shapes, fp32 state, one
activation dtype, head dim and conv width the op's checks accept.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from k3compile.patterns._common import (
    LOW_PRECISION, Group, aten, match_val, pm, register_groups, reusing_search_traces, statically_known_true,
    trace_dtypes_of, trace_fn,
)

NAME = "kda_decode"
# ops every pattern calls (the conv window, the state update, the decay): a graph without one of them is not
# traced for (patterns/_common.py Group)
REQUIRES = (aten.cat.default, aten.copy.default, aten.exp.default, aten.sigmoid.default)

# traced in place of the gate's lower bound and the norm's eps, then turned into keywords (must be unique)
LB_PLACEHOLDER = -4.321
EPS_PLACEHOLDER = 1.2345e-5


# -- the search: the plain step, functional ---------------------------------------------------------------
def _short_conv(x, conv_state, weight):
    window = torch.cat([conv_state, x[..., None]], dim=-1)
    y = F.silu((window.float() * weight[:, 0].float()).sum(-1)).to(x.dtype)
    return y, torch.ops.aten.copy.default(conv_state, window[..., 1:])


def _l2(x):
    xf = x.float()
    return xf * torch.rsqrt(xf.pow(2).sum(-1, keepdim=True) + 1e-6)


def _step(q, k, v, conv_q, conv_k, conv_v, w_q, w_k, w_v, f, A_log, dt_bias, b, gate, o_norm_w, state,
          eps, gate_fn):
    B, H, V, K = state.shape
    q, new_cq = _short_conv(q, conv_q, w_q)
    k, new_ck = _short_conv(k, conv_k, w_k)
    v, new_cv = _short_conv(v, conv_v, w_v)
    g = gate_fn(f.reshape(B, H, K), A_log, dt_bias)
    beta = torch.sigmoid(b.float())
    q = _l2(q.reshape(B, H, K)) * K ** -0.5
    k = _l2(k.reshape(B, H, K))
    S = state * torch.exp(g)[:, :, None, :]
    u = beta[..., None] * (v.reshape(B, H, V).float() - (S @ k[..., None]).squeeze(-1))
    S = S + u[..., None] * k[:, :, None, :]
    o = (S @ q[..., None]).squeeze(-1)
    G = gate.reshape(B, H, V)
    out = (o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + eps) * o_norm_w.float()
           * torch.sigmoid(G.float())).to(G.dtype)
    return out, new_cq, new_ck, new_cv, S


def _gate_lower_bound(lower_bound):
    def gate(f, A_log, dt_bias):
        H, K = f.shape[-2:]
        a = torch.exp(A_log.float())[:, None]
        return lower_bound * torch.sigmoid(a * (f.float() + dt_bias.float().reshape(H, K)))
    return gate


def _gate_softplus(f, A_log, dt_bias):
    H, K = f.shape[-2:]
    a = torch.exp(A_log.float())[:, None]
    return -a * F.softplus(f.float() + dt_bias.float().reshape(H, K))


def _search_lower_bound(q, k, v, conv_q, conv_k, conv_v, w_q, w_k, w_v, f, A_log, dt_bias, b, gate, o_norm_w,
                        state, lower_bound, eps):
    return _step(q, k, v, conv_q, conv_k, conv_v, w_q, w_k, w_v, f, A_log, dt_bias, b, gate, o_norm_w, state,
                 eps, _gate_lower_bound(lower_bound))


def _search_softplus(q, k, v, conv_q, conv_k, conv_v, w_q, w_k, w_v, f, A_log, dt_bias, b, gate, o_norm_w,
                     state, eps):
    return _step(q, k, v, conv_q, conv_k, conv_v, w_q, w_k, w_v, f, A_log, dt_bias, b, gate, o_norm_w, state,
                 eps, _gate_softplus)


# -- the replacement ----------------------------------------------------------------------------------------
def _fused(backend, q, k, v, conv_q, conv_k, conv_v, w_q, w_k, w_v, f, A_log, dt_bias, b, gate, o_norm_w,
           state, lower_bound, eps):
    from torch._higher_order_ops.auto_functionalize import auto_functionalized

    B, H, V, K = state.shape
    res = auto_functionalized(
        torch.ops.k3.kda_decode.default, q=q, k=k, v=v, conv_state_q=conv_q, conv_state_k=conv_k,
        conv_state_v=conv_v, conv_weight_q=w_q, conv_weight_k=w_k, conv_weight_v=w_v, f=f, A_log=A_log,
        dt_bias=dt_bias, lower_bound=lower_bound, beta_logits=b, out_gate=gate, o_norm_weight=o_norm_w,
        state=state, eps=eps, backend=backend)
    out, new_cq, new_ck, new_cv, new_state = res
    return out.reshape(B, H, V), new_cq, new_ck, new_cv, new_state


def _replace_lower_bound(backend):
    def replacement(q, k, v, conv_q, conv_k, conv_v, w_q, w_k, w_v, f, A_log, dt_bias, b, gate, o_norm_w,
                    state, lower_bound, eps):
        return _fused(backend, q, k, v, conv_q, conv_k, conv_v, w_q, w_k, w_v, f, A_log, dt_bias, b, gate,
                      o_norm_w, state, lower_bound, eps)
    return replacement


def _replace_softplus(backend):
    def replacement(q, k, v, conv_q, conv_k, conv_v, w_q, w_k, w_v, f, A_log, dt_bias, b, gate, o_norm_w,
                    state, eps):
        return _fused(backend, q, k, v, conv_q, conv_k, conv_v, w_q, w_k, w_v, f, A_log, dt_bias, b, gate,
                      o_norm_w, state, None, eps)
    return replacement


# -- example inputs and the guard ---------------------------------------------------------------------------
B_EX, H_EX, K_EX, W_EX = 3, 2, 8, 4   # distinct sizes, so no two dims of the trace can be confused


def get_inputs(act_dtype: torch.dtype, param_dtype: torch.dtype) -> list[torch.Tensor]:
    """Activations in ``act_dtype``; conv weights, A_log, dt_bias, o_norm weight in ``param_dtype``
    (fp32 in the checkpoint, the activation dtype after ``model.to(dtype)``); the state is fp32."""
    B, H, K, W = B_EX, H_EX, K_EX, W_EX
    P = H * K
    a = functools.partial(torch.empty, dtype=act_dtype)
    p = functools.partial(torch.empty, dtype=param_dtype)
    return [a(B, P), a(B, P), a(B, P), a(B, P, W - 1), a(B, P, W - 1), a(B, P, W - 1),
            p(P, 1, W), p(P, 1, W), p(P, 1, W), a(B, P), p(H), p(P), a(B, H), a(B, P), p(K),
            torch.empty(B, H, K, K, dtype=torch.float32)]


# (activation dtype, parameter dtype) of each trace: fp32 model, model.to(bf16), bf16 with fp32 checkpoint params
TRACES = ((torch.float32, torch.float32), (LOW_PRECISION, LOW_PRECISION), (LOW_PRECISION, torch.float32))

MAX_HEAD_DIM_FOR_FUSION = 256   # the op itself takes any size (the reference runs beyond the kernel's 128)


def _can_fuse_kda_decode(match: pm.Match) -> bool:
    """Correctness only: the shapes k3::kda_decode accepts (it raises otherwise), fp32 state, float inputs."""
    names = ("q", "k", "v", "conv_q", "conv_k", "conv_v", "w_q", "w_k", "w_v", "f", "A_log", "dt_bias",
             "b", "gate", "o_norm_w", "state")
    t = {n: match_val(match, n) for n in names}
    if not all(isinstance(x, torch.Tensor) for x in t.values()):
        return False
    state = t["state"]
    if state.dim() != 4 or state.dtype != torch.float32:
        return False
    if len({x.device for x in t.values()}) != 1:
        return False
    act = t["q"].dtype
    if not act.is_floating_point or any(t[n].dtype != act for n in ("k", "v", "conv_q", "conv_k", "conv_v")):
        return False
    B, H, V, K = state.shape
    W = t["w_q"].shape[-1]
    P = H * K
    want = {
        "q": (B, P), "k": (B, P), "v": (B, H * V), "conv_q": (B, P, W - 1), "conv_k": (B, P, W - 1),
        "conv_v": (B, H * V, W - 1), "w_q": (P, 1, W), "w_k": (P, 1, W), "w_v": (H * V, 1, W),
        "f": (B, P), "A_log": (H,), "dt_bias": (P,), "b": (B, H), "gate": (B, H * V), "o_norm_w": (V,),
    }
    for n, shape in want.items():
        x = t[n]
        if x.dim() != len(shape) or not all(statically_known_true(a == s) for a, s in zip(x.shape, shape)):
            return False
    return statically_known_true(K == V) and statically_known_true(K <= MAX_HEAD_DIM_FOR_FUSION)


def _register_traces(pm_pass: pm.PatternMatcherPass, options, traces=TRACES) -> None:
    import k3compile.ops.kda_decode  # noqa: F401  (registers k3::kda_decode)

    trace = reusing_search_traces(trace_fn, (_search_lower_bound, _search_softplus))
    for act_dtype, param_dtype in traces:
        inputs = get_inputs(act_dtype, param_dtype)
        pm.register_replacement(
            _search_lower_bound, _replace_lower_bound(options.backend), inputs, trace, pm_pass,
            extra_check=_can_fuse_kda_decode, skip_duplicates=True,
            scalar_workaround={"lower_bound": LB_PLACEHOLDER, "eps": EPS_PLACEHOLDER},
        )
        pm.register_replacement(
            _search_softplus, _replace_softplus(options.backend), inputs, trace, pm_pass,
            extra_check=_can_fuse_kda_decode, skip_duplicates=True,
            scalar_workaround={"eps": EPS_PLACEHOLDER},
        )


def _conv_windows(graph: torch.fx.Graph) -> list:
    """The one-token conv-state windows ``cat([state, x[..., None]], -1)`` of ``graph`` (three a KDA decode step)."""
    out = []
    for node in graph.find_nodes(op="call_function", target=torch.ops.aten.cat.default):
        parts = node.args[0]
        if (len(parts) == 2 and isinstance(parts[0], torch.fx.Node) and parts[0].op == "placeholder"
                and isinstance(parts[1], torch.fx.Node) and parts[1].target == torch.ops.aten.unsqueeze.default):
            out.append(node)
    return out


def _window_dtypes(graph: torch.fx.Graph) -> list:
    """``trace_dtypes_of`` each conv window of ``graph``."""
    return [trace_dtypes_of(w) for w in _conv_windows(graph)]


def _wants(facts, act_dtype: torch.dtype) -> bool:
    """A graph with a conv window computed from values of ``act_dtype``, or with none found."""
    windows = facts.derived(_window_dtypes)
    return not windows or any(act_dtype in dtypes for dtypes in windows)


def groups(options) -> list[Group]:
    """A group an activation dtype (its parameter dtypes together), each traced only for a graph whose conv windows
    are computed in it: a bf16 model's decode graph traces 4 of the 6 searches, a fp32 one 2."""
    acts = dict.fromkeys(act for act, _ in TRACES)
    return [Group(f"{str(act).removeprefix('torch.')} activations",
                  functools.partial(_register_traces, options=options,
                                    traces=tuple(t for t in TRACES if t[0] == act)),
                  requires=REQUIRES, when=functools.partial(_wants, act_dtype=act))
            for act in acts]


def register(pm_pass: pm.PatternMatcherPass, options) -> None:
    register_groups(pm_pass, groups(options))


def facts(graph: torch.fx.Graph, options) -> dict:
    """Read before any rewrite: how many one-token conv-state windows the graph holds (three per KDA decode step; a
    prefill concatenates a whole [B, P, T] block)."""
    return {"graph_kda_decode_convs": len(_conv_windows(graph))}


# What the pass manager's warning says where a graph had candidates and none was rewritten.
EXPECTED = "the model has KDA layers and the graph updates one-token conv windows: a decode step"
MISSED = "each KDA decode step as separate Inductor kernels, not one fused in-place k3::kda_decode"


def expected(model_summary: dict) -> bool:
    """A K3 / Kimi Linear model with KDA layers, on a graph with one-token conv windows (a decode step)."""
    return (bool(model_summary.get("is_k3")) and model_summary.get("kda_layers", 0) > 0
            and model_summary.get("graph_kda_decode_convs", 1) > 0)


def postprocess(graph: torch.fx.Graph, options) -> int:
    """Restore topological order. A multi-output replacement is inserted before the earliest of the
    matched outputs (here a conv-state update), which in a model precedes some of the step's inputs
    (the output-gate projection, for one); moving nodes after their inputs changes no result."""
    from torch._inductor.pattern_matcher import stable_topological_sort

    stable_topological_sort(graph)
    return 0
