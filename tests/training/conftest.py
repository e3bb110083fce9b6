import pytest
import torch


@pytest.fixture(autouse=True)
def one_cpu_thread():
    """The training tests run tiny matmuls: extra threads gain nothing, and OpenMP spin-waiting on a busy 2-core
    machine makes them ~50x slower. Pinned per test and restored, so other tests are unaffected."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
