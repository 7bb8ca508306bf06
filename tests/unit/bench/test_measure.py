"""The bench's process-tree watcher: a phase's memory includes processes found at its mark."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from raying.bench.measure import TreeWatch

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/smaps_rollup"),
                                reason="needs Linux /proc")

# The watched process starts a grandchild that touches 96 MiB, then waits for stdin to close.
_PARENT = r"""
import subprocess, sys
kid = subprocess.Popen([sys.executable, "-c", "import sys; b = bytearray(96 << 20); "
                        "b[::4096] = b'x' * len(b[::4096]); print('ready', flush=True); "
                        "sys.stdin.read()"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                       text=True)
kid.stdout.readline()
print("ready", flush=True)
sys.stdin.read()
kid.stdin.close()
kid.wait()
"""


def test_a_mark_reads_the_memory_of_processes_started_since_the_last_sample():
    proc = subprocess.Popen([sys.executable, "-c", _PARENT], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        # Sampling and discovery far apart: only the mark can find the grandchild in time.
        watch = TreeWatch(proc.pid, discover_interval_s=60, pss_interval_s=60).start()
        watch.phase("start")
        before = watch.whole_phase_peaks["start"]
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(0.1)
        watch.mark("start.end")
        watch.phase(None)
        after = watch.whole_phase_peaks["start"]
        watch.stop()
        assert after - before >= 80, (before, after)
    finally:
        proc.stdin.close()
        proc.wait(timeout=30)
