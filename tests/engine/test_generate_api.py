"""The public generate() API: string prompts through the target's tokenizer, outputs, stats, the CLI."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from tllm_spec import SamplingParams, SpecModel

from ..models import eagle3, hf_greedy, tiny_pair

ROOT = Path(__file__).parents[2]


@pytest.fixture(scope="module")
def target_with_tokenizer(tmp_path_factory):
    """The tiny llama target copied with a 97-word tokenizer: word wN is token N, w0 is EOS."""
    import shutil
    target, head = tiny_pair("llama")
    out = tmp_path_factory.mktemp("tok") / "target"
    shutil.copytree(target, out)
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(97)}, unk_token="w1"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="w0").save_pretrained(out)
    return out, head


def test_string_prompts_round_trip_text(target_with_tokenizer):
    target, head = target_with_tokenizer
    model = SpecModel.from_pretrained(target, eagle3(head, 3), max_batch_size=2)
    outs = model.generate(["w5 w17 w3", "w12 w8"], SamplingParams(max_new_tokens=6, ignore_eos=True))
    assert outs[0].prompt_token_ids == [5, 17, 3]
    assert outs[0].token_ids == hf_greedy(target, [5, 17, 3], 6)
    assert outs[0].text.split() == [f"w{t}" for t in outs[0].token_ids if t != 0]  # EOS skipped in text


def test_eos_from_tokenizer_stops(target_with_tokenizer):
    target, head = target_with_tokenizer
    model = SpecModel.from_pretrained(target, eagle3(head, 3), max_batch_size=2)
    assert 0 in model.runner.eos_token_ids
    ref = hf_greedy(target, [5, 17, 3], 60)
    out = model.generate([[5, 17, 3]], SamplingParams(max_new_tokens=60))[0]
    if 0 in ref:
        assert out.finish_reason == "stop" and out.token_ids == ref[:ref.index(0) + 1]
    else:
        assert out.finish_reason == "length" and out.token_ids == ref


def test_aggregate_and_per_request_stats():
    target, head = tiny_pair("llama")
    model = SpecModel.from_pretrained(target, eagle3(head, 2), max_batch_size=2)
    outs = model.generate([[1, 2, 3], [4, 5]], [SamplingParams(max_new_tokens=5), SamplingParams(max_new_tokens=9)])
    assert outs.stats["num_tokens"] == 14 and outs.stats["num_requests"] == 2
    assert outs.stats["steps"] == sum(o.stats.num_steps for o in outs)
    for out in outs:
        assert sum(out.stats.histogram) == out.stats.num_steps
        assert len(out.stats.acceptance_rate_per_position) == 2


@pytest.mark.slow  # real processes or compiles: ten seconds or more (the second CI command)
def test_cli_runs_with_target_and_draft(tmp_path):
    target, head = tiny_pair("llama")
    out_json = tmp_path / "out.json"
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "generate.py"), "--target", str(target),
                           "--draft", str(head), "-k", "2", "--max-new-tokens", "5", "--prompt", "x",
                           "--json", str(out_json), "--device", "cpu"],
                          capture_output=True, text=True, timeout=300)
    # the tiny target has no tokenizer: a string prompt is a clear error, not a crash deep inside
    assert proc.returncode != 0 and "tokenizer" in proc.stderr


@pytest.mark.slow  # real processes or compiles: ten seconds or more (the second CI command)
def test_cli_config_file_with_token_prompts(tmp_path, target_with_tokenizer):
    target, head = target_with_tokenizer
    cfg = tmp_path / "run.yaml"
    cfg.write_text(f"target_model: {target}\nspec_config:\n  decoding_type: eagle3\n  speculative_model: {head}\n"
                   f"  max_draft_len: 2\nsampling:\n  max_new_tokens: 4\n  ignore_eos: true\ndevice: cpu\n")
    out_json = tmp_path / "out.json"
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "generate.py"), "--config", str(cfg),
                           "--prompt", "w5 w17 w3", "--json", str(out_json)], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "mean accepted length" in proc.stdout
    data = json.loads(out_json.read_text())
    assert data["outputs"][0]["token_ids"] == hf_greedy(target, [5, 17, 3], 4)


def test_engines_sharing_a_target_each_attend_over_their_own_cache():
    """Two engines over one target object (as the benchmark builds its plain engine beside the speculative one),
    with KV caches of different sizes, used in turn: each gives its own greedy tokens, the target's greedy
    decode. (The fused layers attend over bound cache tensors: each engine binds its own before a step.)"""
    target_dir, head = tiny_pair("llama")
    prompts = [[5, 17, 3, 44, 9, 2, 71], [12, 8, 30, 30, 4]] * 2
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    spec = SpecModel.from_pretrained(target_dir, eagle3(head, 3), max_batch_size=4, max_seq_len=96)
    plain = SpecModel.from_target(spec.target, None, max_batch_size=1, max_seq_len=32)
    assert plain.runner.num_kv_pages < spec.runner.num_kv_pages
    expected = [hf_greedy(target_dir, p, 12) for p in prompts]
    for _ in range(2):
        assert [o.token_ids for o in spec.generate(prompts, params)] == expected
        assert [o.token_ids for o in plain.generate(prompts[:1], params)] == expected[:1]
