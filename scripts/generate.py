r"""Generate with one-model speculative decoding; no arguments runs the embedded demo pair.

A speculative run is followed by plain decoding of the same prompts on the same engine settings, and the two
speeds, the speedup and the acceptance are printed (--no-baseline skips the plain run). --target alone decodes
that target plainly; --draft (EAGLE-3), --mtp, --draft-model (a small LM of its vocabulary) or --sa (drafts copied
from the text so far) gives it a draft; --sa-spec lets an EAGLE-3 head or MTP take the automaton's drafts where
the text repeats. --workload picks the embedded demo's held-out prompts: first-line (continue a file's opening) or
edit (quote a function and ask for it back with a change: most of the answer repeats the prompt).

    python scripts/generate.py
    python scripts/generate.py --mtp
    python scripts/generate.py --draft-model demo://draft
    python scripts/generate.py --sa --workload edit
    python scripts/generate.py --sa-spec --workload edit      # the demo's EAGLE-3 head, SA where text repeats
    python scripts/generate.py --config configs/demo_eagle3.yaml --prompt "def main():"
    python scripts/generate.py --target /models/llama --draft /models/eagle3 -k 3 --temperature 0.7 \
        --prompt-file prompts.txt --batch-size 8
    python scripts/generate.py --target /models/no-tokenizer --prompt-ids 1,2,3 --prompt-ids 4,5
    torchrun --nproc-per-node 2 scripts/generate.py --tensor-parallel-size 2 --target /models/llama \
        --draft /models/eagle3          # target split over 2 GPUs, draft on each; rank 0 prints

Exit status: 0 when at least one request decoded, 1 when every request was rejected (each reason on stderr),
2 on a usage or configuration error (one line on stderr: "generate.py: error: <flag or field>: <message>").
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

import torch
import yaml
from pydantic import ValidationError

from tllm_spec import GenerationOutputs, RunConfig, SpecModel, load_run_config
from tllm_spec.tools.comparison import Comparison, compare
from tllm_spec.tools.report import format_comparison, format_outputs

PROG = "generate.py"
DEMO_CONFIG = Path(__file__).parent.parent / "configs" / "demo_eagle3.yaml"
DEMO_PROMPTS = ["def fibonacci(n):\n", "import os\n\n\nclass ", "    for key, value in "]
DEFAULT_MAX_DRAFT_LEN = 3  # --mtp's K when neither -k nor the run file gives one (the demo's)
# run-file fields that a flag sets: a validation error on one is reported under the flag's name
FLAGS = {"target_model": "--target", "spec_config.speculative_model": "--draft",
         "spec_config.max_draft_len": "-k/--max-draft-len", "spec_config.sa_spec_threshold": "--sa-spec-threshold", "sampling.max_new_tokens": "--max-new-tokens",
         "sampling.temperature": "--temperature", "sampling.top_k": "--top-k", "sampling.top_p": "--top-p",
         "engine.max_batch_size": "--batch-size", "engine.tensor_parallel_size": "--tensor-parallel-size",
         "dtype": "--dtype", "device": "--device", "quantization": "--quantization",
         "draft_quantization": "--draft-quantization", "engine.kv_cache_dtype": "--kv-cache-dtype"}
# what bad input raises while a run file is read or a model loads (pydantic's ValidationError is a ValueError)
USER_ERRORS = (ValueError, OSError, NotImplementedError, yaml.YAMLError)
Prompt = str | list[int]  # text, or token ids (no tokenizer needed)


def exit_with_error(text: str) -> NoReturn:
    """argparse's exit: status 2 and one line on stderr."""
    print(f"{PROG}: error: {' '.join(text.splitlines())}", file=sys.stderr)
    raise SystemExit(2)


def fail(where: str, message: str) -> NoReturn:
    exit_with_error(f"{where}: {message}")


class Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, like ours, instead of the usage and then the error
        exit_with_error(message.removeprefix("argument "))


