"""Data of the I/O benchmark: the generated images, their Parquet copy, the sampled trace."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from raying.config import DEFAULT_PLAN_CHUNK_IDS

BLOCK_ROWS = 256
ROW_GROUP_ROWS = 256
ROWS_PER_GROUP = 16


@dataclasses.dataclass
class TraceUnit:
    """One read unit of the trace: its epoch, drawn ids and their probabilities at draw time."""

    epoch: int
    ids: np.ndarray
    probs: np.ndarray


def make_trace(n: int, *, epochs: int, sigma: float, seed: int, block_rows: int = BLOCK_ROWS,
               starts: np.ndarray | None = None) -> list[TraceUnit]:
    """Prioritized read units with simulated loss feedback (see raying/bench/io_bench.py).

    With ``starts`` (first id of each Parquet row group) units are two-stage plans:
    ``ROWS_PER_GROUP`` rows from each row group drawn by its mass.
    """
    from raying.sampling.table import PriorityTable

    rng = np.random.default_rng(seed)
    difficulty = rng.lognormal(0.0, sigma, n)
    table = PriorityTable(n, alpha=1.0, uniform_mix=0.1, seed=seed)
    units = []
    for epoch in range(epochs):
        left = n
        while left > 0:
            k = min(block_rows, left)
            left -= k
            if starts is None:
                ids, probs = table.sample(DEFAULT_PLAN_CHUNK_IDS, systematic=True)
                pick = rng.permutation(len(ids))[:k]
                ids, probs = ids[pick], probs[pick]
            else:
                ids, probs = table.sample_in_groups(k, starts, ROWS_PER_GROUP)
                order = np.argsort(ids, kind="stable")
                ids, probs = ids[order], probs[order]
            units.append(TraceUnit(epoch, ids, probs))
            table.update(ids, difficulty[ids] * rng.lognormal(0.0, 0.2, k))
    return units


def write_parquet(paths: np.ndarray, labels: np.ndarray, dst: Path) -> Path:
    """The images as Parquet (raying pack's layout: id, label, image, path; 256-row groups)."""
    if (dst / ".complete").exists():
        return dst
    dst.mkdir(parents=True, exist_ok=True)
    shard = 1024
    for k, start in enumerate(range(0, len(paths), shard)):
        ids = np.arange(start, min(start + shard, len(paths)))
        table = pa.table({"id": pa.array(ids, pa.int64()),
                          "label": pa.array(labels[ids], pa.int64()),
                          "image": pa.array([Path(p).read_bytes() for p in paths[ids]],
                                            pa.binary()),
                          "path": pa.array([str(p) for p in paths[ids]])})
        pq.write_table(table, dst / f"part-{k:05d}.parquet", row_group_size=ROW_GROUP_ROWS,
                       compression="none", use_dictionary=["label"])
    (dst / ".complete").write_text("ok")
    return dst


def dataset(args: argparse.Namespace) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The generated image folder (cached): paths, sizes, labels in id order."""
    from raying.datagen import make_image_folder

    root = Path(args.data) / f"images-{args.images}-{args.side}"
    if not (root / ".complete").exists():
        print(f"generating {args.images} images of {args.side}px in {root} ...")
        make_image_folder(root, n=args.images, classes=10, size=(args.side, args.side), seed=0)
        (root / ".complete").write_text("ok")
    files = sorted(p for p in root.rglob("*.jpg"))
    paths = np.array([str(p) for p in files], dtype=object)
    sizes = np.array([p.stat().st_size for p in files], dtype=np.int64)
    labels = np.array([int(p.parent.name.split("_")[1]) for p in files], dtype=np.int64)
    return paths, sizes, labels
