"""A small pool of worker processes for kernel builds (``k3compile/precompile.py``): each worker is a fresh Python
process running :func:`main`, one job at a time: a module-level function and its arguments.

Fresh processes rather than ``multiprocessing``: a spawned ``multiprocessing`` child re-runs the user's ``__main__``
script (every line outside an ``if __name__ == "__main__"`` guard: a model built again in each worker), and a forked
one inherits the parent's CUDA state. This is why Inductor's own compile workers are subprocesses too.

Messages are length-prefixed pickles on the worker's stdin and on a copy of its stdout (its fd 1 then points at
stderr, so a build that prints cannot corrupt a reply). A job returns ``(ok, detail, seconds)``: ``ok`` True with the
function's result; False with the error where the function raised, ran past ``timeout`` seconds (its worker is
killed) or its worker died while running it; None where the job could not run in a worker at all (the worker did not
start, the job did not unpickle there): a fault of the workers' environment, not of the job. A killed or dead worker is
replaced by the next job: never a hang. A worker whose parent has gone ends itself.

``shared_pool`` keeps one pool per worker environment for the whole process, so that every graph a process compiles
uses the workers the first one started (and imported in): a fresh pool costs each graph the workers' start and
imports again (5.8 s for the second graph of an H200 run). A worker idle for ``K3_PRECOMPILE_IDLE`` seconds (default
120) ends, its thread starting a new one for the next job; the pools close when the process exits.
"""
from __future__ import annotations

import atexit
import os
import pickle
import queue
import struct
import subprocess
import sys
import threading
import time
from concurrent.futures import Future
from typing import Any, Callable, Optional

STARTUP_SECONDS = 300.0   # a worker that has not imported its modules by then is killed
IDLE_ENV = "K3_PRECOMPILE_IDLE"
IDLE_SECONDS = 120.0      # a worker with no job for this long ends (its memory back); the next job starts another
REAP_SECONDS = 10.0       # how long a worker's exit is waited for before it is killed


def _send_bytes(stream, data: bytes) -> None:
    stream.write(struct.pack("<Q", len(data)) + data)
    stream.flush()


def _send(stream, obj) -> None:
    _send_bytes(stream, pickle.dumps(obj))


