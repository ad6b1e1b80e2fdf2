"""The decode step compiles whole (fullgraph=True) and later steps reuse the graph (no recompiles).

Dynamo's capture is what is tested, so the graphs run through AOTAutograd with eager kernels (``aot_eager``: the
cache updates still functionalised and written back); Inductor's code for the whole model is checked against eager
where it also compiles our passes' graphs (tests/compiler/test_tiny_k3.py, test_demo.py)."""
import copy

import pytest
import torch
from torch._dynamo.utils import counters

from k3compile.model import KimiK3Config, KimiK3ForConditionalGeneration
from k3compile.testing import rel_err as rel

pytestmark = pytest.mark.slow


def clone_cache(cache):
    return copy.deepcopy(cache)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return KimiK3ForConditionalGeneration(KimiK3Config.micro()).eval()


@torch.no_grad()
def test_decode_step_compiles_once_without_graph_breaks(model):
    torch._dynamo.reset()
    counters.clear()
    decode = torch.compile(model, backend="aot_eager", fullgraph=True, dynamic=False)
    ids = torch.randint(0, 512, (2, 12))
    cache = model.allocate_cache(2, 16)
    model(ids[:, :6], cache=cache)                                    # eager prefill
    eager_cache = clone_cache(cache)
    outs, refs = [], []
    for t in range(6, 12):
        if t == 7:                                                    # every later step must reuse the graph
            torch._dynamo.config.error_on_recompile = True
        try:
            outs.append(decode(ids[:, t:t + 1], cache=cache))
        finally:
            torch._dynamo.config.error_on_recompile = False
        refs.append(model(ids[:, t:t + 1], cache=eager_cache))
    assert counters["stats"]["unique_graphs"] == 1
    assert not counters["graph_break"]
    assert int(cache.pos) == 12
    assert rel(torch.cat(outs, 1), torch.cat(refs, 1)) < 1e-4
    for a, b in zip(cache.layers, eager_cache.layers):                # states updated in place, identically
        for x, y in zip(a.tensors(), b.tensors()):
            assert rel(x, y) < 1e-4 or y.norm() == 0


@torch.no_grad()
def test_compiled_in_place_generate_runs_compiled(model):
    """model.compile() then model.generate(): prefill and decode each one graph, reused by every step."""
    m = copy.deepcopy(model)
    torch._dynamo.reset()
    counters.clear()
    m.compile(fullgraph=True, dynamic=False, backend="aot_eager")
    ids = torch.randint(0, 512, (1, 5))
    new = m.generate(ids, max_new_tokens=6)
    assert counters["stats"]["unique_graphs"] == 2                     # prefill [1, 5] and decode [1, 1]
    assert torch.equal(new, model.generate(ids, max_new_tokens=6))
