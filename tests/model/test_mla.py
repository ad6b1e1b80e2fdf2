"""Gated NoPE MLA: the absorbed, cached form against the expanded per-head form of spec §5.2."""
import torch
from hypothesis import example, given, strategies as st

from k3compile.model import KimiK3Config
from k3compile.model.cache import MLAState
from k3compile.model.layers import rms_norm
from k3compile.model.mla import KimiMLAAttention
from k3compile.testing import rel_err as rel


def expanded_reference(attn, x):
    """q = W_qb RMSNorm(W_qa x); [c | k_pe] = W_kva x; [k_nope | v] = W_kvb RMSNorm(c); causal softmax with
    scale (nope+rope)^-1/2; output gate sigmoid(W_g x); o_proj."""
    B, T, _ = x.shape
    H, N, R, Vd = attn.num_heads, attn.nope, attn.rope, attn.v_dim
    q = attn.q_b_proj(rms_norm(attn.q_a_proj(x), attn.q_a_layernorm.weight, 1e-6)).view(B, T, H, N + R)
    lat = attn.kv_a_proj_with_mqa(x)
    c, k_pe = lat[..., :attn.kv_lora_rank], lat[..., attn.kv_lora_rank:]
    kv = attn.kv_b_proj(rms_norm(c, attn.kv_a_layernorm.weight, 1e-6)).view(B, T, H, N + Vd)
    k = torch.cat([kv[..., :N], k_pe[:, :, None].expand(B, T, H, R)], -1)
    v = kv[..., N:]
    scores = torch.einsum("bthd,bshd->bhts", q, k) * (N + R) ** -0.5
    scores = scores.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
    o = torch.einsum("bhts,bshv->bthv", scores.softmax(-1), v)
    o = o * torch.sigmoid(attn.g_proj(x).view(B, T, H, Vd))
    return attn.o_proj(o.reshape(B, T, H * Vd))


@given(st.integers(1, 2), st.integers(1, 9), st.integers(0, 4), st.integers(0, 2**16))
@example(1, 1, 0, 0)
def test_mla_cached_matches_expanded(B, T, extra, seed):
    torch.manual_seed(seed)
    cfg = KimiK3Config.tiny().text_config
    attn = KimiMLAAttention(cfg, 3)
    for p in attn.parameters():
        torch.nn.init.normal_(p, 0, p.shape[-1] ** -0.5 if p.dim() > 1 else 1.0)
    x = torch.randn(B, T + extra, cfg.hidden_size)
    S = T + extra + 3
    state = MLAState(torch.full((B, S, cfg.kv_lora_rank), 0.0), torch.zeros(B, S, cfg.qk_rope_head_dim))
    with torch.no_grad():
        ref = expanded_reference(attn, x)
        out = attn(x[:, :T], state, torch.tensor(0))                  # prefill
        steps = [out] + [attn(x[:, t:t + 1], state, torch.tensor(t)) for t in range(T, T + extra)]  # decode
    assert rel(torch.cat(steps, 1), ref) < 1e-5
