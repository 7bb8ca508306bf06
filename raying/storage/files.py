"""From a URI and storage options to a pyarrow filesystem and path; list, read and write safely.

Schemes: plain paths and ``file://`` (local), ``s3://`` (also ``s3a://``), ``hdfs://``. S3 follows
the standard AWS environment (credentials chain, ``AWS_REGION``, ``AWS_ENDPOINT_URL[_S3]``,
``AWS_PROFILE``) and the same settings given explicitly in ``storage=`` (StorageOptions or a
dict). Errors name the URI and the fix; credentials never appear in messages, reprs or logs.
"""

from __future__ import annotations

import errno
import itertools
import logging
import os
import stat
import threading
import uuid
import warnings
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from typing import Any

import pyarrow.fs as pafs

from raying.errors import CredentialsError, DataError, StorageError
from raying.options import StorageOptions, settings
from raying.storage import errors as _errors
from raying.storage.errors import NotFoundError, unreachable
from raying.storage.spec import StorageSpec, clear_cache

__all__ = ["NotFoundError", "StorageSpec", "clear_cache", "exists", "file_info",
           "is_credentials_error", "list_files", "make_dirs", "open_input", "read_bytes",
           "read_many", "resolve", "storage_error", "unreachable", "write_bytes_atomic"]

logger = logging.getLogger(__name__)

OnRetry = Callable[[str, int, BaseException], None]


def resolve(uri: str, storage: StorageOptions | dict | None = None
            ) -> tuple[pafs.FileSystem, str]:
    """Turn a URI into a pyarrow filesystem and the path on it.

    Args:
        uri: a local path (relative, absolute or ``~``), ``file://...``, ``s3://bucket/key``
            or ``hdfs://host:port/path`` (``hdfs:///path`` for fs.defaultFS).
        storage: StorageOptions, a dict of its fields, or None for the environment alone.
            ``slow=(latency_s, bandwidth_bytes_per_s)`` (or a tier name such as ``"hdd"``)
            wraps the filesystem in the slow-storage simulator.

    Returns:
        ``(filesystem, path)``; filesystems are cached per scheme and options in a process.

    Raises:
        ConfigError: unknown scheme or bad options. DependencyError: HDFS prerequisites or
            botocore (for ``profile``) missing. StorageError: HDFS unreachable.

    Example:
        >>> fs, path = resolve("s3://bucket/images", {"endpoint_url": "http://127.0.0.1:9000"})
    """
    spec, path = StorageSpec.from_uri(uri, storage)
    return spec.filesystem(), path


def list_files(fs: pafs.FileSystem, path: str, *, extensions: Iterable[str] | None = None,
               recursive: bool = True, skip_prefixes: str = "._",
               report: dict[str, list[str]] | None = None) -> list[pafs.FileInfo]:
    """List the files under ``path`` in one listing call, sorted by path.

    Files and directories whose names start with one of ``skip_prefixes`` (by default ``.``
    or ``_``: ``.git``, ``_SUCCESS``, ``_temporary``, temp files) are skipped. A path that is
    itself a file lists as that one file.

    Args:
        fs: the filesystem, from :func:`resolve`.
        path: the directory (or prefix) to list.
        extensions: keep only these suffixes, case-insensitive, e.g. ``(".jpg", "png")``.
        recursive: descend into subdirectories.
        report: if given, gets ``"dirs"``: the folders listed (relative to ``path``, without
            the skipped names).

    Returns:
        The regular files, as :class:`ListedFile` (``.path``, ``.size``, ``.mtime``,
        ``.type``, and pyarrow's FileInfo as ``.info``).

    Raises:
        NotFoundError: nothing exists at ``path``. CredentialsError: access refused.
        StorageError: the storage failed after retries.
    """
    exts = None if extensions is None else tuple(
        ("." + e.lstrip(".")).lower() for e in ([extensions] if isinstance(extensions, str)
                                               else extensions))
    base = path.rstrip("/") or path
    selector = pafs.FileSelector(base, recursive=recursive)
    try:
        infos = _retry(lambda: fs.get_file_info(selector), fs, base)
    except StorageError as exc:
        if isinstance(exc, CredentialsError):
            raise
        info = _retry(lambda: fs.get_file_info(base), fs, base)  # a file, not a folder?
        if info.type != pafs.FileType.File:
            raise exc from None
        infos, base = [info], base.rpartition("/")[0]
    prefix = len(base.rstrip("/")) + 1
    # Each read of a FileInfo's path makes a new string and of its type a new enum (~0.4 us
    # each; a dataset scan reads paths in several passes): both are read once here.
    infos, paths, types = _named(fs, infos, base)
    folders: dict[str, bool] = {}

    def kept(rel: str) -> bool:
        folder, _, name = rel.rpartition("/")
        ok = folders.get(folder)
        if ok is None:
            ok = folders[folder] = not any(part[:1] and part[:1] in skip_prefixes
                                           for part in folder.split("/"))
        return ok and not (name[:1] and name[:1] in skip_prefixes)

    file, folder = pafs.FileType.File, pafs.FileType.Directory
    out = [ListedFile(i, p) for i, p, t in zip(infos, paths, types, strict=True)
           if t == file and kept(p[prefix:]) and (exts is None or p.lower().endswith(exts))]
    if report is not None:
        report["dirs"] = [p[prefix:] for p, t in zip(paths, types, strict=True)
                          if t == folder and kept(p[prefix:])]
    out.sort(key=_path_of)
    if isinstance(fs, pafs.LocalFileSystem) and out:
        out = _drop_symlink_loops(out, base)
    return out


