"""The priority store's snapshots, in one process (the actor's class without Ray): a late
periodic write never replaces a newer snapshot, and a failed one is tried again in time."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from raying.sampling import store_actor as sa

OPTIONS = {"coalesce": "last", "ema": 0.5, "tick_s": 0.05, "storage": None, "restore": True}


@pytest.fixture
def actor(monkeypatch, tmp_path):
    monkeypatch.setattr(sa, "_restarted", lambda: False)
    made = []

    def make(**options):
        a = sa.StoreActor("s", 0, 10, {"alpha": 1.0, "uniform_mix": 0.1},
                          {**OPTIONS, **options}, str(tmp_path / "snap.npz"), {})
        made.append(a)
        return a

    yield make
    for a in made:
        a._stop.set()


def _saved(tmp_path):
    state, _ = sa.decode_snapshot((tmp_path / "snap.npz").read_bytes())
    return state


def test_a_periodic_snapshot_that_waited_does_not_replace_a_newer_one(actor, tmp_path,
                                                                      monkeypatch):
    """The tick captures the table, then waits (descheduled) before it writes; the final
    snapshot_now() captures and writes the newer table meanwhile: the file keeps the newer."""
    real = sa.StoreActor._write
    captured = threading.Event()

    def slow_tick_write(self, *args):
        if threading.current_thread() is not threading.main_thread():
            captured.set()
            time.sleep(0.4)
        real(self, *args)

    monkeypatch.setattr(sa.StoreActor, "_write", slow_tick_write)
    a = actor(snapshot_every_updates=1, snapshot_interval_s=1e9)
    a.update(np.array([1]), np.array([5.0]))
    assert captured.wait(5)  # the tick holds the table with one update
    a._stop.set()
    a.update(np.array([2]), np.array([9.0]))
    done = a.snapshot_now()
    assert done["updates_applied"] == 2
    time.sleep(0.6)  # the tick's late write has come and gone
    state = _saved(tmp_path)
    assert state["counters"]["updates_applied"] == 2 and state["priorities"][2] > 1.0


def test_a_failed_snapshot_is_tried_again_after_the_interval(actor, tmp_path, monkeypatch):
    """The run's last reports: a snapshot that fails is written at a later interval, with no
    new report to prompt it."""
    from raying.storage import files as storage

    real = storage.write_bytes_atomic
    calls = []

    def flaky(fs, path, data):
        calls.append(path)
        if len(calls) == 1:
            raise OSError("503 Slow Down")
        real(fs, path, data)

    monkeypatch.setattr(storage, "write_bytes_atomic", flaky)
    a = actor(snapshot_every_updates=10**9, snapshot_interval_s=0.2)
    a.update(np.array([1]), np.array([5.0]))
    deadline = time.monotonic() + 5
    while not (tmp_path / "snap.npz").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(calls) >= 2 and _saved(tmp_path)["counters"]["updates_applied"] == 1
    stats = a.stats()
    assert stats["counters"]["snapshot_errors"] == 1 and stats["updates_since_snapshot"] == 0


def test_a_storage_that_refuses_snapshots_is_asked_again_at_most_once_a_retry_wait(
        actor, monkeypatch):
    """Snapshots due by count keep failing (an S3 answering 503): a new attempt comes once
    per SNAPSHOT_RETRY_S (or interval), not at every tick."""
    from raying.storage import files as storage

    calls = []

    def refusing(fs, path, data):
        calls.append(time.monotonic())
        raise OSError("503 Slow Down")

    monkeypatch.setattr(storage, "write_bytes_atomic", refusing)
    monkeypatch.setattr(sa, "SNAPSHOT_RETRY_S", 0.3)
    a = actor(snapshot_every_updates=5, snapshot_interval_s=1e9)
    a.update(np.arange(5), np.ones(5))
    deadline = time.monotonic() + 10.0  # ticks of 0.05 s: attempts 0.3 s apart, not 20 a s
    while len(calls) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    a._stop.set()
    assert len(calls) >= 3, len(calls)
    assert all(b - a_ >= 0.25 for a_, b in zip(calls, calls[1:], strict=False)), calls


def test_a_snapshot_of_other_settings_is_refused_in_the_store_user_s_words(monkeypatch,
                                                                          tmp_path):
    from raying.errors import ConfigError

    monkeypatch.setattr(sa, "_restarted", lambda: False)
    path = str(tmp_path / "snap.npz")
    a = sa.StoreActor("s", 0, 10, {"alpha": 1.0, "uniform_mix": 0.1}, OPTIONS, path, {})
    a.update(np.arange(3), np.ones(3))
    a.snapshot_now()
    a._stop.set()
    with pytest.raises(ConfigError, match=r"priority store s: the snapshot at .*snap.npz does "
                                          r"not fit this store \(.*'alpha': 1.0.*\); build the "
                                          r"sampler with the settings .*'restore': False") as e:
        sa.StoreActor("s", 0, 10, {"alpha": 0.5, "uniform_mix": 0.1}, OPTIONS, path, {})
    assert "strict=False" not in str(e.value)
