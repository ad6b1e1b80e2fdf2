"""A checkpoint in the published layout (4 shards, an index, MXFP4 experts, written by save_pretrained) loaded at
tensor-parallel sizes 1, 2 and 4 by four gloo processes, each rank reading only its slices: the logits of a prefill
and a decode step equal the unsharded load's."""
import os
import socket

import pytest
import torch
import torch.multiprocessing as mp

pytestmark = pytest.mark.slow

HEADS4 = dict(num_attention_heads=4, num_key_value_heads=4, linear_num_heads=4, moe_intermediate_size=128)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@torch.no_grad()
def prefill_and_step(model) -> torch.Tensor:
    ids = torch.randint(0, 512, (2, 7), generator=torch.Generator().manual_seed(5))
    cache = model.allocate_cache(2, 7)
    return torch.cat([model(ids[:, :6], cache=cache), model(ids[:, 6:], cache=cache)], 1)


def _worker(rank: int, world: int, port: int, path: str, out_dir: str) -> None:
    import torch.distributed as dist

    from k3compile.model import KimiK3ForConditionalGeneration

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    try:
        pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]          # every rank makes every group
        out = {}
        for tp, group in ((4, dist.group.WORLD), (2, pairs[rank // 2]), (1, None)):
            model = KimiK3ForConditionalGeneration.from_pretrained(path, tp_group=group, progress=False)
            ex = model.text_model.layers[1].block_sparse_moe.experts
            assert ex.packed and ex.w2_packed.shape == (16, 64, 64 // tp), ex.w2_packed.shape
            assert model.language_model.lm_head.weight.shape == model.get_input_embeddings().weight.shape \
                == (512 // tp, 128)                                    # split by vocabulary
            out[tp] = prefill_and_step(model)
        torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_tp_1_2_4_loads_give_the_unsharded_logits(tmp_path):
    from k3compile.model import KimiK3Config, KimiK3ForConditionalGeneration

    torch.manual_seed(0)
    model = KimiK3ForConditionalGeneration(KimiK3Config.micro(**HEADS4)).eval().convert_experts("mxfp4")
    model.save_pretrained(tmp_path / "ckpt", max_shard_size=1_500_000)
    assert len(list((tmp_path / "ckpt").glob("model-*-of-*.safetensors"))) == 4
    ref = prefill_and_step(KimiK3ForConditionalGeneration.from_pretrained(tmp_path / "ckpt", progress=False))
    assert torch.equal(ref, prefill_and_step(model))
    mp.start_processes(_worker, args=(4, _free_port(), str(tmp_path / "ckpt"), str(tmp_path)), nprocs=4, join=True,
                       start_method="fork")                    # the children share the imports already made
    for rank in range(4):
        out = torch.load(tmp_path / f"rank{rank}.pt")
        assert torch.equal(out[1], ref)
        for tp in (2, 4):                        # partial sums all-reduced: equal up to fp32 rounding
            err = ((out[tp] - ref).norm() / ref.norm()).item()
            assert err < 1e-5, (rank, tp, err)
