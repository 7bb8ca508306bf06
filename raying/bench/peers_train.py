"""raying on the Ray Train path: a TorchTrainer with 2 workers reads the pipeline through
``raying.train``, as users' training jobs do.

Each worker iterates its share of every epoch (``loader.iter_batches``, uint8 NHWC, the same
work as every peer) and checks each batch's shape and dtype itself; what it sends the bench
process, through a bounded Ray queue, is each batch's row count and labels, so the bench's
consumer counts the rows of both workers as they arrive. The images stay in the workers (a
trainer would use them there): the bench receives a zero-stride stand-in of the same shape,
so ``check_batch`` sees the rows and shape, not pixels. The workers run epochs ahead up to the
queue's bound, as a trainer's loader would; ``close`` tells them to stop and drains the queue.
"""

from __future__ import annotations

import tempfile
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np

from raying.bench.workloads import OUTPUT_SIZE, Workload

TRAIN_WORKERS = 2
# Batches the workers may run ahead of the bench's consumer.
QUEUE_BATCHES = 32
# Epochs the trainer is told to run; the bench stops it after the cell's epochs.
_MAX_EPOCHS = 10_000


def _loop(config: dict[str, Any]) -> None:
    import ray
    import ray.train

    import raying.train

    loader = raying.train.loader()
    rank = ray.train.get_context().get_world_rank()
    queue, control = config["queue"], config["control"]
    for epoch in loader.epochs():
        for b in loader.iter_batches(batch_size=config["batch"]):
            image = b["image"]
            if image.dtype != np.uint8 or image.shape[1:] != (OUTPUT_SIZE, OUTPUT_SIZE, 3):
                msg = f"rank {rank}: image batch {image.shape} {image.dtype}"
                raise RuntimeError(msg)
            queue.put((epoch, len(b["id"]), np.asarray(b["label"])))
        queue.put((epoch, None, None))  # this worker's share of the epoch is done
        if ray.get(control.stopped.remote()):
            break
    loader.close()


class _TrainLoader:
    def __init__(self, pipe: Any, batch: int) -> None:
        import ray
        from ray.train import RunConfig, ScalingConfig
        from ray.train.torch import TorchTrainer
        from ray.util.queue import Queue

        import raying.train

        @ray.remote(num_cpus=0)
        class _Control:
            def __init__(self) -> None:
                self.stop = False

            def set(self) -> None:
                self.stop = True

            def stopped(self) -> bool:
                return self.stop

        self.pipe = pipe
        self.queue = Queue(maxsize=QUEUE_BATCHES, actor_options={"num_cpus": 0})
        self.control = _Control.remote()
        self._ahead: list[tuple[int, Any, Any]] = []
        # The workers hold a sliver of CPU each: the read tasks need the cores.
        self.trainer = TorchTrainer(
            _loop, train_loop_config={"queue": self.queue, "control": self.control,
                                      "batch": batch},
            scaling_config=ScalingConfig(num_workers=TRAIN_WORKERS,
                                         resources_per_worker={"CPU": 0.01}),
            run_config=RunConfig(storage_path=tempfile.mkdtemp(prefix="raying-bench-train-")),
            **raying.train.datasets(pipe, epochs=_MAX_EPOCHS))
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._fit, daemon=True)
        self.thread.start()

    def _fit(self) -> None:
        try:
            self.trainer.fit()
        except BaseException as exc:  # noqa: BLE001 - reported by epoch()
            self.error = exc

    def _get(self) -> tuple[int, Any, Any]:
        from ray.util.queue import Empty

        while True:
            try:
                return self.queue.get(timeout=1.0)
            except Empty:
                if self.error is not None or not self.thread.is_alive():
                    msg = f"the Ray Train arm stopped: {self.error!r}"
                    raise RuntimeError(msg) from self.error

    def epoch(self, e: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        done = 0
        while done < TRAIN_WORKERS:
            # A worker that finished its share may already send the next epoch's batches
            # while the other still reads this one: those wait for their epoch.
            mine = [item for item in self._ahead if item[0] == e]
            if mine:
                item = mine[0]
                self._ahead.remove(item)
            else:
                item = self._get()
            epoch, rows, labels = item
            if epoch > e:
                self._ahead.append(item)
                continue
            if epoch < e:
                msg = f"the Ray Train arm delivered epoch {epoch} while epoch {e} was read"
                raise RuntimeError(msg)
            if rows is None:
                done += 1
                continue
            stand_in = np.broadcast_to(np.zeros((1, OUTPUT_SIZE, OUTPUT_SIZE, 3), np.uint8),
                                       (rows, OUTPUT_SIZE, OUTPUT_SIZE, 3))
            yield stand_in, labels

    def close(self) -> None:
        import ray
        from ray.util.queue import Empty

        ray.get(self.control.set.remote())
        while self.thread.is_alive():  # let blocked workers finish their epoch and stop
            try:
                self.queue.get(timeout=0.5)
            except Empty:
                pass
        self.pipe.close()


class RayingTrainPeer:
    """raying with default settings, read by 2 Ray Train workers through raying.train."""

    def start(self, cores: int) -> dict[str, Any]:
        from raying.bench.peers_ray import _start_ray
        from raying.engine.ray_setup import default_object_store_bytes

        return _start_ray(cores, default_object_store_bytes(cores))

    def open(self, wl: Workload, *, batch_size: int, cores: int, seed: int) -> _TrainLoader:
        import raying

        if wl.kind == "images":
            m = raying.Manifest.scan(wl.root)
        else:
            m = raying.Manifest.scan(wl.root, format="parquet", label="label")
        return _TrainLoader(raying.Pipeline(m), batch_size)

    def stop(self) -> None:
        import ray

        ray.shutdown()
