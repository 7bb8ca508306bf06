"""The README's code examples run exactly as written."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _blocks():
    text = (ROOT / "README.md").read_text()
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


def test_readme_shows_the_two_commands():
    text = (ROOT / "README.md").read_text()
    assert "make demo" in text and "make test" in text
    assert len(_blocks()) >= 2


@pytest.mark.parametrize("index", range(2))
def test_readme_example_runs(index, tmp_path):
    code = _blocks()[index]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("RAY_ADDRESS", None)
    try:  # a hang, not slowness, should fail this: 66 s here, 80 s with both cores busy
        proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=600)
    except subprocess.TimeoutExpired as e:
        tail = (e.stderr or b"")[-3000:]
        pytest.fail(f"README example {index} ran past 600 s; its stderr ended with:\n"
                    f"{tail.decode(errors='replace') if isinstance(tail, bytes) else tail}")
    assert proc.returncode == 0, proc.stderr[-3000:]
