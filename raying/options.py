"""Every setting of raying in one place: named defaults, the RAYING_* environment overrides,
and the public configuration dataclasses (storage, pipeline, I/O, cache)."""

from __future__ import annotations

import dataclasses
import math
import os
import tempfile
from collections.abc import Mapping
from typing import Any

import numpy as np

from raying.errors import ConfigError

# --- decode ------------------------------------------------------------------------------------
# PIL's own default: images above this many pixels are treated as decompression bombs.
DEFAULT_MAX_IMAGE_PIXELS = 89_478_485

# --- reads and blocks --------------------------------------------------------------------------
# Images per read task: about 100 ms of decode work on one core for 256px JPEGs.
DEFAULT_BLOCK_ROWS = 256
# Parquet row groups shuffled together inside one read task (uniform mode).
DEFAULT_PARQUET_WINDOW_ROW_GROUPS = 4
# Rows per row group written by `raying pack`.
DEFAULT_PACK_ROW_GROUP_ROWS = 256
# Rows per Parquet shard written by `raying pack`.
DEFAULT_PACK_SHARD_ROWS = 4096
# Read tasks in flight per CPU the executor may use.
DEFAULT_INFLIGHT_TASKS_PER_CPU = 2
# Share of the object store that the decoded blocks of read tasks in flight may fill (split
# between the Train workers of one pipeline); the rest is for the part being consumed and
# the blocks the consumer still holds, below Ray's spilling threshold (80 % of the store).
DEFAULT_INFLIGHT_STORE_SHARE = 0.5
# Object store of a local Ray that raying starts itself (``ensure_ray``): this many MB per CPU,
# at least the floor, at most Ray's own default (30% of memory). Ray keeps consumed blocks in
# the store until it needs their room, so its tmpfs pages grow to the store's size whatever
# the read window; the window itself needs ~2 units (~40 MB each at 224 px) per CPU. A 256 MB
# store on 2 CPUs read W1 as fast as a 512 MB one with half the memory, no spilling.
# RAYING_OBJECT_STORE_MB fixes it; 0 keeps Ray's.
DEFAULT_OBJECT_STORE_MB: int | None = None  # None: sized per CPU as below
DEFAULT_OBJECT_STORE_MB_PER_CPU = 128
DEFAULT_OBJECT_STORE_MIN_MB = 256
# Threads a read task uses to fetch objects from remote storage.
DEFAULT_REMOTE_READ_THREADS = 16
# Attempts for a storage read before the error surfaces.
DEFAULT_READ_RETRIES = 5
DEFAULT_READ_RETRY_BACKOFF_S = 0.2

# --- iterators ---------------------------------------------------------------------------------
DEFAULT_PREFETCH_BATCHES = 4
DEFAULT_BATCH_SIZE = 256

# ImageNet statistics, the usual normalization on the device.
DEFAULT_MEAN = (0.485, 0.456, 0.406)
DEFAULT_STD = (0.229, 0.224, 0.225)

# --- priority store ----------------------------------------------------------------------------
DEFAULT_STORE_TICK_S = 0.02
DEFAULT_PLAN_CHUNK_IDS = 4096
# The largest p**alpha a leaf of a priority table holds: sums of n leaves, and of their
# squares (the effective sample size), stay finite for any n below 1e100.
MAX_PRIORITY_LEAF = 1e100
DEFAULT_SNAPSHOT_EVERY_UPDATES = 200_000
DEFAULT_SNAPSHOT_INTERVAL_S = 30.0
DEFAULT_STORE_SHARD_ROWS = 10_000_000
DEFAULT_REPORT_FLUSH_IDS = 1024
DEFAULT_REPORT_FLUSH_S = 0.05
# 1: JPEGs decode only the region their crop needs (raying.image._jpegroi); 0: whole.
DEFAULT_ROI_DECODE = 1
# 1: a Ray that raying starts has its workers import the read path as they start
# (raying.engine.preload); 0: on a worker's first read task.
DEFAULT_PRELOAD_WORKERS = 1
# Share of the gap to the mean that a stale priority closes per update call (see `age`).
DEFAULT_AGE_RATE = 0.05
# The noisy-label guard of prioritized sampling (PrioritizedSampler(guard=True)): a sample
# whose last DEFAULT_GUARD_AFTER reports were all in the top
# (1 - DEFAULT_GUARD_QUANTILE) of priorities, without progress, is drawn at the median
# priority. The quantile is below 0.9 so that a noise rate of 20 % is still caught. Six
# reports rather than three let a hard but learnable sample show progress first: in the
# sampler study's noise part the guarded steps to target stayed within 0.1 of the clean run's
# on 8 seeds of 9 (three runs) with 6, on 1 of 3 with 3 in the same session.
# InfoBatch stores track the same streaks for their statistics.
DEFAULT_GUARD_AFTER = 6
DEFAULT_GUARD_QUANTILE = 0.75
# A high-loss report whose loss fell by at least this share from the first report of its streak
# is progress (a hard sample being learned): it restarts the streak instead of extending it.
DEFAULT_GUARD_DECLINE = 0.2
# How the updates of one store tick fold per id.
COALESCE_MODES = ("last", "max", "ema")


