"""The Ray peers: plain Ray Data as a user writes it, and raying with its default settings.

Both start their own local Ray in the measuring process, ``ray.init(address="local",
num_cpus=cores, include_dashboard=False)``, timed as ``ray_start_s`` (never part of a time to
first batch), then leave the node ``RAY_SETTLE_S`` idle to start its worker processes, as a
job's model building does. Ray Data gets Ray's default object store (30% of memory) and
workers that import what its first tasks need; raying gets the Ray ``raying.ensure_ray``
starts (and ``raying cluster start``, cluster.yaml): its object store
(``default_object_store_bytes``: 128 MB per CPU, at least 256 MB) and workers that import its
read path as they start (``raying.engine.preload``).

Ray Data (Ray 2.60 APIs):

- Image folders: ``read_binary_files(root, include_paths=True,
  shuffle=FileShuffleConfig(seed), override_num_blocks=ceil(N / 256))`` (a new file order
  every execution, i.e. every epoch; blocks of ~256 images, ~100 ms of work) ->
  ``map_batches(decode_augment, batch_format="numpy", compute=TaskPoolStrategy())``
  (simplejpeg + cv2, the same kernel as torch and L; the label from the class folder in the
  path; fused with the read into one task per block, at most one task per CPU) -> ``iter_batches(batch_size=B,
  batch_format="numpy")`` with its default prefetch.
- Parquet (W3, W4): ``read_parquet(root, shuffle=FileShuffleConfig(seed),
  override_num_blocks=ceil(N / 256)).select_columns(["image", "label"])`` -> ``map_batches``
  (decode + augment, or crop + flip of the stored pixels) -> ``iter_batches(...,
  local_shuffle_buffer_size=256)`` (Ray Data's documented row shuffle; the file shuffle alone
  would only permute a few shards).

Progress bars are switched off (``DataContext.enable_progress_bars = False``) to keep the logs
readable; nothing else in the DataContext is changed.

raying: ``raying.Pipeline(Manifest.scan(root))`` (``Manifest.scan(root, format="parquet",
label="label")`` for Parquet) with the default transform (random-resized-crop 224 + flip),
the default uniform sampler and ``PipelineConfig()``; batches from ``pipe.iter_batches(
batch_size=B, epoch=e)``. W4 passes ``ImageTransform(size=224, scale=(c, c), ratio=(1, 1))``
with ``c = (224 / S)**2``: a plain 224 crop of the stored SxS pixels, the same work as the other
peers. W5 passes ``PrioritizedSampler()`` (defaults) and reports a random loss per sample
after every batch through ``pipe.report`` (non-blocking).
"""

from __future__ import annotations

import functools
import math
import os
import time
from collections.abc import Iterator
from typing import Any

import numpy as np

from raying.bench.workloads import OUTPUT_SIZE, Workload

DEFAULT_RAYDATA_BLOCK_ROWS = 256
DEFAULT_RAYDATA_SHUFFLE_BUFFER_ROWS = 256


# Seconds a fresh local Ray is left to start its workers before the first cell.
RAY_SETTLE_S = 1.0


def _start_ray(cores: int, object_store_bytes: int | None = None,
               resources: dict[str, float] | None = None,
               preload: bool = False) -> dict[str, Any]:
    """A local Ray as a user's ``ray.init`` starts it, or (``preload``) as raying's own
    start does: its workers import raying's read path as they start, and its raylet deletes
    objects out of scope at once."""
    import ray

    kwargs: dict[str, Any] = {}
    if preload:
        from raying.engine.ray_setup import local_ray_kwargs

        kwargs = local_ray_kwargs()
    t0 = time.perf_counter()
    ray.init(address="local", num_cpus=cores, include_dashboard=False,
             object_store_memory=object_store_bytes, resources=resources, **kwargs)
    # Ray's first serialization in a process imports pydantic (~0.1 s): raying's own start
    # does it then (ensure_ray); every Ray peer's driver gets it here alike, as Ray start-up.
    from raying.engine.ray_setup import warm_serializer

    warm_serializer()
    started = time.perf_counter() - t0
    # ray.init returns before the node has started its worker processes (and, with the
    # preload, their imports); a job builds its model meanwhile. Every Ray peer's node gets
    # the same second, idle, before its first cell.
    time.sleep(RAY_SETTLE_S)
    return {"ray_start_s": started, "ray_settle_s": RAY_SETTLE_S, "ray_version": ray.__version__,
            "preload": sorted(kwargs.get("_system_config", {}).get(
                "preload_python_modules", [])),
            "free_objects_period_ms": kwargs.get("_system_config", {}).get(
                "free_objects_period_milliseconds")}


