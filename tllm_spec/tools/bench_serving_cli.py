"""Serving benchmark against an OpenAI-compatible completions server (tllm-spec serve, vLLM; also scripts/bench_serving.py): streamed requests
at a fixed concurrency or with Poisson arrivals; TTFT / TPOT / ITL / E2E percentiles, throughput and the prefix
cache's hit rate (cached prompt tokens over prompt tokens, from the usage, when the server reports them).

    tllm-spec bench-serve --concurrency 8 --num-prompts 64 --label spec --out runs/serve/spec
    tllm-spec bench-serve --request-rate 4 --prompt-file prompts.txt --label no-spec --out runs/serve/plain
    tllm-spec bench-serve --dataset shared-prefix --shared-prefix-len 4096 --question-len 128 --concurrency 16 \\
        --num-prompts 256 --out runs/serve/shared-prefix
    tllm-spec bench-serve --dataset multi-turn --turns 8 --question-len 128 --concurrency 16 --num-prompts 32 \\
        --out runs/serve/multi-turn
    tllm-spec bench-serve --compare runs/serve/spec/bench_serving.json \\
        runs/serve/plain/bench_serving.json --out runs/serve

Datasets (tllm_spec/tools/bench_datasets.py): random prompts of random token ids (or --prompt-file); shared-prefix:
one shared prefix of random ids then a distinct question per request; multi-turn: --num-prompts conversations of
--turns requests, each turn's prompt the previous prompt, its completion's text and a new question of
--question-len words (text prompts; a word a token on the random-weight benchmarks' tokenizer), the concurrency
counting conversations in flight.

Writes bench_serving.json (and bench_serving.png with matplotlib) under --out; --compare prints the runs side by
side and writes bench_serving_compare.png. See tllm_spec/tools/bench_serving.py for how tokens are counted.

Random prompts draw their ids from the served model's vocabulary, which tllm-spec serve's GET /v1/models card
states (vocab_size); another server's card may not: give --vocab-size. Exit status: 0 when every request
completed, 1 when any failed or the server could not be asked (one line on stderr), 2 on a usage error or a load
the served model cannot take (ids past its vocabulary, lengths past its max_model_len).
"""
from __future__ import annotations

import argparse
import sys
from typing import NoReturn

import httpx
from pydantic import ValidationError

from .bench_datasets import DATASETS
from .bench_report import compare, format_table, write_report
from .bench_serving import BenchConfig, run_benchmark

FLAGS = {"timeout_s": "--timeout", "continuous_usage": "--no-continuous-usage"}  # fields not named as their flag


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="tllm-spec bench-serve", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--model", help="model id (default: the first id of GET /v1/models)")
    p.add_argument("--api-key", help="sent as 'Authorization: Bearer KEY'")
    p.add_argument("--num-prompts", type=int, default=100, help="requests (multi-turn: conversations)")
    p.add_argument("--concurrency", type=int, help="N workers sending back to back (default 1); with "
                   "--request-rate, a cap on requests in flight")
    p.add_argument("--request-rate", type=float, help="Poisson arrivals, requests/s")
    p.add_argument("--seed", type=int, default=0, help="seeds the random prompts and the arrival times")
    p.add_argument("--dataset", choices=DATASETS, default="random", help="the prompts (see above)")
    p.add_argument("--random-input-len", type=int, default=128, help="tokens per random prompt")
    p.add_argument("--shared-prefix-len", type=int, default=1024, help="shared-prefix: tokens every prompt starts with")
    p.add_argument("--question-len", type=int, default=128, help="shared-prefix: tokens of each prompt's own "
                   "question after the prefix; multi-turn: words of each turn's new question")
    p.add_argument("--turns", type=int, default=4, help="multi-turn: requests per conversation")
    p.add_argument("--vocab-size", type=int, help="prompt ids lie in [0, V) (default: the served model's "
                   "vocab_size from GET /v1/models)")
    p.add_argument("--prompt-file", help="UTF-8, one prompt per line (the two characters \\n stand for a newline)")
    p.add_argument("--output-len", type=int, default=128, help="max_tokens of every request (sent with ignore_eos)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--no-continuous-usage", action="store_true",
                   help="do not ask for usage in every chunk (for servers that refuse continuous_usage_stats)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--label", help="the run's name in reports (default: the model id)")
    p.add_argument("--out", default="runs/bench_serving")
    p.add_argument("--compare", nargs="+", metavar="JSON", help="compare these result files instead of running")
    return p.parse_args(argv)


def config(args: argparse.Namespace) -> BenchConfig:
    return BenchConfig(base_url=args.base_url, model=args.model, api_key=args.api_key, num_prompts=args.num_prompts,
                       concurrency=args.concurrency, request_rate=args.request_rate, seed=args.seed,
                       dataset=args.dataset, random_input_len=args.random_input_len,
                       shared_prefix_len=args.shared_prefix_len, question_len=args.question_len, turns=args.turns,
                       vocab_size=args.vocab_size,
                       prompt_file=args.prompt_file, output_len=args.output_len, temperature=args.temperature,
                       continuous_usage=not args.no_continuous_usage, timeout_s=args.timeout, label=args.label)


def main(argv: list[str] | None = None) -> None:
    """Run (or compare); raises SystemExit(1) when any request failed, SystemExit(2) on a usage error."""
    args = parse_args(argv)
    if args.compare:
        print(compare(args.compare, args.out))
        return
    try:
        result = run_benchmark(config(args))
    except ValidationError as err:
        _exit(2, "; ".join(_describe(e) for e in err.errors()))
    except (ValueError, OSError) as err:  # a load the served model cannot take; an unreadable prompt file
        _exit(2, str(err))
    except httpx.HTTPError as err:
        _exit(1, f"GET {args.base_url}/v1/models failed: {type(err).__name__}: {err}")
    path = write_report(result, args.out)
    print(format_table([result]))
    for error in result["summary"]["errors"]:
        print(f"failed: {error}")
    print(f"wrote {path}")
    summary = result["summary"]
    if summary["num_failed"]:
        _exit(1, f"{summary['num_failed']} of {summary['num_requests']} requests failed (first error: "
              f"{summary['errors'][0]})")


def _describe(error: dict) -> str:
    field = ".".join(str(p) for p in error["loc"])
    if not field:  # a rule across fields
        return error["msg"].removeprefix("Value error, ")
    return f"{FLAGS.get(field, '--' + field.replace('_', '-'))}: {error['msg']} (got {error['input']!r})"


def _exit(status: int, message: str) -> NoReturn:
    print(f"tllm-spec bench-serve: error: {' '.join(message.splitlines())}", file=sys.stderr)
    raise SystemExit(status)