# --- the environment -----------------------------------------------------------------------------
# Every RAYING_* variable raying reads, the Settings field it sets, and its type. They are read
# once, when a Pipeline is built (Settings.from_env), and travel to the read tasks and the
# priority store with the pipeline, so every worker runs with the driver's values.
ENVIRONMENT: dict[str, tuple[str, type]] = {
    "RAYING_MAX_IMAGE_PIXELS": ("max_image_pixels", int),
    "RAYING_BLOCK_ROWS": ("block_rows", int),
    "RAYING_PARQUET_WINDOW_ROW_GROUPS": ("parquet_window_row_groups", int),
    "RAYING_PACK_ROW_GROUP_ROWS": ("pack_row_group_rows", int),
    "RAYING_PACK_SHARD_ROWS": ("pack_shard_rows", int),
    "RAYING_INFLIGHT_TASKS_PER_CPU": ("inflight_tasks_per_cpu", int),
    "RAYING_OBJECT_STORE_MB": ("object_store_mb", int),
    "RAYING_OBJECT_STORE_MB_PER_CPU": ("object_store_mb_per_cpu", int),
    "RAYING_OBJECT_STORE_MIN_MB": ("object_store_min_mb", int),
    "RAYING_REMOTE_READ_THREADS": ("remote_read_threads", int),
    "RAYING_READ_RETRIES": ("read_retries", int),
    "RAYING_READ_RETRY_BACKOFF_S": ("read_retry_backoff_s", float),
    "RAYING_PREFETCH_BATCHES": ("prefetch_batches", int),
    "RAYING_STORE_TICK_S": ("store_tick_s", float),
    "RAYING_PLAN_CHUNK_IDS": ("plan_chunk_ids", int),
    "RAYING_SNAPSHOT_EVERY_UPDATES": ("snapshot_every_updates", int),
    "RAYING_SNAPSHOT_INTERVAL_S": ("snapshot_interval_s", float),
    "RAYING_STORE_SHARD_ROWS": ("store_shard_rows", int),
    "RAYING_REPORT_FLUSH_IDS": ("report_flush_ids", int),
    "RAYING_REPORT_FLUSH_S": ("report_flush_s", float),
    "RAYING_ROI_DECODE": ("roi_decode", int),
    "RAYING_PRELOAD_WORKERS": ("preload_workers", int),
}
# The values each variable may take: (lowest, highest), None where open. Out of range is a
# ConfigError naming the variable when the Pipeline is built, not a silent empty epoch or
# every read failing later in a worker.
ENVIRONMENT_RANGE: dict[str, tuple[float, float | None]] = {
    "RAYING_OBJECT_STORE_MB": (0, None),  # 0: Ray's default
    "RAYING_READ_RETRY_BACKOFF_S": (0, None),
    "RAYING_PREFETCH_BATCHES": (0, None),  # 0: none prepared ahead
    "RAYING_ROI_DECODE": (0, 1),
    "RAYING_PRELOAD_WORKERS": (0, 1),
}
_POSITIVE: tuple[float, float | None] = (1, None)  # every other integer: >= 1


