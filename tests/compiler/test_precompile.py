"""Building the k3 kernels a graph calls ahead of its first call (``k3compile/precompile.py``), on the CPU: the skinny
GEMM's CuTe path made runnable here (its availability predicates pass) with its builds done by
``k3compile.testing``'s fake builder, registered as the "cute" kind of ``k3compile/kernel_cache.py``. Everything else
is real: the pass, the call sites read off the rewritten graph, the dispatch's choice and configuration per call,
the worker processes, the disk cache, the first call's loads.

The model: four small-M products, each a different kernel variant (bias / residual / static weight), M = 4."""
from __future__ import annotations

import json
import os
import sys
import time

import pytest
import torch
from torch import nn

import k3compile
from k3compile import kernel_cache, testing, workers
from k3compile.kernels.cute import compile as cute_kernels
from k3compile.call_sites import stand_in
from k3compile.ops.latent_moe_tail import dispatch as tail_dispatch
from k3compile.ops.latent_moe_tail.reference import latent_moe_tail_unfused
from k3compile.ops.skinny_gemm import dispatch as gemm_dispatch
from k3compile.graph_records import GraphRecord
from k3compile.precompile import enabled, setting, should_prestart
from k3compile.testing import latent_moe_tail_inputs, rel_err

D = 64


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(D, 2 * D, bias=False)   # x is an input: the weight is not proven static
        self.down = nn.Linear(2 * D, D)             # bias + residual
        self.mix = nn.Linear(D, D, bias=False)
        self.out = nn.Linear(D, 2 * D)              # bias

    def forward(self, x):
        h = self.down(torch.relu(self.up(x))) + x
        h = torch.relu(self.mix(h)) + h
        return self.out(h)


@pytest.fixture
def fake_cute(monkeypatch, tmp_path, no_graph_caches):
    """The CuTe skinny GEMM runs on the CPU with fake kernels, built into a fresh disk cache (yields its folder)."""
    monkeypatch.setenv("K3_CUTE_CACHE_DIR", str(tmp_path))
    for dispatch in (gemm_dispatch, tail_dispatch):
        monkeypatch.setattr(dispatch, "cute_can_run_on", lambda *tensors: None)
    monkeypatch.setattr(cute_kernels, "unavailable", lambda: None)
    monkeypatch.setitem(kernel_cache.BUILDERS, cute_kernels.KIND, testing.fake_cute_builder())
    ops = (gemm_dispatch.SKINNY_GEMM, tail_dispatch.LATENT_MOE_TAIL)
    kernel_cache.clear()
    for op in ops:
        op.clear()
    torch._dynamo.reset()
    yield tmp_path / "fake"
    workers.shutdown_shared()   # the next test's workers start afresh (its environment differs anyway)
    kernel_cache.clear()
    for op in ops:
        op.clear()   # no CuTe choice (nor broken mark) outlives the patches


def _run(x, dynamic=False, more=()):
    """(model, eager outputs, compiled outputs, the first call's kernel builds and loads) for ``x`` then ``more``."""
    model = Net().to(torch.bfloat16)
    with torch.no_grad():
        ref = [model(t) for t in (x, *more)]
        k3compile.optimize(model, passes=["skinny_gemm"], precompile=True, dynamic=dynamic)
        before = dict(kernel_cache.STATS[cute_kernels.KIND])
        out = [model(t) for t in (x, *more)]
    after = kernel_cache.STATS[cute_kernels.KIND]
    return model, ref, out, {k: after[k] - before[k] for k in ("built", "loaded")}


