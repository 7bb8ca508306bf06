"""A Train worker's side: its share of every epoch, loss reports, checkpoints and resume."""

from __future__ import annotations

import dataclasses
import glob
import itertools
import logging
import os
import pickle
import re
import shutil
import tempfile
import weakref
from collections.abc import Iterator
from typing import Any

import numpy as np

from raying.errors import ConfigError
from raying.loader.pipeline import Pipeline
from raying.options import DEFAULT_BATCH_SIZE
from raying.train.feed import FEED_DATASET, Feed

# Share of an epoch's rows that steps_per_epoch's steps may leave out before it warns.
STEPS_LEFT_OUT_WARN = 0.1

# Files of a checkpoint: every worker writes its own position; rank 0 the user's state.
# Those of a feed other than the default one carry its name (see _files).
_POSITION = "raying-position-rank{}.pkl"
_STATE = "raying-state.pkl"
# The local folder of a checkpoint: this prefix, the process id, a random part.
_CHECKPOINT_PREFIX = "raying-checkpoint-"


def loader(*, name: str = FEED_DATASET) -> Loader:
    """This Train worker's loader: its share of the pipeline given to ``datasets()``.

    Call it once at the top of the training loop. After a restart (``FailureConfig``), it
    picks up the latest checkpoint: :attr:`Loader.restored` holds the state given to
    :meth:`Loader.checkpoint`, and :meth:`Loader.epochs` continues from the position.
    """
    import ray.train

    try:
        shard = ray.train.get_dataset_shard(name)
    except (KeyError, ValueError) as exc:
        msg = (f"this Train worker has no dataset {name!r}: pass "
               f"**raying.train.datasets(pipe, epochs=...) to the trainer ({exc})")
        raise ConfigError(msg) from None
    if shard is None:
        msg = (f"this Train worker has no dataset {name!r}: pass "
               f"**raying.train.datasets(pipe, epochs=...) to the trainer")
        raise ConfigError(msg)
    feed: Feed = pickle.loads(_feed_bytes(shard, name))
    ctx = ray.train.get_context()
    return Loader(feed, rank=ctx.get_world_rank(), world_size=ctx.get_world_size(),
                  checkpoint=ray.train.get_checkpoint(), dataset=name)


def _files(dataset: str) -> tuple[str, str]:
    """(position file pattern, state file) of a feed's checkpoint: the default feed's as they
    always were, another's (a validation pipeline beside the training one) with its name, so
    that each loader restores its own position and never the other feed's."""
    if dataset == FEED_DATASET:
        return _POSITION, _STATE
    tag = re.sub(r"[^A-Za-z0-9._-]+", "_", dataset)
    return f"raying-position@{tag}-rank{{}}.pkl", f"raying-state@{tag}.pkl"


def _feed_bytes(shard: Any, name: str) -> bytes:
    """The encoded feed: by reference from raying's FeedConfig, else the one-row dataset read
    through Ray Data (a trainer given another DataConfig)."""
    import ray

    if isinstance(shard, ray.ObjectRef):
        return ray.get(shard)
    # Two rows at most: a dataset that is not the feed may be large, and one row tells.
    rows = list(itertools.islice(shard.iter_rows(), 2))
    if rows and "feed" not in rows[0]:
        msg = (f"the trainer's dataset {name!r} is not the pipeline's description that "
               f"raying.train.datasets(..., name={name!r}) made (its rows hold "
               f"{sorted(rows[0])[:6]}): another dataset of the same name replaced it in "
               f"the trainer's datasets. Give one of them another name (a feed's name is "
               f"raying.train.datasets(..., name=...) and raying.train.loader(name=...))")
        raise ConfigError(msg)
    if len(rows) != 1:
        got = "no row" if not rows else "more than one row"
        msg = (f"this Train worker got {got} of the dataset {name!r}, not the one "
               f"row of the pipeline's description: the trainer's dataset_config split it. "
               f"Pass the dataset_config of raying.train.datasets(...) (it configures your "
               f"other datasets as DataConfig does), or leave {name!r} out of "
               f"datasets_to_split")
        raise ConfigError(msg)
    return rows[0]["feed"]


