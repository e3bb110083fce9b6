"""Self-distillation data: the target's own continuations of prompts drawn from the training text.

At inference a draft proposes tokens after the target's *own* output: greedy text at T = 0, sampled text at
T = 1. Training only on the corpus conditions the deeper draft levels on tokens the target would often not
have produced (a small target is far from its corpus), so part of each draft batch comes from rollouts:
``prompt_tokens`` tokens of the training stream, continued by the target to ``seq_len`` tokens, half greedily
and half sampled at T = 1 (EOS is not special: the text simply goes on, as in the acceptance evaluation).
"""
from __future__ import annotations

import torch
from transformers import PreTrainedModel

from .data import sample_windows


@torch.no_grad()
def generate_rollouts(model: PreTrainedModel, stream: torch.Tensor, num_sequences: int, prompt_tokens: int,
                      seq_len: int, temperatures: tuple[float, ...] = (0.0, 1.0), batch_size: int = 512,
                      seed: int = 0) -> torch.Tensor:
    """[num_sequences, seq_len] int32 on the CPU: random ``prompt_tokens``-token windows of ``stream`` [N]
    continued by ``model`` (on its device); the sequences are split evenly over ``temperatures`` (0 = greedy)."""
    if not 0 < prompt_tokens < seq_len:
        raise ValueError(f"prompt_tokens must lie in (0, {seq_len}), got {prompt_tokens}")
    prompts = sample_windows(stream, num_sequences, prompt_tokens, seed, step=-1)  # step -1: no training batch
    device = model.get_output_embeddings().weight.device
    generator = torch.Generator(device=device).manual_seed(seed)
    was_training = model.training
    model.eval()
    out = []
    for temperature, group in zip(temperatures, prompts.tensor_split(len(temperatures))):
        for rows in group.split(batch_size):
            out.append(_continue(model, rows.to(device), seq_len, temperature, generator).to("cpu", torch.int32))
    model.train(was_training)
    return torch.cat(out)


def _continue(model: PreTrainedModel, ids: torch.Tensor, seq_len: int, temperature: float,
              generator: torch.Generator) -> torch.Tensor:
    """ids [B, P] int64 -> [B, seq_len] int64: KV-cached decoding to ``seq_len`` tokens."""
    out = model(input_ids=ids, use_cache=True)
    tokens = [ids, _pick(out.logits[:, -1], temperature, generator)[:, None]]
    for _ in range(seq_len - ids.shape[1] - 1):
        out = model(input_ids=tokens[-1], past_key_values=out.past_key_values, use_cache=True)
        tokens.append(_pick(out.logits[:, -1], temperature, generator)[:, None])
    return torch.cat(tokens, dim=1)


def _pick(logits: torch.Tensor, temperature: float, generator: torch.Generator) -> torch.Tensor:
    """logits [B, V] -> [B] int64: argmax at T = 0, else a sample at ``temperature``."""
    if temperature <= 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(1)
