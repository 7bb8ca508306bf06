"""Where a read task's pixels come from: one source object per kind of unit.

A read task (:func:`raying.read.task.iter_unit`) opens one source for its unit and asks it for
the pixels of one slice of rows at a time. Each source reads what it must, decodes through
the transform (the one decode entry point per kind of input), and reports the I/O it did:

- ``EncodedFiles``: an image folder's files, read once per unit (planned and cached when the
  pipeline has an IOConfig).
- ``ParquetRows``: a unit's Parquet row groups, read once; encoded images are decoded, and
  pre-decoded pixels are only cropped.
- ``CachedPixels``: the decoded-pixel cache first; misses are fetched (files or row groups,
  as above) and decoded, some of them whole into the cache as its fill budget allows.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import numpy as np

from raying.errors import DataError, DecodeError
from raying.image.rng import draw_keys
from raying.read import decoded_cache as _decoded
from raying.read import fetch as _fetch
from raying.read import parquet as _parquet
from raying.read.account import add_counters
from raying.read.spec import ReadSpec
from raying.sampling.plan import ReadUnit


@dataclasses.dataclass
class Part:
    """The pixels of one slice of a unit, and what getting them cost."""

    images: np.ndarray
    ok: np.ndarray  # per input row: it decoded (rows not ok are in ``errors``)
    errors: list[DecodeError]
    io: dict[str, int]
    bytes_read: int
    read_s: float  # reading done for this slice alone (sources that read per slice)


def open_source(spec: ReadSpec, fs: Any, root: str, unit: ReadUnit, ids: np.ndarray,
                paths: list[str] | None):
    """The source that serves ``unit``'s rows."""
    if spec.fmt == "images":
        if paths is None:
            msg = "an image read unit needs the paths of its ids"
            raise DataError(msg)
        full = [f"{root.rstrip('/')}/{p}" for p in paths]
        if spec.decoded_cache_bytes:
            def fetch(part: slice, miss: list[int]):
                picked = [full[part][k] for k in miss]
                probs = getattr(unit, "probs", None)  # the misses' own rows' scores
                scores = None if probs is None else np.asarray(probs)[part][miss]
                return _fetch.read_samples(spec, fs, picked, unit, scores=scores)

            return CachedPixels(spec, unit, ids, list(paths), fetch, bytes_from_io=False)
        return EncodedFiles(spec, fs, unit, ids, full, list(paths))
    if spec.decoded_cache_bytes and spec.decoded is None:
        return CachedPixels(spec, unit, ids, _parquet.row_locations(spec, unit, ids),
                            _RowGroupFetch(spec, fs, root, unit, ids), bytes_from_io=True)
    return ParquetRows(spec, fs, root, unit, ids)


class _ReadOnce:
    """A source that reads its whole unit when opened: the first slice carries the I/O."""

    def __init__(self, io: dict[str, int], nbytes: int, delivered: int) -> None:
        if "io_bytes_fetched" not in io:  # plain reads: what was read is what was delivered
            io = {**io, "io_bytes_fetched": int(nbytes), "io_bytes_delivered": int(delivered)}
        self._pending: tuple[dict[str, int], int] | None = (io, int(nbytes))

    def _spent(self) -> tuple[dict[str, int], int]:
        spent, self._pending = self._pending or ({}, 0), None
        return spent


class EncodedFiles(_ReadOnce):
    """The encoded files of an image unit."""

    def __init__(self, spec: ReadSpec, fs: Any, unit: ReadUnit, ids: np.ndarray,
                 full: list[str], where: list[str]) -> None:
        self.spec, self.unit, self.ids, self.where = spec, unit, ids, where
        self.keys = draw_keys(ids, unit.occurrence)
        self.datas, io = _fetch.read_samples(spec, fs, full, unit)
        nbytes = sum(len(d) for d in self.datas if isinstance(d, (bytes, bytearray, memoryview)))
        super().__init__(io, nbytes, nbytes)

    def part(self, part: slice, out: np.ndarray | None) -> Part:
        images, ok, errors = transform_encoded(self.spec, self.unit, self.ids[part],
                                               self.datas[part], self.where[part], out,
                                               keys=self.keys[part])
        io, nbytes = self._spent()
        return Part(images, ok, errors, io, nbytes, 0.0)


