"""Closing a model: SpecModel.close() (and leaving ``with model:``) stops the engine's thread, ends what is still
queued or running with "abort" (pages back) and refuses later calls; every model still open is closed at
interpreter exit, before a tensor-parallel process group is (its ranks hung at exit on NCCL)."""
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from tllm_spec import SamplingParams, SpecModel
from tllm_spec.engine.cuda_graphs import compile_pays

from ..models import eagle3, tiny_pair

ROOT = Path(__file__).parents[2]


def test_close_aborts_running_and_queued_requests_and_frees_every_page():
    target, head = tiny_pair("llama")
    model = SpecModel.from_pretrained(target, eagle3(head, 3), max_batch_size=1)
    engine = model.engine
    free = engine.kv.num_free_pages
    running = model.generate_stream([5, 17, 3], SamplingParams(max_new_tokens=400, ignore_eos=True))
    queued = model.generate_stream([12, 8], SamplingParams(max_new_tokens=400, ignore_eos=True))  # no slot left
    first = next(iter(running))
    assert not first.finished
    model.close()
    assert [out.finish_reason for out in running][-1] == "abort"
    assert [out.finish_reason for out in queued][-1] == "abort"
    assert engine.num_requests == 0 and engine.kv.num_free_pages == free
    assert not model.loop._thread.is_alive()
    with pytest.raises(RuntimeError, match="closed"):
        model.generate([[1, 2]], SamplingParams(max_new_tokens=2))
    model.close()  # again: nothing to do


def test_with_block_closes_a_model_that_never_ran():
    target, _ = tiny_pair("llama")
    with SpecModel.from_pretrained(target, None) as model:
        pass
    with pytest.raises(RuntimeError, match="closed"):
        model.generate([[1, 2]], SamplingParams(max_new_tokens=2))


@pytest.mark.slow  # ten seconds or more on the 2-core CI machine: the second CI command runs it
def test_models_left_open_are_closed_at_exit():
    """A program that never closes its model, and drops it (as a main() that returns does): the exit hook stops
    the engine's thread before the interpreter tears down (and prints nothing)."""
    target, head = tiny_pair("llama")
    code = textwrap.dedent(f"""
        import atexit, threading
        from tllm_spec import SamplingParams, SpecModel
        from tests.models import eagle3
        from pathlib import Path
        atexit.register(lambda: print("engine threads at exit:", sum(t.name == "tllm_spec-engine"
                                                                     for t in threading.enumerate())))
        def main():  # the model is garbage once main() returns; its engine's thread still runs until exit
            model = SpecModel.from_pretrained({str(target)!r}, eagle3(Path({str(head)!r}), 3))
            print(model.generate([[5, 17, 3]], SamplingParams(max_new_tokens=4))[0].token_ids)
        main()
    """)
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "engine threads at exit: 0" in done.stdout  # ours ran before the probe registered earlier
    assert "Traceback" not in done.stderr


def test_compile_step_auto_compiles_targets_above_the_measured_size():
    from tllm_spec.engine.cuda_graphs import COMPILE_MIN_WEIGHT_BYTES

    small = torch.nn.Linear(64, 64)
    large = torch.nn.Linear(1, COMPILE_MIN_WEIGHT_BYTES // 4, bias=False, device="meta")  # fp32: 4 bytes each
    assert not compile_pays("auto", small) and compile_pays("auto", large)
    assert compile_pays(True, small) and not compile_pays(False, large)