def test_precompile_builds_exactly_the_kernels_the_first_call_loads(fake_cute):
    x = torch.randn(4, D, dtype=torch.bfloat16)
    model, ref, out, first = _run(x)
    built_ahead = {p.stem for p in fake_cute.iterdir()}
    assert first == {"built": 0, "loaded": 4}
    assert kernel_cache.in_memory(cute_kernels.KIND) == built_ahead and len(built_ahead) == 4   # no more, none missing
    assert rel_err(out[0], ref[0]) < 1e-2
    rep = k3compile.report(model)
    assert (rep.kernels_compiled, rep.kernel_cache_hits, rep.kernel_failures) == (4, 0, {})
    assert "4 compiled in" in str(rep) and "0 failed; for 4 call(s)" in str(rep)

    kernel_cache.clear()   # a new process on the same disk cache: every kernel is already built
    torch._dynamo.reset()
    model, _, _, first = _run(x)
    rep = k3compile.report(model)
    assert first == {"built": 0, "loaded": 4} and (rep.kernels_compiled, rep.kernel_cache_hits) == (0, 4)


def test_a_cold_compile_starts_the_workers_which_import_before_they_build(fake_cute, monkeypatch):
    monkeypatch.setitem(kernel_cache.BUILDERS, cute_kernels.KIND, testing.fake_cute_builder(warm_up=True))
    monkeypatch.setattr(sys.modules["k3compile.optimize"], "should_prestart", lambda devices, record: True)
    monkeypatch.setenv("K3_PRECOMPILE_WORKERS", "2")
    x = torch.randn(4, D, dtype=torch.bfloat16)
    model, ref, out, first = _run(x)
    assert first == {"built": 0, "loaded": 4} and rel_err(out[0], ref[0]) < 1e-2
    warmed = {int(p.name) for p in (fake_cute.parent / "warm").iterdir()}
    built_by = {json.loads(p.read_text())["pid"] for p in fake_cute.iterdir()}
    # every build in a worker that had imported first (the other may still be importing: the pool does not wait)
    assert built_by and built_by <= warmed
    (record,) = k3compile.report(model).precompiled
    assert (record.workers, record.compiled, record.failed) == (2, 4, {})


def test_a_second_graph_builds_in_the_workers_the_first_one_started(fake_cute, monkeypatch):
    """One pool a process: the second graph (a new M: a recompile) neither starts workers nor imports again."""
    monkeypatch.setitem(kernel_cache.BUILDERS, cute_kernels.KIND, testing.fake_cute_builder(warm_up=True))
    monkeypatch.setattr(sys.modules["k3compile.optimize"], "should_prestart", lambda devices, record: True)
    monkeypatch.setenv("K3_PRECOMPILE_WORKERS", "2")
    x4, x2 = torch.randn(4, D, dtype=torch.bfloat16), torch.randn(2, D, dtype=torch.bfloat16)
    model, ref, out, first = _run(x4, more=(x2,))
    assert first == {"built": 0, "loaded": 8} and all(rel_err(o, r) < 1e-2 for o, r in zip(out, ref))
    one, two = k3compile.report(model).precompiled
    assert (one.compiled, two.compiled, one.pool_reused, two.pool_reused) == (4, 4, False, True)
    warmed = {int(p.name) for p in (fake_cute.parent / "warm").iterdir()}
    built_by = {json.loads(p.read_text())["pid"] for p in fake_cute.iterdir()}
    assert len(warmed) <= 2 and built_by <= warmed   # no third worker, no import again


def _sleep(seconds: float) -> int:
    time.sleep(seconds)
    return os.getpid()


def test_the_pool_ends_idle_workers_drops_abandoned_jobs_and_shuts_down():
    """An idle worker ends and the next job starts another; an abandoned running job's worker is killed while the
    pool serves on; shutdown ends every worker. No wait here is bounded by a timing the test asserts."""
    pool = workers.WorkerPool(1, {}, timeout=600, idle=0.2)
    ok, first_pid, _ = pool.submit(os.getpid).result(timeout=120)
    assert ok and first_pid != os.getpid()
    deadline = time.monotonic() + 60
    while pool._slots[0].proc is not None and time.monotonic() < deadline:   # ends after 0.2 s idle
        time.sleep(0.05)
    assert pool._slots[0].proc is None
    hung = pool.submit(_sleep, 3600)
    while pool._slots[0].phase != "running" or pool._slots[0].future is not hung:
        time.sleep(0.05)
    pool.abandon([hung])
    ok, why, _ = hung.result(timeout=60)
    assert ok is False and "stopped waiting" in why
    ok, pid, _ = pool.submit(_sleep, 0).result(timeout=120)
    assert ok and pid not in (first_pid, os.getpid())
    pool.shutdown()
    assert not any(t.is_alive() for t in pool._threads) and pool._slots[0].proc is None


