"""Multi-token prediction (spec §10) and greedy speculative decoding that drafts with it.

MTP layer s (layer index j = num_hidden_layers + s), DeepSeek-V3 structure, AttnRes disabled:
    e   = embed(token_{p+1}), zeroed at position 0        h = target hidden at p (after the output AttnRes,
    x   = eh_proj([enorm(e) ; hnorm(h)])                      before the final norm)
    out = decoder_layer_j(x)                              plain pre-norm residual; attention MLA (j is past the
    logits = shared_head.head(shared_head.norm(out))      last KDA index), FFN latent MoE
    -> predicts token_{p+2}; `out` is recycled as h when drafting further ahead.

Speculative greedy decoding (`speculative_generate`): draft k tokens with the MTP, run the target once
over [pending, d1..dk], accept the longest prefix of drafts equal to the target's argmax, take the
target's next token as a bonus. The target's KDA states are recurrent, so a rejected suffix cannot be
"un-read": the recurrent/conv states are snapshotted before verification and, on a partial accept,
restored and advanced over the accepted tokens only. The result equals plain greedy decoding.

Legend: B batch, T tokens, D hidden, V vocabulary, k draft tokens per step.
"""
from __future__ import annotations

import types
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from .cache import KDAState, KimiK3Cache
from .layers import RMSNorm, VocabParallelHead
from .loading import mtp_key_to_published
from .modeling import KimiDecoderLayer
from .parallel import SINGLE, TPContext


class SharedHead(nn.Module):
    def __init__(self, hidden_size: int, vocab_size: int, eps: float, tp: TPContext = SINGLE):
        super().__init__()
        self.norm = RMSNorm(hidden_size, eps)
        self.head = VocabParallelHead(hidden_size, vocab_size, tp)       # split by vocabulary, like the lm_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(x))


class KimiK3MTPLayer(nn.Module):
    """One MTP depth. Checkpoint names (DeepSeek-V3 layout, under `language_model.model.layers.{j}.`):
    enorm, hnorm, eh_proj, shared_head.{norm,head}, and the decoder layer's own names — here kept under
    `mtp_block.` (see `KimiK3MultiTokenPredictor.published_state_dict_keys`)."""

    def __init__(self, config, layer_idx: int, tp: TPContext = SINGLE):
        super().__init__()
        D, eps = config.hidden_size, config.rms_norm_eps
        self.layer_idx = layer_idx
        self.enorm = RMSNorm(D, eps)
        self.hnorm = RMSNorm(D, eps)
        self.eh_proj = nn.Linear(2 * D, D, bias=False)
        # j >= num_hidden_layers is in no kda_layers list, hence MLA (spec §10: index 93 ⇒ MLA); the
        # 1-based full_attn_layers rule alone would pick KDA here.
        self.mtp_block = KimiDecoderLayer(config, layer_idx, tp, attn_res_block_size=0, is_mla=True)
        self.shared_head = SharedHead(D, config.vocab_size, eps, tp)

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, state, pos: torch.Tensor):
        """embeds [B, T, D] (of token p+1, already zeroed at position 0), hidden [B, T, D] at positions
        pos..pos+T-1 -> (logits [B, T, V] for token p+2, out [B, T, D])."""
        x = self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(hidden)], dim=-1))
        out, _ = self.mtp_block(x, [], state, pos)
        return self.shared_head(out), out


