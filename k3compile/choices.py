"""Which implementation ran for which key, and how long its first call took: the record of each op's choices
(``backends.OpImpls`` keeps the process's), and of each model ``optimize`` compiled (``report`` prints it)."""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Optional

log = logging.getLogger("k3compile")


@dataclass
class Choice:
    op: str
    backend: str       # what the user asked for
    impl: str          # what runs
    reason: str        # why (the chain of fallbacks, or "preferred")
    key: Hashable = None
    calls: int = 0
    first_call_seconds: Optional[float] = None   # host time of the key's first call (its kernel builds)


# The choice records of the model whose compiled call is running (``optimize`` sets it around each call).
_MODEL_CHOICES: contextvars.ContextVar[Optional[dict]] = contextvars.ContextVar("k3compile_choices", default=None)


@contextlib.contextmanager
def recording_choices(into: dict):
    """Within this block every dispatch is also recorded in ``into`` ((op, backend, key...) -> Choice)."""
    token = _MODEL_CHOICES.set(into)
    try:
        yield
    finally:
        _MODEL_CHOICES.reset(token)


def recorded_into(into: dict, call: Callable) -> Callable:
    """``call`` with every dispatch it makes also recorded in ``into`` (``recording_choices``)."""
    @functools.wraps(call)
    def recorded(*args, **kwargs):
        with recording_choices(into):
            return call(*args, **kwargs)
    return recorded


def record_for_model(ck: tuple, choice: "Choice") -> Optional["Choice"]:
    """``choice`` counted in the running model's record (a copy of it there), if a model's call is running."""
    into = _MODEL_CHOICES.get()
    if into is None:
        return None
    mine = into.get(ck)
    if mine is None:
        mine = into.setdefault(ck, dataclasses.replace(choice, calls=0))
    mine.calls += 1
    return mine


BUILD_LOG_SECONDS = 1.0   # a kernel's first call (its JIT build, unless cached on disk) logged above this


def logging_a_slow_build(fn: Callable[..., Any], choice: "Choice", mine: Optional["Choice"] = None
                         ) -> Callable[..., Any]:
    """``fn`` for a key's first call, which builds the kernels it runs (Triton, CuTe DSL; the latent-MoE tail's
    fallback builds two): its host time kept in ``first_call_seconds`` (of the process's choice and of the model's,
    ``mine``; ``report`` sums them), logged where it takes long, so a slow first step is not silent. Host time: the
    build blocks the host, the kernel itself runs on."""
    def first_call(*args, **kwargs):
        start = time.perf_counter()
        out = fn(*args, **kwargs)
        seconds = time.perf_counter() - start
        for c in (choice, mine):
            if c is not None:
                c.first_call_seconds = seconds
        if seconds > BUILD_LOG_SECONDS:
            log.info("k3compile: k3::%s built its %s kernel for %s in %.1f s (first call; cached afterwards)",
                     choice.op, choice.impl, choice.key, seconds)
        return out
    return first_call