class Loader:
    """One Train worker's share of a pipeline: the units ``rank, rank + W, ...`` of each epoch.

    Args:
        feed: the driver pipeline's description.
        rank: this worker's rank; world_size: the number of workers.
        checkpoint: a ``ray.train.Checkpoint`` made by :meth:`checkpoint`, or None.
        dataset: the feed's name among the trainer's datasets (its checkpoint files').
    """

    def __init__(self, feed: Feed, *, rank: int, world_size: int,
                 checkpoint: Any = None, dataset: str = FEED_DATASET) -> None:
        self.feed, self.rank, self.world_size = feed, int(rank), int(world_size)
        self._position_file, self._state_file = _files(dataset)
        # (epoch, rows) of the last steps_per_epoch(): a loop of that many steps delivers
        # those rows and stops, and its epoch is then done (see _track).
        self._steps_rows: tuple[int, int] | None = None
        # (epoch, {rank: rows delivered}) of a checkpoint resumed mid-epoch.
        self._resumed: tuple[int, dict[int, int]] | None = None
        self._warned_steps = False
        config = dataclasses.replace(feed.config, name=feed.name,
                                     shard=(self.rank, self.world_size))
        pipe = Pipeline(feed.manifest, transform=feed.transform, sampler=feed.sampler,
                        on_error=feed.on_error, config=config, settings=feed.settings)
        for stage in feed.stages:  # the driver pipeline's own augmentation, in order
            pipe = pipe.map_batches(stage.fn, with_rng=stage.with_rng,
                                    fn_kwargs=dict(stage.fn_kwargs))
        self.pipe = pipe
        _check_room_for_reads(self.pipe.config.task_num_cpus)
        self.restored: Any = None
        # Whether the checkpoint's priorities were loaded into a fresh store (a new driver).
        self.priorities_restored = False
        # Local folders of the checkpoints made here, until Ray Train has copied them.
        self._checkpoint_folders: list[str] = []
        weakref.finalize(self, _remove_all, self._checkpoint_folders)
        self.epoch = 0
        self._first = 0
        self._complete = False
        if checkpoint is not None:
            self._restore_priorities(self._restore(checkpoint))
            if self._first >= self.feed.epochs and self.rank == 0:
                # Ray Train restores a run from RunConfig(name, storage_path) whenever one is
                # there, a finished one too: the loop would then read nothing, in silence.
                logging.getLogger("raying").warning(
                    "raying.train.loader(): the checkpoint this run was given is at the end "
                    "of all %d epochs, so no epoch is left to read. Ray Train resumes a run "
                    "from RunConfig(name=..., storage_path=...) when one is stored there: "
                    "give the run a new name to train again, or raise epochs in "
                    "raying.train.datasets(pipe, epochs=...) to train on", self.feed.epochs)
        if self._first < self.feed.epochs:
            # The first epoch's reads start now, while the loop builds its model: on a fresh
            # Train cluster Ray's idle workers went to Train's own actors, and the first read
            # tasks wait for new worker processes (~1.3-1.8 s on two cores here).
            self.pipe.start(epoch=self._first)

    # -- epochs and batches --------------------------------------------------------------------
    def epochs(self) -> Iterator[int]:
        """The epochs left to run: from the checkpoint's (or 0) to ``epochs - 1``."""
        for epoch in range(self._first, self.feed.epochs):
            self.epoch, self._complete = epoch, False
            yield epoch

    def iter_torch_batches(self, *, batch_size: int = DEFAULT_BATCH_SIZE, device: Any = "auto",
                           normalize: bool = True, drop_last: bool = False,
                           prefetch_batches: int | None = None,
                           **kwargs: Any) -> Iterator[dict[str, Any]]:
        """This worker's batches of the current epoch (``Pipeline.iter_torch_batches``):
        ``image`` float32 NCHW normalized on the device (``normalize=False``: uint8 NHWC)."""
        yield from self._track(self.pipe.iter_torch_batches(
            batch_size=batch_size, epoch=self.epoch, device=device, normalize=normalize,
            drop_last=drop_last, prefetch_batches=prefetch_batches, **kwargs))

    def iter_batches(self, *, batch_size: int = DEFAULT_BATCH_SIZE, drop_last: bool = False,
                     prefetch_batches: int | None = None) -> Iterator[dict[str, Any]]:
        """This worker's numpy batches of the current epoch."""
        yield from self._track(self.pipe.iter_batches(
            batch_size=batch_size, epoch=self.epoch, drop_last=drop_last,
            prefetch_batches=prefetch_batches))

    def to_tf(self, *, batch_size: int = DEFAULT_BATCH_SIZE, normalize: bool = True,
              as_supervised: bool = False, drop_last: bool = False,
              prefetch_batches: int | None = None, mean: Any = None, std: Any = None):
        """This worker's share of the current epoch as a ``tf.data.Dataset``.

        ``image`` comes normalized (float32 ``(x/255 - mean)/std``) by default, as from
        ``iter_torch_batches``, for the model it goes straight to; ``Pipeline.to_tf``'s
        default is uint8 (``normalize=False``), for a model that scales its own inputs.
        Its auto-sharding is off (the share is this worker's already). Under
        ``MultiWorkerMirroredStrategy`` every worker must run the same number of steps:
        pass ``steps_per_epoch=loader.steps_per_epoch(batch_size)`` to ``fit``, one ``fit``
        epoch per loader epoch (the dataset holds this epoch only).
        """
        import tensorflow as tf

        ds = self.pipe.to_tf(batch_size=batch_size, epoch=self.epoch, normalize=normalize,
                             as_supervised=as_supervised, drop_last=drop_last,
                             prefetch_batches=prefetch_batches, mean=mean, std=std)
        options = tf.data.Options()
        options.experimental_distribute.auto_shard_policy = (
            tf.data.experimental.AutoShardPolicy.OFF)
        return ds.with_options(options)

    def steps_per_epoch(self, batch_size: int) -> int:
        """Batches every worker can deliver in the current epoch (the smallest share's), for
        collectives that need the same number of steps on every worker.

        The rows of each share past those steps are read but in no step. Raises ConfigError
        when a share holds less than one batch (no step at all); warns, once, when the steps
        leave out more than ``STEPS_LEFT_OUT_WARN`` of the epoch's rows, and raises it for a
        batch size that is not a positive int (as ``iter_batches`` does)."""
        import logging

        if (isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer))
                or batch_size < 1):
            msg = f"steps_per_epoch(batch_size): must be a positive int, got {batch_size!r}"
            raise ConfigError(msg)
        plan = self.pipe.sampler.plan(self.pipe.manifest, self.epoch,
                                      block_rows=self.pipe.block_rows())
        rows = [sum(u.num_rows for u in plan.units[r::self.world_size])
                for r in range(self.world_size)]
        if self._resumed is not None and self._resumed[0] == self.epoch:
            # An epoch resumed mid-way: each share's rows not delivered before the checkpoint.
            rows = [max(0, n - self._resumed[1].get(r, 0)) for r, n in enumerate(rows)]
        batch = int(batch_size)
        steps = min(rows) // batch
        total = sum(rows)
        if min(rows) == 0 and total:
            msg = (f"steps_per_epoch({batch}): epoch {self.epoch} has {len(plan.units)} read "
                   f"units for {self.world_size} workers, so a worker's share is empty and no "
                   f"step would run; use fewer workers or smaller units "
                   f"(PipelineConfig(block_rows=...))")
            raise ConfigError(msg)
        if steps == 0 and total:
            msg = (f"steps_per_epoch({batch}): the smallest of the {self.world_size} workers' "
                   f"shares of epoch {self.epoch} holds {min(rows)} rows, under one batch, so "
                   f"no step would train on any of the epoch's {total}; use a batch size of "
                   f"at most {min(rows)}, fewer workers or more samples per epoch")
            raise ConfigError(msg)
        left_out = total - steps * batch * self.world_size
        if (total and left_out > STEPS_LEFT_OUT_WARN * total and not self._warned_steps
                and self.rank == 0):
            self._warned_steps = True
            logging.getLogger("raying").warning(
                "raying.train: steps_per_epoch(%d) = %d: %d workers x %d steps x %d rows "
                "train on %d of epoch %d's %d rows; %d are read by no step (a smaller batch "
                "or fewer workers train on more)", batch, steps, self.world_size, steps, batch,
                total - left_out, self.epoch, total, left_out)
        self._steps_rows = (self.epoch, steps * batch)
        return steps

    def _track(self, batches: Iterator[dict[str, Any]]) -> Iterator[dict[str, Any]]:
        rows = 0
        steps = self._steps_rows
        for batch in batches:
            rows += len(batch["id"])
            if steps is not None and steps[0] == self.epoch and rows >= steps[1]:
                # The last of steps_per_epoch's steps: a loop of that many steps (islice)
                # never asks for more, and a checkpoint after it resumes at the next epoch.
                self._complete = True
            yield batch
        self._complete = True  # the whole share of this epoch was delivered

    # -- feedback ------------------------------------------------------------------------------
    def report(self, ids: Any, losses: Any) -> None:
        """Per-sample losses of a batch, to the priority store; never blocks the step."""
        self.pipe.report(ids, losses)

    def flush(self) -> None:
        """Send buffered reports now (still without waiting for the store)."""
        self.pipe.sampler.flush()

    def stats(self) -> dict[str, Any]:
        """This worker's ``pipe.stats()``."""
        return self.pipe.stats()

    # -- checkpoints ---------------------------------------------------------------------------
    def checkpoint(self, **state: Any):
        """A ``ray.train.Checkpoint`` of ``state`` (e.g. ``model=model.state_dict()``), this
        worker's position in the epoch and, from rank 0, a snapshot of the priorities.

        Every worker must pass its own to ``ray.train.report``: each holds that worker's
        position. Reports sent so far reach the store before the checkpoint is made. Its
        local folder (``ray.train.report`` copies it to the run's storage) is removed at the
        next ``checkpoint()``, at :meth:`close` or when the process exits.
        """
        from ray.train import Checkpoint
        from ray.train.collective import barrier

        self.pipe.sampler.flush()
        if self.pipe.sampler.handle is not None:
            from raying.sampling import store

            store.flush(self.pipe.sampler.handle)  # this worker's reports applied
            barrier()  # ... and every other worker's, before rank 0 takes the snapshot
        position = self.pipe.state_dict()
        # Delivered to its end (through to_tf too, whose generator the loader does not see).
        complete = self._complete or (position["epoch"] > self.epoch)
        if self.rank != 0:  # one copy of the priorities, from rank 0
            position = {**position, "sampler": _without_tables(position["sampler"])}
        self._drop_checkpoint_folders()
        _sweep_checkpoint_folders()
        folder = tempfile.mkdtemp(prefix=f"{_CHECKPOINT_PREFIX}{os.getpid()}-")
        self._checkpoint_folders.append(folder)
        with open(os.path.join(folder, self._position_file.format(self.rank)), "wb") as fh:
            pickle.dump({"epoch": self.epoch, "complete": complete,
                         "world_size": self.world_size, "position": position}, fh)
        if self.rank == 0:
            with open(os.path.join(folder, self._state_file), "wb") as fh:
                pickle.dump(state, fh)
        return Checkpoint.from_directory(folder)

    def _restore(self, checkpoint: Any) -> list[dict[str, Any]] | None:
        """Take up the checkpoint's state and position; returns the priorities it holds
        (rank 0's), or None."""
        with checkpoint.as_directory() as folder:
            state_path = os.path.join(folder, self._state_file)
            if os.path.exists(state_path):
                with open(state_path, "rb") as fh:
                    self.restored = pickle.load(fh)
            path = os.path.join(folder, self._position_file.format(self.rank))
            if not os.path.exists(path):
                held = sorted(glob.glob(os.path.join(folder, self._position_file.format("*"))))
                if held:
                    # Other workers' positions without this one's: it would start the epochs
                    # over while they go on, out of step (collectives hang).
                    with open(held[0], "rb") as fh:
                        size = pickle.load(fh).get("world_size")
                    names = [os.path.basename(h) for h in held]
                    msg = (f"the checkpoint holds the positions {names} but not rank "
                           f"{self.rank}'s: every Train worker must pass its own "
                           f"loader.checkpoint() to ray.train.report (not rank 0 alone); it "
                           f"was made by {size} workers, this run has {self.world_size}")
                    raise ConfigError(msg)
                return None  # a checkpoint of another shape: restart the epochs' count only
            with open(path, "rb") as fh:
                saved = pickle.load(fh)
            others = []
            delivered: dict[int, int] = {}  # rank -> rows of its share it had delivered
            head, tail = self._position_file.split("{}")
            for other in sorted(glob.glob(os.path.join(folder, self._position_file.format("*")))):
                if other != path:
                    with open(other, "rb") as fh:
                        others.append(pickle.load(fh))
                    rank = os.path.basename(other)[len(head):-len(tail)]
                    if rank.isdigit():
                        delivered[int(rank)] = int(others[-1]["position"].get("delivered", 0))
        if saved["world_size"] != self.world_size:
            msg = (f"the checkpoint was made by {saved['world_size']} Train workers, this run "
                   f"has {self.world_size}; each worker's position is in its share, so resume "
                   f"with ScalingConfig(num_workers={saved['world_size']})")
            raise ConfigError(msg)
        tables = (saved["position"].get("sampler") or {}).get("tables")
        if saved["complete"] or saved["position"]["epoch"] > saved["epoch"] or any(
                _done(other, saved["epoch"]) for other in others):
            # This worker's share of the epoch was delivered, or another worker's was: a loop
            # of steps_per_epoch steps (islice over to_tf) leaves the larger shares' last rows
            # unread, and every worker must start the same epoch.
            self._first = saved["epoch"] + 1
            return tables
        self._first = saved["epoch"]
        # What each worker's share of the resumed epoch has left, for steps_per_epoch.
        delivered[self.rank] = int(saved["position"].get("delivered", 0))
        self._resumed = (saved["epoch"], delivered)
        # The position only: the priorities are the store's business (_restore_priorities).
        position = saved["position"]
        position = {**position, "sampler": _without_tables(position["sampler"])}
        self.pipe.load_state_dict(position)
        return tables

    def _restore_priorities(self, tables: list[dict[str, Any]] | None) -> None:
        """Put the checkpoint's priorities into the store when it has none of its own.

        After a worker restart within a run the store, which lives with the driver, kept every
        report since the checkpoint: it is left as it is. A run resumed by a new driver (Ray
        Train's restore of a run by its name and storage) starts a fresh store, all at the
        initial priority: rank 0 loads the snapshot its checkpoint holds, and every worker
        waits for that before its first read.
        """
        handle = getattr(self.pipe.sampler, "handle", None)
        if handle is None:
            return
        from raying.sampling import store

        if self.rank == 0 and tables is not None:
            health = store.stats(handle)
            if health["updates_applied"] == 0 and health["restores"] == 0:
                store.load_state_dict(handle, tables)
                self.priorities_restored = True
        if self.world_size > 1:
            from ray.train.collective import barrier

            barrier()

    def close(self) -> None:
        """Stop this worker's reads (the store belongs to the driver and stays) and remove the
        last checkpoint's local folder."""
        self.pipe.close(release_store=False)
        self._drop_checkpoint_folders()

    def _drop_checkpoint_folders(self) -> None:
        while self._checkpoint_folders:
            shutil.rmtree(self._checkpoint_folders.pop(), ignore_errors=True)

    def __enter__(self) -> Loader:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _sweep_checkpoint_folders() -> None:
    """Remove the checkpoint folders of processes that are gone (a Train worker killed at the
    end of a run never reaches close() or its exit handlers)."""
    for path in glob.glob(os.path.join(tempfile.gettempdir(), f"{_CHECKPOINT_PREFIX}*-*")):
        pid = os.path.basename(path)[len(_CHECKPOINT_PREFIX):].split("-", 1)[0]
        if not pid.isdigit():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(path, ignore_errors=True)
        except OSError:  # alive, another user's: not ours to remove
            pass


