import gc
import threading

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


_MODELS_OF_THE_COLLECTION: list = []  # SpecModels alive when the collector froze them (gc.get_objects() skips them)


def pytest_collection_finish(session):
    """Every module the suite imports is loaded now (torch, transformers, the test modules: half a million objects):
    without CUDA (the GPU suite was not measured with it) they move to the collector's permanent generation, so that
    full collections (each module's below, and Python's own) traverse only what the tests made. Each took 0.5-1.3 s
    on the 2-core machine: the README command's module teardowns were 99 s of its 643 s of test time, 25 s now.
    Objects the tests make are collected as before; what import made and drops later is left to reference counting."""
    if torch.cuda.is_available():
        return
    from tllm_spec.spec_model import SpecModel

    gc.collect()
    _MODELS_OF_THE_COLLECTION.extend(o for o in gc.get_objects() if type(o) is SpecModel)
    gc.freeze()


@pytest.fixture(autouse=True, scope="module")
def _close_engines_of_the_module():
    """After each module, the engines whose model nobody holds any more (a session fixture's model stays) are
    closed: an engine's thread keeps its model's weights alive until closed, and the suite builds hundreds of models
    (10 GB resident by its end without this)."""
    yield
    from tllm_spec.spec_model import SpecModel

    gc.collect()
    held = {id(o.loop) for o in [*gc.get_objects(), *_MODELS_OF_THE_COLLECTION] if type(o) is SpecModel}
    for loop in _engine_loops():
        if id(loop) not in held:
            loop.close()


def _engine_loops():
    """The EngineLoops whose thread runs (the thread's target is the loop's bound method)."""
    for thread in threading.enumerate():
        target = getattr(thread, "_target", None)
        if thread.name == "tllm_spec-engine" and target is not None:
            yield target.__self__