def test_a_mark_of_the_kernel_modules_import_spares_a_later_process_the_dsl(monkeypatch, tmp_path):
    """The CuTe availability check imports the kernel modules once an install: a process that finds the mark (left by
    a precompile worker's warm-up or an earlier run) imports nothing, nor does precompile's planning; a DSL that does
    not import leaves no mark."""
    from k3compile.kernel_module import KernelModule
    from k3compile.kernels.cute.configs import MmaConfig, WgmmaConfig

    def modules(*names):
        return {cfg: (KernelModule(name, lambda: None), "K") for cfg, name in zip((MmaConfig, WgmmaConfig), names)}

    monkeypatch.setattr(cute_kernels, "directory", lambda: str(tmp_path))
    first = modules("json", "csv")
    monkeypatch.setattr(cute_kernels, "KERNEL_MODULES", first)
    assert cute_kernels.unavailable() is None and all(m._loaded is not None for m, _ in first.values())
    later = modules("json", "csv")   # a new process: nothing imported yet
    monkeypatch.setattr(cute_kernels, "KERNEL_MODULES", later)
    assert cute_kernels.unavailable() is None and all(m._loaded is None for m, _ in later.values())
    (tmp_path / cute_kernels.IMPORTED_MARK).unlink()
    broken = modules("json", "k3compile.no_such_kernels")
    monkeypatch.setattr(cute_kernels, "KERNEL_MODULES", broken)
    with kernel_cache.planning_ahead():   # precompile's planning: the workers' builds check the import
        assert cute_kernels.unavailable() is None and all(m._loaded is None for m, _ in broken.values())
    assert "does not import" in cute_kernels.unavailable()
    assert not (tmp_path / cute_kernels.IMPORTED_MARK).exists()


def test_workers_start_with_the_compile_only_when_it_is_cold_and_on_a_gpu():
    assert should_prestart(("cuda",), None)
    assert not should_prestart(("cuda",), GraphRecord()) and not should_prestart(("cpu",), None)


def test_precompile_plans_a_symbolic_m_at_the_buckets_and_the_example(fake_cute):
    x, x8 = torch.randn(3, D, dtype=torch.bfloat16), torch.randn(8, D, dtype=torch.bfloat16)
    model, ref, out, first = _run(x, dynamic=True, more=(x8,))
    ms = sorted({int(p.stem.split("_m")[1].split("_")[0]) for p in fake_cute.iterdir()})
    assert ms == [1, 2, 3, 4, 8, 16] and len(list(fake_cute.iterdir())) == 6 * 4
    assert first == {"built": 0, "loaded": 8}   # M = 3 (the example) and M = 8 (a bucket): loads only
    assert all(rel_err(o, r) < 1e-2 for o, r in zip(out, ref))
    (record,) = k3compile.report(model).precompiled
    assert record.symbolic == record.calls == 6 * 4


