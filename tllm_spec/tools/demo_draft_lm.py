"""The demo's draft LM (``demo://draft``): a small Llama of the target's vocabulary, run by the one-model
draft_target mode, trained against the frozen target.

Its token embedding starts as the target's, projected on its principal directions. Three objectives: ``"text"``,
next-token cross-entropy on corpus text; ``"rollouts"``, the same on the target's own continuations
(:mod:`..training.rollout`, half greedy half T = 1) mixed with corpus text; ``"kl"``, KL(target || draft) on every
position of corpus windows (the target's full next-token distribution, computed on the fly). On the 2-core CPU the
shipped draft was trained on, "text" reached the highest held-out agreement in the same time: a KL step costs three
to five text steps, and a rollout token more (docs/demo_pair.md). The draft is scored by its greedy agreement with
the target's greedy next token, teacher-forced: on held-out text, and on the target's own greedy continuations of
held-out prompts, where the chain a K-draft step accepts is read off the matches.
"""
from __future__ import annotations

import json
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, PreTrainedModel

from ..tokenizer import load_tokenizer
from ..training.data import eval_windows, read_documents, sample_rows, sample_windows, split_heldout, tokenize_documents
from ..training.loop import LoopConfig, run_loop
from ..training.rollout import generate_rollouts
from ..training.target import llama_config, save_target
from .acceptance_eval import heldout_texts, prompt_ids
from .demo_assets import corpus_root

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


@dataclass(frozen=True)
class DraftLMShape:
    """The draft LM's shape and training settings. Two layers: a CPU decode step costs per layer, and the
    embedding (tied, 4096 x hidden) is most of the bytes, so width is kept to what the 25 MB demo budget allows."""

    model: dict = field(default_factory=lambda: dict(
        hidden_size=128, intermediate_size=384, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
        max_position_embeddings=2048))
    objective: Literal["text", "rollouts", "kl"] = "text"
    init_embedding: bool = True  # start from the target's token embedding, projected to the draft's width
    seq_len: int = 512
    batch: int = 4  # on a 2-core CPU, many small steps learned faster than fewer big ones
    lr: float = 3e-3
    warmup_steps: int = 100
    max_steps: int = 100_000
    rollout_share: float = 0.5  # of each batch, when trained on rollouts
    share: float = 0.25  # of the recipe's training minutes, on top of the other phases
    eval_batches: int = 16  # held-out windows scored: eval_batches x batch
    eval_prompts: int = 16  # held-out prompts the target continues greedily for the chain score ...
    eval_prompt_tokens: int = 64
    eval_new_tokens: int = 128
    k: int = 3  # ... at this draft length
    timing_rounds: int = 5  # CPU forward timings of the draft and the target (0: none)


TINY_DRAFT_LM = DraftLMShape(  # for the CPU tests
    model=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=1,
               num_key_value_heads=1, max_position_embeddings=256),
    seq_len=32, batch=4, max_steps=4, eval_batches=1, eval_prompts=2, eval_prompt_tokens=8, eval_new_tokens=8,
    timing_rounds=0)


