"""k3::attn_res and k3::attn_res_add: the Triton kernel (interpreted on the CPU) against the reference
(model/attn_res.py ``attn_res``, then model/layers.py ``rms_norm``; the residual add before it), outputs poisoned;
checks and fallbacks."""
from __future__ import annotations

import pytest
import torch
from hypothesis import example, given, strategies as st

from k3compile.model.attn_res import attn_res as model_attn_res
from k3compile.model.layers import rms_norm
from k3compile.ops.attn_res import ATTN_RES, ATTN_RES_ADD, attn_res, attn_res_add
from k3compile.ops.attn_res.dispatch import MAX_D, MAX_SOURCES
from k3compile.ops.attn_res.reference import attn_res_add_ref, attn_res_ref
from k3compile.ops.attn_res.triton import attn_res_add_triton, attn_res_triton

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def inputs(s, shape, dtype, seed, norm_dtype=None, spread=1.0):
    """S sources (each its own scale, as block sums grow with depth), the mix's two weights and the norm weight."""
    g = torch.Generator().manual_seed(seed)
    d = shape[-1]
    sources = [(torch.randn(shape, generator=g) * (1 + spread * i)).to(dtype) for i in range(s)]
    proj, mix_norm = torch.randn(1, d, generator=g).to(dtype), (1 + torch.randn(d, generator=g) * 0.1).to(dtype)
    norm = (1 + torch.randn(d, generator=g) * 0.1).to(norm_dtype or dtype)
    return sources, proj, mix_norm, norm


def run_poisoned(sources, proj, mix_norm, eps, norm, norm_eps, **launch):
    dtype = sources[0].dtype if norm is None else torch.promote_types(norm.dtype, sources[0].dtype)
    out = torch.full(sources[0].shape, float("nan"), dtype=dtype, device=sources[0].device)
    got = attn_res_triton(sources, proj, mix_norm, eps, norm, norm_eps, out=out, **launch)
    assert got is out
    return out


def assert_close_to_reference(out, ref, dtype):
    """fp32: to rounding; 16-bit: within two of the dtype's ulps of the row's scale (the mix is rounded to 16 bits
    before the norm, as the model does, and a sum in another order can round that one value the other way)."""
    assert not out.isnan().any()
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=2e-5, atol=2e-5)
    else:
        scale = ref.float().abs().amax(-1, keepdim=True).clamp_min(1e-3)
        ulp = torch.finfo(dtype).eps
        assert ((out.float() - ref.float()).abs() <= 2 * ulp * scale + ulp * ref.float().abs()).all()


@given(s=st.integers(1, 10), rows=st.sampled_from([(0,), (1,), (3,), (2, 3), (1, 1)]), d=st.integers(1, 300),
       dtype=st.sampled_from(list(DTYPES)), norm=st.booleans(), norm_fp32=st.booleans(), seed=st.integers(0, 99),
       group=st.sampled_from([None, 1, 3]), paired=st.booleans())
@example(s=2, rows=(1, 1), d=7168, dtype="bf16", norm=True, norm_fp32=False, seed=0, group=None, paired=False)  # K3
# K3's widest mix (nine sources, four at a time) at one row (two rows: 22 -> ~12 s interpreted; the rows are drawn)
@example(s=9, rows=(1, 1), d=7168, dtype="bf16", norm=True, norm_fp32=False, seed=1, group=None, paired=True)
@example(s=10, rows=(2, 3), d=130, dtype="fp32", norm=False, norm_fp32=False, seed=2, group=4, paired=False)
def test_kernel_equals_reference(s, rows, d, dtype, norm, norm_fp32, seed, group, paired):
    """Any number of sources, widths, dtypes, with and without the norm; the launch shapes the sweep tries (sources
    loaded at once, a source's two sums in one reduction)."""
    dt = DTYPES[dtype]
    sources, proj, mix_norm, norm_w = inputs(s, (*rows, d), dt, seed, torch.float32 if norm_fp32 else None)
    norm_w = norm_w if norm else None
    out = run_poisoned(sources, proj, mix_norm, 1e-6, norm_w, 1e-5, group=group, paired=paired)
    ref = attn_res_ref(sources, proj, mix_norm, 1e-6, norm_w, 1e-5)
    assert out.dtype == ref.dtype and out.shape == ref.shape
    assert_close_to_reference(out, ref, dt)


