"""Block AttnRes mixing against fla's naive_attnres (a reference nobody here wrote)."""
import pytest
import torch
from hypothesis import example, given, strategies as st

from k3compile.model.attn_res import attn_res
from k3compile.testing import rel_err as rel

fla_attnres = pytest.importorskip("fla.ops.attnres.naive")


@given(st.tuples(st.integers(0, 9), st.integers(1, 3), st.integers(1, 9), st.sampled_from([16, 128, 7168]),
                 st.sampled_from([torch.float32, torch.bfloat16]), st.integers(0, 2**16)))
@example((8, 1, 1, 7168, torch.bfloat16, 0))   # K3 decode: 8 stored blocks + the partial sum
def test_attn_res_matches_fla(case):
    N, B, T, D, dtype, seed = case
    gen = torch.Generator().manual_seed(seed)
    blocks = [torch.randn(B, T, D, generator=gen).mul(1 + i).to(dtype) for i in range(N)]
    prefix = torch.randn(B, T, D, generator=gen).to(dtype)
    proj = torch.randn(1, D, generator=gen) * D ** -0.5
    norm = torch.randn(D, generator=gen).abs() + 0.5
    eps = 1e-5
    out = attn_res(prefix, blocks, proj.to(dtype), norm.to(dtype), eps)
    # fla: key = RMSNorm(v; rms_weight), score = key . query -> our norm weight and pseudo-query (proj)
    ref = fla_attnres.naive_attnres(proj.to(dtype).reshape(-1), [*blocks, prefix], norm.to(dtype), rms_eps=eps)
    assert out.dtype == dtype and out.shape == prefix.shape
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert rel(out, ref) < tol
