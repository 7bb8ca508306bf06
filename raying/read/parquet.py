"""Reading a unit's Parquet rows: plainly with pyarrow, or planned through the cache.

Planned reads fetch a window's row groups as few ranged requests, through the cache.

For the (file, row group) pairs of a window, the byte range of the wanted column's chunk in
each row group comes from the file's footer (read once per process). Ranges of one file are
sorted and merged when the hole between them (the other columns) is under the tier's gap, so
adjacent row groups become one ranged request; cached chunks (raw Parquet bytes, keyed by
file, row group and column) are not requested at all. pyarrow then decodes each chunk from
memory, through a file object that serves only the fetched ranges.
"""

from __future__ import annotations

import bisect
import dataclasses
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from raying.errors import (
    CredentialsError,
    DataError,
    DecodeError,
    FileChangedError,
    RayingError,
    StorageError,
)
from raying.options import IOConfig, settings
from raying.read import scanned_files as _files
from raying.read.cache.tiered import CacheStats, open_cache
from raying.read.fetch import ACCOUNT_KEYS, fetch_missing
from raying.read.planner import OpStats, coalesce_ranges, run_ops
from raying.read.spec import ReadSpec
from raying.read.views import Rows, binary_views
from raying.sampling.plan import ReadUnit
from raying.storage import errors as _storage_errors
from raying.storage import files as _storage
from raying.storage.tiers import profile_for

# Parsed footers a worker keeps (the most recently used first to stay), up to this many
# bytes of serialized footers: a dataset of many files with many row groups would
# otherwise leave every footer it ever read in every read worker.
FOOTERS_KEEP_BYTES = 64 << 20
_FOOTERS: OrderedDict[tuple[int, str, str], tuple[pq.FileMetaData, int]] = OrderedDict()
_FOOTERS_HELD = [0]  # serialized bytes of the footers in _FOOTERS
_FOOTERS_LOCK = threading.Lock()

# A read unit over its byte share runs as slices, one task each (raying.engine.stream), and
# a slice of shuffled rows lies in every row group of its unit: each slice read them all (a
# 4-slice unit read its groups 4 times, ~5 % of a Parquet epoch's CPU here); likewise the
# parts a uniform plan deals a large row group into (raying.sampling.plan). A worker keeps
# the groups it read last, up to this many bytes, for the slices and parts of the same
# groups that come to it; a read of other groups replaces them, and a worker that reads
# nothing for UNIT_GROUPS_KEEP_S drops them (an idle worker holds none).
UNIT_GROUPS_KEEP_BYTES = 64 << 20
UNIT_GROUPS_KEEP_S = 5.0
_UNIT_GROUPS: dict[str, Any] = {"unit": None, "tables": {}, "until": 0.0, "dropper": None}
_UNIT_GROUPS_LOCK = threading.Lock()


def _drop_kept_groups_when_idle() -> None:
    while True:
        with _UNIT_GROUPS_LOCK:
            left = _UNIT_GROUPS["until"] - time.monotonic()
            if left <= 0:
                _UNIT_GROUPS["unit"], _UNIT_GROUPS["tables"] = None, {}
                _UNIT_GROUPS["dropper"] = None
                return
        time.sleep(left)


_PLANNED = "<planned>"  # the kept reads of the planned path, apart from any file's


class _KeptChunks:
    """A planned read's arrays, kept as a plain read's table is (``nbytes`` bounds both)."""

    def __init__(self, arrays: list[pa.Array]) -> None:
        self.arrays = arrays
        self.nbytes = sum(a.nbytes for a in arrays)


def _unit_key(unit: ReadUnit) -> tuple[int, bytes]:
    """What a kept read serves: units of this epoch that read the same row groups (the slices
    of one unit, and the parts a uniform plan deals a large row group into)."""
    groups = unit.row_groups
    return (int(unit.epoch), b"" if groups is None else np.ascontiguousarray(groups).tobytes())


def _kept_groups(unit: ReadUnit, namespace: str, path: str, groups: list[Any], col: str
                 ) -> tuple[Any, Any] | None:
    """The tables kept for this unit's file (``namespace``: the dataset as scanned, so that
    another scan of a rewritten file never meets them)."""
    with _UNIT_GROUPS_LOCK:
        if _UNIT_GROUPS["unit"] != _unit_key(unit):
            return None
        got = _UNIT_GROUPS["tables"].get((namespace, path, tuple(groups), col))
        if got is not None:  # in use: idle is counted from the last read that took them
            _UNIT_GROUPS["until"] = time.monotonic() + UNIT_GROUPS_KEEP_S
        return got