def test_strided_sources():
    """Sources that are column slices of wider rows (row stride > D) and a non-contiguous one."""
    g = torch.Generator().manual_seed(3)
    wide = torch.randn(4, 2, 100, generator=g)
    sources = [wide[..., :60], wide[..., 40:], torch.randn(2, 4, 60, generator=g).transpose(0, 1)]
    _, proj, mix_norm, norm = inputs(1, (60,), torch.float32, 4)
    out = run_poisoned(sources, proj, mix_norm, 1e-6, norm, 1e-6)
    assert_close_to_reference(out, attn_res_ref(sources, proj, mix_norm, 1e-6, norm, 1e-6), torch.float32)


@pytest.mark.parametrize("norm", [True, False], ids=["normed", "mix"])
def test_reference_is_the_models_mix_and_norm(norm):
    sources, proj, mix_norm, norm_w = inputs(4, (2, 3, 48), torch.bfloat16, 5)
    want = model_attn_res(sources[-1], sources[:-1], proj, mix_norm, 1e-6)
    if norm:
        want = rms_norm(want, norm_w, 1e-5)
    assert torch.equal(attn_res_ref(sources, proj, mix_norm, 1e-6, norm_w if norm else None, 1e-5), want)


def test_a_nan_source_makes_its_row_nan():
    """NaN in one source of one row: that row is NaN (its weight over depth is NaN), the others are right."""
    sources, proj, mix_norm, norm = inputs(3, (3, 32), torch.float32, 6)
    sources[1][1, 5] = float("nan")
    out = run_poisoned(sources, proj, mix_norm, 1e-6, norm, 1e-6)
    ref = attn_res_ref(sources, proj, mix_norm, 1e-6, norm, 1e-6)
    assert out[1].isnan().all() and ref[1].isnan().all()
    keep = [0, 2]
    assert_close_to_reference(out[keep], ref[keep], torch.float32)


def test_op_checks_its_arguments():
    sources, proj, mix_norm, norm = inputs(2, (2, 16), torch.float32, 7)
    with pytest.raises(ValueError, match="no sources"):
        attn_res([], proj, mix_norm, 1e-6)
    with pytest.raises(ValueError, match="sources differ"):
        attn_res([sources[0], sources[1][:, :8]], proj, mix_norm, 1e-6)
    with pytest.raises(ValueError, match="sources differ"):
        attn_res([sources[0], sources[1].double()], proj, mix_norm, 1e-6)
    with pytest.raises(ValueError, match="mix_norm_weight"):
        attn_res(sources, proj, mix_norm[:8], 1e-6)
    with pytest.raises(ValueError, match="norm_weight"):
        attn_res(sources, proj, mix_norm, 1e-6, norm[None])


@pytest.mark.parametrize("s, d", [(MAX_SOURCES + 1, 8), (2, MAX_D + 1)], ids=["sources", "width"])
def test_beyond_one_program_falls_back_with_the_reason(s, d):
    ATTN_RES.clear()
    sources, proj, mix_norm, norm = inputs(s, (1, d), torch.float32, 8)
    out = attn_res(sources, proj, mix_norm, 1e-6, norm, 1e-6)
    assert torch.equal(out, attn_res_ref(sources, proj, mix_norm, 1e-6, norm, 1e-6))
    (choice,) = ATTN_RES.choices()
    assert choice.impl == "reference" and "one program a row" in choice.reason


def test_auto_runs_the_kernel_where_triton_can():
    ATTN_RES.clear()
    sources, proj, mix_norm, norm = inputs(3, (2, 40), torch.bfloat16, 9)
    attn_res(sources, proj, mix_norm, 1e-6, norm, 1e-6)
    (choice,) = ATTN_RES.choices()
    assert choice.impl == "triton" and choice.key[1] == ("S=3", "D=40", "bfloat16", "normed")


def run_add_poisoned(sources, addend, proj, mix_norm, eps, norm, norm_eps, **launch):
    dtype = sources[0].dtype if norm is None else torch.promote_types(norm.dtype, sources[0].dtype)
    out = torch.full(sources[0].shape, float("nan"), dtype=dtype, device=sources[0].device)
    partial = torch.full(sources[0].shape, float("nan"), dtype=sources[0].dtype, device=sources[0].device)
    got = attn_res_add_triton(sources, addend, proj, mix_norm, eps, norm, norm_eps, out=out, sum_out=partial,
                              **launch)
    assert got[0] is out and got[1] is partial
    return out, partial


