"""Mid-epoch resume: a pipeline restored from state_dict continues with no repeat, no skip."""

from __future__ import annotations

import contextlib
import copy
import itertools

import numpy as np
import pytest

import raying
from tests.helpers_state import assert_same


@pytest.fixture(scope="module")
def manifest(image_folder):
    return raying.Manifest.scan(str(image_folder))


def _make(manifest, sampler=None):
    return lambda: raying.Pipeline(manifest, transform=raying.ImageTransform(size=16),
                                   sampler=sampler() if sampler else raying.UniformSampler(seed=9),
                                   config=raying.PipelineConfig(block_rows=16))


@pytest.mark.parametrize("batches", [1, 3, 8])
def test_uniform_resume_roundtrip(manifest, ray_local, batches):
    make = _make(manifest)
    a = make()
    it = a.iter_batches(batch_size=7, epoch=1, prefetch_batches=2)
    seen = [b["id"] for b in itertools.islice(it, batches)]
    it.close()
    state = copy.deepcopy(a.state_dict())
    assert state["delivered"] == 7 * batches
    b = make()
    b.load_state_dict(copy.deepcopy(state))
    assert_same(state, b.state_dict(), "state right after load")
    rest_b = [x["id"] for x in b.iter_batches(batch_size=7, epoch=1)]
    a.load_state_dict(state)  # the original resumes from its own state just the same
    rest_a = [x["id"] for x in a.iter_batches(batch_size=7, epoch=1)]
    assert_same(rest_a, rest_b, "continuation")
    ids = np.concatenate(seen + rest_b)
    assert sorted(ids.tolist()) == list(range(60))
    # The epoch delivered to its end: the position moved on to the next epoch's start.
    assert (b.state_dict()["epoch"], b.state_dict()["unit"]) == (2, 0), "the position moved on"


def _loaded_mid_epoch(make, prefetch_batches=None):
    """The ids of 3 batches of 8 of epoch 2, and a new pipeline that loaded the state after."""
    a = make()
    it = a.iter_batches(batch_size=8, epoch=2, prefetch_batches=prefetch_batches)
    first = np.concatenate([next(it)["id"] for _ in range(3)])
    state = a.state_dict()
    it.close()
    a.close()
    b = make()
    b.load_state_dict(state)
    return first, b


def _rest_completes_the_epoch(make, state, seen, *, epoch):
    """A new pipeline loaded with ``state`` reads the rest of ``epoch``: with the ids
    ``seen`` before it, each of the 60 once."""
    b = make()
    b.load_state_dict(state)
    rest = np.concatenate([x["id"] for x in b.iter_batches(batch_size=4, epoch=epoch)])
    assert sorted(np.concatenate([seen, rest]).tolist()) == list(range(60))
    b.close()


def test_resume_delivers_each_id_exactly_once(manifest, ray_local):
    make = _make(manifest)
    first, b = _loaded_mid_epoch(make)
    rest = np.concatenate([x["id"] for x in b.iter_batches(batch_size=8, epoch=2)])
    both = np.concatenate([first, rest])
    assert len(both) == 60 and sorted(both.tolist()) == list(range(60))
    full = np.concatenate([x["id"] for x in make().iter_batches(batch_size=8, epoch=2)])
    assert np.array_equal(both, full), "the resumed epoch is the same epoch, in the same order"


def test_state_from_another_dataset_is_refused(manifest, image_folder, tmp_path, ray_local):
    from raying.tools.datagen import make_image_folder

    other = raying.Manifest.scan(str(make_image_folder(tmp_path, n=6, classes=2, size=(8, 8))))
    state = _make(manifest)().state_dict()
    with pytest.raises(raying.ConfigError, match="different dataset"):
        raying.Pipeline(other).load_state_dict(state)


def test_prioritized_resume_keeps_priorities_and_count(manifest, ray_local):
    def sampler():
        return raying.PrioritizedSampler(alpha=1.0, uniform_mix=0.0, seed=4,
                                          samples_per_epoch=100)

    a = _make(manifest, sampler)()
    a.report(np.arange(60), np.where(np.arange(60) < 10, 5.0, 0.0))
    it = a.iter_batches(batch_size=10, epoch=0, prefetch_batches=0)
    first = [next(it)["id"] for _ in range(3)]
    state = a.state_dict()
    it.close()
    a.close()
    b = raying.Pipeline(manifest, transform=raying.ImageTransform(size=16), sampler=sampler(),
                        config=raying.PipelineConfig(block_rows=16, name="resumed"))
    b.load_state_dict(state)
    rest = np.concatenate([x["id"] for x in b.iter_batches(batch_size=10, epoch=0)])
    assert sum(len(f) for f in first) + len(rest) == 100
    assert (rest < 10).all(), "the restored priorities (only ids 0-9 > 0) drive the rest"
    b.close()


