"""tllm-spec, the command line: "tllm-spec serve" runs the OpenAI-compatible server under uvicorn.

    tllm-spec serve                                   # the embedded demo pair, EAGLE-3 head, K=3
    tllm-spec serve --mtp                             # the demo target with its MTP module
    tllm-spec serve /models/llama --draft /models/eagle3 -k 3 --api-key KEY --port 8000
    tllm-spec serve /models/llama                     # a target alone: plain decoding
    tllm-spec serve --draft-model demo://draft        # the demo target with its draft LM
    tllm-spec serve /models/llama --sa -k 8           # drafts copied from each request's own text
    tllm-spec serve --sa-spec                         # the demo's EAGLE-3 head, SA where the text repeats
    tllm-spec serve /models/llama --quantization fp8  # its linear layers in FP8 (an FP8 checkpoint needs no flag)
    tllm-spec serve --spec-config '{"use_dynamic_tree": true, "dynamic_tree_max_topK": 3,
                                    "max_total_draft_tokens": 25, "max_draft_len": 8}'   # a draft tree

A TARGET without --draft, --mtp, --draft-model or --sa decodes plainly (the demo's EAGLE-3 head only fits the demo target). Usage and
configuration errors are one line on stderr ("tllm-spec: error: --flag: ...") and exit status 2; the flags, the
device, the address and --max-seq-len against the target's positions are checked before the model loads.

Requests: temperature defaults to 1 (OpenAI's); max_tokens to 16 (completions) or the rest of the context (chat),
and one that does not fit the context is a 400. Honoured: sampling, stop, logprobs, streaming, structured outputs
(response_format, vLLM's guided_json / guided_regex / guided_grammar / guided_choice / structured_outputs), tool
calls (tool_choice "required" or a named function; "auto" is refused); every other OpenAI field is informational
or a 400 naming it (docs/serving.md). Prefix caching is on (--no-enable-prefix-caching: off); POST
/reset_prefix_cache forgets the cached pages. SIGINT / SIGTERM drain the server (--shutdown-timeout) and exit 0.
"""
from __future__ import annotations

import argparse
import errno
import json
import math
import socket
import sys
import traceback
from collections.abc import Sequence
from typing import TYPE_CHECKING, NoReturn

import uvicorn
from pydantic import ValidationError

from ..config import (
    DEMO_MTP,
    DEMO_TARGET,
    DraftTargetConfig,
    Eagle3Config,
    EngineConfig,
    MTPConfig,
    SAConfig,
    SpecConfig,
)

if TYPE_CHECKING:
    from ..spec_model import SpecModel

PROG = "tllm-spec"
DEMO_EAGLE3 = "demo://eagle3"
DEMO_MODEL_NAME = "tllm-spec-demo"
SERVE_MAX_NUM_BATCHED_TOKENS = 8192  # prompt tokens a serving step prefills (the offline engine takes 16384)
# what bad input raises while the model loads (pydantic's ValidationError is a ValueError)
USER_ERRORS = (ValueError, OSError, NotImplementedError)
ENGINE_FLAGS = {"max_batch_size": "--max-batch-size", "max_seq_len": "--max-seq-len",
                "max_num_batched_tokens": "--max-num-batched-tokens",
                "scheduler_delay_factor": "--scheduler-delay-factor",
                "enable_prefix_caching": "--enable-prefix-caching", "kv_cache_dtype": "--kv-cache-dtype"}
SPEC_FLAGS = {"max_draft_len": "-k/--max-draft-len", "speculative_model": "--draft/--draft-model"}  # fields --spec-config may set


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line instead of the usage and then the error
        fail(message.removeprefix("argument "))


