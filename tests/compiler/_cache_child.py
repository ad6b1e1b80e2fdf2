"""Child process of test_cache.py: compile a small residual projection with our pass installed,
run it, and print the cache counters and the report as JSON (last line of stdout)."""
import json
import sys

import torch

import k3compile
from torch._dynamo.utils import counters


class Residual(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(16, 24)

    def forward(self, x, r):
        return self.proj(x) + r


def main(limit: int) -> None:
    torch.manual_seed(0)
    model = k3compile.optimize(Residual(), passes=["skinny_gemm"], backend="reference", small_m_limit=limit)
    x, r = torch.randn(2, 3, 16), torch.randn(2, 3, 24)
    with torch.no_grad():
        out = model(x, r)
    rep = k3compile.report(model)
    print(json.dumps({
        "fx_hit": counters["inductor"]["fxgraph_cache_hit"],
        "fx_miss": counters["inductor"]["fxgraph_cache_miss"],
        "fx_bypass": counters["inductor"]["fxgraph_cache_bypass"],
        "aot_hit": counters["aot_autograd"]["autograd_cache_hit"],
        "matches": rep.matches, "sources": [g.source for g in rep.graphs],
        "op_calls": rep.op_calls, "uuid": model._k3compile.compiler.config["post_grad_custom_post_pass"].uuid(), "checksum": float(out.double().sum()),
    }))


if __name__ == "__main__":
    main(int(sys.argv[1]))