def _read_exactly(stream, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = stream.read(n - len(data))
        if not chunk:
            raise EOFError("the stream closed")
        data += chunk
    return data


def _receive_bytes(stream) -> bytes:
    (n,) = struct.unpack("<Q", _read_exactly(stream, 8))
    return _read_exactly(stream, n)


def worker_environment(env: dict) -> dict:
    """What a worker's environment is: this process's, ``env`` added, and this process's ``sys.path``."""
    return {**os.environ, **env, "K3_BUILD_WORKER": "1",   # k3compile's own imports skipped: seconds a worker
            "PYTHONPATH": os.pathsep.join(p for p in [*sys.path, os.environ.get("PYTHONPATH")] if p)}


class _Slot:
    """What one worker thread is doing: its process, since when, and why it was killed (if it was)."""

    def __init__(self):
        self.proc: Optional[subprocess.Popen] = None
        self.phase = "idle"            # idle | starting | running
        self.since = 0.0
        self.killed = ""
        self.future: Optional[Future] = None   # the job it runs


class WorkerPool:
    """Up to ``size`` worker processes, started as jobs arrive (or ahead of them: ``prestart``), each with ``env``
    added to this process's environment and this process's ``sys.path``. ``submit`` returns a future of ``(ok, detail,
    seconds)``; ``enforce_limits`` (call it while waiting) kills a worker whose job ran past ``timeout`` seconds."""

    def __init__(self, size: int, env: dict, timeout: float, idle: Optional[float] = None):
        self.size, self.timeout, self.idle = max(1, size), timeout, idle
        self.pid = os.getpid()   # a forked child does not inherit the threads: it gets a pool of its own
        self.env = worker_environment(env)
        self._jobs: queue.Queue = queue.Queue()
        self._slots: list[_Slot] = []
        self._threads: list[threading.Thread] = []
        self._outstanding = 0
        self._lock = threading.Lock()
        self._closed = False

    @property
    def started(self) -> int:
        return len(self._threads)

    def submit(self, fn: Callable, *args: Any) -> Future:
        future: Future = Future()
        with self._lock:
            if self._closed:
                raise RuntimeError("the pool is closed")
            self._outstanding += 1
            if len(self._threads) < min(self.size, self._outstanding):
                self._add_worker(None)
        self._jobs.put((future, pickle.dumps((fn, args))))
        return future

    def prestart(self, count: int, fn: Callable, *args: Any) -> None:
        """Start up to ``count`` workers now, each running ``fn(*args)`` before its first job (the imports a build
        needs), so that they are ready when the jobs come. What ``fn`` raises is ignored: the jobs then pay for it."""
        warm_up = pickle.dumps((fn, args))
        with self._lock:
            if self._closed:
                return
            for _ in range(min(count, self.size) - len(self._threads)):
                self._add_worker(warm_up)
            # workers that ended idle: started again now (a warm-up job; one that finds its worker alive is a no-op)
            for _ in [s for s in self._slots[:count] if s.proc is None and s.phase == "idle"]:
                self._jobs.put((None, warm_up))

    def _add_worker(self, warm_up: Optional[bytes]) -> None:   # under self._lock
        slot = _Slot()
        thread = threading.Thread(target=self._serve, args=(slot, warm_up), daemon=True,
                                  name=f"k3compile-worker-{len(self._threads)}")
        self._slots.append(slot)
        self._threads.append(thread)
        thread.start()

    def enforce_limits(self) -> None:
        now = time.monotonic()
        for slot in list(self._slots):
            proc = slot.proc
            if proc is None:
                continue
            if slot.phase == "running" and now - slot.since > self.timeout:
                slot.killed = f"did not finish within {self.timeout:.0f} s (K3_PRECOMPILE_TIMEOUT): worker killed"
            elif slot.phase == "starting" and now - slot.since > max(self.timeout, STARTUP_SECONDS):
                slot.killed = f"its worker did not start within {max(self.timeout, STARTUP_SECONDS):.0f} s"
            else:
                continue
            proc.kill()

    @property
    def closed(self) -> bool:
        return self._closed

    def abandon(self, futures) -> None:
        """These jobs are no longer wanted (a compile's wait was cut short): cancelled where still queued, their
        workers killed where running; the pool serves the other jobs on."""
        futures = set(futures)
        for future in futures:
            future.cancel()   # a queued job: its worker skips it
        for slot in list(self._slots):
            proc = slot.proc
            if slot.phase == "running" and slot.future in futures and proc is not None:
                slot.killed = "its compile stopped waiting: worker killed"
                proc.kill()

    def close(self) -> None:
        """Workers end once their current job is done (stdin closed); a job still queued is cancelled."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        while True:
            try:
                future, _ = self._jobs.get_nowait()
            except queue.Empty:
                break
            if future is not None:
                future.cancel()
        for _ in self._threads:
            self._jobs.put(None)

    def shutdown(self, wait: float = 2.0) -> None:
        """``close``; workers still running a job after ``wait`` seconds are killed (the process is exiting)."""
        self.close()
        deadline = time.monotonic() + wait
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        for slot in self._slots:
            proc = slot.proc
            if proc is not None and proc.poll() is None:
                slot.killed = slot.killed or "the process exited"
                proc.kill()
        for thread in self._threads:   # each reaps its killed worker, then ends (bounded: an exit never hangs)
            thread.join(REAP_SECONDS)

    def kill(self) -> None:
        """``close``, and the workers killed now."""
        self.close()
        for slot in self._slots:
            if slot.proc is not None and slot.proc.poll() is None:
                slot.killed = slot.killed or "the pool was killed"
                slot.proc.kill()

    # ---- one thread per worker process --------------------------------------------------------------------------

    def _start(self, slot: _Slot) -> Optional[str]:
        """Start ``slot``'s process and wait until it is ready; None, or why it did not start."""
        slot.phase, slot.since, slot.killed = "starting", time.monotonic(), ""
        try:
            slot.proc = subprocess.Popen([sys.executable, "-c", "from k3compile.workers import main; main()"],
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=self.env)
            if pickle.loads(_receive_bytes(slot.proc.stdout)) != "ready":
                raise EOFError("an unexpected first message")
            return None
        except (OSError, EOFError, pickle.UnpicklingError) as e:
            code = self._reap(slot)
            return slot.killed or f"its worker did not start ({type(e).__name__}: {e}; exit code {code})"
        finally:
            slot.phase = "idle"

    @staticmethod
    def _reap(slot: _Slot) -> Optional[int]:
        """End ``slot``'s process (it was told to, died, or was killed): its exit code."""
        proc, slot.proc = slot.proc, None
        if proc is None:
            return None
        try:
            code = proc.wait(timeout=REAP_SECONDS)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = proc.wait()
        for pipe in (proc.stdin, proc.stdout):
            try:
                pipe.close()
            except OSError:
                pass
        return code

    def _serve(self, slot: _Slot, warm_up: Optional[bytes]) -> None:
        if warm_up is not None:
            self._run(slot, warm_up)
        while True:
            try:   # a live worker waits at most ``idle`` seconds for a job
                job = self._jobs.get(timeout=self.idle if slot.proc is not None else None)
            except queue.Empty:
                self._stop(slot)   # idle: its process ends; this thread starts another for the next job
                continue
            if job is None:
                break
            future, payload = job
            if future is None:   # a warm-up (``prestart``): only where this worker had ended
                if slot.proc is None:
                    self._run(slot, payload)
                continue
            if future.set_running_or_notify_cancel():
                slot.future = future
                try:
                    future.set_result(self._run(slot, payload))
                finally:
                    slot.future = None
            with self._lock:
                self._outstanding -= 1
        self._stop(slot)

    def _stop(self, slot: _Slot) -> None:
        """End ``slot``'s process: its stdin closed (it exits at its next read), then reaped."""
        if slot.proc is not None:
            try:
                slot.proc.stdin.close()
            except OSError:
                pass
            self._reap(slot)

    def _run(self, slot: _Slot, payload: bytes) -> tuple:
        if slot.proc is not None and slot.proc.poll() is not None:
            self._reap(slot)   # killed after its last job, or died idle
        why = None if slot.proc is not None else self._start(slot)
        if why is not None:
            return None, why, 0.0
        slot.phase, slot.since, slot.killed = "running", time.monotonic(), ""
        try:
            _send_bytes(slot.proc.stdin, payload)
            return pickle.loads(_receive_bytes(slot.proc.stdout))
        except (OSError, EOFError, pickle.UnpicklingError, struct.error):
            code = self._reap(slot)
            return False, slot.killed or f"its worker process died (exit code {code})", time.monotonic() - slot.since
        finally:
            slot.phase = "idle"


_SHARED: dict = {}   # (worker environment, process id) -> WorkerPool
_SHARED_LOCK = threading.Lock()


def shared_pool(size: int, env: dict, timeout: float) -> tuple[WorkerPool, bool]:
    """This process's pool for workers of environment ``env`` (created with ``size`` workers at its first use, with
    this process's environment then): ``(pool, whether it existed already)``. ``timeout`` is the latest caller's."""
    # keyed by what a build reads: the builder's environment, the K3_ settings, sys.path (not the whole environment:
    # Inductor sets variables of its own as it compiles)
    settings = {k: v for k, v in os.environ.items() if k.startswith("K3_")}
    key = (tuple(sorted(env.items())), tuple(sorted(settings.items())), tuple(sys.path), os.getpid())
    with _SHARED_LOCK:
        pool = _SHARED.get(key)
        reused = pool is not None and not pool.closed
        if not reused:
            idle = float(os.environ.get(IDLE_ENV, "") or IDLE_SECONDS)
            pool = _SHARED[key] = WorkerPool(size, env, timeout, idle=idle)
        pool.timeout = timeout
    return pool, reused


@atexit.register
def shutdown_shared() -> None:
    """The shared pools' workers end (at exit: a worker would otherwise only notice its parent gone 10 s later)."""
    with _SHARED_LOCK:
        pools = [p for key, p in _SHARED.items() if key[-1] == os.getpid()]
        _SHARED.clear()
    for pool in pools:
        pool.shutdown()


def _end_with_parent(parent: int) -> None:
    while True:
        time.sleep(10)
        if os.getppid() != parent:   # the parent died: nothing will read what this worker builds
            os._exit(1)


def main() -> None:
    """The worker: replies go to a copy of stdout; what the jobs print goes to stderr."""
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    inp = sys.stdin.buffer
    threading.Thread(target=_end_with_parent, args=(os.getppid(),), daemon=True).start()
    _send(out, "ready")
    while True:
        try:
            data = _receive_bytes(inp)
        except EOFError:
            return
        start = time.perf_counter()
        try:
            fn, args = pickle.loads(data)
        except Exception as e:   # this worker cannot run the job (a module missing here, ...)
            _send(out, (None, f"the job did not load in a worker ({type(e).__name__}: {e})", 0.0))
            continue
        try:
            reply = (True, fn(*args), time.perf_counter() - start)
        except Exception as e:   # the job's own error, reported with its key by the caller
            reply = (False, f"{type(e).__name__}: {e}", time.perf_counter() - start)
        try:
            _send(out, reply)
        except Exception as e:   # an unpicklable result
            _send(out, (False, f"the result did not pickle ({type(e).__name__}: {e})", time.perf_counter() - start))

