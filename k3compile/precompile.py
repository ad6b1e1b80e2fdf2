"""Building the k3 kernels a compiled graph calls before its first call, in worker processes, while Inductor compiles.

1. After our passes have rewritten a graph, ``call_sites.call_sites`` (run by ``passes.K3PostGradPass``) lists the
   calls of k3 ops that JIT-build kernels at their first call, at concrete sizes (a symbolic M at the tables' M
   buckets and the example's value); the list is kept in the graph's record, so a warm start (Inductor's cache hit:
   no pass runs) plans from it.
2. ``Batch`` (one per graph ``optimize`` compiles) asks each op which kernels those calls will build
   (``call_sites.plan``: the dispatch's own decision and configuration; a kernel compiler's import taken on trust,
   ``kernel_cache.planning_ahead``) and hands those the disk cache lacks to the process's ``workers.WorkerPool``
   (``workers.shared_pool``: every graph of a process builds in the same workers), which builds them into the cache
   (``kernel_cache.build_file``: a temporary file renamed into place). Inductor meanwhile lowers the graph and
   compiles its own kernels; ``optimize`` waits for the builds before the graph first runs, so that its first call
   only loads.
3. A kernel whose build fails (or runs past ``K3_PRECOMPILE_TIMEOUT`` seconds, default 600; or whose worker dies) is
   logged and reported with its name, which spells its key, and its error; its op then passes over that
   implementation for the calls that need it (``OpImpls.mark_broken``: the reason shows in the report's kernel
   choices) and the kernels of the implementation that runs instead are planned in turn. A kernel the workers could
   not even attempt (a worker that does not start) is left to its first call, as without this, and reported so.

The Triton kernels our ops launch are built ahead too (``triton_ahead.py``: each call dry-run on storage-less tensors,
its launches captured as Triton's exact compile requests, compiled with their launchers by the same workers into
Triton's disk cache; ``K3_PRECOMPILE_TRITON=0`` leaves them to their first calls). Triton specialises a compiled
kernel on its launch arguments (16-byte alignment of every pointer, divisibility by 16 and equality to 1 of every
integer, the constexprs each launcher derives), so only the launcher's own request serves the first call. Triton
keeps what it compiles on disk, so a warm start does not compile them again; Inductor's own Triton kernels are built
by Inductor's compile workers.

The workers start as the graph's compile starts (``Batch.prestart``, where no record of the graph is on disk: a cold
compile) and import what a build needs (``Builder.warm_up``) while AOTAutograd, Inductor and our passes run: a fresh
worker's imports of CuTe DSL cost more than a build, so workers started at the first build made a compile slower.
They stay for the process's next graph (ending after ``K3_PRECOMPILE_IDLE`` idle seconds, and at exit).

On by default (``enabled``; off with ``optimize(precompile=False)`` or ``K3_PRECOMPILE=0``, and by default with
``regions=True``); it builds for graphs on an NVIDIA GPU with CuTe DSL installed, under backend "auto" or "cute",
with the CuTe disk cache on. What it saves and what was tried: ``docs/tuning/compile_time.md``.
``K3_PRECOMPILE_WORKERS`` sets the number of worker processes (default: half the CPU cores, shared among the
``LOCAL_WORLD_SIZE`` ranks of a host, at most 16).
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass, field
from typing import Optional

from . import kernel_cache, triton_ahead
from .backends import REGISTRY
from .call_sites import plan
from .kernel_cache import Build
from .workers import WorkerPool, shared_pool

log = logging.getLogger("k3compile")

ENV, TIMEOUT_ENV, WORKERS_ENV = "K3_PRECOMPILE", "K3_PRECOMPILE_TIMEOUT", "K3_PRECOMPILE_WORKERS"
MAX_ROUNDS = 4   # planning rounds of a batch: the first, then one per fallback after a failed build


# --------------------------------------------------------------------------------------------------
# when

def setting(precompile: Optional[bool]) -> Optional[bool]:
    """``optimize(precompile=...)``, else ``K3_PRECOMPILE`` ("1" / "0"), else None (decided per graph)."""
    if precompile is not None:
        return bool(precompile)
    env = os.environ.get(ENV, "")
    return None if env == "" else env not in ("0", "false", "no")


def enabled(choice: Optional[bool]) -> tuple[bool, str]:
    """Whether to build a graph's kernels ahead (``choice``: ``setting``'s), and why. On by default, with compile
    regions too: a graph's region bodies compile within its compile, into its batch, and every batch of a process
    builds in the one pool (``workers.shared_pool``)."""
    if choice is False:
        return False, "off: precompile=False (or K3_PRECOMPILE=0)"
    return True, "precompile=True" if choice else "on by default (precompile=False or K3_PRECOMPILE=0 turns it off)"


# --------------------------------------------------------------------------------------------------
# building

@dataclass
class PrecompileRecord:
    """What building ahead did for one compiled graph (``report`` sums them)."""
    on: bool = False
    why: str = ""                  # "on", or why not
    calls: int = 0                 # distinct k3 op calls planned (a symbolic call once per value planned)
    symbolic: int = 0              # of which at planned values of a symbolic size
    kernels: int = 0               # distinct kernels those calls build
    cached: int = 0                # of which already built: in this process or in the disk cache
    compiled: int = 0              # built ahead of the first call
    failed: dict = field(default_factory=dict)      # kernel name -> "k3::op (impl): error"
    unplanned: dict = field(default_factory=dict)   # why a call or kernel was not planned -> how many
    build_seconds: float = 0.0     # the builds' own time, summed over the workers
    wall_seconds: float = 0.0      # from the first build handed to a worker to the last one done
    plan_seconds: float = 0.0      # planning, in this process
    plan_in_pass_seconds: float = 0.0   # of which inside Inductor's compile (our pass's call)
    waited_seconds: float = 0.0    # waiting for builds after Inductor finished: what it added to the compile
    workers: int = 0               # worker processes of the pool it used
    pool_reused: bool = False      # the pool an earlier graph of this process had started (its workers imported)


_ACTIVE = threading.local()


def found(sites: list[dict], graph=None) -> None:
    """Our pass's call: the batch ``optimize`` runs in this thread (if any) starts building these calls' kernels and
    the Triton kernels of ``graph``'s k3 calls (``triton_ahead.py``)."""
    batch = getattr(_ACTIVE, "batch", None)
    if batch is not None:
        batch.submit(sites, in_pass=True)
        if graph is not None and triton_ahead.enabled():
            batch.submit_triton(graph)


