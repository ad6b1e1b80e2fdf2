"""Checkpoints in the published layout: save/load round trips in both expert forms, MXFP4 experts, the padded A_log,
and every kind of bad input failing early with the file and the tensor named, leaving nothing loaded behind."""
import gc
import json
import shutil
import struct
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from k3compile.model import KimiK3Config, KimiK3ForConditionalGeneration, TPContext
from k3compile.model.loading import INDEX_NAME, SINGLE_NAME, CheckpointError
from k3compile.model.mxfp4 import dequantize_mxfp4, quantize_mxfp4

EXPERT = "language_model.model.layers.1.block_sparse_moe.experts.5"
A_LOG = "language_model.model.layers.0.self_attn.A_log"
load = KimiK3ForConditionalGeneration.from_pretrained


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    return KimiK3ForConditionalGeneration(KimiK3Config.micro()).eval()


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, 512, (2, 7), generator=torch.Generator().manual_seed(3))


@pytest.fixture(scope="module")
def packed(tmp_path_factory, ids):
    """A packed micro K3 written in the published layout: 4 shards, an index, MXFP4 experts; its logits."""
    torch.manual_seed(1)
    model = KimiK3ForConditionalGeneration(KimiK3Config.micro(moe_intermediate_size=64)).eval()
    model.convert_experts("mxfp4")
    path = tmp_path_factory.mktemp("packed")
    model.save_pretrained(path, max_shard_size=1_500_000)
    with torch.no_grad():
        return path, model(ids)


def copy_of(packed, tmp_path):
    shutil.copytree(packed[0], tmp_path, dirs_exist_ok=True)
    return tmp_path


def weight_map(path) -> dict:
    return json.loads((path / INDEX_NAME).read_text())["weight_map"]


def rewrite(path, file, edit):
    tensors = load_file(str(path / file))
    edit(tensors)
    save_file(tensors, str(path / file), metadata={"format": "pt"})


def rewrite_single(path, edit):
    rewrite(path, SINGLE_NAME, edit)


def test_state_dict_keys_are_published_names(tiny):
    keys = set(tiny.state_dict())
    assert f"{EXPERT}.w1.weight" in keys and f"{EXPERT}.w2.weight" in keys
    assert "language_model.lm_head.weight" in keys and "language_model.model.embed_tokens.weight" in keys
    assert "language_model.model.layers.3.self_attn.kv_a_proj_with_mqa.weight" in keys
    assert "language_model.model.layers.0.self_attn.q_conv1d.weight" in keys
    assert "language_model.model.output_attn_res_proj.weight" in keys
    assert not any(k.endswith(("experts.w1", "experts.w2", "experts.w3")) for k in keys)
    assert tiny.state_dict()[f"{EXPERT}.w2.weight"].shape == (64, 48)        # [L, I] per expert


@torch.no_grad()
def test_round_trip_sharded_fp32(tiny, ids, tmp_path):
    tiny.save_pretrained(tmp_path, max_shard_size=400_000)
    index = json.loads((tmp_path / INDEX_NAME).read_text())
    assert len(set(index["weight_map"].values())) > 1 and set(index["weight_map"]) == set(tiny.state_dict())
    loaded = load(tmp_path)
    assert loaded.dtype == torch.float32 and not loaded.experts_packed
    for key, t in tiny.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], t), key
    assert torch.equal(loaded(ids), tiny(ids))


@torch.no_grad()
def test_round_trip_bf16_keeps_fp32_tensors(tiny, ids, tmp_path):
    import copy
    m = copy.deepcopy(tiny).set_dtype(torch.bfloat16)
    m.save_pretrained(tmp_path)
    files = load_file(str(tmp_path / SINGLE_NAME))
    assert files[A_LOG].dtype == torch.float32 and files["language_model.lm_head.weight"].dtype == torch.bfloat16
    loaded = load(tmp_path)
    assert loaded.dtype == torch.bfloat16
    assert loaded.get_parameter(A_LOG).dtype == torch.float32
    assert torch.equal(loaded(ids), m(ids))


