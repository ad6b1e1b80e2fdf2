"""The dispatch decides as before the tables became data: every (op, dtype, M, N, K, static weight) the old tables
and heuristics could see, on a simulated H200 (132 SMs, CuTe DSL importable), another sm_90 GPU (114 SMs) and the
CPU (the Triton interpreter), under ``auto`` and the forced ``cute`` / ``triton`` backends: which implementation
runs and its configuration's tag.

``data/dispatch_decisions_3eb5bb7.json.xz`` holds the decisions of commit 3eb5bb7 (the last with the tables in
Python), written by ``data/freeze_dispatch_decisions.py``. Two changes are intended: a forced backend never takes
the latent-MoE tail's split path (it is OpImpls' ``aten``, which only ``auto`` yields to), so where the old dispatch
ran the split path under a forced backend the fused Triton tail runs now; and where the CuTe skinny GEMM ran an
unlisted static weight of at most two row tiles over a long K on the mma.sync heuristic, it takes
``cute_config.few_rows_heuristic`` now (measured faster: ``docs/tuning/skinny_gemm.md``); and the H200 table lists
Triton configurations for the router's 896 x 7168 (measured in the decode step's chain, where the fp32-output
product runs: ``docs/tuning/moe_route.md`` run 3), which a forced ``triton`` runs there instead of the heuristic's.
"""
from __future__ import annotations

import dataclasses
import json
import lzma
import os

import pytest
import torch

from k3compile import backends
from k3compile.ops.latent_moe_tail import dispatch as tail
from k3compile.ops.skinny_gemm import cute_config, dispatch as gemm

FROZEN = os.path.join(os.path.dirname(__file__), "data", "dispatch_decisions_3eb5bb7.json.xz")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
SMS = {"h200": 132, "sm114": 114, "cpu": 0}
ROUTER = (896, 7168)


class FakeTensor:
    """What the predicates read of a contiguous, 16-byte aligned tensor (no memory behind it)."""

    def __init__(self, shape, dtype, device):
        self.shape, self.dtype, self.device = torch.Size(shape), dtype, torch.device(device)
        strides, acc = [], 1
        for s in reversed(shape):
            strides.append(acc)
            acc *= max(s, 1)
        self._stride = tuple(reversed(strides))

    def dim(self):
        return len(self.shape)

    def stride(self, i=None):
        return self._stride if i is None else self._stride[i]

    def data_ptr(self):
        return 0

    def element_size(self):
        return torch.empty((), dtype=self.dtype).element_size()


def _simulate(monkeypatch, kind):
    """Make the dispatch see ``kind``: CUDA tensors on an sm_90 GPU of that many SMs with CuTe DSL, or the CPU."""
    device = "cpu" if kind == "cpu" else "cuda"
    ok, no = (lambda *a, **k: None), (lambda *a, **k: "not here")
    for impls in (gemm.SKINNY_GEMM, tail.LATENT_MOE_TAIL):
        monkeypatch.setattr(impls, "cute", dataclasses.replace(impls.cute, available=no if kind == "cpu" else ok))
        monkeypatch.setattr(impls, "triton", dataclasses.replace(impls.triton, available=ok))
    gemm_table, tail_table = gemm.table_for("NVIDIA H200"), tail.table_for("NVIDIA H200")
    monkeypatch.setattr(gemm, "_cuda_gpu", lambda index: gemm.Gpu(gemm_table, SMS[kind]))
    monkeypatch.setattr(tail, "_cuda_table", lambda index: tail_table)
    monkeypatch.setattr(tail, "sm90_nvidia", lambda d: d.type == "cuda")
    return device, gemm_table, tail_table


def _decide(impls, backend, args):
    try:
        impl, _ = impls.decide(backend, args)
    except backends.BackendUnavailableError:
        return "raises"
    return impl


def gemm_decision(backend, m, n, k, dtype, static, device, gpu, m_limit=16):
    a, w, r = FakeTensor((m, k), dtype, device), FakeTensor((n, k), dtype, device), FakeTensor((m, n), dtype, device)
    if m > m_limit:
        return "aten:"
    impl = _decide(gemm.SKINNY_GEMM, backend, (a, w, None, r))
    if impl == "cute":
        return "cute:" + gemm.cute_config_for(dtype, m, n, k, static, gpu.table).tag()
    if impl == "triton":
        return "triton:" + gemm.triton_config_for(dtype, m, n, k, gpu).tag()
    return impl + ":"


def tail_decision(backend, m, d, l, dtype, static, device, gpu, tail_table, limit=16):
    lat, sh = FakeTensor((m, l), dtype, device), FakeTensor((m, d), dtype, device)
    g, w = FakeTensor((l,), dtype, device), FakeTensor((d, l), dtype, device)
    impl = _decide(tail.LATENT_MOE_TAIL, backend, (lat, sh, g, w, 1e-5, limit))
    table = tail_table if device == "cuda" else None
    if impl == "cute":
        return "cute:" + tail.cute_config_for(dtype, m, d, l, static, table, gpu.table).tag()
    if impl == "triton":
        return "triton:" + tail.triton_config_for(dtype, m, d, l, static, table, gpu.sms).tag()
    if impl == "aten":   # the split path: the up-projection as the skinny GEMM's auto would run it, static weight
        return "split:" + gemm_decision("auto", m, d, l, dtype, True, device, gpu, m_limit=limit)
    return impl + ":"


@pytest.fixture(scope="module")
def frozen():
    with lzma.open(FROZEN, "rt") as f:
        return json.load(f)


@pytest.mark.parametrize("kind", list(SMS))
def test_dispatch_decides_as_the_python_tables_did(monkeypatch, frozen, kind):
    device, _, tail_table = _simulate(monkeypatch, kind)
    gpu = gemm.gpu_of(torch.device(device))
    changed, checked = [], 0
    for record, old in frozen.items():
        where, op, dt, m, n, k, static = record.split()
        if where != kind:
            continue
        m, n, k, static, dtype = int(m[1:]), int(n[1:]), int(k[1:]), static == "s1", DTYPES[dt]
        for part in old.split():
            backend, want = part.split("=", 1)
            if op == "skinny_gemm":
                got = gemm_decision(backend, m, n, k, dtype, static, device, gpu)
            else:
                got = tail_decision(backend, m, n, k, dtype, static, device, gpu, tail_table)
            checked += 1
            if backend != "auto" and want.startswith("split:") and got.startswith("triton:"):
                changed.append(record)   # the first intended change (module docstring)
                continue
            few = cute_config.few_rows_heuristic(m, n, k) if op == "skinny_gemm" and static else None
            if few is not None and want.startswith("cute:rg") and got == "cute:" + few.tag():
                changed.append(record)   # the second
                continue
            listed = gpu.table.get(gemm._dtype(dtype), m, n, k, False) \
                if kind == "h200" and (n, k) == ROUTER and m <= 16 else None
            if listed is not None and want.startswith("triton:") and got == "triton:" + listed.configs["triton"].tag():
                changed.append(record)   # the third
                continue
            assert got == want, f"{record} backend={backend}: now {got}, was {want}"
    assert checked > 1000
    assert all(" latent_moe_tail " in r or " skinny_gemm " in r for r in changed)
