"""How Train hands a pipeline's description to its workers without running Ray Data.

A Train worker reads a dataset the trainer was given through ``ray.train.get_dataset_shard``,
which returns what the trainer's ``DataConfig.configure`` made for that worker: for a Ray
dataset a ``DataIterator``, whose first read starts a Ray Data execution in the worker (its
executor, a read task, Ray Data's stats and autoscaling actors: ~0.8 s of a cold start on two
cores, and those actors' polling for the rest of the run). :class:`FeedConfig` hands each
worker an object reference to the description instead, so the one-row dataset is never
executed; the trainer's other datasets are configured as Ray's own ``DataConfig`` does.

Every feed made in this process is known to every ``FeedConfig`` of it, by the feed dataset's
name (unique per ``raying.train.datasets`` call), so a trainer given the feeds of several
pipelines may keep any one of their ``dataset_config``. With a plain ``DataConfig`` instead,
the workers read the one-row dataset through Ray Data, as they did before: slower to start,
the same feed.
"""

from __future__ import annotations

import copy
import threading
import uuid
import weakref
from typing import Any

from ray.train import DataConfig

# The prefix of a feed dataset's name; the rest is random, one per datasets() call.
FEED_NAME_PREFIX = "raying-feed-"

# The feeds made in this process: feed dataset name -> reference to the encoded Feed. An entry
# lives as long as its dataset (the trainer holds it).
_FEEDS: dict[str, Any] = {}
_FEEDS_LOCK = threading.Lock()


def register_feed(ds: Any, ref: Any) -> str:
    """Name ``ds`` (the one-row feed dataset) uniquely and remember ``ref`` under that name
    while ``ds`` lives; returns the name."""
    key = FEED_NAME_PREFIX + uuid.uuid4().hex[:16]
    ds.set_name(key)
    with _FEEDS_LOCK:
        _FEEDS[key] = ref
    weakref.finalize(ds, _forget, key)
    return key


def _forget(key: str) -> None:
    with _FEEDS_LOCK:
        _FEEDS.pop(key, None)


def _known_feeds() -> dict[str, Any]:
    with _FEEDS_LOCK:
        return dict(_FEEDS)


class FeedConfig(DataConfig):
    """A ``DataConfig`` that gives each worker a feed's reference, the rest as Ray does.

    Args:
        **kwargs: ``DataConfig``'s own arguments, for the trainer's other datasets (by
            default they are split over the workers, as Ray's default does).
    """

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.feeds: dict[str, Any] = {}

    def _with_known_feeds(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["feeds"] = {**state.get("feeds", {}), **_known_feeds()}
        return state

    # Train copies the configuration in the driver and pickles it to its controller and
    # dataset manager: both carry the feeds this process knows at that moment.
    def __getstate__(self) -> dict[str, Any]:
        return self._with_known_feeds()

    def __deepcopy__(self, memo: dict[int, Any]) -> FeedConfig:
        out = copy.copy(self)
        state = self._with_known_feeds()
        out.__dict__.update({k: (v if k == "feeds" else copy.deepcopy(v, memo))
                             for k, v in state.items()})
        return out

    def configure(self, datasets: dict[str, Any], world_size: int,
                  worker_handles: Any, worker_node_ids: Any,
                  **kwargs: Any) -> list[dict[str, Any]]:
        feeds = {**self.feeds, **_known_feeds()}
        own = {name: feeds[ds.name] for name, ds in datasets.items()
               if getattr(ds, "name", None) in feeds}
        rest = {name: ds for name, ds in datasets.items() if name not in own}
        if rest:
            out = super().configure(rest, world_size, worker_handles, worker_node_ids, **kwargs)
        else:
            out = [{} for _ in range(world_size)]
        for name, ref in own.items():
            for shards in out:
                shards[name] = ref
        return out
