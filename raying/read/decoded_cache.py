"""The decoded-sample cache: pre-augment pixels kept in a node's memory tier across epochs.

Decoding is 70-85% of a read task's work on JPEG folders. When the decoded dataset fits in a
share of the node's memory, read tasks decode samples whole and write their pixels to the
shared memory tier (tmpfs, see :mod:`raying.read.cache.tiered`); later reads take them back
and only crop, resize and flip (a hit costs about half a decode). Augmentation stays random
per epoch: the cache holds pixels before augmentation.

The cache is not free: a fill decodes the whole image and writes it to new tmpfs pages,
while without the cache a JPEG decodes only the region its crop needs. Filling every sample
in the first epoch made it 1.5-2.5x slower (10,000 256-px JPEGs on 2 cores: a 1-epoch job
6.1 s against 2.6 s). So a read process fills only as its :class:`FillBudget` allows
(``PipelineConfig(decoded_cache_fill=...)``, 4 % of its read time by default, plus what its
hits save; the misses' lookups count against it too): the cache fills over epochs and no
epoch runs more than about that share slower than without it; ``decoded_cache_fill=None``
fills at first read. Misses of a cached pipeline's admitted subset decode at full scale
(only the crop's region), never DCT-scaled, so that a sample's pixels do not depend on
whether it was a hit (ids outside it are never cached and decode as without the cache); on
large JPEGs that costs the misses ~12 %, until hits repay it. So ``decoded_cache="auto"``
(the default) turns it on only when the pipeline is told (``PipelineConfig(epochs=...)``)
that at least ``DEFAULT_DECODED_CACHE_MIN_EPOCHS`` epochs follow, and the whole decoded
dataset fits in a share of free memory, judged from the headers of a sample of files;
otherwise the read path is unchanged. A budget in bytes turns it on
regardless.

Where each node keeps its copy, who owns it and when it goes: :mod:`raying.read.decoded_dirs`.
"""

from __future__ import annotations

import os
import shutil
from typing import Any

import numpy as np

from raying.errors import ConfigError, DecodeError
from raying.read.cache.arrays import decode_array, encode_array, new_array_payload
from raying.read.decoded_dirs import (
    cache_dir,
    close_released,
    mark_owner,
    node_budget,
    released,
    root,
)

# Share of the node's available memory (and of free tmpfs) the auto budget may take.
DEFAULT_DECODED_CACHE_MEMORY_SHARE = 0.25
# "auto" turns the cache on only for jobs of at least this many epochs (see the module doc).
DEFAULT_DECODED_CACHE_MIN_EPOCHS = 32
# Headers sampled to estimate the decoded size of a dataset.
DEFAULT_DECODED_CACHE_PROBE = 16
# Share of a budget smaller than the decoded set that its fixed subset is sized to fill.
DEFAULT_DECODED_CACHE_FILL = 0.9


def _available_memory() -> int:
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def auto_budget(directory: str | None = None) -> int:
    """Bytes the cache may use: a share of available memory and of free space in tmpfs."""
    parent = directory or root()
    while parent and not os.path.exists(parent):
        parent = os.path.dirname(parent)
    try:
        free = shutil.disk_usage(parent or "/").free
    except OSError:
        free = 0
    share = DEFAULT_DECODED_CACHE_MEMORY_SHARE
    return int(min(_available_memory() * share, free * share * 2))


def plan_budget(setting: Any, manifest: Any, *, size_of: Any = None,
                epochs: int | None = None, copies: int = 1) -> int:
    """The cache budget in bytes for a pipeline (0 = off), resolved in the driver.

    Args:
        setting: ``"auto"``, ``"off"``/None/0, or a number of bytes.
        manifest: the dataset; only image folders and encoded Parquet are cached.
        size_of: ``ids -> [(h, w), ...]`` from headers, to estimate the decoded size.
        epochs: the epochs the job reads, if known; ``"auto"`` needs at least
            ``DEFAULT_DECODED_CACHE_MIN_EPOCHS``.
        copies: caches of this one budget that may share a node: the shares of a sharded
            pipeline (Train workers), each of which reads every id over its epochs and so
            caches its own copy. Each gets ``1/copies`` of a fixed budget; ``"auto"`` is on
            only when that many copies of the decoded set fit the node's.
    """
    copies = max(1, int(copies))
    if setting in (None, "off", 0, False):
        return 0
    if manifest.format == "parquet" and manifest.meta.get("decoded"):
        return 0  # already pixels
    if setting == "auto":
        if epochs is None or epochs < DEFAULT_DECODED_CACHE_MIN_EPOCHS:
            return 0
        budget = auto_budget()
        if budget <= 0 or size_of is None:
            return 0
        total = decoded_size(manifest, size_of)
        return budget // copies if total is not None and total * copies <= budget else 0
    if isinstance(setting, (int, np.integer)) and not isinstance(setting, bool) and setting > 0:
        return int(setting) // copies
    msg = (f"decoded_cache must be 'auto', 'off' or a positive number of bytes, got "
           f"{setting!r}")
    raise ConfigError(msg)