def fail(message: str) -> NoReturn:
    """argparse's exit: one line on stderr, status 2."""
    print(f"{PROG}: error: {' '.join(message.splitlines())}", file=sys.stderr)
    raise SystemExit(2)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_serve(commands.add_parser("serve", help="run the OpenAI-compatible HTTP server", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter))
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
    draft.add_argument("--draft-model", help="a draft LM: a causal LM directory of the target's vocabulary (the "
                       "demo's: demo://draft)")
    draft.add_argument("--sa", action="store_true", help="drafts copied from each request's prompt and output "
                       "(suffix automaton; K default 8)")
    draft.add_argument("--no-spec", action="store_true", help="plain decoding, no draft")
    p.add_argument("--sa-spec", action="store_true", help="the EAGLE-3 head or MTP takes the suffix automaton's "
                   "drafts where a request's text repeats (use_sa_spec; sa_spec_threshold through --spec-config)")
    p.add_argument("-k", "--max-draft-len", type=int, help="drafts proposed per step (default 3; needs a draft)")
    p.add_argument("--spec-config", type=_json_object, default={}, metavar="JSON",
                   help="more fields of the draft's config (Eagle3Config / MTPConfig, TensorRT-LLM's names) as a "
                   "JSON object, e.g. a tree: '{\"eagle_choices\": [[0], [1], [0, 0]], \"max_draft_len\": 2}'")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=_port, default=8000, help="TCP port, 0-65535 (0: any free one; default 8000)")
    p.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on every route but /health")
    p.add_argument("--served-model-name", help=f"the model name clients send (default: TARGET, or "
                   f"{DEMO_MODEL_NAME})")
    p.add_argument("--max-batch-size", type=int, help="requests decoded together (default: the engine's)")
    p.add_argument("--max-seq-len", type=int, help="prompt + generated tokens (default: the target's; at most its "
                   "max_position_embeddings, or what its rope scaling stretches that to)")
    p.add_argument("--max-num-batched-tokens", type=int, default=SERVE_MAX_NUM_BATCHED_TOKENS,
                   help="prompt tokens prefilled per step; longer prompts go in chunks between decode steps, which "
                   "wait for each chunk (default: %(default)s, half the offline engine's: a long prompt stalls the "
                   "streams for half as long)")
    p.add_argument("--scheduler-delay-factor", type=float, help="while requests decode, a new one waits up to this "
                   "many prefill steps' time so that arrivals close together share one prefill step (default: the "
                   "engine's, 0.5; 0: admit at once)")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="share the K/V of prompt pages earlier requests wrote (a common system prompt or the "
                   "conversation so far is computed once), on the CPU too; usage reports them as "
                   "prompt_tokens_details.cached_tokens (default: on)")
    p.add_argument("--max-queue", type=_positive_int, default=DEFAULT_MAX_QUEUE,
                   help="requests in flight before 429")
    p.add_argument("--shutdown-timeout", type=_seconds, default=5.0, help="on SIGINT/SIGTERM the server answers new "
                   "requests 503 and gives those in flight this many seconds to finish, then aborts them (a stream "
                   "ends with an error event, code 'aborted', and [DONE]) and exits 0 (default %(default)s)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--quantization", choices=["fp8"], help="quantize a 16-bit target's linear layers to FP8 at load "
                   "(per channel, dynamic per-token activations; the lm_head stays); an FP8 checkpoint loads as FP8 "
                   "without it")
    p.add_argument("--draft-quantization", choices=["fp8"], help="the draft network's own linear layers in FP8 too "
                   "(an EAGLE-3 head, MTP modules or a draft LM; needs a draft)")
    p.add_argument("--kv-cache-dtype", choices=["auto", "fp8"], help="'fp8': the KV pool in E4M3 with the "
                   "checkpoint's k_scale/v_scale (else 1.0): twice the tokens in the same memory (default: auto, "
                   "the target's dtype)")
    p.add_argument("--device", default="auto", help="'cpu', 'cuda', 'cuda:1' or 'auto'")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.set_defaults(run=serve)