class ListedFile:
    """A file of a listing: pyarrow's FileInfo with its path and size read once (each read
    of ``FileInfo.path`` makes a new string); the rest (``mtime``, ``type``) from the info."""

    __slots__ = ("info", "path", "size")

    def __init__(self, info: pafs.FileInfo, path: str) -> None:
        self.info = info
        self.path = path
        self.size = info.size

    @property
    def mtime(self) -> Any:
        return self.info.mtime

    @property
    def type(self) -> pafs.FileType:
        return self.info.type

    @property
    def is_file(self) -> bool:
        return True

    def __repr__(self) -> str:
        return f"ListedFile({self.path!r}, size={self.size})"


def _path_of(item: Any) -> str:
    return item.path


def _named(fs: pafs.FileSystem, infos: list[pafs.FileInfo],
           base: str) -> tuple[list[pafs.FileInfo], list[str], list[pafs.FileType]]:
    """The listed entries that can be used, their paths and types (each read of either
    makes a new object), with a warning for those set aside: names that are not UTF-8 (pyarrow cannot give their path; an archive from an old
    system, Latin-1 names). The other files are kept."""
    good, paths, types, undecodable = [], [], [], 0
    for info in infos:
        try:
            path = info.path
        except UnicodeDecodeError:
            undecodable += 1
            continue
        good.append(info)
        paths.append(path)
        types.append(info.type)
    if undecodable:
        named = ""
        if isinstance(fs, pafs.LocalFileSystem):
            found = _undecodable_names(base, 3)
            named = f" (e.g. {', '.join(found)})" if found else ""
        logger.warning("raying: left out %d entries under %s whose names are not UTF-8%s; "
                       "rename them to UTF-8 (e.g. convmv -f latin1 -t utf-8 -r --notest "
                       "<folder>) to read them", undecodable, base, named)
    return good, paths, types


def _undecodable_names(base: str, limit: int) -> list[str]:
    """Up to ``limit`` local paths under ``base`` that are not UTF-8, shown with escapes."""
    found: list[str] = []
    for root, dirs, files in os.walk(os.fsencode(base), followlinks=False):
        for name in dirs + files:
            try:
                name.decode("utf-8")
            except UnicodeDecodeError:
                found.append(repr(os.path.join(root, name))[2:-1])
                if len(found) >= limit:
                    return found
    return found


