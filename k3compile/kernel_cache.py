"""JIT-built kernels kept in memory and on disk, by kind: what ``k3compile/precompile.py`` builds ahead of the first
call, and what that call then loads.

A kind (``"cute"``: ``k3compile/kernels/cute/compile.py``) registers a :class:`Builder`; a kernel is named by its kind
and a key (a picklable tuple naming the variant). :func:`get` returns the kernel from memory, else loads it from the
kind's directory (``<directory>/<name><suffix>``), else builds it in this process and stores it there. A file is
written under a temporary name and renamed into place, so a reader sees a whole file or none, whichever process wrote
it (:func:`build_file` is what a precompile worker runs).
"""
from __future__ import annotations

import contextlib
import os
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Optional


def _no_env() -> dict:
    return {}


@dataclass(frozen=True)
class Builder:
    """How one kind of kernel is built, stored and loaded. Module-level functions only: a precompile worker process
    unpickles the builder with the job."""
    compile: Callable[[Hashable], Any]              # key -> the kernel, built in this process
    export: Callable[[Any, str, str], None]         # (kernel, file, name): writes the kernel to the file
    load: Callable[[str, str], Any]                 # (file, name) -> the kernel
    name: Callable[[Hashable], str]                 # key -> the kernel's file stem and symbol name
    directory: Callable[[], Optional[str]]          # where its files go (None: no disk cache)
    suffix: str = ".o"
    worker_env: Callable[[], dict] = _no_env        # environment a worker process building these needs
    warm_up: Optional[Callable[[], None]] = None    # what every build imports: a worker started early runs it first


@dataclass(frozen=True)
class Build:
    """A kernel a call builds at its first call (``kind``, ``key``: ``k3compile/kernel_cache.py``) and the choice it
    serves: the op, its dispatch key and the implementation, which ``OpImpls.mark_broken`` passes over if the build
    fails."""
    kind: str
    key: Hashable
    op: str
    dispatch_key: Hashable
    impl: str


_AHEAD = threading.local()


@contextlib.contextmanager
def _thread_flag(name: str):
    """Sets this thread's flag ``name`` within the block (nested blocks restore the outer value)."""
    outer = getattr(_AHEAD, name, False)
    setattr(_AHEAD, name, True)
    try:
        yield
    finally:
        setattr(_AHEAD, name, outer)


def planning_ahead():
    """Within this block (``precompile``'s planning, in this thread) a kind may take its compiler's import on trust
    (``cute``'s ``unavailable``): the builds ahead import it in the workers, and a build that fails there falls back
    with the reason; planning need not pay the import in this process."""
    return _thread_flag("on")


def is_planning_ahead() -> bool:
    return getattr(_AHEAD, "on", False)


def is_dry_running() -> bool:
    return getattr(_AHEAD, "dry", False)


def _dry_kernel(*args, **kwargs) -> None:
    """What ``get`` gives during a dry run: a kernel that does nothing (the call goes on to its next launch)."""


def dry_running():
    """Within this block (in this thread) no kernel is loaded, built or called: ``get`` gives one that does
    nothing, so that a dry call (``triton_ahead.dry_run``) goes past a CuTe kernel to the Triton launches after it
    (precompile's planning has the CuTe kernels)."""
    return _thread_flag("dry")


BUILDERS: dict[str, Builder] = {}
KIND_FOR_POOL = "cute"   # whose workers' environment other builds (triton_ahead's) share: one pool a process
# per kind, this process's kernels: loaded from disk, built here (and the seconds the builds took)
STATS: dict[str, dict] = {}
_kernels: dict = {}                   # (kind, key) -> kernel
_build_lock = threading.Lock()        # builds are not thread-safe (cute.compile)


def register(kind: str, builder: Builder) -> dict:
    """Register a kind; returns its counters (``{"loaded", "built", "build_seconds"}``)."""
    BUILDERS[kind] = builder
    return STATS.setdefault(kind, {"loaded": 0, "built": 0, "build_seconds": 0.0})


def path_of(kind: str, key: Hashable) -> Optional[str]:
    """The file a kernel is stored in, None where its kind keeps no disk cache."""
    builder = BUILDERS[kind]
    root = builder.directory()
    return os.path.join(root, builder.name(key) + builder.suffix) if root else None


def in_memory(kind: str) -> set:
    """The names of this process's kernels of a kind (loaded or built)."""
    return {BUILDERS[kind].name(key) for k, key in _kernels if k == kind}


def available(kind: str, key: Hashable) -> bool:
    """Whether the first call of this kernel would only load it: in memory or in the disk cache."""
    if (kind, key) in _kernels:
        return True
    path = path_of(kind, key)
    return path is not None and os.path.exists(path)


def get(kind: str, key: Hashable):
    """The kernel: from memory, else from the disk cache, else built here (and stored)."""
    if getattr(_AHEAD, "dry", False):
        return _dry_kernel
    fn = _kernels.get((kind, key))
    if fn is not None:
        return fn
    with _build_lock:
        fn = _kernels.get((kind, key))
        if fn is None:
            fn = _kernels[(kind, key)] = _load_or_build(kind, key)
    return fn


def _load_or_build(kind: str, key: Hashable):
    builder, stats = BUILDERS[kind], STATS[kind]
    name, path = builder.name(key), path_of(kind, key)
    if path and os.path.exists(path):
        try:
            fn = builder.load(path, name)
            stats["loaded"] += 1
            return fn
        except Exception:   # a stale or foreign file: build below and overwrite it
            pass
    start = time.perf_counter()
    fn = builder.compile(key)
    stats["built"] += 1
    stats["build_seconds"] += time.perf_counter() - start
    if path:
        try:
            _store(builder, fn, path, name)
        except Exception:
            pass   # the cache is an optimisation; the kernel is already in hand
    return fn


def _store(builder: Builder, fn: Any, path: str, name: str) -> None:
    """``fn`` exported to ``path`` through a temporary file renamed into place; the temporary file is removed
    whatever happens."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
    try:
        builder.export(fn, tmp, name)
        os.replace(tmp, path)   # atomic: another process sees the whole file or none
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def build_file(builder: Builder, key: Hashable, path: str) -> None:
    """Build the kernel and store it at ``path`` (what a precompile worker runs); raises what the build raises, and
    then leaves no file behind."""
    _store(builder, builder.compile(key), path, builder.name(key))


def clear() -> None:
    """Forget this process's kernels (the disk cache stays); for tests."""
    with _build_lock:
        _kernels.clear()
