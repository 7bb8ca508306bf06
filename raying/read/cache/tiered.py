"""The tiered cache in front of slow storage: memory tier, then local-disk tier, then storage.

A lookup walks the tiers in order; what a lower tier serves is offered to the tiers above it,
and what storage serves is offered to every tier (each admits by its own policy). Both tiers
are :class:`~raying.read.cache.dirtier.DirTier` directories, so all processes of a node share them.

Why a tmpfs directory for the memory tier rather than an LRU inside each worker or one actor:
Ray runs read tasks in several worker processes per node; a per-process LRU would hold one
copy per worker and be lost whenever a worker is replaced, and an actor would put an RPC and
an object-store copy on every hit and serialize all workers behind one thread. A file on
``/dev/shm`` is one copy per node, read with a memcpy from the page cache, survives worker
restarts, and shares the disk tier's safety (checksums, atomic renames, a bounded index).

The priority policy ranks entries by expected future reads, ``P_i`` from the sampler at the
entry's latest draw, capped by ``decay_reads / draws since then``; see :class:`DirTier`.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import os
import sqlite3
import threading
import zlib
from collections.abc import Callable, Sequence
from typing import Any

from raying.options import DEFAULT_CACHE_INFLIGHT_S, DEFAULT_CACHE_QUEUE_BYTES, CacheConfig
from raying.read.cache.arrays import decode_array, encode_array
from raying.read.cache.dirtier import DirTier, digest_of, dir_id, entry_bytes
from raying.read.cache.inflight import SingleFlight

logger = logging.getLogger(__name__)

# How long close() waits for the background writer to finish the entry it is writing.
DEFAULT_CLOSE_WAIT_S = 5.0

__all__ = ["CacheStats", "DirTier", "TieredCache", "decode_array", "digest_of", "encode_array",
           "entry_bytes", "open_cache"]

TIER_NAMES = ("memory", "disk")


@dataclasses.dataclass
class CacheStats:
    """What the cache did for some lookups; :meth:`account` flattens it for a unit's account.

    Attributes:
        lookups: keys looked up.
        hits: keys served, per tier name.
        hit_bytes: payload bytes served, per tier name.
        admitted: entries written, per tier name.
        evicted: entries evicted, per tier name.
        corrupt: entries found corrupt (dropped and refetched).
        dropped: offers not admitted because the background writer's queue was full.
        failed: tier operations that failed (a full or read-only filesystem under a tier):
            their lookups counted as misses, their writes skipped.
    """

    lookups: int = 0
    hits: dict[str, int] = dataclasses.field(default_factory=dict)
    hit_bytes: dict[str, int] = dataclasses.field(default_factory=dict)
    admitted: dict[str, int] = dataclasses.field(default_factory=dict)
    evicted: dict[str, int] = dataclasses.field(default_factory=dict)
    corrupt: int = 0
    dropped: int = 0
    failed: int = 0

    def add(self, other: CacheStats) -> None:
        """Add another's counts to these."""
        self.lookups += other.lookups
        self.corrupt += other.corrupt
        self.dropped += other.dropped
        self.failed += other.failed
        for name in ("hits", "hit_bytes", "admitted", "evicted"):
            mine, theirs = getattr(self, name), getattr(other, name)
            for tier, v in theirs.items():
                mine[tier] = mine.get(tier, 0) + v

    def hit_ratio(self, tier: str | None = None) -> float:
        """Share of lookups served by ``tier`` (all tiers when None); NaN before any lookup."""
        if not self.lookups:
            return float("nan")
        hits = sum(self.hits.values()) if tier is None else self.hits.get(tier, 0)
        return hits / self.lookups

    def account(self) -> dict[str, int]:
        """Flat integer counters, summable across units (``cache_*`` keys of run_unit)."""
        out = {"cache_lookups": self.lookups, "cache_corrupt": self.corrupt,
               "cache_dropped": self.dropped, "cache_failed": self.failed}
        for tier in TIER_NAMES:
            out[f"cache_hits_{tier}"] = self.hits.get(tier, 0)
            out[f"cache_hit_bytes_{tier}"] = self.hit_bytes.get(tier, 0)
            out[f"cache_admitted_{tier}"] = self.admitted.get(tier, 0)
            out[f"cache_evicted_{tier}"] = self.evicted.get(tier, 0)
        return out


