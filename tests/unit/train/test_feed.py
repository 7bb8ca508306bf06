"""raying.train.datasets refuses what it cannot shard, before anything starts."""

from __future__ import annotations

import numpy as np
import pytest

import raying
import raying.train
from raying.tools.datagen import make_image_folder


@pytest.fixture
def manifest(tmp_path):
    return raying.Manifest.scan(str(make_image_folder(tmp_path / "i", n=8, classes=2,
                                                      size=(8, 8))))


@pytest.mark.parametrize("epochs", [0, -1, 2.0, True])
def test_epochs_must_be_a_positive_integer(manifest, epochs):
    with pytest.raises(raying.ConfigError, match=r"datasets\(epochs=...\) must be an integer"):
        raying.train.datasets(raying.Pipeline(manifest), epochs=epochs)


def test_a_manifest_or_a_dataset_in_place_of_a_pipeline_is_refused(manifest):
    with pytest.raises(raying.ConfigError, match=r"takes a raying.Pipeline, got Manifest: "
                                                 r"build one, raying.Pipeline\(manifest"):
        raying.train.datasets(manifest, epochs=1)
    with pytest.raises(raying.ConfigError, match=r"takes a raying.Pipeline, got list$"):
        raying.train.datasets([1, 2], epochs=1)


def test_a_plan_made_from_live_losses_is_refused(manifest):
    pipe = raying.Pipeline(manifest, sampler=raying.InfoBatchSampler(epochs=4))
    with pytest.raises(raying.ConfigError, match=r"cannot shard a InfoBatchSampler"):
        raying.train.datasets(pipe, epochs=4)


def test_a_pipeline_already_sharded_is_refused(manifest):
    pipe = raying.Pipeline(manifest, config=raying.PipelineConfig(shard=(0, 2)))
    with pytest.raises(raying.ConfigError, match=r"build it without PipelineConfig\(shard="):
        raying.train.datasets(pipe, epochs=1)


@pytest.mark.parametrize("shard", [(2, 2), (-1, 2), (0, 0), (1,), "0/2"])
def test_shard_must_be_an_index_below_the_count(shard):
    with pytest.raises(raying.ConfigError, match=r"PipelineConfig\(shard=...\) must be"):
        raying.PipelineConfig(shard=shard)


def test_a_share_takes_every_nth_unit_renumbered(manifest):
    full = raying.Pipeline(manifest, config=raying.PipelineConfig(block_rows=1))
    parts = [raying.Pipeline(manifest, config=raying.PipelineConfig(block_rows=1,
                                                                    shard=(i, 3)))
             for i in range(3)]
    units = full.plan(1).units
    for i, p in enumerate(parts):
        mine = p.plan(1).units
        assert [u.index for u in mine] == list(range(len(mine)))
        assert [u.ids.tolist() for u in mine] == [u.ids.tolist() for u in units[i::3]]


def test_a_stage_from_the_driver_script_reaches_the_workers_by_value(manifest):
    """A map_batches function defined in the driver's script (module ``__main__``): a Train
    worker's ``__main__`` is Ray's, so the feed carries the function itself, not its name."""
    import pickle

    from raying.train.feed import Feed

    def add_twice(batch):
        batch["twice"] = batch["id"] * 2
        return batch

    add_twice.__module__ = "__main__"
    add_twice.__qualname__ = "add_twice_only_in_the_driver"
    pipe = raying.Pipeline(manifest).map_batches(add_twice)
    # A stage carries its function by value whatever pickles it (plain pickle too, which
    # would name a __main__ function the workers lack).
    for data in (Feed.of(pipe, 1).encode(), pickle.dumps(Feed.of(pipe, 1))):
        (stage,) = pickle.loads(data).stages
        assert stage.fn is not add_twice
        assert stage.fn({"id": np.arange(3)})["twice"].tolist() == [0, 2, 4]
    pipe.close()


class _Named:
    """Stands for the one-row feed dataset: FeedConfig looks only at its name."""

    name = None

    def set_name(self, name):
        self.name = name


def test_a_feed_config_carries_every_feed_of_the_process_to_where_train_unpickles_it():
    """Train deep-copies the config in the driver and unpickles it in its controller and
    dataset manager, where no feed is registered: the config must carry them, the feeds of
    every datasets() call (a trainer of two pipelines keeps one of their configs), and none
    of an ended Ray session (its reference could not be sent)."""
    import copy
    import gc
    import pickle

    from raying.train import config

    a, b = _Named(), _Named()
    key_a = config.register_feed(a, "ref-a")
    key_b = config.register_feed(b, "ref-b")
    assert key_a == a.name != b.name == key_b and key_a.startswith(config.FEED_NAME_PREFIX)
    config._FEEDS["raying-feed-old"] = ("an ended session", "ref-old")
    try:
        sent = pickle.dumps(copy.deepcopy(config.FeedConfig()))
    finally:
        del config._FEEDS["raying-feed-old"]
    del a
    gc.collect()
    assert key_a not in config._known_feeds() and key_b in config._known_feeds()
    saved = dict(config._FEEDS)
    config._FEEDS.clear()  # as in Train's controller: nothing registered there
    try:
        there = pickle.loads(sent)
        assert {key_a, key_b} <= set(there.feeds) and "raying-feed-old" not in there.feeds
        feed_a, feed_b, other = _Named(), _Named(), _Named()
        feed_a.name, feed_b.name, other.name = key_a, key_b, "raying-feed-old"
        out = there.configure({"x": feed_a, "y": feed_b}, world_size=3,
                              worker_handles=None, worker_node_ids=None)
        assert out == [{"x": "ref-a", "y": "ref-b"}] * 3  # every worker gets the whole feed
    finally:
        config._FEEDS.update(saved)
    del b
    gc.collect()
    assert key_b not in config._known_feeds()


def test_a_feed_config_never_splits_the_feed():
    from raying.train.config import FeedConfig

    with pytest.raises(ValueError, match=r"would split the feed too: name the datasets"):
        FeedConfig(datasets_to_split="all")
    assert FeedConfig()._datasets_to_split == []
    assert FeedConfig(datasets_to_split=["val"])._datasets_to_split == ["val"]
