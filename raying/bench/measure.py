"""CPU-seconds and peak memory of a process tree, read from /proc by a watcher outside it.

The bench runs each measurement in a child process; the orchestrator watches the child and
every descendant (Ray's raylet, GCS and workers, torch DataLoader workers, the limit's
processes) without running inside the tree, so the watcher's own cost is not charged to the
peer.

- CPU: ``utime + stime`` of every process ever seen in the tree, each at its last reading,
  summed. A process that exits keeps its last reading, so workers that come and go are still
  counted (up to one sampling interval of their final work). Readings are taken every
  ``DEFAULT_CPU_INTERVAL_S`` and on demand at the child's marks (epoch ends), so the CPU of a
  window between two marks is exact up to the latency of a pipe read (~1 ms).
- Memory: the tree's PSS (``Pss`` of ``/proc/<pid>/smaps_rollup``, summed), sampled every
  ``DEFAULT_PSS_INTERVAL_S`` (a process whose resident size has not moved keeps its last
  reading, up to ``DEFAULT_PSS_MAX_AGE_S`` and until a process joins or leaves the tree). PSS splits each shared page between the processes that map it,
  so copy-on-write pages of forked workers and Ray's shared-memory object store are counted
  once, not once per process as a sum of RSS would. It is a sampled peak: a spike shorter than
  the interval can be missed. The sum of the processes' ``VmHWM`` (kernel-tracked peak RSS,
  which double-counts shared pages) is kept as an upper bound.
- Whole memory: PSS leaves out the tmpfs pages nobody maps at the moment (a decoded cache's
  files between reads, the object store's free but touched pages) and splits the mapped ones.
  The whole figure is the tree's anonymous and file PSS plus the growth of ``/dev/shm``'s
  used bytes since the watch began, so every page counts once (:mod:`raying.read.memory`).
  The bench's memory columns use it for every peer.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

from raying.read import memory as _memory

# How often the watcher reads the tree's CPU times, discovers new processes and reads PSS.
DEFAULT_CPU_INTERVAL_S = 0.25
DEFAULT_DISCOVER_INTERVAL_S = 1.0
DEFAULT_PSS_INTERVAL_S = 1.0
# A process's smaps_rollup (2-3 ms each for a process with Ray's object store mapped, and a
# Ray tree has ~20 processes) is read again only when its resident size (statm, a few us)
# moved by more than this share or ``DEFAULT_PSS_REREAD_KIB``, or its reading is older than
# ``DEFAULT_PSS_MAX_AGE_S``: the watcher runs on the cores it measures, and reading every
# process every second cost a Ray peer ~5 % of a core more than a peer of a few processes.
# Every process is read again when the tree gains or loses one: PSS splits shared pages
# (libraries, the object store) between the processes mapping them, so a process coming or
# going changes the others' PSS while their resident size stays put.
DEFAULT_PSS_REREAD_SHARE = 0.01
DEFAULT_PSS_REREAD_KIB = 1024
DEFAULT_PSS_MAX_AGE_S = 3.0
_PAGE_KIB = os.sysconf("SC_PAGE_SIZE") // 1024

_TICKS = os.sysconf("SC_CLK_TCK")
_MB = 1024.0 * 1024.0


def _stat(pid: int) -> tuple[int, int, float] | None:
    """(ppid, start time in ticks, CPU seconds) of ``pid``, or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            raw = fh.read()
    except OSError:
        return None
    # The command name may hold spaces and parentheses; the fields follow the last ')'.
    fields = raw[raw.rfind(b")") + 2:].split()
    return int(fields[1]), int(fields[19]), (int(fields[11]) + int(fields[12])) / _TICKS


def _kib_field(path: str, key: bytes) -> int:
    """A ``Key:  N kB`` field of a /proc file in KiB (0 if the process is gone)."""
    try:
        with open(path, "rb") as fh:
            for line in fh:
                if line.startswith(key):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return 0


