"""The read path of a unit of image files: cache tiers first, then planned storage reads.

``run_unit`` (raying/read/task.py) calls :func:`read_samples` for the encoded bytes of an image
unit. With no ``io`` setting it is exactly ``storage.read_many``; with one::

    paths of the unit --dedupe--> distinct files --TieredCache.get_many(scores=P_i)-->
        hits (memory, disk) + misses --plan_files (directory order)--> run_ops on the tier's
        pool (its reads-in-flight bound) --> bytes --put_many(scores=P_i)--> tiers admit

and the account of the unit gets the ``io_*`` and ``cache_*`` counters of
:data:`ACCOUNT_KEYS` (integers; sum them over units, then :func:`summarize`).
"""

from __future__ import annotations

import itertools
import os
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pyarrow.fs as pafs

from raying.options import DEFAULT_CACHE_QUEUE_WAIT_S, IOConfig
from raying.read.cache.tiered import TIER_NAMES, CacheStats, open_cache
from raying.read.planner import OpStats, plan_files, read_amplification, run_ops
from raying.storage import files as _storage
from raying.storage.files import refuse_outage
from raying.storage.tiers import profile_for

_OWNERS = itertools.count()  # a claim owner per fetch: pid, thread and this counter

# Integer counters a unit's account carries when an IOConfig is set (RunAccount sums them).
ACCOUNT_KEYS = (
    "io_requests", "io_bytes_fetched", "io_bytes_delivered", "io_reads_deduped",
    "io_reads_shared",
    "cache_lookups", "cache_corrupt", "cache_dropped", "cache_failed",
    *(f"cache_{what}_{tier}" for tier in TIER_NAMES
      for what in ("hits", "hit_bytes", "admitted", "evicted")),
)


def read_samples(spec: Any, fs: pafs.FileSystem, paths: Sequence[str], unit: Any, *,
                 scores: Any = None) -> tuple[list[Any], dict[str, int]]:
    """The bytes of each path of an image unit (or its error), and the I/O account.

    Args:
        spec: the ReadSpec; its ``io`` (an IOConfig, a dict, or None) picks the read path.
        fs: the dataset's filesystem.
        paths: the unit's file paths on ``fs``, one per id (repeats allowed).
        unit: the ReadUnit; its ``probs`` (the sampler's ``P_i``) score cache entries when
            ``paths`` are the unit's, one per id.
        scores: the scores of ``paths`` where they are some of the unit's rows (the misses
            of a decoded cache): each path's own row's ``P_i``.

    Returns:
        ``(datas, account)``: bytes (or a memoryview) or the StorageError per path; the
        ``io_*``/``cache_*`` counters (when ``spec.io`` is None: ``io_requests``, one per path
        and per retry, and ``io_retries`` if any).
    """
    io = IOConfig.coerce(getattr(spec, "io", None))
    if io is None:
        retried = [0]

        def count(*_: Any) -> None:
            retried[0] += 1

        datas = _storage.read_many(fs, paths, on_retry=count)
        # One request per path read (a whole-file read), and one per retry.
        account = {"io_requests": len(paths) + retried[0]}
        if retried[0]:
            account["io_retries"] = retried[0]
    else:
        probs = getattr(unit, "probs", None) if scores is None else scores
        datas, account = fetch_files(fs, paths, io=io, scores=probs, namespace=spec.dataset_key)
    if any(isinstance(d, _storage.NotFoundError) for d in datas):
        from raying.read.scanned_files import check_local_root

        check_local_root(spec)  # a folder this node does not hold is not bad samples
    refuse_outage(datas)
    return datas, account


def fetch_files(fs: pafs.FileSystem, paths: Sequence[str], *, io: IOConfig,
                scores: Sequence[float] | np.ndarray | None = None, namespace: str = ""
                ) -> tuple[list[Any], dict[str, int]]:
    """Fetch whole files through the cache and the planner (see the module docstring).

    Args:
        fs: the filesystem.
        paths: one path per wanted sample (repeats allowed: read once).
        io: the read settings.
        scores: the sampler's probability per path (cache priority), or None.
        namespace: keeps this dataset's cache keys apart (the dataset URI).

    Returns:
        ``(datas, account)`` as for :func:`read_samples`.
    """
    ops_stats = OpStats()
    cstats = CacheStats()
    # Distinct files, each with the largest probability it was drawn with.
    first: dict[str, int] = {}
    best: dict[str, float] = {}
    for k, p in enumerate(paths):
        first.setdefault(p, k)
        if scores is not None:
            s = float(scores[k])
            best[p] = max(best.get(p, s), s)
    if not io.dedupe:
        first = {f"{p}\0{k}": k for k, p in enumerate(paths)}
    keys = list(first)
    files = [paths[first[k]] for k in keys]
    key_scores = [best.get(f, 0.0) for f in files] if scores is not None else None
    got: list[Any] = [None] * len(keys)
    cache = None
    if io.cache is not None and io.cache.enabled:
        cache = open_cache(io.cache, namespace=namespace, reopen_removed=True)
        got = list(cache.get_many(files, key_scores, stats=cstats))
    miss = [i for i, g in enumerate(got) if g is None]
    profile = profile_for(fs)
    concurrency = io.concurrency or profile.concurrency

    def fetch(idx: list[int]) -> list[Any]:
        ops = plan_files([files[i] for i in idx], dedupe=False)
        return run_ops(fs, ops, len(idx), concurrency=concurrency, stats=ops_stats)

    shared = fetch_missing(cache, files, miss, got, key_scores, fetch, stats=cstats,
                           share=profile.name != "local")
    if cache is not None:
        cstats.add(cache.take_background_stats())
    slot = {p: got[i] for i, p in enumerate(files)} if io.dedupe else None
    datas = ([slot[p] for p in paths] if slot is not None else got)
    delivered = sum(len(d) for d in datas if not isinstance(d, BaseException))
    account = {"io_requests": ops_stats.requests, "io_bytes_fetched": ops_stats.bytes_fetched,
               "io_bytes_delivered": int(delivered),
               "io_reads_deduped": len(paths) - len(keys), "io_reads_shared": shared}
    account.update(cstats.account())
    if ops_stats.retries:
        account["io_retries"] = ops_stats.retries
    return datas, account


