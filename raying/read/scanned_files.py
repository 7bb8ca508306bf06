"""Whether a Parquet file a read opens is still the one its manifest was scanned from.

A file rewritten after the scan (regrouped, rows dropped or reordered, recompressed) would
give its rows under other ids: the scan records each file's size and modification time
(``manifest.meta["file_sizes"]``, ``["file_mtimes"]``, as ``ReadSpec.file_sizes`` /
``file_mtimes``), and the reads check them (:func:`verify_file`, once per process and
dataset; :func:`size_check`, at each open) and, for manifests without them, each row
group's rows (:func:`check_groups`). Every finding is a :class:`FileChangedError`.
"""

from __future__ import annotations

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


# Files found unchanged since the scan, in this process: (filesystem, dataset key, path).
_VERIFIED: set[tuple[int, str, str]] = set()
_VERIFIED_LOCK = threading.Lock()


def verify_file(spec: ReadSpec, fs: Any, path: str, f: int) -> None:
    """Stop the read when file ``f`` is not the one scanned: its size, or its modification
    time (a rewrite of the same size: rows reordered in an uncompressed file), differs from
    the manifest's. Looked up once per process and dataset (one stat, or one HEAD on S3);
    a lookup that fails leaves it to the read, whose errors say more.

    Raises:
        FileChangedError: naming the file, what differs, and the fix.
    """
    sizes, mtimes = spec.file_sizes, spec.file_mtimes
    if f >= len(sizes):
        return
    key = (id(fs), spec.dataset_key, path)
    with _VERIFIED_LOCK:
        if key in _VERIFIED:
            return
    try:
        info = fs.get_file_info(path)
    except Exception:  # noqa: BLE001 - the read meets the same failure and names it
        return
    if info.type != _pafs.FileType.File:
        return
    from raying.dataset.scan import mtime_s

    size, want_size = int(info.size), int(sizes[f])
    stamp = mtime_s(info)
    want_stamp = int(mtimes[f]) if f < len(mtimes) else -1
    what = None
    if size != want_size:
        what = f"{size} bytes, the scan found {want_size}"
    elif stamp >= 0 and want_stamp >= 0 and stamp != want_stamp:
        what = (f"modified at {stamp}, the scan found {want_stamp} (seconds since 1970), with "
                f"as many bytes")
    if what is not None:
        raise _changed(spec, f, f" ({what})")
    with _VERIFIED_LOCK:
        _VERIFIED.add(key)


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
