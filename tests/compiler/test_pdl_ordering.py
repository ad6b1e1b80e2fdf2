"""What the static-weight proof and Inductor's PDL codegen take of the GPU (``k3compile/static_weights.py``, step 1),
checked on an sm_90+ GPU with three Triton kernels launched with PDL in one stream:

- a writer that waits, lets the next kernel launch at once, spins ~``SPIN_US`` and then sets a flag;
- a fill that loads nothing, never waits and never triggers (Inductor's (F) kernel);
- a reader of the flag.

(P), which the proof needs: a wait returns only once every earlier kernel has completed, the writer two kernels
back included (reader waits, then reads). Inductor's own PDL codegen needs more: its next kernel reads, before
its wait, what the kernel before the fill wrote, so the fill must not let it start before the writer completes
(reader reads, then waits). A control without the fill shows that the reader does start early.

On an H200 (torch 2.11, Triton 3.6) (P) holds and the second does not: every one of the reads before the wait saw
the flag unset. That is why ``optimize(inductor_pdl=...)`` is off by default (``k3compile/inductor_pdl.py``); the
last test pins the race down, so that a GPU or driver on which it passes says the default may be revisited.
"""
from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait, globaltimer  # noqa: E402

pytestmark = pytest.mark.gpu

SPIN_US = 200
TRIALS = 64


@triton.jit
def _writer(flags, i, SPIN_NS: tl.constexpr):
    gdc_wait()
    gdc_launch_dependents()   # the next kernel may launch now
    start = globaltimer()
    while globaltimer() - start < SPIN_NS:
        pass
    tl.store(flags + i, 1)


@triton.jit
def _fill(out):   # loads nothing, never waits, triggers by exiting
    tl.store(out + tl.arange(0, 16), tl.zeros([16], tl.int32))


@triton.jit
def _reader(flags, seen, i, WAIT_FIRST: tl.constexpr):
    if WAIT_FIRST:
        gdc_wait()
        v = tl.load(flags + i, volatile=True)
    else:
        v = tl.load(flags + i, volatile=True)
        gdc_wait()
    tl.store(seen + i, v)


def _stale_reads(with_fill: bool, wait_first: bool, inductor_pdl: bool = True, reader_pdl: bool = True) -> int:
    """Of ``TRIALS`` reads of a flag the writer sets, those that saw it unset. ``inductor_pdl``: the writer and the
    fill (Inductor's kernels) launched with PDL, else launched plain, their waits no-ops and their triggers kept
    (``inductor_pdl="trigger"``); ``reader_pdl``: the reader launched with PDL."""
    flags = torch.zeros(TRIALS, dtype=torch.int32, device="cuda")
    seen = torch.full((TRIALS,), -1, dtype=torch.int32, device="cuda")
    scratch = torch.empty(16, dtype=torch.int32, device="cuda")
    for i in range(TRIALS):
        _writer[(1,)](flags, i, SPIN_NS=SPIN_US * 1000, launch_pdl=inductor_pdl)
        if with_fill:
            _fill[(1,)](scratch, launch_pdl=inductor_pdl)
        _reader[(1,)](flags, seen, i, WAIT_FIRST=wait_first, launch_pdl=reader_pdl)
    torch.cuda.synchronize()
    assert bool((seen >= 0).all())
    return int((seen == 0).sum())


@pytest.fixture(scope="module")
def sm90():
    if torch.cuda.get_device_capability()[0] < 9 or torch.version.hip:
        pytest.skip("PDL needs an NVIDIA GPU of compute capability 9.0+")


def test_reader_starts_early_without_the_fill(sm90):
    """The control: reading before the wait, right after the writer triggered, sees the flag unset."""
    assert _stale_reads(with_fill=False, wait_first=False) > 0


def test_wait_covers_the_kernel_before_a_fill(sm90):
    """(P): the reader's wait, after a fill that never waited, still waits for the writer."""
    assert _stale_reads(with_fill=True, wait_first=True) == 0


def test_a_fill_lets_the_next_kernel_start_before_the_writer_completes(sm90):
    """Inductor's order (read, then wait) after a fill is unsafe: the fill's exit does not wait for the writer, so
    the reader sees the flag unset (64 of 64 on an H200). Should this fail, the fill holds the reader back on this
    GPU, and Inductor's PDL codegen (``inductor_pdl``, off by default for this race) may be safe here."""
    assert _stale_reads(with_fill=True, wait_first=False) > 0


@pytest.mark.parametrize("with_fill", [False, True], ids=["writer", "writer-fill"])
def test_trigger_only_inductor_kernels_keep_order(sm90, with_fill):
    """``inductor_pdl="trigger"``: Inductor's kernels launched plain (their trigger kept). An Inductor kernel behind
    them that reads before its wait (launched plain too) starts after they complete; a k3 kernel behind them
    launched with PDL waits for them before it reads."""
    assert _stale_reads(with_fill, wait_first=False, inductor_pdl=False, reader_pdl=False) == 0
    assert _stale_reads(with_fill, wait_first=True, inductor_pdl=False, reader_pdl=True) == 0