def _keep_groups(unit: ReadUnit, namespace: str, path: str, groups: list[Any], col: str,
                 read: tuple[Any, Any]) -> None:
    key = _unit_key(unit)
    with _UNIT_GROUPS_LOCK:
        if _UNIT_GROUPS["unit"] != key:
            _UNIT_GROUPS["unit"], _UNIT_GROUPS["tables"] = key, {}
        tables = _UNIT_GROUPS["tables"]
        held = sum(t.nbytes for _, t in tables.values())
        if held + read[1].nbytes <= UNIT_GROUPS_KEEP_BYTES:
            tables[(namespace, path, tuple(groups), col)] = read
            _UNIT_GROUPS["until"] = time.monotonic() + UNIT_GROUPS_KEEP_S
            if _UNIT_GROUPS["dropper"] is None:
                dropper = threading.Thread(target=_drop_kept_groups_when_idle, daemon=True,
                                           name="raying-kept-row-groups")
                _UNIT_GROUPS["dropper"] = dropper
                dropper.start()


def footer(fs: Any, path: str, stats: OpStats | None = None, *, cache: Any = None,
           namespace: str = "") -> tuple[pq.FileMetaData, int]:
    """The metadata and size of a Parquet file, read once per process, filesystem and
    dataset identity (``namespace``: a file rewritten in place by a new pack belongs to
    another dataset, and its old footer would point into the new bytes).

    With a ``cache`` (a TieredCache) the footer is also kept in its tiers, so a worker
    process started later on the node does not request it from storage again.
    """
    key = (id(fs), namespace, path)
    with _FOOTERS_LOCK:
        hit = _FOOTERS.get(key)
        if hit is not None:
            _FOOTERS.move_to_end(key)
    if hit is not None:
        return hit
    got = cache.get_many([f"{path}#footer"]) if cache is not None else [None]
    if got[0] is not None:
        view = memoryview(got[0])
        size = int.from_bytes(view[:8], "little")
        md = pq.read_metadata(pa.BufferReader(pa.py_buffer(view[8:])))
    else:
        def count(*_: Any) -> None:
            if stats is not None:
                stats.retries += 1

        def read() -> tuple[int, pq.FileMetaData]:
            with _storage.open_input(fs, path, on_retry=count) as fh:  # its retries count too
                return fh.size(), pq.read_metadata(fh)

        size, md = _retry_storage(fs, path, read, count)
        if stats is not None:
            stats.requests += 1
            stats.bytes_fetched += md.serialized_size + 8
        if cache is not None:  # a footer serves every read of its file: keep it first
            sink = pa.BufferOutputStream()
            md.write_metadata_file(sink)
            cache.put_many([f"{path}#footer"], [size.to_bytes(8, "little")
                                               + sink.getvalue().to_pybytes()], [1.0])
    _keep_footer(key, md, size)
    return md, size


def _keep_footer(key: tuple[int, str, str], md: pq.FileMetaData, size: int) -> None:
    """Keep a parsed footer for the next reads of its file, dropping the least recently used
    beyond ``FOOTERS_KEEP_BYTES`` (the one just read always stays)."""
    with _FOOTERS_LOCK:
        old = _FOOTERS.pop(key, None)
        if old is not None:
            _FOOTERS_HELD[0] -= old[0].serialized_size
        _FOOTERS[key] = (md, size)
        _FOOTERS_HELD[0] += md.serialized_size
        while _FOOTERS_HELD[0] > FOOTERS_KEEP_BYTES and len(_FOOTERS) > 1:
            _, (dropped, _) = _FOOTERS.popitem(last=False)
            _FOOTERS_HELD[0] -= dropped.serialized_size


