"""``tllm-spec serve`` flags -> the draft it loads; every mistake is one line naming its flag, exit status 2;
``tllm-spec bench-serve`` against the demo server."""
from __future__ import annotations

import json
import socket

import httpx
import pytest
import torch

from tllm_spec import DraftTargetConfig, Eagle3Config, MTPConfig, SAConfig
from tllm_spec.demo import ASSETS as DEMO_DIR
from tllm_spec.model.quant.linear import Fp8Linear
from tllm_spec.serve.cli import build_parser, checked_configs, engine_config_of, load_model, main, spec_config_of


def _spec(*argv: str) -> Eagle3Config | MTPConfig | None:
    return spec_config_of(build_parser().parse_args(["serve", *argv]))


def test_the_demo_target_gets_its_eagle3_head_or_its_mtp_module():
    assert _spec() == Eagle3Config(speculative_model="demo://eagle3", max_draft_len=3)
    assert _spec("-k", "2") == Eagle3Config(speculative_model="demo://eagle3", max_draft_len=2)
    assert _spec("--mtp") == MTPConfig(max_draft_len=3, mtp_checkpoint="demo://mtp")
    assert _spec("--no-spec") is None


def test_another_target_decodes_plainly_unless_given_a_draft():
    assert _spec("/models/llama") is None
    assert _spec("/models/llama", "--draft", "/models/head") == Eagle3Config(speculative_model="/models/head")
    assert _spec("/models/llama", "--mtp") == MTPConfig(max_draft_len=3)


def test_a_draft_lm_suffix_drafting_and_sa_on_a_head():
    assert _spec("--draft-model", "demo://draft") == DraftTargetConfig(speculative_model="demo://draft")
    assert _spec("/models/llama", "--sa") == SAConfig()
    assert _spec("/models/llama", "--sa", "-k", "4") == SAConfig(max_draft_len=4)
    assert _spec("--sa-spec") == Eagle3Config(speculative_model="demo://eagle3", use_sa_spec=True)
    assert _spec("--mtp", "--sa-spec", "--spec-config", '{"sa_spec_threshold": 2}') == MTPConfig(
        max_draft_len=3, mtp_checkpoint="demo://mtp", use_sa_spec=True, sa_spec_threshold=2)
    with pytest.raises(ValueError, match="--sa-spec: it enhances an EAGLE-3 head or MTP"):
        _spec("--sa", "--sa-spec")


def test_spec_config_adds_draft_fields_such_as_a_tree():
    tree = '{"use_dynamic_tree": true, "dynamic_tree_max_topK": 3, "max_total_draft_tokens": 25, "max_draft_len": 8}'
    assert _spec("--spec-config", tree) == Eagle3Config(
        speculative_model="demo://eagle3", max_draft_len=8, use_dynamic_tree=True, dynamic_tree_max_topK=3,
        max_total_draft_tokens=25)
    assert _spec("-k", "2", "--spec-config", '{"use_rejection_sampling": true}') == Eagle3Config(
        speculative_model="demo://eagle3", max_draft_len=2, use_rejection_sampling=True)
    assert _spec("--mtp", "--spec-config", '{"num_nextn_predict_layers": 1}') == MTPConfig(
        max_draft_len=3, mtp_checkpoint="demo://mtp")


@pytest.mark.parametrize("argv", [["serve", "--mtp", "--draft", "x"], ["serve", "--no-spec", "--mtp"], [],
                                  ["serve", "--sa", "--draft-model", "x"], ["serve", "--sa", "--sa-spec"],
                                  ["serve", "--port", "http"], ["serve", "--spec-config", "[1]"],
                                  ["serve", "--spec-config", "{use_dynamic_tree: 1}"],
                                  ["serve", "--spec-config", '{"max_draft_len": 0}', "--device", "cpu"],
                                  ["serve", "--spec-config", '{"no_such_field": 1}', "--device", "cpu"],
                                  ["serve", "--no-spec", "--spec-config", '{"max_draft_len": 2}', "--device", "cpu"],
                                  ["serve", "--no-spec", "-k", "2", "--device", "cpu"]])
def test_usage_errors_are_one_line_and_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("tllm-spec: error: ") and err.count("\n") == 1


def test_a_target_that_does_not_exist_is_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", str(tmp_path / "missing"), "--device", "cpu"])
    assert exit_info.value.code == 2 and capsys.readouterr().err.count("\n") == 1


def test_bench_serve_is_a_subcommand(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["bench-serve", "--help"])
    assert exit_.value.code == 0 and "tllm-spec bench-serve" in capsys.readouterr().out


# ---- each mistake is one line naming its flag, found before the model loads where it can be ---------------------

def _stderr_of_refused(capsys, argv: list[str] | None = None, load: list[str] | None = None) -> list[str]:
    """The stderr lines of ``main(argv)``, or of loading the model of the serve flags ``load`` the way serve does
    (no server starts, even if the check regresses), which must exit with status 2; above the last, the error, there
    may only be the progress bars of weights that loaded."""
    with pytest.raises(SystemExit) as exit_info:
        if load is None:
            main(argv)
        else:
            args = build_parser().parse_args(["serve", *load])
            load_model(args, *checked_configs(args))
    assert exit_info.value.code == 2
    lines = capsys.readouterr().err.splitlines()
    assert lines and all(not line or line.startswith("Loading weights") for line in lines[:-1]), lines
    return lines