def check_links(root: str, uri: str) -> None:
    """Look at the symbolic links under a local ``root`` before it is listed: a link that
    makes a loop (to a folder that holds it, or across folders: ``a/to_b -> ../b`` beside
    ``b/to_a -> ../a``) is refused, as the listing would follow it again and again (each
    image listed some 40 times over, or for hours where loops cross); links that lead
    nowhere are named in a warning, as the listing leaves them out without a word (a split
    made of links into a store would lose those samples unseen), and so are entries that
    are not regular files (a named pipe, a link to a device), which it leaves out too.

    A depth-first walk of the folders by their real paths, each walked once (os.scandir:
    only links cost a ``stat``): a link to a folder still being walked closes a loop. A
    dataset is checked so before it is scanned; :func:`list_files` itself, for other
    callers, lists a loop and leaves its repeats out (:func:`_drop_symlink_loops`)."""
    broken: list[str] = []
    special: list[str] = []
    walking, done = set(), set()
    top = os.path.realpath(root)
    stack: list[tuple[str, str, Any]] = []

    def enter(path: str, real: str) -> None:
        try:
            entries = iter(list(os.scandir(path)))
        except OSError:
            entries = iter(())  # the listing reports what it could not read
        walking.add(real)
        stack.append((path, real, entries))

    enter(root, top)
    while stack:
        folder, real_folder, entries = stack[-1]
        e = next(entries, None)
        if e is None:
            stack.pop()
            walking.discard(real_folder)
            done.add(real_folder)
            continue
        if e.name.startswith("."):
            continue
        if e.is_symlink() and not os.path.exists(e.path):
            broken.append(e.path)
            continue
        if not e.is_dir():
            if not e.is_file():  # a named pipe, a device, a socket (or a link to one)
                special.append(e.path)
            continue
        real = os.path.realpath(e.path)
        if real in walking or (e.is_symlink()
                               and os.path.commonpath([real, real_folder]) == real):
            msg = (f"{uri}: the symbolic link {e.path} -> {os.readlink(e.path)} makes a "
                   f"loop (it leads back to a folder it is reached from), so every image "
                   f"under it would be listed again and again; remove the link")
            raise DataError(msg)
        if real not in done:  # two links to one folder: walked once here
            enter(e.path, real)
    if broken:
        broken.sort()
        shown = ", ".join(f"{b} -> {os.readlink(b)}" for b in broken[:3])
        warnings.warn(f"{uri}: {len(broken)} symbolic links lead to nothing and are left out "
                      f"of the scan (e.g. {shown}); restore their targets or remove them",
                      UserWarning, stacklevel=4)  # the caller of Manifest.scan
    if special:
        special.sort()
        warnings.warn(f"{uri}: {len(special)} entries are not regular files (named pipes, "
                      f"devices, sockets, or links to them) and are left out of the scan "
                      f"(e.g. {', '.join(special[:3])}); a sample must be a regular file or "
                      f"a link to one", UserWarning, stacklevel=4)


def _drop_symlink_loops(infos: list[pafs.FileInfo], base: str) -> list[pafs.FileInfo]:
    """Files under a folder that a symlink loop leads back into (``cat/back -> ..``): the
    listing follows links until the OS refuses, listing the same files under ever longer
    paths. A folder whose real path is that of one of its ancestors is such a repeat."""
    real: dict[str, str] = {}

    def resolve(d: str) -> str:
        r = real.get(d)
        if r is None:
            r = real[d] = os.path.realpath(d)
        return r

    top = base.rstrip("/")
    looped: dict[str, str] = {}
    for d in sorted({i.path.rpartition("/")[0] for i in infos}):
        chain = [d]  # d and its folders up to the root
        while len(chain[-1]) > len(top) and os.path.dirname(chain[-1]) != chain[-1]:
            chain.append(os.path.dirname(chain[-1]))
        seen: dict[str, str] = {}
        for folder in reversed(chain):  # from the root down: a repeat means a loop above d
            r = resolve(folder)
            if r in seen:
                looped[d] = f"{folder} is {seen[r]}"
                break
            seen[r] = folder
    if not looped:
        return infos
    keep = [i for i in infos if i.path.rpartition("/")[0] not in looped]
    logger.warning("raying: left out %d files listed under %d folders that a symlink loop "
                   "leads back into (e.g. %s again); remove or fix the link",
                   len(infos) - len(keep), len(looped), next(iter(looped.values())))
    return keep


