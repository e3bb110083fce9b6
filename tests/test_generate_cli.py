"""scripts/generate.py runs every configs/*.yaml (external targets swapped for a tiny random one, a few tokens),
prints the speculative-vs-plain comparison after a speculative run, and takes --mtp (on the demo target too).
Its front door: --target alone decodes plainly, --prompt-file is UTF-8, --prompt-ids needs no tokenizer, usage
and config errors are one line and status 2, and a run whose every request was rejected ends with status 1."""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from tllm_spec import demo, load_run_config
from tllm_spec.drafts.mtp.model import save_random_mtp_weights
from tllm_spec.tokenizer import load_tokenizer
from tllm_spec.tools.random_models import save_random_head, save_random_target, target_config

from .models import hf_greedy, tiny_pair

ROOT = Path(__file__).parent.parent
CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))
MTP_CONFIGS = [p for p in CONFIGS if p.name.startswith("mtp_")]


@pytest.fixture(scope="module")
def generate_script():
    spec = importlib.util.spec_from_file_location("generate_script", ROOT / "scripts" / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory):
    """Tiny Llama target with 3 DeepSeek-layout MTP modules, a 97-word tokenizer (word wN is token N) and a random
    EAGLE-3 head beside it (``head/``)."""
    root = tmp_path_factory.mktemp("generate_cli") / "target"
    config = target_config("llama", max_position_embeddings=4096)  # the 8B run files' max_seq_len fits
    save_random_target(root, config)
    save_random_mtp_weights(root, 3, "deepseek", seed=1)
    save_random_head(root.parent / "head", config)
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(97)}, unk_token="w1"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="w0").save_pretrained(root)
    return root


def run_cli(script, tmp_path, *args, prompt: str | None = "w5 w17 w3", status: int = 0) -> dict:
    """Run the script's main on CPU (a few tokens) and return its --json output; ``prompt=None``: no --prompt."""
    out = tmp_path / "out.json"
    prompt_args = [] if prompt is None else ["--prompt", prompt]
    assert script.main([*args, "--device", "cpu", "--dtype", "float32", *prompt_args, "--max-new-tokens", "5",
                        "--json", str(out)]) == status
    return json.loads(out.read_text())


def cli_error(script, capsys, *args) -> str:
    """The error line of a run that must stop with a usage or configuration error: status 2, no traceback, one
    line last on stderr (after any weight-loading progress)."""
    with pytest.raises(SystemExit) as exit_info:
        script.main([*args, "--device", "cpu", "--dtype", "float32", "--max-new-tokens", "2"])
    err = capsys.readouterr().err
    last = err.splitlines()[-1]
    assert exit_info.value.code == 2 and "Traceback" not in err and err.endswith(last + "\n"), err
    assert last.startswith("generate.py: error: ") and err.count("error: ") == 1, err
    return last


def config_args(config: Path, target: Path) -> tuple[list[str], str]:
    """CLI arguments and a prompt for ``config``: demo configs run as they are, others on the tiny target (in
    one process)."""
    cfg = load_run_config(config)
    if cfg.target_model is None or cfg.target_model.startswith("demo://"):
        return ["--config", str(config)], "def main():"
    args = ["--config", str(config), "--target", str(target)]
    if cfg.spec_config is not None and cfg.spec_config.decoding_type == "eagle3":
        args += ["--draft", str(target.parent / "head")]
    if cfg.spec_config is not None and cfg.spec_config.decoding_type == "draft_target":
        args += ["--draft-model", str(target)]  # the tiny target drafting for itself
    if cfg.engine.tensor_parallel_size > 1:  # one process here; TP runs are tests/test_tensor_parallel.py's
        args += ["--tensor-parallel-size", "1"]
    return args, "w5 w17 w3"


def test_mtp_configs_exist_for_each_mode():
    modes = {load_run_config(p).spec_config.spec_dec_mode.name for p in MTP_CONFIGS}
    assert modes == {"MTP", "MTP_EAGLE_ONE_MODEL"} and len(MTP_CONFIGS) >= 3


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.name)
def test_generate_script_runs_config(config, generate_script, tiny_target, tmp_path, capsys):
    args, prompt = config_args(config, tiny_target)
    data = run_cli(generate_script, tmp_path, *args, prompt=prompt)
    cfg = load_run_config(config)
    out = data["outputs"][0]
    assert len(out["token_ids"]) == 5 or out["finish_reason"] == "stop"
    if cfg.spec_config is None:
        assert data["baseline_stats"] is None and data["config"]["spec_config"] is None
        return
    assert data["config"]["spec_config"]["decoding_type"] == cfg.spec_config.decoding_type
    assert data["baseline_stats"]["num_tokens"] > 0 and "speedup" in capsys.readouterr().out
    if cfg.sampling.temperature == 0:
        assert data["identical_to_baseline"]
        if prompt.startswith("w"):
            assert out["token_ids"] == hf_greedy(tiny_target, [5, 17, 3], 5)[:len(out["token_ids"])]