def spec_config_of(args: argparse.Namespace) -> SpecConfig | None:
    """The draft the flags ask for: on the demo target its EAGLE-3 head unless --mtp, --draft-model, --sa or
    --no-spec; on another target none unless one of --draft, --mtp, --draft-model or --sa."""
    demo = args.target in (None, DEMO_TARGET)
    k = {} if args.max_draft_len is None else {"max_draft_len": args.max_draft_len}
    fields = {"max_draft_len": 3, **k, **args.spec_config}  # --spec-config's fields win over -k's
    if args.no_spec or not (args.mtp or args.draft or args.draft_model or args.sa or demo):
        for flag, given in (("--spec-config", args.spec_config), ("-k/--max-draft-len", args.max_draft_len),
                            ("--sa-spec", args.sa_spec or None), ("--draft-quantization", args.draft_quantization)):
            if given not in (None, {}):
                raise ValueError(f"{flag}: it configures a draft, and this run has none (give --draft or --mtp)")
        return None
    if args.sa_spec and (args.draft_model or args.sa):
        raise ValueError("--sa-spec: it enhances an EAGLE-3 head or MTP modules; --sa alone drafts from the "
                         "automaton, a draft LM takes no enhancer")
    if args.sa and args.draft_quantization:
        raise ValueError("--draft-quantization: suffix drafting (--sa) has no draft network to quantize")
    if args.draft_model:
        return DraftTargetConfig(**{"speculative_model": args.draft_model, **fields})
    if args.sa:
        return SAConfig(**{**k, **args.spec_config})
    fields = {**fields, "use_sa_spec": True} if args.sa_spec else fields
    if args.mtp:
        return MTPConfig(**{"mtp_checkpoint": DEMO_MTP if demo else None, **fields})
    return Eagle3Config(**{"speculative_model": args.draft or DEMO_EAGLE3, **fields})


def engine_config_of(args: argparse.Namespace) -> EngineConfig:
    """The engine's capacity: the flags given, the engine's defaults for the rest."""
    flags = {name: getattr(args, name) for name in ENGINE_FLAGS}
    return EngineConfig(**{name: value for name, value in flags.items() if value is not None})


def _port(text: str) -> int:
    port = int(text) if text.isdigit() else -1
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"a TCP port lies in 0..65535 (0: any free one), got {text!r}")
    return port


def _number(kind: type, low: float, what: str):
    """An argparse type: a ``kind`` number in [low, inf), else one line saying ``what`` was expected."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            value = math.nan
        if not low <= value < math.inf:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
        return value
    return parse


_positive_int = _number(int, 1, "a whole number of at least 1")
_seconds = _number(float, 0, "seconds, a number of at least 0")


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise argparse.ArgumentTypeError(f"not JSON ({err})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"a JSON object of config fields is needed, got {text!r}")
    return value


def load_model(args: argparse.Namespace, spec_config: SpecConfig | None,
               engine_config: EngineConfig) -> SpecModel:
    """The model the flags ask for (their configs from :func:`checked_configs`); a checkpoint that does not load is
    one line blaming --draft, --mtp or --target."""
    from ..spec_model import SpecModel

    try:
        return SpecModel.from_pretrained(args.target or DEMO_TARGET, spec_config, dtype=args.dtype,
                                         device=args.device, engine_config=engine_config,
                                         quantization=args.quantization, draft_quantization=args.draft_quantization)
    except USER_ERRORS as err:
        fail(load_error(err, args))


def checked_configs(args: argparse.Namespace) -> tuple[SpecConfig | None, EngineConfig]:
    """The draft's and the engine's configs, the device and --max-seq-len against the target's positions, checked
    before anything loads: a mistake is one line naming its flag."""
    check_device(args.device)
    try:
        spec_config = spec_config_of(args)
    except ValidationError as err:
        fail("; ".join(_spec_problem(error, args) for error in err.errors()))
    except ValueError as err:  # the flags' own rules, their flags named
        fail(str(err))
    try:
        engine_config = engine_config_of(args)
    except ValidationError as err:
        fail("; ".join(f"{ENGINE_FLAGS[str(e['loc'][0])]}: {e['msg']} (got {e['input']!r})" for e in err.errors()))
    check_max_seq_len_flag(args.target or DEMO_TARGET, engine_config.max_seq_len)
    return spec_config, engine_config


def _spec_problem(error: dict, args: argparse.Namespace) -> str:
    """``-k/--max-draft-len: message (got value)``, or ``--spec-config: field: message (got value)`` for the fields
    --spec-config gave or no other flag sets."""
    field = ".".join(str(part) for part in error["loc"])
    message = error["msg"].removeprefix("Value error, ")
    if not field:  # a rule across fields: --spec-config's, or -k's alone
        return f"{'--spec-config' if args.spec_config else '-k/--max-draft-len'}: {message}"
    if field in SPEC_FLAGS and field not in args.spec_config:
        return f"{SPEC_FLAGS[field]}: {message} (got {error['input']!r})"
    return f"--spec-config: {field}: {message} (got {error['input']!r})"


def check_device(device: str) -> None:
    """'auto', 'cpu', or a CUDA device this torch can reach."""
    import torch

    from ..engine.loader import resolve_device

    try:
        resolved = resolve_device(device)
    except RuntimeError:
        fail(f"--device: {device!r} is not a device: expected 'cpu', 'cuda', 'cuda:N' or 'auto'")
    if resolved.type not in ("cpu", "cuda"):
        fail(f"--device: {device!r}: tllm-spec runs on 'cpu' or 'cuda'")
    if resolved.type == "cuda" and not torch.cuda.is_available():
        built = torch.version.cuda or torch.version.hip
        fail(f"--device: {device!r}, but " + ("no CUDA device is visible" if built else
                                              f"this torch ({torch.__version__}) is built without CUDA"))
    if resolved.type == "cuda" and (resolved.index or 0) >= torch.cuda.device_count():
        fail(f"--device: {device!r}, but {torch.cuda.device_count()} CUDA devices are visible")


def check_max_seq_len_flag(target: str, max_seq_len: int | None) -> None:
    """--max-seq-len against the target's positions, from its config.json alone."""
    from .. import demo
    from ..engine.loader import check_positions

    try:
        path = demo.resolve(target)
    except USER_ERRORS:
        return  # the loader says what is wrong with the address
    try:
        check_positions(path, max_seq_len)
    except ValueError as err:
        fail(f"--max-seq-len: {err}")


