"""Fixtures the op tests share."""
import pytest


@pytest.fixture
def tail_records():
    """The latent-MoE tail's and the skinny GEMM's recorded choices, cleared before and after the test; the fixture
    is ``choices(backend="auto", impl=None)``: the tail's records for that backend (and implementation)."""
    from k3compile.ops.latent_moe_tail import LATENT_MOE_TAIL
    from k3compile.ops.skinny_gemm import SKINNY_GEMM

    def choices(backend="auto", impl=None):
        return [c for c in LATENT_MOE_TAIL.choices() if c.backend == backend and (impl is None or c.impl == impl)]

    LATENT_MOE_TAIL.clear()
    SKINNY_GEMM.clear()
    yield choices
    LATENT_MOE_TAIL.clear()
    SKINNY_GEMM.clear()
