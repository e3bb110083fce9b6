import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


def pytest_configure(config):
    # Tiny test models gain nothing from intra-op threads, and OpenMP spin-waits slow every op by 10-100x
    # when another process shares the cores: one thread keeps the suite's run time stable.
    torch.set_num_threads(1)
