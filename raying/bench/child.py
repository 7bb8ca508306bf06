"""One bench measurement process: a peer, its cells (workload x batch size x consumer mode), epochs.

Run by the orchestrator (``raying.bench.run``) as
``python -m raying.bench.child SPEC.json RESULT.json EVENTS_FD``. It starts the peer's framework
(timed: a Ray peer's ``ray.init`` is reported as ``ray_start_s`` and never counted in a time to
first batch), then for every cell builds a fresh loader and runs its epochs through the same
consumer loop, writing the result after every cell. Over the ``EVENTS_FD`` pipe it tells the
orchestrator, which watches this process tree from outside, where each cell and epoch ends
(``mark``: CPU readings there), which cell is running (``phase``: peak memory per cell) and
what to print (``say``).

Before each cell, untimed, every file of the workload is read once (``read_through``), so
every peer's cold epoch starts with the workload in the page cache.

Timing of one cell (``perf_counter`` seconds; ``open`` builds the loader: dataset listing,
framework objects, worker start where the framework starts them eagerly)::

    t_open --open--> epoch 0: request .. first batch .. last batch = end_0   (cold)
                     epoch 1: request = end_0 .. first batch .. end_1         (warm)
                     ...
                     epoch E-1: .. end_{E-1}

    ttfb cold  = first batch of epoch 0 - t_open   (listing + loader build + first batch)
    ttfb warm  = first batch of epoch e - its request, e >= 1 (median over e)
    steady     = rows of epochs 1..E-1 / (end_{E-1} - end_0): includes the gaps at the epoch
                 boundaries, as a trainer sees them.

Every batch is checked: rows = len(labels) = images.shape[0], image shape (224, 224, 3) (or
the workload's stored shape for the plain pyarrow read) and dtype uint8. Consumer modes:
``iterate`` (count rows only), ``sleep`` (``time.sleep`` of a fixed time per image: what a
loader that overlaps with the step hides) and ``compute`` (sha256 over a fixed number of bytes
per image on this thread, which releases the GIL like a framework's kernels: the trainer's
CPU competes with the loader's).
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import statistics
import sys
import time
import traceback
from typing import Any

import numpy as np

from raying.bench.workloads import OUTPUT_SIZE, Workload, read_through

# peer name -> "module:class"; each class has ``start(cores) -> dict``, ``open(workload,
# batch_size=, cores=, seed=) -> loader`` and ``stop()``; a loader has ``out_shape``,
# ``epoch(e)`` yielding ``(images, labels)``, ``close()`` and optionally ``extra() -> dict``.
PEERS = {
    "L": "raying.bench.peers_native:LimitPeer",
    "L-crop": "raying.bench.peers_native:CropLimitPeer",
    "pyarrow": "raying.bench.peers_native:PyArrowPeer",
    "torch": "raying.bench.peers_torch:TorchPeer",
    "tf": "raying.bench.peers_tf:TfPeer",
    "tf-cache": "raying.bench.peers_tf:TfCachePeer",
    "raydata": "raying.bench.peers_ray:RayDataPeer",
    "raying": "raying.bench.peers_ray:RayingPeer",
    "raying-cache": "raying.bench.peers_ray:RayingCachePeer",
    "raying-cache-eager": "raying.bench.peers_ray:RayingCacheEagerPeer",
    "raying-train": "raying.bench.peers_train:RayingTrainPeer",
    "raydata-train": "raying.bench.peers_train:RayDataTrainPeer",
}
# The package each peer needs, and how to get it.
PEER_NEEDS = {
    "torch": ("torch", "pip install torch"),
    "tf": ("tensorflow", "pip install 'raying[tf]'"),
    "tf-cache": ("tensorflow", "pip install 'raying[tf]'"),
    "raydata": ("ray", "pip install 'ray[data]'"),
    "raying": ("ray", "pip install 'ray[data]'"),
    "raying-cache": ("ray", "pip install 'ray[data]'"),
    "raying-cache-eager": ("ray", "pip install 'ray[data]'"),
    "raying-train": ("ray", "pip install 'ray[data,train]'"),
    "raydata-train": ("ray", "pip install 'ray[data,train]'"),
}
# Which workloads each peer runs (W4's reference is the plain pyarrow read; W5 needs a sampler
# whose weights live updates reshape, which only raying has).
PEER_WORKLOADS = {
    "L": ("W1", "W2", "W3", "W6", "W7"),
    "L-crop": ("W1", "W2", "W3", "W6", "W7"),
    "pyarrow": ("W4",),
    "torch": ("W1", "W2", "W3", "W4", "W6", "W7"),
    "tf": ("W1", "W2", "W3", "W4", "W6", "W7"),
    "tf-cache": ("W1", "W2"),
    "raydata": ("W1", "W2", "W3", "W4", "W6", "W7"),
    "raying": ("W1", "W2", "W3", "W4", "W5", "W6", "W7"),
    "raying-cache": ("W1", "W2", "W3"),
    "raying-cache-eager": ("W1", "W2"),
    "raying-train": ("W1", "W2", "W3", "W6"),
    "raydata-train": ("W1", "W3"),  # one folder, one Parquet: Train start-up is dear
}
# Peers that train with Ray Train (a TorchTrainer per cell, ~20 s of start each here); in
# ``--quick``, which checks that every arm runs, they run in the "iterate" mode only, raying's
# on one folder and one Parquet workload (W2 and W6 take W1's path through Train; W3 is its
# only run of Parquet shards through Train), plain Ray Data's on the folder (its Parquet
# dataset is the raydata peer's, which quick runs on W3, through the same worker loop).
TRAIN_PEERS = ("raying-train", "raydata-train")
QUICK_TRAIN_WORKLOADS = {"raying-train": ("W1", "W3"), "raydata-train": ("W1",)}


def peer_workloads(peer: str, *, quick: bool = False) -> tuple[str, ...]:
    """The workloads ``peer`` runs (in ``--quick``, fewer for the Train peers)."""
    wls = PEER_WORKLOADS[peer]
    if quick and peer in TRAIN_PEERS:
        return tuple(w for w in wls if w in QUICK_TRAIN_WORKLOADS[peer])
    return wls


# Peers that are references, not loaders: they run the "iterate" mode only.
REFERENCE_PEERS = ("L", "L-crop", "pyarrow")
_WORK_CHUNK_BYTES = 1 << 20


def peer_class(name: str):
    module, cls = PEERS[name].split(":")
    return getattr(importlib.import_module(module), cls)


class Events:
    """JSON lines to the orchestrator (a no-op without a pipe, e.g. when run by hand)."""

    def __init__(self, fd: int | None) -> None:
        self._fh = os.fdopen(fd, "w", buffering=1) if fd is not None else None

    def send(self, **msg: Any) -> None:
        if self._fh is not None:
            self._fh.write(json.dumps(msg) + "\n")
            self._fh.flush()
        elif "say" in msg:
            print(msg["say"], flush=True)


class Consumer:
    """The trainer stand-in: what happens to each batch besides counting it."""

    def __init__(self, mode: str, *, sleep_s_per_image: float, work_bytes_per_image: int) -> None:
        self.mode = mode
        self.sleep_s = float(sleep_s_per_image)
        self.work_bytes = int(work_bytes_per_image)
        self._buf = memoryview(np.random.default_rng(0).integers(
            0, 256, _WORK_CHUNK_BYTES, dtype=np.uint8).tobytes())

    def __call__(self, rows: int) -> None:
        if self.mode == "sleep":
            time.sleep(rows * self.sleep_s)
        elif self.mode == "compute":
            left = rows * self.work_bytes
            while left > 0:
                take = min(left, _WORK_CHUNK_BYTES)
                hashlib.sha256(self._buf[:take]).digest()
                left -= take


def _dtype_name(x: Any) -> str:
    d = getattr(x, "dtype", None)
    return str(getattr(d, "name", d)).replace("torch.", "")


def check_batch(images: Any, labels: Any, out_shape: tuple[int, ...]) -> tuple[int, str | None]:
    """(rows, problem or None) of one batch."""
    shape = tuple(int(s) for s in images.shape)
    rows = shape[0]
    if len(labels) != rows:
        return rows, f"{len(labels)} labels for {rows} images"
    if shape[1:] != tuple(out_shape):
        return rows, f"image shape {shape}, expected (n, {', '.join(map(str, out_shape))})"
    if _dtype_name(images) != "uint8":
        return rows, f"image dtype {_dtype_name(images)}, expected uint8"
    return rows, None


def run_cell(peer: Any, k: int, cell: dict[str, Any], spec: dict[str, Any],
             events: Events) -> dict[str, Any]:
    """Build a loader for one cell and run its epochs; returns the raw timings."""
    wl = Workload.from_dict(spec["workloads"][cell["workload"]])
    batch, mode, epochs = int(cell["batch_size"]), cell["mode"], int(spec["epochs"])
    consumer = Consumer(mode, sleep_s_per_image=spec["sleep_s_per_image"],
                        work_bytes_per_image=spec["work_bytes_per_image"])
    out: dict[str, Any] = {**cell, "cell_index": k, "epochs": [], "errors": []}
    t_warm = time.perf_counter()
    out["page_cache_bytes"] = read_through(wl.root)  # untimed: the same start for every peer
    out["page_cache_s"] = time.perf_counter() - t_warm
    events.send(phase=str(k))
    events.send(mark=f"{k}.open")
    t_open = time.perf_counter()
    loader = peer.open(wl, batch_size=batch, cores=spec["cores"], seed=spec["seed"] + k)
    out["setup_s"] = time.perf_counter() - t_open
    out_shape = tuple(getattr(loader, "out_shape", (OUTPUT_SIZE, OUTPUT_SIZE, 3)))
    end = t_open
    try:
        for e in range(epochs):
            t_req = time.perf_counter()
            first = None
            rows = batches = 0
            problems: list[str] = []
            for images, labels in loader.epoch(e):
                if first is None:
                    first = time.perf_counter()
                n, problem = check_batch(images, labels, out_shape)
                if problem is not None and len(problems) < 5:
                    problems.append(f"batch {batches}: {problem}")
                rows += n
                batches += 1
                consumer(n)
            end = time.perf_counter()
            events.send(mark=f"{k}.e{e}.end")
            first = first if first is not None else end
            out["epochs"].append({
                "epoch": e, "rows": rows, "batches": batches, "problems": problems,
                "request_s": t_req - t_open, "first_s": first - t_open, "end_s": end - t_open,
                "ttfb_s": first - t_req})
            events.send(say=f"    epoch {e}: {rows} rows in {end - t_req:.2f} s "
                            f"(first batch {first - t_req:.3f} s)")
    finally:
        extra = getattr(loader, "extra", None)
        try:
            out["extra"] = extra() if extra is not None else {}
        except Exception as exc:  # noqa: BLE001 - extras are informative only
            out["extra"] = {"error": repr(exc)}
        loader.close()
        events.send(mark=f"{k}.close")
        events.send(phase=None)
    return out


def steady(ep: list[dict[str, Any]]) -> float | None:
    """Rows per second over epochs 1..E-1 (None with fewer than two epochs)."""
    if len(ep) < 2:
        return None
    seconds = ep[-1]["end_s"] - ep[0]["end_s"]
    return sum(e["rows"] for e in ep[1:]) / seconds if seconds > 0 else None


def _summary_line(res: dict[str, Any]) -> str:
    ep = res["epochs"]
    rate = steady(ep)
    warm = [e["ttfb_s"] for e in ep[1:]]
    rate_txt = f"{rate:.0f} img/s" if rate else "n/a"
    return (f"  {res['workload']} b{res['batch_size']} {res['mode']}: "
            f"{rate_txt} steady, first batch "
            f"{ep[0]['first_s']:.2f} s cold"
            + (f" / {statistics.median(warm):.3f} s warm" if warm else ""))


def main(spec_path: str, result_path: str, events_fd: int | None) -> int:
    with open(spec_path) as fh:
        spec = json.load(fh)
    events = Events(events_fd)
    result: dict[str, Any] = {"peer": spec["peer"], "pid": os.getpid(), "cells": []}

    def save() -> None:
        tmp = result_path + ".tmp"
        with open(tmp, "w") as fh:
            json.dump(result, fh, default=_json_default)
        os.replace(tmp, result_path)

    t0 = time.perf_counter()
    peer = peer_class(spec["peer"])()
    result["import_s"] = time.perf_counter() - t0
    events.send(phase="start")
    events.send(mark="start.begin")
    result["start"] = peer.start(spec["cores"]) or {}
    events.send(mark="start.end")
    events.send(phase=None)
    save()
    try:
        for k, cell in enumerate(spec["cells"]):
            try:
                res = run_cell(peer, k, cell, spec, events)
                events.send(say=_summary_line(res))
            except Exception:  # noqa: BLE001 - recorded; the next cell still runs
                tb = traceback.format_exc()
                print(tb, file=sys.stderr, flush=True)
                res = {**cell, "epochs": [], "errors": [tb.strip().splitlines()[-1]],
                       "traceback": tb}
                events.send(say=f"  {cell['workload']} b{cell['batch_size']} {cell['mode']}: "
                                f"FAILED {res['errors'][0]}")
            result["cells"].append(res)
            save()
    finally:
        peer.stop()
    return 0


def _json_default(x: Any) -> Any:
    if isinstance(x, np.generic):
        return x.item()
    if isinstance(x, np.ndarray):
        return x.tolist()
    return str(x)


if __name__ == "__main__":
    fd = int(sys.argv[3]) if len(sys.argv) > 3 else None
    sys.exit(main(sys.argv[1], sys.argv[2], fd))
