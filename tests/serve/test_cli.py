"""``tllm-spec serve`` flags -> the draft it loads; conflicting flags are one line and exit status 2."""
from __future__ import annotations

import pytest

from tllm_spec import Eagle3Config, MTPConfig
from tllm_spec.serve.cli import build_parser, main, spec_config_of


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
                                  ["serve", "--port", "http"], ["serve", "--spec-config", "[1]"],
                                  ["serve", "--spec-config", "{use_dynamic_tree: 1}"],
                                  ["serve", "--spec-config", '{"max_draft_len": 0}', "--device", "cpu"],
                                  ["serve", "--spec-config", '{"no_such_field": 1}', "--device", "cpu"],
                                  ["serve", "--no-spec", "--spec-config", '{"max_draft_len": 2}', "--device", "cpu"]])
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