def decoded_size(manifest: Any, size_of: Any) -> float | None:
    """The dataset's decoded size in bytes, estimated from the headers of a few files (with
    the cache's per-entry overhead); None when no header could be read."""
    n = len(manifest)
    probe = np.linspace(0, n - 1, num=min(n, DEFAULT_DECODED_CACHE_PROBE)).astype(np.int64)
    dims = [d for d in size_of(probe) if d is not None]
    if not dims:
        return None
    return (float(np.mean([h * w * 3 for h, w in dims])) * 1.05 + 64) * n


def admit_share(budget: int, manifest: Any, size_of: Any) -> float:
    """The share of ids the cache admits: all when the decoded set fits the budget, else a
    fixed subset that does (``DEFAULT_DECODED_CACHE_FILL`` of the budget, for the estimate's
    error). Epochs read in random order: an LRU smaller than the set evicts each entry
    before its next read and never hits; a fixed subset hits on every read of it."""
    if budget <= 0 or size_of is None:
        return 1.0
    total = decoded_size(manifest, size_of)
    if total is None or total <= budget:
        return 1.0
    return max(0.0, min(1.0, DEFAULT_DECODED_CACHE_FILL * budget / total))


def admitted(ids: np.ndarray, share: float) -> np.ndarray:
    """Which ids belong to the admitted subset: a fixed hash of the id below ``share``, the
    same in every process and epoch."""
    ids = np.asarray(ids, dtype=np.uint64)
    if share >= 1.0:
        return np.ones(ids.shape, dtype=bool)
    with np.errstate(over="ignore"):
        mixed = ids * np.uint64(0x9E3779B97F4A7C15)
    return (mixed >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53)) < share


class DecodedCache:
    """Pre-augment pixels of one pipeline, in the pipeline's own memory-tier directory.

    A thing apart from the bytes cache in front of slow storage (:mod:`raying.read.cache`):
    its own directory and budget, keys that are sample ids, LRU eviction (a whole epoch reads
    every id once, so no id is likelier than another), and entries that are arrays. It uses
    the same size-bounded, process-shared tier underneath.
    """

    def __init__(self, directory: str, budget_bytes: int, namespace: str,
                 admit: float = 1.0) -> None:
        from raying.options import CacheConfig
        from raying.read.cache.tiered import open_cache

        self.directory = directory
        self.admit = float(admit)
        # A directory made again since this process opened it (a closed pipeline's name,
        # built again: its tombstone gone, see decoded_dirs.claim) is opened anew: the old
        # handles' index is the removed one, and their writes would go past the new budget.
        # (A pipeline's directory removed at its close is not reached here: ``of`` returns
        # None for it.)
        self._tier = open_cache(CacheConfig(memory_bytes=int(budget_bytes),
                                            memory_dir=directory, policy="lru"),
                                namespace=namespace, reopen_removed=True)

    @classmethod
    def of(cls, spec: Any) -> DecodedCache | None:
        """The cache of ``spec``'s pipeline on this node, or None when it is off or was
        released; with ``"auto"`` its budget is at most this node's own share."""
        close_released()
        if not spec.decoded_cache_bytes:
            return None
        directory = cache_dir(spec.decoded_cache_name)
        if released(directory):
            return None
        budget = spec.decoded_cache_bytes
        mark_owner(directory, spec.decoded_cache_owner)
        if spec.decoded_cache_auto:  # one figure for every process of the node
            budget = min(budget, node_budget(directory, auto_budget))
        share = spec.decoded_cache_admit
        if budget < spec.decoded_cache_bytes:  # this node allows less: a smaller subset
            share *= budget / spec.decoded_cache_bytes
        cache = cls(directory, budget, spec.cache_namespace, share)
        if released(directory):
            # Released between the check above and here: the folder and index this made
            # after the release removed its folder would outlive the pipeline. Let go of
            # them and remove them.
            close_released()
            shutil.rmtree(directory, ignore_errors=True)
            return None
        return cache

    def get(self, ids: np.ndarray, admits: np.ndarray | None = None
            ) -> list[np.ndarray | None]:
        """The cached pixels of each id, None for a miss (ids outside the admitted subset
        are not looked up; ``admits``: :meth:`admits` of ``ids``, when the caller has it)."""
        out: list[np.ndarray | None] = [None] * len(ids)
        mine = np.flatnonzero(self.admits(ids) if admits is None else admits)
        if mine.size:
            got = self._tier.get_many([str(int(ids[k])) for k in mine])
            for k, g in zip(mine, got, strict=True):
                if g is not None:
                    out[k] = decode_array(g)
        return out

    def admits(self, ids: np.ndarray) -> np.ndarray:
        """Mask of ``ids`` in the admitted subset (the only ids cached)."""
        return admitted(np.asarray(ids, dtype=np.int64), self.admit)

    def put(self, ids: list[int], arrays: list[np.ndarray],
            payloads: list[np.ndarray | None] | None = None, *,
            background: bool | None = None) -> None:
        """Offer freshly decoded pixels of the admitted subset; dropped once the pipeline
        was released. ``payloads[k]``, when given and not None, is ``arrays[k]`` already laid
        out as a cache entry (:func:`new_array_payload`), so it is offered without a copy.
        ``background=False`` writes them before returning (the tier's default otherwise)."""
        if released(self.directory):
            return
        keep = np.flatnonzero(self.admits(ids))
        if keep.size:
            bodies = [payloads[k] if payloads is not None and payloads[k] is not None
                      else encode_array(arrays[k]) for k in keep]
            self._tier.put_many([str(int(ids[k])) for k in keep],
                                [memoryview(b).cast("B") for b in bodies],
                                background=background)