@pytest.mark.parametrize("batches", [1, 2, 5])
def test_parquet_resume_inside_a_multi_block_unit(image_folder, tmp_path_factory, ray_local,
                                                  batches):
    dst = tmp_path_factory.mktemp("packed-resume")
    raying.pack(str(image_folder), str(dst), row_group_rows=8, progress=False)
    m = raying.Manifest.scan(str(dst), label="label")

    def make():
        return raying.Pipeline(m, transform=raying.ImageTransform(size=16),
                               sampler=raying.UniformSampler(seed=2),
                               config=raying.PipelineConfig(block_rows=10))

    assert make().block_rows() == 10
    full = np.concatenate([b["id"] for b in make().iter_batches(batch_size=7, epoch=3)])
    a = make()
    it = a.iter_batches(batch_size=7, epoch=3, prefetch_batches=0)
    first = [next(it)["id"] for _ in range(batches)]
    state = a.state_dict()
    it.close()
    b = make()
    b.load_state_dict(state)
    rest = [x["id"] for x in b.iter_batches(batch_size=7, epoch=3)]
    assert np.array_equal(np.concatenate(first + rest), full)


@pytest.mark.parametrize("drop_last", [False, True])
def test_a_state_taken_after_a_whole_epoch_resumes_at_the_next(manifest, ray_local, drop_last):
    # A checkpoint at an epoch's end is common (Keras fit, a loop's last line): resuming
    # with epoch=state["epoch"] must read the next epoch, not an empty pass over the last.
    make = _make(manifest)
    a = make()
    got = [b["id"] for b in a.iter_batches(batch_size=7, epoch=3, drop_last=drop_last)]
    assert len(np.concatenate(got)) == (56 if drop_last else 60)
    state = copy.deepcopy(a.state_dict())
    assert (state["epoch"], state["unit"], state["row"], state["delivered"]) == (4, 0, 0, 0)
    b = make()
    b.load_state_dict(state)
    rest = np.concatenate([x["id"] for x in b.iter_batches(batch_size=7, epoch=state["epoch"])])
    full = np.concatenate([x["id"] for x in make().iter_batches(batch_size=7, epoch=4)])
    assert_same(rest, full, "the next epoch, whole")
    a.close()
    b.close()


def test_to_tf_state_moves_to_the_next_epoch_once_its_batches_are_handed_over(manifest,
                                                                              ray_local):
    pytest.importorskip("tensorflow")
    make = _make(manifest)
    a = make()
    # A loop of as many steps as the epoch has batches: tf.data's generator has handed over
    # every row but is never asked for more, so it does not end.
    taken = list(itertools.islice(iter(a.to_tf(batch_size=8, epoch=0)), 8))
    assert sum(int(b["id"].shape[0]) for b in taken) == 60
    state = a.state_dict()
    assert (state["epoch"], state["unit"], state["row"]) == (1, 0, 0)
    a.close()


def test_to_tf_without_an_epoch_continues_where_a_loaded_state_stands(manifest, ray_local):
    pytest.importorskip("tensorflow")
    make = _make(manifest)
    first, b = _loaded_mid_epoch(make, prefetch_batches=0)
    passes = iter(b.to_tf(batch_size=8, epoch=None))  # the rest of epoch 2, not epoch 0
    rest = np.concatenate([x["id"].numpy() for x in passes])
    assert sorted(np.concatenate([first, rest]).tolist()) == list(range(60))
    assert b.state_dict()["epoch"] == 3
    b.close()
    fresh = make()  # no state loaded: epoch=None is the first epoch
    ids = np.concatenate([x["id"].numpy() for x in fresh.to_tf(batch_size=8, epoch=None)])
    other = make()
    assert np.array_equal(ids, np.concatenate(
        [x["id"] for x in other.iter_batches(batch_size=8, epoch=0)]))
    fresh.close()
    other.close()


def test_a_superseded_iterator_yields_nothing_more_and_leaves_the_new_position_alone(
        manifest, ray_local):
    make = _make(manifest)
    a = make()
    old = a.iter_batches(batch_size=4, epoch=0, prefetch_batches=8)
    next(old)
    import time

    time.sleep(0.5)  # the old iterator's prefetch fills up
    new = a.iter_batches(batch_size=4, epoch=5)
    seen = np.concatenate([next(new)["id"] for _ in range(3)])
    with pytest.raises(raying.SupersededError, match="superseded"):
        next(old)  # not one of the batches it had prefetched
    state = a.state_dict()
    assert (state["epoch"], state["delivered"]) == (5, 12)
    new.close()
    _rest_completes_the_epoch(make, state, seen, epoch=5)
    a.close()


