"""Whether a Parquet file a read opens is still the one its manifest was scanned from.

A file rewritten after the scan (regrouped, rows dropped or reordered, recompressed) would
give its rows under other ids: the scan records each file's size and modification time
(``manifest.meta["file_sizes"]``, ``["file_mtimes"]``, as ``ReadSpec.file_sizes`` /
``file_mtimes``), and the reads check them (:func:`verify_file`, once per process and
dataset; :func:`size_check`, at each open) and, for manifests without them, each row
group's rows (:func:`check_groups`). Every finding is a :class:`FileChangedError`.
"""

from __future__ import annotations

import collections
import threading
from typing import Any

import numpy as np
import pyarrow.fs as _pafs
import pyarrow.parquet as pq

from raying.errors import FileChangedError
from raying.read.spec import ReadSpec
from raying.sampling.plan import ReadUnit


def _changed(spec: ReadSpec, f: int, what: str) -> FileChangedError:
    """The error for file ``f`` found other than the scan found it (``what`` says how)."""
    rel = spec.files[f] if spec.files else ""
    where = f"{spec.root.rstrip('/')}/{rel}" if rel else spec.root
    return FileChangedError(f"{where} was rewritten since the manifest was scanned{what}; its "
                            f"rows would come under other ids: scan the dataset again "
                            f"(Manifest.scan)")


def check_local_root(spec: ReadSpec, *, file: str | None = None) -> None:
    """Stop a read whose files were not found because this node does not hold the local
    dataset (:func:`raying.storage.files.check_local_root`, for the spec's dataset).
    ``file``: the Parquet file not found, named in the error.

    Raises:
        StorageError: naming the folder, this node and the fix (an outage, never skipped).
    """
    from raying.storage.files import check_local_root as check

    check(spec.root, scanned_on=spec.scanned_on, file=file)


# Files found unchanged since the scan, in this process: the indices of the files, per
# (filesystem, dataset key, scanning machine); the few datasets used last.
_VERIFIED: collections.OrderedDict[tuple[int, str, str], set[int]] = collections.OrderedDict()
_VERIFIED_DATASETS = 16
_VERIFIED_LOCK = threading.Lock()


def _verified(key: tuple[int, str, str], f: int) -> bool:
    with _VERIFIED_LOCK:
        done = _VERIFIED.get(key)
        if done is None:
            return False
        _VERIFIED.move_to_end(key)
        return f in done


def _mark_verified(key: tuple[int, str, str], f: int) -> None:
    with _VERIFIED_LOCK:
        _VERIFIED.setdefault(key, set()).add(f)
        _VERIFIED.move_to_end(key)
        while len(_VERIFIED) > _VERIFIED_DATASETS:
            _VERIFIED.popitem(last=False)


def verify_file(spec: ReadSpec, fs: Any, path: str, f: int) -> None:
    """Stop the read when file ``f`` is not the one scanned: its size, or its modification
    time (a rewrite of the same size: rows reordered in an uncompressed file), differs from
    the manifest's. Looked up once per process and dataset (one stat, or one HEAD on S3);
    a lookup that fails, or finds nothing there, leaves it to the read, whose errors say
    more. A local file's time is compared only on the machine that scanned it: a copy of
    the dataset on each node has times of its own.

    Raises:
        FileChangedError: naming the file, what differs, and the fix.
    """
    sizes, mtimes = spec.file_sizes, spec.file_mtimes
    if f >= len(sizes):
        return
    key = (id(fs), spec.dataset_key, spec.scanned_on)
    if _verified(key, f):
        return
    try:
        info = fs.get_file_info(path)
    except Exception:  # noqa: BLE001 - the read meets the same failure and names it
        return
    if info.type != _pafs.FileType.File:
        return
    from raying.dataset.scan import changed_since_scan

    what = changed_since_scan(info, f, sizes, mtimes, spec.scanned_on)
    if what is not None:
        raise _changed(spec, f, f" ({what})")
    _mark_verified(key, f)


def verify_files(spec: ReadSpec, fs: Any, files: dict[str, int]) -> None:
    """:func:`verify_file` for each (path, file index) of a unit, the lookups of a remote
    storage side by side (a unit of a random plan may start on hundreds of files)."""
    key = (id(fs), spec.dataset_key, spec.scanned_on)
    todo = [(p, f) for p, f in files.items() if f < len(spec.file_sizes) and not _verified(key, f)]
    if len(todo) <= 1 or isinstance(fs, _pafs.LocalFileSystem):
        for p, f in todo:
            verify_file(spec, fs, p, f)
        return
    import concurrent.futures as cf

    from raying.options import settings

    with cf.ThreadPoolExecutor(max_workers=min(len(todo), settings().remote_read_threads)
                               ) as pool:
        for done in [pool.submit(verify_file, spec, fs, p, f) for p, f in todo]:
            done.result()  # the first file found changed raises


def size_check(spec: ReadSpec, f: int) -> Any:
    """A check of file ``f``'s size against the scan's (None where the manifest has none)."""
    if not spec.file_sizes or f >= len(spec.file_sizes):
        return None
    want = int(spec.file_sizes[f])

    def check(size: int) -> None:
        if int(size) != want:
            raise _changed(spec, f, f" ({int(size)} bytes, the scan found {want})")

    return check


def scanned_groups(unit: ReadUnit, order: np.ndarray) -> np.ndarray | None:
    """What the scan found in each of the unit's row groups (rows, image bytes per row), in
    ``order`` (None where the unit does not say)."""
    found = getattr(unit, "group_scan", None)
    if found is None or len(found) != len(order):
        return None
    return np.asarray(found, dtype=np.int64)[order]


def check_groups(spec: ReadSpec, groups: np.ndarray, scanned: np.ndarray | None,
                   md: pq.FileMetaData) -> None:
    """Stop the read when row groups of a file (``groups``: its rows of the unit's table)
    differ from the scan's: other rows, or other images (another size), so that the rows
    read would come under other ids. The image bytes are compared only for a manifest that
    records the files' sizes: older manifests may have measured them otherwise.

    Raises:
        FileChangedError: naming the file, the row groups, and what differs.
    """
    if scanned is None or not len(groups):
        return
    from raying.dataset.scan import image_bytes_per_row, image_leaves

    leaves = image_leaves(md, spec.image_column or "image")
    bad = []
    for k, g in enumerate(groups[:, 1].tolist()):
        rows = md.row_group(g).num_rows if g < md.num_row_groups else 0
        per_row = image_bytes_per_row(md, g, leaves) if rows else 0
        if not spec.file_sizes:
            per_row = int(scanned[k, 1])
        if (rows, per_row) != (int(scanned[k, 0]), int(scanned[k, 1])):
            bad.append(f"{g} ({rows} rows of {per_row} image bytes each, the scan found "
                       f"{int(scanned[k, 0])} of {int(scanned[k, 1])})")
    if bad:
        more = " ..." if len(bad) > 3 else ""
        raise _changed(spec, int(groups[0, 0]), f": row groups {', '.join(bad[:3])}{more}")
