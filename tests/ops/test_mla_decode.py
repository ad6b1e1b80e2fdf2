"""k3::mla_decode: the Triton kernel (interpreted on CPU) against the reference, the reference against the model's
own ``mla_attend``, nothing read outside each row's valid keys, fallbacks and errors; GPU tests at K3 shapes in a
128K allocation, under a CUDA graph whose replays change the length on the device.

Every buffer the kernels write (scratch and output) is NaN-poisoned first, and every cache row no query sees (outside
``[start_b, pos + T)``, or ``[min(start_b, pos), pos + T)`` with padding queries) holds NaN: an unwritten element or a
read past the valid prefix cannot pass.
"""
from __future__ import annotations

import contextlib
import json
from unittest import mock

import pytest
import torch
from hypothesis import example, given, settings, strategies as st

from k3compile.model.mla import mla_attend
from k3compile.ops.mla_decode import MLA_DECODE, mla_decode
from k3compile.ops.mla_decode import triton as mla_triton
from k3compile.ops.mla_decode.config import TritonConfig
from k3compile.ops.mla_decode.dispatch import dispatch_key
from k3compile.ops.mla_decode.reference import mla_decode_ref, valid_keys
from k3compile.testing import rel_err

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# against the fp32 reference: 16-bit runs round q_lat, the probabilities and o_lat to 16 bits (as the model does)
TOL = {torch.float32: 2e-5, torch.bfloat16: 3e-2, torch.float16: 5e-3}
# (N, R, Vd, Lk): small widths, Lk and R not powers of two (masked tiles), and K3's (one interpreted case each)
DIMS = [(8, 4, 6, 10), (16, 16, 8, 48), (32, 16, 32, 48)]
K3_DIMS = (128, 64, 128, 512)


