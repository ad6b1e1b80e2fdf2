"""Shared test set-up: hypothesis profiles, the GPU marker, deterministic seeds."""
import os

import torch

# Triton kernels run on CPU tensors through the interpreter when no GPU is present; CuTe DSL (where installed)
# compiles for sm_90a, the H200's arch, not its own default. Set before anything imports triton or cutlass.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

# K3_HYPOTHESIS_PROFILE=deep draws many more cases for long local runs; CI uses "ci".
settings.register_profile(
    "ci", max_examples=25, deadline=None, derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
settings.register_profile(
    "deep", max_examples=500, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
settings.load_profile(os.environ.get("K3_HYPOTHESIS_PROFILE", "ci"))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU; run on the lent H200")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture
def gloo_world_of_one():
    """A one-rank gloo process group in this process (a hash store, no port); yields its group name.
    Enough to run (and compile) collectives; skips where a group already exists."""
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dist.group.WORLD.group_name
    finally:
        dist.destroy_process_group()