class FillBudget:
    """How many admitted misses a read process may decode whole and write to the cache now.

    Filling costs a read task more than the cache-off path: the whole image is decoded
    (not only the crop's region) and written to new tmpfs pages. The budget keeps that extra
    time within ``share`` of the process's read time, and lets the cache pay for its own
    filling with what its hits save:

    - each part's time, less what the cache added to it (its fills, its misses' lookups),
      earns ``share`` of itself as credit;
    - each hit earns what it saved: a row's decode and crop minus a hit's lookup and crop,
      both running means measured in this process (:meth:`note`);
    - each fill spends the time it took, counted whole (the region decode it replaces is not
      subtracted, so the real extra stays under the budget);
    - each miss's lookup spends its time too, up to half of what its part earned: in epoch 0
      every lookup misses, ~5 us a row against ~0.3 ms of decode.

    So epoch 0 runs at most ``share`` slower than without the cache (where the misses'
    lookups take less than half of it; plus the little the budget does not time: the
    cache's handle and admission mask per part), no later epoch is
    slower by more than that either, and the fill speeds up as hits accrue (10,000 JPEGs of
    256 px on 2 cores: 3.5 % of the set filled in epoch 0 with a share of 5 %, 24 % of
    epoch 7's reads hit). A share of None fills every admitted miss at once.
    """

    def __init__(self, share: float | None) -> None:
        self.share = share
        self.credit = 0.0  # seconds that fills may still spend
        self.cost: float | None = None  # seconds one fill took, a running mean
        self.decode_row: float | None = None  # seconds per row decoded and cropped
        self.hit_row: float | None = None  # seconds per hit: its lookup and crop

    def allow(self, n: int) -> int:
        """How many of ``n`` candidate fills to do now."""
        if self.share is None or n <= 0:
            return max(n, 0)
        if self.credit <= 0:
            return 0
        if self.cost is None:  # the first fill measures what one costs
            return 1
        return min(n, int(self.credit / self.cost))

    def spend(self, n: int, seconds: float) -> None:
        """Record ``n`` fills that took ``seconds``."""
        if n <= 0:
            return
        self.credit -= seconds
        each = seconds / n
        self.cost = each if self.cost is None else 0.8 * self.cost + 0.2 * each

    def note(self, decoded: int, decode_s: float, hits: int, hit_s: float) -> None:
        """Record a part: ``decoded`` rows decoded and cropped in ``decode_s``, ``hits``
        rows looked up in the cache and cropped in ``hit_s``."""
        if decoded > 0:
            each = decode_s / decoded
            self.decode_row = each if self.decode_row is None else (
                0.9 * self.decode_row + 0.1 * each)
        if hits > 0:
            each = hit_s / hits
            self.hit_row = each if self.hit_row is None else 0.9 * self.hit_row + 0.1 * each

    def earn(self, seconds: float, hits: int = 0, overhead: float = 0.0) -> None:
        """Credit for ``seconds`` of the process's read work (a part, without what the cache
        added to it) and for what its ``hits`` saved, less ``overhead``: the time its
        misses' lookups took, at most half the part's credit (the fills keep the other half,
        so that a cache of small images, whose lookups are a larger share of a decode, still
        fills)."""
        if self.share is None:
            return
        earned = self.share * seconds
        self.credit += earned - min(max(0.0, overhead), 0.5 * earned)
        if hits and self.decode_row is not None and self.hit_row is not None:
            self.credit += hits * max(0.0, self.decode_row - self.hit_row)