def token_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated token ids such as 1,2,3, got {text!r}") from None


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = Parser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="YAML run file (configs/*.yaml); flags below override it")
    p.add_argument("--target", help="HF causal-LM directory (default: the embedded demo target); without --config, "
                   "--draft or --mtp it is decoded plainly")
    p.add_argument("--draft", help="EAGLE-3 head directory")
    p.add_argument("--mtp", action="store_true", help="MTP (MTP-Eagle) instead of EAGLE-3: modules from the target "
                   "checkpoint (the demo target: its module demo://mtp)")
    p.add_argument("--draft-model", help="a draft LM: a causal LM directory of the target's vocabulary (the demo "
                   "target's: demo://draft)")
    p.add_argument("--sa", action="store_true", help="suffix-automaton drafting: drafts copied from the prompt and "
                   "output so far (no draft model; K default 8)")
    p.add_argument("--sa-spec", action="store_true", help="on top of the EAGLE-3 head or MTP: drafts from the "
                   "suffix automaton where the text's suffix repeats at least --sa-spec-threshold tokens")
    p.add_argument("--sa-spec-threshold", type=int, help="suffix-match length from which --sa-spec takes the "
                   "automaton's drafts (default 4)")
    p.add_argument("--workload", choices=["first-line", "edit"], help="prompts from the embedded demo's held-out "
                   "files (default: three fixed openings)")
    p.add_argument("--num-prompts", type=int, default=4, help="prompts --workload takes")
    p.add_argument("--no-spec", action="store_true", help="plain decoding through the same engine")
    p.add_argument("--no-baseline", action="store_true", help="skip the plain-decoding run after a speculative one")
    p.add_argument("-k", "--max-draft-len", type=int, help="drafts per step")
    p.add_argument("--prompt", action="append", dest="prompts", default=[], metavar="TEXT",
                   help="a prompt (repeatable)")
    p.add_argument("--prompt-ids", action="append", dest="prompts", type=token_ids, metavar="ID,ID,...",
                   help="a prompt of token ids, e.g. 1,2,3 (repeatable; needs no tokenizer)")
    p.add_argument("--prompt-file", help="UTF-8, one prompt per line (the two characters \\n stand for a newline)")
    p.add_argument("--max-new-tokens", type=int)
    p.add_argument("--temperature", type=float)
    p.add_argument("--top-k", type=int)
    p.add_argument("--top-p", type=float)
    p.add_argument("--batch-size", type=int, help="max requests decoded together")
    p.add_argument("--tensor-parallel-size", type=int, help="split the target over N ranks (launch with torchrun "
                   "--nproc-per-node N; gloo on CPU)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--quantization", choices=["fp8"], help="the target's linear layers quantized to FP8 at load (an "
                   "FP8 checkpoint loads as FP8 without it)")
    p.add_argument("--draft-quantization", choices=["fp8"], help="the draft's own linear layers in FP8 too")
    p.add_argument("--kv-cache-dtype", choices=["auto", "fp8"], help="the KV pool's element type ('fp8': E4M3, "
                   "the checkpoint's k_scale/v_scale or 1.0)")
    p.add_argument("--device")
    p.add_argument("--json", help="write outputs and stats here")
    p.add_argument("--threads", type=int, default=1, help="CPU intra-op threads (small models decode fastest on "
                   "one: OpenMP spin-waits cost more than they give, and far more when cores are shared)")
    return p.parse_args(argv)


def base_config(args: argparse.Namespace) -> dict:
    """--config's fields, else the demo pair's; --target without --config drops the demo head (it drafts for the
    demo target's vocabulary only)."""
    try:
        cfg = load_run_config(args.config or DEMO_CONFIG).model_dump()
    except USER_ERRORS as err:
        fail("--config", str(err))
    if args.target and not args.config:
        cfg["spec_config"] = None
    return cfg


DRAFTERS = {"--draft": "draft", "--mtp": "mtp", "--draft-model": "draft_model", "--sa": "sa"}


