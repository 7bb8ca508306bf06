"""The references: the limit L (decode + augment over bytes in RAM) and a plain pyarrow read (W4).

L: one process per core (forked), each holding its share of the encoded images in RAM (read
before the clock starts), runs ``kernels.decode_crop_flip`` over a fresh permutation of its
share every epoch into a preallocated uint8 batch, and reports each batch's row count and
labels through a queue. There is no loader around it: no file reads, no transfer of pixels
between processes, no framework. It is the rate the machine decodes and augments at.

L-crop: the same loop with raying's own kernel (``ImageTransform.apply_encoded``: only the
crop window of a JPEG is decoded, at a reduced DCT scale where the crop allows) in place of
``decode_crop_flip``. It is the rate of any loader that decodes only the crop window (raying,
tf.data's ``decode_and_crop_jpeg``) with nothing around the kernel: a ceiling for both, so a
ratio between two of them above ``L-crop / the slower one`` cannot be reached on this machine.

pyarrow: ``pq.ParquetFile(f).iter_batches(batch_size, columns=["label", "image"])`` over the
W4 shards in order, each batch's pixels viewed with ``np.frombuffer`` (no copy, no crop, no
shuffle). One process; pyarrow's own threads as it sets them. ``extra()`` adds one timed
``pq.read_table`` of the same files.
"""

from __future__ import annotations

import multiprocessing as mp
import time
import traceback
from collections.abc import Iterator
from typing import Any

import numpy as np

from raying.bench.workloads import OUTPUT_SIZE, Workload, list_images, parquet_files


class _Shape:
    """Stands in for a batch of images the limit kept in its worker (shape and dtype only)."""

    dtype = "uint8"

    def __init__(self, rows: int) -> None:
        self.shape = (rows, OUTPUT_SIZE, OUTPUT_SIZE, 3)


def _load_share(wl: Workload, k: int, cores: int) -> tuple[list[bytes], np.ndarray]:
    if wl.kind == "images":
        paths, labels, _ = list_images(wl.root)
        datas = []
        for p in paths[k::cores]:
            with open(p, "rb") as fh:
                datas.append(fh.read())
        return datas, labels[k::cores]
    import pyarrow.parquet as pq

    table = pq.read_table(parquet_files(wl.root), columns=["image", "label"])
    share = table.take(np.arange(k, table.num_rows, cores))
    return share.column("image").to_pylist(), share.column("label").to_numpy()


def _limit_worker(wl_dict: dict[str, Any], k: int, cores: int, batch: int, seed: int,
                  commands, results, crop_window: bool = False) -> None:
    import cv2

    from raying.bench import kernels
    from raying.image.transform import ImageTransform

    try:
        cv2.setNumThreads(1)
        wl = Workload.from_dict(wl_dict)
        datas, labels = _load_share(wl, k, cores)
        out = np.empty((batch, OUTPUT_SIZE, OUTPUT_SIZE, 3), dtype=np.uint8)
        transform = ImageTransform(size=OUTPUT_SIZE)
        results.put(("ready", k, len(datas)))
        while True:
            epoch = commands.get()
            if epoch is None:
                return
            rng = np.random.default_rng([seed, epoch, k])
            order = rng.permutation(len(datas))
            for start in range(0, len(order), batch):
                idx = order[start:start + batch]
                if crop_window:  # ids as the samples' global positions: k, k + cores, ...
                    got = transform.apply_encoded([datas[i] for i in idx], idx * cores + k,
                                                  seed=seed, epoch=epoch, out=out)
                    if got.errors:
                        raise RuntimeError(f"L-crop could not decode: {got.errors[0]}")
                else:
                    for j, i in enumerate(idx):
                        kernels.decode_crop_flip(datas[i], rng, out[j])
                if wl.augment:  # one image at a time: its float32 copies stay in the cache
                    factors = kernels.jitter_factors(rng, len(idx))
                    for j in range(len(idx)):
                        out[j:j + 1] = kernels.colour_jitter(out[j:j + 1], factors[j:j + 1])
                results.put(("batch", len(idx), labels[idx]))
            results.put(("done", k, 0))
    except BaseException:  # noqa: BLE001 - forwarded to the measuring process
        results.put(("error", k, traceback.format_exc()))