def read_bytes(fs: pafs.FileSystem, path: str, *, retries: int | None = None,
               backoff: float | None = None,
               on_retry: OnRetry | None = None) -> bytes:
    """Read a whole file, retrying transient failures (never a missing file or a refusal).

    Args:
        fs: the filesystem, from :func:`resolve`.
        path: the file's path on ``fs``.
        retries: attempts in all before the error surfaces (at least 1); None: the settings'.
        backoff: seconds before the second attempt; doubles each time, with jitter, up to
            5 s.
        on_retry: called as ``on_retry(path, attempt, error)`` before each new attempt.

    Raises:
        NotFoundError: the file does not exist. CredentialsError: access refused.
        StorageError: the storage failed ``retries`` times (the message names the URI).
    """
    if isinstance(fs, pafs.LocalFileSystem):
        return _retry(lambda: _read_local(path), fs, path, retries, backoff, on_retry)
    return _retry(lambda: _read_fs(fs, path), fs, path, retries, backoff, on_retry)


def read_many(fs: pafs.FileSystem, paths: Sequence[str | pafs.FileInfo], *,
              threads: int | None = None, retries: int | None = None,
              backoff: float | None = None,
              on_retry: OnRetry | None = None) -> list[bytes | Exception]:
    """Read many whole files; a failure takes its own slot and never the others'.

    Local files are read one after the other (measured faster than threads for files in the
    page cache); other stores use a thread pool, since each read mostly waits on the network.
    A read that failed on the storage itself (not a missing file, not a refusal) gets a second
    round of retries once the others are done: an outage a few seconds long (a DataNode
    restarting, a network blip) outlasts one read's retries, and its files are good samples.

    Args:
        fs: the filesystem, from :func:`resolve`.
        paths: paths on ``fs`` or FileInfo objects from :func:`list_files`.
        threads: concurrent reads for remote stores; ``Settings.remote_read_threads`` if None.
        retries, backoff, on_retry: as in :func:`read_bytes`.

    Returns:
        One entry per path, in order: the bytes, or the StorageError that ended its reads.
    """
    names = [p.path if isinstance(p, (pafs.FileInfo, ListedFile)) else p for p in paths]
    abandoned = threading.Event()  # set when the unit gives up on its reads still running

    def one(name: str) -> bytes | Exception:
        token = _errors.ABANDONED.set(abandoned)
        try:
            return read_bytes(fs, name, retries=retries, backoff=backoff, on_retry=on_retry)
        except Exception as exc:  # noqa: BLE001 - each failure is returned in its slot
            return exc
        finally:
            _errors.ABANDONED.reset(token)

    workers = min(threads or settings().remote_read_threads, len(names))

    def each(batch: list[str]) -> list[bytes | Exception]:
        if isinstance(fs, pafs.LocalFileSystem) or workers <= 1 or len(batch) <= 1:
            return [one(n) for n in batch]
        return _read_pooled(batch, one, min(workers, len(batch)), abandoned)

    got = each(names)
    again = [i for i, r in enumerate(got) if isinstance(r, StorageError)
             and not isinstance(r, (NotFoundError, CredentialsError))]
    # Only beside reads that succeeded: when every read failed the storage is down, and the
    # caller reports that at once (refuse_outage, below) rather than after another round.
    if again and len(again) < len(got):
        for i, result in zip(again, each([names[i] for i in again]), strict=True):
            got[i] = result
    return got