# -- Ray Data ------------------------------------------------------------------------------------
def _decode_augment(batch: dict[str, Any], classes: list[str]) -> dict[str, Any]:
    import cv2

    from raying.bench import kernels

    cv2.setNumThreads(1)
    rng = np.random.default_rng()
    datas = batch["bytes"] if "bytes" in batch else batch["image"]
    out = np.empty((len(datas), OUTPUT_SIZE, OUTPUT_SIZE, 3), dtype=np.uint8)
    for i, data in enumerate(datas):
        kernels.decode_crop_flip(data, rng, out[i])
    if "path" in batch:
        index = {c: k for k, c in enumerate(classes)}
        labels = np.array([index[os.path.basename(os.path.dirname(p))] for p in batch["path"]],
                          dtype=np.int64)
    else:
        labels = np.asarray(batch["label"], dtype=np.int64)
    return {"image": out, "label": labels}


def _jitter(batch: dict[str, Any]) -> dict[str, Any]:
    """W7's colour jitter as a Ray Data stage (its own map_batches after the decode)."""
    from raying.bench import kernels

    return kernels.jitter_batch(batch, np.random.default_rng())


def _crop_flip_pixels(batch: dict[str, Any], side: int) -> dict[str, Any]:
    from raying.bench import kernels

    rng = np.random.default_rng()
    values = batch["image"]
    out = np.empty((len(values), OUTPUT_SIZE, OUTPUT_SIZE, 3), dtype=np.uint8)
    for i, v in enumerate(values):
        pixels = np.frombuffer(v, dtype=np.uint8).reshape(side, side, 3)
        kernels.crop_flip(pixels, rng, out[i])
    return {"image": out, "label": np.asarray(batch["label"], dtype=np.int64)}


def ray_dataset(wl: Workload, *, cores: int, seed: int) -> tuple[Any, int | None]:
    """Plain Ray Data's reading of a workload: ``(dataset, local shuffle buffer rows)``.

    Images: ``read_binary_files`` (file order shuffled) + decode/crop/flip in ``map_batches``;
    Parquet: ``read_parquet`` + the same map, with a local shuffle buffer at iteration.
    """
    import ray

    blocks = max(cores, math.ceil(wl.rows / DEFAULT_RAYDATA_BLOCK_ROWS))
    shuffle = ray.data.FileShuffleConfig(seed=seed)
    # No size: Ray's default, which lets the read fuse with map_batches into one task per
    # block (a size would differ from the read's and split them into two operators).
    compute = ray.data.TaskPoolStrategy()
    if wl.kind == "images":
        classes = sorted(e.name for e in os.scandir(wl.root) if e.is_dir())
        ds = ray.data.read_binary_files(wl.root, include_paths=True, shuffle=shuffle,
                                        override_num_blocks=blocks)
        ds = ds.map_batches(functools.partial(_decode_augment, classes=classes),
                            batch_format="numpy", compute=compute)
        if wl.augment:
            ds = ds.map_batches(_jitter, batch_format="numpy", compute=compute)
        return ds, None
    ds = ray.data.read_parquet(wl.root, shuffle=shuffle, override_num_blocks=blocks)
    ds = ds.select_columns(["image", "label"])
    if wl.decoded:
        ds = ds.map_batches(functools.partial(_crop_flip_pixels, side=int(wl.decoded)),
                            batch_format="numpy", compute=compute)
    else:
        ds = ds.map_batches(functools.partial(_decode_augment, classes=[]),
                            batch_format="numpy", compute=compute)
    return ds, DEFAULT_RAYDATA_SHUFFLE_BUFFER_ROWS


