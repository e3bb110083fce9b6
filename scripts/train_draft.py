r"""Train an EAGLE-3 head or MTP module(s) for a frozen HF target on local text / jsonl files.

    python scripts/train_draft.py --target /models/llama --data corpus/ notes.jsonl --kind eagle3 --out heads/e3 \
        --steps 4000 --batch 16 --seq-len 1024 --draft-vocab 32000 --device cuda
    python scripts/train_draft.py --target demo://target --data /usr/lib/python3.12 --suffixes .py --kind mtp \
        --out /tmp/mtp --steps 200 --device cpu
    python scripts/train_draft.py ... --resume          # continue from OUT/trainer_state.pt

Every 10th file (sorted) is held out (--heldout-every) and evaluated at the end; OUT/training_summary.json
holds the settings, steps, time and the held-out loss / per-level accuracy. EAGLE-3 heads are written in the
EAGLE/SpecForge dialect (config.json + model.safetensors); MTP weights with DeepSeek-style keys
(model.layers.{L+i}.*), read with MTPConfig(mtp_checkpoint=OUT).
"""
from __future__ import annotations

import argparse
import json

from tllm_spec.training import DraftTrainConfig, train_draft


def parse_args() -> DraftTrainConfig:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", required=True, help="HF causal-LM directory (demo://target for the demo)")
    p.add_argument("--data", nargs="+", required=True, help="text / jsonl files and directories")
    p.add_argument("--kind", choices=["eagle3", "mtp"], default="eagle3")
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup-steps", type=int, default=100)
    p.add_argument("--ttt-steps", type=int, default=3, help="draft levels unrolled (EAGLE-3 TTT / MTP-Eagle)")
    p.add_argument("--draft-vocab", type=int, help="EAGLE-3: draft vocabulary size (most frequent tokens)")
    p.add_argument("--aux-layers", type=int, nargs=3, help="EAGLE-3: 0-based layers whose output is captured")
    p.add_argument("--intermediate-size", type=int, help="EAGLE-3 head MLP width (default: the target's); "
                   "with --init-from: widen the existing head's MLP (new units start silent)")
    p.add_argument("--init-from", help="fine-tune this existing head / MTP directory (demo://eagle3, demo://mtp)")
    p.add_argument("--num-modules", type=int, default=1, help="MTP: > 1 trains vanilla MTP modules")
    p.add_argument("--hidden-feedback", choices=["pre_norm", "post_norm"], default="post_norm")
    p.add_argument("--rollouts", type=int, default=0, help="self-distillation: target continuations of training "
                   "prompts generated first (split over --rollout-temperatures) and mixed into every batch")
    p.add_argument("--rollout-prompt-tokens", type=int, default=64)
    p.add_argument("--rollout-temperatures", type=float, nargs="+", default=[0.0, 1.0],
                   help="temperature of each equal share of the rollouts (0: greedy)")
    p.add_argument("--rollout-share", type=float, default=0.5, help="fraction of each batch taken from the rollouts")
    p.add_argument("--rollouts-file", help="reuse the rollouts stored here (written on the first run)")
    p.add_argument("--tv-weight", type=float, default=0.0, help="add this times the total-variation distance to "
                   "the loss (trains T = 1 acceptance directly)")
    p.add_argument("--calibrate-temperature", action="store_true", help="EAGLE-3: fold the logit temperature "
                   "that best matches the target at T = 1 into the head (with --steps 0 --init-from: calibrate only)")
    p.add_argument("--heldout-every", type=int, default=10)
    p.add_argument("--suffixes", nargs="+", help="file suffixes taken from directories (default .py .txt .md "
                   ".rst .jsonl)")
    p.add_argument("--save-dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    p.add_argument("--minutes", type=float, help="wall-clock budget (the schedule shrinks to fit)")
    p.add_argument("--save-every", type=int, default=500)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--device", default="auto")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    fields = dict(target=a.target, data=tuple(a.data), kind=a.kind, out=a.out, steps=a.steps, batch_size=a.batch,
                  seq_len=a.seq_len, lr=a.lr, warmup_steps=a.warmup_steps, ttt_steps=a.ttt_steps,
                  draft_vocab=a.draft_vocab, aux_layers=tuple(a.aux_layers) if a.aux_layers else None,
                  intermediate_size=a.intermediate_size, init_from=a.init_from, num_modules=a.num_modules,
                  hidden_feedback=a.hidden_feedback, rollout_sequences=a.rollouts,
                  rollout_prompt_tokens=a.rollout_prompt_tokens, rollout_temperatures=tuple(a.rollout_temperatures),
                  rollout_share=a.rollout_share,
                  rollouts_file=a.rollouts_file, tv_weight=a.tv_weight,
                  calibrate_temperature=a.calibrate_temperature,
                  heldout_every=a.heldout_every, save_dtype=a.save_dtype,
                  time_budget_s=60 * a.minutes if a.minutes else None, save_every=a.save_every, resume=a.resume,
                  device=a.device, seed=a.seed)
    if a.suffixes:
        fields["suffixes"] = tuple(a.suffixes)
    return DraftTrainConfig(**fields)


def main() -> None:
    result = train_draft(parse_args())
    summary = result.summary
    print(json.dumps({k: summary[k] for k in ("steps", "seconds", "last_step", "heldout", "calibration")
                      if k in summary}, indent=2))
    print(f"written to {result.out}")


if __name__ == "__main__":
    main()
