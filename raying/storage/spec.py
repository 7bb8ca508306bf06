"""StorageSpec: a URI and options parsed into a picklable description; the filesystem cache."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import threading
from urllib.parse import unquote

import pyarrow.fs as pafs

from raying.errors import ConfigError
from raying.options import StorageOptions, settings
from raying.storage import errors as _errors
from raying.storage import hdfs as _hdfs
from raying.storage import s3 as _s3
from raying.storage import slow as _slow

SUPPORTED_SCHEMES = ("file", "s3", "hdfs")
# Hadoop's names for S3 connectors; the objects are the same.
S3_SCHEME_ALIASES = ("s3", "s3a", "s3n")

_LOCAL = pafs.LocalFileSystem()
_CACHE: dict[tuple, pafs.FileSystem] = {}
_CACHE_LOCK = threading.Lock()


def uri_string(uri: object) -> str:
    """``uri`` as a string: a ``str`` or an ``os.PathLike`` (``pathlib.Path``) of a str.

    Raises:
        ConfigError: anything else (bytes paths included), or an empty path.
    """
    value = os.fspath(uri) if isinstance(uri, os.PathLike) else uri
    if not isinstance(value, str) or not value:
        msg = f"uri must be a non-empty path or URI string (or pathlib.Path), got {uri!r}"
        raise ConfigError(msg)
    return value


@dataclasses.dataclass(frozen=True)
class StorageSpec:
    """A picklable, secret-safe description of one storage location, to send to Ray workers.

    A worker calls :meth:`filesystem` and gets the same filesystem the driver resolved, built
    with the worker's own credentials chain. The endpoint and region that the driver took from
    its environment are filled in, so they travel; credentials from the environment do not.
    Explicit secrets, if any were given in ``storage=``, travel but never show in repr or str.

    Attributes:
        scheme: ``"file"``, ``"s3"`` or ``"hdfs"``.
        host: HDFS namenode (``"default"`` for fs.defaultFS); empty otherwise.
        port: HDFS port; 0 otherwise.
        options: the storage options, with environment-derived endpoint and region filled in.
    """

    scheme: str
    host: str = ""
    port: int = 0
    options: StorageOptions = dataclasses.field(default_factory=StorageOptions)

    @classmethod
    def from_uri(cls, uri: str, storage: StorageOptions | dict | None = None
                 ) -> tuple[StorageSpec, str]:
        """Parse ``uri`` with ``storage`` options into a spec and the filesystem path.

        Raises:
            ConfigError: unknown scheme, malformed URI or options.
        """
        options = StorageOptions.coerce(storage)
        slow = options.slow
        if slow is not None:
            _slow.coerce_tier(slow)  # fail here, on the driver, not in a worker
            slow = tuple(slow) if isinstance(slow, list) else slow  # hashable, for the cache
        uri = uri_string(uri)
        scheme, sep, rest = uri.partition("://")
        scheme = scheme.lower() if sep else ""
        if uri.lower().startswith("file:") or scheme == "":
            path = _local_path(uri)
            return cls("file", options=StorageOptions(slow=slow)), path
        if scheme in S3_SCHEME_ALIASES:
            bucket, _, key = rest.partition("/")
            if not bucket or "?" in bucket or "#" in bucket or _settings_query(rest):
                msg = (f"S3 URI {uri!r} must look like s3://bucket/key, without settings in "
                       "a query (?region=...); pass settings through storage=")
                raise ConfigError(msg)
            effective = _s3.effective_options(dataclasses.replace(options, slow=slow), bucket)
            return cls("s3", options=effective), f"{bucket}/{key}".rstrip("/")
        if scheme == "hdfs":
            host, port, path, user = _hdfs.parse_hdfs_uri(uri)
            opts = StorageOptions(hdfs_user=options.hdfs_user or user, slow=slow)
            return cls("hdfs", host, port, opts), path
        msg = (f"URI scheme {scheme + '://'!r} in {uri!r} is not supported; raying reads "
               "local paths, file://, s3:// (also S3-compatible stores via endpoint_url) and "
               "hdfs://")
        raise ConfigError(msg)

    def filesystem(self) -> pafs.FileSystem:
        """The pyarrow filesystem, built once per process and options, then cached."""
        key = (self, _env_fingerprint() if self.scheme == "s3" else None)
        with _CACHE_LOCK:
            fs = _CACHE.get(key)
        if fs is not None:
            return fs
        if self.scheme == "file":
            fs = _LOCAL
        elif self.scheme == "s3":
            fs = _s3.s3_filesystem(self.options, attempts=settings().read_retries)
        else:
            fs = _hdfs.hdfs_filesystem(self.host, self.port, self.options.hdfs_user)
        if self.options.slow is not None:
            fs = _slow.slow_filesystem(fs, self.options.slow)
        _errors.register(fs, self)
        with _CACHE_LOCK:
            return _CACHE.setdefault(key, fs)

    def uri(self, path: str) -> str:
        """The URI of ``path`` on this storage (the inverse of :meth:`from_uri`)."""
        if self.scheme == "file":
            return path
        if self.scheme == "s3":
            return f"s3://{path}"
        where = "" if self.host == _hdfs.DEFAULT_FS_HOST else f"{self.host}:{self.port}"
        return f"hdfs://{where}{path}"

    def __repr__(self) -> str:
        opts = self.options
        secret = opts.access_key_id or opts.secret_access_key or opts.session_token
        where = f", host={self.host!r}, port={self.port}" if self.scheme == "hdfs" else ""
        tail = ", secrets=<redacted>" if secret else ""
        return f"StorageSpec(scheme={self.scheme!r}{where}, options={opts!r}{tail})"

    __str__ = __repr__


# pyarrow's S3 URI query parameters: "s3://b/k?region=x" means settings to pyarrow, and
# raying takes its settings from storage= instead. Any other "?" or "#" belongs to the key.
_PYARROW_S3_QUERY = frozenset((
    "region", "endpoint_override", "scheme", "access_key", "secret_key", "session_token",
    "role_arn", "session_name", "external_id", "load_frequency", "anonymous",
    "proxy_options", "allow_bucket_creation", "allow_bucket_deletion", "background_writes",
    "force_virtual_addressing", "request_timeout", "connect_timeout", "default_metadata",
    "check_directory_existence_before_creation", "allow_delayed_open", "tls_ca_file_path",
    "tls_ca_dir_path", "tls_verify_certificates"))


def _settings_query(rest: str) -> bool:
    """Whether the part after ``s3://`` ends in a query of pyarrow settings."""
    _, q, query = rest.rpartition("?")
    if not q:
        return False
    names = [part.partition("=")[0] for part in query.split("&")]
    return any(n.lower() in _PYARROW_S3_QUERY for n in names) and all(
        "=" in part for part in query.split("&"))