def chunk_range(md: pq.FileMetaData, group: int, column: str) -> tuple[int, int]:
    """(offset, length) of ``column``'s chunk in row group ``group``.

    A nested column (a struct such as the Hugging Face ``Image``'s ``{bytes, path}``) is
    stored as one chunk per leaf, written side by side: the range spans them all.
    """
    if not 0 <= group < md.num_row_groups:
        msg = f"the file has {md.num_row_groups} row groups, none numbered {group}"
        raise DataError(msg)
    rg = md.row_group(group)
    spans = []
    for i in range(rg.num_columns):
        c = rg.column(i)
        if c.path_in_schema == column or c.path_in_schema.startswith(column + "."):
            start = (c.dictionary_page_offset if c.has_dictionary_page
                     and c.dictionary_page_offset is not None else c.data_page_offset)
            spans.append((int(start), int(start) + int(c.total_compressed_size)))
    if not spans:
        msg = f"Parquet column {column!r} not found (columns: {md.schema.names})"
        raise DataError(msg)
    lo = min(a for a, _ in spans)
    return lo, max(b for _, b in spans) - lo


def read_chunks(fs: Any, items: Sequence[tuple[str, int]], column: str, *, io: IOConfig,
                scores: Sequence[float] | None = None, namespace: str = "",
                stats: OpStats | None = None, cache_stats: CacheStats | None = None,
                check: Any = None) -> list[pa.Array]:
    """The values of ``column`` in each (path, row group), fetched as a planned window.

    Args:
        fs: the filesystem.
        items: (file path, row-group index) pairs; repeats are fetched once.
        column: the column to read (e.g. ``"image"``).
        io: read settings (concurrency, gap, cache).
        scores: expected reads of each item (e.g. the probability mass of its rows drawn),
            the cache's priority.
        namespace: keeps this dataset's cache keys apart.
        stats, cache_stats: counters to add requests, bytes and cache outcomes to.
        check: ``check(path, size)`` sees each file's size once its footer is known, before
            any chunk is read (and may raise).

    Returns:
        One Arrow array per item, in order.
    """
    stats = stats if stats is not None else OpStats()
    distinct = list(dict.fromkeys(items))
    best: dict[tuple[str, int], float] = {}
    if scores is not None:
        for it, s in zip(items, scores, strict=True):
            best[it] = max(best.get(it, float(s)), float(s))
    cache = None
    if io.cache is not None and io.cache.enabled:
        cache = open_cache(io.cache, namespace=namespace, reopen_removed=True)
    metas = {p: footer(fs, p, stats, cache=cache, namespace=namespace)
             for p in dict.fromkeys(p for p, _ in distinct)}
    if check is not None:
        for p, (_, size) in metas.items():
            check(p, size)
    ranges = [chunk_range(metas[p][0], g, column) for p, g in distinct]
    keys = [f"{p}#rg{g}/{column}" for p, g in distinct]
    item_scores = [best.get(it, 0.0) for it in distinct] if scores is not None else None
    raw: list[Any] = [None] * len(distinct)
    if cache is not None:
        raw = list(cache.get_many(keys, item_scores, stats=cache_stats))
    miss = [i for i, r in enumerate(raw) if r is None]
    profile = profile_for(fs)
    gap = profile.gap_bytes if io.gap_bytes is None else io.gap_bytes

    def fetch(idx: list[int]) -> list[Any]:
        ops = coalesce_ranges([(distinct[i][0], *ranges[i]) for i in idx], gap_bytes=gap,
                              max_request_bytes=io.max_request_bytes)
        return run_ops(fs, ops, len(idx), concurrency=io.concurrency or profile.concurrency,
                       stats=stats)

    stats.shared += fetch_missing(cache, keys, miss, raw, item_scores, fetch,
                                  stats=cache_stats if cache_stats is not None else CacheStats(),
                                  share=profile.name != "local")
    for i in miss:
        if isinstance(raw[i], BaseException):
            p, g = distinct[i]
            msg = f"{p}: cannot read row group {g} ({raw[i]})"
            if isinstance(raw[i], StorageError) and not isinstance(raw[i], FileNotFoundError):
                err = type(raw[i])(msg)  # the storage failed, not the file
                err.outage = raw[i].outage
                raise err from raw[i]
            raise DataError(msg) from raw[i]
    arrays: dict[tuple[str, int], pa.Array] = {}
    for path in metas:
        mine = [i for i, (p, _) in enumerate(distinct) if p == path]
        md, size = metas[path]
        source = _RangeFile(size, [(ranges[i][0], raw[i]) for i in mine], fs, path, stats)
        pf = pq.ParquetFile(pa.PythonFile(source, mode="r"), metadata=md)
        for i in mine:
            col = pf.read_row_group(distinct[i][1], columns=[column]).column(0)
            arrays[distinct[i]] = col.combine_chunks() if col.num_chunks != 1 else col.chunk(0)
    return [arrays[it] for it in items]