@torch.no_grad()
def test_checkpoint_with_one_packed_expert(tiny, tmp_path):
    """A hand-packed MXFP4 expert in an otherwise plain checkpoint loads (float form) as the hand-computed values."""
    tiny.save_pretrained(tmp_path, quantize_experts=False)
    I, L = 48, 64                                                        # w1 is [I, L] = [48, 64]
    packed = torch.zeros(I, L // 2, dtype=torch.uint8)
    packed[:, 0] = 0x2B                                                  # cols 0, 1 = -1.5, +1.0 (x scale)
    packed[:, 16] = 0x70                                                 # cols 32, 33 = 0, 6.0
    scale = torch.full((I, L // 32), 127, dtype=torch.uint8)
    scale[:, 1] = 126                                                    # second group x 1/2
    scale[3, 0] = 130                                                    # row 3, first group x 8

    def edit(tensors):
        del tensors[f"{EXPERT}.w1.weight"]
        tensors[f"{EXPERT}.w1.weight_packed"] = packed
        tensors[f"{EXPERT}.w1.weight_scale"] = scale
    rewrite_single(tmp_path, edit)
    loaded = load(tmp_path)
    assert not loaded.experts_packed                                     # not every expert is packed
    w1 = loaded.state_dict()[f"{EXPERT}.w1.weight"]
    expect = torch.zeros(I, L)
    expect[:, 0], expect[:, 1], expect[:, 33] = -1.5, 1.0, 3.0
    expect[3, 0], expect[3, 1] = -12.0, 8.0
    assert torch.equal(w1, expect)
    for key in (f"{EXPERT}.w2.weight", "language_model.model.layers.2.block_sparse_moe.experts.0.w1.weight"):
        assert torch.equal(loaded.state_dict()[key], tiny.state_dict()[key])


@torch.no_grad()
def test_round_trip_with_quantized_experts(ids, tmp_path):
    """Experts MXFP4 can represent survive save (packed) -> load exactly (expert widths multiples of 32)."""
    torch.manual_seed(0)
    m = KimiK3ForConditionalGeneration(KimiK3Config.micro(moe_intermediate_size=96)).eval()
    for layer in m.text_model.layers[1:]:
        ex = layer.block_sparse_moe.experts
        for p in (ex.w1, ex.w2, ex.w3):
            p.data.copy_(dequantize_mxfp4(*quantize_mxfp4(p.data), torch.float32))
    m.save_pretrained(tmp_path, quantize_experts=True)
    files = load_file(str(tmp_path / SINGLE_NAME))
    assert files[f"{EXPERT}.w1.weight_packed"].dtype == torch.uint8 and f"{EXPERT}.w1.weight" not in files
    assert json.loads((tmp_path / "config.json").read_text())["quantization_config"]["format"] == "mxfp4-pack-quantized"
    assert getattr(m.config, "quantization_config", None) is None        # the model's own config is left alone
    loaded = load(tmp_path)
    assert loaded.experts_packed                                         # as the checkpoint ships
    assert torch.equal(loaded(ids), m(ids))


@torch.no_grad()
def test_packed_checkpoint_loads_in_every_form_with_the_same_logits(packed, ids):
    path, logits = packed
    names = weight_map(path)
    assert len(set(names.values())) == 4
    assert {f"{EXPERT}.w2.weight_packed", f"{EXPERT}.w2.weight_scale"} <= set(names)
    as_shipped = load(path, progress=False)
    assert as_shipped.experts_packed and torch.equal(as_shipped(ids), logits)
    floats = load(path, experts="float32", progress=False)
    assert not floats.experts_packed and torch.equal(floats(ids), logits)
    bf16 = load(path, experts="bf16", progress=False)
    packed_bf16 = load(path, experts="mxfp4", dtype=torch.bfloat16, progress=False)
    assert bf16.dtype == packed_bf16.dtype == torch.bfloat16
    assert torch.equal(bf16(ids), packed_bf16(ids))
    with pytest.raises(ValueError, match="model's dtype"):
        load(path, experts="bf16", dtype=torch.float32)


@torch.no_grad()
def test_save_writes_the_published_names_from_either_form(packed, ids, tmp_path):
    path, logits = packed
    original = {}
    for file in set(weight_map(path).values()):
        original.update(load_file(str(path / file)))
    as_shipped = load(path, progress=False)
    as_shipped.save_pretrained(tmp_path / "again")                     # packed -> packed: the same tensors
    again = load_file(str(tmp_path / "again" / SINGLE_NAME))
    assert set(again) == set(original) and all(torch.equal(again[k], original[k]) for k in original)
    as_shipped.save_pretrained(tmp_path / "float", quantize_experts=False)
    floats = load_file(str(tmp_path / "float" / SINGLE_NAME))
    assert f"{EXPERT}.w1.weight" in floats and not any(k.endswith("_packed") for k in floats)
    assert torch.equal(floats[f"{EXPERT}.w1.weight"], dequantize_mxfp4(original[f"{EXPERT}.w1.weight_packed"],
                                                                         original[f"{EXPERT}.w1.weight_scale"],
                                                                         torch.float32))
    from_float = load(tmp_path / "float", progress=False)
    assert not from_float.experts_packed and torch.equal(from_float(ids), logits)
    quantised_on_load = load(tmp_path / "float", experts="mxfp4", progress=False)
    assert quantised_on_load.experts_packed and torch.equal(quantised_on_load(ids), logits)
    from_float.save_pretrained(tmp_path / "requantized", quantize_experts=True)  # float -> packed: same values
    assert torch.equal(load(tmp_path / "requantized", progress=False)(ids), logits)


@torch.no_grad()
def test_tp_slices_inside_a_scale_group_load_as_floats(tmp_path):
    """moe_intermediate_size 96 at TP 2: 48 of w2's columns a rank, not whole MXFP4 groups. The float form
    dequantises the groups that cover them and keeps its columns; the packed form is refused."""
    torch.manual_seed(0)
    model = KimiK3ForConditionalGeneration(KimiK3Config.micro(moe_intermediate_size=96)).convert_experts("mxfp4")
    model.save_pretrained(tmp_path)
    full = load(tmp_path, experts="float32", progress=False).text_model.layers[2].block_sparse_moe.experts
    for rank in (0, 1):
        part = load(tmp_path, experts="float32", tp=TPContext(rank, 2), progress=False)
        ex = part.text_model.layers[2].block_sparse_moe.experts
        assert torch.equal(ex.w2, full.w2[..., rank * 48:(rank + 1) * 48])
        assert torch.equal(ex.w1, full.w1[:, rank * 48:(rank + 1) * 48])
    with pytest.raises(ValueError, match="multiple of 32"):
        load(tmp_path, tp=TPContext(0, 2))


@torch.no_grad()
def test_padded_A_log_is_trimmed(tiny, ids, tmp_path):
    tiny.save_pretrained(tmp_path)
    rewrite_single(tmp_path, lambda t: t.update({A_LOG: torch.cat([t[A_LOG], torch.zeros(26)])}))   # [6] -> [32]
    loaded = load(tmp_path)
    assert torch.equal(loaded(ids), tiny(ids))
    rewrite_single(tmp_path, lambda t: t[A_LOG].__setitem__(-1, 1.0))
    with pytest.raises(CheckpointError, match="padding is not zero"):
        load(tmp_path)


def test_progress_goes_to_stderr(packed, capfd, monkeypatch):
    load(packed[0])
    err = capfd.readouterr().err
    assert "loading file 1/4 model-00001-of-00004.safetensors" in err and "loaded 4 file(s)" in err
    load(packed[0], progress=False)
    assert capfd.readouterr().err == ""
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)                 # a terminal: a tqdm bar over bytes
    load(packed[0])
    assert "file 4/4 model-00004-of-00004.safetensors" in capfd.readouterr().err
    monkeypatch.setitem(sys.modules, "tqdm.auto", None)                      # no tqdm: lines again
    load(packed[0])
    assert "loading file 1/4" in capfd.readouterr().err


def test_device_map_takes_one_device(packed):
    assert load(packed[0], device_map={"": "cpu"}, progress=False).device == torch.device("cpu")
    with pytest.raises(ValueError, match="one device"):
        load(packed[0], device_map={"language_model": "cpu", "vision_tower": "cpu"})


# -- bad input -------------------------------------------------------------------------------------------------
def _drop(name, also_index=True):
    """Removes the tensor from its file (and the index): the error names the directory (or the file)."""
    def corrupt(path):
        file = weight_map(path)[name]
        rewrite(path, file, lambda t: t.pop(name))
        if also_index:
            index = json.loads((path / INDEX_NAME).read_text())
            del index["weight_map"][name]
            (path / INDEX_NAME).write_text(json.dumps(index))
        return str(path) if also_index and not name.endswith(("_scale", "_packed")) else file
    return corrupt


def _replace(name, make):
    def corrupt(path):
        file = weight_map(path)[name]
        rewrite(path, file, lambda t: t.update({name: make(t[name])}))
        return file
    return corrupt


def _add(name):
    def corrupt(path):
        file = "model-00002-of-00004.safetensors"
        rewrite(path, file, lambda t: t.update({name: torch.zeros(3)}))
        index = json.loads((path / INDEX_NAME).read_text())
        index["weight_map"][name] = file
        (path / INDEX_NAME).write_text(json.dumps(index))
        return file
    return corrupt


def _truncate(path):
    file = weight_map(path)[f"{EXPERT}.w1.weight_packed"]
    data = (path / file).read_bytes()
    (path / file).write_bytes(data[:-1000])
    return file


def _absent_file(path):
    index = json.loads((path / INDEX_NAME).read_text())
    index["weight_map"][f"{EXPERT}.w3.weight_scale"] = "model-00009-of-00009.safetensors"
    (path / INDEX_NAME).write_text(json.dumps(index))
    return "model-00009-of-00009.safetensors"


def _nan_bytes(name):
    """4 KB of 0xFF (NaN in fp32) written straight into the tensor's bytes of its file."""
    def corrupt(path):
        file = weight_map(path)[name]
        raw = bytearray((path / file).read_bytes())
        n = struct.unpack("<Q", raw[:8])[0]
        start, end = json.loads(raw[8:8 + n])[name]["data_offsets"]
        at = 8 + n + start + (end - start) // 2
        raw[at:at + 4096] = b"\xff" * 4096
        (path / file).write_bytes(bytes(raw))
        return file
    return corrupt


def _scale_255(path):
    name = f"{EXPERT}.w2.weight_scale"
    return _replace(name, lambda t: t.index_fill(1, torch.tensor([1]), 255))(path)


def _config(edit):
    def corrupt(path):
        config = json.loads((path / "config.json").read_text())
        edit(config)
        (path / "config.json").write_text(json.dumps(config))
        return "config.json"
    return corrupt


BAD = {
    "truncated-shard": (_truncate, "the file is truncated: tensor language_model"),
    "missing-scale": (_drop(f"{EXPERT}.w2.weight_scale"), f"{EXPERT}.w2.weight_packed has no matching "
                                                           f"{EXPERT}.w2.weight_scale"),
    "missing-tensor": (_drop("language_model.model.layers.2.self_attn.b_proj.weight"),
                       "no file holds tensor language_model.model.layers.2.self_attn.b_proj.weight"),
    "index-names-absent-file": (_absent_file, f"tensor.*{EXPERT}.w3.weight_scale"),
    "index-names-tensor-not-in-file": (_drop(f"{EXPERT}.w1.weight_scale", also_index=False),
                                       f"tensor {EXPERT}.w1.weight_scale in .*does not hold it"),
    "scale-wrong-shape": (_replace(f"{EXPERT}.w1.weight_scale", lambda t: t[:, :1].contiguous()),
                          rf"{EXPERT}.w1.weight_scale has shape \[64, 1\], expected \[64, 2\]"),
    "codes-wrong-dtype": (_replace(f"{EXPERT}.w3.weight_packed", lambda t: t.to(torch.int16)),
                          f"{EXPERT}.w3.weight_packed is torch.int16, expected uint8"),
    "weight-wrong-dtype": (_replace("language_model.lm_head.weight", lambda t: t.to(torch.int32)),
                           "language_model.lm_head.weight is torch.int32, expected a floating-point"),
    "weight-wrong-shape": (_replace("language_model.model.norm.weight", lambda t: t[:-1].clone()),
                           r"language_model.model.norm.weight has shape \[127\], expected \[128\]"),
    "scale-nan-byte": (_scale_255, f"{EXPERT}.w2.weight_scale holds the E8M0 scale 255"),
    "nan-bytes-in-file": (_nan_bytes("language_model.model.layers.3.self_attn.q_b_proj.weight"),
                          "language_model.model.layers.3.self_attn.q_b_proj.weight holds NaN or inf"),
    "unexpected-tensor": (_add("language_model.model.layers.2.self_attn.bogus.weight"),
                          "tensor language_model.model.layers.2.self_attn.bogus.weight has no place"),
    "missing-codes": (_drop(f"{EXPERT}.w1.weight_packed"), f"{EXPERT}.w1.weight_scale has no matching "
                                                            f"{EXPERT}.w1.weight_packed"),
    "unknown-quantization": (_config(lambda c: c.update(quantization_config={"quant_method": "fp8"})),
                             "quantization_config .* is not understood"),
    "wrong-model-type": (_config(lambda c: c.update(model_type="bert")), "model_type is 'bert'"),
    "no-text-config": (_config(lambda c: c.pop("text_config")), "no text_config"),
}


@pytest.mark.parametrize("case", BAD.values(), ids=BAD.keys())
def test_bad_checkpoint_names_file_and_tensor(packed, tmp_path, case):
    corrupt, message = case
    path = copy_of(packed, tmp_path)
    file = corrupt(path)
    with pytest.raises(CheckpointError, match=message) as info:
        load(path, progress=False)
    assert file in str(info.value)


def test_missing_config_json_is_named(packed, tmp_path):
    path = copy_of(packed, tmp_path)
    (path / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="config.json"):
        load(path)


def test_damaged_floats_load_when_the_check_is_off(packed, tmp_path):
    path = copy_of(packed, tmp_path)
    _nan_bytes("language_model.model.layers.3.self_attn.q_b_proj.weight")(path)
    model = load(path, check_finite=False, progress=False)
    assert model.get_parameter("language_model.model.layers.3.self_attn.q_b_proj.weight").isnan().any()


def test_non_finite_float_expert_is_named_within_its_run(tiny, tmp_path):
    """Float experts are checked a run of consecutive experts at a time; the error still names the one."""
    tiny.save_pretrained(tmp_path, max_shard_size=400_000)
    name = "language_model.model.layers.2.block_sparse_moe.experts.7.w2.weight"
    file = _nan_bytes(name)(tmp_path)
    with pytest.raises(CheckpointError, match=f"{file}: tensor {name} holds NaN"):
        load(tmp_path, progress=False)


def test_float16_overflow_of_mxfp4_values_is_caught(packed, tmp_path):
    path = copy_of(packed, tmp_path)
    _replace(f"{EXPERT}.w1.weight_scale", lambda t: t.index_fill(0, torch.tensor([3]), 145))(path)   # x 2^18
    load(path, progress=False)                                                   # fine as MXFP4
    with pytest.raises(CheckpointError, match=f"{EXPERT}.w1.weight_packed holds NaN or inf.*overflow"):
        load(path, experts="float16", progress=False)


def _live_tensor_bytes() -> int:
    """Bytes of the plain tensors alive (fake tensors other tests' compiles left behind have no storage)."""
    seen, total = set(), 0
    for obj in gc.get_objects():
        if type(obj) in (torch.Tensor, torch.nn.Parameter) and not obj.is_meta \
                and obj.untyped_storage().data_ptr() not in seen:
            seen.add(obj.untyped_storage().data_ptr())
            total += obj.untyped_storage().nbytes()
    return total


def test_failed_load_leaves_nothing_behind(packed, tmp_path):
    """NaN in the last file: everything loaded before it is released, though the error (and its traceback) lives."""
    path = copy_of(packed, tmp_path)
    _nan_bytes("mm_projector.proj.2.weight")(path)
    assert weight_map(path)["mm_projector.proj.2.weight"] == \
        "model-00004-of-00004.safetensors"
    gc.collect()
    before = _live_tensor_bytes()
    with pytest.raises(CheckpointError, match="mm_projector") as info:
        load(path, progress=False)
    gc.collect()
    assert _live_tensor_bytes() - before < 100_000                       # the model's weights are ~6 MB
    assert info.value.__traceback__ is not None


# -- on a GPU --------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@torch.no_grad()
def test_load_straight_to_the_gpu(packed, ids, tmp_path):
    """Parameters are allocated and filled on the device; the packed and float forms agree bitwise there too (the
    prefill's dense form is one chunk here, the decode's gathered form the same shapes in both); a failed load
    gives all device memory back."""
    from k3compile.testing import rel_err
    path, logits = packed
    as_shipped = load(path, device="cuda", progress=False)
    floats = load(path, device="cuda", experts="float32", progress=False)
    assert as_shipped.experts_packed and all(p.is_cuda for p in as_shipped.parameters())
    caches = [m.allocate_cache(2, 8) for m in (as_shipped, floats)]
    prefill = [m(ids.cuda(), cache=c) for m, c in zip((as_shipped, floats), caches)]
    step = [m(ids[:, :1].cuda(), cache=c) for m, c in zip((as_shipped, floats), caches)]
    assert torch.equal(prefill[0], prefill[1]) and torch.equal(step[0], step[1])
    assert rel_err(prefill[0].cpu(), logits) < 1e-4
    del as_shipped, floats, caches, prefill, step
    broken = copy_of(packed, tmp_path)
    _nan_bytes("mm_projector.proj.2.weight")(broken)                             # in the last file
    gc.collect()
    before = torch.cuda.memory_allocated()
    with pytest.raises(CheckpointError, match="mm_projector"):
        load(broken, device="cuda", progress=False)
    gc.collect()
    assert torch.cuda.memory_allocated() == before
