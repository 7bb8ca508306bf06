"""One place for raying's defaults and the RAYING_* environment overrides."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

from raying.errors import ConfigError


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        msg = f"environment variable {name} must be an integer, got {raw!r}; unset it or fix it"
        raise ConfigError(msg) from None


def _env_float(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return float(raw)
    except ValueError:
        msg = f"environment variable {name} must be a number, got {raw!r}; unset it or fix it"
        raise ConfigError(msg) from None


# --- decode ------------------------------------------------------------------------------------
# PIL's own default: images above this many pixels are treated as decompression bombs.
DEFAULT_MAX_IMAGE_PIXELS = _env_int("RAYING_MAX_IMAGE_PIXELS", 89_478_485)

# --- reads and blocks --------------------------------------------------------------------------
# Images per read task: about 100 ms of decode work on one core for 256px JPEGs.
DEFAULT_BLOCK_ROWS = _env_int("RAYING_BLOCK_ROWS", 256)
# Parquet row groups shuffled together inside one read task (uniform mode).
DEFAULT_PARQUET_WINDOW_ROW_GROUPS = _env_int("RAYING_PARQUET_WINDOW_ROW_GROUPS", 4)
# Rows per row group written by `raying pack`.
DEFAULT_PACK_ROW_GROUP_ROWS = _env_int("RAYING_PACK_ROW_GROUP_ROWS", 256)
# Rows per Parquet shard written by `raying pack`.
DEFAULT_PACK_SHARD_ROWS = _env_int("RAYING_PACK_SHARD_ROWS", 4096)
# Read tasks in flight per CPU the executor may use.
DEFAULT_INFLIGHT_TASKS_PER_CPU = _env_int("RAYING_INFLIGHT_TASKS_PER_CPU", 2)
# Object store of a local Ray that raying starts itself (``ensure_ray``): this many MB per CPU,
# at least the floor, at most Ray's own default (30% of memory). Ray's default lets the shared
# memory that read tasks write through grow to gigabytes on a small node with no gain in speed
# (``python -m raying.bench.mem_profile``). RAYING_OBJECT_STORE_MB fixes it; 0 keeps Ray's.
DEFAULT_OBJECT_STORE_MB_PER_CPU = _env_int("RAYING_OBJECT_STORE_MB_PER_CPU", 256)
DEFAULT_OBJECT_STORE_MIN_MB = _env_int("RAYING_OBJECT_STORE_MIN_MB", 512)
# Threads a read task uses to fetch objects from remote storage.
DEFAULT_REMOTE_READ_THREADS = _env_int("RAYING_REMOTE_READ_THREADS", 16)
# Attempts for a storage read before the error surfaces.
DEFAULT_READ_RETRIES = _env_int("RAYING_READ_RETRIES", 5)
DEFAULT_READ_RETRY_BACKOFF_S = _env_float("RAYING_READ_RETRY_BACKOFF_S", 0.2)

# --- iterators ---------------------------------------------------------------------------------
DEFAULT_PREFETCH_BATCHES = _env_int("RAYING_PREFETCH_BATCHES", 4)
DEFAULT_BATCH_SIZE = 256

# ImageNet statistics, the usual normalization on the device.
DEFAULT_MEAN = (0.485, 0.456, 0.406)
DEFAULT_STD = (0.229, 0.224, 0.225)

# --- priority store ----------------------------------------------------------------------------
DEFAULT_STORE_TICK_S = _env_float("RAYING_STORE_TICK_S", 0.02)
DEFAULT_PLAN_CHUNK_IDS = _env_int("RAYING_PLAN_CHUNK_IDS", 4096)
# The largest p**alpha a leaf of a priority table holds: sums of n leaves, and of their
# squares (the effective sample size), stay finite for any n below 1e100.
MAX_PRIORITY_LEAF = 1e100
DEFAULT_SNAPSHOT_EVERY_UPDATES = _env_int("RAYING_SNAPSHOT_EVERY_UPDATES", 200_000)
DEFAULT_SNAPSHOT_INTERVAL_S = _env_float("RAYING_SNAPSHOT_INTERVAL_S", 30.0)
DEFAULT_STORE_SHARD_ROWS = _env_int("RAYING_STORE_SHARD_ROWS", 10_000_000)
DEFAULT_REPORT_FLUSH_IDS = _env_int("RAYING_REPORT_FLUSH_IDS", 1024)
DEFAULT_REPORT_FLUSH_S = _env_float("RAYING_REPORT_FLUSH_S", 0.05)


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
            aliases = {"endpoint": "endpoint_url", "endpoint_override": "endpoint_url",
                       "key": "access_key_id", "secret": "secret_access_key",
                       "aws_access_key_id": "access_key_id",
                       "aws_secret_access_key": "secret_access_key",
                       "aws_session_token": "session_token"}
            fields = {f.name for f in dataclasses.fields(cls)}
            kwargs = {}
            for key, val in value.items():
                name = aliases.get(key, key)
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
