"""The latent-MoE tail's two-kernel path (``split.py``): the Triton RMSNorm, then the up-projection with the
shared add (the skinny GEMM's own pick, the Triton skinny kernel, or cuBLAS ``addmm_``), against the reference.

On CPU the Triton kernels run under TRITON_INTERPRET=1 (set by conftest): PDL is then a no-op.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

from k3compile.ops.latent_moe_tail.reference import kimi_rms_norm
from k3compile.ops.latent_moe_tail.split import GEMMS, SplitConfig, kimi_rms_norm_triton, latent_moe_tail_split
from k3compile.ops import arrival_counters
from k3compile.ops.latent_moe_tail.reference import latent_moe_tail_ref
from k3compile.testing import latent_moe_tail_inputs as make_inputs, rel_err

# as in test_latent_moe_tail.py (pytest's importlib mode keeps test modules from importing each other)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
TOL = {torch.float32: 1e-5, torch.bfloat16: 3e-2, torch.float16: 5e-3}
GPU_TOL = {torch.float32: 1e-4, torch.bfloat16: 1e-2, torch.float16: 2e-3}


def truth(latent, shared, norm_weight, up_weight, eps):
    return latent_moe_tail_ref(latent.float(), shared.float(), norm_weight.float(), up_weight.float(), eps)

# ---------------------------------------------------------------------------------------------
# the split path: Triton norm + skinny GEMM

# the interpreter truncates fp32 -> bf16 / fp16 (a GPU rounds): one unit in the last place of the dtype
NORM_TOL = {torch.float32: 1e-6, torch.bfloat16: 2 ** -7, torch.float16: 2 ** -10}


@given(m=st.integers(1, 16), l=st.integers(1, 300), dtype=st.sampled_from(list(DTYPES)),
       eps=st.sampled_from([1e-6, 1e-5, 1e-2]), strided=st.booleans(), seed=st.integers(0, 2**16))
@example(m=1, l=3584, dtype="bf16", eps=1e-5, strided=False, seed=0)
@example(m=16, l=3584, dtype="bf16", eps=1e-5, strided=True, seed=1)
def test_triton_norm_matches_model_norm(m, l, dtype, eps, strided, seed):
    """The split path's first kernel rounds as the model's KimiRMSNorm (normalised value, then weight)."""
    dt = DTYPES[dtype]
    latent, _, norm_weight, _ = make_inputs(m, l, 1, dt, seed)
    if strided:
        latent = torch.cat([latent, latent], 1)[:, ::2]
    out = torch.full((m, l), float("nan"), dtype=dt)
    kimi_rms_norm_triton(latent, norm_weight, eps, out=out)
    ref = kimi_rms_norm(latent, norm_weight, eps)
    # elementwise: each value within a few units in the last place of the model's value
    assert not out.isnan().any()
    worst = ((out.double() - ref.double()).abs() / ref.double().abs().clamp_min(1e-3)).max().item()
    assert worst <= 4 * NORM_TOL[dt], f"M{m}-L{l}-{dtype}-eps{eps}-strided{strided}: {worst}"


@pytest.mark.parametrize("m,l,d", [(1, 40, 24), (16, 3584, 7168), (5, 300, 9000)],
                         ids=lambda v: str(v))
def test_norm_kernel_copies_shared_exactly(m, l, d):
    """The addmm path's norm kernel also copies ``shared`` into the output buffer (a strided source here)."""
    latent, _, norm_weight, _ = make_inputs(m, l, 1, torch.bfloat16, seed=5)
    src = torch.randn(m, 2 * d).to(torch.bfloat16)[:, ::2]
    dst = torch.full((m, d), float("nan"), dtype=torch.bfloat16)
    normed = torch.full((m, l), float("nan"), dtype=torch.bfloat16)
    kimi_rms_norm_triton(latent, norm_weight, 1e-5, out=normed, copy=(src, dst))
    assert torch.equal(dst, src)
    assert not normed.isnan().any()


@given(m=st.integers(1, 16), l=st.integers(1, 300), d=st.integers(1, 160),
       dtype=st.sampled_from(list(DTYPES)), eps=st.sampled_from([1e-6, 1e-5]), gemm=st.sampled_from(GEMMS),
       pdl=st.booleans(), seed=st.integers(0, 2**16))