def test_mtp_flag(generate_script, tiny_target, tmp_path):
    data = run_cli(generate_script, tmp_path, "--target", str(tiny_target), "--mtp", "-k", "2",
                   "--no-baseline")
    assert data["config"]["spec_config"]["max_draft_len"] == 2 and data["baseline_stats"] is None
    tokens = data["outputs"][0]["token_ids"]
    assert tokens == hf_greedy(tiny_target, [5, 17, 3], 5)[:len(tokens)]


def test_mtp_flag_on_the_demo_target_reads_the_demo_module(generate_script, tmp_path, capsys):
    data = run_cli(generate_script, tmp_path, "--mtp", prompt="import os\n")
    assert data["config"]["spec_config"]["mtp_checkpoint"] == "demo://mtp"
    assert data["identical_to_baseline"] and "MTP-Eagle, K=3" in capsys.readouterr().out


def test_target_alone_decodes_that_target_plainly(generate_script, tiny_target, tmp_path):
    data = run_cli(generate_script, tmp_path, "--target", str(tiny_target))  # the demo head would not fit it
    assert data["config"]["spec_config"] is None and data["baseline_stats"] is None
    tokens = data["outputs"][0]["token_ids"]
    assert len(tokens) > 0 and tokens == hf_greedy(tiny_target, [5, 17, 3], 5)[:len(tokens)]


def test_prompt_file_is_utf8_with_backslash_n_as_the_only_escape(generate_script, tmp_path):
    lines = ["é — 日本", "", "x = 1\\ny = '\\t'"]  # a blank line (skipped); \\n is a newline, \\t stays as it is
    (tmp_path / "prompts.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    data = run_cli(generate_script, tmp_path, "--no-spec", "--prompt-file", str(tmp_path / "prompts.txt"),
                   prompt=None)
    expected = ["é — 日本", "x = 1\ny = '\\t'"]
    tokenizer = load_tokenizer(demo.resolve("demo://target"))
    assert [o["prompt"] for o in data["outputs"]] == expected
    assert [o["prompt_token_ids"] for o in data["outputs"]] == [tokenizer.encode(text) for text in expected]


def test_prompt_ids_decode_on_a_target_without_tokenizer(generate_script, tmp_path, capsys):
    target = tiny_pair("llama")[0]
    assert load_tokenizer(target) is None
    data = run_cli(generate_script, tmp_path, "--target", str(target), "--prompt-ids", "5,17,3",
                   "--prompt-ids", "4, 4, 9, 1", prompt=None)
    for out, prompt in zip(data["outputs"], [[5, 17, 3], [4, 4, 9, 1]], strict=True):
        assert out["prompt_token_ids"] == prompt and out["text"] is None
        assert len(out["token_ids"]) > 0 and out["token_ids"] == hf_greedy(target, prompt, 5)[:len(out["token_ids"])]
    assert "[5, 17, 3] " in capsys.readouterr().out
    run_cli(generate_script, tmp_path, "--target", str(target), prompt="text", status=1)  # text needs a tokenizer
    assert "request 0 rejected: " in capsys.readouterr().err


def test_every_request_rejected_exits_1_with_each_reason_on_stderr(generate_script, tiny_target, tmp_path, capsys):
    data = run_cli(generate_script, tmp_path, "--target", str(tiny_target), "--prompt-ids", "500",
                   "--prompt-ids", "3,97", prompt=None, status=1)
    assert [o["finish_reason"] for o in data["outputs"]] == ["rejected", "rejected"]
    err = capsys.readouterr().err
    assert "request 0 rejected: token ids must lie in [0, 97)" in err and "request 1 rejected: " in err
    data = run_cli(generate_script, tmp_path, "--target", str(tiny_target), "--prompt-ids", "500", status=0)
    assert data["outputs"][0]["finish_reason"] == "rejected" != data["outputs"][1]["finish_reason"]  # --prompt