def _remove_all(folders: list[str]) -> None:
    for folder in folders:
        shutil.rmtree(folder, ignore_errors=True)


def _done(saved: dict[str, Any], epoch: int) -> bool:
    """Whether a worker's saved position has delivered ``epoch`` to its end."""
    return saved["epoch"] > epoch or (saved["epoch"] == epoch and (
        saved["complete"] or saved["position"]["epoch"] > epoch))


def _without_tables(sampler_state: dict[str, Any]) -> dict[str, Any]:
    if "tables" in sampler_state:
        return {**sampler_state, "tables": None}
    return sampler_state


def _check_room_for_reads(task_cpus: float) -> None:
    """Warn when the cluster has no CPU left for read tasks: Train workers that take every
    CPU leave the reads waiting forever.

    What is left for reads is the cluster's CPUs less those its placement groups reserve
    (Ray Train's workers hold theirs in one), not ``ray.available_resources()``: read tasks
    running at that instant (another worker's) hold CPUs that are free for reads.
    """
    import logging

    from raying.engine.ray_setup import cpus_outside_placement_groups

    free = cpus_outside_placement_groups()
    if free < task_cpus:
        logging.getLogger("raying").warning(
            "raying.train: %.2f CPU left in the cluster beside what its placement groups "
            "(Train workers', this run's and any other's) reserve, and each read task needs "
            "%s: the reads then wait for ever. Give the workers fewer CPUs "
            "(ScalingConfig(resources_per_worker={'CPU': ...})) so that %s stay free, or "
            "the reads fewer (PipelineConfig(task_num_cpus=...))",
            free, task_cpus, task_cpus)