@dataclasses.dataclass(frozen=True)
class Settings:
    """The defaults that the RAYING_* environment may override, as one picklable value.

    A Pipeline reads them once when it is built (:meth:`from_env`) and ships them with its
    read spec; read tasks and the priority store make them theirs (:func:`use`), so a worker
    whose environment differs still runs with the driver's values. See ``ENVIRONMENT`` for
    the variable of each field; docs/configuration.md lists them all.
    """

    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS
    block_rows: int = DEFAULT_BLOCK_ROWS
    parquet_window_row_groups: int = DEFAULT_PARQUET_WINDOW_ROW_GROUPS
    pack_row_group_rows: int = DEFAULT_PACK_ROW_GROUP_ROWS
    pack_shard_rows: int = DEFAULT_PACK_SHARD_ROWS
    inflight_tasks_per_cpu: int = DEFAULT_INFLIGHT_TASKS_PER_CPU
    object_store_mb: int | None = DEFAULT_OBJECT_STORE_MB
    object_store_mb_per_cpu: int = DEFAULT_OBJECT_STORE_MB_PER_CPU
    object_store_min_mb: int = DEFAULT_OBJECT_STORE_MIN_MB
    remote_read_threads: int = DEFAULT_REMOTE_READ_THREADS
    read_retries: int = DEFAULT_READ_RETRIES
    read_retry_backoff_s: float = DEFAULT_READ_RETRY_BACKOFF_S
    prefetch_batches: int = DEFAULT_PREFETCH_BATCHES
    store_tick_s: float = DEFAULT_STORE_TICK_S
    plan_chunk_ids: int = DEFAULT_PLAN_CHUNK_IDS
    snapshot_every_updates: int = DEFAULT_SNAPSHOT_EVERY_UPDATES
    snapshot_interval_s: float = DEFAULT_SNAPSHOT_INTERVAL_S
    store_shard_rows: int = DEFAULT_STORE_SHARD_ROWS
    report_flush_ids: int = DEFAULT_REPORT_FLUSH_IDS
    report_flush_s: float = DEFAULT_REPORT_FLUSH_S
    roi_decode: int = DEFAULT_ROI_DECODE
    preload_workers: int = DEFAULT_PRELOAD_WORKERS

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Settings:
        """The defaults with every RAYING_* variable set in ``environ`` (``os.environ``).

        Raises:
            ConfigError: a variable that does not parse as its type, naming it.
        """
        env = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for name, (field, kind) in ENVIRONMENT.items():
            raw = env.get(name)
            if raw is None or not raw.strip():
                continue
            what = "an integer" if kind is int else "a number"
            try:
                value = kind(raw)
            except ValueError:
                msg = (f"environment variable {name} must be {what}, got {raw!r}; unset it "
                       f"or fix it")
                raise ConfigError(msg) from None
            if name in ENVIRONMENT_RANGE or kind is int:
                low, high = ENVIRONMENT_RANGE.get(name, _POSITIVE)
                ok = value >= low and (high is None or value <= high)  # type: ignore[operator]
                span = f">= {low}" if high is None else f"in [{low}, {high}]"
            else:  # the other float settings are durations (a tick, a flush age): > 0
                ok, span = value > 0, "> 0"
            if not ok or not math.isfinite(value):
                msg = (f"environment variable {name} must be {what} {span}, got {raw!r}; "
                       f"unset it or fix it")
                raise ConfigError(msg)
            values[field] = value
        return cls(**values)


_active: Settings | None = None


# Smallest block a small epoch is cut into (below it, per-task costs dominate).
MIN_BLOCK_ROWS = 32


