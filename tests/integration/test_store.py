"""The priority store actor: concurrent reporters, restart from snapshot, exact sharding."""

from __future__ import annotations

import time

import numpy as np
import pytest
import ray

from raying.errors import ConfigError
from raying.sampling import PriorityTable
from raying.sampling import store as st
from tests.unit.sampling.test_table import chi2_pvalue, spanning_priorities

TICK_S = 0.01


@pytest.fixture(scope="module", autouse=True)
def _ray(ray_local):
    """Every test here uses the module's local Ray (see conftest.ray_local)."""
    return ray_local


@ray.remote(num_cpus=0.25)
def _report(store: str | st.StoreHandle, reporter: int, ids: np.ndarray,
            rounds: int) -> list[np.ndarray]:
    """Send `rounds` batches of updates for `ids` and return the values sent, per round."""
    # Reached by name, as a Train worker would, or through a handle passed to the task.
    handle = st.get_store(store) if isinstance(store, str) else store
    rng = np.random.default_rng(reporter)
    sent = []
    for r in range(rounds):
        values = reporter * 1000.0 + r + rng.random(ids.size)  # unique to (reporter, round)
        st.update_async(handle, ids, values)
        sent.append(values)
        if r % 10 == 0:
            st.update_async(handle, [0, handle.n], [np.nan, 1.0])  # two rejected entries
    st.flush(handle)  # the updates of this process have all landed
    return sent


def test_four_reporters_lose_no_update():
    n, rounds = 4000, 40
    rejecting_rounds = len(range(0, rounds, 10))
    handle = st.create_store("four-reporters", n, config={"tick_s": TICK_S})
    rng = np.random.default_rng(0)
    # Each reporter owns 500 ids nobody else touches and shares 1500 with the others.
    own = np.arange(2000).reshape(4, 500)
    shared = np.arange(2000, 3500)
    id_sets = [rng.permutation(np.concatenate([own[r], shared])) for r in range(4)]
    stores = ["four-reporters", handle, "four-reporters", handle]
    sent = ray.get([_report.remote(stores[r], r, id_sets[r], rounds) for r in range(4)])

    final = st.priorities(handle)
    all_ids = np.concatenate([np.tile(ids, rounds) for ids in id_sets])
    all_values = np.concatenate([np.concatenate(values) for values in sent])
    matches = np.bincount(all_ids, weights=all_values == final[all_ids], minlength=n)
    assert np.all(matches[:3500] >= 1)  # every id holds one of the values reported for it
    np.testing.assert_array_equal(final[3500:], 1.0)  # never reported: the initial priority
    for r in range(4):  # ids of one reporter end with that reporter's last value
        order = np.argsort(id_sets[r])
        last = sent[r][-1][order]
        np.testing.assert_array_equal(final[own[r]], last[np.isin(id_sets[r][order], own[r])])

    stats = st.stats(handle)
    assert stats["updates_received"] == 4 * rounds * 2000
    assert stats["updates_applied"] + stats["coalesced"] == stats["updates_received"]
    assert stats["rejected"]["nan"] == 4 * rejecting_rounds
    assert stats["rejected"]["out_of_range"] == 4 * rejecting_rounds
    assert stats["pending"] == 0
    st.kill_store(handle)


