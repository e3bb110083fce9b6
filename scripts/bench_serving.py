"""Serving benchmark against an OpenAI-compatible server: the same as ``tllm-spec bench-serve`` (see
tllm_spec/tools/bench_serving_cli.py; ``--help`` lists the options)."""
from tllm_spec.tools.bench_serving_cli import main

if __name__ == "__main__":
    main()
