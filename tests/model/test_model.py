"""Whole text model, eager fp32 on CPU: prefill + decode equals one longer prefill; generate is greedy."""
import pytest
import torch
from hypothesis import example, given, settings, strategies as st

from k3compile.model import KimiK3Config, KimiK3ForConditionalGeneration
from k3compile.testing import rel_err as rel


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    return KimiK3ForConditionalGeneration(KimiK3Config.tiny()).eval()


@pytest.fixture(scope="module")
def micro_softplus():
    """Kimi Linear's gate, low-rank output gate, no AttnRes (the other code paths)."""
    torch.manual_seed(1)
    cfg = KimiK3Config.micro(attn_res_block_size=None)
    lac = dict(cfg.text_config.linear_attn_config, gate_lower_bound=None, use_full_rank_gate=False)
    cfg.text_config.linear_attn_config = lac
    return KimiK3ForConditionalGeneration(cfg).eval()


@settings(max_examples=max(4, settings.default.max_examples // 6))
@given(st.integers(1, 2), st.integers(2, 20), st.integers(1, 4), st.integers(0, 2**16))
@example(2, 7, 4, 0)
@example(1, 19, 3, 1)   # prefill longer than one KDA chunk
@torch.no_grad()
def test_prefill_then_decode_equals_longer_prefill(tiny, B, T, n, seed):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, tiny.config.text_config.vocab_size, (B, T + n), generator=gen)
    ref = tiny(ids)                                                  # one prefill of T + n tokens
    cache = tiny.allocate_cache(B, T + n + 2)
    steps = [tiny(ids[:, :T], cache=cache)]
    steps += [tiny(ids[:, t:t + 1], cache=cache) for t in range(T, T + n)]
    out = torch.cat(steps, 1)
    assert out.shape == ref.shape and int(cache.pos) == T + n
    assert rel(out, ref) < 1e-5


@torch.no_grad()
def test_other_gate_variants_prefill_decode(micro_softplus):
    m = micro_softplus
    ids = torch.randint(0, 512, (2, 12))
    ref = m(ids)
    cache = m.allocate_cache(2, 12)
    out = torch.cat([m(ids[:, :9], cache=cache)] + [m(ids[:, t:t + 1], cache=cache) for t in range(9, 12)], 1)
    assert rel(out, ref) < 1e-5


@torch.no_grad()
def test_two_prefills_in_a_row(tiny):
    """A second prefill continues the cache (chunked prefill)."""
    ids = torch.randint(0, 512, (1, 15))
    cache = tiny.allocate_cache(1, 15)
    out = torch.cat([tiny(ids[:, :6], cache=cache), tiny(ids[:, 6:], cache=cache)], 1)
    assert rel(out, tiny(ids)) < 1e-5


@torch.no_grad()
def test_generate_is_greedy(tiny):
    ids = torch.randint(0, 512, (2, 5))
    new = tiny.generate(ids, max_new_tokens=4)
    assert new.shape == (2, 4)
    seq = ids
    for i in range(4):
        nxt = tiny(seq)[:, -1].argmax(-1, keepdim=True)
        assert torch.equal(nxt, new[:, i:i + 1])
        seq = torch.cat([seq, nxt], 1)


def test_generate_rejects_overfull_cache(tiny):
    cache = tiny.allocate_cache(1, 4)
    with pytest.raises(ValueError, match="do not fit"):
        tiny.generate(torch.zeros(1, 3, dtype=torch.long), max_new_tokens=4, cache=cache)


def test_layer_schedule(tiny):
    layers = tiny.text_model.layers
    assert [i for i, l in enumerate(layers) if l.is_mla] == [3, 7, 11, 12]
    assert hasattr(layers[0], "mlp") and all(hasattr(l, "block_sparse_moe") for l in layers[1:])
