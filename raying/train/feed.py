"""The driver's side of Ray Train: a pipeline's description, handed to every Train worker."""

from __future__ import annotations

import dataclasses
from typing import Any

from raying.errors import ConfigError
from raying.loader.pipeline import Pipeline
from raying.options import PipelineConfig, Settings
from raying.read.stages import StageChain

# The name under which Train hands the description to the workers.
FEED_DATASET = "raying_feed"


@dataclasses.dataclass
class Feed:
    """What a Train worker needs to build its share of the driver's pipeline; picklable.

    The workers' pipelines share the driver's name, so a prioritized sampler finds the
    driver's priority store, and its settings (the driver's ``RAYING_*`` environment).
    """

    manifest: Any
    transform: Any
    sampler: Any
    on_error: str
    config: PipelineConfig
    settings: Settings
    name: str
    epochs: int
    stages: tuple[Any, ...] = ()  # the pipeline's map_batches stages, in order

    @classmethod
    def of(cls, pipe: Pipeline, epochs: int) -> Feed:
        return cls(manifest=pipe.manifest, transform=pipe.transform, sampler=pipe.sampler,
                   on_error=pipe.on_error, config=pipe.config, settings=pipe.settings,
                   name=pipe.name, epochs=int(epochs),
                   stages=StageChain(pipe.stages))

    def encode(self) -> bytes:
        """The bytes a Train worker gets (``pickle.loads`` reads them back). cloudpickle:
        map_batches functions defined in the driver's script (``__main__``) travel by value,
        as they do to read tasks; plain pickle would name a module the workers lack."""
        from ray import cloudpickle

        return cloudpickle.dumps(self)


def datasets(pipe: Pipeline, *, epochs: int, name: str = FEED_DATASET) -> dict[str, Any]:
    """Keyword arguments for ``TorchTrainer`` / ``TensorflowTrainer`` that feed it ``pipe``.

    ``TorchTrainer(loop, scaling_config=..., **raying.train.datasets(pipe, epochs=10))``.
    Nothing is read here: each worker's :func:`raying.train.loader` reads its share of an
    epoch when the epoch starts, so losses reported during epoch ``e`` shape epoch ``e + 1``.
    A prioritized pipeline's store is started now, in the driver, and outlives restarts of
    the workers.

    Args:
        pipe: the pipeline to train from.
        epochs: epochs ``loader.epochs()`` runs (a restarted run continues where it stood).
        name: the dataset name the description travels under (one per pipeline if a
            trainer reads several; pass the same name to ``raying.train.loader``).

    Returns:
        ``{"datasets": {name: ...}, "dataset_config": ...}``: the description as a one-row
        Ray dataset, and a ``DataConfig`` that hands every worker the description itself
        (no Ray Data runs in the workers for it). A trainer with datasets of its own takes
        them beside it (``kw["datasets"]["val"] = val_ds``); the returned ``dataset_config``
        leaves them unsplit (every worker reads each whole), and
        ``raying.train.config.FeedConfig(datasets_to_split=["val"], ...)`` in its place
        splits them (it takes ``DataConfig``'s arguments). Under a plain ``DataConfig``,
        keep the feed out of ``datasets_to_split``.
    """
    import ray
    import ray.data

    from raying.engine.ray_setup import ensure_ray, warn_without_state_api
    from raying.train.config import FeedConfig, register_feed

    if not isinstance(pipe, Pipeline):
        hint = (": build one, raying.Pipeline(manifest, transform=..., sampler=...)"
                if type(pipe).__name__ == "Manifest" else "")
        msg = (f"raying.train.datasets(pipe, ...) takes a raying.Pipeline, got "
               f"{type(pipe).__name__}{hint}")
        raise ConfigError(msg)
    if isinstance(epochs, bool) or not isinstance(epochs, int) or epochs < 1:
        msg = f"raying.train.datasets(epochs=...) must be an integer >= 1, got {epochs!r}"
        raise ConfigError(msg)
    if pipe.sampler.uses_store and not pipe.sampler.lazy:
        # Such a plan (InfoBatch's pruning) is made from the losses in the store as the epoch
        # starts; every worker would read them at its own moment and plan differently.
        msg = (f"raying.train cannot shard a {type(pipe.sampler).__name__}: its epoch plan "
               f"is made from the store's losses when the epoch starts, and each Train worker "
               f"would plan from other losses. Use it with pipe.iter_torch_batches on one "
               f"trainer, or PrioritizedSampler / UniformSampler / WeightedSampler here")
        raise ConfigError(msg)
    if pipe.config.shard is not None:
        msg = (f"raying.train.datasets() shards the pipeline over the Train workers itself; "
               f"build it without PipelineConfig(shard={pipe.config.shard!r})")
        raise ConfigError(msg)
    ensure_ray(dashboard=True)  # Ray Train's own bookkeeping needs the State API
    warn_without_state_api()
    _ = pipe.store_name  # binds the sampler: a prioritized pipeline starts its store here
    encoded = Feed.of(pipe, epochs).encode()
    # The trainer's record of the feed; its workers get the description's reference from
    # FeedConfig and read this dataset only under a trainer given another DataConfig.
    ds = ray.data.from_items([{"feed": encoded}])
    ds.context.enable_progress_bars = False  # one row, read once per worker: no bar
    ref = ray.put(encoded)
    key = register_feed(ds, ref)
    return {"datasets": {name: ds}, "dataset_config": FeedConfig({key: ref})}