# What a tier's filesystem or index can raise when it is full, read-only or gone.
_TIER_ERRORS = (OSError, sqlite3.Error)
_warned: set[tuple[str, str]] = set()  # (tier root, operation) warned about in this process


def _tier_failed(name: str, tier: Any, what: str, exc: BaseException) -> None:
    """Log once per tier folder and operation that the tier failed; reads go on uncached."""
    root = str(getattr(tier, "root", "?"))
    if (root, what) in _warned:
        return
    _warned.add((root, what))
    logger.warning("raying cache: the %s tier at %s failed a %s (%s: %s); reading around it "
                   "(counted as cache_failed). Free space there, or give the cache another "
                   "folder", name, root, what, type(exc).__name__, exc)


def _bump(d: dict[str, int], key: str, n: int) -> None:
    if n:
        d[key] = d.get(key, 0) + n


class TieredCache:
    """Memory tier, then disk tier, for raw bytes keyed by location.

    Args:
        config: the tiers' capacities, directories and policy.
        namespace: prefixed to every key (datasets sharing a directory stay apart).

    Example:
        >>> cache = TieredCache(CacheConfig(memory_bytes=2**30, disk_bytes=50 * 2**30,
        ...                                 disk_dir="/mnt/nvme/raying-cache"))
        >>> got = cache.get_many(keys, scores=probs)      # None where missed
        >>> cache.put_many(missed_keys, fetched, scores=missed_probs)
    """

    def __init__(self, config: CacheConfig, *, namespace: str = "") -> None:
        self.config = config
        self.namespace = config.namespace or namespace
        self.tiers: list[tuple[str, DirTier]] = []
        wanted = []
        if config.memory_bytes:
            wanted.append(("memory", config.memory_dir, config.memory_bytes))
        if config.disk_bytes and config.disk_dir:
            wanted.append(("disk", config.disk_dir, config.disk_bytes))
        for name, root, capacity in wanted:
            try:
                self.tiers.append((name, _tier(root, capacity, config, name)))
            except _TIER_ERRORS as exc:
                # The driver checked the folder on its own node; this node's may be read-only,
                # full or a file. The cache is an optimisation: reads go around the tier.
                _warn_unusable(name, root, exc)
        self.stats = CacheStats()
        self._lock = threading.Lock()
        self._background = CacheStats()  # admissions done by the writer, not yet reported
        self._queue: collections.deque[
            tuple[list[str], list[Any], list[float] | None, int, Callable[[], None] | None]] = (
            collections.deque())
        self._queued_bytes = 0
        self._pending: dict[str, Any] = {}  # key -> payload offered, not yet written
        self._busy = False
        self._wake = threading.Condition(self._lock)
        self._thread: threading.Thread | None = None
        self._closed = False
        # Entries waiting to be written serve hits (they are in memory), so the queue must
        # stay small next to the tiers or it would act as an unbounded extra tier.
        self._queue_limit = min(DEFAULT_CACHE_QUEUE_BYTES,
                                (config.memory_bytes + config.disk_bytes) // 16)
        self._flight = SingleFlight(self.tiers, self._queued) if self.tiers else None

    def _keys(self, keys: Sequence[str]) -> list[str]:
        return [f"{self.namespace}\0{k}" for k in keys]

    def _queued(self, full: list[str]) -> dict[int, memoryview]:
        """Entries offered to the writer and not written yet, by position in ``full``."""
        if not self._pending:
            return {}
        with self._wake:
            return {i: memoryview(self._pending[k]) for i, k in enumerate(full)
                    if k in self._pending}

    # -- single flight -------------------------------------------------------------------------
    def claim(self, keys: Sequence[str], owner: str, *,
              stats: CacheStats | None = None) -> list[bool]:
        """Claim the fetch of each key (True: ours to fetch; False: another read has it).

        Claims live in the first tier's index, so every process of the node sees them.
        Release ours with :meth:`release` (``put_many(on_done=...)`` once admitted) and wait
        for the others' with :meth:`wait_shared`.
        """
        if self._flight is None:
            return [True] * len(keys)
        try:
            return self._flight.claim(self._keys(keys), owner)
        except _TIER_ERRORS as exc:  # a full or read-only index: every read fetches its own
            self._flight_failed("claim", exc, stats)
            return [True] * len(keys)

    def release(self, keys: Sequence[str], owner: str, *,
                stats: CacheStats | None = None) -> None:
        """Drop ``owner``'s claims on ``keys``."""
        if self._flight is not None and keys:
            try:
                self._flight.release(self._keys(keys), owner)
            except _TIER_ERRORS as exc:  # the claims go stale on their own
                self._flight_failed("claim release", exc, stats)

    def _flight_failed(self, what: str, exc: BaseException,
                       stats: CacheStats | None) -> None:
        """A claim operation failed on the first tier's index (full, read-only): said once,
        counted (``stats``: the caller's counters too); the read goes on without it."""
        name, tier = self.tiers[0]
        _tier_failed(name, tier, what, exc)
        with self._lock:
            self.stats.failed += 1
        if stats is not None:
            stats.failed += 1

    def wait_shared(self, keys: Sequence[str], scores: Sequence[float] | None = None, *,
                    timeout_s: float = DEFAULT_CACHE_INFLIGHT_S,
                    stats: CacheStats | None = None) -> list[memoryview | None]:
        """Wait for the reads other owners claimed on ``keys``: see SingleFlight.wait_shared."""
        if self._flight is None:
            return [None] * len(keys)
        try:
            return self._flight.wait_shared(self._keys(keys), scores, timeout_s=timeout_s)
        except _TIER_ERRORS as exc:  # the caller fetches what it did not get
            self._flight_failed("shared read", exc, stats)
            return [None] * len(keys)

    def get_many(self, keys: Sequence[str], scores: Sequence[float] | None = None, *,
                 stats: CacheStats | None = None) -> list[memoryview | None]:
        """The verified payload of each key, or None; hits are offered to the tiers above.

        Args:
            keys: locations (e.g. file paths) of the wanted samples, distinct.
            scores: the sampler's probability of each key (the priority policy's score).
            stats: counters to add to (also added to ``self.stats``).
        """
        local = CacheStats(lookups=len(keys))
        full = self._keys(keys)
        out: list[memoryview | None] = [None] * len(keys)
        queued = self._queued(full)  # offered to the writer, not written yet: in this memory
        if queued:
            for i, view in queued.items():
                out[i] = view
            _bump(local.hits, "memory", len(queued))
            _bump(local.hit_bytes, "memory", sum(len(v) for v in queued.values()))
        missing = [i for i in range(len(keys)) if out[i] is None]
        for level, (name, tier) in enumerate(self.tiers):
            served = [i for i in range(len(keys)) if out[i] is not None]
            try:
                found, corrupt = tier.get_many(
                    [full[i] for i in missing],
                    [scores[i] for i in missing] if scores is not None else None,
                    draws=len(keys), touch=[full[i] for i in served],
                    touch_scores=[scores[i] for i in served] if scores is not None else None)
            except _TIER_ERRORS as exc:  # the cache is an optimisation: read around it
                _tier_failed(name, tier, "lookup", exc)
                local.failed += 1
                continue
            local.corrupt += corrupt
            promote = [missing[j] for j in found]
            for j, payload in found.items():
                out[missing[j]] = payload
            _bump(local.hits, name, len(found))
            _bump(local.hit_bytes, name, sum(len(p) for p in found.values()))
            if promote and level > 0:
                if self.config.background_writes:
                    self._submit([full[i] for i in promote], [out[i] for i in promote],
                                 [scores[i] for i in promote] if scores is not None else None,
                                 upto=level)
                else:
                    self._offer(promote, full, out, scores, local, upto=level)
            missing = [i for i in missing if out[i] is None]
        self._record(local, stats)
        return out

    def put_many(self, keys: Sequence[str], payloads: Sequence[bytes | memoryview],
                 scores: Sequence[float] | None = None, *,
                 stats: CacheStats | None = None, background: bool | None = None,
                 on_done: Callable[[], None] | None = None, wait_s: float = 0.0) -> None:
        """Offer fetched payloads to every tier (each admits by its policy and capacity).

        Args:
            keys, payloads, scores: the entries and the sampler's probabilities.
            stats: counters to add this call's admissions to (synchronous writes).
            background: hand the writes to this cache's writer thread and return at once
                (default ``config.background_writes``), so that a read task never waits for
                the cache to fill; their counts come from :meth:`take_background_stats`.
                An offer that finds the queue non-empty and would take it past its bound
                (``DEFAULT_CACHE_QUEUE_BYTES``, at most 1/16 of the tiers' capacity) is
                dropped and counted: the writer is behind, and caching is best effort.
            on_done: called once the tiers have decided (admitted or not), or the offer was
                dropped (releases the fetch's claims; see :meth:`claim`).
            wait_s: with background writes, how long an offer that finds the queue full may
                wait for room before it is dropped (``DEFAULT_CACHE_QUEUE_WAIT_S`` for
                entries fetched from slow storage; 0: drop at once).
        """
        if background is None:
            background = self.config.background_writes
        if background:
            self._submit(self._keys(keys), list(payloads),
                         list(scores) if scores is not None else None, upto=len(self.tiers),
                         on_done=on_done, wait_s=wait_s)
            return
        local = CacheStats()
        idx = list(range(len(keys)))
        try:
            self._offer(idx, self._keys(keys), list(payloads), scores, local,
                        upto=len(self.tiers))
        finally:
            if on_done is not None:
                on_done()
        self._record(local, stats)

    # -- the background writer ----------------------------------------------------------------
    def _submit(self, full: list[str], payloads: list[Any], scores: list[float] | None, *,
                upto: int, on_done: Callable[[], None] | None = None,
                wait_s: float = 0.0) -> None:
        size = sum(len(p) for p in payloads)
        with self._wake:
            def no_room() -> bool:
                return bool(self._queue) and self._queued_bytes + size > self._queue_limit

            if wait_s > 0 and no_room():  # the writer is behind: give it a moment
                self._wake.wait_for(lambda: not no_room(), wait_s)
            dropped = no_room()
            if dropped:
                self._background.dropped += len(full)
            else:
                self._queue.append((full, payloads, scores, upto, on_done))
                self._queued_bytes += size
                for k, p in zip(full, payloads, strict=True):
                    self._pending[k] = p
                if self._thread is None or not self._thread.is_alive():
                    self._thread = threading.Thread(target=self._write_loop, daemon=True,
                                                    name="raying-cache-writer")
                    self._thread.start()
                self._wake.notify_all()
        if dropped and on_done is not None:
            on_done()

    def _write_loop(self) -> None:
        while True:
            with self._wake:
                while not self._queue:
                    if self._closed:
                        return
                    self._wake.wait()
                full, payloads, scores, upto, on_done = self._queue.popleft()
                self._busy = True
            local = CacheStats()
            try:
                self._offer(list(range(len(full))), full, payloads, scores, local, upto=upto)
            except Exception as exc:  # noqa: BLE001 - a cache write must never stop reads
                logger.warning("raying cache: background admission failed (%s)", exc)
            if on_done is not None:
                try:
                    on_done()
                except Exception as exc:  # noqa: BLE001
                    logger.warning("raying cache: releasing claims failed (%s)", exc)
            with self._wake:
                self._queued_bytes -= sum(len(p) for p in payloads)
                for k, p in zip(full, payloads, strict=True):
                    if self._pending.get(k) is p:
                        del self._pending[k]
                self._busy = False
                self.stats.add(local)
                self._background.add(local)
                self._wake.notify_all()

    def close(self) -> None:
        """Stop the writer (what it had not written is dropped) and close the tiers' index
        and lock files in this process. The cache is not used after."""
        with self._wake:
            self._closed = True
            dropped = list(self._queue)
            self._queue.clear()
            self._queued_bytes = 0
            self._pending.clear()
            self._wake.notify_all()
            # The item being written, if any, finishes first: its tier files stay open for it.
            self._wake.wait_for(lambda: not self._busy, DEFAULT_CLOSE_WAIT_S)
        for *_, on_done in dropped:
            if on_done is not None:
                with contextlib.suppress(Exception):
                    on_done()
        for _, tier in self.tiers:
            tier.close()

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until the background writer has admitted everything offered so far."""
        with self._wake:
            return self._wake.wait_for(lambda: not self._queue and not self._busy, timeout_s)

    def take_background_stats(self) -> CacheStats:
        """Admissions and evictions the writer made since the last call (then reset)."""
        with self._wake:
            out, self._background = self._background, CacheStats()
        return out

    def _offer(self, idx: list[int], full: list[str], payloads: Sequence[Any],
               scores: Sequence[float] | None, local: CacheStats, *, upto: int) -> None:
        crcs = [zlib.crc32(payloads[i]) for i in idx] if upto > 1 else None
        for name, tier in self.tiers[:upto]:
            try:
                admitted, evicted = tier.put_many(
                    [full[i] for i in idx], [payloads[i] for i in idx],
                    [scores[i] for i in idx] if scores is not None else None, crcs=crcs)
            except _TIER_ERRORS as exc:  # not written: later lookups miss, reads go on
                _tier_failed(name, tier, "write", exc)
                local.failed += 1
                continue
            _bump(local.admitted, name, admitted)
            _bump(local.evicted, name, evicted)

    def _record(self, local: CacheStats, stats: CacheStats | None) -> None:
        with self._lock:
            self.stats.add(local)
        if stats is not None:
            stats.add(local)

    def used_bytes(self) -> dict[str, int]:
        """Bytes held per tier (all namespaces)."""
        return {name: tier.used_bytes() for name, tier in self.tiers}


_TIERS: dict[tuple, DirTier] = {}
_CACHES: dict[tuple, TieredCache] = {}
_REG_LOCK = threading.RLock()


_WARNED_UNUSABLE: set[str] = set()


def _warn_unusable(name: str, root: str, exc: OSError) -> None:
    """Say once per process and folder that a cache tier cannot be used on this node."""
    import socket

    with _REG_LOCK:
        if root in _WARNED_UNUSABLE:
            return
        _WARNED_UNUSABLE.add(root)
    logger.warning("raying cache: the %s tier at %s cannot be used on this node (%s): %s; reads "
                   "go around it here. Give every node a writable folder at that path (or "
                   "leave the tier out)", name, root, socket.gethostname(), exc)


def _tier(root: str, capacity: int, config: CacheConfig, name: str) -> DirTier:
    key = (os.getpid(), os.path.abspath(root), capacity, config.policy, config.decay_reads)
    with _REG_LOCK:  # opened once per process, even by threads that arrive together
        tier = _TIERS.get(key)
        if tier is None:
            tier = _TIERS[key] = DirTier(root, capacity, policy=config.policy,
                                         decay_reads=config.decay_reads, name=name)
    return tier


def close_finished(finished: Callable[[str], bool]) -> int:
    """Close and forget this process's caches whose every tier directory is ``finished``
    (a closed pipeline's decoded cache, its directory removed): a process that outlives the
    pipeline (a Ray worker) would otherwise keep their index and lock files open, and the
    deleted files' tmpfs pages with them. Returns how many it closed."""
    with _REG_LOCK:
        if not _CACHES:
            return 0
        gone = [k for k, c in _CACHES.items()
                if c.tiers and all(finished(t.root) for _, t in c.tiers)]
        caches = [_CACHES.pop(k) for k in gone]
        roots = {t.root for c in caches for _, t in c.tiers}
        for key in [k for k in _TIERS if os.path.abspath(k[1]) in roots]:
            del _TIERS[key]
    for cache in caches:
        cache.close()
    return len(caches)


def open_cache(config: CacheConfig, *, namespace: str = "",
               reopen_removed: bool = False) -> TieredCache:
    """The process's TieredCache for ``config`` and ``namespace`` (opened once, then reused).

    ``reopen_removed``: a tier whose directory was removed since (docs/io.md: free a tier by
    removing it when no run uses it) is opened again, made anew, instead of dropping every
    entry for the rest of this process (a Ray worker outlives the runs). A decoded cache uses
    it too: its directory, removed when its pipeline closes, is not reached again once its
    tombstone is there (``DecodedCache.of``), and one made again for a new pipeline of the
    same name is that pipeline's."""
    key = (os.getpid(), config, namespace)
    stale: TieredCache | None = None
    with _REG_LOCK:
        cache = _CACHES.get(key)
        if (cache is not None and reopen_removed
                and any(dir_id(t.root) != t.root_id for _, t in cache.tiers)):
            stale = _CACHES.pop(key)
            for k in [k for k, t in _TIERS.items() if dir_id(t.root) != t.root_id]:
                del _TIERS[k]  # the removed directories' tiers (not one made again since)
            # (other namespaces' caches on the same tiers find it too, at their next use)
            cache = None
        if cache is None:
            cache = _CACHES[key] = TieredCache(config, namespace=namespace)
    if stale is not None:
        logger.info("raying cache: a tier's directory was removed; it is made again")
        stale.close()
    return cache
