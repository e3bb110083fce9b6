"""Several models in one process with the step's traces kept on disk (tllm_spec.trace_cache), on the GPU: an
EAGLE-3 chain, a static draft tree and MTP modules, built one after another from empty caches and again from warm
ones, each compiled step's greedy output equal to the same model's eager output. The second model of a process
once crashed inside torch's DynamoCache ('expected OutputCode, got <class method>')."""
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from tllm_spec import Eagle3Config, MTPConfig, SamplingParams, trace_cache
from tllm_spec.spec_model import SpecModel

from ..models import tiny_pair
from ..test_mtp_lossless import mtp_target

pytestmark = [pytest.mark.cuda, pytest.mark.compiles]
ROOT = Path(__file__).resolve().parents[2]
PROMPTS = [[5, 17, 3, 44, 9, 2, 71], [12, 8], [60, 61, 62, 63, 1, 2, 3, 4, 5]]
MAX_NEW = [20, 9, 17]
SMALL_TREE = [[0], [1], [0, 0], [0, 1], [0, 0, 0]]


def child() -> dict:
    """Three models, one after another in this process: each compiled and graphed, against itself eager."""
    from torch._dynamo.utils import counters

    target, head = tiny_pair("llama")
    builds = [(target, Eagle3Config(speculative_model=str(head), max_draft_len=3)),
              (target, Eagle3Config(speculative_model=str(head), max_draft_len=3, eagle_choices=SMALL_TREE,
                                    max_total_draft_tokens=len(SMALL_TREE))),
              (mtp_target("qwen2", "mimo"), MTPConfig(num_nextn_predict_layers=1, max_draft_len=3))]
    params = [SamplingParams(max_new_tokens=n) for n in MAX_NEW]
    equal, compiled = [], []
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for path, spec in builds:
            outs = []
            for eager in (False, True):
                model = SpecModel.from_pretrained(path, spec, dtype=torch.float32, device="cuda", max_batch_size=4,
                                                  enforce_eager=eager, compile_step=True)
                outs.append([out.token_ids for out in model.generate(PROMPTS, params)])
                if not eager:
                    compiled.append(model.runner.compiles_step_whole and bool(model.runner.graph_runner.graphs))
            equal.append(outs[0] == outs[1])
    return {"equal": equal, "compiled": compiled, "loaded": counters["dynamo_cache"]["dynamo_cache_hit"],
            "fell_back": [str(w.message) for w in seen if "trace cache" in str(w.message)]}


def _run(cache: Path) -> dict:
    code = "import json; from tests.gpu.test_trace_cache_gpu import child; print(json.dumps(child()))"
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor"), "TRITON_CACHE_DIR": str(cache / "triton"),
           trace_cache.TRACE_CACHE_VAR: "1"}
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=900, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_three_models_in_one_process_from_empty_then_warm_caches(tmp_path):
    fresh = _run(tmp_path)
    assert fresh["equal"] == [True] * 3 and fresh["compiled"] == [True] * 3 and not fresh["fell_back"], fresh
    warm = _run(tmp_path)
    assert warm["equal"] == [True] * 3 and warm["compiled"] == [True] * 3 and not warm["fell_back"], warm
    assert warm["loaded"] > 0
