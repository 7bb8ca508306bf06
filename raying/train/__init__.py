"""Ray Train, first class: a Pipeline feeds a TorchTrainer or a TensorflowTrainer.

The driver passes ``**raying.train.datasets(pipe, epochs=E)`` to the trainer; each worker
calls :func:`loader` and reads its share of every epoch through raying's own read engine::

    driver      pipe = raying.Pipeline(...)           the priority store starts here
                TorchTrainer(loop, **raying.train.datasets(pipe, epochs=E))
                  -> every worker gets the pipeline's description (FeedConfig)
    worker r    loader = raying.train.loader()        its share: the units r, r + W, ...
                for epoch in loader.epochs():          plans made when each epoch starts
                    for batch in loader.iter_torch_batches(batch_size=B):   read tasks,
                        ...                                                 prefetch, device
                        loader.report(batch["id"], per_sample_loss)   -> the store, async
                    ray.train.report(metrics, checkpoint=loader.checkpoint(model=...))

Every id of a uniform epoch reaches exactly one worker once (shards may differ by a unit:
wrap the loop in DDP's ``model.join()`` or use :meth:`Loader.steps_per_epoch`). A restarted
worker resumes from its position in the last checkpoint.
"""

from raying.train.feed import FEED_DATASET, Feed, datasets
from raying.train.loader import Loader, loader

__all__ = ["FEED_DATASET", "Feed", "Loader", "datasets", "loader"]

if __all__ != sorted(__all__):  # pragma: no cover - a guard for maintainers
    raise RuntimeError("raying.train.__all__ must stay sorted")
