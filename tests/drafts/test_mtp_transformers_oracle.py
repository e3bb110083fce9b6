"""A second, independent oracle: transformers' own MTP speculative decoding (``generate(use_mtp=True)``).

transformers reads the DeepSeek-layout MTP weights with its own loader (``MtpModel.from_pretrained``), builds
``MtpLayer``s from the target's decoder-layer class, chains the post-``shared_head.norm`` hidden between
modules and keeps its own MTP cache. Its drafts must equal ours, step by step, with the default
``mtp_hidden_feedback`` (``"post_norm"``, what real checkpoints were trained with).

Two targets: a dense Llama whose checkpoint carries DeepSeek-layout MTP weights, and a tiny GLM-4.5-style MoE
target (its MTP block a MoE block, experts stored one tensor per expert, which transformers fuses with its own
converter). transformers finds the MTP weights through the patterns a model lists in
``_keys_to_ignore_on_load_unexpected`` (Llama lists none; GLM lists the real checkpoints' MTP layers 46 and 92),
which the test sets on the instance.
"""
import functools
import tempfile
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from tllm_spec import MTPConfig, SamplingParams
from tllm_spec.drafts.mtp.model import save_random_mtp_weights
from tllm_spec.spec_model import SpecModel
from tllm_spec.tools.random_models import save_random_target, target_config

from .test_mtp_moe import glm_target

candidate_generator = pytest.importorskip("transformers.generation.candidate_generator")
if not hasattr(candidate_generator, "MTPCandidateGenerator"):
    pytest.skip("this transformers version has no generate(use_mtp=True) (MTPCandidateGenerator, >= 5.17)",
                allow_module_level=True)

PROMPTS = [[5, 17, 3, 44, 9, 2, 71], [12, 8]]
MAX_NEW = 6


@functools.cache
def deepseek_style_target(num_modules: int) -> Path:
    root = Path(tempfile.mkdtemp(prefix="tllm_spec_mtp_hf_"))
    save_random_target(root, target_config("llama"), seed=0)
    save_random_mtp_weights(root, num_modules, "deepseek", seed=1, scale=2.0)
    return root


def transformers_drafts(target: Path, num_modules: int, prompt: list[int], monkeypatch) -> list[list[int]]:
    """The candidates transformers' MTP generator proposes at each step of a greedy generate(use_mtp=True)."""
    main = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    num_layers = main.config.num_hidden_layers
    main.config.num_mtp_layers = num_modules
    main._keys_to_ignore_on_load_unexpected = [rf"model\.layers\.{num_layers + i}\..*" for i in range(num_modules)]
    proposals, original = [], candidate_generator.MTPCandidateGenerator.get_candidates

    def recording(self, input_ids, *args, **kwargs):
        ids, logits = original(self, input_ids, *args, **kwargs)
        if ids.shape[1] > input_ids.shape[1]:  # the first call only lets the target run
            proposals.append(ids[0, input_ids.shape[1]:].tolist())
        return ids, logits

    monkeypatch.setattr(candidate_generator.MTPCandidateGenerator, "get_candidates", recording)
    with torch.no_grad():
        main.generate(torch.tensor([prompt]), use_mtp=True, max_new_tokens=MAX_NEW, do_sample=False, pad_token_id=0)
    return proposals


def our_drafts(target: Path, cfg: MTPConfig, prompt: list[int]) -> list[list[int]]:
    model = SpecModel.from_pretrained(target, cfg, max_batch_size=1)
    proposals, original = [], model.worker.draft

    def recording(*args):
        drafts = original(*args)
        proposals.append(drafts[0].tolist())
        return drafts

    model.worker.draft = recording
    model.generate([prompt], SamplingParams(max_new_tokens=MAX_NEW))
    return proposals


@pytest.mark.parametrize("prompt", PROMPTS, ids=["prompt7", "prompt2"])
@pytest.mark.parametrize("num_modules", [1, 2])
def test_drafts_equal_transformers_use_mtp(prompt, num_modules, monkeypatch):
    target = deepseek_style_target(num_modules)
    reference = transformers_drafts(target, num_modules, prompt, monkeypatch)
    assert len(reference) >= 3
    vanilla = MTPConfig(num_nextn_predict_layers=num_modules, use_mtp_vanilla=True)  # default feedback: post-norm
    assert our_drafts(target, vanilla, prompt)[:len(reference)] == reference
    if num_modules == 1:  # one module, one draft: MTP-Eagle with K = 1 is the same drafter
        assert our_drafts(target, MTPConfig(max_draft_len=1), prompt)[:len(reference)] == reference


@pytest.mark.parametrize("prompt", PROMPTS, ids=["prompt7", "prompt2"])
def test_moe_drafts_equal_transformers_use_mtp(prompt, monkeypatch):
    """GLM-4.5 layout: a MoE MTP block (router with correction bias, 8 experts, shared expert)."""
    target, _ = glm_target()
    reference = transformers_drafts(target, 1, prompt, monkeypatch)
    assert len(reference) >= 3
    for cfg in (MTPConfig(use_mtp_vanilla=True), MTPConfig(max_draft_len=1)):
        assert our_drafts(target, cfg, prompt)[:len(reference)] == reference
