"""Step timelines: StepLog files (``Engine.step_log``, written by ``scripts/serving_vs_offline.py``) drawn one above
the other, so that an offline run and a server run of the same prompts can be compared by eye: requests in each
step over time, prefill steps shaded, the device idle between steps marked.

    python3 -m tllm_spec.tools.step_timeline steps-offline-512.json steps-concurrency-64.json --out timeline.png
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from ..engine.step_log import StepLog


def load(path: Path) -> list[dict]:
    """A StepLog file's records (StepRecord fields), oldest first."""
    return json.loads(path.read_text())


def plot(logs: dict[str, list[dict]], out: Path) -> Path | None:
    """One panel per log (label -> records), on one time scale from each log's first launch; None (with a message)
    without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: plot skipped (pip install matplotlib)")
        return None
    fig, axes = plt.subplots(len(logs), 1, figsize=(11, 2.4 * len(logs)), sharex=True, squeeze=False)
    for ax, (label, records) in zip(axes[:, 0], logs.items()):
        t0 = records[0]["start"] if records else 0.0
        for r in records:
            if r["prompt_tokens"]:  # a prefill step: its span shaded
                ax.axvspan(r["start"] - t0, r["done"] - t0, color="tab:orange", alpha=0.35, lw=0)
        for a, b in zip(records, records[1:]):  # nothing in flight between a step's read and the next launch
            if not b["chained"] and b["start"] - a["done"] > 1e-3:
                ax.axvspan(a["done"] - t0, b["start"] - t0, color="tab:red", alpha=0.5, lw=0)
        ax.step([r["done"] - t0 for r in records], [r["rows"] for r in records], where="pre", color="tab:blue", lw=1)
        summary = StepLog.from_dicts(records).summary()
        ax.set_title(f"{label}: {len(records)} steps in {summary.get('span_s', 0.0):.2f} s, device idle between "
                     f"steps {summary.get('idle_between_steps_s', 0.0):.2f} s", fontsize=9, loc="left")
        ax.set_ylabel("requests")
    axes[-1, 0].set_xlabel("seconds (blue: requests in the step; orange: prefill steps; red: no step in flight)")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("logs", nargs="+", type=Path, help="StepLog JSON files (each file's name labels its panel)")
    p.add_argument("--out", type=Path, default=Path("step_timeline.png"))
    args = p.parse_args(argv)
    written = plot({path.stem: load(path) for path in args.logs}, args.out)
    if written is not None:
        print(f"wrote {written}")


if __name__ == "__main__":
    main()
