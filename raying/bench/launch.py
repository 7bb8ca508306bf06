"""One measurement: a child process for a peer's cells, watched from outside, cleaned up after.

The child (:mod:`raying.bench.child`) reports over a pipe; its marks are turned into CPU
readings of its process tree the moment they arrive (:mod:`raying.bench.measure`). A child
that overruns its time limit gets a ``py-spy dump`` of (up to six of) its tree's processes in
its log, then is killed; descendants still alive ``LEFTOVER_GRACE_S`` after it exits are killed by pid
and listed in the result.
"""

from __future__ import annotations

import dataclasses
import json
import os
import selectors
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

from raying.bench import measure

# After a measurement exits, how long its descendants (Ray's processes) may take to go.
LEFTOVER_GRACE_S = 15.0


@dataclasses.dataclass
class Job:
    """One child process: a peer, a round, the cells it runs."""

    round: int
    peer: str
    workloads: tuple[str, ...]
    cells: list[dict[str, Any]]

    @property
    def tag(self) -> str:
        return f"r{self.round}-{self.peer}-{'+'.join(self.workloads)}"


def _py_spy_dump(pids: list[int]) -> str:
    exe = shutil.which("py-spy") or os.path.join(os.path.dirname(sys.executable), "py-spy")
    if not os.path.exists(exe):
        return "(py-spy not found)"
    out = []
    for pid in pids:
        try:
            res = subprocess.run([exe, "dump", "--pid", str(pid)], capture_output=True,
                                 text=True, timeout=30)
            out.append(res.stdout or res.stderr)
        except (OSError, subprocess.SubprocessError) as exc:
            out.append(f"py-spy dump {pid}: {exc}")
    return "\n".join(out)


def _kill(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def local_ray_env(**extra: str) -> dict[str, str]:
    """This process's environment, plus ``extra``, for a child that starts its own local Ray
    (every Ray peer does): the cluster's address goes, and so does the job config Ray gives
    a job's entrypoint (run as a Ray job, its runtime_env names a working_dir package that
    only the job's cluster holds, which a local Ray's workers would fail to download)."""
    env = dict(os.environ, **extra)
    for name in ("RAY_ADDRESS", "RAY_JOB_CONFIG_JSON_ENV_VAR"):
        env.pop(name, None)
    return env


def run_job(job: Job, *, epochs: int, cores: int, seed: int, timeout_s: float,
            spec_extra: dict[str, Any], logs: str, say: Callable[[str], None]) -> dict[str, Any]:
    """Run one child, watch its tree, and return its raw result with CPU and memory added.

    ``spec_extra`` holds what every child gets (workloads, consumer settings); ``logs`` the
    folder for its spec, result and log; ``say`` prints progress.
    """
    spec = {"peer": job.peer, "cells": job.cells, "epochs": epochs, "cores": cores,
            "seed": seed + 1000 * job.round, **spec_extra}
    base = os.path.join(logs, job.tag)
    with open(base + ".spec.json", "w") as fh:
        json.dump(spec, fh)
    result_path = base + ".result.json"
    if os.path.exists(result_path):
        os.remove(result_path)
    # numpy's BLAS on one thread in every peer's processes, as Ray sets it in its workers:
    # W7's jitter calls it per image, and a second BLAS thread in each of the peers' worker
    # processes competes with the other workers for the same cores.
    env = local_ray_env(PYTHONUNBUFFERED="1", TF_CPP_MIN_LOG_LEVEL="2",
                        RAY_USAGE_STATS_ENABLED="0", OPENBLAS_NUM_THREADS="1")
    read_fd, write_fd = os.pipe()
    load_before = os.getloadavg()
    t0 = time.monotonic()
    with open(base + ".log", "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "raying.bench.child", base + ".spec.json", result_path,
             str(write_fd)], pass_fds=(write_fd,), stdout=log, stderr=subprocess.STDOUT,
            env=env)
    os.close(write_fd)
    watch = measure.TreeWatch(proc.pid).start()
    timed_out = False
    sel = selectors.DefaultSelector()
    sel.register(read_fd, selectors.EVENT_READ)
    deadline = t0 + timeout_s
    pending = b""
    try:
        while True:
            if time.monotonic() > deadline:
                timed_out = True
                break
            if not sel.select(timeout=1.0):
                if proc.poll() is not None:
                    break
                continue
            # Unbuffered: every complete line is handled as soon as it arrives, so a mark's
            # CPU reading is taken when the child sent it, not when the next line comes.
            chunk = os.read(read_fd, 1 << 16)
            if not chunk:
                break
            pending += chunk
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                msg = json.loads(line)
                if "mark" in msg:
                    watch.mark(msg["mark"])
                if "phase" in msg:
                    watch.phase(msg["phase"])
                if "say" in msg:
                    say(msg["say"])
    finally:
        sel.close()
        os.close(read_fd)
    if timed_out:
        pids = measure.alive(watch.known_pids())
        dump = _py_spy_dump(pids[:6])
        with open(base + ".log", "a") as log:
            log.write(f"\n--- timed out after {timeout_s:.0f} s; py-spy dump ---\n{dump}\n")
        _kill(pids)
        say(f"  TIMEOUT after {timeout_s:.0f} s (py-spy dump in {base}.log)")
    rc = proc.wait()
    watch.mark("exit")
    watch.stop()
    seconds = time.monotonic() - t0
    leftovers = _reap(watch.known_pids(), proc.pid)
    try:
        with open(result_path) as fh:
            result = json.load(fh)
    except (OSError, ValueError):
        result = {"peer": job.peer, "cells": []}
    done = len(result["cells"])
    if rc != 0 or timed_out or done < len(job.cells):
        tail = _tail(base + ".log")
        why = "timed out" if timed_out else f"exit code {rc}"
        say(f"  measurement {job.tag} {why}; {done}/{len(job.cells)} cells done. Log tail:\n"
            + tail)
        for cell in job.cells[done:]:
            result["cells"].append({**cell, "epochs": [], "errors": [f"not run: child {why}"]})
    for k, cell in enumerate(result["cells"]):
        cell["cpu_steady_s"] = watch.cpu_between(f"{k}.e0.end", f"{k}.e{epochs - 1}.end")
        cell["cpu_all_s"] = watch.cpu_between(f"{k}.open", f"{k}.e{epochs - 1}.end")
        cell["peak_pss_mb"] = watch.phase_peaks.get(str(k))
        cell["peak_whole_mb"] = watch.whole_phase_peaks.get(str(k))
    result.update({"round": job.round, "peer": job.peer, "workloads": list(job.workloads),
                   "tag": job.tag, "returncode": rc, "timed_out": timed_out,
                   "seconds": round(seconds, 2), "log": base + ".log",
                   "tree": measure.summary(watch), "leftover_pids": leftovers,
                   "startup_pss_mb": watch.phase_peaks.get("start"),
                   "startup_whole_mb": watch.whole_phase_peaks.get("start"),
                   "cpu_start_s": watch.cpu_between("start.begin", "start.end"),
                   "loadavg_before": load_before, "loadavg_after": os.getloadavg()})
    return result


def _reap(known: list[tuple[int, int]], root: int) -> list[int]:
    """Wait for the child's descendants to exit; kill (by pid) those still there after grace."""
    others = [p for p in known if p[0] != root]
    deadline = time.monotonic() + LEFTOVER_GRACE_S
    while measure.alive(others) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = measure.alive(others)
    _kill(left)
    return left


def _tail(path: str, lines: int = 25) -> str:
    try:
        with open(path, errors="replace") as fh:
            return "".join(fh.readlines()[-lines:])
    except OSError:
        return ""
