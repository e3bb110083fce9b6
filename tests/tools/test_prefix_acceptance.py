"""Acceptance with the prefix cache cold and warm on the embedded demo pair (EAGLE-3 chain and static tree, MTP;
greedy and seeded sampling): identical outputs, warm mean accepted length at least the cold one's minus 0.02,
and the warm pass reuses every prompt's cacheable pages."""
from __future__ import annotations

import pytest

from tllm_spec.demo import resolve
from tllm_spec.drafts.tree import DEFAULT_EAGLE_CHOICES
from tllm_spec.tokenizer import load_tokenizer
from tllm_spec.tools.acceptance_eval import head_configs, heldout_texts, prompt_ids
from tllm_spec.tools.prefix_acceptance import evaluate, format_table, shared_prefix_prompts


def test_shared_prefix_prompts():
    assert shared_prefix_prompts([[1, 2], [3], [4, 5]], 5) == [[1, 2, 1, 2, 1, 3], [1, 2, 1, 2, 1, 4, 5]]


@pytest.mark.slow
def test_demo_pair_acceptance_is_the_same_cold_and_warm():
    heads = head_configs("demo://eagle3", "demo://mtp", 3, DEFAULT_EAGLE_CHOICES)
    prompts = prompt_ids(load_tokenizer(resolve("demo://target")), heldout_texts(), 3, 40)  # 3 repeated, 2 shared
    result = evaluate("demo://target", heads, prompts, 16, prefix_tokens=64, page_size=16)
    print(format_table(result))
    for name, runs in result["heads"].items():
        for run_name, r in runs.items():
            assert r["outputs_identical"] == r["num_prompts"], (name, run_name)
            assert r["warm_mean_accepted_length"] >= r["cold_mean_accepted_length"] - 0.02, (name, run_name)
            ideal = sum((n - 1) // 16 * 16 for n in ([40] * 3 if run_name.startswith("repeat") else [104] * 2))
            assert r["warm_cached_tokens"] == ideal, (name, run_name)
