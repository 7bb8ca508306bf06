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


def test_readings_are_taken_again_when_a_process_moves_joins_leaves_or_grows_old(monkeypatch):
    """PSS splits shared pages between their users: a process joining or leaving the tree
    moves the others' PSS while their resident size stays put, so every process is read
    again then; otherwise only one whose resident size moved, or whose reading is old."""
    from raying.bench import measure

    rss = {1: 100_000, 2: 200_000}
    reads: list[int] = []
    clock = [1000.0]
    monkeypatch.setattr(measure, "_rss_kib", lambda pid: rss.get(pid))
    monkeypatch.setattr(measure, "_kib_field", lambda *a: 0)
    monkeypatch.setattr(measure._memory, "tmpfs_used_bytes", lambda *a: 0)

    def process_kib(pid):
        reads.append(pid)
        return {"anon": rss[pid] // 2, "file": 10, "shmem": 0}

    monkeypatch.setattr(measure._memory, "process_kib", process_kib)
    monkeypatch.setattr(measure.time, "monotonic", lambda: clock[0])
    watch = TreeWatch(1)
    watch._live = {1: 11, 2: 22}

    def sample():
        reads.clear()
        watch._read_pss()
        return sorted(reads)

    assert sample() == [1, 2]
    assert sample() == []  # nothing moved: the readings stand
    rss[1] += 4096  # 4 MiB more resident: that process only
    assert sample() == [1]
    rss[2] += 512  # under the threshold
    assert sample() == []
    rss[3] = 50_000
    watch._live[3] = 33  # a process joins: every share may have moved
    assert sample() == [1, 2, 3]
    del watch._live[3]  # and leaves
    assert sample() == [1, 2]
    clock[0] += measure.DEFAULT_PSS_MAX_AGE_S + 0.1  # old readings are taken again
    assert sample() == [1, 2]
    assert watch.peak_whole_mb > 0
