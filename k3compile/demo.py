"""``python -m k3compile.demo``: a small random-weight Kimi K3 decodes greedily, first eagerly, then compiled by
``k3compile.optimize``; prints both timings, whether the tokens agree, and the compile report.

    python -m k3compile.demo                      # micro model on CPU, tiny on a GPU
    python -m k3compile.demo --size tiny --tokens 32
    python -m k3compile.demo --checkpoint DIR     # a directory in the published layout (config.json + safetensors)
"""
from __future__ import annotations

import argparse
import time

import torch

SIZES = ("micro", "tiny")


def build(args):
    from k3compile.model import KimiK3Config, KimiK3ForConditionalGeneration

    if args.checkpoint:
        return KimiK3ForConditionalGeneration.from_pretrained(args.checkpoint, dtype=args.dtype, device=args.device)
    torch.manual_seed(args.seed)
    config = getattr(KimiK3Config, args.size)()
    model = KimiK3ForConditionalGeneration(config).eval()
    if args.dtype != torch.float32:
        model.set_dtype(args.dtype)
    return model.to(args.device)


def timed(fn):
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    out = fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return out, time.perf_counter() - start


def main(argv=None) -> int:
    cuda = torch.cuda.is_available()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=SIZES, default="tiny" if cuda else "micro")
    parser.add_argument("--checkpoint", default=None, help="load this directory instead of random weights")
    parser.add_argument("--device", default="cuda" if cuda else "cpu")
    parser.add_argument("--dtype", default="bfloat16" if cuda else "float32", choices=("float32", "bfloat16"))
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--prompt-len", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=16, help="new tokens to generate")
    parser.add_argument("--backend", default="auto", help="k3 kernel backend: auto | cute | triton | reference")
    parser.add_argument("--mode", default=None, help="torch.compile mode, e.g. reduce-overhead (GPU)")
    parser.add_argument("--eager-only", action="store_true", help="skip compilation")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    args.dtype = getattr(torch, args.dtype)

    model = build(args)
    text = model.config.text_config
    n_params = sum(p.numel() for p in model.parameters())
    print(f"Kimi K3 ({args.checkpoint or args.size}): {text.num_hidden_layers} layers "
          f"({len(text.full_attn_layers)} MLA, {text.num_hidden_layers - len(text.full_attn_layers)} KDA), "
          f"{text.num_experts} experts top-{text.num_experts_per_token}, {n_params / 1e6:.1f} M parameters, "
          f"{args.dtype}, {args.device}")
    gen = torch.Generator().manual_seed(args.seed)
    ids = torch.randint(0, text.vocab_size, (args.batch, args.prompt_len), generator=gen).to(args.device)

    eager, t_eager = timed(lambda: model.generate(ids, max_new_tokens=args.tokens))
    print(f"eager:    {args.tokens} tokens in {t_eager:.2f} s ({1e3 * t_eager / args.tokens:.1f} ms/token)   "
          f"{eager[0].tolist()}")
    if args.eager_only:
        return 0

    import k3compile

    kwargs = {"fullgraph": True, "dynamic": False}
    if args.mode:
        kwargs["mode"] = args.mode
    model = k3compile.optimize(model, backend=args.backend, **kwargs)
    compiled, t_first = timed(lambda: model.generate(ids, max_new_tokens=args.tokens))
    print(f"compiled: first call (includes compilation) {t_first:.1f} s")
    compiled, t_warm = timed(lambda: model.generate(ids, max_new_tokens=args.tokens))
    print(f"compiled: {args.tokens} tokens in {t_warm:.2f} s ({1e3 * t_warm / args.tokens:.1f} ms/token)   "
          f"{compiled[0].tolist()}")
    same = torch.equal(eager, compiled)
    print("tokens agree with eager decoding" if same else
          f"tokens differ from eager decoding from position "
          f"{int((eager != compiled).any(0).nonzero()[0])} (expected only in low precision, at near-ties)")
    print(k3compile.report(model))
    return 0 if same or args.dtype != torch.float32 else 1


if __name__ == "__main__":
    raise SystemExit(main())
