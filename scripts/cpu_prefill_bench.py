"""The engine answering one long prompt with one token against a transformers forward of the same prompt, on this
machine's CPU (fp32); prints JSON with both median times and their ratio (tllm_spec/tools/prefill_bench.py).

    python3 scripts/cpu_prefill_bench.py --prompt-tokens 1800
"""
from __future__ import annotations

import argparse
import json

from tllm_spec.tools.prefill_bench import measure_prefill


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="demo://target", help="HF checkpoint directory (default: the embedded demo)")
    p.add_argument("--prompt-tokens", type=int, default=1800)
    p.add_argument("--repeats", type=int, default=3, help="timed runs of each side; the median is reported")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="prompt tokens an engine step prefills (smaller than the prompt: chunked prefill)")
    p.add_argument("--seed", type=int, default=0, help="the random prompt's seed")
    args = p.parse_args()
    result = measure_prefill(args.target, args.prompt_tokens, args.repeats, args.max_num_batched_tokens, args.seed)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
