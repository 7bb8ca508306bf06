"""Fault injection: worker kills, node loss, store kill, S3 restart, trainer kill and resume.

CI runs the tests not marked slow; ``make test-faults`` runs them all.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import raying
from raying.options import StorageOptions
from raying.tools.datagen import make_image_folder

ROOT = Path(__file__).resolve().parents[2]
# An HDD-like tier, one request at a time, makes an epoch last long enough to kill things in.
SLOW = (0.01, 50e6, 1)


def _read_task_pids() -> list[int]:
    """Processes of Ray workers currently running a raying read task."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cmd = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:
            continue
        if cmd.startswith(b"ray::read_task"):
            pids.append(int(entry))
    return pids


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_image_folder(tmp_path_factory.mktemp("faults"), n=400, classes=4,
                             size=(32, 32), seed=5)


def _slow_manifest(folder):
    m = raying.Manifest.scan(str(folder))
    m.storage = StorageOptions(slow=SLOW)
    return m


@pytest.fixture
def ray_fresh():
    import ray

    if ray.is_initialized():
        ray.shutdown()
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


@pytest.mark.parametrize("cached", [False, True], ids=["direct", "tiered-cache"])
def test_uniform_epoch_survives_five_worker_kills(folder, ray_fresh, tmp_path, cached):
    from raying.options import CacheConfig, IOConfig

    m = _slow_manifest(folder)
    # With the cache, killed workers also leave claims on the files they were fetching
    # (single flight): the others must see them void and fetch those files themselves.
    io = (IOConfig(cache=CacheConfig(memory_bytes=10**8, memory_dir=str(tmp_path / "mem")))
          if cached else None)
    pipe = raying.Pipeline(m, transform=raying.ImageTransform(size=16),
                           config=raying.PipelineConfig(block_rows=20, io=io,
                                                        decoded_cache="off"))
    killed: list[int] = []
    stop = threading.Event()

    def killer():
        while len(killed) < 5 and not stop.is_set():
            time.sleep(0.3)
            for pid in _read_task_pids()[:1]:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                    killed.append(pid)

    t = threading.Thread(target=killer, daemon=True)
    t.start()
    ids = [i for b in pipe.iter_batches(batch_size=32, epoch=0) for i in b["id"].tolist()]
    stop.set()
    t.join()
    assert len(killed) == 5, f"only {len(killed)} kills landed; make the epoch longer"
    assert len(ids) == 400 and sorted(ids) == list(range(400)), "each id exactly once"
    if cached:  # a second epoch is served by the tier; no live claim is left behind
        from raying.read.cache.dirtier import DirTier
        from raying.read.cache.inflight import _alive

        again = [i for b in pipe.iter_batches(batch_size=32, epoch=1) for i in b["id"].tolist()]
        assert sorted(again) == list(range(400))
        st = pipe.stats(sampling=False)["io"]
        assert st["cache_hits_memory"] > 0
        pipe.close()  # no read in flight any more: live owners release once their writes land
        tier = DirTier(str(tmp_path / "mem"), 10**8)
        deadline = time.monotonic() + 30
        while True:
            with tier._lock:
                pids = [pid for (pid,) in tier._db().execute("SELECT pid FROM inflight")]
            if not [p for p in pids if _alive(p)] or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert not [p for p in pids if _alive(p)], "claims of live owners were all released"
        assert len(pids) <= 5 * 20, "only killed workers' (void) claims may remain"
    pipe.close()


def test_retried_read_tasks_yield_the_same_pixels_through_a_seeded_stage(folder, ray_fresh):
    def slow_jitter(batch, rng):  # built here so that Ray ships it by value
        time.sleep(0.1)  # a heavy augmentation: kills land while it runs
        shift = rng.integers(-30, 31, size=(len(batch["id"]), 1, 1, 3))
        batch["image"] = np.clip(batch["image"].astype(np.int16) + shift, 0,
                                 255).astype(np.uint8)
        return batch

    def run(kills: int) -> tuple[dict[int, np.ndarray], int]:
        pipe = raying.Pipeline(_slow_manifest(folder), transform=raying.ImageTransform(size=16),
                               sampler=raying.UniformSampler(seed=7),
                               config=raying.PipelineConfig(block_rows=20,
                                                            decoded_cache="off"))
        pipe = pipe.map_batches(slow_jitter, with_rng=True)
        killed: list[int] = []
        stop = threading.Event()

        def killer():
            while len(killed) < kills and not stop.is_set():
                time.sleep(0.3)
                for pid in _read_task_pids()[:1]:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                        killed.append(pid)

        t = threading.Thread(target=killer, daemon=True)
        t.start()
        images = {int(i): img for b in pipe.iter_batches(batch_size=32, epoch=0)
                  for i, img in zip(b["id"], b["image"], strict=True)}
        stop.set()
        t.join()
        pipe.close()
        return images, len(killed)

    reference, _ = run(kills=0)
    retried, killed = run(kills=3)
    assert killed == 3, f"only {killed} kills landed; make the epoch longer"
    assert sorted(retried) == sorted(reference) == list(range(400)), "each id exactly once"
    same = [i for i in range(400) if np.array_equal(retried[i], reference[i])]
    assert len(same) == 400, f"{400 - len(same)} images differ after retries"


