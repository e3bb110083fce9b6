"""The prompts of ``tllm-spec bench-serve``'s datasets, all drawn from a seed.

- ``random``: prompts of random token ids (or the lines of a prompt file).
- ``shared-prefix``: one long shared system prompt of random ids, then a distinct random question per request
  (vLLM's ``prefix_repetition`` dataset with one prefix): what a prefix cache serves from the second request on.
- ``multi-turn``: conversations; each turn's prompt resends the conversation so far, its previous prompt, that
  prompt's completion text and a new question, so every turn starts with the whole previous turn. Text prompts
  (a completion comes back as text): a question is words ``t<id>``, one token each on the numbered tokenizer of
  the random-weight benchmarks (tools/serving_harness.py), a few tokens each on another tokenizer (the server's
  usage says how many).
"""
from __future__ import annotations

import random
from pathlib import Path
from typing import Literal, get_args

Dataset = Literal["random", "shared-prefix", "multi-turn"]
DATASETS: tuple[str, ...] = get_args(Dataset)


def random_prompts(num: int, input_len: int, vocab_size: int, seed: int) -> list[list[int]]:
    """``num`` prompts of ``input_len`` ids in [0, vocab_size)."""
    rng = random.Random(seed)
    return [[rng.randrange(vocab_size) for _ in range(input_len)] for _ in range(num)]


def file_prompts(path: str, num: int) -> list[str]:
    """``num`` prompts from the non-blank lines of a UTF-8 file, cycled; ``\\n`` in a line stands for a newline."""
    lines = [ln.replace("\\n", "\n") for ln in Path(path).read_text(encoding="utf-8-sig").split("\n") if ln.strip()]
    if not lines:
        raise ValueError(f"{path}: no prompts")
    return [lines[i % len(lines)] for i in range(num)]


def shared_prefix_prompts(num: int, prefix_len: int, question_len: int, vocab_size: int,
                          seed: int) -> list[list[int]]:
    """``num`` prompts of ``prefix_len + question_len`` ids: the same ``prefix_len`` first, then each its own
    random question."""
    rng = random.Random(seed)
    prefix = [rng.randrange(vocab_size) for _ in range(prefix_len)]
    return [prefix + [rng.randrange(vocab_size) for _ in range(question_len)] for _ in range(num)]


def conversation_questions(num: int, turns: int, question_len: int, vocab_size: int, seed: int) -> list[list[str]]:
    """The questions of ``num`` conversations of ``turns`` turns: ``question_len`` words ``t<id>`` each, ids in
    [0, vocab_size)."""
    rng = random.Random(seed)
    return [[" ".join(f"t{rng.randrange(vocab_size)}" for _ in range(question_len)) for _ in range(turns)]
            for _ in range(num)]


def next_turn(prompt: str, completion: str, question: str) -> str:
    """The next turn's prompt: the conversation so far (``prompt``, "" before the first turn, and its
    ``completion``), then ``question``; a space between parts where neither side has whitespace."""
    text = prompt
    for part in (completion, question):
        if part:
            text += part if not text or text[-1].isspace() or part[0].isspace() else " " + part
    return text


def longest_prompt(dataset: str, random_input_len: int, shared_prefix_len: int, question_len: int, turns: int,
                   output_len: int) -> tuple[int, str]:
    """The most prompt tokens a request of the dataset holds (a multi-turn question's words counted as tokens)
    and the flags that make it up."""
    if dataset == "shared-prefix":
        return shared_prefix_len + question_len, "--shared-prefix-len + --question-len"
    if dataset == "multi-turn":
        return (turns * question_len + (turns - 1) * output_len,
                "--turns x --question-len + (--turns - 1) x --output-len")
    return random_input_len, "--random-input-len"