def test_killed_store_restarts_from_its_snapshot(tmp_path):
    n, batch, batches, every = 20_000, 500, 40, 3000  # batches touch disjoint ids
    config = {"tick_s": TICK_S, "snapshot_uri": str(tmp_path / "snaps"),
              "snapshot_every_updates": every, "snapshot_interval_s": 3600.0,
              "restore": False}  # only for a new store: a restarted one restores anyway
    handle = st.create_store("restartable", n, config=config)
    plan = [(np.arange(b * batch, (b + 1) * batch) % n, np.full(batch, b + 1.0))
            for b in range(batches)]
    def snapshotted() -> dict:
        # A tick snapshots once `every` updates are unsnapshotted; flush() and stats() apply
        # updates between ticks, so wait for that tick rather than a fixed time (a starved
        # actor applies a whole stream at once, and takes one snapshot of it).
        deadline = time.monotonic() + 30.0
        now = st.stats(handle)
        while now["updates_since_snapshot"] >= every and time.monotonic() < deadline:
            time.sleep(TICK_S)
            now = st.stats(handle)
        return now

    for b, (ids, values) in enumerate(plan):
        st.update_async(handle, ids, values)
        if b % 4 == 3:
            snapshotted()  # as the stream goes: 2,000 updates a group, a snapshot per 3,000
    st.flush(handle)
    before = snapshotted()
    assert before["updates_applied"] == batches * batch
    assert before["snapshots"] >= 3
    assert 0 <= before["updates_since_snapshot"] < every  # the bound on what a crash loses

    ray.kill(handle.actors[0], no_restart=False)  # Ray restarts it; __init__ restores
    deadline = time.monotonic() + 30.0
    after = st.stats(handle)  # the kill is asynchronous: wait for the restarted actor
    while after["restores"] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
        after = st.stats(handle)
    assert after["restores"] == 1 and after["restarts"] == 1
    lost = before["updates_applied"] - after["updates_applied"]
    assert 0 <= lost <= before["updates_since_snapshot"] < every
    # The restored table is exactly the first `restored` updates replayed.
    restored = after["updates_applied"]
    assert restored % batch == 0
    replay = PriorityTable(n)
    for ids, values in plan[: restored // batch]:
        replay.update(ids, values)
    np.testing.assert_array_equal(st.priorities(handle), replay.priorities())

    # It keeps working: updates after the restart land, and a new snapshot is taken.
    st.update_async(handle, [1, 2], [7.0, 8.0])
    assert st.priorities(handle, [1, 2]).tolist() == [7.0, 8.0]
    info = st.snapshot_now(handle)
    assert info[0]["error"] is None and info[0]["path"].endswith("restartable.shard-00000.npz")
    expected = st.priorities(handle)
    st.kill_store(handle)  # snapshots first

    # A new store (a new job) on the same URI starts from the latest snapshot.
    again = st.create_store("restartable", n, config={**config, "restore": True})
    np.testing.assert_array_equal(st.priorities(again), expected)
    assert st.stats(again)["restores"] == 2
    st.kill_store(again, snapshot=False)


def test_a_store_restarted_without_a_snapshot_says_its_priorities_started_again():
    handle = st.create_store("no-snapshots", 1000, config={"tick_s": TICK_S})
    st.update_async(handle, np.arange(10), np.full(10, 5.0))
    st.flush(handle)
    assert st.stats(handle)["restarts"] == 0
    ray.kill(handle.actors[0], no_restart=False)
    deadline = time.monotonic() + 30.0
    after = st.stats(handle)
    while after["restarts"] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
        after = st.stats(handle)
    # Counted (and warned in the store's log), not hidden: the table is the initial one.
    assert after["restarts"] == 1 and after["restores"] == 0
    assert after["updates_applied"] == 0
    st.kill_store(handle, snapshot=False)


@pytest.mark.parametrize("eps", [0.0, 0.1])
def test_sharded_store_samples_exactly_like_one_table(eps):
    n = 1000
    table_cfg = {"alpha": 0.7, "uniform_mix": eps, "seed": 5}
    handle = st.create_store(f"sharded-{eps}", n, table=table_cfg,
                             config={"tick_s": TICK_S, "shard_rows": 300})
    assert len(handle.actors) == 4 and handle.bounds == (0, 300, 600, 900, 1000)
    p = np.tile(spanning_priorities(100, seed=2), 10)
    p[300:600] = 0.0  # a whole shard of zero weight
    p[[0, 299, 600, 899, 900]] = 0.0
    single = PriorityTable(n, **table_cfg)
    single.update(np.arange(n), p)
    st.update_async(handle, np.arange(n), p)

    plan = st.sample_plan(handle, 4096)
    np.testing.assert_allclose(plan.probs, single.probabilities(plan.ids), rtol=1e-12, atol=0)
    assert plan.size == n and plan.min_prob == pytest.approx(single.min_probability(), rel=1e-12)
    np.testing.assert_allclose(plan.weights(0.5), single.weights(plan.probs, 0.5), rtol=1e-12)

    counts = np.bincount(plan.ids, minlength=n)
    for _ in range(48):  # >= 200k draws in plans of 4096
        counts += np.bincount(st.sample_plan(handle, 4096).ids, minlength=n)
    expected = single.probabilities()
    live = expected > 0
    assert np.all(counts[~live] == 0)
    assert chi2_pvalue(counts[live], expected[live] / expected[live].sum()) > 1e-3
    assert chi2_pvalue(counts[live], np.roll(expected[live], 1) / expected[live].sum()) < 1e-9

    systematic = st.sample_plan(handle, 4096, systematic=True)
    counts = np.bincount(systematic.ids, minlength=n)
    assert np.all(counts >= np.floor(4096 * expected - 1e-6))
    assert np.all(counts <= np.ceil(4096 * expected + 1e-6))

    stats = st.stats(handle)
    assert stats["shards"] == 4 and stats["updates_applied"] == n
    assert stats["total"] == pytest.approx(single.total(), rel=1e-12)
    assert stats["ess"] == pytest.approx(single.ess(), rel=1e-9)
    st.kill_store(handle)


def test_single_store_plan_matches_its_table_and_reaches_by_name():
    handle = st.create_store("plain", 64, table={"alpha": 0.5, "uniform_mix": 0.2},
                             config={"tick_s": TICK_S, "coalesce": "max"})
    p = spanning_priorities(64, seed=3)
    st.update_async(handle, np.arange(64), p)
    st.update_async(handle, np.arange(64), p / 2)  # max coalescing keeps the larger
    plan = st.sample_plan(st.get_store("plain"), 8192)
    reference = PriorityTable(64, alpha=0.5, uniform_mix=0.2)
    reference.update(np.arange(64), p)
    np.testing.assert_allclose(plan.probs, reference.probabilities(plan.ids), rtol=1e-12)
    with pytest.raises(ConfigError, match="a priority store named 'plain' already exists"):
        st.create_store("plain", 64)
    st.kill_store(handle)
    with pytest.raises(ConfigError, match="no priority store named 'missing'"):
        st.get_store("missing")


def test_reporter_sends_on_its_timer_and_never_truncates_float_ids():
    from raying.sampling.feedback import Reporter

    handle = st.create_store("timer", 16, config={"tick_s": TICK_S})
    try:
        rep = Reporter(handle, flush_ids=1_000_000, flush_s=0.05)
        rep.add(np.array([1.0, 2.0, 3.5]), np.array([4.0, 5.0, 6.0]))  # 3.5 is no id
        deadline = time.monotonic() + 10
        while rep.sends == 0 and time.monotonic() < deadline:  # no further add: the timer
            time.sleep(0.02)
        assert rep.sends == 1
        st.flush(handle)
        got = st.stats(handle)
        assert got["rejected"].get("not_integer") == 1, got
        pri = st.priorities(handle, np.array([1, 2, 3]))
        assert pri[0] == 4.0 and pri[1] == 5.0 and pri[2] != 6.0, pri
    finally:
        st.kill_store(handle)


def test_reporter_takes_bfloat16_losses_and_refuses_bool_or_text_ids():
    import torch

    from raying.sampling.feedback import Reporter

    handle = st.create_store("dtypes", 8, config={"tick_s": TICK_S})
    try:
        rep = Reporter(handle, flush_ids=1)
        rep.add(torch.tensor([1, 2]), torch.tensor([3.0, 0.5], dtype=torch.bfloat16))
        st.flush(handle)
        assert st.priorities(handle, np.array([1, 2])).tolist() == [3.0, 0.5]
        for ids in (torch.tensor([True, False]), np.array([True]), ["a", "b"]):
            with pytest.raises(ConfigError, match="ids must be integers"):
                rep.add(ids, [1.0] * len(ids))
        # Numbers numpy would make of text or bytes, a complex loss, None: all refused.
        for losses in (["high"], np.array(["5.0"]), [b"1"], np.array([1 + 2j]), [None],
                       [True], torch.tensor([1 + 2j])):
            with pytest.raises(ConfigError, match="losses must be real numbers"):
                rep.add([1], losses)
        for loss in (torch.tensor(0.7), np.float32(0.7), 0.7):  # reduction="mean"
            with pytest.raises(ConfigError, match="one loss for 2 ids, a reduced"):
                rep.add(torch.tensor([1, 2]), loss)
        # Per-token losses of a (B, T) loss with reduction='none': refused at the call.
        for losses in (torch.ones(2, 5), np.ones((2, 3, 4)), [[1.0, 2.0]] * 2):
            with pytest.raises(ConfigError, match=r"one loss per sample expected, got losses "
                                                  r"of shape \(2, \d+(, 4)?\) for 2 ids"):
                rep.add(torch.tensor([1, 2]), losses)
        # Losses as many as the ids but laid out otherwise: they would pair up by accident.
        for ids, losses in (([1, 2, 3, 4], torch.ones(2, 2)),
                            ([1, 2, 3, 4, 5, 6], np.ones((3, 2)))):
            with pytest.raises(ConfigError, match=rf"losses of shape \(\d, 2\) for "
                                                  rf"{len(ids)} ids; pass one loss per id"):
                rep.add(ids, losses)
        rep.add(torch.tensor([1, 2]), torch.ones(2, 1))  # (B, 1): one loss per sample
        rep.add(torch.tensor([[1, 2], [3, 4]]), torch.ones(2, 2))  # shaped as their ids
        rep.add(torch.tensor([1, 2]), torch.ones(1, 2))  # (1, B)
        rep.add([3], [2])  # an integer loss is a number
        st.flush(handle)
        assert st.priorities(handle, np.array([3])).tolist() == [2.0]
        assert st.stats(handle)["updates_received"] == 11  # nothing of the refused reached it
        # TensorFlow's bfloat16 (mixed_bfloat16), as a tensor and as the numpy array its
        # numpy() gives (ml_dtypes, a dtype numpy has no kind for).
        tf = pytest.importorskip("tensorflow")
        rep.add(tf.constant([4, 5]), tf.constant([1.5, 0.25], dtype=tf.bfloat16))
        rep.add(np.array([6]), tf.constant([0.75], dtype=tf.bfloat16).numpy())
        st.flush(handle)
        assert st.priorities(handle, np.array([4, 5, 6])).tolist() == [1.5, 0.25, 0.75]
    finally:
        st.kill_store(handle)


@ray.remote(num_cpus=0)
class _RestartProbe:
    def restarted(self) -> tuple[bool, list[str]]:
        import warnings

        from raying.sampling.store_actor import _restarted

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            value = _restarted()
        return value, [str(w.message) for w in caught]


def test_a_store_asks_whether_it_restarted_without_a_warning_on_the_console():
    # Ray's answer reads its own deprecated actor_id; its warning would reach the driver's
    # console from every prioritized pipeline's store.
    probe = _RestartProbe.remote()
    assert ray.get(probe.restarted.remote()) == (False, [])
    ray.kill(probe)