class UnitGroupError(Exception):
    """Row groups of one file of a unit that cannot be read (file index, groups, cause)."""

    def __init__(self, file: int, groups: list[int], cause: BaseException) -> None:
        super().__init__(f"file {file}: row groups {groups}: {cause}")
        self.file, self.groups, self.cause = file, groups, cause


def read_unit_groups(spec: Any, fs: Any, paths: list[str], groups: Any, column: str,
                     unit: Any, io: IOConfig) -> tuple[list[pa.Array], dict[str, int]]:
    """The ``column`` chunk of each row group of a read unit, as one planned window.

    Args:
        spec: the unit's ReadSpec (its ``dataset_key`` is the cache namespace).
        fs: the dataset's filesystem.
        paths: the path on ``fs`` of each row group's file.
        groups: (file index, row-group index, first id) rows, in read order.
        column: the image column.
        unit: the ReadUnit; the probability mass of its draws in a row group (``unit.probs``)
            is that group's cache score.
        io: the read settings.

    Returns:
        One array per row group and the unit's ``io_*``/``cache_*`` counters.

    Raises:
        UnitGroupError: naming the file (index into ``spec.files``) whose row groups cannot
            be read or decoded, and why; the reader turns it into its DataError.
    """
    files = [int(f) for f in groups[:, 0]]
    items = [(p, int(g)) for p, g in zip(paths, groups[:, 1], strict=True)]
    scores = None
    probs = getattr(unit, "probs", None)
    if probs is not None and getattr(unit, "ids", None) is not None:
        starts = groups[:, 2]
        order = np.argsort(starts, kind="stable")
        k = order[np.searchsorted(starts[order], np.asarray(unit.ids), side="right") - 1]
        scores = np.bincount(k, weights=np.asarray(probs, dtype=np.float64),
                             minlength=len(items)).tolist()
    stats, cstats = OpStats(), CacheStats()
    _files.verify_files(spec, fs, dict(zip(paths, files, strict=True)))
    checks = {p: _files.size_check(spec, f) for p, f in zip(paths, files, strict=True)}

    def check(path: str, size: int) -> None:
        if checks.get(path) is not None:
            checks[path](size)

    try:
        arrays = read_chunks(fs, items, column, io=io, scores=scores,
                             namespace=spec.dataset_key, stats=stats, cache_stats=cstats,
                             check=check)
    except FileChangedError:
        raise
    except (pa.ArrowInvalid, OSError, DataError) as exc:
        for f in dict.fromkeys(files):  # find the file at fault and name it
            mine = [i for i, x in enumerate(files) if x == f]
            try:
                read_chunks(fs, [items[i] for i in mine], column,
                            io=dataclasses.replace(io, cache=None))
            except (pa.ArrowInvalid, OSError, DataError) as one:
                raise UnitGroupError(f, [items[i][1] for i in mine], one) from None
        names = ", ".join(dict.fromkeys(str(spec.files[f]) if spec.files else str(f)
                                        for f in files))
        msg = (f"{spec.root}: cannot read the row groups of {names} together ({exc}), though "
               f"each file alone reads: the files may have changed since the manifest was "
               f"scanned: rescan it")
        raise DataError(msg) from None
    account = dict.fromkeys(ACCOUNT_KEYS, 0)
    account.update(cstats.account())
    account["io_requests"] = stats.requests
    account["io_bytes_fetched"] = stats.bytes_fetched
    account["io_reads_shared"] = stats.shared
    if stats.retries:
        account["io_retries"] = stats.retries
    return arrays, account