@pytest.mark.slow
def test_node_removed_mid_epoch_loses_nothing(folder):
    import ray
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        ray.shutdown()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    nodes = [cluster.add_node(num_cpus=1) for _ in range(2)]
    try:
        ray.init(address=cluster.address, log_to_driver=False)
        cluster.wait_for_nodes()
        m = _slow_manifest(folder)
        pipe = raying.Pipeline(m, transform=raying.ImageTransform(size=16),
                               config=raying.PipelineConfig(block_rows=20, spread=True))
        ids = []
        removed = False
        for i, b in enumerate(pipe.iter_batches(batch_size=20, epoch=0)):
            ids.extend(b["id"].tolist())
            if i == 3 and not removed:
                cluster.remove_node(nodes[1])
                cluster.add_node(num_cpus=1)  # capacity comes back, as an autoscaler would do
                removed = True
        counts = np.bincount(ids, minlength=400)
        assert removed and (counts >= 1).all(), "the epoch completes with every id"
        duplicates = int((counts - 1).sum())
        print(f"node removal: {len(ids)} rows, {duplicates} duplicates")
        assert duplicates == 0, "plan-ordered delivery repeats nothing after a node loss"
        pipe.close()
    finally:
        ray.shutdown()
        cluster.shutdown()


def test_store_killed_mid_epoch_restores_from_snapshot(folder, ray_fresh, tmp_path):
    from raying.sampling import store as st

    m = raying.Manifest.scan(str(folder))
    snap = str(tmp_path / "priorities.snap")
    s = raying.PrioritizedSampler(seed=1, samples_per_epoch=400,
                                  store={"snapshot_uri": snap, "snapshot_every_updates": 100,
                                         "snapshot_interval_s": 3600})
    pipe = raying.Pipeline(m, transform=raying.ImageTransform(size=16), sampler=s,
                           config=raying.PipelineConfig(block_rows=40))
    rows = 0
    for i, b in enumerate(pipe.iter_batches(batch_size=40, epoch=0)):
        rows += len(b["id"])
        pipe.report(b["id"], np.full(len(b["id"]), float(i + 1)))
        if i == 5:
            s.flush()
            st.flush(s.handle)
            # flush() applies updates between ticks, so the first snapshot may hold fewer
            # than the 240 applied: wait for the tick that snapshots the rest (due once 100
            # are unsnapshotted), so that what is at risk below is the 40 reported after it.
            deadline = time.time() + 10
            while time.time() < deadline:
                now = st.stats(s.handle)
                if now["snapshots"] >= 1 and now["updates_since_snapshot"] < 100:
                    break
                time.sleep(0.05)
            s.report(b["id"], np.full(len(b["id"]), 99.0))  # after the snapshot: at risk
            s.flush()
            st.flush(s.handle)
            before = st.stats(s.handle)
            ray_fresh.kill(s.handle.actors[0], no_restart=False)
            # The kill is asynchronous: wait for the restarted store before reporting more,
            # or a snapshot the dying store takes of later reports would be restored.
            deadline = time.time() + 90  # a restart spawns a worker: slow on a loaded machine
            after = st.stats(s.handle)
            while after["restores"] < 1 and time.time() < deadline:
                time.sleep(0.1)
                after = st.stats(s.handle)
    assert rows == 400, "the epoch completes across the store restart"
    assert before["snapshots"] >= 1 and after["restores"] >= 1, (before, after)
    lost = before["updates_applied"] - after["restored_updates"]
    # Loss is bounded by the updates applied since the last snapshot (< every_updates + a tick).
    assert 0 <= lost <= before["updates_since_snapshot"] < 100 + 40, (lost, before)
    pipe.close()


