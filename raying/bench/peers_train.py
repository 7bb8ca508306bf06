"""The Ray Train path: a TorchTrainer with 2 workers reads raying's pipeline through
``raying.train``, as users' training jobs do, or plain Ray Data's dataset through Train's own
split (``get_dataset_shard``), the same work.

Each worker iterates its share of every epoch (uint8 NHWC, the same work as every peer) and
checks each batch's shape and dtype itself; what it sends the bench process, through one
relay actor (a bounded queue per worker, a few batches per message), is each batch's row
count and labels. The bench's consumer takes one batch from each worker in turn, as a
data-parallel trainer's all-reduce holds its workers within a step of each other (here
within ``CHUNK_BATCHES * RELAY_MESSAGES``): a worker whose queue is full waits, its loader's
prefetch fills and its reads pause, and the cores go to the other worker's reads. (An
unsynchronised consumer would let one worker run epochs ahead while Ray keeps handing it the
CPUs its leases hold, and the other's reads starve.) The images stay in the workers (a
trainer would use them there): the bench receives a zero-stride stand-in of the same shape,
so ``check_batch`` sees the rows and shape, not pixels. ``close`` tells the workers to stop
and drains the queues.
"""

from __future__ import annotations

import shutil
import tempfile
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np

from raying.bench.workloads import OUTPUT_SIZE, Workload

TRAIN_WORKERS = 2
# Batches a worker sends the bench at once (the first of each epoch alone, for the first-batch
# time), and messages each worker may have waiting: it runs at most this far ahead of the
# bench's consumer, which takes one batch from each worker in turn.
CHUNK_BATCHES = 8
RELAY_MESSAGES = 2
# The custom resource a Train worker holds instead of a CPU; the bench's Ray has one per worker.
TRAINER_SLOT = "bench_trainer"
# Epochs the trainer is told to run; the bench stops it after the cell's epochs.
_MAX_EPOCHS = 10_000
_END = None  # a worker's "my share of this epoch is done"


class _Sender:
    """A worker's side of the relay: batches' row counts and labels, a chunk per message."""

    def __init__(self, relay: Any, rank: int) -> None:
        self.relay, self.rank = relay, rank
        self.items: list[tuple[int, Any, Any]] = []
        self.sent_in_epoch = 0

    def batch(self, epoch: int, b: dict[str, Any]) -> None:
        image = b["image"]
        if image.dtype != np.uint8 or image.shape[1:] != (OUTPUT_SIZE, OUTPUT_SIZE, 3):
            msg = f"rank {self.rank}: image batch {image.shape} {image.dtype}"
            raise RuntimeError(msg)
        # A copy: a view would keep the batch's block (a 38 MB object at 256 rows) pinned in
        # the object store until the chunk is sent, which no trainer does.
        self.items.append((epoch, len(b["label"]), np.array(b["label"])))
        if self.sent_in_epoch == 0 or len(self.items) >= CHUNK_BATCHES:
            self._flush()

    def end(self, epoch: int) -> bool:
        """Close the epoch; True when the bench asked the workers to stop. Rank 0 asks and
        tells the others (a broadcast in Train's process group), so every worker stops after
        the same epoch: a worker that went on alone would wait for ever in a split that
        needs them all (Ray Data's ``streaming_split``)."""
        import ray
        import torch.distributed as dist

        self.items.append((epoch, _END, None))
        self._flush()
        self.sent_in_epoch = 0
        flag = [bool(ray.get(self.relay.stopped.remote())) if self.rank == 0 else None]
        dist.broadcast_object_list(flag, src=0)
        return bool(flag[0])

    def _flush(self) -> None:
        import ray

        ray.get(self.relay.put.remote(self.rank, self.items))
        self.sent_in_epoch += len(self.items)
        self.items = []


def _loop(config: dict[str, Any]) -> None:
    import ray.train

    import raying.train

    loader = raying.train.loader()
    sender = _Sender(config["relay"], ray.train.get_context().get_world_rank())
    for epoch in loader.epochs():
        for b in loader.iter_batches(batch_size=config["batch"]):
            sender.batch(epoch, b)
        if sender.end(epoch):
            break
    loader.close()


def _loop_raydata(config: dict[str, Any]) -> None:
    import ray.train

    shard = ray.train.get_dataset_shard("train")
    sender = _Sender(config["relay"], ray.train.get_context().get_world_rank())
    for epoch in range(_MAX_EPOCHS):
        for b in shard.iter_batches(batch_size=config["batch"], batch_format="numpy",
                                    local_shuffle_buffer_size=config["shuffle_buffer"]):
            sender.batch(epoch, b)
        if sender.end(epoch):
            break


def _relay_class():
    import asyncio

    import ray

    @ray.remote(num_cpus=0)
    class _Relay:
        """One actor between the workers and the bench: a bounded queue per worker, and the
        stop flag."""

        def __init__(self, workers: int, bound: int) -> None:
            self.queues = [asyncio.Queue(bound) for _ in range(workers)]
            self.stop = False

        async def put(self, rank: int, items: list) -> None:
            await self.queues[rank].put(items)

        async def get(self, rank: int, timeout: float) -> list | None:
            try:
                return await asyncio.wait_for(self.queues[rank].get(), timeout)
            except asyncio.TimeoutError:
                return None

        async def set_stop(self) -> None:
            self.stop = True

        async def stopped(self) -> bool:
            return self.stop

    return _Relay