def assert_sum_is_the_models_add(partial, want):
    """The add rounds as torch's does, to nearest even: equal, but for bf16 on the CPU, where Triton's interpreter
    truncates a bf16 cast (one ulp toward zero at most)."""
    assert not partial.isnan().any() and partial.dtype == want.dtype
    if partial.dtype == torch.bfloat16 and partial.device.type == "cpu":
        ulp = torch.finfo(torch.bfloat16).eps * want.float().abs()
        assert ((partial.float() - want.float()).abs() <= ulp).all()
    else:
        assert torch.equal(partial, want)


@given(s=st.integers(1, 10), rows=st.sampled_from([(0,), (1,), (3,), (2, 3), (1, 1)]), d=st.integers(1, 300),
       dtype=st.sampled_from(list(DTYPES)), norm=st.booleans(), seed=st.integers(0, 99),
       group=st.sampled_from([None, 1, 3]))
@example(s=2, rows=(1, 1), d=7168, dtype="bf16", norm=True, seed=0, group=None)   # K3's first mix after an add
@example(s=9, rows=(1, 1), d=7168, dtype="bf16", norm=True, seed=1, group=None)   # K3's widest, four at a time
@example(s=5, rows=(2, 3), d=130, dtype="fp16", norm=False, seed=2, group=None)   # five sources and the addend
def test_add_kernel_equals_reference(s, rows, d, dtype, norm, seed, group):
    """The last source made from its two addends: the sum written out as torch's add, the mix read from it."""
    dt = DTYPES[dtype]
    sources, proj, mix_norm, norm_w = inputs(s + 1, (*rows, d), dt, seed)
    sources, addend = sources[:-1], sources[-1]
    norm_w = norm_w if norm else None
    out, partial = run_add_poisoned(sources, addend, proj, mix_norm, 1e-6, norm_w, 1e-5, group=group)
    ref, ref_partial = attn_res_add_ref(sources, addend, proj, mix_norm, 1e-6, norm_w, 1e-5)
    assert_sum_is_the_models_add(partial, ref_partial)
    # against the mix of the sum the kernel made (on the CPU a bf16 sum may be one ulp off the reference's)
    assert_close_to_reference(out, attn_res_ref([*sources[:-1], partial], proj, mix_norm, 1e-6, norm_w, 1e-5), dt)


def test_add_of_strided_operands():
    """The add's operands as column slices of wider rows and transposed, as the graph hands them."""
    g = torch.Generator().manual_seed(10)
    wide = torch.randn(4, 2, 100, generator=g)
    sources = [torch.randn(4, 2, 60, generator=g), wide[..., 40:]]
    addend = torch.randn(2, 4, 60, generator=g).transpose(0, 1)
    _, proj, mix_norm, norm = inputs(1, (60,), torch.float32, 11)
    out, partial = run_add_poisoned(sources, addend, proj, mix_norm, 1e-6, norm, 1e-6)
    ref, ref_partial = attn_res_add_ref(sources, addend, proj, mix_norm, 1e-6, norm, 1e-6)
    assert torch.equal(partial, ref_partial) and partial.is_contiguous()
    assert_close_to_reference(out, ref, torch.float32)


@pytest.mark.parametrize("norm", [True, False], ids=["normed", "mix"])
def test_add_reference_is_the_models_residual_add_then_mix(norm):
    sources, proj, mix_norm, norm_w = inputs(4, (2, 3, 48), torch.bfloat16, 12)
    blocks, prefix, a = sources[:2], sources[2], sources[3]
    partial = prefix + a                                   # model/modeling.py: prefix = prefix + a
    want = model_attn_res(partial, blocks, proj, mix_norm, 1e-6)
    if norm:
        want = rms_norm(want, norm_w, 1e-5)
    got, got_partial = attn_res_add_ref([*blocks, prefix], a, proj, mix_norm, 1e-6, norm_w if norm else None, 1e-5)
    assert torch.equal(got, want) and torch.equal(got_partial, partial)


def test_add_op_checks_its_addend_and_runs_the_kernel():
    ATTN_RES_ADD.clear()
    sources, proj, mix_norm, norm = inputs(3, (2, 16), torch.float32, 13)
    with pytest.raises(ValueError, match="addend"):
        attn_res_add(sources[:2], sources[2][:1], proj, mix_norm, 1e-6)      # would broadcast
    with pytest.raises(ValueError, match="addend"):
        attn_res_add(sources[:2], sources[2].double(), proj, mix_norm, 1e-6)
    out, partial = attn_res_add(sources[:2], sources[2], proj, mix_norm, 1e-6, norm, 1e-6)
    ref, ref_partial = attn_res_add_ref(sources[:2], sources[2], proj, mix_norm, 1e-6, norm, 1e-6)
    assert torch.equal(partial, ref_partial)
    assert_close_to_reference(out, ref, torch.float32)
    (choice,) = ATTN_RES_ADD.choices()
    assert choice.impl == "triton" and choice.key[1] == ("S=2", "D=16", "float32", "normed")