def test_s3_restarted_mid_read_loses_nothing(folder, monkeypatch):
    import ray

    from tests.s3server import start_s3_server

    with start_s3_server() as server:
        uri = server.upload_folder(folder, "faults", "imgs")
        server.snapshot()  # now, so that the restart below goes down at once, mid-epoch
        if ray.is_initialized():
            ray.shutdown()
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
        try:
            m = raying.Manifest.scan(uri, storage=server.storage_options)
            # raying's own attempts (5, each after the SDK's 5 quick ones) with a backoff of
            # 1 s doubling, up to 5 s: ~16 s to outlast the restart (the new server loads
            # every object before it answers: ~3 s here, more on a loaded machine). More
            # attempts would raise the SDK's too, which would then ride out the outage alone,
            # and raying's retries, the path under test, would not run.
            monkeypatch.setenv("RAYING_READ_RETRY_BACKOFF_S", "1.0")
            pipe = raying.Pipeline(m, transform=raying.ImageTransform(size=16),
                                   config=raying.PipelineConfig(block_rows=20, window=2))
            ids = []
            restart = threading.Thread(target=server.restart,
                                       kwargs={"down_s": 1.0, "snapshot": False}, daemon=True)
            for i, b in enumerate(pipe.iter_batches(batch_size=20, epoch=0,
                                                    prefetch_batches=1)):
                ids.extend(b["id"].tolist())
                if i == 2:
                    restart.start()
            restart.join()
            assert sorted(ids) == list(range(400)), "every id once, none lost to the outage"
            st = pipe.stats(sampling=False)
            assert st["skipped_count"] == 0
            assert st["read_retries"] > 0, "the reads met the outage"
            print(f"S3 restart: {len(ids)} rows, {st['read_retries']} reads retried")
            pipe.close()
        finally:
            ray.shutdown()


TRAINER = r"""
import json, os, sys, numpy as np, raying
folder, out, kill_after = sys.argv[1], sys.argv[2], int(sys.argv[3])
m = raying.Manifest.scan(folder)
pipe = raying.Pipeline(m, transform=raying.ImageTransform(size=16),
                       sampler=raying.UniformSampler(seed=11),
                       config=raying.PipelineConfig(block_rows=24))
state_path = os.path.join(out, "state.json")
start_epoch = 0
if os.path.exists(state_path):
    state = json.load(open(state_path))
    pipe.load_state_dict(state)
    start_epoch = state["epoch"]
log = open(os.path.join(out, "ids.log"), "a")
n = 0
for b in pipe.iter_batches(batch_size=16, epoch=start_epoch):
    log.write(" ".join(map(str, b["id"].tolist())) + "\n"); log.flush()
    state = pipe.state_dict()
    tmp = state_path + ".tmp"
    json.dump(state, open(tmp, "w")); os.replace(tmp, state_path)   # after the step: durable
    n += 1
    if n == kill_after:
        os.kill(os.getpid(), 9)     # the trainer dies mid-epoch
print("done")
"""


def test_trainer_killed_and_resumed_repeats_and_skips_nothing(folder, tmp_path):
    script = tmp_path / "trainer.py"
    script.write_text(TRAINER)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("RAY_ADDRESS", None)
    first = subprocess.run([sys.executable, str(script), str(folder), str(tmp_path), "7"],
                           env=env, capture_output=True, text=True, timeout=300)
    assert first.returncode == -9, first.stderr[-2000:]
    second = subprocess.run([sys.executable, str(script), str(folder), str(tmp_path), "0"],
                            env=env, capture_output=True, text=True, timeout=300)
    assert second.returncode == 0 and "done" in second.stdout, second.stderr[-2000:]
    lines = (tmp_path / "ids.log").read_text().split("\n")
    ids = [int(x) for line in lines for x in line.split()]
    assert sorted(ids) == list(range(400)), "no id repeated or skipped across the kill"
    # The state written after the epoch's last batch is the next epoch's start: a trainer
    # killed right then resumes at epoch 1, not in an empty pass over epoch 0.
    last = json.loads((tmp_path / "state.json").read_text())
    assert (last["epoch"], last["unit"], last["row"], last["delivered"]) == (1, 0, 0, 0)
