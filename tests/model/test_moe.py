"""Latent MoE: routing, the gathered (decode) and dense (prefill) expert paths, the whole block, against a
per-token loop written from the spec (§6.2)."""
import torch
import torch.nn.functional as F
from hypothesis import example, given, strategies as st

from k3compile.model import KimiK3Config
from k3compile.model.layers import situ_glu
from k3compile.model.moe import KimiLatentMoE, experts_dense, experts_gathered, route
from k3compile.testing import rel_err as rel


def situ_ref(x, beta):
    return beta * torch.tanh(x / beta) * torch.sigmoid(x)


def loop_reference(x, moe):
    """Spec §6.2 token by token, expert by expert, in float64."""
    cfg_beta, cfg_lb = moe.beta, moe.linear_beta
    x = x.double()
    out = torch.zeros_like(x)
    for m in range(x.shape[0]):
        s = torch.sigmoid(moe.gate.weight.double() @ x[m])
        chosen = sorted(range(s.shape[0]), key=lambda e: -(s[e] + moe.gate.e_score_correction_bias[e]).item())
        chosen = chosen[:moe.top_k]
        w = s[chosen] / (s[chosen].sum() + 1e-20) * moe.scaling
        z = moe.routed_expert_down_proj.weight.double() @ x[m]
        y = torch.zeros_like(z)
        for wk, e in zip(w, chosen):
            h = situ_ref(moe.experts.w1[e].double() @ z, cfg_beta) * (cfg_lb * torch.tanh(moe.experts.w3[e].double() @ z / cfg_lb))
            y += wk * (moe.experts.w2[e].double() @ h)
        y = y * torch.rsqrt(y.pow(2).mean() + moe.routed_expert_norm.eps) * moe.routed_expert_norm.weight.double()
        sh = moe.shared_experts
        hs = situ_ref(sh.gate_proj.weight.double() @ x[m], cfg_beta) * (cfg_lb * torch.tanh(sh.up_proj.weight.double() @ x[m] / cfg_lb))
        out[m] = moe.routed_expert_up_proj.weight.double() @ y + sh.down_proj.weight.double() @ hs
    return out


@given(st.integers(1, 24), st.integers(0, 2**16))
@example(1, 0)
@example(16, 1)
def test_latent_moe_matches_loop_reference(M, seed):
    torch.manual_seed(seed)
    cfg = KimiK3Config.tiny().text_config
    moe = KimiLatentMoE(cfg)
    for p in moe.parameters():
        torch.nn.init.normal_(p, 0, p.shape[-1] ** -0.5 if p.dim() > 1 else 0.3)
    x = torch.randn(M, cfg.hidden_size)
    with torch.no_grad():
        out = moe(x[None])[0]
    assert rel(out, loop_reference(x, moe)) < 1e-5


@given(st.tuples(st.integers(1, 20), st.sampled_from([4, 16, 33]), st.integers(1, 4), st.integers(0, 2**16)),
       st.sampled_from([torch.float32, torch.bfloat16]))
def test_gathered_equals_dense(case, dtype):
    M, E, A, seed = case
    A = min(A, E)
    L, I = 24, 40
    gen = torch.Generator().manual_seed(seed)
    z = torch.randn(M, L, generator=gen).to(dtype)
    w1 = (torch.randn(E, I, L, generator=gen) * L ** -0.5).to(dtype)
    w3 = (torch.randn(E, I, L, generator=gen) * L ** -0.5).to(dtype)
    w2 = (torch.randn(E, L, I, generator=gen) * I ** -0.5).to(dtype)
    x = torch.randn(M, 32, generator=gen)
    weights, experts = route(x, torch.randn(E, 32, generator=gen), torch.randn(E, generator=gen) * 0.1, A, True, 1.0)
    assert weights.dtype == torch.float32 and torch.allclose(weights.sum(-1), torch.ones(M))
    a = experts_gathered(z, experts, weights, w1, w3, w2, 4.0, 25.0)
    b = experts_dense(z, experts, weights, w1, w3, w2, 4.0, 25.0)
    assert a.dtype == dtype and b.dtype == dtype
    assert rel(a.float(), b.float()) < (1e-5 if dtype == torch.float32 else 2e-2)


def test_route_selects_by_biased_score_but_weights_by_raw_score():
    x = torch.eye(4)
    weight = torch.eye(4) * 4.0                                   # token m scores expert m highest
    bias = torch.tensor([0.0, 0.0, 0.0, 10.0])                    # expert 3 always selected ...
    w, idx = route(x, weight, bias, 2, True, 2.0)
    assert (idx == 3).any(-1).all()
    s = torch.sigmoid(x @ weight.t())
    expect = s.gather(-1, idx)
    expect = expect / expect.sum(-1, keepdim=True) * 2.0          # ... but weighted by its unbiased score
    assert torch.allclose(w, expect)


def test_situ_glu_formula():
    g, u = torch.randn(50) * 10, torch.randn(50) * 60
    ref = 4 * torch.tanh(g / 4) * torch.sigmoid(g) * 25 * torch.tanh(u / 25)
    assert torch.allclose(situ_glu(g, u, 4.0, 25.0), ref)
    assert torch.allclose(situ_glu(g, u, None, None), F.silu(g) * u)