def fetch_missing(cache: Any, keys: list[str], miss: list[int], got: list[Any],
                  scores: list[float] | None, fetch: Callable[[list[int]], list[Any]], *,
                  stats: CacheStats, share: bool = True) -> int:
    """Fill ``got[i]`` for the missed ``keys[i]``, with single flight; offer them to the cache.

    Args:
        cache: the TieredCache, or None (then ``fetch`` all of ``miss``).
        keys, got, scores: cache keys, the result slots, their scores.
        miss: positions to fill.
        fetch: positions -> a payload (or the exception) for each, from storage.
        stats: cache counters to add the admissions to.
        share: the storage is slow (not local files): take claims (when the cache allows
            it), so a miss another read of the node is fetching is taken from that read
            instead (see :mod:`raying.read.cache.inflight`), and let offers wait up to
            ``DEFAULT_CACHE_QUEUE_WAIT_S`` for room in the writer's queue.

    Returns:
        How many positions another read's fetch served.
    """
    if not miss:
        return 0
    wait_s = DEFAULT_CACHE_QUEUE_WAIT_S if share else 0.0  # slow storage: refetching costs more
    owner = None
    theirs: list[int] = []
    if cache is not None and share and cache.config.share_reads:
        owner = f"{os.getpid()}.{threading.get_ident()}.{next(_OWNERS)}"
        ours = cache.claim([keys[i] for i in miss], owner, stats=stats)
        theirs = [i for i, mine in zip(miss, ours, strict=True) if not mine]
        miss = [i for i, mine in zip(miss, ours, strict=True) if mine]
    try:
        _fetch_into(cache, keys, miss, got, scores, fetch, stats, owner, wait_s)
    finally:
        if owner is not None:  # claims not handed to the writer (failed reads) go now
            cache.release([keys[i] for i in miss
                           if got[i] is None or isinstance(got[i], BaseException)], owner,
                          stats=stats)
    if not theirs:
        return 0
    waited = cache.wait_shared([keys[i] for i in theirs],
                               [scores[i] for i in theirs] if scores is not None else None,
                               stats=stats)
    for i, payload in zip(theirs, waited, strict=True):
        got[i] = payload
    _fetch_into(cache, keys, [i for i in theirs if got[i] is None], got, scores, fetch, stats,
                None, wait_s)
    return sum(p is not None for p in waited)


def _fetch_into(cache: Any, keys: list[str], idx: list[int], got: list[Any],
                scores: list[float] | None, fetch: Callable[[list[int]], list[Any]],
                stats: CacheStats, owner: str | None, wait_s: float = 0.0) -> None:
    """Fetch positions ``idx`` into ``got``; offer the good ones to the cache.

    With an ``owner``, its claims on what was fetched are released once the tiers decided;
    ``wait_s`` is how long the offer may wait for room in the writer's queue.
    """
    if not idx:
        return
    fetched = fetch(idx)
    keep = []
    for j, i in enumerate(idx):
        got[i] = fetched[j]
        if not isinstance(fetched[j], BaseException):
            keep.append(i)
    if cache is not None and keep:
        done_keys = [keys[i] for i in keep]
        on_done = ((lambda: cache.release(done_keys, owner)) if owner is not None else None)
        cache.put_many(done_keys, [got[i] for i in keep],
                       [scores[i] for i in keep] if scores is not None else None,
                       stats=stats, on_done=on_done, wait_s=wait_s)


def summarize(totals: dict[str, Any]) -> dict[str, Any]:
    """Ratios for ``pipe.stats()`` from summed account counters.

    Returns:
        ``read_amplification`` (bytes fetched from storage per byte delivered),
        ``cache_hit_ratio`` (all tiers) and ``cache_hit_ratio_<tier>`` (share of lookups
        each tier served), and the raw counters (``io_requests`` None where bytes were
        read by requests no one counted: pyarrow's own reads of Parquet without ``io``).
    """
    out: dict[str, Any] = {k: int(totals.get(k, 0)) for k in ACCOUNT_KEYS}
    if out["io_bytes_fetched"] and not out["io_requests"]:
        # Bytes came from reads no one counted: pyarrow's own, of Parquet without ``io``
        # (it coalesces ranges as it sees fit). Unknown, not none.
        out["io_requests"] = None
    out["read_amplification"] = read_amplification(out["io_bytes_fetched"],
                                                   out["io_bytes_delivered"])
    lookups = out["cache_lookups"]
    hits = 0
    for tier in TIER_NAMES:
        h = out[f"cache_hits_{tier}"]
        hits += h
        out[f"cache_hit_ratio_{tier}"] = h / lookups if lookups else float("nan")
    out["cache_hit_ratio"] = hits / lookups if lookups else float("nan")
    return out
