"""Per-step MTP layer selection (``mtp_layer_selection="per_step"``): draft step k runs module k mod N, each
with its own ``shared_head.head``. Lossless, and the drafts equal a cache-free reference in which every module
reads the MTP-Eagle sequence of (token, hidden) pairs and logits come from the checkpoint's own heads."""
import functools
import tempfile
from pathlib import Path

import pytest
import torch

from tllm_spec import MTPConfig, SamplingParams
from tllm_spec.drafts.mtp.checkpoint import HEAD_KEY, save_mtp_weights
from tllm_spec.drafts.mtp.model import random_mtp_modules
from tllm_spec.spec_model import SpecModel
from tllm_spec.tools.random_models import save_random_target, target_config

from ..models import hf_greedy, hf_model
from .test_mtp_draft import PROMPTS, reference_module, run_recorded, stock_model

PER_STEP = MTPConfig(num_nextn_predict_layers=2, max_draft_len=3, mtp_layer_selection="per_step")


@functools.cache
def headed_target(arch: str, vocab_size: int, scale: float) -> tuple[Path, tuple[torch.Tensor, ...]]:
    """A tiny target with 2 DeepSeek-layout MTP modules, each with its own head (the target's lm_head plus
    noise: distinct, yet predictive enough that some drafts are accepted); returns the heads too."""
    root = Path(tempfile.mkdtemp(prefix="tllm_spec_mtp_heads_"))
    config = target_config(arch, vocab_size=vocab_size)
    save_random_target(root, config, seed=1)
    lm_head = hf_model(root).lm_head.weight.detach()
    states = random_mtp_modules(config, 2, seed=2, scale=scale, own_head=True)
    for state in states:
        state[HEAD_KEY] = lm_head + 0.5 * state[HEAD_KEY] * lm_head.std() / state[HEAD_KEY].std()
    save_mtp_weights(root, states, "deepseek")
    return root, tuple(s[HEAD_KEY] for s in states)


def reference_drafts(model, target: Path, heads, committed: list[int]) -> list[int]:
    """Drafts after ``committed``, recomputed from scratch: step k runs module k mod 2 over the whole sequence,
    its logits through ``heads[k mod 2]``, the new position's hidden = that module's post-norm output."""
    dm = model.worker.draft_model
    with torch.no_grad():
        hidden = hf_model(target).model(torch.tensor([committed[:-1]])).last_hidden_state[0]
        tokens, drafts = torch.tensor(committed[1:]), []
        for k in range(model.max_draft_len):
            norm = dm.mtp_modules[k % 2].shared_head["norm"]
            post = norm(reference_module(dm, k % 2, tokens, hidden)[-1:])
            drafts.append(int((post @ heads[k % 2].T).argmax(-1)))
            tokens = torch.cat([tokens, torch.tensor(drafts[-1:])])
            hidden = torch.cat([hidden, post])
    return drafts


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_per_step_selection_is_lossless(arch):
    target, _ = headed_target(arch, 97, 1.0)
    model = SpecModel.from_pretrained(target, PER_STEP, max_batch_size=3)
    assert model.worker.step_modules == (0, 1, 0) and len(model.worker.kv_layer_shapes()) == 2
    outs = model.generate(PROMPTS, SamplingParams(max_new_tokens=12))
    for prompt, out in zip(PROMPTS, outs):
        assert out.token_ids == hf_greedy(target, prompt, 12)


def test_per_step_drafts_equal_cache_free_reference():
    target, heads = headed_target("llama", 6, 4.0)
    model = SpecModel.from_pretrained(target, PER_STEP, max_batch_size=3)
    outs, recorded = run_recorded(model, PROMPTS, 12)
    stock = stock_model(target, PER_STEP)
    checked, lengths = 0, set()
    for b, (prompt, out) in enumerate(zip(PROMPTS, outs)):
        assert out.token_ids == hf_greedy(target, prompt, 12)
        total = 0
        for step, n in enumerate([1] + out.stats.accepted_per_step):
            total += n
            if total > len(out.token_ids) - 1:
                break  # the request finished in this step
            assert recorded[step][b] == reference_drafts(stock, target, heads, prompt + out.token_ids[:total]), \
                (b, step)
            checked, lengths = checked + 1, lengths | {n}
    assert checked >= 12 and len(lengths) >= 2, (checked, lengths)  # some drafts accepted, some rejected


def test_first_selection_ignores_the_other_modules():
    """The default ("first") loads and runs module 0 only, as TensorRT-LLM's MTP-Eagle does."""
    target, _ = headed_target("llama", 97, 1.0)
    model = SpecModel.from_pretrained(target, MTPConfig(num_nextn_predict_layers=2, max_draft_len=3),
                                      max_batch_size=1)
    assert model.worker.step_modules == (0, 0, 0) and len(model.worker.draft_model.mtp_modules) == 1


def test_per_step_is_an_mtp_eagle_option():
    with pytest.raises(ValueError, match="mtp_layer_selection"):
        MTPConfig(num_nextn_predict_layers=2, use_mtp_vanilla=True, mtp_layer_selection="per_step")