class KimiK3MultiTokenPredictor(nn.Module):
    """`num_nextn_predict_layers` MTP layers; the embedding table is the target's (passed in)."""

    def __init__(self, config, tp: TPContext = SINGLE):
        super().__init__()
        n = config.num_nextn_predict_layers
        if n < 1:
            raise ValueError("num_nextn_predict_layers is 0: this config has no MTP module")
        self.config = config
        self.layers = nn.ModuleList(KimiK3MTPLayer(config, config.num_hidden_layers + s, tp) for s in range(n))
        init_mtp_weights(self)

    def published_state_dict_keys(self) -> dict[str, str]:
        """{our name: published name} with the real layer index j = num_hidden_layers + s."""
        L, prefix = self.config.num_hidden_layers, "language_model.model."
        return {name: mtp_key_to_published("mtp." + name, L).removeprefix(prefix) for name in self.state_dict()}

    def allocate_state(self, batch: int, max_len: int, dtype=None, device=None) -> KimiK3Cache:
        """One attention state per MTP layer, as the target cache allocates them."""
        ref = self.layers[0].eh_proj.weight
        shim = types.SimpleNamespace(embed_tokens=types.SimpleNamespace(weight=ref),
                                     layers=[layer.mtp_block for layer in self.layers])
        return KimiK3Cache.allocate(shim, batch, max_len, dtype=dtype, device=device)

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, cache: KimiK3Cache, depth: int = 0):
        """Run MTP layer `depth` on T positions starting at cache.pos (advances it by T).

        embeds [B, T, D] embeddings of the *next* tokens, hidden [B, T, D] -> (logits [B, T, V], out [B, T, D]).
        """
        T = embeds.shape[1]
        positions = cache.pos + torch.arange(T, device=embeds.device)
        embeds = embeds.masked_fill((positions == 0)[None, :, None], 0.0)       # spec: zero at position 0
        logits, out = self.layers[depth](embeds, hidden, cache.layers[depth], cache.pos)
        cache.pos.add_(T)
        return logits, out


@torch.no_grad()
def init_mtp_weights(module: nn.Module) -> None:
    """O(1)-activation random init (same rules as the target's test init); loading overwrites it."""
    for name, p in module.named_parameters():
        leaf = name.rsplit(".", 1)[-1]
        if name.endswith("e_score_correction_bias"):
            p.normal_(0, 0.05)
        elif "norm" in name and leaf == "weight":
            p.fill_(1.0)
        elif p.dim() >= 2:
            bound = p.shape[-1] ** -0.5
            p.uniform_(-bound, bound)


# ----------------------------------------------------------------------------------------------
# Speculative greedy decoding
# ----------------------------------------------------------------------------------------------