def _read_pooled(names: list[str], one: Callable[[str], bytes | Exception],
                 workers: int, abandoned: threading.Event) -> list[bytes | Exception]:
    """``one`` of every name on ``workers`` threads, in order; but once two waves of reads
    (``2 * workers``) failed on the storage and none succeeded, the rest are not started:
    each would wait out the storage client's own retries (with Hadoop's defaults ~20 s a
    read for a block no live DataNode holds, times raying's attempts), and the unit is
    refused as an outage anyway. (One wave may be a run of bad files, a lost block each:
    the next wave's reads then succeed, and every file is read.) Their slots get a
    StorageError marked ``unread``; reads still running finish their attempt and make no
    other (``abandoned`` is set)."""
    out: list[bytes | Exception | None] = [None] * len(names)
    pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="raying-read")
    waiting = iter(range(len(names)))
    running = {}
    ok = failed = 0
    first: Exception | None = None
    try:
        for i in itertools.islice(waiting, workers):
            running[pool.submit(one, names[i])] = i
        while running:
            done, _ = wait(running, return_when=FIRST_COMPLETED)
            for future in done:
                i = running.pop(future)
                out[i] = result = future.result()
                if isinstance(result, StorageError) and not isinstance(result, NotFoundError):
                    failed += 1
                    first = first or result
                elif not isinstance(result, Exception):
                    ok += 1
            if not ok and failed >= 2 * workers and first is not None:
                said = str(first).splitlines()[0]
                for i in [*running.values(), *waiting]:
                    err = StorageError(f"not read: the {failed} reads before it in this unit "
                                       f"failed on the storage, none read ({said})")
                    err.outage = getattr(first, "outage", False)
                    err.unread = True
                    out[i] = err
                abandoned.set()
                running.clear()
                break
            for i in itertools.islice(waiting, len(done)):
                running[pool.submit(one, names[i])] = i
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
    return out  # type: ignore[return-value]


def write_bytes_atomic(fs: pafs.FileSystem, path: str, data: bytes) -> None:
    """Write ``data`` so that readers see the old file or the new one, never a partial one.

    Local: a temp file in the same directory, fsync, then ``os.replace``. S3: one upload, which
    becomes visible only when complete. Others (HDFS, wrappers): a temp file, then a rename.
    Parent directories are created.

    Raises:
        CredentialsError: access refused. StorageError: the write failed.
    """
    try:
        if isinstance(fs, pafs.LocalFileSystem):
            _write_local_atomic(path, data)
        elif isinstance(fs, pafs.S3FileSystem):
            with fs.open_output_stream(path) as out:
                out.write(data)
        else:
            parent, _, name = path.rpartition("/")
            if parent:
                fs.create_dir(parent, recursive=True)
            tmp = f"{parent}/.{name}.{uuid.uuid4().hex}.tmp"
            try:
                with fs.open_output_stream(tmp) as out:
                    out.write(data)
                fs.move(tmp, path)
            except BaseException:
                _delete_quietly(fs, tmp)
                raise
    except Exception as exc:
        raise _errors.storage_error(exc, fs, path, action="write") from None


def move(fs: pafs.FileSystem, src: str, dst: str) -> None:
    """Rename ``src`` to ``dst`` (replacing it): one rename locally and on HDFS, a copy then
    a delete on S3.

    Raises:
        CredentialsError: access refused. StorageError: the storage failed.
    """
    try:
        fs.move(src, dst)
    except Exception as exc:
        raise _errors.storage_error(exc, fs, src, action="write") from None


def exists(fs: pafs.FileSystem, path: str) -> bool:
    """Whether a file or directory exists at ``path`` (transient failures are retried).

    Raises:
        CredentialsError: access refused. StorageError: the storage failed after retries.
    """
    try:
        return file_info(fs, path).type != pafs.FileType.NotFound
    except NotFoundError:
        return False


def file_info(fs: pafs.FileSystem, path: str, uri: str | None = None) -> pafs.FileInfo:
    """The FileInfo at ``path`` (type ``NotFound`` when nothing is there), retried.

    Args:
        uri: the name to use in error messages (default: derived from ``fs`` and ``path``).
    """
    return _retry(lambda: fs.get_file_info(path), fs, path, uri=uri)


def open_input(fs: pafs.FileSystem, path: str, *,
               on_retry: OnRetry | None = None) -> pafs.NativeFile:
    """Open ``path`` for random access (e.g. for ``pq.ParquetFile``); the open is retried,
    each retry reported to ``on_retry`` as in :func:`read_bytes`.

    Raises:
        NotFoundError, CredentialsError, StorageError: as for :func:`read_bytes`.
    """
    return _retry(lambda: fs.open_input_file(path), fs, path, on_retry=on_retry)