def _rss_kib(pid: int) -> int | None:
    """Resident size of ``pid`` in KiB from /proc/<pid>/statm (None if it is gone)."""
    try:
        with open(f"/proc/{pid}/statm", "rb") as fh:
            return int(fh.read().split()[1]) * _PAGE_KIB
    except (OSError, ValueError, IndexError):
        return None


def descendants(root: int) -> list[int]:
    """``root`` and every live process below it (one scan of /proc)."""
    parent: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        st = _stat(int(name))
        if st is not None:
            parent.setdefault(st[0], []).append(int(name))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(parent.get(pid, ()))
    return out


class TreeWatch:
    """Watches the process tree under ``root`` from a background thread.

    Call :meth:`mark` at the moments whose CPU readings you need (``cpu_at(name)`` later) and
    :meth:`phase` to attribute the peak PSS to a part of the run (``phase_peaks``).
    """

    def __init__(self, root: int, *, cpu_interval_s: float = DEFAULT_CPU_INTERVAL_S,
                 discover_interval_s: float = DEFAULT_DISCOVER_INTERVAL_S,
                 pss_interval_s: float = DEFAULT_PSS_INTERVAL_S) -> None:
        self.root = root
        self._intervals = (cpu_interval_s, discover_interval_s, pss_interval_s)
        self._lock = threading.Lock()
        self._procs: dict[tuple[int, int], float] = {}  # (pid, start ticks) -> last CPU s
        self._live: dict[int, int] = {root: -1}  # pid -> start ticks (-1: not read yet)
        self._hwm: dict[tuple[int, int], int] = {}  # (pid, start) -> peak RSS KiB
        self.marks: dict[str, tuple[float, float]] = {}  # name -> (monotonic, CPU s)
        self.peak_pss_mb = 0.0
        self.phase_peaks: dict[str, float] = {}
        self._footprint = _memory.Footprint()  # /dev/shm's used bytes before the tree's own
        self.peak_whole_mb = 0.0
        self.whole_phase_peaks: dict[str, float] = {}
        self._phase: str | None = None
        # (pid, start) -> (resident KiB when read, monotonic time, its smaps_rollup figures)
        self._pss: dict[tuple[int, int], tuple[int, float, dict[str, int]]] = {}
        self.pss_reads = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-treewatch", daemon=True)
        self.samples = 0

    # -- public ----------------------------------------------------------------------------------
    def start(self) -> TreeWatch:
        self._discover()
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def mark(self, name: str) -> None:
        """Record the tree's CPU seconds now under ``name`` (new processes looked up first),
        and read the memory of the phase in force: the end of a phase is often its fullest
        moment (Ray's workers, prestarted as ``ray.init`` returns, are found here rather than
        up to a discovery interval later, when the start phase is over)."""
        with self._lock:
            self._discover_locked()
            self._read_cpu_locked()
            self.marks[name] = (time.monotonic(), self._total_locked())
            reading = self._phase is not None
        if reading:
            self._read_pss()

    def phase(self, name: str | None) -> None:
        """Attribute PSS samples from now on to ``name`` (None: to no phase)."""
        with self._lock:
            self._phase = name
            if name is not None:
                self.phase_peaks.setdefault(name, 0.0)
                self.whole_phase_peaks.setdefault(name, 0.0)
        if name is not None:
            self._read_pss()

    def cpu_between(self, start: str, end: str) -> float | None:
        """CPU seconds the tree spent between two marks (None if either is missing)."""
        if start not in self.marks or end not in self.marks:
            return None
        return self.marks[end][1] - self.marks[start][1]

    def cpu_total(self) -> float:
        with self._lock:
            return self._total_locked()

    def known_pids(self) -> list[tuple[int, int]]:
        """Every (pid, start ticks) seen in the tree, for a clean-up check after the run."""
        with self._lock:
            return list(self._procs)

    def peak_rss_sum_mb(self) -> float:
        with self._lock:
            return sum(self._hwm.values()) / 1024.0

    # -- sampling --------------------------------------------------------------------------------
    def _run(self) -> None:
        cpu_s, disc_s, pss_s = self._intervals
        next_disc = next_pss = time.monotonic()
        while not self._stop.wait(cpu_s):
            now = time.monotonic()
            with self._lock:
                if now >= next_disc:
                    self._discover_locked()
                    next_disc = now + disc_s
                self._read_cpu_locked()
            if now >= next_pss:
                self._read_pss()
                next_pss = now + pss_s
            self.samples += 1

    def _discover(self) -> None:
        with self._lock:
            self._discover_locked()

    def _discover_locked(self) -> None:
        for pid in descendants(self.root):
            if pid not in self._live or self._live[pid] == -1:
                st = _stat(pid)
                if st is not None:
                    self._live[pid] = st[1]

    def _read_cpu_locked(self) -> None:
        gone = []
        for pid, start in self._live.items():
            st = _stat(pid)
            if st is None or (start != -1 and st[1] != start):
                gone.append(pid)
                continue
            self._procs[(pid, st[1])] = st[2]
        for pid in gone:
            self._live.pop(pid, None)

    def _total_locked(self) -> float:
        return sum(self._procs.values())

    def _read_pss(self) -> None:
        with self._lock:
            live = list(self._live.items())
        total_kib = own_kib = 0
        hwm = {}
        now = time.monotonic()
        if set(self._pss) != set(live):  # a process came or went: the shares moved
            self._pss.clear()
        for pid, start in live:
            k = self._process_kib(pid, start, now)
            total_kib += k["anon"] + k["file"] + k["shmem"]
            own_kib += k["anon"] + k["file"]
            hwm[(pid, start)] = _kib_field(f"/proc/{pid}/status", b"VmHWM:")
        mb = total_kib / 1024.0
        grown = max(0, _memory.tmpfs_used_bytes() - self._footprint.tmpfs_base)
        whole = own_kib / 1024.0 + grown / _MB
        with self._lock:
            for key, v in hwm.items():
                if v > self._hwm.get(key, 0):
                    self._hwm[key] = v
            self.peak_pss_mb = max(self.peak_pss_mb, mb)
            self.peak_whole_mb = max(self.peak_whole_mb, whole)
            if self._phase is not None:
                self.phase_peaks[self._phase] = max(self.phase_peaks.get(self._phase, 0.0), mb)
                self.whole_phase_peaks[self._phase] = max(
                    self.whole_phase_peaks.get(self._phase, 0.0), whole)


    def _process_kib(self, pid: int, start: int, now: float) -> dict[str, int]:
        """``memory.process_kib(pid)``, read again only when the process's resident size
        moved or its last reading is old (see ``DEFAULT_PSS_REREAD_SHARE``)."""
        rss = _rss_kib(pid)
        if rss is None:
            self._pss.pop((pid, start), None)
            return {"anon": 0, "file": 0, "shmem": 0}
        last = self._pss.get((pid, start))
        if last is not None:
            moved = abs(rss - last[0])
            if (moved <= max(DEFAULT_PSS_REREAD_KIB, DEFAULT_PSS_REREAD_SHARE * last[0])
                    and now - last[1] < DEFAULT_PSS_MAX_AGE_S):
                return last[2]
        k = _memory.process_kib(pid)
        self.pss_reads += 1
        self._pss[(pid, start)] = (rss, now, k)
        return k


def alive(procs: list[tuple[int, int]]) -> list[int]:
    """The pids of ``procs`` (pid, start ticks) that still run as the same process."""
    out = []
    for pid, start in procs:
        st = _stat(pid)
        if st is not None and st[1] == start:
            out.append(pid)
    return out


def summary(watch: TreeWatch) -> dict[str, Any]:
    """Whole-run figures of a watch, for the JSON."""
    return {"peak_pss_mb": round(watch.peak_pss_mb, 1),
            "peak_whole_mb": round(watch.peak_whole_mb, 1),
            "peak_rss_sum_mb": round(watch.peak_rss_sum_mb(), 1),
            "cpu_s": round(watch.cpu_total(), 3), "processes_seen": len(watch.known_pids()),
            "phase_peak_pss_mb": {k: round(v, 1) for k, v in watch.phase_peaks.items()}}