_FILL_BUDGETS: dict[tuple[str, float | None], FillBudget] = {}


def fill_budget(directory: str, share: float | None) -> FillBudget:
    """This process's fill budget for the cache in ``directory`` (kept across its tasks)."""
    key = (directory, share)
    budget = _FILL_BUDGETS.get(key)
    if budget is None:
        budget = _FILL_BUDGETS[key] = FillBudget(share)
    return budget


class _PayloadAlloc:
    """The ``alloc`` of :func:`raying.image.decode.decode_image_to`: a cache entry's payload
    with its pixels still to be written, kept for the offer."""

    payload: np.ndarray | None = None

    def __call__(self, shape: tuple[int, int, int]) -> np.ndarray:
        self.payload, view = new_array_payload(shape)
        return view


def fill(cache: DecodedCache, ids: np.ndarray, items: list[Any], picks: list[int], *,
         max_pixels: int | None) -> int:
    """Decode ``items[k]`` (encoded) whole for each ``k`` in ``picks``, straight into a cache
    entry, write the entries now, and put the pixels in ``items[k]``. An item that does not
    decode stays encoded: the transform's decode then reports it with its file. Returns how
    many entries were offered."""
    from raying.image.decode import decode_image_to

    keys, arrays, payloads = [], [], []
    for k in picks:
        alloc = _PayloadAlloc()
        try:
            arr, placed = decode_image_to(items[k], alloc, max_pixels=max_pixels)
        except DecodeError:
            continue
        items[k] = arr
        keys.append(int(ids[k]))
        arrays.append(arr)
        payloads.append(alloc.payload if placed else None)
    if keys:
        cache.put(keys, arrays, payloads, background=False)
    return len(keys)


def header_sizes(manifest: Any, ids: np.ndarray) -> list[tuple[int, int] | None]:
    """(h, w) of some samples from their headers (to size the decoded cache)."""
    from raying.image.decode import image_size
    from raying.storage import files as storage

    fs, root = storage.resolve(manifest.root, manifest.storage)
    if manifest.format == "parquet":
        datas = _parquet_probe(manifest, fs, root, ids)
    else:
        paths = [f"{root.rstrip('/')}/{p}" for p in manifest.column("path")[ids]]
        datas = storage.read_many(fs, paths)
    out: list[tuple[int, int] | None] = []
    for data in datas:
        try:
            out.append(None if isinstance(data, BaseException) else image_size(data))
        except DecodeError:
            out.append(None)
    return out


def _parquet_probe(m: Any, fs: Any, root: str, ids: np.ndarray) -> list[Any]:
    """A few encoded values: the first rows of up to 4 row groups among ``ids``."""
    import pyarrow.parquet as pq

    col = m.meta.get("image_column") or "image"
    groups = sorted({(int(m.column("file")[i]), int(m.column("row_group")[i])) for i in ids})
    out: list[Any] = []
    for f, g in groups[:: max(1, len(groups) // 4)][:4]:
        path = f"{root.rstrip('/')}/{m.files[f]}" if m.files[f] != root else root
        try:
            table = pq.ParquetFile(path, filesystem=fs).read_row_group(g, columns=[col])
        except (OSError, ValueError):
            continue
        for v in table.column(col).to_pylist()[:4]:
            v = v.get("bytes") if isinstance(v, dict) else v  # {bytes, path} structs
            if v is not None:
                out.append(v)
    return out
