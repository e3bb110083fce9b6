"""The serving benchmark's datasets (tllm_spec/tools/bench_datasets.py): lengths as asked, a prefix shared by every
prompt, conversations whose turns grow, reproducible from the seed."""
from __future__ import annotations

import pytest
from pydantic import ValidationError

from tllm_spec.tools.bench_datasets import conversation_questions, longest_prompt, next_turn, shared_prefix_prompts
from tllm_spec.tools.bench_serving import BenchConfig


def test_shared_prefix_prompts_share_the_prefix_and_differ_after_it():
    prompts = shared_prefix_prompts(6, prefix_len=37, question_len=5, vocab_size=11, seed=3)
    assert prompts == shared_prefix_prompts(6, 37, 5, 11, seed=3) != shared_prefix_prompts(6, 37, 5, 11, seed=4)
    assert [len(p) for p in prompts] == [42] * 6 and all(0 <= t < 11 for p in prompts for t in p)
    assert len({tuple(p[:37]) for p in prompts}) == 1 and len({tuple(p[37:]) for p in prompts}) == 6


def test_conversation_questions_are_words_of_the_vocabulary():
    questions = conversation_questions(4, turns=3, question_len=7, vocab_size=13, seed=0)
    assert questions == conversation_questions(4, 3, 7, 13, seed=0) != conversation_questions(4, 3, 7, 13, seed=1)
    assert [len(q) for q in questions] == [3] * 4 and len({q for c in questions for q in c}) == 12
    words = [w for c in questions for q in c for w in q.split(" ")]
    assert len(words) == 4 * 3 * 7 and all(w.startswith("t") and 0 <= int(w[1:]) < 13 for w in words)


def test_next_turn_resends_the_conversation_with_a_space_between_parts():
    first = next_turn("", "", "t1 t2")
    assert first == "t1 t2"
    second = next_turn(first, "t3 t4", "t5")
    assert second == "t1 t2 t3 t4 t5" and second.startswith(first)
    assert next_turn("a\n", " b", "c") == "a\n b c"  # no space added next to whitespace already there
    assert next_turn("a", "", "c") == "a c"  # a failed turn: no completion


def test_longest_prompt_of_each_dataset():
    assert longest_prompt("random", 9, 100, 5, 4, 3) == (9, "--random-input-len")
    assert longest_prompt("shared-prefix", 9, 100, 5, 4, 3)[0] == 105
    assert longest_prompt("multi-turn", 9, 100, 5, 4, 3)[0] == 4 * 5 + 3 * 3  # the last turn's prompt


def test_a_prompt_file_is_only_the_random_datasets():
    BenchConfig(prompt_file="p.txt")
    with pytest.raises(ValidationError, match="not with --dataset shared-prefix"):
        BenchConfig(prompt_file="p.txt", dataset="shared-prefix")
    assert BenchConfig(dataset="multi-turn", num_prompts=3, turns=4).num_requests == 12
    assert BenchConfig(dataset="shared-prefix", num_prompts=3, turns=4).num_requests == 3
