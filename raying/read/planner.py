"""The read planner: a window of planned ids turned into few, ordered, bounded storage requests.

From the ids a sampler will deliver next, the planner builds the requests that fetch them::

    ids of a window --group by file / row group--> wanted pieces (file, offset, length)
        --dedupe (an id drawn twice is read once)--> --order by (directory, file, offset)-->
        --coalesce (ranges closer than the tier's gap become one request)--> ReadOps
        --run on the tier's pool (its reads-in-flight bound)--> bytes per wanted piece

and :class:`Prefetcher` runs the next window's requests while the current window decodes.
Planning is pure (testable without storage); :func:`run_ops` does the I/O.
"""

from __future__ import annotations

import collections
import dataclasses
import posixpath
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

import numpy as np
import pyarrow.fs as pafs

from raying.errors import ConfigError
from raying.options import DEFAULT_MAX_REQUEST_BYTES, settings
from raying.storage import errors as _storage_errors
from raying.storage import files as _storage
from raying.storage.tiers import observe, tier_pool

W = TypeVar("W")
R = TypeVar("R")


@dataclasses.dataclass(frozen=True)
class Piece:
    """One wanted piece of a request: the slot it fills and where it lies.

    Attributes:
        slot: index of the wanted piece in the caller's list.
        offset: first byte in the file (None: the whole file).
        length: bytes (None: the whole file).
    """

    slot: int
    offset: int | None = None
    length: int | None = None


@dataclasses.dataclass(frozen=True)
class ReadOp:
    """One request to storage, serving one or more wanted pieces.

    Attributes:
        path: the file on the filesystem.
        offset: first byte of the request (None: the whole file in one read).
        length: bytes requested (None: the whole file).
        pieces: the pieces this request serves, each cut from its bytes.
    """

    path: str
    offset: int | None
    length: int | None
    pieces: tuple[Piece, ...]

    @property
    def useful_bytes(self) -> int | None:
        """Bytes of the request that some piece wants (None for whole files)."""
        if self.offset is None:
            return None
        spans = sorted((p.offset or 0, (p.offset or 0) + (p.length or 0)) for p in self.pieces)
        total, end = 0, -1
        for lo, hi in spans:
            lo = max(lo, end)
            if hi > lo:
                total += hi - lo
            end = max(end, hi)
        return total


def plan_files(paths: Sequence[str], *, dedupe: bool = True) -> list[ReadOp]:
    """Whole-file requests for ``paths``: one per distinct file, in directory order.

    Files of one directory are read together and by name (neighbours on a disk, one listing
    prefix on an object store); a path wanted twice is read once and fills both slots.

    Args:
        paths: file paths, one per wanted sample (repeats allowed).
        dedupe: merge repeated paths into one request.

    Returns:
        The requests, ordered by (directory, name).
    """
    slots: dict[str, list[int]] = collections.defaultdict(list)
    ops: list[ReadOp] = []
    for k, p in enumerate(paths):
        if dedupe:
            slots[p].append(k)
        else:
            ops.append(ReadOp(p, None, None, (Piece(k),)))
    ops.extend(ReadOp(p, None, None, tuple(Piece(k) for k in ks)) for p, ks in slots.items())
    ops.sort(key=lambda op: (posixpath.dirname(op.path), posixpath.basename(op.path),
                             op.pieces[0].slot))
    return ops