def epoch_block_rows(rows: int, wanted: int) -> int:
    """Rows per read task of an epoch of ``rows`` for a ``block_rows`` of ``wanted``: the
    wanted rows, or for a small epoch (under 8 blocks) a multiple of 32 that cuts it into
    ~8 tasks, so that it still spreads over the cores (``Pipeline.block_rows`` and
    ``raying advise`` both take it from here)."""
    if rows >= 8 * wanted:
        return wanted
    small = -(-rows // 8)
    return max(1, min(wanted, max(MIN_BLOCK_ROWS, -(-small // 32) * 32)))


def settings() -> Settings:
    """This process's settings: those last given to :func:`use`, else its environment's
    (read once)."""
    global _active
    if _active is None:
        _active = Settings.from_env()
    return _active


def use(value: Settings) -> None:
    """Make ``value`` this process's settings (read tasks and the store, with the driver's)."""
    global _active
    _active = value


@dataclasses.dataclass(frozen=True)
class StorageOptions:
    """How to reach remote storage.

    Every field left as None falls back to the standard environment: the AWS credentials
    chain (env vars, shared config and credentials files, instance roles), ``AWS_REGION`` and
    ``AWS_ENDPOINT_URL``. Secrets never appear in the repr.

    Args:
        endpoint_url: S3-compatible endpoint, e.g. ``http://127.0.0.1:9000``.
        region: S3 region.
        anonymous: read public buckets without credentials.
        profile: a profile of the shared AWS config files.
        access_key_id: explicit access key (prefer the environment).
        secret_access_key: explicit secret key (prefer the environment).
        session_token: explicit session token.
        hdfs_user: user name for HDFS.
        slow: ``(latency_s, bandwidth_bytes_per_s)`` to emulate slow storage in tests/benchmarks.
    """

    endpoint_url: str | None = None
    region: str | None = None
    anonymous: bool = False
    profile: str | None = None
    access_key_id: str | None = dataclasses.field(default=None, repr=False)
    secret_access_key: str | None = dataclasses.field(default=None, repr=False)
    session_token: str | None = dataclasses.field(default=None, repr=False)
    hdfs_user: str | None = None
    slow: tuple[float, float] | None = None

    @classmethod
    def coerce(cls, value: StorageOptions | Mapping[str, Any] | None) -> StorageOptions:
        """Accept a StorageOptions, a dict of its fields, or None."""
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        if isinstance(value, Mapping):
            fields = {f.name for f in dataclasses.fields(cls)}
            kwargs = {}
            for key, val in value.items():
                name = STORAGE_ALIASES.get(key, key)
                if name not in fields:
                    msg = (f"storage option {key!r} is not known; expected one of "
                           f"{sorted(fields)}")
                    raise ConfigError(msg)
                kwargs[name] = val
            return cls(**kwargs)
        msg = f"storage must be a StorageOptions, a dict or None, got {type(value).__name__}"
        raise ConfigError(msg)

    def public_dict(self) -> dict[str, Any]:
        """The non-secret fields, safe to save in a manifest or print."""
        out = dataclasses.asdict(self)
        for secret in ("access_key_id", "secret_access_key", "session_token"):
            out.pop(secret)
        return out


# Other names users give storage options (s3fs's, pyarrow's, boto's), as StorageOptions names.
STORAGE_ALIASES = {"endpoint": "endpoint_url", "endpoint_override": "endpoint_url",
                   "key": "access_key_id", "secret": "secret_access_key",
                   "aws_access_key_id": "access_key_id",
                   "aws_secret_access_key": "secret_access_key",
                   "aws_session_token": "session_token"}


# --- I/O: read planning and the tiered cache ----------------------------------------------------
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
        if self.memory_bytes and not self.memory_dir:
            msg = (f"CacheConfig(memory_bytes={self.memory_bytes}) needs memory_dir=..., a "
                   f"directory on tmpfs (default {DEFAULT_MEMORY_CACHE_DIR!r})")
            raise ConfigError(msg)
        for name in ("memory_dir", "disk_dir"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, (str, os.PathLike)):
                msg = f"CacheConfig({name}=...) must be a directory path, got {value!r}"
                raise ConfigError(msg)
        _number("CacheConfig(decay_reads=...)", self.decay_reads, low=0.0, low_open=True,
                hint=f"pass a number of reads, e.g. {DEFAULT_CACHE_DECAY_READS}")
        for name in ("background_writes", "share_reads"):
            if not isinstance(getattr(self, name), (bool, np.bool_)):
                msg = f"CacheConfig({name}=...) must be True or False, got {getattr(self, name)!r}"
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
            # os.access answers for permissions only (root passes it on /proc, a read-only
            # mount): a real file says whether the tier can write there.
            probe = os.path.join(path, f".raying-probe-{os.getpid()}")
            try:
                with open(probe, "wb") as fh:
                    fh.write(b"raying")
                os.unlink(probe)
            except OSError as exc:
                msg = (f"CacheConfig({field}={path!r}): cannot write a file there "
                       f"({exc.strerror or exc}); point it at a writable local directory")
                raise ConfigError(msg) from None


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
            object.__setattr__(self, "cache", _coerce(CacheConfig, self.cache, "IOConfig cache"))
        if self.cache is not None and not isinstance(self.cache, CacheConfig):
            msg = f"IOConfig(cache=...) must be a CacheConfig, a dict or None, got {self.cache!r}"
            raise ConfigError(msg)
        for name in ("concurrency", "gap_bytes", "max_request_bytes", "prefetch_windows"):
            value = getattr(self, name)
            if value is None and name in ("max_request_bytes", "prefetch_windows"):
                msg = f"IOConfig({name}=...) must be an int, got None"
                raise ConfigError(msg)
            if value is not None and (isinstance(value, bool)
                                      or not isinstance(value, (int, np.integer))):
                msg = f"IOConfig({name}=...) must be an int, got {value!r}"
                raise ConfigError(msg)
        if not isinstance(self.dedupe, (bool, np.bool_)):
            msg = f"IOConfig(dedupe=...) must be True or False, got {self.dedupe!r}"
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
            return _coerce(cls, value, "io")
        msg = f"io must be an IOConfig, a dict or None, got {type(value).__name__}"
        raise ConfigError(msg)


# Share of a read process's time that filling the decoded cache may add (PipelineConfig): 4 %,
# so that with what its budget does not time (a handle and an admission mask per part) the
# cache's first epoch stays within 5 % of the cache-off one.
DEFAULT_DECODED_CACHE_FILL_SHARE = 0.04


@dataclasses.dataclass(frozen=True)
class PipelineConfig:
    """Knobs of the read path; the defaults are what `raying bench` measures.

    Args:
        block_rows: images per read task (~100 ms of decode work at 256 px); None takes
            ``Settings.block_rows`` (RAYING_BLOCK_ROWS, default ``DEFAULT_BLOCK_ROWS``).
        window: read tasks in flight; None = ``DEFAULT_INFLIGHT_TASKS_PER_CPU`` x cluster CPUs.
        keep_warm: start the next epoch's reads while the current one drains (not for a
            sampler that plans an epoch from the losses reported until it starts: InfoBatch;
            a prioritized sampler draws those first units then, before losses reported
            between the epochs).
        task_num_cpus: CPUs each read task reserves.
        spread: spread read tasks over nodes (``SPREAD``) instead of packing them.
        name: names the pipeline's actors (priority store); default a fresh id.
        max_image_pixels: images claiming more pixels are set aside as decompression bombs;
            None takes ``Settings.max_image_pixels`` (RAYING_MAX_IMAGE_PIXELS).
        decoded_cache: keep decoded pixels in the node's memory tier across epochs:
            ``"auto"`` (on only when ``epochs`` says enough epochs follow to repay the
            first epoch's writes, and the decoded dataset fits in a quarter of free memory),
            ``"off"``, or a budget in bytes (on from the first epoch; each share of a
            sharded pipeline, a Train worker's, gets its share of it). See
            :mod:`raying.read.decoded_cache`.
        decoded_cache_fill: how much filling the decoded cache may slow a read task, as a
            share of its time (default ``DEFAULT_DECODED_CACHE_FILL_SHARE``, 4 %): a fill
            decodes the whole image and writes it to memory, so the cache fills over several
            epochs at that cost (its misses' lookups count against the share too); None
            fills every admitted sample at its first read (that epoch then runs 1.4-4x
            slower than without the cache in docs/benchmarks.md's runs).
        epochs: how many epochs the job reads, when known (None: unknown). Only ``"auto"``
            choices use it, to weigh a one-time cost against the epochs that repay it.
        ray_remote_args: extra Ray options of the read tasks, fast path and ``dataset()``
            alike, e.g. ``{"resources": {"ingest": 0.01}}`` to keep decode on ingest nodes.
        io: read planning and the tiered cache: a ``raying.options.IOConfig`` or
            a dict of its fields; None reads every file directly (see docs/io.md).
        shard: ``(index, count)``: this pipeline reads only its share of every epoch, the
            plan's units ``index, index + count, ...`` (data-parallel training: each of
            ``count`` trainers builds the same pipeline with its own index; together they
            read every id of a uniform epoch exactly once). ``raying.train`` sets it.
    """

    block_rows: int | None = None
    window: int | None = None
    keep_warm: bool = True
    task_num_cpus: float = 1.0
    spread: bool = False
    name: str | None = None
    max_image_pixels: int | None = None
    ray_remote_args: dict[str, Any] | None = None
    decoded_cache: Any = "auto"
    decoded_cache_fill: float | None = DEFAULT_DECODED_CACHE_FILL_SHARE
    io: Any = None  # IOConfig | dict | None, passed to ReadSpec
    shard: tuple[int, int] | None = None
    epochs: int | None = None

    def __post_init__(self) -> None:
        def whole(v: Any) -> bool:
            return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))

        if self.epochs is not None and (not whole(self.epochs) or self.epochs < 1):
            msg = (f"PipelineConfig(epochs=...) must be an integer >= 1 or None, got "
                   f"{self.epochs!r}")
            raise ConfigError(msg)

        cache = self.decoded_cache
        if isinstance(cache, (float, np.floating)) and math.isfinite(cache) and cache >= 0 \
                and float(cache).is_integer():
            cache = int(cache)  # bytes written as 2e9
            object.__setattr__(self, "decoded_cache", cache)
        if not (cache is None or cache is False or (isinstance(cache, str) and cache in
                                                    ("auto", "off"))
                or (whole(cache) and cache >= 0)):
            msg = (f"PipelineConfig(decoded_cache=...) must be 'auto', 'off' (or None, 0), or "
                   f"a budget in bytes, got {cache!r}")
            raise ConfigError(msg)

        fill = self.decoded_cache_fill
        if fill is not None:
            ok = (isinstance(fill, (int, float, np.integer, np.floating))
                  and not isinstance(fill, (bool, np.bool_)) and math.isfinite(fill) and fill > 0)
            if not ok:
                msg = (f"PipelineConfig(decoded_cache_fill=...) must be a share of read time > 0 "
                       f"(e.g. 0.05) or None (fill at first read), got {fill!r}")
                raise ConfigError(msg)
            object.__setattr__(self, "decoded_cache_fill", float(fill))

        if self.block_rows is not None and (not whole(self.block_rows) or self.block_rows < 1):
            msg = (f"PipelineConfig(block_rows=...) must be an integer >= 1 or None, got "
                   f"{self.block_rows!r}")
            raise ConfigError(msg)
        pixels = self.max_image_pixels
        if pixels is not None and (not whole(pixels) or pixels < 1):
            msg = (f"PipelineConfig(max_image_pixels=...) must be an integer >= 1 or None, got "
                   f"{pixels!r}")
            raise ConfigError(msg)
        if self.io is not None:
            object.__setattr__(self, "io", IOConfig.coerce(self.io))
        if self.window is not None and (not whole(self.window) or self.window < 1):
            msg = f"PipelineConfig(window=...) must be an integer >= 1 or None, got {self.window!r}"
            raise ConfigError(msg)
        for name in ("keep_warm", "spread"):
            if not isinstance(getattr(self, name), (bool, np.bool_)):
                msg = f"PipelineConfig({name}=...) must be True or False, got {getattr(self, name)!r}"
                raise ConfigError(msg)
        cpus = self.task_num_cpus
        if (isinstance(cpus, bool) or not isinstance(cpus, (int, float)) or not cpus > 0
                or not math.isfinite(cpus)):
            msg = f"PipelineConfig(task_num_cpus=...) must be a finite number > 0, got {cpus!r}"
            raise ConfigError(msg)
        args = self.ray_remote_args
        if args is not None and (not isinstance(args, Mapping)
                                 or not all(isinstance(k, str) for k in args)):
            msg = (f"PipelineConfig(ray_remote_args=...) must be a dict of Ray task options "
                   f"(e.g. {{'resources': {{'ingest': 0.01}}}}) or None, got {args!r}")
            raise ConfigError(msg)
        if self.shard is not None:
            ok = (isinstance(self.shard, (tuple, list)) and len(self.shard) == 2
                  and all(whole(v) for v in self.shard)
                  and 0 <= self.shard[0] < self.shard[1])
            if not ok:
                msg = (f"PipelineConfig(shard=...) must be (index, count) with 0 <= index < "
                       f"count, got {self.shard!r}")
                raise ConfigError(msg)
            object.__setattr__(self, "shard", (int(self.shard[0]), int(self.shard[1])))


# --- priorities: the table and its store ---------------------------------------------------
def _number(name: str, value: Any, *, low: float, high: float = math.inf,
            low_open: bool = False, hint: str) -> float:
    ok = isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool)
    if ok:
        value = float(value)
        ok = math.isfinite(value) and (value > low if low_open else value >= low) and value <= high
    if not ok:
        bound = f"> {low}" if low_open else f">= {low}"
        upper = f" and <= {high}" if math.isfinite(high) else ""
        msg = f"{name} must be a finite number {bound}{upper}, got {value!r}; {hint}"
        raise ConfigError(msg)
    return value


@dataclasses.dataclass(frozen=True)
class TableConfig:
    """The settings of a PriorityTable; see PriorityTable for what each one does.

    Args:
        alpha: priority exponent (0 = uniform, 1 = proportional).
        uniform_mix: share ``eps`` of the uniform floor in the sampling mixture.
        beta: default importance-weight exponent.
        cap_quantile: clip priorities above this quantile, or None.
        age_after: update calls without a refresh after which a priority starts aging, or None.
        age_rate: share of the gap to the mean closed per update call once aging.
        initial_priority: the priority every row starts with.
        seed: seed of the table's random generator.
        guard_after: the noisy-label guard: a row whose last ``guard_after`` reported
            priorities were all at or above the ``guard_quantile`` of the stored priorities is
            *persistently high-loss* (a mislabelled sample looks like this) and is drawn as if
            its priority were the median priority until a report falls below the threshold.
            None disables the guard (and its statistics).
        guard_quantile: the quantile of the stored priorities that counts as high loss.
    """

    alpha: float = 1.0
    uniform_mix: float = 0.0
    beta: float = 0.0
    cap_quantile: float | None = None
    age_after: int | None = None
    age_rate: float = DEFAULT_AGE_RATE
    initial_priority: float = 1.0
    seed: int = 0
    guard_after: int | None = None
    guard_quantile: float = DEFAULT_GUARD_QUANTILE

    def __post_init__(self) -> None:
        _number("alpha", self.alpha, low=0.0,
                hint="pass e.g. alpha=0.6 (0 samples uniformly, 1 in proportion to priority)")
        _number("uniform_mix", self.uniform_mix, low=0.0, high=1.0,
                hint="pass the share of uniform draws, e.g. uniform_mix=0.1")
        _number("beta", self.beta, low=0.0,
                hint="pass e.g. beta=0.4 (0 = no importance correction, 1 = full)")
        if self.cap_quantile is not None:
            _number("cap_quantile", self.cap_quantile, low=0.0, high=1.0, low_open=True,
                    hint="pass e.g. cap_quantile=0.99, or None for no cap")
        if self.age_after is not None and (
                isinstance(self.age_after, bool) or not isinstance(self.age_after, (int, np.integer))
                or self.age_after < 1):
            msg = (f"age_after must be an integer >= 1 (update calls) or None, got "
                   f"{self.age_after!r}; pass e.g. age_after=100, or None to disable aging")
            raise ConfigError(msg)
        _number("age_rate", self.age_rate, low=0.0, high=1.0, low_open=True,
                hint="pass the share of the gap to the mean closed per update, e.g. 0.05")
        if self.guard_after is not None and (
                isinstance(self.guard_after, bool)
                or not isinstance(self.guard_after, (int, np.integer)) or self.guard_after < 1):
            msg = (f"guard_after must be an integer >= 1 (consecutive high-loss reports) or "
                   f"None, got {self.guard_after!r}; pass e.g. guard_after="
                   f"{DEFAULT_GUARD_AFTER}, or None to disable the noisy-label guard")
            raise ConfigError(msg)
        _number("guard_quantile", self.guard_quantile, low=0.0, high=1.0, low_open=True,
                hint="pass the quantile of priorities that counts as high loss, e.g. 0.9")
        _number("initial_priority", self.initial_priority, low=0.0,
                hint="pass the priority rows start with, e.g. initial_priority=1.0")
        if isinstance(self.seed, bool) or not isinstance(self.seed, (int, np.integer)) \
                or self.seed < 0:
            msg = f"seed must be an integer >= 0, got {self.seed!r}; pass e.g. seed=0"
            raise ConfigError(msg)

    @classmethod
    def coerce(cls, value: TableConfig | Mapping[str, Any] | None) -> TableConfig:
        """Accept a TableConfig, a dict of its fields, or None (the defaults)."""
        return _coerce(cls, value, "table")


@dataclasses.dataclass(frozen=True)
class StoreConfig:
    """How the priority store runs.

    Args:
        coalesce: how the updates of one tick fold per id: ``"last"`` (latest report wins),
            ``"max"`` (largest report wins) or ``"ema"`` (each report moves the stored
            priority by ``ema``, in arrival order).
        ema: the EMA step in ``(0, 1]`` for ``coalesce="ema"``.
        tick_s: seconds between two applications of the queued updates.
        snapshot_uri: a directory URI (local, ``file://``, ``s3://``, ``hdfs://``) for
            snapshots, or None for none. A store restores from it when one exists.
        snapshot_every_updates: snapshot after this many applied updates...
        snapshot_interval_s: ...or this many seconds, whichever comes first (only when
            something changed). A restart loses at most the updates applied since then.
        shard_rows: ids per actor; a larger store shards by id range.
        storage: StorageOptions (or a dict) for the snapshot URI.
        restore: restore from an existing snapshot at creation (restarts always do).
        actor_options: extra Ray options of the store's actors. By default they ask for a
            sliver of the head node's resource (``node:__internal_head__``), so the store
            lives on the node the cluster cannot lose, apart from trainers and decode
            workers, and comes back there when restarted; ``{}`` lets Ray place it.
    """

    coalesce: str = "last"
    ema: float = 0.5
    tick_s: float = dataclasses.field(default_factory=lambda: settings().store_tick_s)
    snapshot_uri: str | None = None
    snapshot_every_updates: int = dataclasses.field(
        default_factory=lambda: settings().snapshot_every_updates)
    snapshot_interval_s: float = dataclasses.field(
        default_factory=lambda: settings().snapshot_interval_s)
    shard_rows: int = dataclasses.field(default_factory=lambda: settings().store_shard_rows)
    storage: StorageOptions | Mapping[str, Any] | None = None
    restore: bool = True
    actor_options: Mapping[str, Any] | None = None

    def __post_init__(self) -> None:
        if self.coalesce not in COALESCE_MODES:
            msg = (f"coalesce must be one of {list(COALESCE_MODES)}, got {self.coalesce!r}; "
                   f"'last' keeps the latest report of each id")
            raise ConfigError(msg)
        # (tick_s must be finite: the store applies the queued updates once per tick; a
        # snapshot interval may be inf, snapshots then come by count alone.)
        checks = [("ema", self.ema, 0.0, 1.0), ("tick_s", self.tick_s, 0.0, 3600.0),
                  ("snapshot_interval_s", self.snapshot_interval_s, 0.0, math.inf)]
        for name, value, low, high in checks:
            if (isinstance(value, bool) or not isinstance(value, (int, float))
                    or not low < value <= high):
                msg = f"{name} must be a number in ({low}, {high}], got {value!r}"
                raise ConfigError(msg)
        for name in ("snapshot_every_updates", "shard_rows"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                msg = f"{name} must be an integer >= 1, got {value!r}"
                raise ConfigError(msg)
        object.__setattr__(self, "storage", StorageOptions.coerce(self.storage))

    @classmethod
    def coerce(cls, value: StoreConfig | Mapping[str, Any] | None) -> StoreConfig:
        """Accept a StoreConfig, a dict of its fields, or None (the defaults)."""
        return _coerce(cls, value, "store")


def _coerce(cls: Any, value: Any, kind: str) -> Any:
    """``value`` as a ``cls``: itself, built from a dict of its fields, or the defaults."""
    if value is None:
        return cls()
    if isinstance(value, cls):
        return value
    if isinstance(value, Mapping):
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - fields)
        if unknown:
            msg = f"{kind} option(s) {unknown} not known; expected some of {sorted(fields)}"
            raise ConfigError(msg)
        return cls(**value)
    msg = (f"{kind} config must be a {cls.__name__}, a dict or None, got "
           f"{type(value).__name__}")
    raise ConfigError(msg)