@pytest.fixture
def busy_port():
    """A port something listens on: a serve run that got past its flag checks stops at the address check (or at
    uvicorn's bind) instead of serving."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        yield str(busy.getsockname()[1])


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a torch that cannot reach CUDA")
@pytest.mark.parametrize("device", ["cuda", "cuda:1"], ids=["default-gpu", "gpu-1"])  # an id "cuda" is a marker
def test_a_cuda_device_on_a_cpu_only_torch(device, busy_port, capsys):
    lines = _stderr_of_refused(capsys, ["serve", "--device", device, "--port", busy_port])
    assert len(lines) == 1 and lines[0].startswith("tllm-spec: error: --device: ") and "CUDA" in lines[0]


@pytest.mark.parametrize("argv, flag", [
    (["--port", "99999"], "--port"), (["--port", "-1"], "--port"), (["--device", "gpu"], "--device"),
    (["-k", "0"], "-k/--max-draft-len"), (["--mtp", "--max-draft-len", "17"], "-k/--max-draft-len"),
    (["--spec-config", '{"max_draft_len": 0}'], "--spec-config"), (["--max-batch-size", "0"], "--max-batch-size"),
    (["--max-queue", "0"], "--max-queue"), (["--shutdown-timeout", "-1"], "--shutdown-timeout"),
    (["--max-seq-len", "100000"], "--max-seq-len"), (["--max-seq-len", "2049"], "--max-seq-len"),
    (["--quantization", "int4"], "--quantization"), (["--sa", "--draft-quantization", "fp8"], "--draft-quantization"),
    (["--no-spec", "--draft-quantization", "fp8"], "--draft-quantization")])
def test_a_bad_flag_is_named_before_the_model_loads(argv, flag, busy_port, capsys):
    lines = _stderr_of_refused(capsys, ["serve", "--device", "cpu", "--port", busy_port, *argv])
    assert len(lines) == 1, lines  # nothing loaded: no progress bar above the error
    assert lines[0].startswith(f"tllm-spec: error: {flag}: "), lines[0]  # checked before the (busy) address
    assert "pydantic" not in lines[0] and "http" not in lines[0]


def test_max_seq_len_up_to_the_targets_positions_is_accepted():
    args = build_parser().parse_args(["serve", "--max-seq-len", "2048", "--device", "cpu"])
    assert checked_configs(args)[1].max_seq_len == 2048  # the demo target's max_position_embeddings


def test_a_port_in_use_is_refused_before_the_model_loads(busy_port, capsys):
    lines = _stderr_of_refused(capsys, ["serve", "--port", busy_port, "--device", "cpu"])
    assert len(lines) == 1 and lines[0].startswith(f"tllm-spec: error: --port: cannot listen on 127.0.0.1:{busy_port}")
    assert "in use" in lines[0]


def test_a_full_model_given_as_the_draft_is_not_an_eagle3_head(capsys):
    line = _stderr_of_refused(capsys, load=["--draft", str(DEMO_DIR / "target"), "--device", "cpu"])[-1]
    assert line.startswith("tllm-spec: error: --draft: ") and "is not an EAGLE-3 head" in line


def test_an_eagle3_head_given_as_the_target_is_refused(capsys):
    line = _stderr_of_refused(capsys, load=[str(DEMO_DIR / "eagle3"), "--device", "cpu"])[-1]
    assert line.startswith("tllm-spec: error: --target: ") and "lacks 10 of" in line and "randomly initialised" in line
    assert "EAGLE-3 head" in line


def test_quantization_flags_load_the_target_and_the_draft_in_fp8():
    args = build_parser().parse_args(["serve", "--quantization", "fp8", "--draft-quantization", "fp8", "--device",
                                      "cpu", "--max-batch-size", "1"])
    with load_model(args, *checked_configs(args)) as model:
        assert isinstance(model.target.hf.model.layers[0].self_attn.o_proj, Fp8Linear)
        assert isinstance(model.worker.draft_model.fc, Fp8Linear)
        assert type(model.target.lm_head) is type(model.worker.draft_model.lm_head) is torch.nn.Linear
    args = build_parser().parse_args(["serve", "--device", "cpu"])
    assert (args.quantization, args.draft_quantization) == (None, None)


def test_prefix_caching_is_on_whatever_the_device_unless_turned_off():
    def enabled(*argv: str) -> bool | None:
        return engine_config_of(build_parser().parse_args(["serve", *argv])).enable_prefix_caching
    assert enabled() is enabled("--device", "cpu") is enabled("--enable-prefix-caching") is True
    assert enabled("--no-enable-prefix-caching") is False


def test_shutdown_timeout_is_a_number_of_seconds():
    assert build_parser().parse_args(["serve"]).shutdown_timeout == 5.0
    assert build_parser().parse_args(["serve", "--shutdown-timeout", "0.5"]).shutdown_timeout == 0.5


@pytest.mark.slow  # starts the demo server: eleven seconds on the 2-core machine
def test_bench_serve_defaults_complete_against_the_demo_server(server_url, tmp_path):
    card = httpx.get(f"{server_url}/v1/models").json()["data"][0]
    assert (card["vocab_size"], card["max_model_len"]) == (4096, 2048)  # the demo target's
    main(["bench-serve", "--base-url", server_url, "--num-prompts", "2", "--output-len", "4", "--out", str(tmp_path)])
    summary = json.loads((tmp_path / "bench_serving.json").read_text())["summary"]
    assert (summary["num_completed"], summary["num_failed"]) == (2, 0), summary["errors"]
