"""Storage errors: pyarrow and OS errors turned into raying's (URI, what, fix), and retries."""

from __future__ import annotations

import contextvars
import errno
import logging
import random
import threading
import time
import urllib.parse
import weakref

import pyarrow.fs as pafs

from raying.errors import ConfigError, CredentialsError, RayingError, StorageError
from raying.storage import s3 as _s3

logger = logging.getLogger("raying.storage.files")

# The longest wait between two attempts, whatever the backoff has grown to.
DEFAULT_READ_RETRY_MAX_BACKOFF_S = 5.0


class NotFoundError(StorageError, FileNotFoundError):
    """Nothing exists at the URI (no such file, key, prefix or bucket)."""


_CREDENTIAL_MARKERS = (
    "ACCESS_DENIED", "INVALID_ACCESS_KEY_ID", "SIGNATURE_DOES_NOT_MATCH", "EXPIRED_TOKEN",
    "INVALID_CLIENT_TOKEN_ID", "UNRECOGNIZED_CLIENT", "MISSING_AUTHENTICATION_TOKEN",
    "HTTP response code: 403", "AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch",
    "ExpiredToken", "AccessControlException",
)
_MISSING_MARKERS = ("NO_SUCH_BUCKET", "NO_SUCH_KEY", "RESOURCE_NOT_FOUND", "NoSuchBucket",
                    "NoSuchKey", "java.io.FileNotFoundException")
# "HDFS read failed": libhdfs's read gave up, e.g. no DataNode holding the block answered.
_NETWORK_MARKERS = ("NETWORK_CONNECTION", "curlCode", "Could not connect", "Connection refused",
                    "Could not resolve host", "REQUEST_TIMEOUT", "timed out", "HDFS read failed")

# Network errors that may be one file's: libhdfs gives up a read when no DataNode holding a
# block answers, whether the DataNodes are down or that block lost every replica.
_FILE_MARKERS = ("HDFS read failed",)

# Filesystems built by StorageSpec.filesystem() and their specs, to name endpoints in errors:
# id -> (a weak reference to the filesystem, its spec). A filesystem let go (the cache
# cleared) frees its id for another object, which must not inherit the spec (a local
# filesystem's errors would speak of S3).
_SPECS: dict[int, tuple[weakref.ref, object]] = {}
_SPECS_LOCK = threading.Lock()


def register(fs: pafs.FileSystem, spec) -> None:
    """Remember which StorageSpec built ``fs`` (for error messages)."""
    with _SPECS_LOCK:
        _SPECS[id(fs)] = (weakref.ref(fs), spec)


# A path that can never open: a loop of symbolic links, a name over the file system's limit.
_PERMANENT_ERRNOS = frozenset({errno.ELOOP, errno.ENAMETOOLONG})


def classify(exc: BaseException) -> str:
    """One of ``missing``, ``credentials``, ``network``, ``transient``, ``permanent``."""
    if isinstance(exc, FileNotFoundError):
        return "missing"
    if isinstance(exc, PermissionError):
        return "credentials"
    if isinstance(exc, (IsADirectoryError, NotADirectoryError)):
        return "permanent"
    if isinstance(exc, OSError) and exc.errno in _PERMANENT_ERRNOS:
        return "permanent"  # the same path fails the same way: no retry, said at once
    if isinstance(exc, RayingError) and not isinstance(exc, StorageError):
        return "permanent"
    text = str(exc)
    if any(m in text for m in _CREDENTIAL_MARKERS):
        return "credentials"
    if any(m in text for m in _MISSING_MARKERS):
        return "missing"
    if any(m in text for m in _NETWORK_MARKERS):
        return "network"
    return "transient" if isinstance(exc, OSError) else "permanent"


def is_retryable(exc: BaseException) -> bool:
    """Whether another attempt may succeed (a network or server hiccup, not a refusal)."""
    return classify(exc) in ("network", "transient")