def make_dirs(fs: pafs.FileSystem, path: str) -> None:
    """Create ``path`` and its parents; nothing to do on S3, where folders are key prefixes."""
    if isinstance(fs, pafs.S3FileSystem):
        return
    try:
        fs.create_dir(path, recursive=True)
    except Exception as exc:
        raise _errors.storage_error(exc, fs, path, action="create") from None


def storage_error(exc: Exception, uri: str, *, action: str = "read") -> Exception:
    """The raying error (NotFoundError, CredentialsError, StorageError) for a failure on ``uri``.

    For callers that use pyarrow directly (e.g. ``pq.read_metadata``); secrets are scrubbed.
    """
    return _errors.storage_error(exc, None, uri, action=action, uri=uri)


def is_credentials_error(exc: BaseException) -> bool:
    """Whether ``exc`` is the storage refusing access (credentials missing, wrong or short)."""
    return _errors.classify(exc) == "credentials"


# The largest local file read whole (an encoded image): a file replaced after the scan by one
# of many gigabytes would take a read worker's memory, and with it the node's.
MAX_LOCAL_READ_BYTES = 2 << 30
# Bytes per read past what fstat said a local file holds (one that grew while read).
_READ_ON_BYTES = 1 << 20


def _read_local(path: str) -> bytes:
    # O_NONBLOCK: the open of a named pipe put where a file was (after the scan) returns at
    # once instead of waiting for a writer; it changes nothing for a regular file's reads.
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), path)
        if not stat.S_ISREG(st.st_mode):
            # A named pipe would block the read (the epoch with it), a device (a link to
            # /dev/zero) would never end it.
            msg = (f"{path} is not a regular file but {_kind_of(st.st_mode)}: it is set "
                   f"aside; replace it with the image file, or remove it from the dataset")
            raise DataError(msg)
        if st.st_size > MAX_LOCAL_READ_BYTES:
            msg = (f"{path} holds {st.st_size:,} bytes, more than the "
                   f"{MAX_LOCAL_READ_BYTES:,} a sample's file may hold (read whole into a "
                   f"read worker's memory): it is set aside; is it the file the dataset "
                   f"meant? Replace or remove it")
            raise DataError(msg)
        # One read of the size fstat gave plus a byte: a file of that size comes back whole
        # and the short count shows its end, with no second read to find it. One that grew,
        # shrank or is larger than a read returns (2 GiB) is read on to its end. (A Python
        # file object adds an ioctl, two seeks and two fstats per file: ~5 of the ~15 us a
        # small JPEG's read takes here.)
        data = os.read(fd, st.st_size + 1)
        if len(data) == st.st_size:
            return data
        parts = [data]
        while chunk := os.read(fd, _READ_ON_BYTES):
            parts.append(chunk)
        return b"".join(parts)
    finally:
        os.close(fd)


def _kind_of(mode: int) -> str:
    """What a file that is not a regular one is, in words."""
    if stat.S_ISFIFO(mode):
        return "a named pipe"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "a special file"


def _read_fs(fs: pafs.FileSystem, path: str) -> bytes:
    with fs.open_input_stream(path, compression=None) as f:
        return f.read()


def _write_local_atomic(path: str, data) -> None:
    directory = os.path.dirname(path) or "."
    os.makedirs(directory, exist_ok=True)
    tmp = os.path.join(directory, f".{os.path.basename(path)}.{uuid.uuid4().hex}.tmp")
    try:
        # os.open with 0o666 lets the umask decide the mode, as for any new file.
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _delete_quietly(fs: pafs.FileSystem, path: str) -> None:
    try:
        fs.delete_file(path)
    except Exception:  # noqa: BLE001 - best effort after a failed write
        logger.debug("could not remove temp file %s", path)


def _retry(call, fs, path, retries=None, backoff=None,
           on_retry=None, uri=None):
    s = settings()
    return _errors.retrying(call, fs, path, s.read_retries if retries is None else retries,
                            s.read_retry_backoff_s if backoff is None else backoff, on_retry, uri)


