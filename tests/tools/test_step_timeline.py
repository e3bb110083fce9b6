"""Step timelines (tllm_spec/tools/step_timeline.py): StepLog files drawn one panel each."""
import json

import pytest

from tllm_spec.engine.step_log import StepLog, StepRecord
from tllm_spec.tools.step_timeline import main

pytest.importorskip("matplotlib")


def test_logs_are_drawn_one_panel_each(tmp_path, capsys):
    paths = []
    for name, gap in (("offline", 0.0), ("server", 0.02)):
        log = StepLog()
        log.record(StepRecord(0.0, 0.001, 0.05, 256, 2, 2, False, 0))
        log.record(StepRecord(0.05 + gap, 0.051 + gap, 0.06 + gap, 0, 0, 2, False, 0))
        log.record(StepRecord(0.055 + gap, 0.056 + gap, 0.07 + gap, 0, 0, 2, True, 0))
        paths.append(tmp_path / f"steps-{name}.json")
        paths[-1].write_text(json.dumps(log.as_dicts()))
    out = tmp_path / "timeline.png"
    main([str(p) for p in paths] + ["--out", str(out)])
    assert out.stat().st_size > 10_000 and "wrote" in capsys.readouterr().out