@pytest.mark.slow  # three runs of the script: five to seven seconds on the 2-core machine
def test_sa_and_a_draft_lm_are_lossless(generate_script, tiny_target, tmp_path):
    for flags in (["--sa"], ["--draft-model", str(tiny_target)], ["--mtp", "--sa-spec", "--sa-spec-threshold", "2"]):
        data = run_cli(generate_script, tmp_path, "--target", str(tiny_target), *flags, "-k", "2")
        assert data["identical_to_baseline"], flags
        assert data["config"]["spec_config"]["max_draft_len"] == 2
        assert data["config"]["spec_config"].get("use_sa_spec", "--sa-spec" in flags) == ("--sa-spec" in flags)


def test_quantization_flags_load_fp8_and_the_baseline_runs_the_fp8_target(generate_script, tiny_target, tmp_path):
    data = run_cli(generate_script, tmp_path, "--target", str(tiny_target), "--draft",
                   str(tiny_target.parent / "head"), "--quantization", "fp8", "--draft-quantization", "fp8")
    assert (data["config"]["quantization"], data["config"]["draft_quantization"]) == ("fp8", "fp8")
    assert data["baseline_stats"]["num_tokens"] > 0  # the plain FP8 target, without a draft to quantize


@pytest.mark.slow  # three to four seconds on the 2-core machine, out of the README command for its margin
def test_the_edit_workload_quotes_functions_for_sa(generate_script, tmp_path):
    data = run_cli(generate_script, tmp_path, "--sa", "--workload", "edit", "--num-prompts", "2", prompt=None)
    assert len(data["outputs"]) == 2 and all("def " in o["prompt"] for o in data["outputs"])
    assert data["config"]["spec_config"]["decoding_type"] == "sa" and data["identical_to_baseline"]


def test_mtp_with_draft_is_refused(generate_script, tiny_target, capsys):
    err = cli_error(generate_script, capsys, "--target", str(tiny_target), "--mtp", "--draft",
                    str(tiny_target.parent / "head"))
    assert "--mtp" in err and "--draft" in err


@pytest.mark.parametrize("args, where", [
    (["--temperature", "-1"], "--temperature: "),
    (["--temperature", "warm"], "--temperature: "),
    (["--top-p", "1.5"], "--top-p: "),
    (["-k", "0"], "-k/--max-draft-len: "),
    (["--batch-size", "0"], "--batch-size: "),
    (["--target", "{bare}", "-k", "2"], "-k/--max-draft-len: "),  # plain decoding has no drafts to count
    (["--prompt-ids", "1,two"], "--prompt-ids: "),
    (["--target", "{tmp}/missing"], "--target: "),
    (["--draft", "{tmp}/missing"], "--draft: "),
    (["--target", "{bare}", "--mtp"], "--mtp: "),  # a target without MTP modules
    (["--tensor-parallel-size", "2"], "--tensor-parallel-size: "),  # not launched with torchrun
    (["--config", "{tmp}/missing.yaml"], "--config: "),
    (["--sa", "--draft-model", "x"], "--draft-model: "),
    (["--sa", "--sa-spec"], "--sa-spec: "),
    (["--draft-model", "{tmp}/missing"], "--draft-model: "),
    (["--config", "{tmp}/bad.yaml"], "--config: "),
    (["--prompt-file", "{tmp}/missing.txt"], "--prompt-file: "),
    (["--quantization", "int4"], "--quantization: "),
    (["--no-spec", "--draft-quantization", "fp8"], "--draft-quantization: "),
    (["--sa", "--draft-quantization", "fp8"], "--draft-quantization: "),
])
def test_usage_and_config_errors_are_one_line_and_status_2(generate_script, tmp_path, capsys, args, where):
    (tmp_path / "bad.yaml").write_text("sampling:\n  temperature: -1\n")
    err = cli_error(generate_script, capsys, *[a.format(tmp=tmp_path, bare=tiny_pair("llama")[0]) for a in args])
    assert err.startswith(f"generate.py: error: {where}")


@pytest.mark.slow  # ten seconds or more on the 2-core CI machine: the second CI command runs it
def test_a_config_error_prints_no_traceback():
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "generate.py"), "--top-p", "0"],
                         capture_output=True, text=True, timeout=300, check=False)
    assert run.returncode == 2 and run.stdout == ""
    assert run.stderr.splitlines() == ["generate.py: error: --top-p: Input should be greater than 0 (got 0.0)"]
