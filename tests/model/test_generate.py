"""generate(): its checks, and left-padded batches (each row generates what it generates alone), eager and
through k3compile.optimize (fp32, CPU).

One compiled micro model for the module (default dynamic, so its first prefill compiles static -- the graphs of
dynamic=False -- and a second prompt length recompiles it dynamic); the checks run on it too, as they must raise
before any compiled graph is entered. The micro model here has two layers, a KDA layer (dense MLP) and an MLA layer
(latent MoE): one of each kind of layer padding reaches, compiled in ~2/3 of the four-layer model's time (the
four-layer model compiled: tests/compiler/test_tiny_k3.py).
"""
from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import example, given, settings, strategies as st

import k3compile
from k3compile.model import KimiK3Config, KimiK3ForConditionalGeneration
from k3compile.model.cache import KDAState
from k3compile.model.kda import KimiDeltaAttention
from k3compile.model.mla import mla_attend
from k3compile.testing import rel_err as rel

VOCAB = 512


@pytest.fixture(scope="module")
def eager():
    """KDA (dense MLP), then MLA (latent MoE)."""
    torch.manual_seed(0)
    return KimiK3ForConditionalGeneration(KimiK3Config.micro(num_hidden_layers=2)).eval()


@pytest.fixture(scope="module")
def compiled(eager):
    """Compiled in place; nothing compiles until the first call (the checks raise before it)."""
    torch._dynamo.reset()
    return k3compile.optimize(copy.deepcopy(eager), backend="reference")


