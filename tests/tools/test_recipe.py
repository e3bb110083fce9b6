"""The demo recipe end to end at tiny shapes: held-out list, sizes, packed parts that unpack into a loadable pair."""
import io
import json
import tarfile

import pytest
import torch

from tllm_spec.tools.demo_assets import MAX_FILE_BYTES, PACK_NAME, check_sizes
from tllm_spec.tools.demo_recipe import TINY_SHAPE, build_demo_models

from ..training.helpers import corpus


pytestmark = pytest.mark.slow  # builds the demo models twice over: fifteen seconds on the 2-core machine


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    out, work = tmp_path_factory.mktemp("out"), tmp_path_factory.mktemp("work")
    files = sorted(corpus(30).glob("*.py"))
    report = build_demo_models(out, work, torch.device("cpu"), minutes=0.05, shape=TINY_SHAPE, files=files,
                               progress=False)
    return out, work / "demo", report


def test_heldout_list_is_every_tenth_file(built):
    _, demo, report = built
    heldout = json.loads((demo / "heldout.json").read_text())
    assert heldout["files"] == ["mod_09.py", "mod_19.py", "mod_29.py"]
    assert heldout["prompts"][0]["text"].startswith("def ")
    assert (report["train_files"], report["validation_files"], report["heldout_files"]) == (24, 3, 3)


def test_phases_are_timed_and_both_heads_checked(built):
    out, _, report = built
    assert set(report["phases_s"]) == {"corpus+tokenizer", "target", "rollouts", "eagle3", "mtp", "draft_lm",
                                       "cpu check", "pack"}
    assert json.loads((out / "build_report.json").read_text())["phases_s"] == report["phases_s"]
    for head in ("eagle3", "mtp", "eagle3_T1", "mtp_T1"):
        assert report["cpu_check"][head]["steps"] > 0
    assert report["cpu_check"]["num_prompts"] == TINY_SHAPE.check_prompts


def test_drafts_train_on_text_and_rollouts(built):
    _, _, report = built
    assert report["rollout_tokens"] == TINY_SHAPE.rollout_sequences * TINY_SHAPE.seq_len
    for head in ("eagle3", "mtp"):
        assert set(report[head]["heldout_rollouts"]) >= {"loss", "acc0", "acc1", "acc2"}


def test_a_reused_target_skips_its_phase(built, tmp_path):
    _, demo, report = built
    files = sorted(corpus(30).glob("*.py"))
    again = build_demo_models(tmp_path / "out", tmp_path / "work", torch.device("cpu"), minutes=0.02, shape=TINY_SHAPE,
                              files=files, progress=False, target_from=demo / "target")
    assert again["target"]["reused"] == str(demo / "target") and again["train_tokens"] == report["train_tokens"]
    assert (tmp_path / "work" / "demo" / "target" / "model.safetensors").read_bytes() == \
        (demo / "target" / "model.safetensors").read_bytes()


def test_parts_unpack_into_the_asset_layout(built):
    out, demo, report = built
    parts = sorted(out.glob(PACK_NAME + ".*"))
    assert [p.name for p in parts] == [f"{PACK_NAME}.000"] and all(p.stat().st_size <= MAX_FILE_BYTES for p in parts)
    with tarfile.open(fileobj=io.BytesIO(b"".join(p.read_bytes() for p in parts)), mode="r:gz") as tar:
        names = set(tar.getnames())
    expected = {"demo/target/config.json", "demo/target/tokenizer.json", "demo/target/model.safetensors",
                "demo/eagle3/config.json", "demo/eagle3/model.safetensors", "demo/mtp/model.safetensors.index.json",
                "demo/mtp/model-mtp.safetensors", "demo/draft/config.json", "demo/draft/model.safetensors",
                "demo/draft/tokenizer.json", "demo/heldout.json", "demo/recipe.json"}
    assert expected <= names
    assert not any(n.endswith("trainer_state.pt") for n in names)
    assert report["sizes"]["total"] == sum(v for k, v in report["sizes"].items() if k != "total")


def test_size_limits_are_enforced(tmp_path):
    (tmp_path / "big.safetensors").open("wb").truncate(MAX_FILE_BYTES + 1)  # sparse: no real bytes written
    with pytest.raises(ValueError, match="too large"):
        check_sizes(tmp_path)