def coalesce_ranges(ranges: Sequence[tuple[str, int, int]], *, gap_bytes: int,
                    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES) -> list[ReadOp]:
    """Ranged requests for wanted byte ranges, neighbours merged.

    Ranges of one file are sorted by offset; the next range joins the current request when
    the hole between them is at most ``gap_bytes`` (reading the hole is cheaper than another
    request) and the request stays within ``max_request_bytes``. Overlapping and repeated
    ranges are fetched once.

    Args:
        ranges: ``(path, offset, length)`` per wanted piece; its index is the piece's slot.
        gap_bytes: the largest hole read through to save a request.
        max_request_bytes: the largest merged request (a single larger range stays whole).

    Returns:
        The requests, ordered by (path, offset).
    """
    if gap_bytes < 0 or max_request_bytes < 1:
        msg = (f"coalesce_ranges needs gap_bytes >= 0 and max_request_bytes >= 1, got "
               f"{gap_bytes!r} and {max_request_bytes!r}")
        raise ConfigError(msg)
    by_file: dict[str, list[tuple[int, int, int]]] = collections.defaultdict(list)
    for k, (path, offset, length) in enumerate(ranges):
        if offset < 0 or length < 0:
            msg = f"range {k} of {path!r} has offset {offset} and length {length}; both >= 0"
            raise ConfigError(msg)
        by_file[path].append((int(offset), int(length), k))
    ops: list[ReadOp] = []
    for path in sorted(by_file):
        spans = sorted(by_file[path])
        start, end = spans[0][0], spans[0][0] + spans[0][1]
        cur = [spans[0]]
        for off, length, k in spans[1:]:
            p_end = off + length
            if off - end <= gap_bytes and max(end, p_end) - start <= max_request_bytes:
                cur.append((off, length, k))
                end = max(end, p_end)
                continue
            ops.append(ReadOp(path, start, end - start, tuple(Piece(c, o, n) for o, n, c in cur)))
            cur, start, end = [(off, length, k)], off, p_end
        ops.append(ReadOp(path, start, end - start, tuple(Piece(c, o, n) for o, n, c in cur)))
    return ops


def row_group_runs(row_groups: np.ndarray) -> list[tuple[int, list[int]]]:
    """Distinct (file, row group) pairs grouped into runs of adjacent row groups.

    Args:
        row_groups: an ``(n, >=2)`` array whose first two columns are (file index, row-group
            index), e.g. ``ReadUnit.row_groups`` of one or several units of a window.

    Returns:
        ``[(file, [g, g+1, ...]), ...]`` in (file, row group) order: each run is one span of
        the file, which :mod:`raying.read.parquet` reads as one ranged request.
    """
    if row_groups is None or len(row_groups) == 0:
        return []
    pairs = np.unique(np.asarray(row_groups, dtype=np.int64)[:, :2], axis=0)
    runs: list[tuple[int, list[int]]] = []
    for f, g in pairs.tolist():
        if runs and runs[-1][0] == f and runs[-1][1][-1] == g - 1:
            runs[-1][1].append(g)
        else:
            runs.append((f, [g]))
    return runs


@dataclasses.dataclass
class OpStats:
    """What a batch of requests cost: requests issued and bytes they returned, attempts
    repeated after a storage failure (and how many items another read in flight served
    instead, see :func:`raying.read.fetch.fetch_missing`)."""

    requests: int = 0
    bytes_fetched: int = 0
    shared: int = 0
    retries: int = 0


def run_ops(fs: pafs.FileSystem, ops: Sequence[ReadOp], n_slots: int, *, concurrency: int,
            retries: int | None = None, backoff: float | None = None,
            stats: OpStats | None = None) -> list[Any]:
    """Run requests on the tier's pool; a failure fills its own slots and never the others'.

    Args:
        fs: the filesystem.
        ops: requests from :func:`plan_files` or :func:`coalesce_ranges`.
        n_slots: number of wanted pieces (the length of the result).
        concurrency: reads in flight; 1 runs them in order in this thread.
        retries, backoff: as in :func:`raying.storage.files.read_bytes`.
        stats: counters to add the requests and fetched bytes to.

    Returns:
        Per slot: the bytes (a memoryview slice for ranged pieces), or the StorageError.
    """
    out: list[Any] = [None] * n_slots
    lock = threading.Lock()
    mine = OpStats()
    retries = settings().read_retries if retries is None else retries
    backoff = settings().read_retry_backoff_s if backoff is None else backoff

    def count(*_: Any) -> None:
        with lock:
            mine.retries += 1

    def one(op: ReadOp) -> None:
        try:
            data = _fetch(fs, op, retries, backoff, count)
        except Exception as exc:  # noqa: BLE001 - each failure is returned in its slots
            for p in op.pieces:
                out[p.slot] = exc
            return
        with lock:
            mine.requests += 1
            mine.bytes_fetched += len(data)
        if op.offset is None:
            for p in op.pieces:
                out[p.slot] = data
            return
        view = memoryview(data)
        for p in op.pieces:
            lo = (p.offset or 0) - op.offset
            out[p.slot] = view[lo:lo + (p.length or 0)]

    if concurrency <= 1 or len(ops) <= 1:
        for op in ops:
            one(op)
    else:
        pool = tier_pool(fs, concurrency)
        for f in [pool.submit(one, op) for op in ops]:
            f.result()
    observe(fs, mine.requests, mine.bytes_fetched)
    if stats is not None:
        stats.requests += mine.requests
        stats.bytes_fetched += mine.bytes_fetched
        stats.retries += mine.retries
    return out


