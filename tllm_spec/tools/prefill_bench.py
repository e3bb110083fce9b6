"""Prefill on the CPU: the engine answering one long prompt with a single token against a transformers forward of the
same prompt, on the same machine, in one run (issue 51: an 1,800-token prompt of the demo target took 32.6 s through
the engine and 0.64 s through transformers while its attention went through the paged reference).

Both load the same checkpoint in fp32; each is warmed up on a short prompt, then both are timed on the same random
prompt, alternately, ``repeats`` times (the median of each is reported; alternating gives both the same share of
whatever else runs on the machine). The engine's time is ``SpecModel.generate`` of the prompt with
``max_new_tokens=1`` (admission, the prompt step(s), sampling and the output back to the caller); transformers' is
``AutoModelForCausalLM`` called on the prompt under ``torch.inference_mode`` (its default attention, SDPA).
"""
from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
from transformers import AutoModelForCausalLM

from .. import demo
from ..config import SamplingParams
from ..spec_model import SpecModel

WARMUP_TOKENS = 16


def random_prompt(vocab_size: int, num_tokens: int, seed: int = 0) -> list[int]:
    """``num_tokens`` token ids drawn uniformly from the vocabulary (a fixed seed: the same prompt every run)."""
    return torch.randint(0, vocab_size, (num_tokens,), generator=torch.Generator().manual_seed(seed)).tolist()


def timed(fn: Callable[[], object]) -> float:
    """Seconds one call of ``fn`` takes."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def measure_prefill(target: str = "demo://target", prompt_tokens: int = 1800, repeats: int = 3,
                    max_num_batched_tokens: int | None = None, seed: int = 0) -> dict:
    """Engine and transformers times of one ``prompt_tokens`` prompt on the CPU (fp32), their ratio, and whether
    both pick the same greedy next token. ``max_num_batched_tokens`` (None: the engine's default) splits the
    prompt over several steps (chunked prefill)."""
    engine_kwargs = {} if max_num_batched_tokens is None else {"max_num_batched_tokens": max_num_batched_tokens}
    hf = AutoModelForCausalLM.from_pretrained(demo.resolve(target), dtype=torch.float32).eval()
    prompt = random_prompt(hf.config.vocab_size, prompt_tokens, seed)
    greedy_one = SamplingParams(max_new_tokens=1, temperature=0.0)
    ids = torch.tensor([prompt])
    engine_times, hf_times = [], []
    with SpecModel.from_pretrained(target, None, dtype="float32", device="cpu", **engine_kwargs) as model, \
            torch.inference_mode():
        model.generate([prompt[:WARMUP_TOKENS]], greedy_one)
        hf(ids[:, :WARMUP_TOKENS])
        for _ in range(repeats):
            engine_times.append(timed(lambda: model.generate([prompt], greedy_one)))
            hf_times.append(timed(lambda: hf(ids)))
        engine_token = model.generate([prompt], greedy_one)[0].token_ids[0]
        hf_token = int(hf(ids).logits[0, -1].argmax())
    engine_s, hf_s = statistics.median(engine_times), statistics.median(hf_times)
    return {
        "target": target, "prompt_tokens": prompt_tokens, "max_num_batched_tokens": max_num_batched_tokens,
        "torch_threads": torch.get_num_threads(), "repeats": repeats,
        "engine_s": engine_s, "transformers_s": hf_s, "ratio": engine_s / hf_s,
        "engine_runs_s": engine_times, "transformers_runs_s": hf_times,
        "transformers_attention": hf.config._attn_implementation,
        "same_next_token": engine_token == hf_token,
    }
