"""Helpers shared by the pattern guards (patterns/_common.py)."""
from types import SimpleNamespace

import torch

from k3compile.patterns._common import matched_scalar_ok


def test_matched_scalar_ok_accepts_numbers_and_a_burned_in_literal():
    # torch < 2.12's re-check leaves a scalar_workaround constant out of the specific match's keywords
    assert matched_scalar_ok(SimpleNamespace(kwargs={"beta": 2.5}), "beta")
    assert matched_scalar_ok(SimpleNamespace(kwargs={"beta": 3}), "beta")
    assert matched_scalar_ok(SimpleNamespace(kwargs={}), "beta")


def test_matched_scalar_ok_rejects_a_graph_value():
    node = torch.fx.Graph().placeholder("beta")
    assert not matched_scalar_ok(SimpleNamespace(kwargs={"beta": node}), "beta")
    assert not matched_scalar_ok(SimpleNamespace(kwargs={"beta": True}), "beta")
