"""Model tests run tiny tensors: one intra-op thread avoids OpenMP oversubscription on a shared CPU
(measured here: 30x faster decode steps with 1 thread when the machine is busy)."""
import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
