"""torch DataLoader as a careful user writes it: num_workers = cores, persistent workers.

- Image folders: a map-style ``Dataset`` whose ``__getitem__`` reads the file, decodes it with
  simplejpeg (libjpeg-turbo, not PIL) and does RandomResizedCrop + flip with numpy/cv2
  (``raying.bench.kernels``; torchvision is not a dependency). ``DataLoader(shuffle=True,
  batch_size=B, num_workers=cores, persistent_workers=True)``, default collate (uint8 NHWC
  tensor, int64 labels), default prefetch_factor.
- Parquet (W3, W4): an ``IterableDataset`` over row groups: every epoch all row groups are
  permuted (same order in every worker), worker ``w`` of ``n`` takes every n-th, reads it with
  pyarrow and yields its rows in a random order. W4's rows are viewed with ``np.frombuffer``
  and cropped (224, no resize) and flipped.

Each worker sets ``cv2.setNumThreads(1)`` (torch already runs its workers on one thread).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, get_worker_info

from raying.bench import kernels
from raying.bench.workloads import OUTPUT_SIZE, Workload, list_images, parquet_files, row_groups


def _worker_init(_: int) -> None:
    import cv2

    cv2.setNumThreads(1)


class FileDataset(Dataset):
    """One JPEG file per item: read, decode, random-resized-crop, flip."""

    def __init__(self, paths: list[str], labels: np.ndarray, augment: bool = False) -> None:
        self.paths = paths
        self.labels = labels
        self.augment = augment  # W7: the colour jitter, per item as a torch Dataset does it
        self._rng: np.random.Generator | None = None
        self._pid = -1

    def __len__(self) -> int:
        return len(self.paths)

    def _generator(self) -> np.random.Generator:
        if self._rng is None or self._pid != os.getpid():  # one per worker, seeded by torch
            self._rng = np.random.default_rng(torch.initial_seed() % (1 << 63))
            self._pid = os.getpid()
        return self._rng

    def __getitem__(self, i: int):
        with open(self.paths[i], "rb") as fh:
            data = fh.read()
        out = np.empty((OUTPUT_SIZE, OUTPUT_SIZE, 3), dtype=np.uint8)
        rng = self._generator()
        kernels.decode_crop_flip(data, rng, out)
        if self.augment:
            out = kernels.colour_jitter(out[None], kernels.jitter_factors(rng, 1))[0]
        return torch.from_numpy(out), int(self.labels[i])

class RowGroupDataset(IterableDataset):
    """Parquet row groups split over workers, shuffled by group and within each group."""

    def __init__(self, files: list[str], decoded: int | None, seed: int) -> None:
        self.files = files
        self.groups = row_groups(files)
        self.decoded = decoded
        self.seed = seed
        self._epoch = -1  # each worker's copy counts its own epochs (persistent workers)
        self._open: dict[int, Any] = {}

    def _file(self, f: int):
        import pyarrow.parquet as pq

        if f not in self._open:
            self._open[f] = pq.ParquetFile(self.files[f])
        return self._open[f]

    def __iter__(self) -> Iterator[tuple[Any, int]]:
        info = get_worker_info()
        wid, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        self._epoch += 1
        order = np.random.default_rng([self.seed, self._epoch]).permutation(len(self.groups))
        rng = np.random.default_rng([self.seed, self._epoch, wid, 1])
        s = self.decoded
        for gi in order[wid::workers]:
            f, g, _ = self.groups[gi]
            table = self._file(f).read_row_group(g, columns=["image", "label"])
            labels = table.column("label").to_numpy()
            if s:
                col = table.column("image").combine_chunks()
                flat = np.frombuffer(col.buffers()[1], dtype=np.uint8)
                pixels = flat[col.offset * s * s * 3:(col.offset + len(col)) * s * s * 3]
                pixels = pixels.reshape(len(col), s, s, 3)
            else:
                datas = table.column("image").to_pylist()
            for r in rng.permutation(len(labels)):
                out = np.empty((OUTPUT_SIZE, OUTPUT_SIZE, 3), dtype=np.uint8)
                if s:
                    kernels.crop_flip(pixels[r], rng, out)
                else:
                    kernels.decode_crop_flip(datas[r], rng, out)
                yield torch.from_numpy(out), int(labels[r])


class _TorchLoader:
    def __init__(self, loader: Any) -> None:
        self.loader = loader

    def epoch(self, e: int) -> Iterator[tuple[Any, Any]]:
        yield from self.loader

    def close(self) -> None:
        it = getattr(self.loader, "_iterator", None)
        if it is not None:  # persistent workers: shut them down now, not at interpreter exit
            it._shutdown_workers()
            self.loader._iterator = None


class TorchPeer:
    """torch.utils.data.DataLoader with worker processes."""

    def start(self, cores: int) -> dict[str, Any]:
        return {"torch_version": torch.__version__}

    def open(self, wl: Workload, *, batch_size: int, cores: int, seed: int) -> _TorchLoader:
        common: dict[str, Any] = {"batch_size": batch_size, "num_workers": cores, "persistent_workers": True,
                  "worker_init_fn": _worker_init}
        if wl.kind == "images":
            paths, labels, _ = list_images(wl.root)
            gen = torch.Generator().manual_seed(seed)
            loader = DataLoader(FileDataset(paths, labels, wl.augment), shuffle=True,
                                generator=gen, **common)
        else:
            loader = DataLoader(RowGroupDataset(parquet_files(wl.root), wl.decoded, seed), **common)
        return _TorchLoader(loader)

    def stop(self) -> None:
        pass