def check_address(host: str, port: int) -> None:
    """Bind where uvicorn will listen (as asyncio does: every address of ``host``, SO_REUSEADDR), before the model
    loads: uvicorn binds only once it starts."""
    try:
        for family, kind, proto, _, address in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                                  flags=socket.AI_PASSIVE):
            with socket.socket(family, kind, proto) as sock:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                sock.bind(address)
    except OSError as err:
        flag = "--port" if err.errno in (errno.EADDRINUSE, errno.EACCES) else "--host"
        fail(f"{flag}: cannot listen on {host}:{port}: {err.strerror or err}")


def load_error(err: BaseException, args: argparse.Namespace) -> str:
    """``--flag: message`` for an error raised while loading: the draft's loaders' (tllm_spec.drafts) are the
    draft's, an EAGLE-3 checkpoint's reader says it is not a head for this target; the rest are the target's."""
    modules = {frame.f_globals.get("__name__", "") for frame, _ in traceback.walk_tb(err.__traceback__)}
    if "tllm_spec.drafts.eagle3.checkpoint" in modules and isinstance(err, ValueError):
        return f"--draft: {args.draft or DEMO_EAGLE3} is not an EAGLE-3 head this target can use: {err}"
    if any(name.startswith("tllm_spec.drafts.") for name in modules):
        flag = next(f for f, given in (("--mtp", args.mtp), ("--draft-model", args.draft_model), ("--sa", args.sa),
                                       ("--draft", True)) if given)
        return f"{flag}: {err}"
    return f"--target: {err}"


def serve(args: argparse.Namespace) -> int:
    from .app import build_app
    from .shutdown import DrainingServer

    spec_config, engine_config = checked_configs(args)  # the flags, then the address, then the model
    check_address(args.host, args.port)
    model = load_model(args, spec_config, engine_config)
    try:
        model.warmup()  # compiles and captures before the first request, not during it
        name = args.served_model_name or (DEMO_MODEL_NAME if args.target in (None, DEMO_TARGET) else args.target)
        app = build_app(model, name, args.api_key, args.max_queue)
    except USER_ERRORS as err:  # pydantic's ValidationError is a ValueError
        fail(f"--target: {err}")
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level)
    try:
        DrainingServer(config, app.state.server, args.shutdown_timeout, f"{PROG}: serving {name}").run()
    finally:
        model.close()  # the engine's thread ends between steps, before the interpreter finalises
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