def storage_error(exc: Exception, fs: pafs.FileSystem | None, path: str, *,
                  action: str = "read", attempts: int = 1, uri: str | None = None,
                  probe: bool = True) -> Exception:
    """The raying error for ``exc``, raised while ``action``-ing ``path`` on ``fs``.

    The message names the URI (``uri`` if given) and the fix, never a credential. raying's own
    errors come back unchanged; anything that is not an OSError (a bug, a bad argument) too.
    ``probe``: on HDFS, ask the NameNode whether it answers at all (a missing path and a dead
    NameNode look alike to libhdfs); off for the errors of attempts that are retried.
    """
    if isinstance(exc, RayingError):
        return exc
    kind = classify(exc)
    if kind == "permanent" and not isinstance(exc, OSError) and not _is_arrow_error(exc):
        return exc
    spec = _spec_of(fs)
    scheme = _scheme_of(fs, spec) if fs is not None else _scheme_of_uri(uri or path)
    if uri is None:
        uri = spec.uri(path) if spec is not None else _uri(scheme, path)
    detail = _s3.scrub(str(exc))
    tries = f" (after {attempts} attempts)" if attempts > 1 else ""
    if (probe and scheme == "hdfs" and kind in ("missing", "network", "transient")
            and fs is not None):
        # libhdfs connects lazily: a NameNode that is down or a wrong port surfaces in the
        # first call as a missing path or a bare I/O error.
        down = _hdfs_unreachable(fs, uri, detail, tries)
        if down is not None:
            return down
    err = _storage_error(exc, fs, path, kind=kind, scheme=scheme, spec=spec, uri=uri,
                         action=action, detail=detail, tries=tries)
    if (kind == "network" and isinstance(err, StorageError)
            and not any(m in str(exc) for m in _FILE_MARKERS)):
        err.outage = True
    return err


def _storage_error(exc: Exception, fs: pafs.FileSystem | None, path: str, *, kind: str,
                   scheme: str, spec, uri: str, action: str, detail: str,
                   tries: str) -> Exception:
    options = getattr(spec, "options", None)
    if kind == "missing":
        return NotFoundError(_missing_message(fs, scheme, path, uri, options))
    if kind == "credentials":
        if scheme == "s3":
            # S3's 403 often has no body (HeadObject): keys it does not know and keys that
            # lack a permission look alike, so the message names both.
            msg = (f"access to {uri} was refused: {_s3.credentials_source(options)}, or they "
                   f"lack the permission to {action} it ({detail}); fix: "
                   f"{_s3.FIX_CREDENTIALS}, or grant them s3:GetObject (and s3:ListBucket on "
                   f"the bucket for listing). S3 also answers 'access denied' for a missing "
                   f"key when the credentials may not list the bucket")
        elif scheme == "hdfs":
            msg = (f"HDFS refused access to {uri} ({detail}); check the HDFS user "
                   "(storage={'hdfs_user': ...} or HADOOP_USER_NAME) or the Kerberos ticket")
        else:
            msg = f"permission denied to {action} {uri}; check the file's owner and mode"
        return CredentialsError(msg)
    if kind == "network" and scheme == "s3":
        endpoint = getattr(options, "endpoint_url", None)
        where = f"the S3 endpoint {endpoint}" if endpoint else "AWS S3 (no endpoint_url set)"
        msg = (f"cannot reach {where} to {action} {uri}{tries}: {detail}. "
               "Check that the server is up and that storage={'endpoint_url': ...} or "
               "AWS_ENDPOINT_URL (set before Ray starts, or in the process that builds the "
               "pipeline) points to it")
        return StorageError(msg)
    if scheme == "hdfs" and "working directory URI: file:" in detail:
        return StorageError(f"cannot {action} {uri}{tries}: {detail}. {_DEFAULT_FS_HINT}")
    if scheme == "hdfs" and action != "read" and any(m in detail for m in _HDFS_WRITE_MARKERS):
        # The NameNode took the file; no DataNode took its blocks.
        return StorageError(f"cannot {action} {uri}{tries}: {detail}. {_HDFS_DATANODES_FIX}")
    if scheme == "hdfs" and "HDFS read failed" in detail:
        return StorageError(f"cannot {action} {uri}{tries}: {detail}. {_HDFS_READ_FIX}")
    return StorageError(f"cannot {action} {uri}{tries}: {detail}")


# libhdfs's words when a write's blocks found no DataNode (all down, or full).
_HDFS_WRITE_MARKERS = ("CloseFile failed", "HDFS Write failed", "HDFS Flush failed")
_HDFS_DATANODES_FIX = ("Check that the DataNodes taking its blocks are up and have space (hdfs "
                       "dfsadmin -report lists the live ones)")
# A read no DataNode served: all down, or (one file's) its blocks lost every replica.
_HDFS_READ_FIX = ("Check that the DataNodes holding its blocks are up (hdfs dfsadmin -report "
                  "lists the live ones; hdfs fsck PATH, a file's missing blocks)")


def unreachable(fs: pafs.FileSystem, uri: str) -> StorageError | None:
    """The error to raise for ``uri``, found missing, when its storage is an HDFS whose
    NameNode does not answer, or that refuses this user a folder above it (libhdfs then
    reports the path as missing); else None."""
    if _scheme_of(fs, _spec_of(fs)) != "hdfs":
        return None
    return _hdfs_unreachable(fs, uri, "", "") or _hdfs_refused_above(fs, uri)