def spec_from_flags(spec: dict | None, args: argparse.Namespace) -> dict | None:
    """The run file's spec_config with --no-spec, --draft, --mtp, --draft-model, --sa, --sa-spec and -k applied."""
    given = [flag for flag, name in DRAFTERS.items() if getattr(args, name)]
    if len(given) > 1:
        fail(given[0], f"cannot be combined with {given[1]}: each picks the drafter, give one")
    if args.no_spec:
        return None
    if args.draft:
        kept = spec if spec and spec["decoding_type"] == "eagle3" else {}
        spec = {**kept, "decoding_type": "eagle3", "speculative_model": args.draft}
    elif args.mtp and (spec or {}).get("decoding_type") != "mtp":  # MTP-Eagle with as many drafts as the file's
        spec = {"decoding_type": "mtp", "max_draft_len": (spec or {}).get("max_draft_len") or DEFAULT_MAX_DRAFT_LEN}
    elif args.draft_model:
        spec = {"decoding_type": "draft_target", "speculative_model": args.draft_model}
    elif args.sa:
        spec = {"decoding_type": "sa"}
    spec = with_sa_spec(spec, args)
    if args.max_draft_len is not None:
        if spec is None:
            fail("-k/--max-draft-len", "plain decoding drafts nothing: add --draft, --mtp or a --config with a "
                 "spec_config")
        spec = {**spec, "max_draft_len": args.max_draft_len}
    return spec


def with_sa_spec(spec: dict | None, args: argparse.Namespace) -> dict | None:
    """--sa-spec (and its threshold) on the EAGLE-3 or MTP spec."""
    if not args.sa_spec and args.sa_spec_threshold is None:
        return spec
    if spec is None or spec["decoding_type"] not in ("eagle3", "mtp"):
        fail("--sa-spec", "enhances an EAGLE-3 head or MTP modules (--draft, --mtp, or a --config with one); "
             "--sa alone drafts from the automaton only")
    fields = {"use_sa_spec": True}
    if args.sa_spec_threshold is not None:
        fields["sa_spec_threshold"] = args.sa_spec_threshold
    return {**spec, **fields}


def apply_flags(cfg: dict, args: argparse.Namespace) -> None:
    """Override the run file's fields with the flags that were given."""
    sampling = {"max_new_tokens": args.max_new_tokens, "temperature": args.temperature, "top_k": args.top_k,
                "top_p": args.top_p}
    engine = {"max_batch_size": args.batch_size, "tensor_parallel_size": args.tensor_parallel_size,
              "kv_cache_dtype": args.kv_cache_dtype}
    for section, values in (("sampling", sampling), ("engine", engine)):
        cfg[section].update({k: v for k, v in values.items() if v is not None})
    cfg["spec_config"] = spec_from_flags(cfg["spec_config"], args)
    cfg["target_model"] = args.target or cfg["target_model"]
    cfg["dtype"] = args.dtype or cfg["dtype"]
    cfg["quantization"] = args.quantization or cfg["quantization"]
    cfg["draft_quantization"] = args.draft_quantization or cfg["draft_quantization"]
    cfg["device"] = args.device or cfg["device"]
    spec = cfg["spec_config"]
    if cfg["draft_quantization"] and (spec is None or spec["decoding_type"] == "sa"):
        fail("--draft-quantization" if args.draft_quantization else "draft_quantization", "it quantizes a draft "
             "network, and this run has none (suffix drafting has none): add --draft, --mtp or --draft-model")


def build_config(args: argparse.Namespace) -> RunConfig:
    cfg = base_config(args)
    apply_flags(cfg, args)
    try:
        return RunConfig.model_validate(cfg)
    except ValidationError as err:
        exit_with_error("; ".join(describe_problem(e) for e in err.errors()))


def describe_problem(error: dict) -> str:
    """``--flag: message (got value)`` for a field a flag sets, else ``field.path: message``."""
    field = ".".join(str(p) for p in error["loc"] if p not in ("eagle3", "mtp", "draft_target", "sa"))  # union tag
    message = error["msg"].removeprefix("Value error, ")
    if field in FLAGS:
        return f"{FLAGS[field]}: {message} (got {error['input']!r})"
    return f"{field or 'config'}: {message}"


def read_prompt_file(path: str) -> list[str]:
    """The non-blank lines of a UTF-8 file; the two characters ``\\n`` in a line stand for a newline."""
    try:
        text = Path(path).read_text(encoding="utf-8-sig")
    except (OSError, UnicodeDecodeError) as err:
        fail("--prompt-file", str(err))
    return [line.replace("\\n", "\n") for line in text.split("\n") if line.strip()]