def travelling_options(uri: str, storage: StorageOptions | dict | None) -> StorageOptions:
    """``storage`` as Ray workers must get it to reach ``uri``: for S3, with the endpoint and
    region this process took from its environment filled in (a worker's environment may lack
    them: a Ray started before ``AWS_ENDPOINT_URL`` was set, or nodes set up otherwise);
    credentials from the environment are left out, as workers find their own. Other schemes
    get ``storage`` unchanged."""
    options = StorageOptions.coerce(storage)
    spec, _ = StorageSpec.from_uri(uri, options)
    if spec.scheme != "s3":
        return options
    return dataclasses.replace(options, endpoint_url=spec.options.endpoint_url,
                               region=spec.options.region)


def clear_cache() -> None:
    """Forget the cached filesystems (tests; a process whose credentials changed)."""
    with _CACHE_LOCK:
        _CACHE.clear()


def _local_path(uri: str) -> str:
    if uri.lower().startswith("file:"):
        path = unquote(uri[len("file:"):])
        if path.startswith("//"):  # file://host/path: only the local host is ours
            host, _, rest = path[2:].partition("/")
            if host not in ("", "localhost"):
                msg = f"file URI {uri!r} names host {host!r}; only local files are supported"
                raise ConfigError(msg)
            path = "/" + rest
    else:
        path = uri
    return os.path.abspath(os.path.expanduser(path))


def _env_fingerprint() -> str:
    # A filesystem built from the credentials chain must not outlive a change of credentials.
    names = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE")
    text = "\0".join(os.environ.get(n, "") for n in names)
    return hashlib.sha256(text.encode()).hexdigest()
