"""A slow-storage simulator: a filesystem wrapper adding per-request latency and a bandwidth cap.

The model, per wrapped filesystem (so per tier, shared by every thread of the process)::

    request  = a metadata call (one per path), a listing, an open, or a read that does not
               continue where the previous read of the same file ended (a seek: a new ranged GET
               on S3, a head movement on a disk); each waits ``latency_s``
    transfer = the bytes a read returns, through one pipe of ``bandwidth_bytes_per_s`` shared by
               all threads: a read waits until the pipe has carried everything queued before it
    concurrency (optional) = requests served at once (1 for a disk head; None for S3)

Opening a file and reading it through therefore costs one latency plus size / bandwidth. Writes
pay the open latency only. Counters (requests, bytes read) feed read-amplification reports.
"""

from __future__ import annotations

import dataclasses
import threading
import time

import pyarrow as pa
import pyarrow.fs as pafs

from raying.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class SlowTier:
    """Speed of an emulated storage tier.

    Args:
        latency_s: wait per request, in seconds.
        bandwidth_bytes_per_s: bytes per second through the tier's pipe; None for no cap.
        concurrency: requests served at once; None for no limit.
    """

    latency_s: float
    bandwidth_bytes_per_s: float | None = None
    concurrency: int | None = None

    def __post_init__(self) -> None:
        if not self.latency_s >= 0:
            msg = f"slow tier latency_s must be >= 0 seconds, got {self.latency_s!r}"
            raise ConfigError(msg)
        bw = self.bandwidth_bytes_per_s
        if bw is not None and not bw > 0:
            msg = f"slow tier bandwidth_bytes_per_s must be > 0 or None, got {bw!r}"
            raise ConfigError(msg)
        if self.concurrency is not None and self.concurrency < 1:
            msg = f"slow tier concurrency must be >= 1 or None, got {self.concurrency!r}"
            raise ConfigError(msg)


# Rough shapes of common media; the I/O benchmark's tier is (0.005, 50e6).
TIERS = {
    "ssd": SlowTier(latency_s=0.0001, bandwidth_bytes_per_s=500e6),
    "hdd": SlowTier(latency_s=0.008, bandwidth_bytes_per_s=120e6, concurrency=1),
    "s3": SlowTier(latency_s=0.03, bandwidth_bytes_per_s=100e6),
}


def coerce_tier(value) -> SlowTier:
    """Accept a SlowTier, a tier name (``"hdd"``, ``"s3"``, ``"ssd"``), or a tuple
    ``(latency_s, bandwidth_bytes_per_s[, concurrency])`` as in ``StorageOptions.slow``."""
    if isinstance(value, SlowTier):
        return value
    if isinstance(value, str):
        if value not in TIERS:
            msg = f"slow tier {value!r} is not known; expected one of {sorted(TIERS)} or a tuple"
            raise ConfigError(msg)
        return TIERS[value]
    if isinstance(value, (tuple, list)) and len(value) in (2, 3):
        latency, bandwidth, *rest = value
        concurrency = rest[0] if rest else None
        try:
            return SlowTier(float(latency), None if bandwidth is None else float(bandwidth),
                            None if concurrency is None else int(concurrency))
        except (TypeError, ValueError):
            pass
    msg = ("storage option slow must be (latency_s, bandwidth_bytes_per_s[, concurrency]) "
           f"or a tier name {sorted(TIERS)}, got {value!r}")
    raise ConfigError(msg)


