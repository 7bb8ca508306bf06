"""Where raying's memory goes: the process tree's PSS at its peak, split by process and mapping.

The bench's peak-memory target compares the PSS of raying's process tree with torch
DataLoader's. This profile shows what that figure is made of, so a miss is explained by
measurement rather than a guess:

- by process: the driver (the trainer's process), Ray's own processes (raylet, GCS, log
  monitor, agents) and Ray's workers (read tasks, the priority store);
- by mapping: Ray's shared-memory object store (plasma), the decoded-sample cache's files in
  tmpfs that readers map, other shared memory, the heap and anonymous memory, and file-backed
  code (Python, numpy, pyarrow, cv2, torch libraries).

Also reported: the tree's PSS once Ray has started and before any loader exists (Ray's floor),
and the bytes the decoded-sample cache holds in tmpfs (memory too, though mapped only while
read, so only partly inside PSS).

Run: ``python -m raying.bench.mem_profile DATA_DIR [--epochs 3] [--batch-size 256]
[--decoded-cache auto|off] [--object-store-mb N] [--json out.json]``
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import threading
import time
from typing import Any

import numpy as np

from raying.bench.measure import _stat, descendants
from raying.read.memory import dir_bytes

_MB = 1024.0 * 1024.0


def _category(path: str) -> str:
    if "plasma" in path:
        return "object store (plasma)"
    if "raying-decoded" in path:
        return "decoded cache (tmpfs, mapped)"
    if path.startswith("/dev/shm") or path.startswith("/memfd:"):
        return "other shared memory"
    if path.startswith("/") and not path.startswith("/dev/zero"):
        return "code and mapped files"
    return "heap and anonymous"


def _smaps(pid: int) -> dict[str, float]:
    """PSS in MB of one process, by mapping category."""
    out: dict[str, float] = collections.defaultdict(float)
    cat = "heap and anonymous"
    try:
        with open(f"/proc/{pid}/smaps", "rb") as fh:
            for raw in fh:
                line = raw.decode("utf-8", "replace")
                head = line.split(None, 5)
                if head and "-" in head[0] and len(head) >= 5 and ":" not in head[0]:
                    cat = _category(head[5].strip() if len(head) == 6 else "")
                elif line.startswith("Pss:"):
                    out[cat] += int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return dict(out)


def _pss(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/smaps_rollup", "rb") as fh:
            for line in fh:
                if line.startswith(b"Pss:"):
                    return int(line.split()[1]) / 1024.0
    except (OSError, ValueError):
        pass
    return 0.0


def _role(pid: int, root: int) -> str:
    if pid == root:
        return "driver (trainer process)"
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            cmd = fh.read().replace(b"\0", b" ").decode("utf-8", "replace")
    except OSError:
        return "gone"
    if "default_worker.py" in cmd or cmd.startswith("ray::"):
        return "Ray workers"
    return "Ray processes (raylet, GCS, agents, log monitor)"


class PeakWatch:
    """Samples the tree's PSS; at each new peak, records the per-process, per-mapping split."""

    def __init__(self, root: int, interval_s: float = 0.3) -> None:
        self.root, self.interval_s = root, interval_s
        self.peak_mb = 0.0
        self.split: dict[str, dict[str, float]] = {}
        self.procs: dict[str, list[float]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def total(self) -> float:
        return sum(_pss(p) for p in descendants(self.root))

    def start(self) -> PeakWatch:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        while not self._stop.is_set():
            pids = descendants(self.root)
            tot = sum(_pss(p) for p in pids)
            if tot > self.peak_mb:
                split: dict[str, dict[str, float]] = {}
                procs: dict[str, list[float]] = {}
                for p in pids:
                    name = _role(p, self.root)
                    role = split.setdefault(name, {})
                    cats = _smaps(p)
                    procs.setdefault(name, []).append(round(sum(cats.values()), 1))
                    for cat, mb in cats.items():
                        role[cat] = role.get(cat, 0.0) + mb
                self.peak_mb, self.split, self.procs = tot, split, procs
            self._stop.wait(self.interval_s)


def _title(pid: int, root: int) -> str:
    """A finer role for CPU: Ray workers by their process title (the actor or task they run)."""
    role = _role(pid, root)
    if role != "Ray workers":
        return role
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            cmd = fh.read().split(b"\0")[0].decode("utf-8", "replace")
    except OSError:
        return role
    if cmd.startswith("ray::"):
        name = cmd[5:].split(".")[0].split()[0]
        return "read workers" if name in ("IDLE", "read_task") else f"Ray actor {name}"
    return role


def _cpu_by_role(root: int) -> dict[int, tuple[str, float]]:
    """pid -> (role, CPU seconds so far) for the tree under ``root``."""
    out = {}
    for p in descendants(root):
        st = _stat(p)
        if st is not None:
            out[p] = (_title(p, root), st[2])
    return out


def _cpu_delta(a: dict[int, tuple[str, float]], b: dict[int, tuple[str, float]]
               ) -> dict[str, float]:
    """CPU seconds spent between two readings, by role (processes born in between count whole)."""
    out: dict[str, float] = collections.defaultdict(float)
    for p, (role, cpu) in b.items():
        out[role] += cpu - (a[p][1] if p in a else 0.0)
    return dict(out)


def profile(data: str, *, epochs: int = 3, batch_size: int = 256, decoded_cache: str = "auto",
            object_store_mb: int | None = None, cores: int | None = None,
            prioritized: bool = False) -> dict[str, Any]:
    import ray

    import raying
    from raying.read.decoded_dirs import root as decoded_root

    kwargs: dict[str, Any] = {"address": "local", "include_dashboard": False,
                              "num_cpus": cores or len(os.sched_getaffinity(0))}
    if object_store_mb:
        kwargs["object_store_memory"] = int(object_store_mb * _MB)
    t0 = time.perf_counter()
    ray.init(**kwargs)
    time.sleep(2.0)  # let Ray's processes settle before reading its floor
    watch = PeakWatch(os.getpid())
    ray_floor = watch.total()
    watch.start()
    manifest = raying.Manifest.scan(data)
    sampler = raying.PrioritizedSampler() if prioritized else None
    pipe = raying.Pipeline(manifest, sampler=sampler,
                           config=raying.PipelineConfig(decoded_cache=decoded_cache))
    rng = np.random.default_rng(0)
    rows, steady_rows, t_steady = 0, 0, 0.0
    cpu0: dict[int, tuple[str, float]] = {}
    try:
        for e in range(epochs):
            for b in pipe.iter_batches(batch_size=batch_size, epoch=e):
                rows += len(b["id"])
                steady_rows += len(b["id"]) if e > 0 else 0
                if prioritized:  # as the bench's W5: a random loss per sample, after the step
                    pipe.report(b["id"], rng.random(len(b["id"])))
            if e == 0:
                t_steady = time.perf_counter()
                cpu0 = _cpu_by_role(os.getpid())
        cpu = _cpu_delta(cpu0, _cpu_by_role(os.getpid()))
        steady = steady_rows / max(time.perf_counter() - t_steady, 1e-9) if epochs > 1 else None
        cache_mb = dir_bytes(decoded_root()) / _MB
    finally:
        watch.stop()
        pipe.close()
        ray.shutdown()
    by_role = {r: round(sum(c.values()), 1) for r, c in watch.split.items()}
    by_cat: collections.Counter[str] = collections.Counter()
    for cats in watch.split.values():
        by_cat.update(cats)
    return {"data": data, "rows": rows, "epochs": epochs, "batch_size": batch_size,
            "decoded_cache": decoded_cache, "object_store_mb": object_store_mb,
            "seconds": round(time.perf_counter() - t0, 1),
            "steady_img_s": round(steady) if steady else None, "prioritized": prioritized,
            "steady_cpu_s_per_1k_by_process": {
                k: round(v / max(steady_rows, 1) * 1000, 3) for k, v in cpu.items()},
            "ray_floor_pss_mb": round(ray_floor, 1), "peak_pss_mb": round(watch.peak_mb, 1),
            "peak_by_process": by_role,
            "peak_by_mapping": {k: round(v, 1) for k, v in by_cat.most_common()},
            "peak_processes_mb": {r: sorted(v, reverse=True) for r, v in watch.procs.items()},
            "peak_split": {r: {k: round(v, 1) for k, v in c.items()}
                           for r, c in watch.split.items()},
            "decoded_cache_tmpfs_mb": round(cache_mb, 1)}


def _print(res: dict[str, Any]) -> None:
    print(f"{res['rows']} rows, {res['epochs']} epochs, batch {res['batch_size']}, "
          f"decoded_cache={res['decoded_cache']}, object store "
          f"{res['object_store_mb'] or 'Ray default'} MB, "
          f"{'prioritized' if res['prioritized'] else 'uniform'}; steady {res['steady_img_s']} img/s")
    print(f"  Ray's floor (started, no loader): {res['ray_floor_pss_mb']:8.0f} MB PSS")
    print(f"  peak of the tree:                 {res['peak_pss_mb']:8.0f} MB PSS")
    print("  at the peak, by process:")
    for k, v in sorted(res["peak_by_process"].items(), key=lambda kv: -kv[1]):
        each = ", ".join(f"{x:.0f}" for x in res["peak_processes_mb"].get(k, []))
        print(f"    {k:50s} {v:8.0f}   ({each})")
    print("  at the peak, by mapping:")
    for k, v in res["peak_by_mapping"].items():
        print(f"    {k:50s} {v:8.0f}")
    print("  CPU-s per 1k images over the steady epochs, by process:")
    for k, v in sorted(res["steady_cpu_s_per_1k_by_process"].items(), key=lambda kv: -kv[1]):
        print(f"    {k:50s} {v:8.3f}")
    print(f"  decoded-sample cache held in tmpfs: {res['decoded_cache_tmpfs_mb']:.0f} MB")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m raying.bench.mem_profile",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("data", help="an image folder (e.g. the bench's W1 under --data)")
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--decoded-cache", default="auto", help="auto or off")
    ap.add_argument("--object-store-mb", type=int, default=None)
    ap.add_argument("--prioritized", action="store_true",
                    help="PrioritizedSampler with a random loss reported per sample (W5)")
    ap.add_argument("--json", default=None, help="also write the result here")
    args = ap.parse_args(argv)
    res = profile(args.data, epochs=args.epochs, batch_size=args.batch_size,
                  decoded_cache=args.decoded_cache, object_store_mb=args.object_store_mb,
                  prioritized=args.prioritized)
    _print(res)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(res, fh, indent=2)


if __name__ == "__main__":
    main()