class ParquetRows(_ReadOnce):
    """The rows of a Parquet unit: encoded images, or pre-decoded pixels."""

    def __init__(self, spec: ReadSpec, fs: Any, root: str, unit: ReadUnit,
                 ids: np.ndarray) -> None:
        self.spec, self.unit, self.ids = spec, unit, ids
        self.keys = draw_keys(ids, unit.occurrence)
        io: dict[str, int] = {}
        self.values, self.where, nbytes = _parquet.read_rows(spec, fs, root, unit, ids, io)
        if spec.decoded is not None:
            delivered = len(ids) * int(np.prod(spec.decoded))
        else:
            delivered = sum(len(d) for d in self.values
                            if isinstance(d, (bytes, bytearray, memoryview)))
        super().__init__(io, nbytes, delivered)

    def part(self, part: slice, out: np.ndarray | None) -> Part:
        if self.spec.decoded is not None:
            rows, keys = self.values[part], self.keys[part]
            ok = np.ones(len(rows), dtype=bool) if rows.valid is None else rows.valid.copy()
            errors = [DecodeError("missing", "no pixels (a null cell of the image column)",
                                  path=self.where[part][k], sample_id=int(self.ids[part][k]))
                      for k in np.flatnonzero(~ok)]
            if errors:
                rows, keys = rows[ok], keys[ok]
            images = self.spec.transform.apply_decoded(rows, keys, seed=self.spec.seed,
                                                       epoch=self.unit.epoch, out=out)
        else:
            images, ok, errors = transform_encoded(self.spec, self.unit, self.ids[part],
                                                   self.values[part], self.where[part], out,
                                                   keys=self.keys[part])
        io, nbytes = self._spent()
        return Part(images, ok, errors, io, nbytes, 0.0)


class _RowGroupFetch:
    """The encoded values of a Parquet unit's missed rows: its row groups read once, on the
    first miss, then served from memory."""

    def __init__(self, spec: ReadSpec, fs: Any, root: str, unit: ReadUnit,
                 ids: np.ndarray) -> None:
        self.spec, self.fs, self.root, self.unit, self.ids = spec, fs, root, unit, ids
        self.values: Any = None

    def __call__(self, part: slice, miss: list[int]) -> tuple[list[Any], dict[str, int]]:
        fetched = 0
        io: dict[str, int] = {}
        if self.values is None:
            self.values, _, fetched = _parquet.read_rows(self.spec, self.fs, self.root,
                                                         self.unit, self.ids, io)
        values = self.values[part]
        picked = [values[k] for k in miss]
        delivered = sum(len(v) for v in picked if isinstance(v, (bytes, memoryview)))
        return picked, {**io, "io_bytes_fetched": int(fetched),
                        "io_bytes_delivered": int(delivered)}


