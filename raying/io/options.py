"""Settings of the I/O layer: read planning (IOConfig) and the tiered cache (CacheConfig)."""

from __future__ import annotations

import dataclasses
import os
import tempfile
from collections.abc import Mapping
from typing import Any

from raying.errors import ConfigError

# --- cache ------------------------------------------------------------------------------------
CACHE_POLICIES = ("priority", "lru")
# Evict the entries the sampler is least likely to want again (lowest expected future reads).
DEFAULT_CACHE_POLICY = "priority"
# The memory tier is a size-bounded directory on tmpfs, shared by every worker of the node.
DEFAULT_MEMORY_CACHE_DIR = ("/dev/shm/raying-cache" if os.path.isdir("/dev/shm")
                            else os.path.join(tempfile.gettempdir(), "raying-cache-mem"))
# An entry not drawn for D draws is credited with at most this many reads per D draws, so a
# sample whose priority fell (and is no longer drawn) loses its place even though the cache
# never hears its new priority.
DEFAULT_CACHE_DECAY_READS = 2.0
# How long a process waits for another one holding a tier's index lock.
DEFAULT_CACHE_LOCK_TIMEOUT_S = 60.0
# Files with no index row (left by a crashed writer) older than this are deleted on open.
DEFAULT_CACHE_ORPHAN_AGE_S = 300.0
# Bytes of offers waiting for the background writer (at most 1/16 of the tiers' capacity);
# offers beyond it are dropped.
DEFAULT_CACHE_QUEUE_BYTES = 64 * 1024**2
# On slow storage, an offer that finds the writer's queue full waits up to this long for
# room before it is dropped: fetching a dropped entry again costs more than the wait (on a
# busy node the writer falls behind; dropping there added 12-20% storage requests).
DEFAULT_CACHE_QUEUE_WAIT_S = 1.0
# A reserved entry whose file is still not written after this long (its writer died) may be
# evicted.
DEFAULT_CACHE_PENDING_S = 120.0
# A claim on a file another process or thread is fetching (see CacheConfig.share_reads) is
# ignored after this long, or at once when its owner's process is gone.
DEFAULT_CACHE_INFLIGHT_S = 30.0

# --- planning ---------------------------------------------------------------------------------
# Ranges of one file closer than this are fetched as one request (None: the tier's profile).
DEFAULT_COALESCE_GAP_BYTES: int | None = None
# A coalesced request never grows beyond this.
DEFAULT_MAX_REQUEST_BYTES = 64 * 1024**2
# Windows fetched ahead of the one being decoded (in-process loaders; see Prefetcher).
DEFAULT_PREFETCH_WINDOWS = 1