def test_add_beyond_one_program_falls_back_with_the_reason():
    ATTN_RES_ADD.clear()
    sources, proj, mix_norm, norm = inputs(MAX_SOURCES + 2, (1, 8), torch.float32, 14)
    out, partial = attn_res_add(sources[:-1], sources[-1], proj, mix_norm, 1e-6, norm, 1e-6)
    ref, ref_partial = attn_res_add_ref(sources[:-1], sources[-1], proj, mix_norm, 1e-6, norm, 1e-6)
    assert torch.equal(out, ref) and torch.equal(partial, ref_partial)
    (choice,) = ATTN_RES_ADD.choices()
    assert choice.impl == "reference" and "one program a row" in choice.reason


@pytest.mark.gpu
@pytest.mark.parametrize("pdl", [True, False], ids=["pdl", "plain"])
@pytest.mark.parametrize("s", [2, 9])
@pytest.mark.parametrize("m", [1, 8, 1000])
def test_gpu_kernel_equals_reference_and_replays_in_a_graph(m, s, pdl):
    """K3's width (D 7168, bf16) on the GPU, against the reference; then a CUDA graph replayed on fresh sources with
    a poisoned output, launched with PDL behind the kernel that writes the last source (as the step's residual add
    is), and without."""
    sources, proj, mix_norm, norm = (
        [t.cuda() for t in x] if isinstance(x, list) else x.cuda()
        for x in inputs(s, (m, 1, 7168), torch.bfloat16, m + s))
    out = run_poisoned(sources, proj, mix_norm, 1e-6, norm, 1e-6)
    assert_close_to_reference(out, attn_res_ref(sources, proj, mix_norm, 1e-6, norm, 1e-6), torch.bfloat16)
    writer = torch.empty_like(sources[-1])
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        sources[-1].copy_(writer)
        attn_res_triton(sources, proj, mix_norm, 1e-6, norm, 1e-6, out=out, pdl=pdl)
    fresh = inputs(s, (m, 1, 7168), torch.bfloat16, m + s + 1)[0]
    for src, new in zip(sources[:-1], fresh):
        src.copy_(new)
    writer.copy_(fresh[-1])
    sources[-1].fill_(float("nan"))
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert_close_to_reference(out, attn_res_ref([f.cuda() for f in fresh], proj, mix_norm, 1e-6, norm, 1e-6),
                              torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("s", [2, 9])
@pytest.mark.parametrize("m", [1, 8, 1000])
def test_gpu_add_kernel_equals_reference_and_replays_in_a_graph(m, s):
    """K3's width on the GPU: the sum equal to torch's bf16 add, the mix to the reference; then a CUDA graph that
    writes the addend right before the kernel (launched with PDL, as behind the all-reduce or the latent tail),
    replayed on fresh operands with poisoned outputs."""
    sources, proj, mix_norm, norm = (
        [t.cuda() for t in x] if isinstance(x, list) else x.cuda()
        for x in inputs(s + 1, (m, 1, 7168), torch.bfloat16, m + s))
    sources, addend = sources[:-1], sources[-1]
    out, partial = run_add_poisoned(sources, addend, proj, mix_norm, 1e-6, norm, 1e-6)
    ref, ref_partial = attn_res_add_ref(sources, addend, proj, mix_norm, 1e-6, norm, 1e-6)
    assert_sum_is_the_models_add(partial, ref_partial)
    assert_close_to_reference(out, ref, torch.bfloat16)
    writer = torch.empty_like(addend)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        addend.copy_(writer)
        attn_res_add_triton(sources, addend, proj, mix_norm, 1e-6, norm, 1e-6, out=out, sum_out=partial)
    fresh = [t.cuda() for t in inputs(s + 1, (m, 1, 7168), torch.bfloat16, m + s + 1)[0]]
    for src, new in zip(sources, fresh):
        src.copy_(new)
    writer.copy_(fresh[-1])
    addend.fill_(float("nan"))
    out.fill_(float("nan"))
    partial.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    ref, ref_partial = attn_res_add_ref(fresh[:-1], fresh[-1], proj, mix_norm, 1e-6, norm, 1e-6)
    assert_sum_is_the_models_add(partial, ref_partial)
    assert_close_to_reference(out, ref, torch.bfloat16)