def test_a_broken_build_is_reported_with_its_key_and_its_calls_fall_back(fake_cute, monkeypatch):
    """A compiler error, a file torn half way through its write, a build that never ends: each reported with the
    kernel's name, its calls on the next implementation (the Triton kernel, interpreted) with the reason, no file
    left for it in the cache (nor a temporary one), no hang."""
    monkeypatch.setenv(testing.FAKE_FAIL_ENV, "_b1_r0_")
    monkeypatch.setenv(testing.FAKE_TORN_ENV, "_b0_r0_s1")
    monkeypatch.setenv(testing.FAKE_HANG_ENV, "_b1_r1_")
    # the hang waits this out; a good fake build takes a fraction of it, but under a loaded 2-core host (the suite's
    # two workers beside other work) 5 s killed good builds too
    monkeypatch.setenv("K3_PRECOMPILE_TIMEOUT", "15")
    monkeypatch.setenv("K3_PRECOMPILE_WORKERS", "2")
    model, ref, out, first = _run(torch.randn(4, D, dtype=torch.bfloat16))
    rep = k3compile.report(model)
    errors = {name.split("_l")[-1]: why for name, why in rep.kernel_failures.items()}
    assert errors.keys() == {"1_b1_r0_s1", "1_b0_r0_s1", "2_b1_r1_s1"}, rep.kernel_failures
    assert "RuntimeError: simulated compiler error" in errors["1_b1_r0_s1"]
    assert "half way" in errors["1_b0_r0_s1"]
    assert "did not finish within 15 s" in errors["2_b1_r1_s1"]
    assert all(why.startswith("k3::skinny_gemm (cute): ") for why in errors.values())
    assert [p.name for p in fake_cute.iterdir()] == ["k3_skinny_bfloat16_m4_rg1_wn1_wk1_u4_e_l1_b0_r0_s0.json"]
    fell_back = [c for c in rep.choices if c.impl != "cute"]
    assert len(fell_back) == 3 and all(c.impl == "triton" and "failed to build ahead" in c.reason for c in fell_back)
    assert {n for c in fell_back for n in rep.kernel_failures if n in c.reason} == rep.kernel_failures.keys()
    assert first == {"built": 0, "loaded": 1}
    assert rel_err(out[0], ref[0]) < 1e-2
    assert "failed: k3_skinny_bfloat16_m4_" in str(rep)


def test_precompile_is_on_by_default(monkeypatch):
    monkeypatch.delenv("K3_PRECOMPILE", raising=False)
    assert setting(None) is None and enabled(None)[0] and "K3_PRECOMPILE=0" in enabled(None)[1]
    assert not enabled(False)[0] and enabled(True)[0]
    monkeypatch.setenv("K3_PRECOMPILE", "0")
    assert setting(None) is False and setting(True) is True and not enabled(setting(None))[0]
    monkeypatch.setenv("K3_PRECOMPILE", "1")
    assert setting(None) is True and setting(False) is False and enabled(setting(None))[0]


def _stand_in(t: torch.Tensor):
    return stand_in(t.shape, t.dtype, t.device, t.stride(), t.storage_offset())


@pytest.mark.parametrize("path", ["cute", "split"])
def test_the_latent_moe_tail_plans_what_its_call_builds(fake_cute, path):
    """The fused CuTe tail (forced), and the split path's GEMM (the CuTe skinny GEMM on the norm's output, its weight
    static; a failure there is the skinny GEMM's to fall back from): the kernel planned on stand-ins is the one the
    call then builds."""
    args = latent_moe_tail_inputs(4, 64, 96, torch.bfloat16)
    eps, backend = 1e-6, "cute" if path == "cute" else "auto"
    if path == "split":   # on the CPU auto passes the CuTe tail over (unmeasured); the Triton tail's kernel "broke"
        key = tail_dispatch.key(*args, tail_dispatch.MAX_BLOCK_M)
        tail_dispatch.LATENT_MOE_TAIL.mark_broken(key, "triton", "its kernel failed to build")
    planned = tail_dispatch.kernels(*map(_stand_in, args), eps, backend)
    assert [(b.op, b.impl) for b in planned] == [("latent_moe_tail" if path == "cute" else "skinny_gemm", "cute")]
    out = torch.ops.k3.latent_moe_tail(*args, eps, backend)
    (choice,) = tail_dispatch.LATENT_MOE_TAIL.choices()
    assert choice.impl == ("cute" if path == "cute" else "aten")
    names = {kernel_cache.BUILDERS[b.kind].name(b.key) for b in planned}
    assert kernel_cache.in_memory(cute_kernels.KIND) == names and len(names) == 1
    assert ("_norm" in next(iter(names))) == (path == "cute")
    assert rel_err(out, latent_moe_tail_unfused(*args, eps)) < 2e-2
