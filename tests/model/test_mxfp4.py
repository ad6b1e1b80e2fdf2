"""MXFP4 experts: the format against its definition (value = E2M1(code) * 2^(scale - 127)), quantisation round
trips, and the packed expert functions and model against the float ones on the same dequantised values, bitwise."""
import copy

import pytest
import torch
from hypothesis import example, given, strategies as st

from k3compile.model import KimiK3Config, KimiK3ForConditionalGeneration, TPContext
from k3compile.model import moe
from k3compile.model.moe import (Experts, dense_chunk_experts, experts_dense, experts_dense_mxfp4, experts_gathered,
                                 experts_gathered_mxfp4, route)
from k3compile.model.mxfp4 import E2M1, GROUP, dequantize_mxfp4, quantize_mxfp4

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def reference(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The definition, element by element in float64, then one rounding to ``dtype``."""
    codes = torch.stack([packed & 0xF, packed >> 4], -1).flatten(-2).long()
    sign = torch.where(codes >= 8, -1.0, 1.0).double()
    magnitude = torch.tensor(E2M1, dtype=torch.float64)[codes & 7]
    factor = torch.tensor([2.0 ** (s - 127) for s in range(255)], dtype=torch.float64)[scale.long()]
    return (sign * magnitude * factor.repeat_interleave(GROUP, -1)).to(dtype)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal including the sign of zeros and infinities."""
    return torch.equal(a, b) and torch.equal(torch.signbit(a), torch.signbit(b))


@given(st.tuples(st.integers(1, 3), st.integers(1, 5), st.integers(1, 3), st.integers(0, 2 ** 16)),
       st.sampled_from(DTYPES), st.sampled_from(["any", "extremes"]))
@example((1, 2, 1, 0), torch.float32, "extremes")
@example((2, 3, 2, 1), torch.bfloat16, "extremes")
def test_dequantize_matches_definition(case, dtype, scales):
    lead, R, groups, seed = case
    gen = torch.Generator().manual_seed(seed)
    packed = torch.randint(0, 256, (lead, R, groups * GROUP // 2), generator=gen, dtype=torch.uint8)
    packed[..., 0] = 0x80                                                 # codes 0 (+0) and 8 (-0)
    if scales == "extremes":
        scale = torch.tensor([0, 254], dtype=torch.uint8)[torch.randint(0, 2, (lead, R, groups), generator=gen)]
    else:
        scale = torch.randint(0, 255, (lead, R, groups), generator=gen, dtype=torch.uint8)
    out = dequantize_mxfp4(packed, scale, dtype)
    assert out.shape == (lead, R, groups * GROUP) and out.dtype == dtype
    assert same_bits(out, reference(packed, scale, dtype))


def test_dequantize_hand_computed():
    # byte 0x2B: low nibble 0xB = sign + code 3 -> -1.5, high nibble 0x2 -> +1.0
    # byte 0xF7: low 0x7 -> 6.0, high 0xF -> -6.0;   byte 0x90: low 0 -> 0, high 0x9 -> -0.5
    packed = torch.tensor([[0x2B, 0xF7, 0x90] + [0x00] * 13, [0x44] * 16], dtype=torch.uint8)   # 32 columns
    scale = torch.tensor([[128], [125]], dtype=torch.uint8)                                     # x2, x1/4
    out = dequantize_mxfp4(packed, scale, torch.float32)
    assert out[0, :6].tolist() == [-3.0, 2.0, 12.0, -12.0, 0.0, -1.0]
    assert torch.equal(out[0, 6:], torch.zeros(26)) and torch.equal(out[1], torch.full((32,), 0.5))
    # scale 0 is 2^-127 (subnormal in fp32): 0.5 * 2^-127 = 2^-128; scale 254 is 2^127
    tiny = dequantize_mxfp4(torch.tensor([[0x01] + [0] * 15], dtype=torch.uint8), torch.zeros(1, 1, dtype=torch.uint8),
                            torch.float32)
    assert tiny[0, 0].item() == 2.0 ** -128
    big = dequantize_mxfp4(torch.tensor([[0x31] + [0] * 15], dtype=torch.uint8),
                           torch.full((1, 1), 254, dtype=torch.uint8), torch.float32)
    assert big[0, :2].tolist() == [2.0 ** 126, 1.5 * 2.0 ** 127]


def test_dequantize_rejects_bad_shapes_and_dtypes():
    with pytest.raises(ValueError, match="shapes"):
        dequantize_mxfp4(torch.zeros(2, 16, dtype=torch.uint8), torch.zeros(2, 2, dtype=torch.uint8))
    with pytest.raises(ValueError, match="uint8"):
        dequantize_mxfp4(torch.zeros(2, 16), torch.zeros(2, 1, dtype=torch.uint8))


@given(st.integers(1, 4), st.integers(1, 3), st.integers(-120, 120), st.integers(0, 2 ** 16))
@example(2, 2, -120, 0)
@example(1, 1, 120, 1)
def test_quantize_round_trips_representable_values(R, groups, exponent, seed):
    """Values of the form E2M1 * 2^e (each group with its own e near ``exponent``) come back exactly; a group whose
    largest magnitude is 6 * 2^e gets scale e + 127 and its own codes back."""
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (R, groups, GROUP), generator=gen)
    codes[..., 0] = 7 + 8 * torch.randint(0, 2, (R, groups), generator=gen)     # +-6: the group's max
    codes[codes == 8] = 0                                                        # -0 quantises to +0
    e = exponent + torch.randint(-3, 4, (R, groups), generator=gen)
    w = (torch.tensor(E2M1 + tuple(-v for v in E2M1), dtype=torch.float64)[codes]
         * torch.exp2(e.double())[..., None]).reshape(R, groups * GROUP).float()
    packed, scale = quantize_mxfp4(w)
    assert torch.equal(scale, (e + 127).to(torch.uint8))
    assert torch.equal(packed, (codes[..., 0::2] | codes[..., 1::2] << 4).to(torch.uint8).reshape(R, -1))
    assert torch.equal(dequantize_mxfp4(packed, scale, torch.float32), w)
    smaller = w / 4                                                              # max 1.5 * 2^e: other codes
    assert torch.equal(dequantize_mxfp4(*quantize_mxfp4(smaller), torch.float32), smaller)


def test_quantize_zero_group_gets_scale_zero():
    packed, scale = quantize_mxfp4(torch.zeros(2, 64))
    assert not packed.any() and not scale.any()


# -- the expert functions --------------------------------------------------------------------------------------
def random_packed(E, I, L, gen):
    """MXFP4 experts with O(1) values: scales near 2^0 (some groups finer)."""
    def one(rows, cols):
        packed = torch.randint(0, 256, (E, rows, cols // 2), generator=gen, dtype=torch.uint8)
        scale = torch.randint(122, 128, (E, rows, cols // GROUP), generator=gen, dtype=torch.uint8)
        return packed, scale
    return (*one(I, L), *one(I, L), *one(L, I))


def routing(M, E, A, gen):
    x = torch.randn(M, 16, generator=gen)
    return route(x, torch.randn(E, 16, generator=gen), torch.randn(E, generator=gen) * 0.1, A, True, 1.0)


@given(st.tuples(st.integers(1, 12), st.sampled_from([1, 4, 9]), st.integers(1, 4), st.sampled_from([32, 64]),
                 st.sampled_from([32, 96]), st.integers(0, 2 ** 16)),
       st.sampled_from([torch.float32, torch.bfloat16]), st.integers(1, 9))
@example((1, 9, 4, 64, 96, 0), torch.bfloat16, 2)
@example((12, 4, 2, 32, 32, 1), torch.float32, 3)
def test_packed_functions_equal_float_functions_on_dequantised_values(case, dtype, chunk):
    M, E, A, L, I, seed = case
    A = min(A, E)
    gen = torch.Generator().manual_seed(seed)
    packed = random_packed(E, I, L, gen)
    w1, w3, w2 = (dequantize_mxfp4(packed[i], packed[i + 1], dtype) for i in (0, 2, 4))
    z = torch.randn(M, L, generator=gen).to(dtype)
    weights, experts = routing(M, E, A, gen)
    gathered = experts_gathered_mxfp4(z, experts, weights, *packed, 4.0, 25.0)
    assert gathered.dtype == dtype
    assert torch.equal(gathered, experts_gathered(z, experts, weights, w1, w3, w2, 4.0, 25.0))
    dense = experts_dense(z, experts, weights, w1, w3, w2, 4.0, 25.0)
    assert torch.equal(experts_dense_mxfp4(z, experts, weights, *packed, 4.0, 25.0, chunk=min(chunk, E)), dense)
    assert torch.equal(experts_dense_mxfp4(z, experts, weights, *packed, 4.0, 25.0), dense)


def test_dense_chunk_follows_the_byte_budget():
    # K3's TP=8 rank: I 384, L 3584, bf16 -> 8.26 MB an expert, 65 in 512 MiB
    assert dense_chunk_experts(896, 3584, 384, torch.bfloat16) == 65
    assert dense_chunk_experts(16, 64, 48, torch.float32) == 16                  # the tiny model: one chunk
    assert dense_chunk_experts(16, 64, 48, torch.float32, budget=1) == 1


# -- the module and the model ----------------------------------------------------------------------------------
def test_experts_convert_and_state_dict_use_published_names():
    torch.manual_seed(0)
    ex = Experts(4, 64, 96)
    for p in ex.parameters():
        p.data.uniform_(-1, 1)
    ex.to_mxfp4()
    assert ex.packed and ex.w1_packed.shape == (4, 96, 32) and ex.w2_scale.shape == (4, 64, 3)
    assert all(p.dtype == torch.uint8 and not p.requires_grad for p in ex.parameters())
    state = ex.state_dict()
    assert set(state) == {f"{e}.{w}.{part}" for e in range(4) for w in ("w1", "w2", "w3")
                          for part in ("weight_packed", "weight_scale")}
    other = Experts(4, 64, 96, packed=True)
    other.load_state_dict(state)
    assert all(torch.equal(a, b) for a, b in zip(ex.parameters(), other.parameters()))
    floats = copy.deepcopy(ex).to_float(torch.float32)
    assert torch.equal(floats.w2, dequantize_mxfp4(ex.w2_packed, ex.w2_scale, torch.float32))
    again = copy.deepcopy(floats).to_mxfp4()                                   # values MXFP4 holds: exact
    assert torch.equal(dequantize_mxfp4(again.w1_packed, again.w1_scale, torch.float32), floats.w1)


def test_packed_experts_need_whole_groups_per_rank():
    with pytest.raises(ValueError, match="multiple of 32"):
        Experts(4, 64, 96, tp=TPContext(0, 2), packed=True)                    # I / tp = 48
    with pytest.raises(ValueError, match="latent width"):
        Experts(4, 48, 64, packed=True)
    assert Experts(4, 64, 128, tp=TPContext(1, 4), packed=True).w2_packed.shape == (4, 64, 16)


@pytest.fixture(scope="module")
def micro_pair():
    """A packed micro K3 and its float twin holding the dequantised values."""
    torch.manual_seed(0)
    packed = KimiK3ForConditionalGeneration(KimiK3Config.micro(moe_intermediate_size=64)).eval()
    packed.convert_experts("mxfp4")
    return packed, copy.deepcopy(packed).convert_experts(torch.float32)


@pytest.mark.parametrize("chunk_bytes", [None, 150_000], ids=["one-chunk", "several-chunks"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@torch.no_grad()
def test_packed_model_logits_equal_float_model(micro_pair, dtype, chunk_bytes, monkeypatch):
    """Prefill of 2 x 7 tokens (M 14 * top-4 > 16 experts: the dense form) and decode steps (M 2: gathered)."""
    if chunk_bytes is not None:
        monkeypatch.setattr(moe, "DENSE_CHUNK_BYTES", chunk_bytes)              # fp32: 3 experts of 48 KB
    packed, floats = (copy.deepcopy(m).set_dtype(dtype) for m in micro_pair)
    assert packed.experts_packed and not floats.experts_packed
    ids = torch.randint(0, 512, (2, 10), generator=torch.Generator().manual_seed(1))
    caches = [m.allocate_cache(2, 10) for m in (packed, floats)]
    for lo, hi in ((0, 7), (7, 8), (8, 9)):
        a, b = (m(ids[:, lo:hi], cache=c) for m, c in zip((packed, floats), caches))
        assert torch.equal(a, b), (lo, hi)


@given(rms=st.floats(1e-6, 10.0))
def test_scale_for_rms_nearest_power_of_two(rms):
    from k3compile.model.mxfp4 import scale_for_rms

    code_rms = (sum(v * v for v in E2M1) / len(E2M1)) ** 0.5
    got = 2.0 ** (scale_for_rms(rms) - 127) * code_rms
    assert rms / 2 ** 0.5 <= got <= rms * 2 ** 0.5


def test_init_weights_rank_on_meta_packed_experts_and_full_fan_in():
    """A TP-2 rank built on the meta device with packed experts, materialised, then init_weights: random codes whose
    RMS is within sqrt(2) of the float init's; row-parallel slices (o_proj, w2) bounded by the full fan-in."""
    from k3compile.model.loading import assign_parameters

    with torch.device("meta"):
        model = KimiK3ForConditionalGeneration(KimiK3Config.micro(moe_intermediate_size=64), TPContext(0, 2))
    model.convert_experts("mxfp4")
    text = model.language_model
    assign_parameters(text, {n: torch.empty(p.shape, dtype=p.dtype) for n, p in text.named_parameters()})
    torch.manual_seed(0)
    model.init_weights()
    ex = model.text_model.layers[1].block_sparse_moe.experts
    for w, fan_in in (("w1", ex.latent), ("w2", 2 * ex.intermediate)):
        values = dequantize_mxfp4(getattr(ex, w + "_packed"), getattr(ex, w + "_scale"), torch.float32)
        want = fan_in ** -0.5 / 3 ** 0.5                                   # uniform(-b, b), b = fan_in^-1/2
        assert want / 2 ** 0.5 <= values.pow(2).mean().sqrt() <= want * 2 ** 0.5, w
        assert len(torch.unique(getattr(ex, w + "_packed"))) > 200        # random codes
    o_proj = model.text_model.layers[0].self_attn.o_proj.weight              # [D, P/2]
    assert o_proj.abs().max() <= (2 * o_proj.shape[1]) ** -0.5 < o_proj.shape[1] ** -0.5