class IOCounters:
    """Thread-safe counts of what went through a slow filesystem.

    Attributes:
        requests: requests that paid the latency (metadata calls, listings, opens, seeks).
        bytes_read: bytes returned by reads.
        opens: files opened for reading.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests = 0
        self.bytes_read = 0
        self.opens = 0

    def add(self, *, requests: int = 0, bytes_read: int = 0, opens: int = 0) -> None:
        """Add to the counters."""
        with self._lock:
            self.requests += requests
            self.bytes_read += bytes_read
            self.opens += opens

    def snapshot(self) -> dict[str, int]:
        """The counters as a plain dict."""
        with self._lock:
            return {"requests": self.requests, "bytes_read": self.bytes_read, "opens": self.opens}

    def reset(self) -> None:
        """Set every counter back to zero."""
        with self._lock:
            self.requests = self.bytes_read = self.opens = 0


class _Pipe:
    """One link of fixed bandwidth: each transfer reserves the time after those queued before."""

    def __init__(self, bandwidth_bytes_per_s: float | None) -> None:
        self._bw = bandwidth_bytes_per_s
        self._lock = threading.Lock()
        self._free_at = 0.0

    def carry(self, nbytes: int) -> None:
        if not self._bw or nbytes <= 0:
            return
        with self._lock:
            now = time.monotonic()
            self._free_at = max(now, self._free_at) + nbytes / self._bw
            wait = self._free_at - now
        time.sleep(wait)


class SlowFileSystemHandler(pafs.FileSystemHandler):
    """A pyarrow FileSystemHandler that delegates to ``base`` at the speed of ``tier``."""

    def __init__(self, base: pafs.FileSystem, tier: SlowTier) -> None:
        self.base = base
        self.tier = tier
        self.counters = IOCounters()
        self._pipe = _Pipe(tier.bandwidth_bytes_per_s)
        self._slots = threading.BoundedSemaphore(tier.concurrency) if tier.concurrency else None

    def __reduce__(self):
        return (SlowFileSystemHandler, (self.base, self.tier))

    def request(self, nbytes: int = 0, *, count: int = 1) -> None:
        """Pay for ``count`` requests, then carry ``nbytes`` through the pipe."""
        self.counters.add(requests=count)
        if self._slots is not None:
            with self._slots:
                time.sleep(self.tier.latency_s * count)
                self._pipe.carry(nbytes)
            return
        if self.tier.latency_s:
            time.sleep(self.tier.latency_s * count)
        self._pipe.carry(nbytes)

    def get_type_name(self):
        return f"slow+{self.base.type_name}"

    def normalize_path(self, path):
        return self.base.normalize_path(path)

    def equals(self, other):
        return self is other

    def get_file_info(self, paths):
        self.request(count=len(paths))
        return self.base.get_file_info(paths)

    def get_file_info_selector(self, selector):
        self.request()
        return self.base.get_file_info(selector)

    def create_dir(self, path, recursive):
        self.request()
        self.base.create_dir(path, recursive=recursive)

    def delete_dir(self, path):
        self.request()
        self.base.delete_dir(path)

    def delete_dir_contents(self, path, missing_dir_ok=False):
        self.request()
        self.base.delete_dir_contents(path, missing_dir_ok=missing_dir_ok)

    def delete_root_dir_contents(self):
        self.request()
        self.base.delete_dir_contents("/", accept_root_dir=True)

    def delete_file(self, path):
        self.request()
        self.base.delete_file(path)

    def move(self, src, dest):
        self.request()
        self.base.move(src, dest)

    def copy_file(self, src, dest):
        self.request()
        self.base.copy_file(src, dest)

    def open_input_stream(self, path):
        return self.open_input_file(path)

    def open_input_file(self, path):
        self.request()
        self.counters.add(opens=1)
        return pa.PythonFile(_SlowReader(self.base.open_input_file(path), self), mode="r")

    def open_output_stream(self, path, metadata):
        self.request()
        return self.base.open_output_stream(path, metadata=metadata)

    def open_append_stream(self, path, metadata):
        self.request()
        return self.base.open_append_stream(path, metadata=metadata)


class _SlowReader:
    """File-like view of a NativeFile for pa.PythonFile: seeks cost a request, bytes cost time."""

    def __init__(self, raw: pa.NativeFile, handler: SlowFileSystemHandler) -> None:
        self._raw = raw
        self._handler = handler
        self._expected = 0  # where a continuing read starts; elsewhere is a seek

    closed = property(lambda self: self._raw.closed)

    def readable(self):
        return True

    def seekable(self):
        return True

    def writable(self):
        return False

    def size(self):
        return self._raw.size()

    def tell(self):
        return self._raw.tell()

    def seek(self, offset, whence=0):
        return self._raw.seek(offset, whence)

    def read(self, nbytes=None):
        start = self._raw.tell()
        data = self._raw.read(None if nbytes is None or nbytes < 0 else nbytes)
        seek = start != self._expected
        self._expected = start + len(data)
        if seek:
            self._handler.request(len(data))
        else:
            self._handler._pipe.carry(len(data))
        self._handler.counters.add(bytes_read=len(data))
        return data

    def close(self):
        self._raw.close()


def slow_filesystem(base: pafs.FileSystem, tier) -> pafs.PyFileSystem:
    """Wrap ``base`` so that it behaves like a slower tier (see the module docstring).

    Args:
        base: the real filesystem (paths are passed through unchanged).
        tier: a SlowTier, a name in :data:`TIERS`, or ``(latency_s, bandwidth_bytes_per_s
            [, concurrency])``; ``(0, None)`` only counts.

    Returns:
        A pyarrow filesystem; its counters are ``io_counters(fs)``.
    """
    return pafs.PyFileSystem(SlowFileSystemHandler(base, coerce_tier(tier)))


def io_counters(fs: pafs.FileSystem) -> IOCounters | None:
    """The counters of a filesystem made by :func:`slow_filesystem`, else None."""
    handler = getattr(fs, "handler", None)
    return handler.counters if isinstance(handler, SlowFileSystemHandler) else None