def _fetch(fs: pafs.FileSystem, op: ReadOp, retries: int, backoff: float,
           on_retry: Callable[..., None] | None = None) -> bytes:
    if op.offset is None:
        return _storage.read_bytes(fs, op.path, retries=retries, backoff=backoff,
                                   on_retry=on_retry)

    def ranged() -> bytes:
        with fs.open_input_file(op.path) as f:
            return f.read_at(op.length, op.offset)

    return _storage_errors.retrying(ranged, fs, op.path, retries, backoff, on_retry, None)


class Prefetcher(Iterator[tuple[W, R]]):
    """Fetch the next windows in the background while the caller works on the current one.

    What is in flight with ``depth=1``::

        caller:      decode(w0)       decode(w1)       decode(w2)
        background:  fetch(w1)        fetch(w2)        fetch(w3)

    Up to ``depth + 1`` fetches run at once (the window the caller waits for and ``depth``
    ahead), each in its own thread; their reads share the tier's pool and its bound.

    Args:
        windows: the windows, in order (e.g. lists of ReadUnits).
        fetch: ``window -> result`` (runs in a background thread).
        depth: windows fetched ahead of the one being consumed (0: fetch on demand).

    Yields:
        ``(window, fetch(window))`` in order; an error of ``fetch`` surfaces at its window.
    """

    def __init__(self, windows: Iterable[W], fetch: Callable[[W], R], *, depth: int = 1) -> None:
        if depth < 0:
            msg = f"Prefetcher(depth=...) must be >= 0, got {depth!r}"
            raise ConfigError(msg)
        self._windows = iter(windows)
        self._fetch = fetch
        self._depth = depth
        self._pool = ThreadPoolExecutor(max_workers=depth + 1,
                                        thread_name_prefix="raying-prefetch")
        self._queue: collections.deque[tuple[W, Future]] = collections.deque()
        self._done = False

    def _fill(self) -> None:
        while not self._done and len(self._queue) <= self._depth:
            try:
                w = next(self._windows)
            except StopIteration:
                self._done = True
                return
            self._queue.append((w, self._pool.submit(self._fetch, w)))

    def __next__(self) -> tuple[W, R]:
        self._fill()
        if not self._queue:
            self.close()
            raise StopIteration
        w, fut = self._queue.popleft()
        result = fut.result()
        self._fill()
        return w, result

    def close(self) -> None:
        """Stop fetching ahead (results not yet taken are dropped)."""
        self._done = True
        for _, fut in self._queue:
            fut.cancel()
        self._queue.clear()
        self._pool.shutdown(wait=False)

    def __enter__(self) -> Prefetcher:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def read_amplification(bytes_fetched: int, bytes_delivered: int) -> float:
    """Bytes read from storage per byte delivered (1.0: nothing wasted; NaN: nothing yet)."""
    return bytes_fetched / bytes_delivered if bytes_delivered else float("nan")