class _TrainLoader:
    def __init__(self, loop: Any, config: dict[str, Any], data: dict[str, Any],
                 pipe: Any = None) -> None:
        import collections

        from ray.train import RunConfig, ScalingConfig
        from ray.train.torch import TorchTrainer

        self.pipe = pipe
        self.storage = tempfile.mkdtemp(prefix="raying-bench-train-")  # Train's run folder
        self.relay = _relay_class().remote(TRAIN_WORKERS, RELAY_MESSAGES)
        self._items: list[collections.deque] = [collections.deque()
                                                for _ in range(TRAIN_WORKERS)]
        # The workers hold no CPU: the read tasks need every core, as the iterator path's do
        # (its consumer, the bench process, holds none either). Each holds a slot of a custom
        # resource instead, as a GPU trainer holds its GPU (Train refuses an empty bundle).
        self.trainer = TorchTrainer(
            loop, train_loop_config={"relay": self.relay, **config},
            scaling_config=ScalingConfig(num_workers=TRAIN_WORKERS,
                                         resources_per_worker={"CPU": 0, TRAINER_SLOT: 1}),
            run_config=RunConfig(storage_path=self.storage),
            **data)
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._fit, daemon=True)
        self.thread.start()

    def _fit(self) -> None:
        try:
            self.trainer.fit()
        except BaseException as exc:  # noqa: BLE001 - reported by epoch()
            self.error = exc

    def _get(self, rank: int) -> tuple[int, Any, Any]:
        import ray

        while not self._items[rank]:
            items = ray.get(self.relay.get.remote(rank, 1.0))
            if items is not None:
                self._items[rank].extend(items)
            elif self.error is not None or not self.thread.is_alive():
                msg = f"the Ray Train arm stopped: {self.error!r}"
                raise RuntimeError(msg) from self.error
        return self._items[rank].popleft()

    def epoch(self, e: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        reading = list(range(TRAIN_WORKERS))
        while reading:
            for rank in list(reading):  # one batch from each worker in turn: a step
                epoch, rows, labels = self._get(rank)
                if epoch != e:
                    msg = f"the Ray Train arm's rank {rank} sent epoch {epoch} during {e}"
                    raise RuntimeError(msg)
                if rows is _END:  # this worker's share is done; it may start the next epoch
                    reading.remove(rank)
                    continue
                stand_in = np.broadcast_to(
                    np.zeros((1, OUTPUT_SIZE, OUTPUT_SIZE, 3), np.uint8),
                    (rows, OUTPUT_SIZE, OUTPUT_SIZE, 3))
                yield stand_in, labels

    def close(self) -> None:
        import ray

        ray.get(self.relay.set_stop.remote())
        while self.thread.is_alive():  # let blocked workers finish their epoch and stop
            for rank in range(TRAIN_WORKERS):
                ray.get(self.relay.get.remote(rank, 0.25))
        if self.pipe is not None:
            self.pipe.close()
        shutil.rmtree(self.storage, ignore_errors=True)


class RayingTrainPeer:
    """raying with default settings, read by 2 Ray Train workers through raying.train."""

    def start(self, cores: int) -> dict[str, Any]:
        from raying.bench.peers_ray import _start_ray, import_raying
        from raying.engine.ray_setup import default_object_store_bytes

        import_raying()
        return _start_ray(cores, default_object_store_bytes(cores),
                          resources={TRAINER_SLOT: TRAIN_WORKERS}, preload=True)

    def open(self, wl: Workload, *, batch_size: int, cores: int, seed: int) -> _TrainLoader:
        import raying

        if wl.kind == "images":
            m = raying.Manifest.scan(wl.root)
        else:
            m = raying.Manifest.scan(wl.root, format="parquet", label="label")
        import raying.train

        pipe = raying.Pipeline(m)
        return _TrainLoader(_loop, {"batch": batch_size},
                            raying.train.datasets(pipe, epochs=_MAX_EPOCHS), pipe)

    def stop(self) -> None:
        import ray

        ray.shutdown()


class RayDataTrainPeer:
    """Plain Ray Data (the raydata peer's dataset), read by 2 Ray Train workers through
    Train's default split (``DataConfig``: ``streaming_split(equal=True)``)."""

    def start(self, cores: int) -> dict[str, Any]:
        import ray

        from raying.bench.peers_ray import _start_ray

        info = _start_ray(cores, resources={TRAINER_SLOT: TRAIN_WORKERS})
        ray.data.DataContext.get_current().enable_progress_bars = False
        return info

    def open(self, wl: Workload, *, batch_size: int, cores: int, seed: int) -> _TrainLoader:
        from raying.bench.peers_ray import ray_dataset

        ds, shuffle_buffer = ray_dataset(wl, cores=cores, seed=seed)
        return _TrainLoader(_loop_raydata, {"batch": batch_size, "shuffle_buffer": shuffle_buffer},
                            {"datasets": {"train": ds}})

    def stop(self) -> None:
        import ray

        ray.shutdown()
