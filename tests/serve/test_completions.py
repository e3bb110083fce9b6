"""Completions and chat through the official openai client against a real server: streamed text == non-streamed
text == offline SpecModel.generate, greedy and seeded; stop strings, max_tokens and usage exact."""
from __future__ import annotations

import pytest

from tllm_spec import SamplingParams

from .clients import GREEDY, SEEDED, chat, complete, offline_text, scrape

PROMPTS = ["def fibonacci(n):\n", "import os\n\n\nclass ", "    for key, value in "]
SAMPLINGS = {"greedy": GREEDY, "seeded": SEEDED}


@pytest.mark.parametrize("sampling", SAMPLINGS)
@pytest.mark.parametrize("prompt", PROMPTS)
def test_completion_streamed_equals_non_streamed_equals_offline(client, offline, prompt, sampling):
    params = SAMPLINGS[sampling]
    expected = offline_text(offline, prompt, max_new_tokens=24, **params)
    whole = complete(client, prompt, stream=False, max_tokens=24, **params)
    streamed = complete(client, prompt, stream=True, max_tokens=24, **params)
    assert whole.text == streamed.text == expected
    assert whole.finish_reason == streamed.finish_reason
    assert streamed.num_chunks > 1 and streamed.usage == whole.usage


def test_completion_of_token_ids_equals_offline(client, offline):
    ids = offline.encode(PROMPTS[0])
    assert complete(client, ids, stream=False, max_tokens=16, **GREEDY).text == \
        offline_text(offline, ids, max_new_tokens=16, **GREEDY)


@pytest.mark.parametrize("sampling", SAMPLINGS)
def test_chat_streamed_equals_non_streamed_equals_offline_with_the_builtin_template(client, offline, sampling):
    params = SAMPLINGS[sampling]
    messages = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "def add(a, b):"}]
    prompt = "<|system|>\nYou write Python.\n<|user|>\ndef add(a, b):\n<|assistant|>\n"  # the documented template
    expected = offline_text(offline, prompt, max_new_tokens=24, **params)
    whole = chat(client, messages, stream=False, max_tokens=24, **params)
    streamed = chat(client, messages, stream=True, max_completion_tokens=24, **params)
    assert whole.text == streamed.text == expected
    assert whole.usage.prompt_tokens == len(offline.encode(prompt))


def test_usage_counts_the_prompt_and_the_generated_tokens(client, offline):
    reference = offline.generate([PROMPTS[1]], SamplingParams(max_new_tokens=20, **GREEDY))[0]
    for stream in (False, True):
        usage = complete(client, PROMPTS[1], stream=stream, max_tokens=20, **GREEDY).usage
        assert usage.prompt_tokens == len(offline.encode(PROMPTS[1])) == len(reference.prompt_token_ids)
        assert usage.completion_tokens == len(reference.token_ids)
        assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


@pytest.mark.parametrize("max_tokens", [1, 5, 13])
def test_max_tokens_is_exact(client, offline, max_tokens):
    expected = offline_text(offline, PROMPTS[2], max_new_tokens=max_tokens, ignore_eos=True, **GREEDY)
    for stream in (False, True):
        result = complete(client, PROMPTS[2], stream=stream, max_tokens=max_tokens, extra_body={"ignore_eos": True},
                          **GREEDY)
        assert (result.text, result.finish_reason, result.usage.completion_tokens) == (expected, "length", max_tokens)


def test_stop_strings_cut_the_text_before_the_first_one(client, offline):
    full = offline_text(offline, PROMPTS[0], max_new_tokens=32, ignore_eos=True, **GREEDY)
    early, late = full[12:15], full[20:24]  # the cut is at whichever of them comes first in the text
    cut = min(full.index(early), full.index(late))
    for stream in (False, True):
        result = complete(client, PROMPTS[0], stream=stream, max_tokens=32, stop=[late, early],
                          extra_body={"ignore_eos": True}, **GREEDY)
        assert (result.text, result.finish_reason) == (full[:cut], "stop")
        assert early not in result.text and late not in result.text
        assert result.usage.completion_tokens < 32
    single = complete(client, PROMPTS[0], stream=False, max_tokens=32, stop=late, **GREEDY)
    assert single.text == full[:full.index(late)]


def test_metrics_count_a_finished_request(client, server_url, offline):
    before = scrape(server_url)
    result = complete(client, PROMPTS[0], stream=True, max_tokens=16, extra_body={"ignore_eos": True}, **GREEDY)
    after = scrape(server_url)
    delta = {name: after[name] - before.get(name, 0.0) for name in after}
    assert delta['tllm_spec_requests_total{finish_reason="length"}'] == 1
    assert delta["tllm_spec_generation_tokens_total"] == result.usage.completion_tokens == 16
    assert delta["tllm_spec_prompt_tokens_total"] == len(offline.encode(PROMPTS[0]))
    assert delta["tllm_spec_time_to_first_token_seconds_count"] == 1
    assert delta["tllm_spec_time_per_output_token_seconds_count"] == 1
    steps = delta["tllm_spec_accepted_tokens_per_step_count"]
    assert 1 <= steps < 16 and delta["tllm_spec_accepted_tokens_per_step_sum"] >= steps  # drafts were accepted
    assert after["tllm_spec_requests_running"] == 0
    assert delta["tllm_spec_compiled_graphs"] == 0 and after["tllm_spec_cuda_graphs"] == 0  # no compile on the
    # request's path (a CPU server compiles and captures nothing at all)