@example(m=16, l=3584, d=64, dtype="bf16", eps=1e-5, gemm="pick", pdl=False, seed=1)
@example(m=4, l=256, d=40, dtype="bf16", eps=1e-5, gemm="pick", pdl=False, seed=2)
@example(m=16, l=3584, d=64, dtype="bf16", eps=1e-5, gemm="triton", pdl=True, seed=3)
@example(m=16, l=3584, d=64, dtype="bf16", eps=1e-5, gemm="addmm", pdl=True, seed=4)
def test_split_norm_then_gemm_matches_reference(m, l, d, dtype, eps, gemm, pdl, seed):
    """Triton norm, then the up-projection with residual = shared: the skinny GEMM's pick (its Triton kernel here),
    the Triton skinny kernel directly, or addmm; ``pdl`` (the norm's launch: a no-op off the GPU)."""
    dt = DTYPES[dtype]
    args = make_inputs(m, l, d, dt, seed)
    out = latent_moe_tail_split(*args, eps, config=SplitConfig(gemm=gemm, pdl=pdl))
    # relative to the sum of the terms' magnitudes: shared may cancel the product (one output at D = 1)
    latent, shared, norm_weight, up_weight = (t.float() for t in args)
    scale = (kimi_rms_norm(latent, norm_weight, eps).abs() @ up_weight.abs().T + shared.abs()).norm()
    err = ((out.float() - truth(*args, eps)).norm() / scale).item()
    assert err < TOL[dt], f"M{m}-L{l}-D{d}-{dtype}-eps{eps}-{gemm}-pdl{pdl}: {err}"


def test_split_gemm_always_streams_the_weight_early(monkeypatch):
    """Inside the split path only the norm kernel can run when the GEMM starts: the GEMM gets
    static_weight=True whatever the caller proved (split.py's docstring); an empty latent launches no norm,
    so not there."""
    from k3compile.ops.skinny_gemm import dispatch as gemm_dispatch
    from k3compile.ops.skinny_gemm import triton as gemm_triton

    calls = []

    def spy(a, w, bias=None, residual=None, *rest, static_weight=False, **kw):
        calls.append(static_weight)
        return torch.zeros(a.shape[0], w.shape[0], dtype=a.dtype)

    monkeypatch.setattr(gemm_triton, "skinny_gemm_triton", spy)
    monkeypatch.setattr(gemm_dispatch, "run_auto", spy)
    args = make_inputs(2, 32, 16, torch.float32, 0)
    latent_moe_tail_split(*args, 1e-5, config=SplitConfig(gemm="triton", pdl=True))
    latent_moe_tail_split(*args, 1e-5, config=SplitConfig(gemm="pick"))
    latent_moe_tail_split(*make_inputs(0, 32, 16, torch.float32, 0), 1e-5)
    assert calls == [True, True, False]


def test_split_config_rejects_unknown_gemm():
    with pytest.raises(ValueError, match="gemm must be one of"):
        SplitConfig(gemm="cublas")


@pytest.mark.gpu
@pytest.mark.parametrize("cfg,m", [(SplitConfig(gemm="pick", pdl=True), 16), (SplitConfig(gemm="addmm", pdl=True), 16),
                                   (SplitConfig(gemm="triton", pdl=True), 16), (SplitConfig(gemm="triton", pdl=True),
                                                                                1)],
                         ids=lambda v: v.tag() if isinstance(v, SplitConfig) else f"M{v}-L3584-D7168")
def test_cuda_split_graph_replay(cfg, m):
    """The two-kernel path (PDL norm; the GEMM streams the weight under it), two calls back to back in one
    CUDA graph, replayed on fresh inputs: every replay right."""
    l, d, dt = 3584, 7168, torch.bfloat16
    lat, sh, g, w = (t.cuda() for t in make_inputs(m, l, d, dt, seed=12))
    outs = []

    def call():
        outs.append(latent_moe_tail_split(lat, sh, g, w, 1e-5, config=cfg))
        outs.append(latent_moe_tail_split(lat, sh, g, w, 1e-5, config=cfg))

    call()   # compiles, makes counters
    torch.cuda.synchronize()
    outs.clear()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    for seed in range(3):
        lat2, sh2, _, _ = make_inputs(m, l, d, dt, seed=30 + seed)
        lat.copy_(lat2)
        sh.copy_(sh2)
        for o in outs:
            o.fill_(float("nan"))
        graph.replay()
        ref = truth(lat.cpu(), sh.cpu(), g.cpu(), w.cpu(), 1e-5)
        for o in outs:
            assert rel_err(o.cpu(), ref) < GPU_TOL[dt], cfg.tag()
    torch.cuda.synchronize()
    assert arrival_counters.all_zero()