def left_padded(rows: list[torch.Tensor], pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of different lengths -> (ids, attention_mask) [B, max length], padded on the left."""
    T = max(len(r) for r in rows)
    ids = torch.full((len(rows), T), pad_id, dtype=torch.long)
    mask = torch.zeros(len(rows), T, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, T - len(r):] = r
        mask[i, T - len(r):] = 1
    return ids, mask


def random_rows(lengths, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=gen) for n in lengths]


# -- eager -----------------------------------------------------------------------------------------------------
@settings(max_examples=max(5, settings.default.max_examples // 5))
@given(st.lists(st.integers(1, 35), min_size=1, max_size=4), st.integers(0, 2**16))
@example([2, 3], 0)            # the issue's [[4, 5]] against [[0, 4, 5]], in shape
@example([1, 35, 17], 1)       # padding across a whole KDA chunk (16) and into the next
@torch.no_grad()
def test_left_padded_rows_generate_as_alone(eager, lengths, seed):
    rows = random_rows(lengths, seed)
    ids, mask = left_padded(rows, pad_id=seed % VOCAB)
    out = eager.generate(ids, 3, attention_mask=mask)
    for i, row in enumerate(rows):
        assert torch.equal(out[i], eager.generate(row[None], 3)[0]), f"row {i} of lengths {lengths}"


@torch.no_grad()
def test_left_padded_prefill_logits_and_state_equal_alone(eager):
    """Not only the argmax: the logits at real positions, the KDA conv and recurrent states and the MLA
    latents of each row equal that row's own prefill."""
    rows = random_rows([4, 9], seed=3)
    ids, mask = left_padded(rows)
    T = ids.shape[1]
    cache = eager.allocate_cache(2, T)
    cache.set_start(T - mask.sum(1))
    logits = eager(ids, cache=cache)
    for i, row in enumerate(rows):
        n = len(row)
        alone_cache = eager.allocate_cache(1, n)
        alone = eager(row[None], cache=alone_cache)
        assert rel(logits[i, T - n:], alone[0]) < 1e-5
        for state, ref in zip(cache.layers, alone_cache.layers):
            if isinstance(state, KDAState):
                for a, b in zip(state.tensors(), ref.tensors()):
                    assert rel(a[i], b[0]) < 1e-5
            else:
                for a, b in zip(state.tensors(), ref.tensors()):
                    assert rel(a[i, T - n:], b[0]) < 1e-5


@torch.no_grad()
def test_kda_padding_leaves_states_exactly_zero():
    """Padding positions: zeroed inputs before the short convolutions -> conv windows of zeros and k = v = 0,
    so the delta rule keeps the recurrent state exactly zero (not merely small), whatever x holds there."""
    cfg = KimiK3Config.micro().text_config
    torch.manual_seed(1)
    attn = KimiDeltaAttention(cfg, 0)
    for p in attn.parameters():
        torch.nn.init.normal_(p, 0, p.shape[-1] ** -0.5 if p.dim() > 1 else 1.0)
    B, T, P, W = 2, 20, attn.q_conv1d.weight.shape[0], attn.q_conv1d.weight.shape[-1]
    H, K = attn.num_heads, attn.head_dim
    state = KDAState(*(torch.zeros(B, P, W - 1) for _ in range(3)), torch.zeros(B, H, K, K))
    x = torch.randn(B, T, cfg.hidden_size) * 10
    out = attn(x, state, valid=torch.zeros(B, T, dtype=torch.bool))
    assert torch.isfinite(out).all()
    for t in state.tensors():
        assert torch.equal(t, torch.zeros_like(t))


@pytest.mark.parametrize("T", [1, 3], ids=["decode", "prefill"])
def test_mla_attend_hides_keys_before_start(T):
    """Row b over a cache whose first start[b] entries are garbage equals row b over the cache without them."""
    gen = torch.Generator().manual_seed(T)
    B, H, N, R, Lk, Vd, S = 2, 3, 8, 4, 16, 8, 12
    r = lambda *s: torch.randn(*s, generator=gen)
    q_nope, q_pe, w = r(B, T, H, N), r(B, T, H, R), r(H, N + Vd, Lk)
    c_kv, k_pe = r(B, S, Lk), r(B, S, R)
    start = torch.tensor([0, 5])
    c_kv[1, :5], k_pe[1, :5] = 1e4, -1e4                     # garbage behind the padding
    pos = torch.tensor(7)
    out = mla_attend(q_nope, q_pe, c_kv, k_pe, w, pos, 0.1, start)
    for b, s in enumerate(start.tolist()):
        ref = mla_attend(q_nope[b:b + 1], q_pe[b:b + 1], c_kv[b:b + 1, s:], k_pe[b:b + 1, s:], w, pos - s, 0.1)
        assert rel(out[b:b + 1], ref) < 1e-6


def test_mla_attend_padding_query_stays_finite():
    """A prefill query before its row's start has no visible key; it sees its own, so no NaN reaches the cache."""
    q_nope, q_pe, w = torch.randn(1, 4, 2, 8), torch.randn(1, 4, 2, 4), torch.randn(2, 16, 16)
    out = mla_attend(q_nope, q_pe, torch.randn(1, 4, 16), torch.randn(1, 4, 4), w, torch.tensor(0), 0.1,
                     torch.tensor([3]))
    assert torch.isfinite(out).all()


@torch.no_grad()
def test_unpadded_graphs_hold_no_padding_input():
    """Without padding (no mask, or a mask of ones) cache.start stays None: no graph input or op is added; with
    it, the prefill zeroes each KDA layer's q/k/v inputs and the decode step's KDA ops stay as they were.
    (Dynamo graphs of a KDA + MLA micro model, recorded without compiling them.)"""
    codes = []

    def record(gm, inputs):
        codes.append(gm.code)
        return gm.forward

    model = KimiK3ForConditionalGeneration(KimiK3Config.micro(num_hidden_layers=2)).eval()
    torch._dynamo.reset()
    model.compile(backend=record, dynamic=False, fullgraph=True)
    ids = torch.randint(0, VOCAB, (2, 5))
    model.generate(ids, 2, attention_mask=torch.ones_like(ids))
    model.generate(ids, 2)
    assert len(codes) == 2 and not any("cache_start" in c for c in codes)           # prefill, decode
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    model.generate(ids, 2, attention_mask=mask)
    (prefill, decode), (padded_prefill, padded_decode) = codes[:2], codes[2:]
    where = "torch.where("
    assert padded_prefill.count(where) == prefill.count(where) + 3                  # q, k, v of its KDA layer
    assert padded_decode.count(where) == decode.count(where)                        # the KDA step: as before
    assert "cache_start" in padded_decode and "minimum" not in padded_decode       # the MLA mask: start only
    torch._dynamo.reset()


# -- compiled ----------------------------------------------------------------------------------------------------
@pytest.mark.slow
@torch.no_grad()
def test_compiled_left_padded_rows_generate_as_alone(eager, compiled):
    """Two batches with the same cache length (T + new = 8), so the decode graph is reused: a static prefill,
    a decode step, then a dynamic prefill (another T). Each row equals that row generated alone (eager; the
    compiled model equals eager elsewhere: tests/compiler/test_tiny_k3.py)."""
    from torch._dynamo.utils import counters

    counters.clear()
    with torch._inductor.config.patch(fx_graph_cache=False), \
            torch._functorch.config.patch(enable_autograd_cache=False):
        for lengths, new, seed in (([2, 5, 3], 3, 4), ([6, 1, 4], 2, 5)):
            rows = random_rows(lengths, seed)
            ids, mask = left_padded(rows)
            out = compiled.generate(ids, new, attention_mask=mask)
            for i, row in enumerate(rows):
                assert torch.equal(out[i], eager.generate(row[None], new)[0]), f"row {i} of lengths {lengths}"
    assert counters["stats"]["unique_graphs"] == 3
    rep = k3compile.report(compiled)
    prefill, decode = rep.graphs[:2]           # the static graphs: every pass still fires with padding (one KDA
                                               # layer, one MoE layer)
    assert prefill.record.matches["kda_prefill"] == 1 and decode.record.matches["kda_decode"] == 1
    assert prefill.record.matches["latent_moe_tail"] == decode.record.matches["latent_moe_tail"] == 1
    assert decode.record.matches["skinny_gemm"] > 0
    # the MLA attention with start: the decode step's, and the 5-token prefill's (T <= 8: the op takes it too)
    assert prefill.record.matches["mla_decode"] == decode.record.matches["mla_decode"] == 1


# -- checks (eager and compiled: raised before any graph runs) ---------------------------------------------------
def _ids(*shape, dtype=torch.long, fill=1):
    return torch.full(shape, fill, dtype=dtype)


BAD_CALLS = {
    # name: (generate's arguments, exception, message)
    "id-at-vocab": (dict(input_ids=torch.tensor([[1, VOCAB]])), ValueError, f"token id {VOCAB}, outside"),
    "id-negative": (dict(input_ids=torch.tensor([[-1, 3]])), ValueError, "token id -1, outside"),
    "ids-1d": (dict(input_ids=_ids(3)), ValueError, r"2-D \[batch, tokens\], got shape \[3\] \(one prompt"),
    "ids-3d": (dict(input_ids=_ids(1, 2, 3)), ValueError, "2-D"),
    "ids-empty-prompt": (dict(input_ids=_ids(1, 0)), ValueError, "empty"),
    "ids-empty-batch": (dict(input_ids=_ids(0, 3)), ValueError, "empty"),
    "ids-int32": (dict(input_ids=_ids(1, 3, dtype=torch.int32)), TypeError, "int64"),
    "ids-float": (dict(input_ids=_ids(1, 3, dtype=torch.float32)), TypeError, "int64"),
    "ids-list": (dict(input_ids=[[1, 2]]), TypeError, "torch.Tensor"),
    "new-negative": (dict(max_new_tokens=-3), ValueError, "max_new_tokens must be >= 0, got -3"),
    "new-float": (dict(max_new_tokens=2.0), TypeError, "max_new_tokens must be an int"),
    "mask-shape": (dict(attention_mask=_ids(2, 4)), ValueError, r"shape \[2, 4\], input_ids \[2, 3\]"),
    "mask-float": (dict(attention_mask=_ids(2, 3, dtype=torch.float32)), TypeError, "bool or integer"),
    "mask-values": (dict(attention_mask=_ids(2, 3, fill=2)), ValueError, "only 0"),
    "mask-right-padding": (dict(attention_mask=torch.tensor([[1, 1, 1], [1, 1, 0]])), ValueError,
                           "row 1 has padding .* position 2: only left padding"),
    "mask-gap": (dict(attention_mask=torch.tensor([[0, 1, 0], [1, 1, 1]])), ValueError, "row 0"),
    "mask-empty-row": (dict(attention_mask=torch.tensor([[1, 1, 1], [0, 0, 0]])), ValueError,
                       "row 1 has no token"),
    "mask-list": (dict(attention_mask=[[1, 1, 1], [1, 1, 1]]), TypeError, "attention_mask must be"),
    "cache-batch": (dict(cache=("alloc", 3, 16)), ValueError, "batch of 3"),
    "cache-too-small": (dict(cache=("alloc", 2, 5)), ValueError, "cache of length 5 holds 0 tokens; 3 \\+ 4"),
    "pad-into-used-cache": (dict(cache=("used", 2, 16), attention_mask=torch.tensor([[0, 1, 1], [1, 1, 1]])),
                            ValueError, "padding can only begin"),
}


@pytest.mark.parametrize("which", ["eager", "compiled"])
@pytest.mark.parametrize("case", list(BAD_CALLS))
@torch.no_grad()
def test_generate_rejects(request, which, case):
    model = request.getfixturevalue(which)
    kwargs, exc, match = BAD_CALLS[case]
    kwargs = {"input_ids": _ids(2, 3), "max_new_tokens": 4, **kwargs}
    if isinstance(kwargs.get("cache"), tuple):
        how, batch, length = kwargs["cache"]
        kwargs["cache"] = model.allocate_cache(batch, length)
        if how == "used":
            kwargs["cache"].pos.fill_(1)
    with pytest.raises(exc, match=match):
        model.generate(**kwargs)


@pytest.mark.parametrize("which", ["eager", "compiled"])
@torch.no_grad()
def test_forward_rejects_out_of_vocab_id(request, which):
    """A direct call checks its ids before the (compiled) forward too."""
    model = request.getfixturevalue(which)
    with pytest.raises(ValueError, match=f"token id {VOCAB + 7}, outside the vocabulary \\[0, {VOCAB}\\)"):
        model(torch.tensor([[3, VOCAB + 7]]))


@torch.no_grad()
def test_zero_new_tokens_returns_empty(eager):
    out = eager.generate(_ids(2, 3), 0)
    assert out.shape == (2, 0) and out.dtype == torch.long
    with pytest.raises(ValueError, match="row 0 has no token"):      # still checked
        eager.generate(_ids(2, 3), 0, attention_mask=torch.tensor([[0, 0, 0], [1, 1, 1]]))
