"""Serving benchmark against an OpenAI-compatible completions server (tllm-spec serve, vLLM; also scripts/bench_serving.py): streamed requests
at a fixed concurrency or with Poisson arrivals; TTFT / TPOT / ITL / E2E percentiles and throughput.

    tllm-spec bench-serve --concurrency 8 --num-prompts 64 --label spec --out runs/serve/spec
    tllm-spec bench-serve --request-rate 4 --prompt-file prompts.txt --label no-spec --out runs/serve/plain
    tllm-spec bench-serve --compare runs/serve/spec/bench_serving.json \\
        runs/serve/plain/bench_serving.json --out runs/serve

Writes bench_serving.json (and bench_serving.png with matplotlib) under --out; --compare prints the runs side by
side and writes bench_serving_compare.png. See tllm_spec/tools/bench_serving.py for how tokens are counted.
"""
from __future__ import annotations

import argparse

from pydantic import ValidationError

from .bench_serving import BenchConfig, compare, format_table, run_benchmark, write_report


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="tllm-spec bench-serve", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--model", help="model id (default: the first id of GET /v1/models)")
    p.add_argument("--api-key", help="sent as 'Authorization: Bearer KEY'")
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--concurrency", type=int, help="N workers sending back to back (default 1); with "
                   "--request-rate, a cap on requests in flight")
    p.add_argument("--request-rate", type=float, help="Poisson arrivals, requests/s")
    p.add_argument("--seed", type=int, default=0, help="seeds the random prompts and the arrival times")
    p.add_argument("--random-input-len", type=int, default=128, help="tokens per random prompt")
    p.add_argument("--vocab-size", type=int, default=32000, help="random prompt ids lie in [0, V)")
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
                       random_input_len=args.random_input_len, vocab_size=args.vocab_size,
                       prompt_file=args.prompt_file, output_len=args.output_len, temperature=args.temperature,
                       continuous_usage=not args.no_continuous_usage, timeout_s=args.timeout, label=args.label)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.compare:
        print(compare(args.compare, args.out))
        return
    try:
        cfg = config(args)
    except ValidationError as err:
        raise SystemExit(f"bench_serving: {err}") from None
    result = run_benchmark(cfg)
    path = write_report(result, args.out)
    print(format_table([result]))
    for error in result["summary"]["errors"]:
        print(f"failed: {error}")
    print(f"wrote {path}")