def train_draft_lm(target: PreTrainedModel, stream: torch.Tensor, shape: DraftLMShape, device: torch.device,
                   budget_s: float | None, rollouts: torch.Tensor | None = None, progress: bool = True, seed: int = 0,
                   draft: PreTrainedModel | None = None) -> tuple[PreTrainedModel, dict]:
    """A draft LM (fp32; a fresh one unless ``draft`` is given) trained against the frozen ``target`` on windows
    of ``stream`` [N] int32, with ``shape.objective`` (``rollouts`` [R, seq_len] int32 required for "rollouts");
    returns it with a summary."""
    target.eval().requires_grad_(False)
    draft = (draft if draft is not None else new_draft_lm(target, shape, seed)).to(device).train()
    num_rollout_rows = round(shape.batch * shape.rollout_share) if shape.objective == "rollouts" else 0
    if num_rollout_rows and rollouts is None:
        raise ValueError("objective='rollouts' needs the target's rollouts")

    def step_fn(step: int) -> tuple[torch.Tensor, dict[str, float]]:
        ids = sample_windows(stream, shape.batch - num_rollout_rows, shape.seq_len, seed, step)
        if num_rollout_rows:
            ids = torch.cat([ids, sample_rows(rollouts, num_rollout_rows, seed, step)])
        ids = ids.to(device)
        logits = draft(input_ids=ids).logits[:, :-1].float()  # [B, S-1, V]
        if shape.objective == "kl":
            with torch.no_grad():
                target_logits = target(input_ids=ids).logits[:, :-1].float()
            loss, labels = kl_loss(logits, target_logits), target_logits.argmax(-1)
        else:
            labels = ids[:, 1:]
            loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
        return loss, {"loss": loss.item(), "acc0": (logits.argmax(-1) == labels).float().mean().item()}

    loop = LoopConfig(max_steps=shape.max_steps, lr=shape.lr, warmup_steps=shape.warmup_steps, weight_decay=0.1,
                      time_budget_s=budget_s)
    result = run_loop(draft, step_fn, loop, device, None, desc=f"train draft LM ({shape.objective})", progress=progress)
    tail = result.losses[-20:]
    summary = {"objective": shape.objective, "steps": result.step, "seconds": round(result.seconds, 1),
               "tokens": result.step * shape.batch * shape.seq_len, "train_loss_first": round(result.losses[0], 4),
               "train_loss_last": round(sum(tail) / len(tail), 4)}
    return draft.eval(), summary


def new_draft_lm(target: PreTrainedModel, shape: DraftLMShape, seed: int = 0) -> PreTrainedModel:
    """A fresh fp32 draft LM of ``shape.model`` with the target's vocabulary and special tokens."""
    tc = target.config
    config = llama_config(tc.vocab_size, tc.bos_token_id, tc.eos_token_id, **shape.model)
    torch.manual_seed(seed)
    draft = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    if shape.init_embedding:
        with torch.no_grad():
            draft.get_input_embeddings().weight.copy_(projected_embedding(target, config.hidden_size))
    return draft


@torch.no_grad()
def projected_embedding(target: PreTrainedModel, width: int) -> torch.Tensor:
    """[V, width] float32: the target's token embedding [V, H] on its ``width`` principal directions (the rank-
    ``width`` factor U S of its SVD, which keeps the tokens' dot products best: the tied lm_head's logits)."""
    embedding = target.get_input_embeddings().weight.float()
    if width > embedding.shape[1]:
        return F.pad(embedding, (0, width - embedding.shape[1]))
    u, s, _ = torch.linalg.svd(embedding, full_matrices=False)
    return u[:, :width] * s[:width]


def kl_loss(draft_logits: torch.Tensor, target_logits: torch.Tensor) -> torch.Tensor:
    """Mean over positions of KL(p_target || q_draft); both [B, S, V] float32."""
    log_q = F.log_softmax(draft_logits, dim=-1).flatten(0, 1)
    log_p = F.log_softmax(target_logits, dim=-1).flatten(0, 1)
    return F.kl_div(log_q, log_p, log_target=True, reduction="batchmean")


@torch.no_grad()
def text_agreement(draft: PreTrainedModel, target: PreTrainedModel, stream: torch.Tensor, batch_size: int,
                   seq_len: int, max_batches: int) -> dict[str, float]:
    """Teacher-forced on windows spread over ``stream`` [N] (held-out text): how often the draft's argmax is the
    target's argmax (the per-position greedy acceptance), and the draft's KL to the target."""
    device = draft.get_output_embeddings().weight.device
    same = kl = 0.0
    windows = eval_windows(stream, batch_size, seq_len, max_batches)
    for ids in windows:
        ids = ids.to(device)
        q, p = draft(input_ids=ids).logits.float(), target(input_ids=ids).logits.float()
        same += (q.argmax(-1) == p.argmax(-1)).float().mean().item() / len(windows)
        kl += kl_loss(q, p).item() / len(windows)
    return {"agreement": round(same, 4), "kl": round(kl, 4), "positions": sum(w.numel() for w in windows)}


