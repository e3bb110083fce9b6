"""scripts/generate.py runs every configs/mtp_*.yaml (target overridden by a tiny one) and the --mtp flag."""
import importlib.util
import json
import sys
from pathlib import Path

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from tllm_spec import load_run_config
from tllm_spec.drafts.mtp import save_random_mtp_weights
from tllm_spec.random_models import save_random_target, target_config

from .models import hf_greedy

ROOT = Path(__file__).parent.parent
MTP_CONFIGS = sorted((ROOT / "configs").glob("mtp_*.yaml"))


@pytest.fixture(scope="module")
def generate_script():
    spec = importlib.util.spec_from_file_location("generate_script", ROOT / "scripts" / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def mtp_target_with_tokenizer(tmp_path_factory):
    """Tiny Llama target with 3 DeepSeek-layout MTP modules and a 97-word tokenizer (word wN is token N)."""
    root = tmp_path_factory.mktemp("mtp_cli") / "target"
    save_random_target(root, target_config("llama"))
    save_random_mtp_weights(root, 3, "deepseek", seed=1)
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(97)}, unk_token="w1"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="w0").save_pretrained(root)
    return root


def run_cli(script, monkeypatch, tmp_path, *args) -> dict:
    out = tmp_path / "out.json"
    monkeypatch.setattr(sys, "argv", ["generate.py", *args, "--device", "cpu", "--dtype", "float32",
                                      "--prompt", "w5 w17 w3", "--max-new-tokens", "5", "--json", str(out)])
    script.main()
    return json.loads(out.read_text())


def test_mtp_configs_exist_for_each_mode():
    modes = {load_run_config(p).spec_config.spec_dec_mode.name for p in MTP_CONFIGS}
    assert modes == {"MTP", "MTP_EAGLE_ONE_MODEL"} and len(MTP_CONFIGS) >= 3


@pytest.mark.parametrize("config", MTP_CONFIGS, ids=lambda p: p.name)
def test_generate_script_runs_mtp_config(config, generate_script, mtp_target_with_tokenizer, monkeypatch, tmp_path):
    data = run_cli(generate_script, monkeypatch, tmp_path, "--config", str(config),
                   "--target", str(mtp_target_with_tokenizer))
    assert data["config"]["spec_config"]["decoding_type"] == "mtp"
    tokens = data["outputs"][0]["token_ids"]
    assert len(tokens) == 5 or data["outputs"][0]["finish_reason"] == "stop"
    if load_run_config(config).sampling.temperature == 0:
        assert tokens == hf_greedy(mtp_target_with_tokenizer, [5, 17, 3], 5)[:len(tokens)]


def test_mtp_flag(generate_script, mtp_target_with_tokenizer, monkeypatch, tmp_path):
    data = run_cli(generate_script, monkeypatch, tmp_path, "--target", str(mtp_target_with_tokenizer), "--mtp",
                   "-k", "2")
    assert data["config"]["spec_config"]["max_draft_len"] == 2
    tokens = data["outputs"][0]["token_ids"]
    assert tokens == hf_greedy(mtp_target_with_tokenizer, [5, 17, 3], 5)[:len(tokens)]
