"""jobs/train_prioritized.py --smoke-test: runs in seconds and prints its JSON summary last."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_smoke_test_prints_a_json_summary(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "jobs/train_prioritized.py", "--smoke-test", "--out", str(out),
         "--data", str(tmp_path / "data")],
        cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = [ln for ln in proc.stdout.splitlines() if ln.strip()]
    summary = json.loads(lines[-1])
    assert summary["job"] == "train_prioritized" and summary["smoke_test"] is True
    assert summary["seeds"] == [0]
    for arm in ("uniform", "prioritized"):
        a = summary["arms"][arm]
        assert len(a["steps_to_target"]) == 1
        assert 0.0 <= a["rare_acc"] <= 1.0
        assert a["img_per_s"] > 0
        assert a["steps"] == [summary["max_steps"]] or a["steps_to_target"][0] is not None
        assert any(ln.startswith(f"seed 0 {arm:>11}:") for ln in lines)
    assert len(summary["speedup_per_seed"]) == 1
    assert len(summary["aim_met_per_seed"]) == 1
    for chart in summary["charts"]:
        assert Path(chart).stat().st_size > 10_000
    assert (out / "summary.json").is_file()