@torch.no_grad()
def chain_agreement(draft: PreTrainedModel, target: PreTrainedModel, prompts: list[list[int]], new_tokens: int,
                    k: int) -> dict[str, float]:
    """On the target's greedy continuation of each prompt (``new_tokens`` tokens; prompts of one length): the
    draft's teacher-forced agreement with it, and the mean accepted length of a K-draft chain at T = 0 read off
    the matches (a draft matching the target sees exactly the context it is teacher-forced with)."""
    device = draft.get_output_embeddings().weight.device
    ids = greedy_continuation(target, torch.tensor(prompts, device=device), new_tokens)  # [P, L + n]
    start = len(prompts[0])
    match = draft(input_ids=ids).logits[:, start - 1:-1].argmax(-1) == ids[:, start:]  # [P, n] bool
    tokens = steps = 0
    for row in match.tolist():
        i = 0
        while i < len(row):
            accepted = next((j for j, m in enumerate(row[i:i + k]) if not m), min(k, len(row) - i))
            i, tokens, steps = i + accepted + 1, tokens + accepted + 1, steps + 1
    return {"agreement": round(match.float().mean().item(), 4), f"mean_accepted_length_k{k}": round(tokens / steps, 4),
            "prompts": len(prompts), "new_tokens": new_tokens}


