"""The plan of an epoch: which ids each read task delivers, grouped by where they live."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np


@dataclasses.dataclass
class ReadUnit:
    """One read task: the ids it delivers, in delivery order, and what it must read for them.

    ``ids`` is None for a unit whose ids are drawn when it is submitted (prioritized plans);
    ``draw`` then says how many. For Parquet, ``row_groups`` lists the (file, row group) pairs
    the unit reads; rows are taken from them in ``ids`` order. ``group_scan`` holds what the
    scan found in each of them (rows, and image bytes per row): a file rewritten since then
    is found out by the read instead of giving other rows' pixels under these ids.
    """

    epoch: int
    index: int
    draw: int
    ids: np.ndarray | None = None
    labels: np.ndarray | None = None
    probs: np.ndarray | None = None
    weights: np.ndarray | None = None
    row_groups: np.ndarray | None = None
    group_scan: np.ndarray | None = None
    # Samplers that draw with replacement: which draw of its id each row is (0 for the
    # first; see raying.image.rng.draw_keys), so that repeated draws are augmented apart.
    occurrence: np.ndarray | None = None
    # Set by the executor when the unit is re-run to resume mid-unit: rows to drop at the front.
    skip_rows: int = 0

    @property
    def num_rows(self) -> int:
        return self.draw if self.ids is None else len(self.ids)


@dataclasses.dataclass
class EpochPlan:
    """The read units of one epoch, in the order their rows are delivered."""

    epoch: int
    units: list[ReadUnit]
    sampler: str

    @property
    def num_rows(self) -> int:
        return sum(u.num_rows for u in self.units)

    def __len__(self) -> int:
        return len(self.units)


def occurrence_ranks(ids: np.ndarray) -> np.ndarray:
    """For each element of ``ids``, how many equal ids come before it (0 for the first)."""
    ids = np.asarray(ids, dtype=np.int64)
    order = np.argsort(ids, kind="stable")
    ranked = ids[order]
    first = np.r_[True, ranked[1:] != ranked[:-1]] if len(ids) else np.zeros(0, bool)
    run_start = np.maximum.accumulate(np.where(first, np.arange(len(ids)), 0))
    out = np.empty(len(ids), dtype=np.int64)
    out[order] = np.arange(len(ids)) - run_start
    return out


def set_occurrences(units: list[ReadUnit]) -> None:
    """Give the units of an epoch drawn with replacement each row's draw of its id, counted
    over the epoch in plan order (none where no id repeats)."""
    sizes = [len(u.ids) for u in units if u.ids is not None]
    if len(sizes) != len(units) or not sizes:
        return
    ranks = occurrence_ranks(np.concatenate([np.asarray(u.ids) for u in units]))
    if not ranks.any():
        return
    at = 0
    for u, n in zip(units, sizes, strict=True):
        u.occurrence = ranks[at:at + n]
        at += n


def chunk_units(epoch: int, ids: np.ndarray, block_rows: int) -> list[ReadUnit]:
    """Cut an ordered id array into units of ``block_rows``."""
    units = []
    for k, start in enumerate(range(0, len(ids), block_rows)):
        part = ids[start:start + block_rows]
        units.append(ReadUnit(epoch=epoch, index=k, draw=len(part), ids=part))
    return units


def row_group_units(epoch: int, rg_file: np.ndarray, rg_index: np.ndarray,
                    rg_start: np.ndarray, rg_rows: np.ndarray, order: np.ndarray,
                    window: int, rng: np.random.Generator | None,
                    max_rows: int | None = None, block_rows: int = 1) -> list[ReadUnit]:
    """Units of ``window`` row groups each, taken in ``order``; rows shuffled inside a window.

    Every row group is read by exactly one unit, so a uniform epoch reads each byte once,
    unless ``max_rows`` binds: a window of more rows than that is dealt into parts of its
    shuffled rows (a fresh deal each epoch), each a unit that reads the groups holding its
    rows. The parts hold near-equal numbers of whole ``block_rows`` blocks (the last block
    may be short), so that a part is read as blocks of the pipeline's size. The windows, and
    so which rows mix, are the same either way. A worker keeps the groups it read for the
    parts that follow (``raying.read.parquet``), so a window is read about once per read
    worker rather than once per part. See :func:`unit_rows_cap`.
    """
    units: list[ReadUnit] = []
    for start in range(0, len(order), window):
        groups = order[start:start + window]
        ids = np.concatenate([np.arange(rg_start[g], rg_start[g] + rg_rows[g]) for g in groups])
        if rng is not None:
            rng.shuffle(ids)
        ids = ids.astype(np.int64)
        pieces = 1 if max_rows is None else max(1, -(-len(ids) // int(max_rows)))
        if pieces == 1:
            pairs = np.stack([rg_file[groups], rg_index[groups], rg_start[groups]], axis=1)
            units.append(ReadUnit(epoch=epoch, index=len(units), draw=len(ids), ids=ids,
                                  row_groups=pairs.astype(np.int64)))
            continue
        # The window's blocks dealt near-equally into the parts (rounding each part up to
        # whole blocks would make fewer, larger parts, and leave Train shares empty).
        block = max(1, int(block_rows))
        blocks = -(-len(ids) // block)
        k = min(pieces, blocks)
        cuts = [min(len(ids), block * (blocks * j // k)) for j in range(k + 1)]
        for lo, hi in zip(cuts[:-1], cuts[1:], strict=True):
            part = ids[lo:hi].copy()
            units.append(ReadUnit(epoch=epoch, index=len(units), draw=len(part), ids=part,
                                  row_groups=row_groups_of(part, rg_file, rg_index, rg_start)))
    return units


def unit_rows_cap(num_rows: int, block_rows: int, min_units: int = 8) -> int:
    """The most rows a Parquet read unit may hold: ~1/``min_units`` of the epoch, at least a
    block, so that the epoch spreads over the cores and its Train shares.

    A file written by pyarrow or pandas holds one row group of up to ~1 M rows; windows of
    whole groups made such a file one read task (one core decoding) and gave one Train
    worker every row. A window over the cap is read by each of its parts (a worker keeps up
    to ``UNIT_GROUPS_KEEP_BYTES`` of groups for the parts that follow); datasets of many
    windows under the cap read each group once, with the plans they always had.
    """
    return max(int(block_rows), -(-int(num_rows) // int(min_units)))


def row_groups_of(ids: np.ndarray, rg_file: np.ndarray, rg_index: np.ndarray,
                  rg_start: np.ndarray) -> np.ndarray:
    """The distinct (file, row group, first id) triples that hold ``ids``, in file order."""
    pos = np.searchsorted(rg_start, ids, side="right") - 1
    uniq = np.unique(pos)
    return np.stack([rg_file[uniq], rg_index[uniq], rg_start[uniq]], axis=1).astype(np.int64)


class ManifestLookup:
    """The per-id columns a unit needs to be read (labels, paths, row groups); picklable.

    Shipped once to the object store when read tasks must resolve ids they draw themselves.
    """

    def __init__(self, manifest) -> None:
        self.format = manifest.format
        self.labels = manifest.labels
        self.paths: Any = manifest.column("path") if manifest.format == "images" else None
        self.rg: Any = manifest.row_group_table() if manifest.format == "parquet" else None
        # Per row group: (rows, image bytes per row) as the scan found them.
        self.scanned: Any = None if self.rg is None else np.stack(
            [self.rg[3], manifest.column("size")[self.rg[2]]], axis=1).astype(np.int64)

    def complete(self, unit: ReadUnit) -> tuple[ReadUnit, list[str] | None]:
        """Fill ``unit``'s labels (and row groups), and return the paths of its ids."""
        ids: Any = unit.ids
        unit.labels = self.labels[ids]
        if self.format == "parquet":
            f, g, start, _ = self.rg
            if unit.row_groups is None:
                unit.row_groups = row_groups_of(ids, f, g, start)
            if unit.group_scan is None:
                unit.group_scan = self.scanned[np.searchsorted(start, unit.row_groups[:, 2])]
            return unit, None
        return unit, [str(p) for p in self.paths[ids]]