class _RangeFile:
    """A read-only file of ``size`` bytes that serves the fetched ranges from memory.

    A read outside them (a layout pyarrow reads differently) goes to storage and is counted,
    so it costs a request but never returns wrong bytes.
    """

    def __init__(self, size: int, segments: list[tuple[int, Any]], fs: Any, path: str,
                 stats: OpStats) -> None:
        segs = sorted(((int(o), memoryview(d)) for o, d in segments), key=lambda s: s[0])
        self._starts = [o for o, _ in segs]
        self._segs = segs
        self._size = size
        self._pos = 0
        self._fs, self._path, self._stats = fs, path, stats
        self.closed = False

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def writable(self) -> bool:
        return False

    def size(self) -> int:
        return self._size

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = 0) -> int:
        base = {0: 0, 1: self._pos, 2: self._size}[whence]
        self._pos = base + offset
        return self._pos

    def read(self, nbytes: int | None = None) -> bytes:
        n = self._size - self._pos if nbytes is None or nbytes < 0 else nbytes
        n = max(0, min(n, self._size - self._pos))
        k = bisect.bisect_right(self._starts, self._pos) - 1
        if k >= 0:
            start, view = self._segs[k]
            lo = self._pos - start
            if lo + n <= len(view):
                self._pos += n
                return bytes(view[lo:lo + n])
        with self._fs.open_input_file(self._path) as f:
            data = f.read_at(n, self._pos)
        self._stats.requests += 1
        self._stats.bytes_fetched += len(data)
        self._pos += len(data)
        return data

    def close(self) -> None:
        self.closed = True


