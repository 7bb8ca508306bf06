"""Local checkpoint folders of Train workers: a dead process's are swept, a live one's kept."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import tempfile

# The module (raying.train's own name ``loader`` is the function).
train_loader = importlib.import_module("raying.train.loader")


def test_checkpoint_folders_of_dead_processes_are_swept_and_live_ones_kept():
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    dead = int(done.stdout)  # a process that has exited
    prefix = train_loader._CHECKPOINT_PREFIX
    gone = tempfile.mkdtemp(prefix=f"{prefix}{dead}-")
    open(os.path.join(gone, "raying-state.pkl"), "wb").close()
    mine = tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}-")
    odd = tempfile.mkdtemp(prefix=f"{prefix}notapid-")
    try:
        train_loader._sweep_checkpoint_folders()
        assert not os.path.exists(gone)
        assert os.path.isdir(mine) and os.path.isdir(odd)
    finally:
        for path in (gone, mine, odd):
            train_loader._remove_all([path])