def read_prompts(args: argparse.Namespace) -> list[Prompt]:
    prompts = args.prompts + (read_prompt_file(args.prompt_file) if args.prompt_file else [])
    if args.workload:
        from tllm_spec.tools.workloads import edit_prompts, first_line_prompts

        prompts += (edit_prompts if args.workload == "edit" else first_line_prompts)(args.num_prompts)
    return prompts or list(DEMO_PROMPTS)


def decode(cfg: RunConfig, prompts: list[Prompt], args: argparse.Namespace, progress: bool
           ) -> tuple[GenerationOutputs, Comparison | None]:
    """The speculative (or plain) run's outputs, and its comparison with plain decoding unless there is none."""
    try:
        if cfg.spec_config is None or args.no_baseline:
            model = SpecModel.from_run_config(cfg)
            return model.generate(prompts, cfg.sampling, seed=args.seed, progress=progress), None
        comparison = compare(cfg, prompts, seed=args.seed, progress=progress)
        return comparison.spec, comparison
    except USER_ERRORS as err:
        fail(culprit(err, args), str(err))


def culprit(err: BaseException, args: argparse.Namespace) -> str:
    """The flag (or run-file field) a load error is about, from the package that raised it: the draft's loaders
    (tllm_spec.drafts), the tensor-parallel setup (tllm_spec.distributed), else the target's."""
    modules = {frame.f_globals.get("__name__", "") for frame, _ in traceback.walk_tb(err.__traceback__)}
    if any(name.startswith("tllm_spec.drafts.") for name in modules):
        return next((flag for flag, name in DRAFTERS.items() if getattr(args, name)), "spec_config")
    if any(name.startswith("tllm_spec.distributed.") for name in modules):
        return "--tensor-parallel-size"
    return "--target" if args.target else "target_model"


def report(outputs: GenerationOutputs, comparison: Comparison | None, cfg: RunConfig, prompts: list[Prompt]
           ) -> None:
    shown = [p if isinstance(p, str) else f"{p} " for p in prompts]  # id prompts print as a list, then the output
    print(format_outputs(outputs, shown, aggregate=comparison is None))
    if comparison is not None:
        print(format_comparison(comparison, cfg))


def write_json(path: str, outputs: GenerationOutputs, comparison: Comparison | None, cfg: RunConfig,
               prompts: list[Prompt]) -> None:
    Path(path).write_text(json.dumps({"config": cfg.model_dump(), "stats": outputs.stats, "outputs": [
        {"prompt": p, "prompt_token_ids": o.prompt_token_ids, "text": o.text, "token_ids": o.token_ids,
         "finish_reason": o.finish_reason, "error": o.error, "stats": o.stats.summary()}
        for p, o in zip(prompts, outputs)],
        "baseline_stats": comparison.plain.stats if comparison else None,
        "identical_to_baseline": comparison.same_tokens if comparison else None}, indent=2))


def rejection_status(outputs: GenerationOutputs, first_rank: bool) -> int:
    """Rank 0 prints each rejected request's reason on stderr; 1 when every request was rejected, else 0."""
    rejected = [(i, o.error) for i, o in enumerate(outputs) if o.finish_reason == "rejected"]
    for i, error in rejected if first_rank else ():
        print(f"{PROG}: request {i} rejected: {error}", file=sys.stderr)
    return 1 if len(rejected) == len(outputs) else 0


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", message=r"request \d+ rejected")  # reported below, once each
    cfg = build_config(args)
    prompts = read_prompts(args)
    first_rank = int(os.environ.get("RANK", "0")) == 0  # every rank decodes the same steps; rank 0 reports
    outputs, comparison = decode(cfg, prompts, args, progress=first_rank)
    if first_rank:
        report(outputs, comparison, cfg, prompts)
    if first_rank and args.json:
        write_json(args.json, outputs, comparison, cfg, prompts)
    return rejection_status(outputs, first_rank)


if __name__ == "__main__":
    sys.exit(main())