class Batch:
    """The kernels of one graph ``optimize`` compiles: planned as our pass finds the calls (``active``) or from the
    stored list (``submit``), built by worker processes, waited for by ``finish`` (which returns the record)."""

    def __init__(self, on: bool, why: str):
        self.record = PrecompileRecord(on=on, why=why)
        self._pool: Optional[WorkerPool] = None
        self._futures: dict[Future, tuple] = {}        # -> (kind, key)
        self._owners: dict[tuple, list[Build]] = {}     # (kind, key) -> the choices it serves
        self._sites_of: dict[tuple, list[dict]] = {}    # (kind, key) -> the calls that need it
        self._seen_sites: set = set()
        self._first_submit: Optional[float] = None
        self._last_done: Optional[float] = None

    @contextlib.contextmanager
    def active(self):
        """Within this block our pass hands this batch the calls it finds (``found``), in this thread."""
        outer = getattr(_ACTIVE, "batch", None)
        _ACTIVE.batch = self if self.record.on else None
        try:
            yield self
        finally:
            _ACTIVE.batch = outer

    def submit(self, sites: list[dict], in_pass: bool = False) -> None:
        """Plan these calls and start building what they need; never raises (a compile does not fail for this)."""
        if not self.record.on or not sites:
            return
        start = time.perf_counter()
        try:
            self._submit(sites)
        except Exception as e:   # pragma: no cover - a bug of ours: the kernels then build at their first call
            self._unplanned(f"building ahead failed ({type(e).__name__}: {e})")
            log.warning("k3compile: building kernels ahead failed (%s: %s); they build at their first call",
                        type(e).__name__, e)
        seconds = time.perf_counter() - start
        self.record.plan_seconds += seconds
        self.record.plan_in_pass_seconds += seconds if in_pass else 0.0

    def _submit(self, sites: list[dict]) -> None:
        for site in sites:
            text = json.dumps(site, sort_keys=True)
            if text in self._seen_sites:
                continue
            self._seen_sites.add(text)
            if "unplanned" in site:
                self._unplanned(f"k3::{site['op']}: {site['unplanned']}")
                continue
            self.record.calls += 1
            self.record.symbolic += bool(site.get("symbols"))
            self._plan(site)

    def _unplanned(self, why: str) -> None:
        self.record.unplanned[why] = self.record.unplanned.get(why, 0) + 1

    def _plan(self, site: dict) -> None:
        try:
            with kernel_cache.planning_ahead():   # the workers check the kernels' compiler imports, not this process
                builds = plan(site)
        except Exception as e:
            self._unplanned(f"k3::{site['op']}: planning raised {type(e).__name__}: {e}")
            return
        for b in builds:
            kk = (b.kind, b.key)
            self._sites_of.setdefault(kk, []).append(site)
            owners = self._owners.setdefault(kk, [])
            if owners:
                owners.append(b)
                continue
            owners.append(b)
            self.record.kernels += 1
            if kernel_cache.available(b.kind, b.key):
                self.record.cached += 1
                continue
            path = kernel_cache.path_of(b.kind, b.key)
            if path is None:
                self._unplanned(f"{b.kind} kernels: no disk cache to build into")
                continue
            pool = self._pool_for(b.kind)
            if self._first_submit is None:
                self._first_submit = time.perf_counter()
            self._futures[pool.submit(kernel_cache.build_file, kernel_cache.BUILDERS[b.kind], b.key, path)] = kk

    def submit_triton(self, graph) -> None:
        """Dry-run the graph's k3 calls of Triton-launching ops on the GPU's metadata (``triton_ahead.dry_run``) and
        hand each Triton compile they ask for to the workers; never raises."""
        if not self.record.on:
            return
        start = time.perf_counter()
        try:
            from .call_sites import call_sites

            sites = [s for s in call_sites(graph, triton_ahead.OPS) if _on_cuda(s)]
            requests, skipped = triton_ahead.dry_run(sites)
            for why, n in skipped.items():
                self.record.unplanned[f"triton kernels: {why}"] = n
            pool = self._pool_for(kernel_cache.KIND_FOR_POOL if kernel_cache.KIND_FOR_POOL in kernel_cache.BUILDERS
                                  else next(iter(kernel_cache.BUILDERS)))
            for request in requests:
                self.record.kernels += 1
                if self._first_submit is None:
                    self._first_submit = time.perf_counter()
                self._futures[pool.submit(triton_ahead.build, *request)] = ("triton", request[1])
        except Exception as e:   # a bug of ours: the Triton kernels build at their first call, as without this
            self._unplanned(f"triton kernels: building ahead failed ({type(e).__name__}: {e})")
        seconds = time.perf_counter() - start
        self.record.plan_seconds += seconds
        self.record.plan_in_pass_seconds += seconds

    def _pool_for(self, kind: str) -> WorkerPool:
        if self._pool is None:   # the process's pool for these workers: the graphs of a process share it
            timeout = float(os.environ.get(TIMEOUT_ENV, "") or 600)
            self._pool, self.record.pool_reused = shared_pool(_workers(), kernel_cache.BUILDERS[kind].worker_env(),
                                                              timeout)
        return self._pool

    def prestart(self) -> None:
        """Start the workers now, each importing what a build needs, so that they are ready when our pass finds the
        graph's calls (the first kind of kernel whose builder names its imports: one pool a batch)."""
        if not self.record.on:
            return
        for kind, builder in kernel_cache.BUILDERS.items():
            if builder.warm_up is not None and builder.directory() is not None:
                self._pool_for(kind).prestart(_workers(), builder.warm_up)
                return

    def finish(self) -> PrecompileRecord:
        """Wait for every build (a failed one re-plans the calls that needed it); the pool stays for the process's
        next graph. Never raises: what is not built by then builds at its first call."""
        start = time.perf_counter()
        try:
            for _ in range(MAX_ROUNDS):
                failed = self._wait()
                if not failed:
                    break
                for kk in failed:
                    for site in self._sites_of.get(kk, []):
                        self._plan(site)
        except Exception as e:   # pragma: no cover - a bug of ours
            self._unplanned(f"building ahead failed ({type(e).__name__}: {e})")
            log.warning("k3compile: building kernels ahead failed (%s: %s); the rest build at their first call",
                        type(e).__name__, e)
        finally:
            self.close()
        r = self.record
        r.waited_seconds += time.perf_counter() - start
        if self._first_submit is not None:
            r.wall_seconds = (self._last_done or time.perf_counter()) - self._first_submit
        if self._pool is not None:
            r.workers = self._pool.started
        if r.compiled or r.failed:
            log.info("k3compile: %d k3 kernel(s) built ahead of the first call in %d worker process(es): %.1f s of "
                     "build time, %.1f s wall, %.1f s of it after Inductor finished; %d already built%s", r.compiled,
                     r.workers, r.build_seconds, r.wall_seconds, r.waited_seconds, r.cached,
                     f"; {len(r.failed)} failed" if r.failed else "")
        return r

    def _wait(self) -> list[tuple]:
        failed = []
        while self._futures:
            done, _ = wait(list(self._futures), timeout=0.5, return_when=FIRST_COMPLETED)
            self._pool.enforce_limits()
            for future in done:
                kk = self._futures.pop(future)
                ok, detail, seconds = future.result() if not future.cancelled() else (False, "cancelled", 0.0)
                self._last_done = time.perf_counter()
                self.record.build_seconds += seconds
                if ok:
                    self.record.compiled += 1
                elif ok is None or kk[0] == "triton":   # built at its first call, as without the workers
                    self._unplanned(f"{kk[0]} kernels: {kk[1] + ': ' if kk[0] == 'triton' else ''}{detail}")
                else:
                    self._fail(kk, detail)
                    failed.append(kk)
        return failed

    def _fail(self, kk: tuple, error: str) -> None:
        kind, key = kk
        name = kernel_cache.BUILDERS[kind].name(key)
        owners = self._owners[kk]
        where = ", ".join(sorted({f"k3::{b.op} ({b.impl})" for b in owners}))
        self.record.failed[name] = f"{where}: {error}"
        for b in owners:
            REGISTRY[b.op].mark_broken(b.dispatch_key, b.impl,
                                       f"its kernel {name} failed to build ahead of the first call ({error})")
        log.warning("k3compile: kernel %s of %s failed to build: %s; those calls run their next implementation "
                    "(k3compile.report(model) names it)", name, where, error)

    def close(self) -> None:
        """Builds of this batch still queued or running (an error cut the wait short) are dropped, their workers
        killed; the shared pool serves the process's other graphs on."""
        if self._pool is not None and self._futures:
            self._pool.abandon(list(self._futures))
            self._futures.clear()


def _on_cuda(site: dict) -> bool:
    args = site.get("args", {}).values()
    return any(isinstance(v, dict) and str(v.get("device", "")).startswith("cuda") for v in args)


def should_prestart(devices, stored_record) -> bool:
    """Start the workers with the compile: a graph on an NVIDIA GPU (where the CuTe kernels build) compiled cold (no
    record of it on disk: with one, Inductor's cache will most likely serve it and its kernels are built)."""
    import torch

    return "cuda" in devices and torch.version.hip is None and stored_record is None


def _workers() -> int:
    env = os.environ.get(WORKERS_ENV, "")
    if env:
        return max(1, int(env))
    ranks = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "") or 1))
    return max(1, min(16, (os.cpu_count() or 2) // 2 // ranks))
