"""How Train hands a pipeline's description to its workers without running Ray Data.

A Train worker reads a dataset the trainer was given through ``ray.train.get_dataset_shard``,
which returns what the trainer's ``DataConfig.configure`` made for that worker: for a Ray
dataset a ``DataIterator``, whose first read starts a Ray Data execution in the worker (its
executor, a read task, Ray Data's stats actor: ~0.8 s of a cold start on two cores, and
that actor's polling for the rest of the run). :class:`FeedConfig` hands each worker an
object reference to the description instead, so the one-row dataset is never executed; the
trainer's other datasets are configured by ``DataConfig`` itself, unsplit unless named.

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

# The feeds made in this process: feed dataset name -> (Ray session, reference to the encoded
# Feed). An entry lives as long as its dataset (the trainer holds it); one of an ended Ray
# session is never handed on (its reference cannot be sent on the new session's).
_FEEDS: dict[str, tuple[str | None, Any]] = {}
# Re-entrant: an entry's finalizer may run in a garbage collection that an allocation made
# while this thread held the lock.
_FEEDS_LOCK = threading.RLock()


def register_feed(ds: Any, ref: Any) -> str:
    """Name ``ds`` (the one-row feed dataset) uniquely and remember ``ref`` under that name
    while ``ds`` lives; returns the name."""
    from raying.engine.ray_setup import ray_session

    key = FEED_NAME_PREFIX + uuid.uuid4().hex[:16]
    ds.set_name(key)
    with _FEEDS_LOCK:
        _FEEDS[key] = (ray_session(), ref)
    weakref.finalize(ds, _forget, key)
    return key


def _forget(key: str) -> None:
    with _FEEDS_LOCK:
        _FEEDS.pop(key, None)


def _known_feeds() -> dict[str, Any]:
    """The feeds of this process's current Ray session."""
    from raying.engine.ray_setup import ray_session

    now = ray_session()
    with _FEEDS_LOCK:
        return {key: ref for key, (session, ref) in _FEEDS.items() if session == now}


class FeedConfig(DataConfig):
    """A ``DataConfig`` that gives each worker a feed's reference, the rest as Ray does.

    Args:
        feeds: feed dataset name -> reference (``raying.train.datasets`` passes its own;
            the feeds registered in this process are added when Train copies the config).
        datasets_to_split: the trainer's other datasets to split over the workers with
            ``streaming_split`` (Ray's default splits all of them); by default none is
            split, and every worker reads each of them whole. A feed is never split.
        **kwargs: ``DataConfig``'s other arguments, for the trainer's other datasets.
    """

    def __init__(self, feeds: dict[str, Any] | None = None, *,
                 datasets_to_split: list[str] | str | None = None, **kwargs: Any) -> None:
        if datasets_to_split == "all":
            msg = ("FeedConfig(datasets_to_split='all') would split the feed too: name the "
                   "datasets to split")
            raise ValueError(msg)
        super().__init__(datasets_to_split=list(datasets_to_split or []), **kwargs)
        self.feeds: dict[str, Any] = dict(feeds or {})

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