@pytest.mark.parametrize("depth", [0, 4])
def test_an_epoch_whose_last_batch_ends_a_block_moves_on_without_asking_past_it(manifest,
                                                                              ray_local, depth):
    # 60 rows in blocks of 16 and batches of 4: the last batch closes the last block, and a
    # loop of exactly the epoch's steps never asks the iterator for more. Its state is the
    # next epoch's start whatever the prefetch thread has reached.
    make = _make(manifest)
    a = make()
    it = a.iter_batches(batch_size=4, epoch=2, prefetch_batches=depth)
    assert sum(len(b["id"]) for b in itertools.islice(it, 15)) == 60
    state = a.state_dict()
    assert (state["epoch"], state["unit"], state["row"]) == (3, 0, 0)
    it.close()
    a.close()


@pytest.mark.parametrize("depth", [0, 4])
def test_a_drop_last_epoch_taken_to_its_last_full_batch_moves_on(manifest, ray_local, depth):
    # 60 rows, batches of 7 with drop_last: 8 full batches, the last 4 rows dropped. A loop
    # of exactly those 8 steps never asks past them; the 4 rows left are no batch to come,
    # so the state is the next epoch's start (it stayed in this one, whose resume then gave
    # no batch and a "dropped every row" warning).
    make = _make(manifest)
    a = make()
    it = a.iter_batches(batch_size=7, epoch=2, prefetch_batches=depth, drop_last=True)
    assert sum(len(b["id"]) for b in itertools.islice(it, 8)) == 56
    state = a.state_dict()
    assert (state["epoch"], state["unit"], state["row"]) == (3, 0, 0)
    it.close()
    a.close()
    # One full batch short of the end, the epoch still has a batch to give.
    b = make()
    it = b.iter_batches(batch_size=7, epoch=2, prefetch_batches=depth, drop_last=True)
    assert sum(len(x["id"]) for x in itertools.islice(it, 7)) == 49
    assert b.state_dict()["epoch"] == 2
    it.close()
    b.close()


@pytest.fixture(scope="module")
def with_bad(tmp_path_factory):
    """40 good images and 30 empty .jpg files in 2 classes."""
    from raying.tools.datagen import make_image_folder

    root = make_image_folder(tmp_path_factory.mktemp("bad") / "img", n=40, classes=2,
                             size=(20, 24), seed=4, formats=("png",))
    for i in range(30):
        (root / f"class_0{i % 2}" / f"zz_bad{i:02d}.jpg").write_bytes(b"")
    m = raying.Manifest.scan(str(root))
    bad = {i for i, p in enumerate(m.path_of(np.arange(len(m)))) if "zz_bad" in p}
    return m, bad


def _ids(batches):
    return [i for b in batches for i in b["id"].tolist()]


def test_weighted_resume_after_a_sample_set_aside_continues_the_same_epoch(with_bad, ray_local):
    """A sample set aside before the checkpoint leaves later epochs' plans, not the resumed
    epoch's: the continuation is the uninterrupted epoch's rest, row for row."""
    m, bad = with_bad

    def make():
        return raying.Pipeline(m, transform=raying.ImageTransform(size=8),
                               sampler=raying.WeightedSampler(class_balanced=True, seed=3),
                               config=raying.PipelineConfig(block_rows=8))

    p = make()
    planned = [int(i) for u in p.plan(1).units for i in u.ids]
    full = _ids(p.iter_batches(batch_size=10, epoch=1))
    p.close()
    assert set(planned[:30]) & bad, "a bad sample comes before the checkpoint"
    p = make()
    it = p.iter_batches(batch_size=10, epoch=1, prefetch_batches=0)
    before = _ids(itertools.islice(it, 3))
    state = p.state_dict()
    it.close()
    p.close()
    assert set(state["sampler"]["set_aside"]) & bad
    q = make()
    q.load_state_dict(state)
    after = _ids(q.iter_batches(batch_size=10, epoch=1))
    assert before + after == full
    # An epoch first planned after the set-aside leaves them out (epoch 2 may have been
    # planned while epoch 1 was read, to start its reads early: it keeps that plan).
    later = {int(i) for u in q.plan(3).units for i in u.ids}
    assert not later & set(state["sampler"]["set_aside"]), "later epochs leave them out"
    q.close()