def snapshot_recurrent(cache: KimiK3Cache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Copies of everything a rejected token could corrupt: KDA recurrent/conv states and pos.
    (MLA caches need no copy: entries at or past pos are masked and overwritten.)"""
    pairs = [(cache.pos, cache.pos.clone())]
    for state in cache.layers:
        if isinstance(state, KDAState):
            pairs += [(t, t.clone()) for t in state.tensors()]
    return pairs


def restore(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    for live, saved in pairs:
        live.copy_(saved)  # in place: compiled graphs keep pointing at the same tensors


@dataclass
class SpeculativeResult:
    tokens: torch.Tensor     # [B, max_new_tokens], equal to plain greedy decoding
    num_drafted: int         # draft tokens proposed (per sequence)
    num_accepted: int        # of which accepted
    target_calls: int        # target forward passes (prefill, verifications and re-runs)

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted / self.num_drafted if self.num_drafted else 0.0


class MTPSpeculator:
    """Drafts with a `KimiK3MultiTokenPredictor` for a target `KimiK3ForConditionalGeneration`.

    State: the MTP cache has consumed positions < mtp cache.pos; `pending_hidden` holds the target's
    hidden states for the positions the MTP has not consumed yet.
    """

    def __init__(self, model, mtp: KimiK3MultiTokenPredictor):
        self.model, self.mtp = model, mtp

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model.get_input_embeddings()(tokens)

    def propose(self, pending_hidden: torch.Tensor, next_tokens: torch.Tensor, cache: KimiK3Cache,
                k: int) -> torch.Tensor:
        """Catch the MTP up on (hidden_p, token_{p+1}) pairs, then draft k tokens -> [B, k].

        pending_hidden [B, n, D] and next_tokens [B, n] (the last is the target's pending token).
        Leaves the MTP cache right after the catch-up (draft-ahead steps are rolled back).
        """
        logits, out = self.mtp(self.embed(next_tokens), pending_hidden, cache)
        drafts = [logits[:, -1:].argmax(-1)]                                    # [B, 1]
        caught_up = snapshot_recurrent(cache)
        h = out[:, -1:]
        for _ in range(k - 1):  # the single MTP layer reused on its own output (depth-1 chain)
            logits, h = self.mtp(self.embed(drafts[-1]), h, cache)
            drafts.append(logits.argmax(-1))
        restore(caught_up)
        return torch.cat(drafts, dim=1)


@torch.no_grad()
def speculative_generate(model, mtp: Optional[KimiK3MultiTokenPredictor], input_ids: torch.Tensor,
                         max_new_tokens: int, num_draft_tokens: int = 3, speculator: Optional[MTPSpeculator] = None,
                         **forward_kwargs) -> SpeculativeResult:
    """Greedy decoding of `model`, drafting `num_draft_tokens` per step with `mtp`; tokens equal
    `model.generate(input_ids, max_new_tokens, **forward_kwargs)`.

    Args:
        mtp: the drafter; None = the model's own (`model.mtp`, present when num_nextn_predict_layers > 0).
        input_ids: [B, T] int64 prompt. In a batch every sequence advances by the shortest accepted
            prefix of the batch (still exact, fewer tokens accepted).
        forward_kwargs: given to the prefill only (pixel_values, grid_thws); the MTP drafts from the
            token embeddings, so image positions only lower its acceptance, never the exactness.
    Returns:
        SpeculativeResult(tokens [B, max_new_tokens], num_drafted, num_accepted, target_calls);
        `.acceptance_rate` = accepted / drafted.
    """
    if num_draft_tokens < 1:
        raise ValueError(f"num_draft_tokens must be >= 1, got {num_draft_tokens}")
    if mtp is None:
        mtp = getattr(model, "mtp", None)
        if mtp is None:
            raise ValueError("the model has no MTP module (num_nextn_predict_layers = 0): pass one as `mtp`")
    B, T = input_ids.shape
    if max_new_tokens < 1:
        return SpeculativeResult(input_ids.new_zeros(B, 0), 0, 0, 0)
    spec = speculator or MTPSpeculator(model, mtp)
    k = num_draft_tokens
    max_len = T + max_new_tokens + k + 1
    cache = model.allocate_cache(B, max_len, device=input_ids.device)
    mtp_cache = mtp.allocate_state(B, max_len, dtype=model.dtype, device=input_ids.device)

    logits, hidden = model(input_ids, cache=cache, return_hidden=True, **forward_kwargs)
    pending = logits[:, -1:].argmax(-1)                                         # [B, 1], not yet fed
    out = [pending]
    n_out, calls, drafted, accepted = 1, 1, 0, 0
    pending_hidden, next_tokens = hidden, torch.cat([input_ids[:, 1:], pending], dim=1)

    while n_out < max_new_tokens:
        drafts = spec.propose(pending_hidden, next_tokens, mtp_cache, k)        # [B, k]
        saved = snapshot_recurrent(cache)
        verify_in = torch.cat([pending, drafts], dim=1)                         # [B, k+1]
        logits, hidden = model(verify_in, cache=cache, return_hidden=True)
        calls += 1
        greedy = logits.argmax(-1)                                              # [B, k+1]
        match = (drafts == greedy[:, :k]).long().cumprod(dim=1)                 # 1 while drafts agree
        n = int(match.sum(dim=1).min())                                         # accepted for all rows
        drafted += k
        accepted += n
        if n < k:  # re-read only the accepted tokens so the recurrent states hold no rejected draft
            restore(saved)
            _, hidden = model(verify_in[:, :n + 1], cache=cache, return_hidden=True)
            calls += 1
        new = greedy[:, :n + 1]                                                 # d1..dn (= greedy) + bonus
        out.append(new)
        n_out += n + 1
        pending_hidden = hidden[:, :n + 1]
        next_tokens = new
        pending = new[:, -1:]
    return SpeculativeResult(torch.cat(out, dim=1)[:, :max_new_tokens], drafted, accepted, calls)
