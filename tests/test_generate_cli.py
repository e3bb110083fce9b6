"""scripts/generate.py runs every configs/*.yaml (external targets swapped for a tiny random one, a few tokens),
prints the speculative-vs-plain comparison after a speculative run, and takes --mtp (on the demo target too)."""
import importlib.util
import json
import sys
from pathlib import Path

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from tllm_spec import load_run_config
from tllm_spec.drafts.mtp.model import save_random_mtp_weights
from tllm_spec.tools.random_models import save_random_head, save_random_target, target_config

from .models import hf_greedy

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
    config = target_config("llama")
    save_random_target(root, config)
    save_random_mtp_weights(root, 3, "deepseek", seed=1)
    save_random_head(root.parent / "head", config)
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(97)}, unk_token="w1"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="w0").save_pretrained(root)
    return root


def run_cli(script, monkeypatch, tmp_path, *args, prompt: str = "w5 w17 w3") -> dict:
    out = tmp_path / "out.json"
    monkeypatch.setattr(sys, "argv", ["generate.py", *args, "--device", "cpu", "--dtype", "float32",
                                      "--prompt", prompt, "--max-new-tokens", "5", "--json", str(out)])
    script.main()
    return json.loads(out.read_text())


def config_args(config: Path, target: Path) -> tuple[list[str], str]:
    """CLI arguments and a prompt for ``config``: demo configs run as they are, others on the tiny target (in
    one process)."""
    cfg = load_run_config(config)
    if cfg.target_model is None or cfg.target_model.startswith("demo://"):
        return ["--config", str(config)], "def main():"
    args = ["--config", str(config), "--target", str(target)]
    if cfg.spec_config is not None and cfg.spec_config.decoding_type == "eagle3":
        args += ["--draft", str(target.parent / "head")]
    if cfg.engine.tensor_parallel_size > 1:  # one process here; TP runs are tests/test_tensor_parallel.py's
        args += ["--tensor-parallel-size", "1"]
    return args, "w5 w17 w3"


def test_mtp_configs_exist_for_each_mode():
    modes = {load_run_config(p).spec_config.spec_dec_mode.name for p in MTP_CONFIGS}
    assert modes == {"MTP", "MTP_EAGLE_ONE_MODEL"} and len(MTP_CONFIGS) >= 3


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.name)
def test_generate_script_runs_config(config, generate_script, tiny_target, monkeypatch, tmp_path, capsys):
    args, prompt = config_args(config, tiny_target)
    data = run_cli(generate_script, monkeypatch, tmp_path, *args, prompt=prompt)
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


def test_mtp_flag(generate_script, tiny_target, monkeypatch, tmp_path):
    data = run_cli(generate_script, monkeypatch, tmp_path, "--target", str(tiny_target), "--mtp", "-k", "2",
                   "--no-baseline")
    assert data["config"]["spec_config"]["max_draft_len"] == 2 and data["baseline_stats"] is None
    tokens = data["outputs"][0]["token_ids"]
    assert tokens == hf_greedy(tiny_target, [5, 17, 3], 5)[:len(tokens)]


def test_mtp_flag_on_the_demo_target_reads_the_demo_module(generate_script, monkeypatch, tmp_path, capsys):
    data = run_cli(generate_script, monkeypatch, tmp_path, "--mtp", prompt="import os\n")
    assert data["config"]["spec_config"]["mtp_checkpoint"] == "demo://mtp"
    assert data["identical_to_baseline"] and "MTP-Eagle, K=3" in capsys.readouterr().out
