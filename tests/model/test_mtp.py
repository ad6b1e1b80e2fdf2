"""MTP module (spec §10) and greedy speculative decoding: exactly the tokens of plain greedy decoding."""
import pytest
import torch

from k3compile.model import KimiK3Config, KimiK3ForConditionalGeneration
from k3compile.model.mtp import KimiK3MultiTokenPredictor, MTPSpeculator, speculative_generate
from k3compile.testing import rel_err as rel

N_NEW = 8


def build(cfg, seed=0):
    torch.manual_seed(seed)
    model = KimiK3ForConditionalGeneration(cfg).eval()
    return model, model.mtp                                # the model owns its MTP module


@pytest.fixture(scope="module")
def micro():
    """Micro config (4 layers) with one MTP layer, a B=2 prompt and its plain greedy continuation."""
    model, mtp = build(KimiK3Config.micro(num_nextn_predict_layers=1))
    prompt = torch.randint(3, 512, (2, 6), generator=torch.Generator().manual_seed(5))
    greedy = model.generate(prompt, N_NEW)
    return model, mtp, prompt, greedy


def test_mtp_layer_structure_and_published_names(micro):
    model, mtp, _, _ = micro
    layer = mtp.layers[0]
    assert layer.layer_idx == 4 and layer.mtp_block.is_mla and hasattr(layer.mtp_block, "block_sparse_moe")
    names = mtp.published_state_dict_keys()
    assert not any("_res_" in n for n in names)  # AttnRes disabled: no res norms/projections
    assert {"layers.4.enorm.weight", "layers.4.hnorm.weight", "layers.4.eh_proj.weight",
            "layers.4.shared_head.norm.weight", "layers.4.shared_head.head.weight",
            "layers.4.self_attn.kv_a_proj_with_mqa.weight", "layers.4.block_sparse_moe.gate.weight",
            "layers.4.input_layernorm.weight"} <= set(names.values())
    assert mtp.layers[0].eh_proj.weight.shape == (128, 256)


def test_mtp_forward_matches_formula(micro):
    model, mtp, prompt, _ = micro
    layer = mtp.layers[0]
    B, T, D = 2, 5, 128
    hidden = torch.randn(B, T, D)
    tokens = prompt[:, 1:6]
    with torch.no_grad():
        logits, out = mtp(model.get_input_embeddings()(tokens), hidden, mtp.allocate_state(B, 8))
        e = model.get_input_embeddings()(tokens).clone()
        e[:, 0] = 0  # position 0
        x = layer.eh_proj(torch.cat([layer.enorm(e), layer.hnorm(hidden)], -1))   # embedding first
        blk, state = layer.mtp_block, mtp.allocate_state(B, 8).layers[0]
        h = x + blk.self_attn(blk.input_layernorm(x), state, torch.zeros((), dtype=torch.long))
        want_out = h + blk.block_sparse_moe(blk.post_attention_layernorm(h))
        want_logits = layer.shared_head.head(layer.shared_head.norm(want_out))
    assert rel(out, want_out) < 1e-6 and rel(logits, want_logits) < 1e-6


def test_mtp_prefill_equals_step_by_step(micro):
    model, mtp, prompt, _ = micro
    hidden = torch.randn(2, 5, 128)
    emb = model.get_input_embeddings()(prompt[:, 1:6])
    with torch.no_grad():
        full, _ = mtp(emb, hidden, mtp.allocate_state(2, 8))
        cache = mtp.allocate_state(2, 8)
        steps = torch.cat([mtp(emb[:, i:i + 1], hidden[:, i:i + 1], cache)[0] for i in range(5)], dim=1)
    assert int(cache.pos) == 5
    assert rel(steps, full) < 1e-5


@pytest.mark.parametrize("k", [1, 2], ids=["k1", "k2"])
def test_speculative_equals_plain_greedy(micro, k):
    model, mtp, prompt, greedy = micro
    res = speculative_generate(model, mtp, prompt, N_NEW, num_draft_tokens=k)
    assert torch.equal(res.tokens, greedy)
    assert 0.0 <= res.acceptance_rate <= 1.0 and res.num_drafted > 0


class OracleSpeculator(MTPSpeculator):
    """Runs the MTP as usual (so its cache logic is exercised) but proposes the known greedy tokens,
    wrong at a chosen draft index every other step, to drive full and partial acceptance."""

    def __init__(self, model, mtp, full_sequence, corrupt_every_other):
        super().__init__(model, mtp)
        self.full, self.corrupt, self.calls = full_sequence, corrupt_every_other, 0

    def propose(self, pending_hidden, next_tokens, cache, k):
        drafts = super().propose(pending_hidden, next_tokens, cache, k)
        c = int(cache.pos)  # position of the pending token
        oracle = self.full[:, c + 1:c + 1 + k]
        drafts[:, :oracle.shape[1]] = oracle
        if self.corrupt and self.calls % 2 == 1:
            j = self.calls % k
            drafts[:, j] = (drafts[:, j] + 1) % 512
        self.calls += 1
        return drafts


@pytest.mark.parametrize("corrupt", [False, True], ids=["all-accepted", "partly-rejected"])
def test_speculative_with_oracle_drafts(micro, corrupt):
    model, mtp, prompt, greedy = micro
    spec = OracleSpeculator(model, mtp, torch.cat([prompt, greedy], dim=1), corrupt)
    res = speculative_generate(model, mtp, prompt, N_NEW, num_draft_tokens=3, speculator=spec)
    assert torch.equal(res.tokens, greedy)
    if corrupt:
        assert 0.0 < res.acceptance_rate < 1.0
    else:
        # 1 prefill + 2 verifications of 3 drafts + 1 bonus each (1 + 4 + 4 >= 8), no re-runs
        assert res.target_calls == 3 and res.num_accepted == 6 and res.num_drafted == 6
        assert res.acceptance_rate == 1.0


def test_speculative_tiny_config():
    model, mtp = build(KimiK3Config.tiny(num_nextn_predict_layers=1), seed=1)
    prompt = torch.randint(3, 512, (1, 5), generator=torch.Generator().manual_seed(9))
    greedy = model.generate(prompt, 5)
    res = speculative_generate(model, mtp, prompt, 5, num_draft_tokens=2)
    assert torch.equal(res.tokens, greedy)


def test_bad_arguments_raise(micro):
    model, mtp, prompt, _ = micro
    with pytest.raises(ValueError, match="num_draft_tokens"):
        speculative_generate(model, mtp, prompt, 4, num_draft_tokens=0)
    with pytest.raises(ValueError, match="num_nextn_predict_layers"):
        KimiK3MultiTokenPredictor(KimiK3Config.micro().text_config)
