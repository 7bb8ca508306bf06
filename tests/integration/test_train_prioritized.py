"""jobs/train_prioritized.py --smoke-test: runs in seconds and prints its summary line last."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "jobs"))
import _common  # noqa: E402


def test_smoke_test_prints_a_json_summary(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "jobs/train_prioritized.py", "--smoke-test", "--out", str(out),
         "--data", str(tmp_path / "data")],
        cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = [ln for ln in proc.stdout.splitlines() if ln.strip()]
    assert lines[-1].startswith(_common.SUMMARY_PREFIX), lines[-1][:200]
    summary = _common.find_summary(proc.stdout)
    assert summary["job"] == "train_prioritized" and summary["smoke_test"] is True
    assert summary["seeds"] == [0] and summary["max_steps"] == 30
    assert summary["prioritized"] == {"alpha": 1.0, "beta": 0.0, "uniform_mix": 0.1,
                                      "guard": False}
    for arm in ("uniform", "prioritized"):
        a = summary["arms"][arm]
        assert a["steps"] == [30]
        assert len(a["steps_to_target"]) == 1
        assert 0.0 <= a["rare_acc"] <= 1.0 and 0.0 <= a["final_acc"] <= 1.0
        assert a["img_per_s"] > 0
        assert set(a["skipped_ids"]) and a["skipped_count"] >= 3  # the bad files, skipped
        assert any(ln.startswith(f"seed 0 {arm:>11}: steps to 90%") for ln in lines)
    assert len(summary["speedup_per_seed"]) == 1 and len(summary["aim_met_per_seed"]) == 1
    assert len(summary["charts"]) == 2
    for chart in summary["charts"]:
        assert Path(chart).read_bytes()[:4] == b"\x89PNG"
        assert Path(chart).stat().st_size > 10_000
    saved = json.loads((out / "summary.json").read_text())
    assert len(saved["runs"]["prioritized"][0]["curve"]) >= 3


def test_config_file_sets_defaults_and_rejects_unknown_keys(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"alpah": 0.5}))
    proc = subprocess.run([sys.executable, "jobs/train_prioritized.py", "--config", str(bad)],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "unknown keys ['alpah']" in proc.stderr


def test_data_naming_a_users_own_folder_is_refused_not_written_into(tmp_path):
    own = tmp_path / "my-images"
    (own / "cats").mkdir(parents=True)
    (own / "cats" / "a.jpg").write_bytes(b"not really")
    proc = subprocess.run([sys.executable, "jobs/train_prioritized.py", "--smoke-test",
                           "--data", str(own), "--out", str(tmp_path / "out")],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "trains on data it generates" in proc.stderr
    assert "jobs/train_torch.py --data" in proc.stderr
    assert sorted(p.name for p in own.iterdir()) == ["cats"]  # nothing written there