def read_rows(spec: ReadSpec, fs, root: str, unit: ReadUnit, ids: np.ndarray,
                       account: dict[str, int] | None = None):
    """The image values of ``ids``, reading each needed row group once.

    With ``spec.io`` set, the row groups' image chunks are fetched as a planned window
    through the cache (:func:`raying.read.parquet.read_unit_groups`) and ``account`` gets the
    ``io_*``/``cache_*`` counters; else each file's row groups are read with pyarrow.

    Returns (values, locations, bytes): values is a list of buffers (encoded images, None for
    nulls) or, for pre-decoded data, one (n, h, w, c) uint8 array; bytes are those fetched
    (planned path) or the Arrow size of what was read.
    """
    groups = unit.row_groups
    if groups is None or len(groups) == 0:
        msg = "a Parquet read unit needs its row groups"
        raise DataError(msg)
    col = spec.image_column or "image"
    order = np.lexsort((groups[:, 1], groups[:, 0]))
    groups = groups[order]
    scanned = _files.scanned_groups(unit, order)
    chunks: list[pa.Array] = []
    starts: list[tuple[int, int]] = []
    nbytes = 0
    io = IOConfig.coerce(spec.io)
    if io is not None:  # planned, coalesced, cached column chunks
        paths = [_file_path(spec, root, int(f)) for f in groups[:, 0]]
        # The chunks a unit of the same groups read last in this worker (a slice of a unit,
        # a part of a dealt window), kept as the plain path keeps its tables: without them
        # every part fetched the whole window again (8x a one-group file's size on S3).
        pairs = [(int(f), int(g)) for f, g in groups[:, :2].tolist()]
        kept = _kept_groups(unit, spec.dataset_key, _PLANNED, pairs, col)
        if kept is not None:
            arrays, acct = kept[1].arrays, dict.fromkeys(ACCOUNT_KEYS, 0)  # no I/O
        else:
            try:
                arrays, acct = read_unit_groups(spec, fs, paths, groups, col, unit, io)
            except UnitGroupError as exc:
                raise _parquet_error(spec, spec.files[exc.file], exc.groups,
                                     exc.cause) from None
            _keep_groups(unit, spec.dataset_key, _PLANNED, pairs, col,
                         (None, _KeptChunks(arrays)))
        for f in np.unique(groups[:, 0]) if scanned is not None else ():
            mine = groups[:, 0] == f  # (the footers read for the unit, kept in-process)
            md, _ = footer(fs, _file_path(spec, root, int(f)), namespace=spec.dataset_key)
            _files.check_groups(spec, groups[mine], scanned[mine], md)
        offset = 0
        for (_, _, g_start), arr in zip(groups.tolist(), arrays, strict=True):
            starts.append((int(g_start), offset))
            offset += len(arr)
            chunks.append(arr)
        nbytes = acct.pop("io_bytes_fetched", 0)
        if account is not None:
            account.update(acct)
    for f in (np.unique(groups[:, 0]) if io is None else ()):  # else: read above
        sel = groups[groups[:, 0] == f]
        rel = spec.files[int(f)]
        retried = [0]
        path, wanted = _file_path(spec, root, int(f)), [int(g) for g in sel[:, 1]]
        _files.verify_file(spec, fs, path, int(f))
        kept = _kept_groups(unit, spec.dataset_key, path, wanted, col)
        try:
            pf, table = kept or _read_row_groups(fs, path, wanted, col, retried,
                                                 _files.size_check(spec, int(f)))
        except (pa.ArrowInvalid, OSError) as exc:
            raise _parquet_error(spec, rel, sel[:, 1].tolist(), exc) from None
        finally:
            if retried[0] and account is not None:
                account["io_retries"] = account.get("io_retries", 0) + retried[0]
        if kept is None:
            _keep_groups(unit, spec.dataset_key, path, wanted, col, (pf, table))
        _files.check_groups(spec, sel, None if scanned is None else scanned[groups[:, 0] == f],
                       pf.metadata)
        arr = table.column(col)
        nbytes += table.nbytes if kept is None else 0  # bytes read, not reused
        # read_row_groups returns the groups in the order asked; track each group's first row.
        offset = sum(len(c) for c in chunks)
        for g_start, g_rows in _group_rows(sel, pf):
            starts.append((g_start, offset))
            offset += g_rows
        chunks.extend(arr.chunks)
    pos = _positions(starts, ids)
    # {bytes, path}: Hugging Face Image; flatten keeps the struct's nulls.
    path_only = _paths_without_bytes(chunks, pos) if spec.decoded is None else {}
    chunks = [c.flatten()[c.type.get_field_index("bytes")] if pa.types.is_struct(c.type)
              else c for c in chunks]
    if len({c.type for c in chunks}) > 1:  # binary beside large_binary (files' writers differ)
        chunks = [c.cast(pa.large_binary()) for c in chunks]
    values = pa.chunked_array(chunks) if chunks else pa.chunked_array([], pa.binary())
    if spec.decoded is not None:
        flat = values.combine_chunks() if values.num_chunks != 1 else values.chunk(0)
        h, w, c = spec.decoded
        buf = np.frombuffer(flat.buffers()[1], dtype=np.uint8)
        buf = buf[flat.offset * h * w * c:(flat.offset + len(flat)) * h * w * c]
        if not flat.null_count:
            return Rows(buf.reshape(len(flat), h, w, c), pos), None, nbytes
        # A null cell's slot holds whatever the writer left (zeros, with pyarrow): set aside
        # as missing, named by its location, never delivered as pixels.
        valid = np.asarray(flat.is_valid().to_numpy(zero_copy_only=False))[pos]
        return (Rows(buf.reshape(len(flat), h, w, c), pos, valid),
                row_locations(spec, unit, ids), nbytes)
    views = binary_views(values, pos)
    for k, path in path_only.items():
        views[k] = DecodeError("missing", f"a Hugging Face Image cell with only a path "
                               f"({path!r}) and no bytes: raying reads the image bytes the "
                               f"Parquet file holds, never the files such paths name; store "
                               f"the bytes in the column (datasets' embed_table_storage, as "
                               f"push_to_hub does) or scan the images' folder instead")
    return views, row_locations(spec, unit, ids), nbytes


def _paths_without_bytes(chunks: list[Any], pos: np.ndarray) -> dict[int, str]:
    """``{k: path}`` for the rows ``pos[k]`` of a Hugging Face Image column (a ``{bytes,
    path}`` struct) whose bytes are null and whose path is set: such a cell names a file
    raying does not follow, and its error says so."""
    paths, missing = [], False
    for c in chunks:
        none = pa.nulls(len(c), pa.string())
        if not (pa.types.is_struct(c.type) and c.type.get_field_index("path") >= 0):
            paths.append(none)
            continue
        fields = c.flatten()
        raw, path = fields[c.type.get_field_index("bytes")], fields[c.type.get_field_index("path")]
        if not raw.null_count:  # every cell holds its bytes (the common case)
            paths.append(none)
            continue
        missing = True
        try:
            path = path.cast(pa.string()) if not pa.types.is_string(path.type) else path
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError):  # paths not text: name none
            path = none
        paths.append(pc.if_else(raw.is_null(), path, none))
    if not missing:
        return {}
    picked = pa.chunked_array(paths, pa.string()).take(pa.array(pos)).to_pylist()
    return {k: p for k, p in enumerate(picked) if p is not None}