class CachedPixels:
    """Decoded pixels from the pipeline's decoded cache; misses fetched and decoded.

    Hits are only cropped. A miss in the admitted subset is decoded whole into a cache entry
    and written, while this process's fill budget (:class:`raying.read.decoded_cache.FillBudget`)
    allows; every other miss takes the cache-off path (only the crop's region decoded).
    Pixels are looked up one slice at a time, so a task holds a slice's decoded images, not
    its whole unit's.
    """

    def __init__(self, spec: ReadSpec, unit: ReadUnit, ids: np.ndarray, where: list[str],
                 fetch: Any, *, bytes_from_io: bool) -> None:
        self.spec, self.unit, self.ids, self.where, self.fetch = spec, unit, ids, where, fetch
        self.keys = draw_keys(ids, unit.occurrence)
        # Row groups count what their (shared, once per unit) read fetched; files count the
        # encoded bytes of the misses they decoded.
        self.bytes_from_io = bytes_from_io

    def part(self, part: slice, out: np.ndarray | None) -> Part:
        t0 = time.perf_counter()
        spec, ids = self.spec, self.ids[part]
        cache = _decoded.DecodedCache.of(spec)
        admit = cache.admits(ids) if cache is not None else None  # the ids looked up here
        items: list[Any] = cache.get(ids, admit) if cache is not None else [None] * len(ids)
        get_s = time.perf_counter() - t0
        miss = [k for k, a in enumerate(items) if a is None]
        io: dict[str, int] = {"cache_decoded_hits": len(ids) - len(miss),
                              "cache_decoded_lookups": len(ids)}
        nbytes = 0
        fill_s = 0.0
        budget = (None if cache is None
                  else _decoded.fill_budget(cache.directory, spec.decoded_cache_fill))
        if miss:
            datas, fetched = self.fetch(part, miss)
            add_counters(io, fetched)
            for k, data in zip(miss, datas, strict=True):
                items[k] = data
                if data is not None and not isinstance(data, BaseException):
                    nbytes += len(data)
            if cache is not None:
                picks = [k for k in miss if admit[k] and items[k] is not None
                         and not isinstance(items[k], BaseException)]
                picks = picks[:budget.allow(len(picks))]
                if picks:
                    t1 = time.perf_counter()
                    _decoded.fill(cache, ids, items, picks, max_pixels=spec.max_pixels)
                    fill_s = time.perf_counter() - t1
                    budget.spend(len(picks), fill_s)
        if self.bytes_from_io:
            nbytes = io.get("io_bytes_fetched", 0)
        if "io_bytes_fetched" not in io:
            add_counters(io, {"io_bytes_fetched": int(nbytes), "io_bytes_delivered": int(nbytes)})
        read_s = time.perf_counter() - t0
        t2 = time.perf_counter()
        # Misses of the admitted ids decode at full scale, so that such a sample looks the
        # same whether it was a hit; ids the pipeline's cache never holds may decode
        # DCT-scaled. The pipeline's share decides, not this node's (a node with less room
        # admits fewer), so that a sample looks the same on every node.
        scaled: Any = False
        if cache is not None and spec.decoded_cache_admit < 1.0:
            scaled = ~_decoded.admitted(ids, spec.decoded_cache_admit)
        res = _render(spec, self.unit, ids, items, self.where[part], out, scaled=scaled,
                      keys=self.keys[part])
        if budget is not None:
            # The lookup's time is shared by the ids looked up (the admitted ones): a hit
            # costs its share and a crop; the misses' share is time the cache added.
            looked = max(1, int(np.count_nonzero(admit)))
            hits = io["cache_decoded_hits"]
            crops = sum(isinstance(a, np.ndarray) and a.ndim >= 2 for a in items)
            hit_s = (get_s * hits / looked
                     + (res.decoded_s * hits / crops if crops else 0.0))
            budget.note(len(items) - crops, time.perf_counter() - t2 - res.decoded_s,
                        hits, hit_s)
            # Credit is earned on the part's time without the cache's additions (its fills,
            # its misses' lookups), which spend from it, so that together they stay within
            # the share of the cache-off time.
            miss_s = get_s * sum(1 for k in miss if admit[k]) / looked
            budget.earn(max(0.0, time.perf_counter() - t0 - fill_s - miss_s), hits=hits,
                        overhead=miss_s)
        return Part(res.images, res.ok, res.errors, io, int(nbytes), read_s)


def transform_encoded(spec: ReadSpec, unit: ReadUnit, ids: np.ndarray, datas: Any,
                      where: list[str], out: np.ndarray | None = None, *,
                      keys: np.ndarray | None = None):
    """Decode and augment encoded values (errors of the read itself included), in order:
    ``(images, ok, errors)``. ``keys``: what the random draws are made from, where not the
    ids (:func:`raying.image.rng.draw_keys`)."""
    res = _render(spec, unit, ids, datas, where, out, keys=keys)
    return res.images, res.ok, res.errors


def _render(spec: ReadSpec, unit: ReadUnit, ids: np.ndarray, datas: Any, where: list[str],
            out: np.ndarray | None, *, scaled: Any = True,
            keys: np.ndarray | None = None):
    """:func:`transform_encoded` as the transform's result (errors named by location)."""
    clean: list[Any] = []
    pre_errors: dict[int, DecodeError] = {}
    for k, d in enumerate(datas):
        if isinstance(d, DecodeError):  # the reader's own verdict on the cell, kept as given
            pre_errors[k] = DecodeError(d.reason, d.detail, path=where[k], sample_id=int(ids[k]))
            clean.append(None)
        elif isinstance(d, BaseException):
            pre_errors[k] = DecodeError("read_error", _parquet._first_line(d), path=where[k],
                                        sample_id=int(ids[k]))
            clean.append(None)
        else:
            clean.append(d)
    res = spec.transform.apply_encoded(clean, ids if keys is None else keys, seed=spec.seed,
                                       epoch=unit.epoch,
                                       max_pixels=spec.max_pixels, out=out, scaled=scaled)
    ok = np.asarray(res.ok, dtype=bool)
    # The transform lists its errors in input order, one for each row that is not ok.
    errors = []
    for pos, e in zip(np.flatnonzero(~ok), res.errors, strict=True):
        errors.append(pre_errors.get(int(pos)) or DecodeError(
            e.reason, e.detail, path=where[pos], sample_id=int(ids[pos])))
    return dataclasses.replace(res, ok=ok, errors=errors)