@dataclasses.dataclass(frozen=True)
class CacheConfig:
    """A tiered cache in front of slow storage: a memory tier and a local-disk tier.

    Both tiers are size-bounded directories with a SQLite (WAL) index, safe to share between
    processes (atomic renames, checksummed entries). The memory tier lives on tmpfs, so every
    Ray worker of a node shares one copy; the disk tier is any local directory. A tier with
    ``*_bytes=0`` is off.

    Args:
        memory_bytes: capacity of the memory tier, in bytes.
        disk_bytes: capacity of the local-disk tier, in bytes.
        memory_dir: directory of the memory tier (tmpfs).
        disk_dir: directory of the disk tier; required when ``disk_bytes > 0``.
        policy: ``"priority"`` (keep the samples the sampler will draw most) or ``"lru"``.
        decay_reads: see ``DEFAULT_CACHE_DECAY_READS``.
        namespace: separates datasets sharing a directory; default: derived from the dataset
            URI by the reader.
        background_writes: admit in a background thread, so reads never wait for the cache
            to fill (False: admit before returning, e.g. for tests).
        share_reads: a miss that another read task of the node (or another thread) is
            already fetching waits for that read instead of fetching the file again ("single
            flight"; claims live in the first tier's index). Off for local files, whose reads
            cost less than a claim.
    """

    memory_bytes: int = 0
    disk_bytes: int = 0
    memory_dir: str = DEFAULT_MEMORY_CACHE_DIR
    disk_dir: str | None = None
    policy: str = DEFAULT_CACHE_POLICY
    decay_reads: float = DEFAULT_CACHE_DECAY_READS
    namespace: str | None = None
    background_writes: bool = True
    share_reads: bool = True

    def __post_init__(self) -> None:
        for name in ("memory_bytes", "disk_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                msg = f"CacheConfig({name}=...) must be an integer >= 0 (bytes), got {value!r}"
                raise ConfigError(msg)
        if self.policy not in CACHE_POLICIES:
            msg = f"CacheConfig(policy=...) must be one of {CACHE_POLICIES}, got {self.policy!r}"
            raise ConfigError(msg)
        if self.disk_bytes and not self.disk_dir:
            msg = (f"CacheConfig(disk_bytes={self.disk_bytes}) needs disk_dir=..., a local "
                   f"directory for the disk tier")
            raise ConfigError(msg)
        if not self.decay_reads > 0:
            msg = f"CacheConfig(decay_reads=...) must be > 0, got {self.decay_reads!r}"
            raise ConfigError(msg)

    @property
    def enabled(self) -> bool:
        """Whether any tier has a capacity."""
        return bool(self.memory_bytes or self.disk_bytes)

    def check_dirs(self) -> None:
        """On this node: every tier's directory exists (or is made now) and is writable.

        Pipelines call it when they are built, so that a bad path is a ConfigError there and
        not a NotADirectoryError in a worker at the first batch.
        """
        for field, path, capacity in (("memory_dir", self.memory_dir, self.memory_bytes),
                                      ("disk_dir", self.disk_dir, self.disk_bytes)):
            if not capacity or not path:
                continue
            if os.path.exists(path) and not os.path.isdir(path):
                msg = (f"CacheConfig({field}={path!r}) is a file, not a directory; point it at "
                       f"a local directory (made if missing)")
                raise ConfigError(msg)
            try:
                os.makedirs(path, exist_ok=True)
            except OSError as exc:
                msg = (f"CacheConfig({field}={path!r}): cannot create it "
                       f"({exc.strerror or exc}); point it at a writable local directory")
                raise ConfigError(msg) from None
            if not os.access(path, os.W_OK | os.X_OK):
                msg = (f"CacheConfig({field}={path!r}) is not writable by this user; point it "
                       f"at a writable local directory")
                raise ConfigError(msg)


@dataclasses.dataclass(frozen=True)
class IOConfig:
    """How a read task fetches its samples: planned reads, per-tier concurrency, a cache.

    Args:
        cache: a CacheConfig (or dict of its fields); None for no cache.
        concurrency: reads in flight per process; None takes the storage tier's profile
            (few for a disk head, many for S3).
        gap_bytes: ranges of one file closer than this are merged; None: the tier's profile.
        max_request_bytes: the largest merged request.
        prefetch_windows: windows fetched ahead by in-process loaders.
        dedupe: read an id drawn several times in a unit once.
    """

    cache: CacheConfig | None = None
    concurrency: int | None = None
    gap_bytes: int | None = DEFAULT_COALESCE_GAP_BYTES
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    prefetch_windows: int = DEFAULT_PREFETCH_WINDOWS
    dedupe: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.cache, Mapping):
            object.__setattr__(self, "cache", CacheConfig(**self.cache))
        if self.cache is not None and not isinstance(self.cache, CacheConfig):
            msg = f"IOConfig(cache=...) must be a CacheConfig, a dict or None, got {self.cache!r}"
            raise ConfigError(msg)
        if self.concurrency is not None and self.concurrency < 1:
            msg = f"IOConfig(concurrency=...) must be >= 1 or None, got {self.concurrency!r}"
            raise ConfigError(msg)
        if self.gap_bytes is not None and self.gap_bytes < 0:
            msg = f"IOConfig(gap_bytes=...) must be >= 0 or None, got {self.gap_bytes!r}"
            raise ConfigError(msg)
        if self.max_request_bytes < 1:
            msg = f"IOConfig(max_request_bytes=...) must be >= 1, got {self.max_request_bytes!r}"
            raise ConfigError(msg)
        if self.prefetch_windows < 0:
            msg = f"IOConfig(prefetch_windows=...) must be >= 0, got {self.prefetch_windows!r}"
            raise ConfigError(msg)

    @classmethod
    def coerce(cls, value: IOConfig | Mapping[str, Any] | None) -> IOConfig | None:
        """Accept an IOConfig, a dict of its fields (``cache`` may be a dict), or None."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, Mapping):
            return cls(**value)
        msg = f"io must be an IOConfig, a dict or None, got {type(value).__name__}"
        raise ConfigError(msg)