def _file_path(spec: ReadSpec, root: str, f: int) -> str:
    """Path on the filesystem of the dataset's ``f``-th Parquet file."""
    rel = spec.files[f] if spec.files else root
    return f"{root.rstrip('/')}/{rel}" if rel != root else root


class _NotRetried(RayingError):
    """Carries a failure that another attempt cannot fix out of the retry loop, unchanged."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__(str(cause))
        self.cause = cause


def _read_row_groups(fs: Any, path: str, groups: list[int], col: str | list[str],
                     retried: list[int], check: Any = None) -> tuple[pq.ParquetFile, pa.Table]:
    """Open ``path`` and read ``col`` (one column or several) of ``groups``, retried as
    :func:`_retry_storage` says; the retries are counted in ``retried[0]``. ``check(size)``,
    if given, sees the file's size before anything is read (and may raise)."""
    cols = [col] if isinstance(col, str) else list(col)

    def count(*_: Any) -> None:
        retried[0] += 1

    def read() -> tuple[pq.ParquetFile, pa.Table]:
        with _storage.open_input(fs, path, on_retry=count) as fh:  # the open's retries too
            if check is not None:
                check(fh.size())
            pf = pq.ParquetFile(fh)
            return pf, pf.read_row_groups(groups, columns=cols)

    return _retry_storage(fs, path, read, count)


def _retry_storage(fs: Any, path: str, read: Any, on_retry: Any) -> Any:
    """``read()``, run again (with the settings' retries and backoff) when the storage failed.

    Opening a file is not enough to know the storage is there: on HDFS the open asks only the
    NameNode, and a DataNode that is down fails the reads that follow. Failures of the
    storage (network-class) are retried, each retry reported to ``on_retry``; a file that does
    not parse is not retried and its error surfaces unchanged.
    """
    def attempt() -> Any:
        try:
            return read()
        except (pa.ArrowInvalid, OSError) as exc:
            if isinstance(exc, StorageError) or _storage_errors.classify(exc) != "network":
                raise _NotRetried(exc) from None  # the open's own retries are done
            raise

    s = settings()
    try:
        return _storage_errors.retrying(attempt, fs, path, s.read_retries,
                                        s.read_retry_backoff_s, on_retry)
    except _NotRetried as exc:
        raise exc.cause from None


def _parquet_error(spec: ReadSpec, rel: str, groups: list[int], exc: BaseException
                   ) -> DataError | StorageError:
    if isinstance(exc, FileNotFoundError):
        # The scan listed it: this node does not hold the dataset, or the file was removed or
        # moved since; not a corrupt file.
        _files.check_local_root(spec, file=rel)
        return DataError(f"{spec.root.rstrip('/')}/{rel} does not exist: it was removed or "
                         f"moved since the manifest was scanned; scan the dataset again")
    if isinstance(exc, StorageError) and not isinstance(exc, FileNotFoundError):
        # Unreachable or refused storage says nothing about the file: keep the storage error.
        kind = type(exc) if isinstance(exc, CredentialsError) else StorageError
        # Whole: raying's own storage message ends with the fix (the endpoint or the
        # credentials to set), which a first line of 200 characters cut off.
        err = kind(f"{spec.root.rstrip('/')}/{rel}: cannot read row groups {groups}: {exc}")
        err.outage = exc.outage
        return err
    return DataError(f"{spec.root.rstrip('/')}/{rel}: cannot read row groups {groups} "
                     f"({_first_line(exc)}); the file may be corrupt or changed since the "
                     f"manifest was scanned: rescan it")


def _group_rows(sel: np.ndarray, pf: pq.ParquetFile):
    for _, g, start in sel:
        yield int(start), pf.metadata.row_group(int(g)).num_rows


def row_locations(spec: ReadSpec, unit: ReadUnit, ids: np.ndarray) -> list[str]:
    groups: Any = unit.row_groups
    first = groups[:, 2]
    sort = np.argsort(first)
    k = sort[np.searchsorted(first[sort], ids, side="right") - 1]
    return [f"{spec.files[int(groups[j, 0])]}#rg{int(groups[j, 1])}/row{int(i - groups[j, 2])}"
            for i, j in zip(ids, k, strict=True)]


