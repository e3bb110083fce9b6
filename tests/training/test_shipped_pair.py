"""The shipped demo pair (tllm_spec/assets/demo): loads through the public API, decodes losslessly, and accepts
at least what the recipe measured when it built the pair. Skipped while the assets are absent."""
import json
from functools import cache

import pytest

from tllm_spec import Eagle3Config, MTPConfig, SamplingParams, SpecModel
from tllm_spec.demo import ASSETS, is_trained
from tllm_spec.tools.acceptance_eval import acceptance, heldout_texts, prompt_ids
from tllm_spec.tools.demo_assets import MAX_BYTES, MAX_FILE_BYTES

from ..models import hf_greedy

pytestmark = pytest.mark.skipif(not is_trained(), reason=f"no trained demo pair in {ASSETS} (build it with "
                                "scripts/build_demo_models.py and unpack it there)")
# Absolute floors, K = 3, T = 0, set under what the shipped pair measures (recipe.json cpu_check: EAGLE-3 3.22,
# MTP 2.40 tokens/step): a wrong aux-layer index, hidden feedback or a broken draft loop drops acceptance far
# below them.
FLOOR = {"eagle3": 2.4, "mtp": 2.0}
HEADS = {"eagle3": Eagle3Config(speculative_model="demo://eagle3", max_draft_len=3),
         "mtp": MTPConfig(num_nextn_predict_layers=1, max_draft_len=3, mtp_checkpoint="demo://mtp")}


@cache
def model(head: str | None) -> SpecModel:
    return SpecModel.from_pretrained("demo://target", HEADS.get(head), dtype="float32", device="cpu",
                                     max_batch_size=8, max_seq_len=256)


@cache
def recorded() -> dict:
    """What the recipe measured on the CPU right after training (same prompts and settings as below)."""
    return json.loads((ASSETS / "recipe.json").read_text())["cpu_check"]


def heldout_prompts(num: int, tokens: int) -> list[list[int]]:
    return prompt_ids(model(None).tokenizer, heldout_texts(ASSETS / "heldout.json"), num, tokens)


def test_sizes_fit_the_budget():
    sizes = [p.stat().st_size for p in ASSETS.rglob("*") if p.is_file()]
    assert sum(sizes) <= MAX_BYTES and max(sizes) <= MAX_FILE_BYTES


@pytest.mark.parametrize("head", [pytest.param("eagle3", marks=pytest.mark.slow), "mtp"])  # four seconds each
def test_greedy_speculative_output_equals_target_greedy(head):
    prompts = heldout_prompts(3, 32)
    outs = model(head).generate(prompts, SamplingParams(max_new_tokens=40, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(ASSETS / "target", prompt, 40)


@pytest.mark.parametrize("head", ["eagle3", pytest.param("mtp", marks=pytest.mark.slow)])  # the README command
def test_acceptance_clears_the_floor(head):  # keeps one head of each test
    check = recorded()
    prompts = heldout_prompts(check["num_prompts"], check["prompt_tokens"])
    stats = acceptance(model(head), prompts, check["max_new_tokens"], temperature=0.0)
    assert stats["mean_accepted_length"] >= FLOOR[head]
    assert stats["mean_accepted_length"] >= check[head]["mean_accepted_length"] - 0.1, (stats, check[head])


def test_default_generate_prints_python_like_text():
    out = model("eagle3").generate(["def fibonacci(n):\n"], SamplingParams(max_new_tokens=48))[0]
    assert out.text and out.stats.mean_accepted_length > 1.0