def _hdfs_refused_above(fs: pafs.FileSystem, uri: str) -> Exception | None:
    """A CredentialsError naming the nearest folder above ``uri`` that exists when HDFS
    refuses to list it (a path under a folder of mode 700 looks missing to other users);
    None when that folder lists (the path is missing) or the probe cannot tell."""
    split = urllib.parse.urlsplit(uri)
    path = split.path.rstrip("/")
    for _ in range(64):
        if path in ("", "/"):
            return None
        path = path.rpartition("/")[0] or "/"
        try:
            if fs.get_file_info(path).type != pafs.FileType.Directory:
                continue
            fs.get_file_info(pafs.FileSelector(path, recursive=False))
        except OSError as exc:
            if classify(exc) != "credentials":
                return None
            folder = urllib.parse.urlunsplit(split._replace(path=path))
            return storage_error(exc, None, folder, action="list", uri=folder)
        except Exception:  # noqa: BLE001 - a probe that fails tells nothing
            return None
        return None
    return None


def _hdfs_unreachable(fs, uri: str, detail: str, tries: str) -> StorageError | None:
    """The error for an HDFS whose NameNode does not answer (its root, which always exists,
    cannot be listed), or None when it answers."""
    try:
        if fs.get_file_info("/").type == pafs.FileType.Directory:
            return None
    except Exception:  # noqa: BLE001 - the probe failing is the answer
        pass
    where = urllib.parse.urlsplit(uri).netloc or "fs.defaultFS"
    said = f": {detail.strip().splitlines()[0]}" if detail.strip() else ""
    err = StorageError(
        f"cannot connect to HDFS at {where} to reach {uri}{tries} (the NameNode did not "
        f"answer{said}). Check that the NameNode is up and the address "
        "(hdfs://host:port/path; hdfs:///path takes fs.defaultFS from the core-site.xml "
        "that libhdfs finds on CLASSPATH)")
    err.outage = True
    return err


def missing_error(fs: pafs.FileSystem, path: str, uri: str, options=None) -> NotFoundError:
    """The error for a dataset root that does not exist: on S3 it says whether the bucket
    is missing (at which endpoint) or the prefix, on HDFS where hdfs:/// points."""
    return NotFoundError(_missing_message(fs, _scheme_of_uri(uri), path, uri, options))


def _missing_message(fs, scheme, path, uri, options) -> str:
    if scheme == "s3" and fs is not None:
        bucket = path.split("/", 1)[0]
        try:
            missing_bucket = fs.get_file_info(bucket).type == pafs.FileType.NotFound
        except Exception:  # noqa: BLE001 - the probe only sharpens the message
            missing_bucket = False
        if missing_bucket:
            endpoint = getattr(options, "endpoint_url", None) or "AWS S3"
            return (f"{uri} does not exist: bucket {bucket!r} does not exist at {endpoint}; "
                    "check the bucket name and the endpoint")
        return f"{uri} does not exist; check the key or prefix (the bucket exists)"
    if scheme == "hdfs" and uri.startswith("hdfs:///"):
        return f"{uri} does not exist; check the path. {_DEFAULT_FS_HINT}"
    return f"{uri} does not exist; check the path"


# hdfs:///path takes the NameNode from fs.defaultFS, which the client reads from the
# core-site.xml it finds on the class path; without it Hadoop falls back to file:///.
_DEFAULT_FS_HINT = ("hdfs:///path uses fs.defaultFS from the core-site.xml that libhdfs finds "
                    "on CLASSPATH: put the configuration folder (HADOOP_CONF_DIR, e.g. "
                    "/etc/hadoop/conf) on CLASSPATH (exporting HADOOP_CONF_DIR alone is not "
                    "enough), or name the NameNode: hdfs://host:8020/path")


def _is_arrow_error(exc: BaseException) -> bool:
    return type(exc).__module__.startswith("pyarrow")


def _spec_of(fs):
    with _SPECS_LOCK:
        entry = _SPECS.get(id(fs))
        if entry is None:
            return None
        if entry[0]() is not fs:  # another object at a freed filesystem's id
            del _SPECS[id(fs)]
            return None
        return entry[1]


def _scheme_of(fs, spec) -> str:
    if spec is not None:
        return spec.scheme
    handler = getattr(fs, "handler", None)
    base = getattr(handler, "base", None)
    if base is not None:
        return _scheme_of(base, None)
    if isinstance(fs, pafs.S3FileSystem):
        return "s3"
    if isinstance(fs, pafs.HadoopFileSystem):
        return "hdfs"
    return "file"


def _scheme_of_uri(uri: str) -> str:
    scheme = uri.partition("://")[0].lower() if "://" in uri else "file"
    return "s3" if scheme in ("s3", "s3a", "s3n") else scheme