def _first_line(exc: BaseException) -> str:
    text = str(exc)
    return (text.splitlines()[0] if text else type(exc).__name__)[:200]


def read_columns(spec: ReadSpec, fs: Any, root: str, unit: ReadUnit, ids: np.ndarray,
                 account: dict[str, int] | None = None) -> tuple[dict[str, np.ndarray], int]:
    """The extra columns (``spec.columns``) of ``ids``, aligned with them.

    Each file's row groups of the unit are read once, for those columns only, with pyarrow
    (the planned, cached path fetches the image column; these columns are small beside it).

    Returns:
        One array per column (see :mod:`raying.dataset.columns`) and the Arrow bytes read.
    """
    from raying.dataset import columns as _columns

    # Each column is read by its Parquet name and given to the block under its batch key.
    names = [desc.get("source", key) for key, desc in spec.columns]
    groups = unit.row_groups
    if groups is None or len(groups) == 0:
        msg = "a Parquet read unit needs its row groups"
        raise DataError(msg)
    order = np.lexsort((groups[:, 1], groups[:, 0]))
    groups = groups[order]
    scanned = _files.scanned_groups(unit, order)
    tables: list[pa.Table] = []
    table_files: list[int] = []  # the file each table was read from
    table_starts: list[int] = []  # each table's first row in the concatenated rows
    starts: list[tuple[int, int]] = []
    offset = 0
    for f in np.unique(groups[:, 0]):
        table_starts.append(offset)
        table_files.append(int(f))
        sel = groups[groups[:, 0] == f]
        retried = [0]
        _files.verify_file(spec, fs, _file_path(spec, root, int(f)), int(f))
        try:
            pf, table = _read_row_groups(fs, _file_path(spec, root, int(f)),
                                         [int(g) for g in sel[:, 1]], names, retried,
                                         _files.size_check(spec, int(f)))
        except (pa.ArrowInvalid, OSError) as exc:
            raise _parquet_error(spec, spec.files[int(f)], sel[:, 1].tolist(), exc) from None
        finally:
            if retried[0] and account is not None:
                account["io_retries"] = account.get("io_retries", 0) + retried[0]
        _files.check_groups(spec, sel, None if scanned is None else scanned[groups[:, 0] == f],
                       pf.metadata)
        for g_start, g_rows in _group_rows(sel, pf):
            starts.append((g_start, offset))
            offset += g_rows
        tables.append(table)
    pos = _positions(starts, ids)
    # Each file's rows become numpy on their own (files may store a column as int32 and
    # int64, or string and large_string: the description's dtype is what every block gets),
    # and a null is reported with the file that holds it.
    of_table = np.searchsorted(np.asarray(table_starts), pos, side="right") - 1
    picks = [np.flatnonzero(of_table == t) for t in range(len(tables))]
    out = {}
    for key, desc in spec.columns:
        source = desc.get("source", key)
        parts = [_columns.to_numpy(
            tables[t].column(source).take(pa.array(pos[rows] - table_starts[t],
                                                   type=pa.int64())),
            desc, name=source, where=_file_path(spec, root, table_files[t]))
            for t, rows in enumerate(picks) if len(rows)]
        if not parts:
            out[key] = _columns.empty(desc)
        elif len(parts) == 1:
            out[key] = parts[0]
        else:
            joined = np.concatenate(parts)
            column = np.empty_like(joined)
            column[np.concatenate([rows for rows in picks if len(rows)])] = joined
            out[key] = column
    return out, int(sum(t.nbytes for t in tables))


def _positions(starts: list[tuple[int, int]], ids: np.ndarray) -> np.ndarray:
    """Where each id sits in the concatenated rows, given each row group's (first id, offset
    of its first row)."""
    first_ids = np.array([s for s, _ in starts], dtype=np.int64)
    offsets = np.array([o for _, o in starts], dtype=np.int64)
    sort = np.argsort(first_ids)
    first_ids, offsets = first_ids[sort], offsets[sort]
    k = np.searchsorted(first_ids, ids, side="right") - 1
    return offsets[k] + (ids - first_ids[k])