def test_a_resumed_epoch_whose_rest_is_all_bad_ends_quietly(with_bad, ray_local):
    """The rows delivered before the checkpoint were good: a rest of the epoch with only bad
    samples left is not 'nothing to train on' (the uninterrupted epoch ends quietly too)."""
    m, bad = with_bad

    def make():
        return raying.Pipeline(m, transform=raying.ImageTransform(size=8),
                               sampler=raying.UniformSampler(seed=0),
                               config=raying.PipelineConfig(block_rows=1))

    p = make()
    for epoch in range(200):  # an epoch whose plan ends in 8 or more bad samples
        order = [int(i) for u in p.plan(epoch).units for i in u.ids]
        good_at = [k for k, i in enumerate(order) if i not in bad]
        if len(order) - good_at[-1] - 1 >= 8:
            break
    assert len(_ids(p.iter_batches(batch_size=1, epoch=epoch))) == 40
    p.close()
    p = make()
    it = p.iter_batches(batch_size=1, epoch=epoch, prefetch_batches=0)
    before = _ids(itertools.islice(it, 40))  # every good row
    state = p.state_dict()
    it.close()
    p.close()
    q = make()
    q.load_state_dict(state)
    assert _ids(q.iter_batches(batch_size=1, epoch=epoch)) == [] and len(set(before)) == 40
    q.close()


def test_iterating_another_epoch_than_the_loaded_state_s_says_so(manifest, ray_local, caplog):
    make = _make(manifest)
    first, b = _loaded_mid_epoch(make)  # epoch 2, 24 rows in
    with caplog.at_level("WARNING", logger="raying"):
        assert len(_ids(b.iter_batches(batch_size=8, epoch=3))) == 60
    assert "the loaded state resumes epoch 2 after 24 rows, but epoch 3 was asked" in caplog.text
    b.close()


def test_an_older_iterator_that_runs_out_leaves_the_newer_position_alone(manifest, ray_local):
    # Epoch 0 read by a loop of exactly its steps (the iterator never asked past its last
    # batch), then epoch 1 begun: the old iterator's end, reached later, is not epoch 1's.
    make = _make(manifest)
    a = make()
    old = a.iter_batches(batch_size=4, epoch=0)
    assert sum(len(b["id"]) for b in itertools.islice(old, 15)) == 60
    new = a.iter_batches(batch_size=4, epoch=1)
    seen = np.concatenate([next(new)["id"] for _ in range(3)])
    with contextlib.suppress(raying.SupersededError):  # or its end, had it read it first
        assert next(old, None) is None
    state = a.state_dict()
    assert (state["epoch"], state["delivered"]) == (1, 12)
    new.close()
    _rest_completes_the_epoch(make, state, seen, epoch=1)
    a.close()


def test_iter_blocks_is_an_iteration_whose_rows_move_the_position(manifest, ray_local):
    make = _make(manifest)
    a = make()
    assert sum(len(b["id"]) for b in a.iter_blocks(0)) == 60
    assert a.state_dict()["epoch"] == 1  # the whole epoch delivered
    old = a.iter_batches(batch_size=4, epoch=1, prefetch_batches=8)
    next(old)
    import time

    time.sleep(0.5)  # the old iterator's prefetch fills up
    blocks = a.iter_blocks(1)
    first = next(blocks)["id"]
    with pytest.raises(raying.SupersededError, match="superseded"):
        next(old)  # its prefetched batches count nowhere
    state = a.state_dict()
    assert (state["epoch"], state["delivered"]) == (1, len(first))
    blocks.close()
    _rest_completes_the_epoch(make, state, first, epoch=1)
    a.close()


def test_a_state_loaded_under_a_running_iterator_supersedes_it(manifest, ray_local):
    make = _make(manifest)
    a = make()
    it = a.iter_batches(batch_size=4, epoch=0, prefetch_batches=2)
    seen = np.concatenate([next(it)["id"] for _ in range(2)])
    a.load_state_dict(a.state_dict())
    with pytest.raises(raying.SupersededError, match="superseded"):
        next(it)
    rest = np.concatenate([x["id"] for x in a.iter_batches(batch_size=4, epoch=0)])
    assert sorted(np.concatenate([seen, rest]).tolist()) == list(range(60))
    a.close()


def test_a_loop_left_early_lets_its_reads_go(manifest, ray_local):
    # A break leaves nothing of its epoch submitted (refs would pin blocks in the object
    # store), and start() of the next epoch then starts its reads.
    make = _make(manifest)
    a = make()
    for _ in a.iter_batches(batch_size=4, epoch=0):
        break
    stream = a._stream
    import time

    deadline = time.monotonic() + 10  # the prefetch thread stops at its next item
    while ([k for k in (*stream._inflight, *stream._reading) if k[0] == 0]
           and time.monotonic() < deadline):
        time.sleep(0.05)
    assert not [k for k in (*stream._inflight, *stream._reading) if k[0] == 0]
    a.start(1)
    assert [k for k in stream._inflight if k[0] == 1]
    ids = np.concatenate([b["id"] for b in a.iter_batches(batch_size=4, epoch=1)])
    assert sorted(ids.tolist()) == list(range(60))
    a.close()