def check_local_root(root: str, *, scanned_on: str = "", file: str | None = None,
                     fix: str = "keep the reads on the nodes that hold it "
                                "(PipelineConfig(ray_remote_args={'resources': ...}))") -> None:
    """Stop a read whose files were not found because this node does not hold the local
    dataset at ``root``: its folder is missing here, or empty (a mount point with nothing
    mounted). Tasks run on every node and read the dataset at the path it was scanned at;
    those files are good samples (elsewhere), and set aside as unreadable they would be
    dropped (from every later plan, or from a pack's shards). Files missing from a folder
    that holds others (removed on purpose) are left to the read's policy.

    Raises:
        StorageError: naming the folder, this node and the fix (an outage, never skipped).
    """
    import socket

    if "://" in root:
        return
    try:
        with os.scandir(root) as entries:
            if next(entries, None) is not None:
                return
        what = "is empty"
    except FileNotFoundError:
        what = "does not exist"
    except OSError:  # not a folder, not readable: the read's own error says it
        return
    here = socket.gethostname()
    scanned = (f" (the dataset was scanned on {scanned_on})"
               if scanned_on and scanned_on != here else "")
    missing = f" ({file} not found)" if file else ""
    err = StorageError(f"{root} {what} on this node ({here}){scanned}{missing}: tasks run on "
                       f"every node and read the dataset at the path it was scanned at. Put "
                       f"it on storage every node reaches (S3, HDFS, a shared mount), copy it "
                       f"to that path on every node, or {fix}")
    err.outage = True
    raise err


def refuse_outage(datas: Sequence[Any], *, again: str = "run the epoch again") -> None:
    """Raise when a read of the unit failed on the storage itself, not on its file.

    ``on_error="skip"`` sets bad files aside; an endpoint that is down or credentials that are
    refused are not a property of the samples: skipping them would set good files aside (and
    a sampler would never draw them again), or end the epoch "normally" with nothing
    delivered. So one read that found the storage unreachable (``StorageError.outage``) stops
    the unit, whatever the other reads did; other storage errors (an I/O error, a refusal)
    stop it when every read of the unit failed so (at least two). A lone failure among good
    reads is still skipped and reported, and a unit of one read is left to that policy.
    """
    down = next((d for d in datas if isinstance(d, StorageError) and d.outage), None)
    if down is not None:
        failed = sum(isinstance(d, StorageError) and d.outage for d in datas)
        msg = (f"{failed} of the {len(datas)} reads of this unit could not reach the storage; "
               f"the first failed with: {str(down).splitlines()[0]}. on_error='skip' sets bad "
               f"files aside, not outages: bring the storage back (or fix its address), then "
               f"{again} (an outage longer than the retries' few seconds of "
               f"backoff: raise RAYING_READ_RETRIES)")
        err = StorageError(msg)
        err.outage = True
        raise err
    if len(datas) < 2:
        return
    first = None
    for d in datas:
        if not isinstance(d, StorageError) or isinstance(d, NotFoundError):
            return
        if first is None or (getattr(first, "unread", False)
                             and not getattr(d, "unread", False)):
            first = d  # the first read made, not a slot left unread
    kind = type(first) if isinstance(first, CredentialsError) else StorageError
    said = str(first).splitlines()[0]
    check = ("check that the DataNodes are up (hdfs dfsadmin -report lists the live ones) and "
             "that this user may read the files" if "hdfs://" in said else
             "check the endpoint and the credentials")
    unread = sum(bool(getattr(d, "unread", False)) for d in datas)
    made = (f"none of the {len(datas)} reads of this unit succeeded" if not unread else
            f"none of the {len(datas) - unread} reads made of this unit's {len(datas)} "
            f"succeeded (the other {unread} were not started)")
    msg = (f"{made}; the first failed with: "
           f"{said}. The storage is unreachable or refusing access: on_error='skip' sets bad "
           f"files aside, not outages: {check}, then {again} (an outage longer than the "
           f"retries' few seconds of backoff: raise RAYING_READ_RETRIES)")
    raise kind(msg)