@torch.no_grad()
def greedy_continuation(model: PreTrainedModel, ids: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """ids [B, P] int64 -> [B, P + new_tokens] int64: KV-cached greedy decoding (EOS is not special)."""
    out = model(input_ids=ids, use_cache=True)
    tokens = [ids]
    for _ in range(new_tokens):
        tokens.append(out.logits[:, -1:].argmax(-1))
        out = model(input_ids=tokens[-1], past_key_values=out.past_key_values, use_cache=True)
    return torch.cat(tokens, dim=1)


@torch.no_grad()
def forward_ms(model: PreTrainedModel, num_tokens: int, context: int = 128, repeats: int = 100) -> float:
    """Median ms of one batch-1 forward of ``num_tokens`` new tokens after ``context`` cached ones (CPU timing)."""
    ids = torch.randint(2, model.config.vocab_size, (1, context + num_tokens))
    cache = model(input_ids=ids[:, :context], use_cache=True).past_key_values
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        model(input_ids=ids[:, context:], past_key_values=cache, use_cache=True)
        times.append(1e3 * (time.perf_counter() - start))
        cache.crop(-num_tokens)  # a negative count: transformers 4.x and 5.x both read it
    return sorted(times)[len(times) // 2]


def forward_costs(draft: PreTrainedModel, target: PreTrainedModel, rounds: int = 5, repeats: int = 100
                  ) -> dict[str, float]:
    """Batch-1 CPU forward ms of the draft and the target at 1 and 4 new tokens: the best of ``rounds`` medians,
    the two models taking turns (a shared machine's load hits both alike)."""
    best: dict[str, float] = {}
    for _ in range(rounds):
        for name, model in (("draft", draft), ("target", target)):
            for n in (1, 4):
                key = f"{name}_{n}tok_ms"
                best[key] = round(min(best.get(key, float("inf")), forward_ms(model, n, repeats=repeats)), 3)
    best["ratio_1tok"] = round(best["draft_1tok_ms"] / best["target_1tok_ms"], 3)
    return best


def save_draft_lm(draft: PreTrainedModel, target_dir: Path, out: Path) -> None:
    """bf16 ``model.safetensors`` (one file), config, generation config and the target's tokenizer files: a
    complete HF model directory."""
    shutil.rmtree(out, ignore_errors=True)
    save_target(draft, out, max_shard_size="50MB")
    for name in TOKENIZER_FILES:
        shutil.copy2(target_dir / name, out / name)


def draft_lm_phase(shape: DraftLMShape, target_dir: Path, stream: torch.Tensor, held: torch.Tensor,
                   heldout_json: Path, dest: Path, device: torch.device, budget_s: float | None,
                   rollouts: torch.Tensor | None = None, progress: bool = True) -> dict:
    """Train, score on held-out text and on the target's greedy continuations, time (CPU) and save the draft LM
    in ``dest``; returns the summary recorded in recipe.json under "draft_lm"."""
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).to(device)
    draft, summary = train_draft_lm(target, stream, shape, device, budget_s, rollouts, progress)
    summary = {"shape": asdict(shape), **summary}
    if rollouts is not None and shape.objective == "rollouts":
        summary["rollout_tokens"] = int(rollouts.numel())
    summary["heldout_text"] = text_agreement(draft, target, held, shape.batch, shape.seq_len, shape.eval_batches)
    prompts = prompt_ids(load_tokenizer(target_dir), heldout_texts(heldout_json), shape.eval_prompts,
                         shape.eval_prompt_tokens)
    summary["heldout_greedy"] = chain_agreement(draft, target, prompts, shape.eval_new_tokens, shape.k)
    if shape.timing_rounds:
        summary["cpu_forward"] = forward_costs(draft.cpu(), target.cpu(), shape.timing_rounds)
    save_draft_lm(draft, target_dir, dest)
    summary["bytes"] = sum(p.stat().st_size for p in dest.iterdir())
    print(f"draft LM: {json.dumps({k: v for k, v in summary.items() if k != 'shape'})}", flush=True)
    return summary


def split_corpus(files: list[Path], heldout_json: Path) -> tuple[list[Path], list[Path]]:
    """(train, held-out) files of a corpus: held out are the files ``heldout_json`` lists (paths relative to the
    corpus root) and, should this corpus differ from the one it was written for, every 10th file of this one."""
    listed = set(json.loads(heldout_json.read_text())["files"])
    root = corpus_root(files)
    heldout = [f for f in files if str(f.relative_to(root)) in listed]
    excluded = set(heldout) | set(split_heldout(files)[1])
    return [f for f in files if f not in excluded], heldout


def build_draft_lm(files: list[Path], target_dir: Path, heldout_json: Path, dest: Path, minutes: float | None,
                   shape: DraftLMShape, device: torch.device, rollout_sequences: int = 256, progress: bool = True
                   ) -> dict:
    """The recipe's draft-LM phase on its own, against an already trained target: corpus split by
    ``heldout_json``, rollouts generated here when ``shape.objective`` needs them (their time counts against
    ``minutes``; None: ``shape.max_steps`` steps, however long they take)."""
    start = time.perf_counter()
    train, heldout = split_corpus(files, heldout_json)
    tokenizer = load_tokenizer(target_dir)
    stream = tokenize_documents(tokenizer, read_documents(train), tokenizer.eos_token_id)
    held = tokenize_documents(tokenizer, read_documents(heldout) if heldout else heldout_texts(heldout_json),
                              tokenizer.eos_token_id)
    rollouts = None
    if shape.objective == "rollouts":
        target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).to(device)
        rollouts = generate_rollouts(target, stream, rollout_sequences, 64, shape.seq_len, batch_size=64)
    data = {"corpus_root": str(corpus_root(files)), "train_files": len(train), "heldout_files": len(heldout),
            "heldout_listed": len(json.loads(heldout_json.read_text())["files"]),
            "train_tokens": int(stream.numel()), "heldout_tokens": int(held.numel()),
            "prepare_s": round(time.perf_counter() - start, 1)}
    budget_s = None if minutes is None else 60.0 * minutes - data["prepare_s"]
    summary = draft_lm_phase(shape, target_dir, stream, held, heldout_json, dest, device, budget_s, rollouts,
                             progress)
    return {**data, **summary}


def record(recipe_json: Path, summary: dict) -> None:
    """Add (or replace) ``recipe.json``'s "draft_lm" entry, keeping the rest."""
    recipe = json.loads(recipe_json.read_text())
    recipe["draft_lm"] = summary
    recipe_json.write_text(json.dumps(recipe, indent=2))
