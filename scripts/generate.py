r"""Generate with one-model speculative decoding; no arguments runs the embedded demo pair.

A speculative run is followed by plain decoding of the same prompts on the same engine settings, and the two
speeds, the speedup and the acceptance are printed (--no-baseline skips the plain run).

    python scripts/generate.py
    python scripts/generate.py --mtp
    python scripts/generate.py --config configs/demo_eagle3.yaml --prompt "def main():"
    python scripts/generate.py --target /models/llama --draft /models/eagle3 -k 3 --temperature 0.7 \
        --prompt-file prompts.txt --batch-size 8
    torchrun --nproc-per-node 2 scripts/generate.py --tensor-parallel-size 2 --target /models/llama \
        --draft /models/eagle3          # target split over 2 GPUs, draft on each; rank 0 prints
"""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch

from tllm_spec import RunConfig, SpecModel, load_run_config
from tllm_spec.tools.comparison import compare
from tllm_spec.tools.report import format_comparison, format_outputs

DEMO_PROMPTS = ["def fibonacci(n):\n", "import os\n\n\nclass ", "    for key, value in "]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="YAML run file (configs/*.yaml); flags below override it")
    p.add_argument("--target", help="HF causal-LM directory (default: the embedded demo target)")
    p.add_argument("--draft", help="EAGLE-3 head directory")
    p.add_argument("--mtp", action="store_true", help="MTP (MTP-Eagle) instead of EAGLE-3: modules from the target "
                   "checkpoint (the demo target: its module demo://mtp)")
    p.add_argument("--no-spec", action="store_true", help="plain decoding through the same engine")
    p.add_argument("--no-baseline", action="store_true", help="skip the plain-decoding run after a speculative one")
    p.add_argument("-k", "--max-draft-len", type=int, help="drafts per step")
    p.add_argument("--prompt", action="append", help="a prompt (repeatable)")
    p.add_argument("--prompt-file", help="one prompt per line (\\n escapes allowed)")
    p.add_argument("--max-new-tokens", type=int)
    p.add_argument("--temperature", type=float)
    p.add_argument("--top-k", type=int)
    p.add_argument("--top-p", type=float)
    p.add_argument("--batch-size", type=int, help="max requests decoded together")
    p.add_argument("--tensor-parallel-size", type=int, help="split the target over N ranks (launch with torchrun "
                   "--nproc-per-node N; gloo on CPU)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--device")
    p.add_argument("--json", help="write outputs and stats here")
    p.add_argument("--threads", type=int, default=1, help="CPU intra-op threads (small models decode fastest on "
                   "one: OpenMP spin-waits cost more than they give, and far more when cores are shared)")
    return p.parse_args()


def build_config(args: argparse.Namespace) -> RunConfig:
    base = load_run_config(args.config) if args.config else load_run_config(
        Path(__file__).parent.parent / "configs" / "demo_eagle3.yaml")
    cfg = base.model_dump()
    if args.target:
        cfg["target_model"] = args.target
    spec = cfg["spec_config"] or {}
    if args.draft:
        spec = {**({} if spec.get("decoding_type") != "eagle3" else spec), "decoding_type": "eagle3",
                "speculative_model": args.draft}
    if args.mtp and spec.get("decoding_type") != "mtp":  # MTP-Eagle with the same number of drafts
        spec = {"decoding_type": "mtp", "max_draft_len": spec.get("max_draft_len")}
    if args.max_draft_len and spec:
        spec["max_draft_len"] = args.max_draft_len
    cfg["spec_config"] = None if args.no_spec else (spec or None)
    overrides = {"max_new_tokens": args.max_new_tokens, "temperature": args.temperature, "top_k": args.top_k,
                 "top_p": args.top_p}
    cfg["sampling"].update({k: v for k, v in overrides.items() if v is not None})
    if args.batch_size:
        cfg["engine"]["max_batch_size"] = args.batch_size
    if args.tensor_parallel_size:
        cfg["engine"]["tensor_parallel_size"] = args.tensor_parallel_size
    cfg["dtype"] = args.dtype or cfg["dtype"]
    cfg["device"] = args.device or cfg["device"]
    return RunConfig.model_validate(cfg)


def read_prompts(args: argparse.Namespace) -> list[str]:
    prompts = list(args.prompt or [])
    if args.prompt_file:
        text = Path(args.prompt_file).read_text()
        prompts += [line.encode().decode("unicode_escape") for line in text.splitlines() if line.strip()]
    return prompts or DEMO_PROMPTS


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    cfg = build_config(args)
    prompts = read_prompts(args)
    first_rank = int(os.environ.get("RANK", "0")) == 0  # every rank decodes the same steps; rank 0 reports
    comparison = None
    if cfg.spec_config is None or args.no_baseline:
        outputs = SpecModel.from_run_config(cfg).generate(prompts, cfg.sampling, seed=args.seed, progress=first_rank)
    else:
        comparison = compare(cfg, prompts, seed=args.seed, progress=first_rank)
        outputs = comparison.spec
    if not first_rank:
        return
    print(format_outputs(outputs, prompts, aggregate=comparison is None))
    if comparison is not None:
        print(format_comparison(comparison, cfg))
    if args.json:
        Path(args.json).write_text(json.dumps({"config": cfg.model_dump(), "stats": outputs.stats, "outputs": [
            {"prompt": p, "text": o.text, "token_ids": o.token_ids, "finish_reason": o.finish_reason,
             "error": o.error, "stats": o.stats.summary()} for p, o in zip(prompts, outputs)],
            "baseline_stats": comparison.plain.stats if comparison else None,
            "identical_to_baseline": comparison.same_tokens if comparison else None}, indent=2))

if __name__ == "__main__":
    main()