def _uri(scheme: str, path: str) -> str:
    return path if scheme == "file" else f"{scheme}://{path}"


# Set, in the thread that makes a read, by a caller that may give up on it (a unit whose
# reads all fail, see files.read_many): once it is set the read makes no further attempt.
ABANDONED: contextvars.ContextVar[threading.Event | None] = contextvars.ContextVar(
    "raying_read_abandoned", default=None)

# Seconds after which a failed attempt counts as one the storage's client retried itself.
SLOW_ATTEMPT_S = 10.0

# A process warns of a retried storage call at most this often (a storage outage makes every
# open of every read task retry; one line says it).
RETRY_WARNING_EVERY_S = 30.0
_last_retry_warning = [-RETRY_WARNING_EVERY_S]
_retry_warning_lock = threading.Lock()


def _warn_now() -> bool:
    now = time.monotonic()
    with _retry_warning_lock:
        if now - _last_retry_warning[0] < RETRY_WARNING_EVERY_S:
            return False
        _last_retry_warning[0] = now
        return True


# Retries this process made for a caller that counts them (``on_retry``): a read task that
# raises loses its account, and with it the retries it made (see ``counted_retries``).
_COUNTED_RETRIES = [0]
_COUNTED_RETRIES_LOCK = threading.Lock()


def counted_retries() -> int:
    """Retries this process has made so far for callers that count them (reads)."""
    with _COUNTED_RETRIES_LOCK:
        return _COUNTED_RETRIES[0]


def retrying(call, fs, path, attempts, backoff, on_retry=None, uri=None):
    """Run ``call()``; on a transient failure wait (exponential backoff, jitter) and run it again.

    A call without ``on_retry`` (one made where no account counts the retries: a scan, a
    listing, advise, a file's open outside a read task) logs its first retry as a warning, a
    counted one (a read task's) its second, at most once every ``RETRY_WARNING_EVERY_S`` per
    process, so a run waiting on storage that does not answer says so before its attempts run
    out (each may take the SDK's own retries and timeouts: a minute or more against an
    endpoint that accepts and never answers).

    Raises:
        the raying error of the last failure, after ``attempts`` tries or at the first failure
        that another try cannot fix (missing, refused).
    """
    if attempts < 1:
        msg = f"retries must be >= 1 (attempts in all), got {attempts!r}"
        raise ConfigError(msg)
    attempt = 1
    slow_before = False
    while True:
        began = time.monotonic()
        try:
            return call()
        except Exception as exc:
            # An attempt that failed only after SLOW_ATTEMPT_S had the storage's own client
            # retry within it (Hadoop's block acquisition, an SDK's retries and timeouts): a
            # second such attempt in a row ends the call, as raying's backoff of seconds is
            # meant for outages of seconds, and each further attempt would wait as long again.
            took = time.monotonic() - began
            slow = took >= SLOW_ATTEMPT_S
            again = slow and slow_before
            slow_before = slow
            final = attempt >= attempts or not is_retryable(exc) or again
            error = storage_error(exc, fs, path, attempts=attempt, uri=uri, probe=final)
            if again and attempt < attempts and _warn_now():
                logger.warning("%s; not retried again: two attempts in a row failed only "
                               "after %.1f s or more, within which the storage's own client "
                               "retried", error, SLOW_ATTEMPT_S)
            if final:
                raise error from None
            abandoned = ABANDONED.get()
            if abandoned is not None and abandoned.is_set():
                raise error from None  # the caller gave up on this read: no further attempt
            delay = min(backoff * 2 ** (attempt - 1), DEFAULT_READ_RETRY_MAX_BACKOFF_S)
            delay *= 0.5 + random.random() / 2
            # Said once per RETRY_WARNING_EVERY_S per process: an uncounted call's first
            # retry; a counted read's second (one blip is routine and its account counts it,
            # but storage that keeps failing holds an epoch for as long as the storage's own
            # client retries each read, minutes with Hadoop's defaults, and is said now).
            loud = attempt == (1 if on_retry is None else 2) and _warn_now()
            logger.log(logging.WARNING if loud else logging.DEBUG,
                       "retrying in %.2fs (attempt %d of %d): %s", delay, attempt + 1,
                       attempts, error)
            if on_retry is not None:
                with _COUNTED_RETRIES_LOCK:
                    _COUNTED_RETRIES[0] += 1
                on_retry(path, attempt, error)
            # A caller that gives up during the backoff ends this read then, with no further
            # attempt (a check before the sleep alone would let a read that was backing off
            # as its unit gave up make one more).
            if abandoned is not None:
                if abandoned.wait(delay):
                    raise error from None
            else:
                time.sleep(delay)
            attempt += 1
