"""The local Ray raying starts: its workers import the read path as they start, and its
raylet deletes objects out of scope at once."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

CHECK = """
import sys, time
from raying.engine.ray_setup import ensure_ray
import ray
ensure_ray()
# Ray's serialization context made by the start, before this driver's first serialization.
print("driver serializer", len(ray._private.worker.global_worker.serialization_context_map))
@ray.remote
def modules():
    import sys
    preload = sys.modules.get("raying.engine.preload")
    return [m in sys.modules for m in ("raying.engine.preload", "raying.read.task", "pyarrow")
            ] + [getattr(preload, "SERIALIZER_READY", None)]
@ray.remote
def blas_threads():
    import ctypes, glob, os, numpy
    libs = glob.glob(os.path.join(os.path.dirname(numpy.__file__), "..", "numpy.libs",
                                  "libscipy_openblas*"))
    if not libs:
        return None
    lib = ctypes.CDLL(libs[0])
    return lib.scipy_openblas_get_num_threads64_()
print("blas", ray.get(blas_threads.remote()))
# The node's raylet deletes objects out of scope at once, not in a batch a second later.
config = ray._private.worker._global_node._ray_params._system_config
print("free period", config.get("free_objects_period_milliseconds"))
print(ray.get(modules.remote()))
ray.shutdown()
"""


@pytest.mark.parametrize(("preload", "expected"), [("1", "[True, True, True, True]"),
                                                   ("0", "[False, False")])
def test_a_ray_raying_starts_preloads_the_read_path_in_its_workers(preload, expected):
    env = {k: v for k, v in os.environ.items()
           if k not in ("RAY_ADDRESS", "RAY_preload_python_modules",
                        "RAY_free_objects_period_milliseconds")}
    env["RAYING_PRELOAD_WORKERS"] = preload
    env.pop("OPENBLAS_NUM_THREADS", None)
    out = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True,
                         env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    assert lines[-1].startswith(expected), out.stdout[-2000:]
    # numpy's BLAS on one thread in a read worker, preloaded or not (not one per core: the
    # node's workers would oversubscribe it), as when numpy is imported inside the task.
    blas = next(ln for ln in lines if ln.startswith("blas"))
    assert blas in ("blas 1", "blas None"), out.stdout[-2000:]
    # The start made the driver's serialization context (a preloaded worker made its own as
    # it started: SERIALIZER_READY above).
    assert "driver serializer 1" in lines, out.stdout[-2000:]
    assert "free period 0" in lines, out.stdout[-2000:]


def _folder(root, per_class: int, side: int) -> str:
    """Two class folders of small JPEGs for the scripts below."""
    import numpy as np
    from PIL import Image

    for c in ("a", "b"):
        (root / c).mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            Image.fromarray(np.full((side, side, 3), i, np.uint8)).save(root / c / f"{i}.jpg")
    return str(root)


TRAIN_STATE_API = """
import logging, sys
import ray
import raying, raying.train
from raying.engine.ray_setup import ensure_ray
root = sys.argv[1]
logging.basicConfig(level=logging.WARNING, stream=sys.stdout)
if sys.argv[2] == "read-first":
    ensure_ray()  # a driver that read with raying before it built the trainer
pipe = raying.Pipeline(raying.Manifest.scan(root))
raying.train.datasets(pipe, epochs=1)
try:
    ray.util.state.list_nodes(address=ray.get_runtime_context().gcs_address)
    print("state api: up")
except ray.util.state.exception.RayStateApiException:
    print("state api: down")
ray.shutdown()
"""


@pytest.mark.parametrize(("first", "state_api", "warned"), [("train", "up", False),
                                                            ("read-first", "down", True)])
def test_a_ray_raying_starts_for_ray_train_serves_the_state_api(tmp_path, first, state_api,
                                                                 warned):
    # Ray Train's placement-group cleaner asks the State API each second whether the
    # trainer's controller lives, and logs a warning each time it cannot: a Ray started by
    # raying.train.datasets() runs the dashboard that serves it; one started earlier without
    # it gets raying's warning, once, saying how to start Ray instead.
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    out = subprocess.run([sys.executable, "-c", TRAIN_STATE_API, _folder(tmp_path, 2, 8), first],
                         capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"state api: {state_api}" in out.stdout, out.stdout[-2000:]
    said = out.stdout.count("runs without its dashboard")
    assert said == (1 if warned else 0), out.stdout[-2000:]


RESTART = """
import sys
import ray
import raying
import raying.sampling.feedback, raying.sampling.store
root = sys.argv[1]
make = lambda: raying.Pipeline(raying.Manifest.scan(root), transform=raying.ImageTransform(size=16))
pipe = make()
print("epoch 0:", sum(len(b["id"]) for b in pipe.iter_batches(batch_size=16, epoch=0)))
prio_of = lambda: raying.Pipeline(
    raying.Manifest.scan(root), transform=raying.ImageTransform(size=16),
    sampler=raying.PrioritizedSampler(seed=0), config=raying.PipelineConfig(name="restarted"))
prio = prio_of()
print("prioritized:", sum(len(b["id"]) for b in prio.iter_batches(batch_size=16, epoch=0)))
prio.report([1, 2], [1.0, 2.0])  # buffered in its reporter
raying.report([3], [3.0], store=prio.store_name)  # a Train worker's way, by the store's name
# A prioritized pipeline closed before the shutdown keeps what its store said last.
early = raying.Pipeline(raying.Manifest.scan(root), transform=raying.ImageTransform(size=16),
                        sampler=raying.PrioritizedSampler(seed=1))
