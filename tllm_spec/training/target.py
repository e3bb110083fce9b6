"""Train a small Llama target from scratch on a token stream (next-token cross-entropy) and save it as an HF
checkpoint with small shards."""
from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedModel

from .data import eval_windows, sample_windows
from .loop import LoopConfig, LoopResult, autocast, run_loop


def llama_config(vocab_size: int, bos_token_id: int, eos_token_id: int, hidden_size: int, intermediate_size: int,
                 num_hidden_layers: int, num_attention_heads: int, num_key_value_heads: int,
                 max_position_embeddings: int = 2048, rope_theta: float = 10000.0) -> LlamaConfig:
    """A Llama config with tied input/output embeddings (the lm_head costs no extra bytes)."""
    return LlamaConfig(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_hidden_layers=num_hidden_layers, num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads, max_position_embeddings=max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": rope_theta}, rms_norm_eps=1e-5,
        tie_word_embeddings=True, bos_token_id=bos_token_id, eos_token_id=eos_token_id, pad_token_id=None)


def train_target(config: LlamaConfig, stream: torch.Tensor, loop: LoopConfig, batch_size: int, seq_len: int,
                 device: torch.device, state_dir: Path | None = None, seed: int = 0, resume: bool = False,
                 progress: bool = True, val_stream: torch.Tensor | None = None) -> tuple[PreTrainedModel, LoopResult]:
    """A fresh fp32 model trained on random windows of ``stream`` [N] (bf16 autocast on CUDA). With
    ``val_stream`` and ``loop.eval_every``, the weights with the lowest validation loss are kept (a small corpus
    is memorised quickly: the training loss keeps falling while the held-out loss climbs)."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").to(device)
    model.train()

    def step_fn(step: int) -> tuple[torch.Tensor, dict[str, float]]:
        ids = sample_windows(stream, batch_size, seq_len, seed, step).to(device)
        loss = model(input_ids=ids, labels=ids).loss
        return loss, {"loss": loss.item()}

    def eval_fn() -> float:
        model.eval()
        loss = eval_loss(model, val_stream, batch_size, seq_len, device, max_batches=16)
        model.train()
        return loss

    result = run_loop(model, step_fn, loop, device, state_dir, resume, desc="train target", progress=progress,
                      eval_fn=eval_fn if val_stream is not None else None)
    return model.eval(), result


@torch.no_grad()
def eval_loss(model: PreTrainedModel, stream: torch.Tensor, batch_size: int, seq_len: int, device: torch.device,
              max_batches: int = 8) -> float:
    """Mean next-token cross-entropy (nats) over consecutive windows of ``stream``."""
    batches = eval_windows(stream, batch_size, seq_len, max_batches)
    total = 0.0
    for ids in batches:
        ids = ids.to(device)
        with autocast(device):
            total += model(input_ids=ids, labels=ids).loss.item() / len(batches)
    return total


def save_target(model: PreTrainedModel, out: str | Path, dtype: torch.dtype = torch.bfloat16,
                max_shard_size: str = "12MB") -> list[Path]:
    """save_pretrained in ``dtype`` with shards of at most ``max_shard_size``; returns the weight files."""
    out = Path(out)
    model.to(dtype).save_pretrained(out, max_shard_size=max_shard_size)
    model.to(torch.float32)
    return sorted(out.glob("*.safetensors"))
