"""``k3::all_reduce_``: the in-place all-reduce the latent-MoE tail pass emits for its merged collective.

One gloo rank in this process (no port) for the op itself; two ranks through the pass are covered by
tests/patterns/test_latent_moe_tail.py (micro K3, TP=2) and tests/compiler/test_tp_decode_script.py.
"""
from __future__ import annotations

import pytest
import torch

import k3compile.ops.all_reduce  # noqa: F401  (registers k3::all_reduce_)

OP = torch.ops.k3.all_reduce_.default


@pytest.mark.parametrize("reduce_op", ["sum", "max"])
def test_reduces_in_place_world_of_one(gloo_world_of_one, reduce_op):
    x = torch.randn(3, 40)
    buf = x.clone()
    assert OP(buf, reduce_op, gloo_world_of_one) is None
    assert torch.equal(buf, x)   # one rank: every reduction is the identity, in the same buffer


def test_unknown_reduce_op_is_a_clear_error(gloo_world_of_one):
    with pytest.raises(ValueError, match="reduce_op 'mean' is not one of"):
        OP(torch.zeros(2, 2), "mean", gloo_world_of_one)


def test_schema_mutates_the_buffer_only():
    """Inductor keeps it (a mutating op is never dead code) and orders the readers of ``buf`` after it."""
    schema = OP._schema
    assert schema.is_mutable and [a.name for a in schema.arguments if a.alias_info and a.alias_info.is_write] == ["buf"]
    assert len(schema.returns) == 0
