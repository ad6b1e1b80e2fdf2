"""Tensor parallelism: two gloo processes give the single-process logits (the embedding, lm_head and MTP head split by
vocabulary), generate its tokens, and the collectives are in the graph torch.compile captures."""
import os
import re
import socket

import pytest
import torch
import torch.multiprocessing as mp

pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, out_dir: str) -> None:
    import torch.distributed as dist

    from k3compile.model import KimiK3Config, KimiK3ForConditionalGeneration, TPContext
    from k3compile.model.loading import convert_checkpoint

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    try:
        config = KimiK3Config.micro(num_nextn_predict_layers=1)
        torch.manual_seed(0)
        full = KimiK3ForConditionalGeneration(config).eval()
        tp = TPContext.from_group()
        with torch.device("meta"):
            part = KimiK3ForConditionalGeneration(config, tp)
        part.load_state_dict(convert_checkpoint(part, full.state_dict(), torch.float32, tp), strict=True, assign=True)
        part.eval()
        ids = torch.randint(0, config.text_config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            cache = part.allocate_cache(2, 9)
            steps = [part(ids[:, :6], cache=cache)] + [part(ids[:, t:t + 1], cache=cache) for t in range(6, 9)]
            mtp = {}
            for name, model in (("part", part), ("full", full)):
                hidden = model(ids, return_hidden=True)[1]
                mtp[name] = model.mtp(model.get_input_embeddings()(ids), hidden, model.mtp.allocate_state(2, 9))[0]
            generated = (part.generate(ids[:, :4], 5), full.generate(ids[:, :4], 5))
            graphs = []

            def record(gm, example_inputs):
                graphs.append(str(gm.graph))
                return gm.forward

            decode = torch.compile(part, backend=record, fullgraph=True, dynamic=False)
            cache2 = part.allocate_cache(2, 9)
            part(ids[:, :8], cache=cache2)
            compiled_step = decode(ids[:, 8:9], cache=cache2)
        embed = part.get_input_embeddings()
        torch.save({"logits": torch.cat(steps, 1), "reference": full(ids), "compiled_step": compiled_step,
                    "graph": graphs[0], "local_heads": part.text_model.layers[0].self_attn.num_heads,
                    "mtp": mtp, "generated": generated,
                    "vocab": (embed.vocab_start, tuple(embed.weight.shape),
                              tuple(part.language_model.lm_head.weight.shape),
                              tuple(part.mtp.layers[0].shared_head.head.weight.shape))},
                   os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_tp2_gloo_equals_tp1(tmp_path):
    mp.spawn(_worker, args=(2, _free_port(), str(tmp_path)), nprocs=2, join=True)
    for rank in range(2):
        r = torch.load(tmp_path / f"rank{rank}.pt")
        ref = r["reference"]
        assert r["local_heads"] == 3                                   # 6 KDA heads split over 2 ranks
        rel = ((r["logits"] - ref).norm() / ref.norm()).item()
        assert rel < 1e-5, rel
        rel_c = ((r["compiled_step"][:, 0] - ref[:, 8]).norm() / ref[:, 8].norm()).item()
        assert rel_c < 1e-5, rel_c
        # in the captured graph: one all-reduce for the embedding, one per attention layer (4) and for the dense
        # MLP (1), two per MoE tail (routed latent and shared experts, 3 layers); the logits' all-gather
        calls = re.findall(r"call_function\[target=[^\]]*all_reduce", r["graph"])
        assert len(calls) == 1 + 4 + 1 + 2 * 3, calls
        assert len(re.findall(r"call_function\[target=[^\]]*all_gather", r["graph"])) == 1
        # rank r holds vocabulary rows r·256 .. r·256 + 255 of the embedding, the lm_head and the MTP head
        assert r["vocab"] == (256 * rank, (256, 128), (256, 128), (256, 128))
        rel_m = ((r["mtp"]["part"] - r["mtp"]["full"]).norm() / r["mtp"]["full"].norm()).item()
        assert r["mtp"]["part"].shape[-1] == 512 and rel_m < 1e-5, rel_m
        assert torch.equal(*r["generated"])
