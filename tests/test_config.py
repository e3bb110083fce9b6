from pathlib import Path

import pytest
from pydantic import ValidationError

from tllm_spec import Eagle3Config, EngineConfig, MTPConfig, RunConfig, SamplingParams, load_run_config
from tllm_spec import SpeculativeDecodingMode as Mode

CONFIGS = sorted((Path(__file__).parent.parent / "configs").glob("*.yaml"))


def test_configs_directory_is_not_empty():
    assert len(CONFIGS) >= 4


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_config_file_loads(path):
    cfg = load_run_config(path)
    if cfg.spec_config is not None:
        assert cfg.spec_config.spec_dec_mode in Mode.supported()


@pytest.mark.parametrize("kwargs,field", [
    (dict(temperature=-0.1), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=-2), "top_k"),
    (dict(max_new_tokens=0), "max_new_tokens"),
    (dict(tempreature=0.5), "tempreature"),
])
def test_bad_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(ValidationError, match=field):
        SamplingParams(**kwargs)


def test_configs_are_frozen():
    params = SamplingParams()
    with pytest.raises(ValidationError):
        params.temperature = 1.0


def test_eagle3_config_rules():
    with pytest.raises(ValidationError, match="max_draft_len"):
        Eagle3Config(speculative_model="x", max_draft_len=0)
    with pytest.raises(ValidationError, match="eagle3_layers_to_capture"):
        Eagle3Config(speculative_model="x", eagle3_layers_to_capture=(1, 5))
    with pytest.raises(ValidationError, match="eagle3_layers_to_capture"):
        Eagle3Config(speculative_model="x", eagle3_layers_to_capture=(-1, 2, 5))
    assert Eagle3Config(speculative_model="x", eagle3_layers_to_capture=(1, 1, 5)).eagle3_layers_to_capture == (1, 1, 5)
    with pytest.raises(ValidationError, match="speculative_model"):
        Eagle3Config()
    with pytest.raises(NotImplementedError, match="EAGLE3 is not run"):
        Eagle3Config(speculative_model="x", eagle3_one_model=False).spec_dec_mode


def test_mtp_config_modes_and_rules():
    assert MTPConfig().spec_dec_mode is Mode.MTP_EAGLE_ONE_MODEL
    assert MTPConfig(num_nextn_predict_layers=3, use_mtp_vanilla=True).spec_dec_mode is Mode.MTP
    assert MTPConfig(num_nextn_predict_layers=1, max_draft_len=3).num_draft_tokens == 3
    with pytest.raises(NotImplementedError, match="MTP_EAGLE is not run"):
        MTPConfig(mtp_eagle_one_model=False).spec_dec_mode
    with pytest.raises(ValidationError, match="max_draft_len"):
        MTPConfig(num_nextn_predict_layers=2, max_draft_len=3, use_mtp_vanilla=True)
    with pytest.raises(ValidationError, match="begin_thinking_phase_token"):
        MTPConfig(use_relaxed_acceptance_for_thinking=True)


def test_yaml_errors_name_file_and_field(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("spec_config:\n  decoding_type: eagle3\n  speculative_model: h\n  max_draft_len: -1\n")
    with pytest.raises(ValueError, match=r"bad.yaml.*spec_config.eagle3.max_draft_len"):
        load_run_config(bad)
    typo = tmp_path / "typo.yaml"
    typo.write_text("engine:\n  max_batchsize: 4\n")
    with pytest.raises(ValueError, match=r"engine.max_batchsize"):
        load_run_config(typo)


def test_engine_config_defaults():
    assert EngineConfig().page_size == 16


def test_mtp_on_the_demo_target_reads_the_demo_module():
    for target in (None, "demo://target"):
        assert RunConfig(target_model=target, spec_config=MTPConfig()).spec_config.mtp_checkpoint == "demo://mtp"
        loaded = RunConfig.model_validate({"target_model": target, "spec_config": {"decoding_type": "mtp"}})
        assert loaded.spec_config.mtp_checkpoint == "demo://mtp"
    assert RunConfig(target_model="/models/x", spec_config=MTPConfig()).spec_config.mtp_checkpoint is None
    explicit = RunConfig(spec_config=MTPConfig(mtp_checkpoint="/heads/mtp")).spec_config.mtp_checkpoint
    assert explicit == "/heads/mtp"


TREE = [[0], [1], [0, 0], [0, 1], [1, 0]]


def test_eagle3_tree_fields_follow_tensorrt_llm():
    static = Eagle3Config(speculative_model="x", max_draft_len=2, eagle_choices=TREE)
    assert static.is_spec_dec_tree and static.total_draft_tokens == 5 and static.draft_tree.max_depth == 2
    assert Eagle3Config(speculative_model="x", max_draft_len=2, eagle_choices=TREE,
                        max_total_draft_tokens=5).total_draft_tokens == 5
    chain = Eagle3Config(speculative_model="x", max_draft_len=3, eagle_choices=[[0], [0, 0], [0, 0, 0]])
    assert not chain.is_spec_dec_tree and chain.total_draft_tokens == 3  # a chain is not a tree
    plain = Eagle3Config(speculative_model="x", max_draft_len=3)
    assert not plain.is_spec_dec_tree and plain.total_draft_tokens == 3 and plain.draft_tree is None
    dynamic = Eagle3Config(speculative_model="x", max_draft_len=4, use_dynamic_tree=True, dynamic_tree_max_topK=4,
                           max_total_draft_tokens=16)
    assert dynamic.is_spec_dec_tree and dynamic.total_draft_tokens == 16


@pytest.mark.parametrize("kwargs, message", [
    (dict(max_draft_len=3, eagle_choices=TREE), "2 deep"),
    (dict(max_draft_len=2, eagle_choices=TREE, max_total_draft_tokens=6), "5 nodes"),
    (dict(max_draft_len=2, eagle_choices=[[0], [1, 0]]), "prefix-closed"),
    (dict(max_draft_len=2, eagle_choices=TREE, use_dynamic_tree=True), "exclude each other"),
    (dict(max_draft_len=4, use_dynamic_tree=True, max_total_draft_tokens=16), "dynamic_tree_max_topK"),
    (dict(max_draft_len=4, use_dynamic_tree=True, dynamic_tree_max_topK=4, max_total_draft_tokens=3), "at least"),
    (dict(max_draft_len=6, use_dynamic_tree=True, dynamic_tree_max_topK=8, max_total_draft_tokens=32),
     "40 frontier tokens"),
    (dict(max_draft_len=2, use_dynamic_tree=True, dynamic_tree_max_topK=1, max_total_draft_tokens=5),
     "exceeds the 2 candidates"),
    (dict(max_draft_len=3, dynamic_tree_max_topK=4), "use_dynamic_tree=True only"),
    (dict(max_draft_len=3, max_total_draft_tokens=8), "a chain drafts"),
])
def test_bad_tree_configs_are_refused(kwargs, message):
    with pytest.raises(ValidationError, match=message):
        Eagle3Config(speculative_model="x", **kwargs)
