"""The bench's workloads W1-W5: generated once, cached on disk, listed the same way for all peers.

- W1: JPEG folder, 256x256 (``raying.tools.datagen.make_image_folder``: ~20 KB files that decode
  like photos), 10 classes, one subfolder per class.
- W2: JPEG folder, 500x375 (width x height), like ImageNet's typical image.
- W3: W1 packed by ``raying.pack`` as Parquet of the JPEG bytes (``binary``).
- W4: pre-decoded uint8 Parquet (``raying.pack(..., decode_size=S)``, ``fixed_size_binary``
  of SxSx3 pixels). Its "same work" is a plain random 224 crop + flip of the stored pixels
  (no decode, no resize), and it is measured in GB/s of stored pixels against a plain pyarrow
  read of the same files.
- W5: W1 read with ``raying.PrioritizedSampler`` while the consumer reports a random loss per
  sample every batch (only raying has a sampler that live priorities reshape).
- W6: ImageNet-like JPEG folder (``raying.tools.datagen.make_imagenet_like_folder``): 20,000
  images, sides 300-800 px (mean near 500x375, landscape, portrait and square), quality 75-95,
  ~10% grayscale and ~10% progressive. Decoded it is ~11 GB, more than the decoded-cache
  budget of this kind of node allows, so no loader can keep it in memory.
- W7: heavy augmentation: W1 plus a user colour jitter of ~0.3 ms per 224 px image on one core
  (``raying.bench.kernels.colour_jitter``, torchvision's ColorJitter(0.4, 0.4, 0.4) math) that
  every peer applies in its own idiom: in the DataLoader's dataset, as tf.data ``map`` of TF
  ops, as Ray Data ``map_batches``, as raying ``pipe.map_batches(..., with_rng=True)``.

A cached workload is a folder with a ``.complete`` file holding the parameters it was made
with; anything else under the data folder is rebuilt.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

ALL_WORKLOADS = ("W1", "W2", "W3", "W4", "W5", "W6", "W7")
DEFAULT_W1_IMAGES = 10_000
DEFAULT_W2_IMAGES = 2_000
DEFAULT_W6_IMAGES = 20_000
QUICK_W1_IMAGES = 256
QUICK_W2_IMAGES = 64
QUICK_W6_IMAGES = 64
W6_SHAPE = (375, 500)  # its mean; each image has its own size
W1_SHAPE = (256, 256)  # (height, width)
W2_SHAPE = (375, 500)
DEFAULT_CLASSES = 10
DEFAULT_DECODE_SIZE = 256  # W4's stored side: crops of 224 leave room to move
OUTPUT_SIZE = 224
DATA_SEED = 0
_MARKER = ".complete"


@dataclasses.dataclass(frozen=True)
class Workload:
    """One workload as every peer sees it.

    Attributes:
        name: ``W1`` .. ``W5``.
        kind: ``"images"`` (a class-per-folder JPEG tree) or ``"parquet"``.
        root: the folder (images) or the folder of Parquet shards.
        rows: samples per epoch.
        shape: (height, width) of the source images.
        decoded: side S of pre-decoded pixels (W4), else None.
        prioritized: read with ``PrioritizedSampler`` and live loss reports (W5).
        bytes: bytes on disk.
        augment: every peer applies the W7 colour jitter after its crop and flip.
    """

    name: str
    kind: str
    root: str
    rows: int
    shape: tuple[int, int]
    decoded: int | None = None
    prioritized: bool = False
    bytes: int = 0
    augment: bool = False

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Workload:
        d = dict(d)
        d["shape"] = tuple(d["shape"])
        return cls(**d)

    @property
    def row_bytes(self) -> int:
        """Stored pixel bytes per row (W4), the unit of its GB/s."""
        return int(self.decoded) ** 2 * 3 if self.decoded else 0


# -- listing, shared by the user-written peers ----------------------------------------------------
def list_images(root: str) -> tuple[list[str], np.ndarray, list[str]]:
    """(absolute paths, int64 labels, class names) of a class-per-folder tree, sorted."""
    classes = sorted(e.name for e in os.scandir(root) if e.is_dir())
    paths: list[str] = []
    labels: list[int] = []
    for k, c in enumerate(classes):
        names = sorted(e.name for e in os.scandir(os.path.join(root, c))
                       if e.is_file() and e.name.lower().endswith((".jpg", ".jpeg")))
        paths.extend(os.path.join(root, c, n) for n in names)
        labels.extend([k] * len(names))
    return paths, np.asarray(labels, dtype=np.int64), classes


def read_through(root: str) -> int:
    """Read every file under ``root`` once (bytes discarded) and return the bytes read.

    The bench does this before every cell, untimed, so each peer's cold epoch starts with
    the workload in the page cache whatever ran before it: a host may page out file pages
    that sat idle for a while (this bench's VM does after about 60 s), and the first cell
    of a workload in a round would otherwise read the disk while the next ones did not.
    """
    total = 0
    for folder, _, names in os.walk(root):
        for name in names:
            with open(os.path.join(folder, name), "rb", buffering=0) as fh:
                while chunk := fh.read(1 << 22):
                    total += len(chunk)
    return total


def parquet_files(root: str) -> list[str]:
    """The Parquet shards under ``root``, sorted."""
    return sorted(os.path.join(root, n) for n in os.listdir(root) if n.endswith(".parquet"))


def row_groups(files: list[str]) -> list[tuple[int, int, int]]:
    """(file index, row-group index, rows) of every row group of ``files``."""
    import pyarrow.parquet as pq

    out: list[tuple[int, int, int]] = []
    for f, path in enumerate(files):
        md = pq.ParquetFile(path).metadata
        out.extend((f, g, md.row_group(g).num_rows) for g in range(md.num_row_groups))
    return out


# -- generation and cache ------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Sizes:
    """Images per workload; W3 and W5 are W1's images, W4 defaults to W1's count."""

    w1: int = DEFAULT_W1_IMAGES
    w2: int = DEFAULT_W2_IMAGES
    w4: int | None = None
    decode_size: int = DEFAULT_DECODE_SIZE
    w6: int = DEFAULT_W6_IMAGES

    @property
    def w4_rows(self) -> int:
        return self.w4 if self.w4 is not None else self.w1


def _complete(path: Path, params: dict[str, Any]) -> bool:
    marker = path / _MARKER
    if not marker.exists():
        return False
    try:
        return json.loads(marker.read_text()) == params
    except (OSError, ValueError):
        return False


def _folder_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and p.name != _MARKER)


def _image_folder(data: Path, n: int, shape: tuple[int, int],
                  say: Callable[[str], None]) -> Path:
    from raying.tools.datagen import make_image_folder

    h, w = shape
    dst = data / f"jpeg-{w}x{h}-n{n}-c{DEFAULT_CLASSES}-s{DATA_SEED}"
    params = {"n": n, "shape": list(shape), "classes": DEFAULT_CLASSES, "seed": DATA_SEED}
    if _complete(dst, params):
        return dst
    say(f"generating {n} JPEGs {w}x{h} -> {dst}")
    tmp = dst.with_name(dst.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.rmtree(dst, ignore_errors=True)
    t0 = time.perf_counter()
    make_image_folder(tmp, n=n, classes=DEFAULT_CLASSES, size=shape, seed=DATA_SEED)
    (tmp / _MARKER).write_text(json.dumps(params))
    tmp.rename(dst)
    say(f"  {n} images in {time.perf_counter() - t0:.1f} s")
    return dst


def _imagenet_like_folder(data: Path, n: int, say: Callable[[str], None]) -> Path:
    dst = data / f"jpeg-imagenet-like-n{n}-c{DEFAULT_CLASSES}-s{DATA_SEED}"
    params = {"n": n, "kind": "imagenet-like", "classes": DEFAULT_CLASSES, "seed": DATA_SEED}
    if _complete(dst, params):
        return dst
    say(f"generating {n} ImageNet-like JPEGs -> {dst}")
    tmp = dst.with_name(dst.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.rmtree(dst, ignore_errors=True)
    t0 = time.perf_counter()
    procs = max(1, min(len(os.sched_getaffinity(0)), 8))
    step = -(-n // procs)
    code = ("import sys; from raying.tools.datagen import make_imagenet_like_folder as f; "
            "f(sys.argv[1], n=int(sys.argv[2]), classes=int(sys.argv[3]), seed=int(sys.argv[4]), "
            "start=int(sys.argv[5]), stop=int(sys.argv[6]))")
    children = [subprocess.Popen([sys.executable, "-c", code, str(tmp), str(n),
                                  str(DEFAULT_CLASSES), str(DATA_SEED), str(a), str(min(n, a + step))])
                for a in range(0, n, step)]
    if any(c.wait() != 0 for c in children):
        msg = f"generating {dst} failed"
        raise RuntimeError(msg)
    (tmp / _MARKER).write_text(json.dumps(params))
    tmp.rename(dst)
    say(f"  {n} images in {time.perf_counter() - t0:.1f} s")
    return dst


def _packed(data: Path, src: Path, decode_size: int | None) -> tuple[Path, dict[str, Any]]:
    tag = f"-decoded{decode_size}" if decode_size else ""
    return (data / f"parquet{tag}-of-{src.name}",
            {"src": src.name, "decode_size": decode_size})


def _pack_all(todo: list[tuple[Path, Path, int | None]], say: Callable[[str], None]) -> None:
    """Pack with ``raying.pack`` in a child process (it starts a local Ray for its tasks)."""
    if not todo:
        return
    jobs: list[dict[str, Any]] = [{"src": str(s), "dst": str(d) + ".tmp", "decode_size": k}
                                  for s, d, k in todo]
    for _, d, _ in todo:
        shutil.rmtree(str(d) + ".tmp", ignore_errors=True)
        shutil.rmtree(d, ignore_errors=True)
    say("packing " + ", ".join(f"{Path(j['dst']).name[:-4]}" for j in jobs) + " (raying.pack)")
    t0 = time.perf_counter()
    from raying.bench.launch import local_ray_env

    subprocess.run([sys.executable, "-m", "raying.bench.workloads", "pack", json.dumps(jobs)],
                   check=True, stdout=sys.stderr, env=local_ray_env())
    for (src, dst, k), job in zip(todo, jobs, strict=True):
        params = _packed(dst.parent, src, k)[1]
        tmp = Path(job["dst"])
        (tmp / _MARKER).write_text(json.dumps(params))
        tmp.rename(dst)
    say(f"  packed in {time.perf_counter() - t0:.1f} s")


def prepare(names: list[str], sizes: Sizes, data: str | os.PathLike,
            say: Callable[[str], None] = print) -> dict[str, Workload]:
    """Generate (or find in ``data``) the folders and shards of the named workloads."""
    data = Path(data)
    data.mkdir(parents=True, exist_ok=True)
    out: dict[str, Workload] = {}
    need_w1 = any(n in names for n in ("W1", "W3", "W5", "W7"))
    w1 = _image_folder(data, sizes.w1, W1_SHAPE, say) if need_w1 else None
    todo: list[tuple[Path, Path, int | None]] = []
    if "W3" in names and w1 is not None:
        dst, params = _packed(data, w1, None)
        if not _complete(dst, params):
            todo.append((w1, dst, None))
    if "W4" in names:
        src4 = w1 if (w1 is not None and sizes.w4_rows == sizes.w1) else _image_folder(
            data, sizes.w4_rows, W1_SHAPE, say)
        dst, params = _packed(data, src4, sizes.decode_size)
        if not _complete(dst, params):
            todo.append((src4, dst, sizes.decode_size))
    _pack_all(todo, say)
    for name in names:
        if name in ("W1", "W5", "W7") and w1 is not None:
            out[name] = Workload(name, "images", str(w1), sizes.w1, W1_SHAPE,
                                 prioritized=name == "W5", augment=name == "W7",
                                 bytes=_folder_bytes(w1))
        elif name == "W2":
            w2 = _image_folder(data, sizes.w2, W2_SHAPE, say)
            out[name] = Workload(name, "images", str(w2), sizes.w2, W2_SHAPE,
                                 bytes=_folder_bytes(w2))
        elif name == "W6":
            w6 = _imagenet_like_folder(data, sizes.w6, say)
            out[name] = Workload(name, "images", str(w6), sizes.w6, W6_SHAPE,
                                 bytes=_folder_bytes(w6))
        elif name == "W3" and w1 is not None:
            dst = _packed(data, w1, None)[0]
            out[name] = Workload(name, "parquet", str(dst), sizes.w1, W1_SHAPE,
                                 bytes=_folder_bytes(dst))
        elif name == "W4":
            src4 = w1 if (w1 is not None and sizes.w4_rows == sizes.w1) else _image_folder(
                data, sizes.w4_rows, W1_SHAPE, say)
            dst = _packed(data, src4, sizes.decode_size)[0]
            out[name] = Workload(name, "parquet", str(dst), sizes.w4_rows, W1_SHAPE,
                                 decoded=sizes.decode_size, bytes=_folder_bytes(dst))
    for w in out.values():  # every peer must deliver exactly these rows per epoch
        if w.kind == "parquet":
            import pyarrow.parquet as pq

            rows = sum(pq.ParquetFile(f).metadata.num_rows for f in parquet_files(w.root))
        else:
            rows = len(list_images(w.root)[0])
        if rows != w.rows:
            msg = f"workload {w.name} at {w.root} holds {rows} rows, expected {w.rows}; delete it"
            raise RuntimeError(msg)
    return out


def _pack_main(jobs: list[dict[str, Any]]) -> None:
    import ray

    import raying

    ray.init(address="local", include_dashboard=False, log_to_driver=False)
    try:
        for job in jobs:
            res = raying.pack(job["src"], job["dst"], decode_size=job["decode_size"],
                              on_error="raise", progress=False)
            print(json.dumps(res.summary()), flush=True)
    finally:
        ray.shutdown()


if __name__ == "__main__":
    p = argparse.ArgumentParser(description="internal: pack bench workloads in a child process")
    p.add_argument("action", choices=["pack"])
    p.add_argument("jobs", help="JSON list of {src, dst, decode_size}")
    ns = p.parse_args()
    _pack_main(json.loads(ns.jobs))
