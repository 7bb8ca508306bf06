"""Storage tiers as the planner sees them: reads in flight and merge gaps per kind of storage.

A disk head serves one request at a time, so a few reads in flight keep it busy and more only
add seeks; S3 serves each request in tens of milliseconds but many at once, so it takes many
in flight to fill the link. The number that fills a link is its bandwidth-delay product
divided by the request size; profiles below follow it, and the simulator's tiers
(:mod:`raying.storage.slow`) get theirs computed from their latency and bandwidth.
"""

from __future__ import annotations

import dataclasses
import math
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import pyarrow.fs as pafs

from raying.storage.slow import SlowFileSystemHandler


@dataclasses.dataclass(frozen=True)
class TierProfile:
    """How to read from one kind of storage.

    Attributes:
        name: ``local``, ``ssd``, ``hdd``, ``s3``, ``hdfs`` or ``slow:<tier>``.
        concurrency: reads in flight per process.
        gap_bytes: ranges of one file closer than this are fetched as one request (reading
            the gap costs less than another request).
        latency_s: typical time to first byte of a request (0 when unknown).
        bandwidth_bytes_per_s: typical bandwidth (None when unknown).
    """

    name: str
    concurrency: int
    gap_bytes: int
    latency_s: float = 0.0
    bandwidth_bytes_per_s: float | None = None


PROFILES = {
    # Local files in the page cache: threads only add overhead (measured in storage.read_many).
    "local": TierProfile("local", concurrency=1, gap_bytes=64 * 1024),
    "ssd": TierProfile("ssd", concurrency=16, gap_bytes=256 * 1024, latency_s=1e-4,
                       bandwidth_bytes_per_s=500e6),
    "hdd": TierProfile("hdd", concurrency=2, gap_bytes=1024**2, latency_s=8e-3,
                       bandwidth_bytes_per_s=120e6),
    "s3": TierProfile("s3", concurrency=64, gap_bytes=2 * 1024**2, latency_s=0.03,
                      bandwidth_bytes_per_s=100e6),
    "hdfs": TierProfile("hdfs", concurrency=16, gap_bytes=1024**2, latency_s=5e-3,
                        bandwidth_bytes_per_s=200e6),
}

# A request of this size is what the concurrency of a tier is computed for.
TYPICAL_REQUEST_BYTES = 32 * 1024
MAX_CONCURRENCY = 128


def fill_concurrency(latency_s: float, bandwidth_bytes_per_s: float | None,
                     request_bytes: int = TYPICAL_REQUEST_BYTES) -> int:
    """Reads in flight that keep a link of this latency and bandwidth busy, with 2x headroom.

    Each request holds the link idle for ``latency_s``; ``bandwidth * latency / size``
    requests in flight hide that wait behind other requests' transfers. Rounded up to a
    power of two (pools are kept per bound, so few distinct bounds).
    """
    if latency_s <= 0:
        return 1
    if not bandwidth_bytes_per_s:
        return MAX_CONCURRENCY
    per_request = max(request_bytes, 1) / bandwidth_bytes_per_s
    need = 2 * (latency_s + per_request) / per_request
    return max(2, min(MAX_CONCURRENCY, 2 ** math.ceil(math.log2(need))))


def profile_for(fs: pafs.FileSystem, *, request_bytes: int | None = None) -> TierProfile:
    """The profile of a filesystem from :func:`raying.storage.files.resolve`.

    The slow-storage simulator's wrapper yields a profile computed from its tier (a tier with
    ``concurrency=1`` is a disk head: 2 reads in flight, as for ``hdd``) and the request size
    (default: the mean this process has observed on ``fs``, see :func:`observe`).
    """
    if request_bytes is None:
        request_bytes = typical_request_bytes(fs)
    handler = getattr(fs, "handler", None)
    if isinstance(handler, SlowFileSystemHandler):
        tier = handler.tier
        bw = tier.bandwidth_bytes_per_s
        gap = int(tier.latency_s * bw) if bw else PROFILES["s3"].gap_bytes
        if tier.concurrency is not None:  # a device serving few at once: queue a few more
            conc = min(MAX_CONCURRENCY, 2 * tier.concurrency)
        else:
            conc = fill_concurrency(tier.latency_s, bw, request_bytes)
        return TierProfile(f"slow:{tier.latency_s:g}s", concurrency=conc,
                           gap_bytes=max(gap, 4096), latency_s=tier.latency_s,
                           bandwidth_bytes_per_s=bw)
    if isinstance(fs, pafs.LocalFileSystem):
        return PROFILES["local"]
    if isinstance(fs, pafs.S3FileSystem):
        return PROFILES["s3"]
    if type(fs).__name__ == "HadoopFileSystem":
        return PROFILES["hdfs"]
    return PROFILES["ssd"]


_POOLS_LOCK = threading.Lock()
# (pid, id of fs) -> [requests, bytes] seen by this process.
_OBSERVED: dict[tuple[int, int], list[int]] = {}


def observe(fs: pafs.FileSystem, requests: int, nbytes: int) -> None:
    """Record requests made to ``fs`` and the bytes they returned (sizes the concurrency)."""
    if requests <= 0:
        return
    with _POOLS_LOCK:
        seen = _OBSERVED.setdefault((os.getpid(), id(fs)), [0, 0])
        seen[0] += requests
        seen[1] += nbytes


def typical_request_bytes(fs: pafs.FileSystem) -> int:
    """Mean bytes per request observed on ``fs`` here, else ``TYPICAL_REQUEST_BYTES``."""
    with _POOLS_LOCK:
        seen = _OBSERVED.get((os.getpid(), id(fs)))
    if not seen or seen[0] < 16:
        return TYPICAL_REQUEST_BYTES
    return max(1, seen[1] // seen[0])


# (pid, id of fs, bound) -> (fs, pool); the fs is kept so that its id is never reused, the pid
# keeps a forked child from using its parent's (threadless) pool.
_POOLS: dict[tuple[int, int, int], tuple[pafs.FileSystem, ThreadPoolExecutor]] = {}


def tier_pool(fs: pafs.FileSystem, concurrency: int) -> ThreadPoolExecutor:
    """A process-wide pool of ``concurrency`` reader threads for ``fs``.

    Every loader of the process (threads, prefetchers, read tasks sharing a worker) submits
    its reads of ``fs`` to the same pool, so the tier sees at most ``concurrency`` reads in
    flight from this process, however many callers there are.
    """
    key = (os.getpid(), id(fs), int(concurrency))
    with _POOLS_LOCK:
        entry = _POOLS.get(key)
        if entry is None:
            pool = ThreadPoolExecutor(max_workers=int(concurrency),
                                      thread_name_prefix="raying-io")
            entry = _POOLS[key] = (fs, pool)
        return entry[1]