def make_inputs(B, T, H, N, R, Vd, Lk, S, pos, dtype, start=None, seed=0, device="cpu"):
    """Random decode-step inputs as the model holds them: q_nope / q_pe are slices of one projection, the whole
    allocation random (the valid rows are what the step may read)."""
    g = torch.Generator().manual_seed(seed)

    def r(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(device=device, dtype=dtype)

    q = r(B, T, H, N + R)
    return dict(q_nope=q[..., :N], q_pe=q[..., N:], c_kv=r(B, S, Lk), k_pe=r(B, S, R),
                w_kv_b=r(H, N + Vd, Lk, scale=N ** -0.5), pos=torch.tensor(pos, device=device),
                scale=(N + R) ** -0.5,
                start=None if start is None else torch.tensor(start, dtype=torch.int64, device=device))


def poison_outside_valid(inputs: dict) -> dict:
    """The same inputs with NaN in every cache row that no query of its sequence sees."""
    c_kv, k_pe = inputs["c_kv"], inputs["k_pe"]
    B, S = c_kv.shape[:2]
    T = inputs["q_nope"].shape[1]
    read = valid_keys(inputs["pos"], inputs["start"], B, T, S).any(1)[..., None]      # [B, S, 1]
    return {**inputs, "c_kv": c_kv.masked_fill(~read, float("nan")), "k_pe": k_pe.masked_fill(~read, float("nan"))}


@contextlib.contextmanager
def nan_buffers():
    """Every buffer the Triton path allocates (scratch and output) starts as NaN."""
    def empty(*shape, dtype, device):
        return torch.full(shape, float("nan"), dtype=dtype, device=device)

    with mock.patch.object(mla_triton, "_empty", empty):
        yield


def check_kernel(inputs: dict, config: TritonConfig = TritonConfig()) -> torch.Tensor:
    """The Triton path on poisoned inputs and buffers against the reference on clean inputs; returns its output."""
    ref = mla_decode_ref(**inputs)
    with nan_buffers():
        out = mla_triton.mla_decode_triton(**poison_outside_valid(inputs), config=config)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert torch.isfinite(out).all(), "a NaN from outside the valid prefix or an unwritten element"
    assert rel_err(out, ref.float()) < TOL[out.dtype]
    return out


def case_id(B, T, H, dims, S, pos, dtype, start) -> str:
    N, R, Vd, Lk = dims
    return f"B{B}-T{T}-H{H}-N{N}-R{R}-Vd{Vd}-Lk{Lk}-S{S}-pos{pos}-{dtype}" + ("-start" if start else "")


# ---------------------------------------------------------------------------------------------------
# The kernel against the reference

# interpreted kernels, a third of a second a draw: a third of the profile's draws
@settings(max_examples=max(8, settings.default.max_examples // 3))
@given(
    B=st.integers(1, 3), T=st.integers(1, 3), H=st.integers(1, 6), dims=st.sampled_from(DIMS),
    S=st.integers(3, 80), where=st.floats(0, 1), padded=st.booleans(), data=st.data(),
    dtype=st.sampled_from(list(DTYPES)), block_s=st.sampled_from([16, 32]), min_tiles=st.sampled_from([1, 2, 4]),
    fused=st.booleans(), static=st.booleans(), max_splits=st.sampled_from([0, 1, 3]), full_tiles=st.booleans(),
    seed=st.integers(0, 2**16),
)
@example(B=1, T=1, H=3, dims=DIMS[0], S=40, where=0.0, padded=False, data=None, dtype="bf16", block_s=16,
         min_tiles=1, fused=True, static=False, max_splits=0, full_tiles=True, seed=0)   # valid length 1
@example(B=2, T=1, H=6, dims=DIMS[1], S=67, where=1.0, padded=False, data=None, dtype="bf16", block_s=16,
         min_tiles=1, fused=False, static=True, max_splits=0, full_tiles=True, seed=1)   # the full allocation
@example(B=3, T=3, H=2, dims=DIMS[2], S=50, where=1.0, padded=True, data=None, dtype="fp32", block_s=16,
         min_tiles=1, fused=True, static=True, max_splits=1, full_tiles=False, seed=2)   # left-padded, one split
def test_triton_matches_reference_property(B, T, H, dims, S, where, padded, data, dtype, block_s, min_tiles, fused,
                                           static, max_splits, full_tiles, seed):
    """Heads, batch, T, valid lengths from 1 to the allocation, per-row starts, split layouts, both read-backs
    (the combine kernel and a per-head product, or both in one kernel), the split kernel with its shapes and
    strides compiled in or not, the split count capped or not, whole tiles unmasked or not."""
    N, R, Vd, Lk = dims
    pos = round(where * (S - T))                                   # valid length pos + T: from T to S
    start = None
    if padded:
        starts = st.lists(st.integers(0, pos + T + 1), min_size=B, max_size=B)   # past pos: padding queries
        start = data.draw(starts) if data is not None else [b * 7 for b in range(B)]
    inputs = make_inputs(B, T, H, N, R, Vd, Lk, S, pos, DTYPES[dtype], start, seed)
    check_kernel(inputs, TritonConfig(block_s=block_s, min_split_tiles=min_tiles, fused_readback=fused,
                                      static_strides=static, max_splits=max_splits, full_tiles=full_tiles))


def test_static_strides_fall_back_where_cache_rows_are_strided():
    """``static_strides`` compiles the shapes in only where the cache rows are contiguous: a cache whose rows are
    strided (here c_kv [B, S, Lk] a transposed view) runs the general kernel, and correctly."""
    inputs = make_inputs(2, 1, 3, *DIMS[1], S=40, pos=30, dtype=torch.float32, start=[0, 4], seed=6)
    ref = mla_decode_ref(**inputs)
    poisoned = poison_outside_valid(inputs)
    config = TritonConfig(block_s=16, min_split_tiles=1, static_strides=True)
    launched = []
    with contextlib.ExitStack() as stack:
        for name in ("_mla_split", "_mla_split_static"):
            stack.enter_context(mock.patch.object(mla_triton, name,
                                                  _Recording(getattr(mla_triton, name), name, launched)))
        stack.enter_context(nan_buffers())
        for c_kv, kernel in ((poisoned["c_kv"].transpose(1, 2).contiguous().transpose(1, 2), "_mla_split"),
                             (poisoned["c_kv"].contiguous(), "_mla_split_static")):
            launched.clear()
            out = mla_triton.mla_decode_triton(**{**poisoned, "c_kv": c_kv}, config=config)
            assert launched == [kernel]
            assert torch.isfinite(out).all() and rel_err(out, ref) < TOL[torch.float32]


class _Recording:
    """A kernel whose launches are recorded by name."""

    def __init__(self, kernel, name, launched):
        self.kernel, self.name, self.launched = kernel, name, launched

    def __getitem__(self, grid):
        self.launched.append(self.name)
        return self.kernel[grid]


@pytest.mark.parametrize("fused", [False, True], ids=["combine", "fused"])
@pytest.mark.parametrize("B,T,start", [(1, 1, None), (3, 2, [0, 9, 30])], ids=["B1-T1", "B3-T2-start"])
def test_combine_in_several_steps(B, T, start, fused):
    """The combine's loops over splits, a few splits a step (on the GPU a step holds 32 or 8 of them): 24 splits of
    16 keys, taken 2 at a time, rows of different lengths and starts."""
    inputs = make_inputs(B, T, 5, *DIMS[1], S=400, pos=390 - T, dtype=torch.float32, start=start, seed=4)
    with mock.patch.object(mla_triton, "COMBINE_TILE", 4), mock.patch.object(mla_triton, "FUSED_SPLITS", 2), \
            mock.patch.object(mla_triton, "split_count", lambda *args: 24):
        check_kernel(inputs, TritonConfig(block_s=16, min_split_tiles=1, fused_readback=fused))


@pytest.mark.parametrize("T,H,start,fused,static", [(1, 6, None, False, False), (2, 12, [0, 23], False, False),
                                                    (2, 6, [0, 23], True, False), (1, 12, [0, 23], False, True)],
                         ids=["T1-H6", "T2-H12-start", "T2-H6-start-fused", "T1-H12-start-static"])
def test_triton_k3_widths_read_only_the_valid_prefix(T, H, start, fused, static):
    """K3's widths (N 128, R 64, Vd 128, Lk 512; 6 or 12 heads a rank): the rows outside [start_b, pos + T) are NaN,
    the output is finite and equals the reference, with either read-back, the shapes compiled in and whole tiles
    unmasked or not."""
    inputs = make_inputs(2, T, H, *K3_DIMS, S=96, pos=41, dtype=torch.bfloat16, start=start, seed=3)
    check_kernel(inputs, TritonConfig(block_s=16, min_split_tiles=1, fused_readback=fused, static_strides=static,
                                      full_tiles=static))


@pytest.mark.parametrize("B,fused,max_splits", [(1, True, 0), (2, False, 0), (1, False, 4)],
                         ids=["B1-fused", "B2-combine", "B1-combine-4-splits"])
def test_triton_grid_sized_for_an_h200(B, fused, max_splits):
    """The grids the host lays out for 132 SMs (on the interpreter, which counts none): as many splits as two
    programs an SM allow (or ``max_splits``), the per-head products narrowed to 16 or 32 output columns, the
    combine's tiles shaped by the split count; K3's widths, left-padded rows."""
    inputs = make_inputs(B, 1, 12, *K3_DIMS, S=160, pos=150, dtype=torch.bfloat16, start=[0, 40][:B], seed=5)
    with mock.patch.object(mla_triton, "sm_count", lambda device: 132):
        check_kernel(inputs, TritonConfig(block_s=16, min_split_tiles=1, fused_readback=fused, max_splits=max_splits,
                                          static_strides=max_splits > 0, full_tiles=max_splits > 0))


def test_query_before_its_row_start_sees_its_own_key():
    """A left-padding query of a prompt (pos + t < start_b) sees its own key alone, as the model's rule has it: its
    output is its own value read back, w_v c_kv[pos + t]."""
    inputs = make_inputs(2, 3, 3, *DIMS[0], S=20, pos=5, dtype=torch.float32, start=[0, 7])
    out = check_kernel(inputs, TritonConfig(block_s=16, min_split_tiles=1))
    N = inputs["q_nope"].shape[-1]
    for t in (0, 1):                                                # positions 5, 6 < start 7
        own = torch.einsum("l,hvl->hv", inputs["c_kv"][1, 5 + t], inputs["w_kv_b"][:, N:])
        assert rel_err(out[1, t], own) < TOL[torch.float32]


@pytest.mark.parametrize("static", [False, True], ids=["general", "static"])
def test_length_is_read_on_the_device(static):
    """The host never reads pos or start (a CUDA graph replays one launch for every length): every host read of a
    tensor's value raises during the call, and one set of buffers serves lengths set in place."""
    inputs = make_inputs(2, 1, 3, *DIMS[1], S=70, pos=0, dtype=torch.float32, start=[0, 0])
    pos, start = inputs["pos"], inputs["start"]

    def no_host_read(*args, **kwargs):
        raise AssertionError("the host read a tensor's value")

    for p, s in ((0, [0, 0]), (33, [5, 0]), (69, [0, 68])):
        pos.fill_(p)
        start.copy_(torch.tensor(s))
        ref = mla_decode_ref(**inputs)
        with mock.patch.object(torch.Tensor, "item", no_host_read), \
                mock.patch.object(torch.Tensor, "tolist", no_host_read), \
                mock.patch.object(torch.Tensor, "__bool__", no_host_read), \
                mock.patch.object(torch.Tensor, "__int__", no_host_read), nan_buffers():
            out = mla_triton.mla_decode_triton(**inputs, config=TritonConfig(block_s=16, min_split_tiles=1,
                                                                             static_strides=static, full_tiles=static))
        assert rel_err(out, ref) < TOL[torch.float32]


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("T,pos,start", [(1, 0, None), (1, 37, None), (3, 20, None), (2, 30, [0, 9])],
                         ids=["T1-pos0", "T1-pos37", "T3-pos20", "T2-pos30-start"])
def test_op_equals_model_mla_attend(T, pos, start, backend):
    """The op through its public function against the model's own fp32 attention over the whole allocation. With
    ``start``, row b against the model on its cache from start_b on (positions shifted by start_b)."""
    inputs = make_inputs(2, T, 4, *DIMS[2], S=40, pos=pos, dtype=torch.float32, start=start)
    out = mla_decode(**inputs, backend=backend)
    ref = torch.cat([_model_row(inputs, b, 0 if start is None else start[b]) for b in range(2)])
    assert rel_err(out, ref) < TOL[torch.float32]


def _model_row(inputs: dict, b: int, first: int) -> torch.Tensor:
    """Row b by the model's ``mla_attend``, its cache and positions starting at ``first``."""
    sl = slice(b, b + 1)
    return mla_attend(inputs["q_nope"][sl], inputs["q_pe"][sl], inputs["c_kv"][sl, first:],
                      inputs["k_pe"][sl, first:], inputs["w_kv_b"], inputs["pos"] - first, inputs["scale"])


# ---------------------------------------------------------------------------------------------------
# Dispatch, errors, schema

def test_mixed_dtypes_run_the_reference_recorded():
    inputs = make_inputs(1, 1, 2, *DIMS[0], S=9, pos=3, dtype=torch.float32)
    inputs["q_nope"] = inputs["q_nope"].to(torch.bfloat16)
    MLA_DECODE.clear()
    out = mla_decode(**inputs, backend="triton")
    (choice,) = MLA_DECODE.choices()
    assert choice.impl == "reference" and "mixed dtypes" in choice.reason
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()


def test_table_picks_are_read_by_gpu_name(tmp_path, monkeypatch):
    """tables/<gpu>.json (benchmarks/tune_mla_decode.py's output) applies to a device whose name holds <gpu>, keyed by
    dtype, query-rows bucket and batch bucket; any other key or device takes the default layout."""
    from k3compile.ops.mla_decode import dispatch
    from k3compile.ops.mla_decode.config import TritonConfig, default_config

    pick = TritonConfig(block_s=64, min_split_tiles=2, programs_per_sm=4, num_warps=8, num_stages=3)
    key = dispatch.table_key(torch.bfloat16, 12, 9)
    (tmp_path / "h200.json").write_text(json.dumps({"picks": {key: pick.to_json()}}))
    monkeypatch.setattr(dispatch, "TABLES", tmp_path)
    dispatch.load_table.cache_clear()
    try:
        assert key == "bfloat16 rows=16 batch=8"
        assert dispatch.load_table("NVIDIA H200") == {key: pick}
        assert dispatch.load_table("NVIDIA H100 80GB HBM3") == {}
        assert [dispatch.batch_bucket(b) for b in (1, 3, 8, 15, 64, 500)] == [1, 2, 8, 8, 64, 64]
        assert default_config(48).num_warps == 8 and default_config(12).num_warps == 4
    finally:
        dispatch.load_table.cache_clear()


def test_table_picks_by_length_apply_to_allocations_within_it():
    """A pick keyed by length serves caches allocated for at most that many keys (the host knows the allocation, not
    the valid length); a larger allocation, or a batch without one, takes the batch's pick, then the default."""
    from k3compile.ops.mla_decode import dispatch
    from k3compile.ops.mla_decode.config import TritonConfig, default_config

    short = TritonConfig(block_s=32, num_warps=8, static_strides=True, max_splits=16)
    whole = TritonConfig(block_s=64, num_warps=8, programs_per_sm=1)
    table = {dispatch.table_key(torch.bfloat16, 12, 1, 1024): short, dispatch.table_key(torch.bfloat16, 12, 1): whole}
    assert dispatch.table_key(torch.bfloat16, 12, 1, 1000) == "bfloat16 rows=16 batch=1 len=1024"
    assert [dispatch.length_bucket(n) for n in (1, 2, 1000, 1024, 1025, 131072)] == [1, 2, 1024, 1024, 2048, 131072]
    assert dispatch.table_pick(table, torch.bfloat16, 12, 1, 700) == short
    assert dispatch.table_pick(table, torch.bfloat16, 12, 1, 1024) == short
    assert dispatch.table_pick(table, torch.bfloat16, 12, 1, 1025) == whole
    assert dispatch.table_pick(table, torch.bfloat16, 12, 1, 131072) == whole
    assert dispatch.table_pick(table, torch.bfloat16, 12, 8, 1024) == default_config(12, 8)


def test_tuner_stage3_picks_by_length_and_for_the_batch():
    """benchmarks/tune_mla_decode.py's stage 3 rule on made-up times: the fastest of each length where it beats the
    batch's pick by the margin (a split cap included), the batch's pick only by one no slower at any length; a
    candidate that failed (inf) never."""
    import importlib.util
    import math
    import os
    import sys
    import types

    bench_dir = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "benchmarks")
    sys.path.insert(0, bench_dir)
    try:
        spec = importlib.util.spec_from_file_location("tune_mla_decode", os.path.join(bench_dir, "tune_mla_decode.py"))
        tune = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(tune)
    finally:
        sys.path.remove(bench_dir)
    from k3compile.ops.mla_decode.dispatch import table_key

    pick = TritonConfig(block_s=64, programs_per_sm=1, min_split_tiles=2)
    capped = TritonConfig(block_s=32, num_warps=8, static_strides=True, max_splits=16)
    whole = TritonConfig(block_s=64, num_warps=8, static_strides=True)
    broken = TritonConfig(block_s=16, num_warps=8, num_stages=6)
    us = {(pick, 1024): 10.0, (pick, 65536): 50.0, (capped, 1024): 7.0, (capped, 65536): 200.0,
          (whole, 1024): 9.0, (whole, 65536): 45.0, (broken, 1024): math.inf, (broken, 65536): math.inf}
    key = table_key(torch.bfloat16, 12, 1)
    picks = {key: pick}
    report = tune._length_picks(types.SimpleNamespace(min_gain=0.02), 1, (1024, 65536),
                                [pick, capped, whole, broken], us, picks, key)
    assert picks == {key: whole, table_key(torch.bfloat16, 12, 1, 1024): capped,
                     table_key(torch.bfloat16, 12, 1, 65536): whole}
    assert report["pick"] == tune.tag(whole) and [r["us"] for r in report["rows"]][1] == [7.0, 200.0]
    us[whole, 1024] = 10.2                       # slower than the pick at one length: the batch keeps its pick
    picks = {key: pick}
    tune._length_picks(types.SimpleNamespace(min_gain=0.02), 1, (1024, 65536), [pick, capped, whole], us, picks, key)
    assert picks[key] == pick


@pytest.mark.parametrize("what", ["q_pe heads", "cache batch", "w_kv_b width", "pos shape", "start shape", "int q"])
def test_bad_inputs_raise(what):
    inputs = make_inputs(2, 1, 3, *DIMS[0], S=9, pos=3, dtype=torch.float32, start=[0, 1])
    bad = {"q_pe heads": ("q_pe", inputs["q_pe"][:, :, :2]), "cache batch": ("c_kv", inputs["c_kv"][:1]),
           "w_kv_b width": ("w_kv_b", inputs["w_kv_b"][:, :, :5]), "pos shape": ("pos", torch.tensor([3])),
           "start shape": ("start", torch.tensor([0])), "int q": ("q_nope", inputs["q_nope"].to(torch.int32))}[what]
    with pytest.raises(ValueError, match="mla_decode"):
        mla_decode(**{**inputs, bad[0]: bad[1]}, backend="reference")


@pytest.mark.parametrize("start", [None, [0, 2]], ids=["no-start", "start"])
def test_op_passes_opcheck(start):
    inputs = make_inputs(2, 2, 3, *DIMS[0], S=9, pos=3, dtype=torch.float32, start=start)
    args = tuple(inputs[n] for n in ("q_nope", "q_pe", "c_kv", "k_pe", "w_kv_b", "pos", "scale", "start"))
    torch.library.opcheck(torch.ops.k3.mla_decode.default, args + ("reference",),
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_static"))


# ---------------------------------------------------------------------------------------------------
# The kernels compile for sm_90 (Triton's NVIDIA backend needs no GPU) without spilling, the cache stream pipelined

_AOT_SCRIPT = r"""
import json, os, re, subprocess, sys, tempfile
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from k3compile.ops.mla_decode import triton as mt
from k3compile.ops.mla_decode.config import TritonConfig, default_config, row_block

PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
MEMORY = ("ld.global", "cp.async", "st.global", "atom.global", "red.global", "prefetch.global")


def build(kernel, ptrs, consts, warps, stages, div16=()):
    names = kernel.arg_names
    sig = {n: "constexpr" if n in consts else ptrs.get(n) or ("i64" if n.startswith("stride") else
           "fp32" if n == "qk_scale" else "i32") for n in names}
    # what a launch specialises on: 16-byte aligned pointers and strides, unit last-dim strides, the integer
    # arguments that are multiples of 16 at K3's widths (div16)
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
             if n in ptrs or (n.startswith("stride") and n not in consts) or n in div16}
    k = triton.compile(ASTSource(fn=kernel, signature=sig, constexprs=consts, attrs=attrs),
                       target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps, num_stages=stages))
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(k.asm["ptx"])
    info = subprocess.run([PTXAS, "-arch=sm_90a", "-v", f.name, "-o", os.devnull], capture_output=True, text=True)
    os.unlink(f.name)
    spills = [int(x) for x in re.findall(r"(\d+) bytes spill stores", info.stderr)]
    lines = k.asm["ptx"].splitlines()
    wait = [i for i, line in enumerate(lines) if "griddepcontrol.wait" in line]
    trigger = [i for i, line in enumerate(lines) if "griddepcontrol.launch_dependents" in line]
    # every global memory instruction before the wait, by its opcode ("ld.global.cg.b64", "prefetch.global.L2")
    pre_wait = sorted({op for line in lines[:wait[0] if wait else 0] for op in line.replace(";", " ").split()
                       if op.startswith(MEMORY)})
    return dict(ok=info.returncode == 0, spills=sum(spills), smem=k.metadata.shared,
                async_copies=k.asm["ttgir"].count("async_copy_global_to_local"),
                pdl_order=len(wait) == 1 and len(trigger) == 1 and wait[0] < trigger[0], pre_wait=pre_wait)


bf16 = "*bf16"
out = {}
split_ptrs = dict(q_lat=bf16, q_pe=bf16, c_kv=bf16, k_pe=bf16, pos="*i64", start="*i64", o_part="*fp32",
                  m_part="*fp32", l_part="*fp32")
parts = dict(o_part="*fp32", m_part="*fp32", l_part="*fp32", pos="*i64", start="*i64")
for rows in json.loads(sys.argv[1]):      # T x H: 12 and 6 heads a rank at T = 1, 12 heads at T = 4
    cfg = default_config(rows)
    for has_start in (False, True):
        consts = dict(LK=512, R=64, BM=row_block(rows), BL=512, BR=64, BS=cfg.block_s,
                      PREFETCH=cfg.prefetch_tiles * cfg.block_s, EARLY=True, HAS_START=has_start, UPCAST=False,
                      PDL=True, FULL_TILES=False, stride_cl=1, stride_kr=1, stride_pr=1)
        out[f"split-rows{rows}-{'start' if has_start else 'nostart'}"] = build(
            mt._mla_split, split_ptrs, consts, cfg.num_warps, cfg.num_stages)
# the shapes and strides compiled in; 4 warps, and 8 with whole tiles unmasked
for name, cfg in (("split-static", default_config(12)),
                  ("split-static-8w-full", TritonConfig(block_s=64, num_warps=8, num_stages=3, programs_per_sm=1,
                                                        full_tiles=True))):
    out[name] = build(mt._mla_split_static, split_ptrs, dict(
        LK=512, R=64, BM=16, BL=512, BR=64, BS=cfg.block_s, PREFETCH=cfg.prefetch_tiles * cfg.block_s, EARLY=True,
        HAS_START=True, UPCAST=False, PDL=True, FULL_TILES=cfg.full_tiles, T=1, H=12, N_SPLIT=132, min_tiles=2,
        qk_scale=0.104,
        stride_pb=2304, stride_pt=2304, stride_ph=192, stride_pr=1, stride_cs=512, stride_cl=1, stride_ks=64,
        stride_kr=1), cfg.num_warps, cfg.num_stages)
cfg = default_config(12)
out["split-late"] = build(mt._mla_split, split_ptrs, dict(
    LK=512, R=64, BM=16, BL=512, BR=64, BS=cfg.block_s, PREFETCH=0, EARLY=False, HAS_START=True, UPCAST=False,
    PDL=True, FULL_TILES=False, stride_cl=1, stride_kr=1, stride_pr=1), cfg.num_warps, cfg.num_stages)
for brw, bsp in ((1, mt.COMBINE_TILE), (mt.COMBINE_TILE // 4, 4)):     # B 1-8 (many splits), B 64 (4 splits)
    out[f"combine-{brw}x{bsp}"] = build(mt._mla_combine, dict(parts, o_lat=bf16), dict(
        LK=512, BRW=brw, BSP=bsp, BLC=mt.COMBINE_CHUNK, BS=cfg.block_s, EARLY=True, HAS_START=True, PDL=True), 4, 3)
out["combine-readback"] = build(mt._mla_combine_readback, dict(parts, w_v=bf16, out=bf16), dict(
    LK=512, BL=512, BN=mt.FUSED_VD, BSP=mt.FUSED_SPLITS, BS=cfg.block_s, EARLY=True, HAS_START=True, PDL=True,
    stride_wl=1, stride_ov=1), 4, 2)
for bm in (16, 64):   # the absorption (w_k [N, Lk] rows contiguous) and the read-back (w_v columns contiguous)
    out[f"absorb-bm{bm}"] = build(mt._per_head_matmul, dict(x=bf16, w=bf16, y=bf16), dict(
        BM=bm, BK=mt.MATMUL_BLOCK, BN=32, KP=128, UPCAST=False, PDL=True, PREFETCH=True, W_K_CONTIG=False,
        stride_xk=1, stride_wn=1), 4, 3, div16=("K", "NOUT"))
    out[f"readback-bm{bm}"] = build(mt._per_head_matmul, dict(x=bf16, w=bf16, y=bf16), dict(
        BM=bm, BK=mt.MATMUL_BLOCK, BN=16, KP=512, UPCAST=False, PDL=True, PREFETCH=True, W_K_CONTIG=True,
        stride_xk=1, stride_wk=1), 4, 3, div16=("K", "NOUT"))
print(json.dumps(out))
"""


def test_kernels_compile_for_sm90_without_spills():
    """At K3's widths with the default layouts, under PDL: ptxas accepts every kernel for sm_90a with no spill stores;
    each waits (griddepcontrol.wait) once and lets the next kernel launch only after that. Before the wait the first
    kernel (the absorption, which may follow the kernel that wrote q_nope) only prefetches lines into L2; the later
    ones also read the op's inputs, through L2 (``ld.global.cg``), and write nothing (no store, atomic or cp.async);
    the split kernel without early reads touches no memory before it. The split kernel streams its cache tiles
    through cp.async (a load the pipeliner cannot take would stall each tile), the combines their partials, the
    per-head products their tiles."""
    from k3compile.testing import ptx_in_a_fresh_process

    pytest.importorskip("triton.backends.nvidia")
    report = ptx_in_a_fresh_process(_AOT_SCRIPT, [12, 6, 48])
    assert len(report) == 16, report
    for name, r in report.items():
        assert r["ok"] and r["spills"] == 0 and r["pdl_order"], (name, r)
        allowed = ("prefetch.global.L2",) if name.startswith("absorb") else ("prefetch.global.L2", "ld.global.cg.")
        assert all(op.startswith(allowed) for op in r["pre_wait"]), (name, r)
        if name.startswith("split"):
            assert r["async_copies"] >= 2, (name, r)       # the c_kv and k_pe tiles
            assert r["smem"] <= 227 * 1024, (name, r)
            assert ("prefetch.global.L2" in r["pre_wait"]) == (name != "split-late"), (name, r)
            assert r["pre_wait"] == [] or name != "split-late", (name, r)
        if name.startswith("combine"):
            assert r["async_copies"] >= 3, (name, r)       # m, l and o partials, pipelined over the splits
        if name.startswith(("absorb", "readback")):
            assert r["async_copies"] >= 2, (name, r)       # x and w tiles, pipelined over K


# ---------------------------------------------------------------------------------------------------
# GPU: K3 shapes in a 128K allocation, under a CUDA graph

K3_ALLOC = 128 * 1024


def _gpu_inputs(B, H, T, alloc, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    N, R, Vd, Lk = K3_DIMS

    def r(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, device="cuda") * scale).to(torch.bfloat16)

    q = r(B, T, H, N + R)
    return dict(q_nope=q[..., :N], q_pe=q[..., N:], c_kv=r(B, alloc, Lk), k_pe=r(B, alloc, R),
                w_kv_b=r(H, N + Vd, Lk, scale=N ** -0.5), pos=torch.zeros((), dtype=torch.int64, device="cuda"),
                scale=(N + R) ** -0.5, start=torch.zeros(B, dtype=torch.int64, device="cuda"))


def _gpu_reference(inputs: dict, end: int) -> torch.Tensor:
    """The reference row by row on the cache before ``end`` = pos + T (the keys it may see: the whole allocation in
    fp32 would not fit)."""
    rows = []
    for b in range(inputs["c_kv"].shape[0]):
        sl = slice(b, b + 1)
        rows.append(mla_decode_ref(inputs["q_nope"][sl], inputs["q_pe"][sl], inputs["c_kv"][sl, :end],
                                   inputs["k_pe"][sl, :end], inputs["w_kv_b"], inputs["pos"], inputs["scale"],
                                   inputs["start"][sl]))
    return torch.cat(rows)


@pytest.mark.gpu
@pytest.mark.parametrize("B,H,T", [(1, 12, 1), (8, 12, 1), (64, 6, 1), (4, 12, 4)],
                         ids=["B1-H12-T1", "B8-H12-T1", "B64-H6-T1", "B4-H12-T4"])
def test_gpu_cuda_graph_replays_follow_the_length(B, H, T):
    """One captured step, replayed at lengths 1 .. the whole 128K allocation with per-row starts set in place; each
    replay equals the reference, the rows past each length are NaN, the output buffer is NaN before each replay."""
    inputs = _gpu_inputs(B, H, T, K3_ALLOC)
    _check_graph_replays(inputs, T, lambda: mla_decode(**inputs, backend="triton"))
    key = dispatch_key(*(inputs[n] for n in ("q_nope", "q_pe", "c_kv", "k_pe", "w_kv_b", "pos", "scale", "start")))
    (choice,) = [c for c in MLA_DECODE.choices() if c.backend == "triton" and c.key == key]
    assert choice.impl == "triton", choice.reason


@pytest.mark.gpu
@pytest.mark.parametrize("B,config", [
    (1, TritonConfig(block_s=32, num_warps=8, num_stages=3, programs_per_sm=1, min_split_tiles=2,
                     static_strides=True, full_tiles=True, max_splits=16)),
    (8, TritonConfig(block_s=64, num_warps=8, num_stages=2, programs_per_sm=2, min_split_tiles=1,
                     static_strides=True, full_tiles=True, maxnreg=128)),
], ids=["B1-32-8-3-static-full-16-splits", "B8-64-8-2-static-full-r128"])
def test_gpu_layout_options_cuda_graph(B, config):
    """The layout options stage 3 of the tuner times (shapes compiled in, whole tiles unmasked, a split cap, a
    register cap), under the same replays: 12 heads, T 1."""
    inputs = _gpu_inputs(B, 12, 1, K3_ALLOC)
    _check_graph_replays(inputs, 1, lambda: mla_triton.mla_decode_triton(**inputs, config=config))


def _check_graph_replays(inputs: dict, T: int, step) -> None:
    """``step()`` captured once and replayed at lengths T .. the allocation, starts set in place, NaN past them."""
    c_kv, k_pe, pos, start = inputs["c_kv"], inputs["k_pe"], inputs["pos"], inputs["start"]
    B = c_kv.shape[0]
    clean_c, clean_k = c_kv.clone(), k_pe.clone()
    step()                                                 # compile before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for length, first in ((T, 0), (1024, 0), (5000, 17), (K3_ALLOC, 0), (K3_ALLOC - 3, 1000)):
        end = length if length >= T else T
        pos.fill_(end - T)
        start.fill_(min(first, end - 1))
        start[0] = 0
        c_kv.copy_(clean_c)
        k_pe.copy_(clean_k)
        c_kv[:, end:] = float("nan")
        k_pe[:, end:] = float("nan")
        for b in range(B):
            c_kv[b, :start[b]] = float("nan")
            k_pe[b, :start[b]] = float("nan")
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        c_kv.copy_(clean_c)
        k_pe.copy_(clean_k)
        ref = _gpu_reference(inputs, end)
        assert torch.isfinite(out).all(), length
        assert rel_err(out, ref.float()) < TOL[torch.bfloat16], length
