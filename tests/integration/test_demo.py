"""`raying demo --quick` end to end: the report's charts and summary, then a Chromium screenshot."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = ROOT / "artifacts"
CHARTS = ("accuracy.png", "priorities.png", "throughput.png", "stall.png")
# The arms' colours in every chart (raying.tools.demo_report.COLOURS).
UNIFORM_RGB, PRIORITIZED_RGB = (0x4C, 0x72, 0xB0), (0xDD, 0x84, 0x52)


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    out = tmp_path_factory.mktemp("raying-report")
    data = tmp_path_factory.mktemp("demo-data")
    proc = subprocess.run(
        [sys.executable, "-m", "raying.tools.cli", "demo", "--quick", "--out", str(out),
         "--data", str(data)],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"raying demo --quick failed:\n{proc.stderr[-4000:]}"
    return out, proc


def _has_colour(img: np.ndarray, rgb: tuple[int, int, int], tol: int = 12) -> int:
    return int((np.abs(img[..., :3].astype(int) - np.array(rgb)).max(axis=-1) <= tol).sum())


def test_charts_exist_and_show_both_arms(demo):
    from PIL import Image

    out, _ = demo
    for name in CHARTS:
        path = out / name
        assert path.is_file(), f"{name} is missing"
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", f"{name} is not a PNG"
        assert path.stat().st_size > 10_000, f"{name} is nearly empty"
        img = np.asarray(Image.open(path).convert("RGB"))
        assert img.shape[0] > 200 and img.shape[1] > 600
        assert img.std() > 10, f"{name} is blank"
        assert _has_colour(img, PRIORITIZED_RGB) > 50, f"{name} has no prioritized curve"
        if name != "priorities.png":
            assert _has_colour(img, UNIFORM_RGB) > 50, f"{name} has no uniform curve"


def test_summary_holds_the_expected_fields(demo):
    out, proc = demo
    summary = json.loads((out / "summary.json").read_text())
    assert summary["quick"] is True
    assert sorted(summary["charts"]) == sorted(CHARTS)
    assert 0 < summary["target"] < 1
    assert summary["dataset"]["train_size"] > 1000
    assert 0 < summary["dataset"]["rare_share"] < 0.1
    for arm in ("uniform", "prioritized"):
        a = summary["arms"][arm]
        assert a["img_per_s"] > 0 and a["pipeline_img_per_s"] > 0
        assert 0.0 <= a["stall_share"] <= 1.0
        assert len(a["steps_to_target"]) == len(summary["seeds"])
        assert 0.0 <= a["rare_acc"] <= 1.0 and 0.0 <= a["final_acc"] <= 1.0
        # Three bad files are in the training folder: every epoch read skips them.
        assert a["skipped_count"] >= 3
        run = summary["runs"][arm][0]
        assert run["curve"][-1]["step"] == run["steps"] > 0
    reasons = {s["path"].split("/")[-1]: s["reason"] for s in summary["skipped_files"]}
    assert reasons == {"bad_truncated.jpg": "truncated", "bad_empty.jpg": "empty",
                       "bad_not_an_image.jpg": "not_an_image"}
    curve = summary["runs"]["prioritized"][0]["curve"]
    assert all("rare_prob_mass" in r for r in curve)
    # The prioritized arm drew the rare classes more often than their share of the data.
    assert summary["arms"]["prioritized"]["rare_draw_share"] > summary["dataset"]["rare_share"]
    assert summary["verdict"]
    assert "steps to" in proc.stdout and "skipped samples" in proc.stdout
    assert (out / "index.html").is_file()


def test_html_report_renders_in_headless_chromium(demo, tmp_path):
    from PIL import Image

    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        pytest.skip("chromium is not installed (Debian: apt-get install -y chromium); the "
                    "screenshot check needs it")
    out, _ = demo
    html = out / "index.html"
    for name in CHARTS:
        assert f'src="{name}"' in html.read_text()
    shot = tmp_path / "report.png"
    cmd = [browser, "--headless", "--no-sandbox", "--disable-gpu",
           "--disable-background-networking", "--disable-component-update", "--disable-sync",
           "--no-first-run", "--disable-quic", "--hide-scrollbars",
           f"--user-data-dir={tmp_path / 'profile'}", f"--screenshot={shot}",
           "--window-size=1280,2000", html.resolve().as_uri()]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "HOME": str(tmp_path)})
    assert shot.is_file(), f"chromium wrote no screenshot (rc {proc.returncode}):\n" \
                           f"{proc.stderr[-2000:]}"
    ARTIFACTS.mkdir(exist_ok=True)
    shutil.copy(shot, ARTIFACTS / "demo-report-screenshot.png")
    img = np.asarray(Image.open(shot).convert("RGB"))
    assert img.shape[:2] == (2000, 1280)
    assert img.std() > 20, "the screenshot is blank"
    # The charts were drawn, not broken-image icons: both arms' colours are on the page.
    assert _has_colour(img, PRIORITIZED_RGB) > 200
    assert _has_colour(img, UNIFORM_RGB) > 200
