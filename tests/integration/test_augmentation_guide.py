"""docs/augmentation.md: every Python example runs exactly as written."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GUIDE = ROOT / "docs" / "augmentation.md"


def _blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", GUIDE.read_text(), flags=re.S)


def _imports(module: str) -> bool:
    """Whether ``module`` imports in a fresh interpreter (a torchvision built for another
    torch fails with a RuntimeError, not an ImportError)."""
    proc = subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True)
    return proc.returncode == 0


def test_guide_has_the_three_examples():
    blocks = _blocks()
    assert len(blocks) == 3
    assert "colour_jitter" in blocks[0] and "RandAugment" in blocks[1]
    assert 'columns=["caption"' in blocks[2]


@pytest.mark.parametrize("index", range(3), ids=["numpy-jitter", "randaugment", "caption"])
def test_guide_example_runs(index, tmp_path):
    code = _blocks()[index]
    if "torchvision" in code and not _imports("torchvision"):
        pytest.skip("torchvision does not import alongside this torch (install the build that "
                    "matches it to run this example)")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("RAY_ADDRESS", None)
    try:
        proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=600)
    except subprocess.TimeoutExpired as e:
        tail = (e.stderr or b"")[-3000:]
        pytest.fail(f"guide example {index} ran past 600 s; its stderr ended with:\n"
                    f"{tail.decode(errors='replace') if isinstance(tail, bytes) else tail}")
    assert proc.returncode == 0, proc.stderr[-3000:]