class _RayDataLoader:
    def __init__(self, ds: Any, batch: int, shuffle_buffer: int | None) -> None:
        self.ds = ds
        self.batch = batch
        self.shuffle_buffer = shuffle_buffer

    def epoch(self, e: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        for b in self.ds.iter_batches(batch_size=self.batch, batch_format="numpy",
                                      local_shuffle_buffer_size=self.shuffle_buffer):
            yield b["image"], b["label"]

    def extra(self) -> dict[str, Any]:
        stats = self.ds.stats()
        print(stats, flush=True)  # to the measurement's log: operators, fusion, task times
        return {"stats_head": stats[:2000]}

    def close(self) -> None:
        self.ds = None


class RayDataPeer:
    """Plain Ray Data: read_* + map_batches + iter_batches."""

    def start(self, cores: int) -> dict[str, Any]:
        info = _start_ray(cores)
        import ray

        ray.data.DataContext.get_current().enable_progress_bars = False
        return info

    def open(self, wl: Workload, *, batch_size: int, cores: int, seed: int) -> _RayDataLoader:
        ds, shuffle_buffer = ray_dataset(wl, cores=cores, seed=seed)
        return _RayDataLoader(ds, batch_size, shuffle_buffer)

    def stop(self) -> None:
        import ray

        ray.shutdown()


# -- raying --------------------------------------------------------------------------------------
class _RayingLoader:
    def __init__(self, pipe: Any, batch: int, report: bool, seed: int) -> None:
        self.pipe = pipe
        self.batch = batch
        self.report = report
        self.rng = np.random.default_rng(seed)

    def epoch(self, e: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        for b in self.pipe.iter_batches(batch_size=self.batch, epoch=e):
            yield b["image"], b["label"]
            if self.report:  # after the step, as a trainer reports its per-sample losses
                self.pipe.report(b["id"], self.rng.random(len(b["id"])))

    def extra(self) -> dict[str, Any]:
        return self.pipe.stats()

    def close(self) -> None:
        self.pipe.close()


def import_raying() -> None:
    """Load the raying names a peer builds its loader from. ``import raying`` loads them on
    first use; the peers' frameworks (torch, tensorflow) are imported before any timing, so
    raying's are too, rather than inside the first cell's time to first batch."""
    import raying

    for name in ("Manifest", "Pipeline", "PipelineConfig", "ImageTransform",
                 "PrioritizedSampler", "UniformSampler"):
        getattr(raying, name)


class RayingPeer:
    """raying.Pipeline with default settings (uniform), prioritized with live updates on W5."""

    # The pipeline's config beyond the defaults (a subclass's labelled variant).
    config: dict[str, Any] = {}

    def start(self, cores: int) -> dict[str, Any]:
        from raying.engine.ray_setup import default_object_store_bytes

        import_raying()
        # As a Ray that raying starts itself (ensure_ray): its object store, its preload.
        return _start_ray(cores, default_object_store_bytes(cores), preload=True)

    def open(self, wl: Workload, *, batch_size: int, cores: int, seed: int) -> _RayingLoader:
        import raying

        if wl.kind == "images":
            m = raying.Manifest.scan(wl.root)
        else:
            m = raying.Manifest.scan(wl.root, format="parquet", label="label")
        kwargs: dict[str, Any] = {}
        if wl.decoded:
            c = (OUTPUT_SIZE / wl.decoded) ** 2
            kwargs["transform"] = raying.ImageTransform(size=OUTPUT_SIZE, scale=(c, c),
                                                        ratio=(1.0, 1.0))
        if wl.prioritized:
            kwargs["sampler"] = raying.PrioritizedSampler()
        pipe = raying.Pipeline(m, config=raying.PipelineConfig(**self.config), **kwargs)
        if wl.augment:  # W7: the user's stage in the read tasks, reproducible per (seed, epoch)
            from raying.bench.kernels import jitter_batch

            pipe = pipe.map_batches(jitter_batch, with_rng=True)
        return _RayingLoader(pipe, batch_size, wl.prioritized, seed)

    def stop(self) -> None:
        import ray

        ray.shutdown()


class RayingCachePeer(RayingPeer):
    """raying with its decoded-sample cache on from the first epoch (a budget of a quarter of
    free memory), whatever the job's length: a labelled row beside the decoding peers, never
    in the headline ratio. It fills within its default budget (4 % of the read time, plus
    what hits save), so its later epochs crop the cached share and decode the rest."""

    @property
    def config(self) -> dict[str, Any]:  # type: ignore[override]
        from raying.read.decoded_cache import auto_budget

        return {"decoded_cache": max(1, auto_budget())}


class RayingCacheEagerPeer(RayingCachePeer):
    """raying-cache that fills every sample at its first read (``decoded_cache_fill=None``):
    a slow epoch 0, then every later epoch crops cached pixels. The row to set beside
    tf.data's ``.cache()``, which works the same way."""

    @property
    def config(self) -> dict[str, Any]:  # type: ignore[override]
        return {**super().config, "decoded_cache_fill": None}
