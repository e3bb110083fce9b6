"""tllm-spec, the command line: "tllm-spec serve" runs the OpenAI-compatible server under uvicorn.

    tllm-spec serve                                   # the embedded demo pair, EAGLE-3 head, K=3
    tllm-spec serve --mtp                             # the demo target with its MTP module
    tllm-spec serve /models/llama --draft /models/eagle3 -k 3 --api-key KEY --port 8000
    tllm-spec serve /models/llama                     # a target alone: plain decoding
    tllm-spec serve --spec-config '{"use_dynamic_tree": true, "dynamic_tree_max_topK": 3,
                                    "max_total_draft_tokens": 25, "max_draft_len": 8}'   # a draft tree

A TARGET without --draft or --mtp decodes plainly (the demo's EAGLE-3 head only fits the demo target). Usage and
configuration errors are one line on stderr ("tllm-spec: error: ...") and exit status 2.
"""
from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, NoReturn

import uvicorn

from ..config import DEMO_MTP, DEMO_TARGET, Eagle3Config, MTPConfig

if TYPE_CHECKING:
    from ..spec_model import SpecModel

PROG = "tllm-spec"
DEMO_EAGLE3 = "demo://eagle3"
DEMO_MODEL_NAME = "tllm-spec-demo"
SERVE_MAX_NUM_BATCHED_TOKENS = 8192  # prompt tokens a serving step prefills (the offline engine takes 16384)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line instead of the usage and then the error
        print(f"{PROG}: error: {' '.join(message.splitlines())}", file=sys.stderr)
        raise SystemExit(2)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_serve(commands.add_parser("serve", help="run the OpenAI-compatible HTTP server"))
    commands.add_parser("bench-serve", help="load an OpenAI-compatible server and measure TTFT / TPOT / ITL "
                        "(tllm-spec bench-serve --help)")
    return parser


def _add_serve(p: argparse.ArgumentParser) -> None:
    from .app import DEFAULT_MAX_QUEUE  # the model stack loads for serving only, not for bench-serve

    p.add_argument("target", nargs="?", help=f"HF causal-LM directory (default: the embedded demo target, "
                   f"{DEMO_TARGET})")
    draft = p.add_mutually_exclusive_group()
    draft.add_argument("--draft", help="EAGLE-3 head directory")
    draft.add_argument("--mtp", action="store_true", help="MTP modules (the target's own; the demo's ships beside it)")
    draft.add_argument("--no-spec", action="store_true", help="plain decoding, no draft")
    p.add_argument("-k", "--max-draft-len", type=int, default=3, help="drafts proposed per step (default 3)")
    p.add_argument("--spec-config", type=_json_object, default={}, metavar="JSON",
                   help="more fields of the draft's config (Eagle3Config / MTPConfig, TensorRT-LLM's names) as a "
                   "JSON object, e.g. a tree: '{\"eagle_choices\": [[0], [1], [0, 0]], \"max_draft_len\": 2}'")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on every route but /health")
    p.add_argument("--served-model-name", help=f"the model name clients send (default: TARGET, or "
                   f"{DEMO_MODEL_NAME})")
    p.add_argument("--max-batch-size", type=int, help="requests decoded together (default: the engine's)")
    p.add_argument("--max-seq-len", type=int, help="prompt + generated tokens (default: the target's)")
    p.add_argument("--max-num-batched-tokens", type=int, default=SERVE_MAX_NUM_BATCHED_TOKENS,
                   help="prompt tokens prefilled per step; longer prompts go in chunks between decode steps, which "
                   "wait for each chunk (default: %(default)s, half the offline engine's: a long prompt stalls the "
                   "streams for half as long)")
    p.add_argument("--scheduler-delay-factor", type=float, help="while requests decode, a new one waits up to this "
                   "many prefill steps' time so that arrivals close together share one prefill step (default: the "
                   "engine's, 0.5; 0: admit at once)")
    p.add_argument("--max-queue", type=int, default=DEFAULT_MAX_QUEUE, help="requests in flight before 429")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--device", default="auto", help="'cpu', 'cuda', 'cuda:1' or 'auto'")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.set_defaults(run=serve)


def spec_config_of(args: argparse.Namespace) -> Eagle3Config | MTPConfig | None:
    """The draft the flags ask for: on the demo target its EAGLE-3 head unless --mtp or --no-spec; on another
    target none unless --draft or --mtp."""
    demo = args.target in (None, DEMO_TARGET)
    fields = {"max_draft_len": args.max_draft_len, **args.spec_config}  # --spec-config's fields win
    if args.no_spec or not (args.mtp or args.draft or demo):
        if args.spec_config:
            raise ValueError("--spec-config configures a draft: this run has none (give --draft or --mtp)")
        return None
    if args.mtp:
        return MTPConfig(**{"mtp_checkpoint": DEMO_MTP if demo else None, **fields})
    return Eagle3Config(**{"speculative_model": args.draft or DEMO_EAGLE3, **fields})


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise argparse.ArgumentTypeError(f"not JSON ({err})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"a JSON object of config fields is needed, got {text!r}")
    return value


def load_model(args: argparse.Namespace) -> SpecModel:
    from ..spec_model import SpecModel

    flags = (("max_batch_size", args.max_batch_size), ("max_seq_len", args.max_seq_len),
             ("max_num_batched_tokens", args.max_num_batched_tokens),
             ("scheduler_delay_factor", args.scheduler_delay_factor))
    engine_kwargs = {name: value for name, value in flags if value is not None}
    return SpecModel.from_pretrained(args.target or DEMO_TARGET, spec_config_of(args), dtype=args.dtype,
                                     device=args.device, **engine_kwargs)


class _Uvicorn(uvicorn.Server):
    """uvicorn's server, printing one line once it listens."""

    def __init__(self, config: uvicorn.Config, model_name: str):
        super().__init__(config)
        self.model_name = model_name

    async def startup(self, sockets: list | None = None) -> None:
        await super().startup(sockets)
        if not self.should_exit:
            port = self.servers[0].sockets[0].getsockname()[1] if self.servers else self.config.port
            print(f"{PROG}: serving {self.model_name} on http://{self.config.host}:{port}", flush=True)


def serve(args: argparse.Namespace) -> int:
    from .app import build_app

    try:
        model = load_model(args)
        model.warmup()  # compiles and captures before the first request, not during it
        name = args.served_model_name or (DEMO_MODEL_NAME if args.target in (None, DEMO_TARGET) else args.target)
        app = build_app(model, name, args.api_key, args.max_queue)
    except (ValueError, OSError, NotImplementedError) as err:  # pydantic's ValidationError is a ValueError
        _Parser(prog=PROG).error(f"{type(err).__name__}: {err}")
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            timeout_graceful_shutdown=5)
    _Uvicorn(config, name).run()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench-serve"]:  # the load generator: a tool above the server, imported only when asked for
        from ..tools.bench_serving_cli import main as bench_serve
        bench_serve(argv[1:])
        return 0
    args = build_parser().parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