class _LimitLoader:
    def __init__(self, wl: Workload, batch: int, cores: int, seed: int,
                 crop_window: bool = False) -> None:
        ctx = mp.get_context("fork")
        self.cores = cores
        self.results = ctx.Queue()
        self.commands = [ctx.SimpleQueue() for _ in range(cores)]
        self.procs = [ctx.Process(target=_limit_worker, daemon=True,
                                  args=(wl.to_dict(), k, cores, batch, seed,
                                        self.commands[k], self.results, crop_window))
                      for k in range(cores)]
        for p in self.procs:
            p.start()
        for _ in range(cores):  # every share in RAM before the first epoch
            kind, k, info = self.results.get()
            if kind == "error":
                self.close()
                raise RuntimeError(f"limit worker {k} failed:\n{info}")

    def epoch(self, e: int) -> Iterator[tuple[Any, np.ndarray]]:
        for q in self.commands:
            q.put(e)
        done = 0
        while done < self.cores:
            kind, n, info = self.results.get()
            if kind == "batch":
                yield _Shape(n), info
            elif kind == "done":
                done += 1
            else:
                raise RuntimeError(f"limit worker {n} failed:\n{info}")

    def close(self) -> None:
        for q in self.commands:
            q.put(None)
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.terminate()


class LimitPeer:
    """L: the decode + augment rate of all cores, with the bytes already in RAM."""

    def start(self, cores: int) -> dict[str, Any]:
        return {}

    def open(self, wl: Workload, *, batch_size: int, cores: int, seed: int) -> _LimitLoader:
        return _LimitLoader(wl, batch_size, cores, seed)

    def stop(self) -> None:
        pass


class CropLimitPeer(LimitPeer):
    """L-crop: L with raying's crop-window decode kernel (see the module docstring)."""

    def open(self, wl: Workload, *, batch_size: int, cores: int, seed: int) -> _LimitLoader:
        return _LimitLoader(wl, batch_size, cores, seed, crop_window=True)


class _PyArrowLoader:
    def __init__(self, wl: Workload, batch: int) -> None:
        self.files = parquet_files(wl.root)
        self.batch = batch
        self.side = int(wl.decoded or 0)
        self.out_shape = (self.side, self.side, 3)
        self.row_bytes = wl.row_bytes

    def epoch(self, e: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        import pyarrow.parquet as pq

        s = self.side
        for f in self.files:
            for rb in pq.ParquetFile(f).iter_batches(batch_size=self.batch,
                                                     columns=["label", "image"]):
                col = rb.column(1)
                flat = np.frombuffer(col.buffers()[1], dtype=np.uint8)
                n = len(col)
                images = flat[col.offset * s * s * 3:(col.offset + n) * s * s * 3]
                yield images.reshape(n, s, s, 3), rb.column(0).to_numpy()

    def extra(self) -> dict[str, Any]:
        import pyarrow.parquet as pq

        t0 = time.perf_counter()
        table = pq.read_table(self.files, columns=["label", "image"])
        seconds = time.perf_counter() - t0
        rows = table.num_rows
        return {"read_table_s": seconds, "read_table_rows": rows,
                "read_table_gb_s": rows * self.row_bytes / seconds / 1e9}

    def close(self) -> None:
        pass


class PyArrowPeer:
    """W4's reference: a plain pyarrow read of the same Parquet files, no work on the pixels."""

    def start(self, cores: int) -> dict[str, Any]:
        return {}

    def open(self, wl: Workload, *, batch_size: int, cores: int, seed: int) -> _PyArrowLoader:
        return _PyArrowLoader(wl, batch_size)

    def stop(self) -> None:
        pass
