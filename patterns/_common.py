"""What every pattern file shares: tracing, fake-mode registration, reading node metadata.

Contract of a pattern module ``patterns/<name>.py`` (listed in ``patterns/__init__.py``):

- ``NAME: str`` -- the pass name shown in reports and used in ``optimize(passes=...)``.
- ``register(pm_pass: PatternMatcherPass, options: K3Options) -> None`` -- registers its
  search/replacement pairs into ``pm_pass``. Called once per (pass, options) under fake tensors,
  lazily, at the first compile that needs it.
- ``expected(summary: dict) -> bool`` -- whether a graph of a model described by the summary
  (``k3compile.passes.summarize_model`` keys, plus every module's ``facts`` for this graph and
  ``small_m_limit``) should produce at least one match; used by ``strict=True`` and the warning
  on zero matches.
- ``EXPECTED: str`` and ``MISSED: str`` -- that warning's words: why the pass was expected on the graph
  (formatted with the summary's keys, e.g. ``{small_m_limit}``), and what the graph runs instead.
- Optionally ``postprocess(graph, options) -> int`` for rewrites done by hand after the pattern
  matcher (returns the number of rewrites).
- Optionally ``facts(graph, options) -> dict`` -- read-only facts about a post-grad graph, taken
  before any pass rewrites it (e.g. ``{"graph_small_m_gemms": 3}``). The pass manager merges every
  module's facts into the summary that ``expected()`` receives for that graph, so a pass can be
  expected only where its candidates exist (a decode graph, not a prefill graph). Keys must be
  unique across modules: prefix them ``graph_``.

Search and replacement functions are plain eager functions traced with :func:`trace_fn`; guards
read ``meta["val"]`` through :func:`val` and decide symbolic sizes only through
``statically_known_true`` / ``guard_or_false`` so that they never add guards of their own.
"""
from __future__ import annotations

import contextlib
import functools
from typing import Any, Optional

import torch
from torch._inductor import pattern_matcher as pm
from torch.fx.experimental.symbolic_shapes import guard_or_false, statically_known_true

aten = torch.ops.aten

__all__ = [
    "aten", "pm", "trace_fn", "fake_mode", "val", "match_val", "is_static_le", "guard_or_false",
    "statically_known_true", "LOW_PRECISION", "TRACE_DTYPES",
]

# Patterns ignore sizes but not dtypes (a 16-bit trace carries converts a fp32 trace lacks), so each
# pattern registers one fp32 and one 16-bit trace; bf16 and fp16 traces are identical.
LOW_PRECISION = torch.bfloat16
TRACE_DTYPES = (torch.float32, LOW_PRECISION)


def trace_fn(*args, **kwargs) -> torch.fx.GraphModule:
    """``fwd_only`` + ``view_to_reshape`` so traced patterns look like the post-grad graph.

    torch >= 2.12 passes extra keywords (``get_decomp_fn``); accept and forward them.
    """
    from torch._inductor.fx_passes.post_grad import view_to_reshape

    gm = pm.fwd_only(*args, **kwargs)
    view_to_reshape(gm)
    return gm


@functools.cache
def warm_inductor_patterns() -> None:
    """Initialise Inductor's lazily registered pattern sets (joint graph, post grad) for every device our searches
    are traced on, before any ``register_replacement`` of ours runs. Some searches are traced through Inductor's
    own passes; one that reaches a set not yet initialised registers Inductor's patterns from inside our
    ``register_replacement``, which re-enters a config patch torch 2.11 cannot enter twice ("prior should be empty
    when entering ConfigPatch": the moe_experts pass failed so on the H200 image). Call under :func:`fake_mode`."""
    from torch._inductor import config as inductor_config
    from torch._inductor.fx_passes.joint_graph import joint_graph_passes
    from torch._inductor.fx_passes.post_grad import post_grad_passes

    for device in ("cpu", "cuda") if torch.cuda.is_available() else ("cpu",):
        gm = pm.fwd_only(lambda x: x + 1, [torch.empty(2, device=device)])
        with inductor_config.patch(joint_custom_pre_pass=None, joint_custom_post_pass=None,
                                   post_grad_custom_pre_pass=None, post_grad_custom_post_pass=None):
            joint_graph_passes(gm)
            post_grad_passes(gm, is_inference=True)


@contextlib.contextmanager
def fake_mode():
    """Register patterns on fake tensors: no real memory, no real kernels, no device needed."""
    from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily

    with torch._guards.tracing(None), unset_fake_temporarily(), FakeTensorMode():
        yield


def val(node: Any) -> Optional[torch.Tensor]:
    """The fake value an FX node carries (None for non-nodes or nodes without one)."""
    if isinstance(node, torch.fx.Node):
        return node.meta.get("val")
    return None


def match_val(match: pm.Match, name: str) -> Any:
    """The fake value bound to keyword ``name`` in a match (a tensor, or a plain Python value)."""
    v = match.kwargs[name]
    return val(v) if isinstance(v, torch.fx.Node) else v


def matched_scalar_ok(match: pm.Match, name: str) -> bool:
    """True when keyword ``name`` (a ``scalar_workaround`` constant) is bound to a Python number, or is absent.
    Absent happens on torch < 2.12: ``register_replacement``'s re-check re-traces the search with the first
    match's value, which is then no placeholder and stays in the specific pattern as a literal, so the specific
    match (the one the guard sees) proved the graph holds exactly that number; torch >= 2.12 re-binds it."""
    v = match.kwargs.get(name, 0.0)
    return isinstance(v, (float, int)) and not isinstance(v, bool)


def is_static_le(size: Any, limit: int) -> bool:
    """True only when ``size <= limit`` holds for every value a symbolic size may take."""
    return bool(statically_known_true(size <= limit))
