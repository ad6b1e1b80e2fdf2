"""k3::moe_experts' decode form with more programs in flight (``MoeConfig.split_l``: gate/up over slices of L, the
last slice to arrive summing them; ``MoeConfig.gemv``: products on the CUDA cores) against the reference.

CPU: the kernels run under TRITON_INTERPRET=1 (conftest), where 16-bit roundings truncate (test_moe_experts.py's
module doc: the tolerances cover it). GPU tests (marked) check CUDA-graph replays and K3's rank shapes.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from k3compile.ops import arrival_counters
from k3compile.ops.moe_experts import triton as moe_triton
from k3compile.ops.moe_experts.reference import moe_experts_ref
from k3compile.ops.moe_experts.triton import MoeConfig, moe_experts_triton
from k3compile.testing import moe_experts_inputs, rel_err

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
TOL = {torch.float32: 2e-5, torch.bfloat16: 4e-2, torch.float16: 8e-3}
K3_BETAS = (4.0, 25.0)


def small_config(**kw) -> MoeConfig:
    """Steps of 32 columns (several per slice at the widths drawn here), one stage: cheap interpreted programs."""
    return MoeConfig(**{**dict(block_i=16, block_l=32, block_n=16, block_k=32, stages_up=1, stages_down=1), **kw})


def run(args, config, limit=16, betas=K3_BETAS):
    out = torch.full_like(args[0], float("nan"))
    moe_experts_triton(*args, *betas, out=out, small_m_limit=limit, config=config)
    return out


@settings(max_examples=max(8, settings.default.max_examples // 3))
@given(m=st.integers(1, 5), a=st.integers(1, 3), e=st.integers(1, 6), i=st.integers(1, 50),
       l=st.integers(33, 140), dtype=st.sampled_from(list(DTYPES)), mxfp4=st.booleans(),
       routing=st.sampled_from(["random", "skewed", "repeat", "one"]), split=st.integers(1, 5), gemv=st.booleans(),
       rows=st.booleans(), seed=st.integers(0, 2**16))
@example(m=1, a=3, e=6, i=64, l=128, dtype="bf16", mxfp4=True, routing="random", split=4, gemv=False, rows=True,
         seed=0)                                                                 # K3's decode form, 4 slices of 32
@example(m=2, a=3, e=5, i=37, l=70, dtype="fp32", mxfp4=False, routing="repeat", split=3, gemv=True, rows=False,
         seed=1)                                                                 # duplicates, ragged I and L
@example(m=4, a=2, e=3, i=32, l=96, dtype="fp16", mxfp4=True, routing="one", split=5, gemv=True, rows=True,
         seed=2)                                                                 # every pair on one expert
@example(m=5, a=3, e=6, i=17, l=50, dtype="bf16", mxfp4=False, routing="skewed", split=2, gemv=False, rows=True,
         seed=3)
def test_split_and_gemv_match_reference(m, a, e, i, l, dtype, mxfp4, routing, split, gemv, rows, seed):
    """Any M of the decode form, widths not multiples of 16 (float), random E2M1 codes and E8M0 scales (MXFP4: whole
    groups), duplicate experts within and across tokens, every pair on one expert, experts nobody chose; as many
    slices as asked or fewer (never an empty one), the CUDA-core products, either weight orientation."""
    if routing in ("random", "skewed") and a > e:
        a = e
    if mxfp4:
        i, l = 32 * max(1, i // 32), 32 * (l // 32)   # whole MXFP4 groups
    dt = DTYPES[dtype]
    args = moe_experts_inputs(m, a, e, i, l, dt, routing, mxfp4=mxfp4, seed=seed)
    out = run(args, small_config(split_l=split, gemv=gemv, weight_rows=rows, trigger_early=True))
    assert rel_err(out, moe_experts_ref(*args, *K3_BETAS)) < TOL[dt], \
        f"M{m}-A{a}-E{e}-I{i}-L{l}-{dtype}-mx{mxfp4}-{routing}-split{split}-gemv{gemv}-rows{rows}"
    assert arrival_counters.all_zero()


@pytest.mark.parametrize("config", [dict(split_l=3), dict(split_l=2, gemv=True, weight_rows=True)],
                         ids=["split3", "split2-gemv-rows"])
def test_split_repeated_calls_identical_counters_rearmed(config):
    """The slices are summed in slice order by whichever arrives last: every call gives the same bits, and each leaves
    its counters at zero for the next (one buffer serves every call, no memset)."""
    args = moe_experts_inputs(3, 3, 4, 24, 128, torch.bfloat16, routing="repeat", seed=6)
    outs = [run(args, small_config(**config)) for _ in range(2)]
    assert torch.equal(outs[0], outs[1])
    assert arrival_counters.all_zero()
    assert rel_err(outs[0], moe_experts_ref(*args, *K3_BETAS)) < TOL[torch.bfloat16]


def test_split_without_a_counter_buffer_zeroes_its_own(monkeypatch):
    """A first call inside a CUDA-graph capture gets no counters from the shared buffer (it cannot allocate there):
    it takes zeroed counters of its own (the graph zeroes them on every replay) and computes the same."""
    args = moe_experts_inputs(2, 2, 4, 32, 96, torch.float32, seed=9)
    config = small_config(split_l=3)
    expect = run(args, config)
    monkeypatch.setattr(moe_triton, "arrival_counters", lambda device, n: None)
    assert torch.equal(run(args, config), expect)


def test_split_ignored_by_the_sorted_form():
    """Above the small-M limit the sorted kernels run whole rows of L (the prefill has programs to spare)."""
    args = moe_experts_inputs(6, 2, 4, 24, 96, torch.float32, routing="repeat", seed=10)
    out = run(args, small_config(split_l=3, gemv=True), limit=1)
    assert rel_err(out, moe_experts_ref(*args, *K3_BETAS)) < TOL[torch.float32]


@pytest.mark.parametrize("config", [dict(split_l=3), dict(split_l=2, gemv=True, weight_rows=True),
                                    dict(gemv=True, down_by_token=True)], ids=["split3", "split2-gemv-rows",
                                                                               "gemv-bytoken"])
@pytest.mark.parametrize("mxfp4", [False, True], ids=["fp32", "mxfp4"])
def test_split_id_outside_range_poisons_only_its_token(config, mxfp4):
    """Ids -1 and E: those tokens come out NaN, the others exact, and every counter is back at zero."""
    args = list(moe_experts_inputs(4, 2, 5, 32, 96, torch.float32, mxfp4=mxfp4, seed=4))
    experts = args[1].clone()
    experts[1, 0], experts[2, 1] = -1, 5
    args[1] = experts
    out = run(args, small_config(**config))
    assert out[1].isnan().all() and out[2].isnan().all()
    good = [0, 3]
    ref = moe_experts_ref(args[0][good], args[1][good], args[2][good], *args[3:], *K3_BETAS)
    assert rel_err(out[good], ref) < TOL[torch.float32]
    assert arrival_counters.all_zero()


# Every weight and scale stack copied between unreadable pages as wide as one expert's slab, once flush against the
# pages below and once against the pages above: a read of expert -1 or E faults (SIGSEGV), so the process running
# the kernels dies instead of printing "ok".
_GUARDED_SCRIPT = r"""
import ctypes, ctypes.util, mmap, os, sys
os.environ["TRITON_INTERPRET"] = "1"
import torch
from k3compile.ops.moe_experts.reference import moe_experts_ref
from k3compile.ops.moe_experts.triton import MoeConfig, moe_experts_triton
from k3compile.testing import moe_experts_inputs

libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
libc.mprotect.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
PAGE = mmap.PAGESIZE
KEEP = []

def guarded(t, flush_above):
    nbytes = t.numel() * t.element_size()
    pad = -nbytes % PAGE
    guard = -(-t.stride(0) * t.element_size() // PAGE) * PAGE      # one expert's slab, whole pages
    mm = mmap.mmap(-1, 2 * guard + pad + nbytes)
    base = ctypes.addressof(ctypes.c_char.from_buffer(mm))
    lo = guard + (pad if flush_above else 0)                         # the data's first byte
    for start in (0, guard + pad + nbytes):
        assert libc.mprotect(base + start, guard, 0) == 0, ctypes.get_errno()
    g = torch.frombuffer(mm, dtype=torch.uint8, count=nbytes, offset=lo).view(t.dtype).view(t.shape)
    g.copy_(t)
    KEEP.append(mm)
    return g

configs = [MoeConfig(**c) for c in eval(sys.argv[1])]
for mxfp4, dtype in ((True, torch.bfloat16), (False, torch.float32)):
    args = list(moe_experts_inputs(2, 2, 3, 32, 64, dtype, mxfp4=mxfp4, seed=1))
    args[1] = torch.tensor([[0, -1], [3, 2]])
    for flush_above in (False, True):
        weights = [guarded(t, flush_above) if t is not None else None for t in args[3:]]
        for config in configs:
            out = torch.full_like(args[0], float("nan"))
            moe_experts_triton(*args[:3], *weights, 4.0, 25.0, out=out, config=config)
            assert out.isnan().all(), config.tag()      # both tokens hold a bad id
            if flush_above:
                continue
            good = torch.tensor([[0, 2], [1, 2]])        # the copies are what the kernels read
            ref = moe_experts_ref(args[0], good, args[2], *args[3:], 4.0, 25.0)
            moe_experts_triton(args[0], good, args[2], *weights, 4.0, 25.0, out=out, config=config)
            assert ((out.double() - ref.double()).norm() / ref.double().norm()).item() < 5e-2, config.tag()
print("ok")
"""


def test_id_outside_range_reads_no_byte_outside_the_weights():
    """Ids -1 and E with the weights between unreadable pages: no kernel of the decode form, whichever form, reads
    outside the stacks (a fault kills the interpreting process; the tokens come out NaN)."""
    configs = [dict(block_l=32, block_k=32, block_n=16, stages_up=1, stages_down=1, **c) for c in
               (dict(split_l=4, weight_rows=True, trigger_early=True), dict(split_l=2, gemv=True),
                dict(gemv=True, weight_rows=True, down_by_token=True))]
    env = dict(os.environ, TRITON_INTERPRET="1")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in [env.get("PYTHONPATH")] if p])
    proc = subprocess.run([sys.executable, "-c", _GUARDED_SCRIPT, repr(configs)], env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), (proc.returncode, proc.stderr[-3000:])


# ---------------------------------------------------------------------------------------------
# GPU

# The leading candidates of benchmarks/tune_moe_experts.py (MXFP4's also run on bf16 weights)
_MXR = dict(weight_rows=True, mxfp4_asm=True, block_i=32, block_l=256, stages_up=3, block_n=128, block_k=128,
            stages_down=3, trigger_early=True, maxnreg_up=128, maxnreg_down=128)
GPU_CONFIGS = {
    "split2-rows-capped": MoeConfig(split_l=2, **_MXR),
    "split2-early": MoeConfig(split_l=2, stages_up=3, trigger_early=True),
    "split7-gemv-rows-asm": MoeConfig(gemv=True, weight_rows=True, mxfp4_asm=True, block_i=16, block_l=256,
                                      stages_up=1, split_l=7, block_n=32, warps_down=8, stages_down=1,
                                      trigger_early=True),
}


@pytest.mark.gpu
@pytest.mark.parametrize("config", list(GPU_CONFIGS))
@pytest.mark.parametrize("fmt", ["bf16", "mxfp4"])
@pytest.mark.parametrize("m", [1, 16], ids=lambda m: f"M{m}")
def test_gpu_split_graph_replays_fresh_inputs(m, fmt, config):
    """Captured once, replayed on fresh z, ids and router weights with the output NaN-poisoned: no host sync, no
    data-dependent allocation, the slices' arrival counters back at zero after every replay, PDL order kept. K3's
    widths with 128 experts (the kernels compiled here serve test_gpu_split_k3_rank_shapes too)."""
    e, a, l, i = 128, 16, 3584, 384
    args = list(moe_experts_inputs(m, a, e, i, l, torch.bfloat16, mxfp4=fmt == "mxfp4", seed=0, device="cuda"))
    z, experts, weights = args[:3]
    out = torch.empty_like(z)
    kw = dict(config=GPU_CONFIGS[config])
    moe_experts_triton(*args, *K3_BETAS, out=out, **kw)   # compile (and take the counter buffer) outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        moe_experts_triton(*args, *K3_BETAS, out=out, **kw)
    for seed in range(1, 4):
        fresh = moe_experts_inputs(m, a, e, i, l, torch.bfloat16, routing="repeat" if seed == 2 else "random",
                                   mxfp4=fmt == "mxfp4", seed=seed, device="cuda")
        for dst, src in zip((z, experts, weights), fresh[:3]):
            dst.copy_(src)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert rel_err(out, moe_experts_ref(*args, *K3_BETAS)) < 1e-2, seed
        assert arrival_counters.all_zero(), seed


@pytest.mark.gpu
@pytest.mark.parametrize("config", list(GPU_CONFIGS))
@pytest.mark.parametrize("fmt", ["bf16", "mxfp4"])
def test_gpu_split_k3_rank_shapes(fmt, config):
    """K3 at TP=8 (E 896, top-16, L 3584, I 384): 16 experts of one token, and 16 tokens."""
    for m in (1, 16):
        args = moe_experts_inputs(m, 16, 896, 384, 3584, torch.bfloat16, mxfp4=fmt == "mxfp4", seed=m,
                                  device="cuda")
        out = run(args, GPU_CONFIGS[config])
        torch.cuda.synchronize()
        assert rel_err(out, moe_experts_ref(*args, *K3_BETAS)) < 1e-2, f"M{m}"
