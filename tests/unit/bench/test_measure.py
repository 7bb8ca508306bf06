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


# The watched process touches 16 MiB, idles until told, then touches 64 MiB more.
_GROWER = r"""
import sys
a = bytearray(16 << 20); a[::4096] = b'x' * len(a[::4096])
print("ready", flush=True)
sys.stdin.readline()
b = bytearray(64 << 20); b[::4096] = b'x' * len(b[::4096])
print("grown", flush=True)
sys.stdin.read()
"""


def test_an_idle_process_keeps_its_reading_and_a_grown_one_is_read_again():
    proc = subprocess.Popen([sys.executable, "-c", _GROWER], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        watch = TreeWatch(proc.pid, cpu_interval_s=0.02, pss_interval_s=0.02).start()
        watch.phase("idle")
        time.sleep(0.6)  # ~30 samples of a process whose resident size does not move
        idle_reads = watch.pss_reads
        assert watch.samples >= 10 and idle_reads <= 3, (watch.samples, idle_reads)
        idle = watch.whole_phase_peaks["idle"]
        watch.phase("grown")
        proc.stdin.write("go\n")
        proc.stdin.flush()
        assert proc.stdout.readline().strip() == "grown"
        time.sleep(0.2)
        watch.mark("grown.end")
        watch.stop()
        assert watch.pss_reads > idle_reads
        assert watch.whole_phase_peaks["grown"] - idle >= 56, watch.whole_phase_peaks
    finally:
        proc.stdin.close()
        proc.wait(timeout=30)