next(early.iter_batches(batch_size=16, epoch=0))
early.close()
# An iteration begun before the shutdown, one small unit read of many.
begun = raying.Pipeline(raying.Manifest.scan(root), transform=raying.ImageTransform(size=16),
                        config=raying.PipelineConfig(block_rows=4, window=2))
it = begun.iter_batches(batch_size=4, epoch=0, prefetch_batches=0)
next(it)
# A prioritized one whose reader thread (prefetch) waits on a read when the session ends.
prio_begun = raying.Pipeline(raying.Manifest.scan(root), transform=raying.ImageTransform(size=16),
                             sampler=raying.PrioritizedSampler(seed=2),
                             config=raying.PipelineConfig(block_rows=4, window=2))
pit = prio_begun.iter_batches(batch_size=4, epoch=0)
next(pit)
ray.shutdown()  # the next epoch's first reads were already submitted (keep_warm)
if sys.argv[2] == "again":
    ray.init(address="local", include_dashboard=False)
try:
    next(iter(pipe.iter_batches(batch_size=16, epoch=1)))
except raying.ConfigError as exc:
    print("refused:", exc)
try:
    print("begun drained:", sum(len(b["id"]) for b in it))
except raying.ConfigError as exc:
    print("begun refused:", "session that has ended" in str(exc))
begun.close()
try:  # Ray's core raised SystemExit(0) in the reader: the script ended as if done
    print("prio begun drained:", sum(len(b["id"]) for b in pit))
except raying.ConfigError as exc:
    print("prio begun refused:", "session that has ended" in str(exc))
prio_begun.close()
# The prioritized pipeline's store went with the session: refused, no Ray started for it.
calls = {"stats": prio.stats, "state_dict": prio.state_dict, "dataset": lambda: prio.dataset(1),
         "priorities": prio.priorities, "report": lambda: prio.report([1], [1.0])}
for what, call in calls.items():
    try:
        call()
        print(what, "answered")
    except raying.ConfigError as exc:
        print(what, "refused:", "session that has ended" in str(exc), "ray up:", ray.is_initialized())
print("own stats rows:", prio.stats(sampling=False)["rows_delivered"])
print("closed before:", early.stats()["sampling"].get("store_closed"), "ray up:",
      ray.is_initialized())
pipe.close()
prio.close()  # its store went with the old session: nothing to flush or stop there
print("closed after:", prio.stats()["sampling"]["sampler"], "ray up:", ray.is_initialized())
print("stats rows:", pipe.stats()["rows_delivered"], "ray up:", ray.is_initialized())
pipe = make()
print("new pipeline:", sum(len(b["id"]) for b in pipe.iter_batches(batch_size=16, epoch=1)))
pipe.close()
if sys.argv[2] == "again":  # a new store under the same name gets the reports sent by name
    prio = prio_of()
    raying.report([4, 5], [4.0, 5.0], store=prio.store_name)
    raying.sampling.feedback.flush_all()
    raying.sampling.store.flush(prio.sampler.handle)
    print("new store received:", prio.stats()["sampling"]["updates_received"])
    prio.close()
ray.shutdown()
"""


@pytest.mark.parametrize("restart", ["again", "down"])
def test_a_pipeline_whose_ray_was_shut_down_says_so_and_a_new_one_works(tmp_path, restart):
    # Iterating a pipeline over the object references of an ended Ray session aborted the
    # process in Ray's core (a C++ check: no Python error to catch).
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    out = subprocess.run([sys.executable, "-c", RESTART, _folder(tmp_path, 40, 24), restart],
                         capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, (out.stdout[-2000:], out.stderr[-3000:])
    since = "ray.shutdown() and ray.init() since" if restart == "again" else "ray.shutdown() since"
    assert "refused: Pipeline" in out.stdout and since in out.stdout, out.stdout[-2000:]
    # Closing them started no Ray of its own (a Ray call after shutdown starts one).
    up = "True" if restart == "again" else "False"
    assert f"stats rows: 80 ray up: {up}" in out.stdout, out.stdout[-2000:]
    assert "new pipeline: 80" in out.stdout, out.stdout[-2000:]
    # An iteration begun before the shutdown is refused by name, not by Ray's internals.
    assert "begun refused: True" in out.stdout, out.stdout[-2000:]
    assert "prio begun refused: True" in out.stdout, out.stdout[-2000:]
    # The old prioritized pipeline refuses what needs its store, starting no Ray for it;
    # what this process counted it still gives.
    for what in ("stats", "state_dict", "dataset", "priorities", "report"):
        assert f"{what} refused: True ray up: {up}" in out.stdout, out.stdout[-2000:]
    assert "own stats rows: 80" in out.stdout, out.stdout[-2000:]
    # Once closed (before or after the shutdown), stats() answers from what it kept.
    assert f"closed before: True ray up: {up}" in out.stdout, out.stdout[-2000:]
    assert f"closed after: prioritized ray up: {up}" in out.stdout, out.stdout[-2000:]
    if restart == "again":
        assert "new store received: 2" in out.stdout, out.stdout[-2000:]
