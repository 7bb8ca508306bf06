"""Packing an image dataset into Parquet shards on Ray, one task per shard (`raying pack`)."""

from __future__ import annotations

import copy
import logging
import os
import time
from typing import Any

import numpy as np

from raying.dataset.manifest import IMAGE_EXTENSIONS, PARQUET_EXTENSIONS, Manifest
from raying.dataset.pack import (
    PACK_COLUMNS,
    PENDING_NAME,
    SHARD_NAME,
    STOP_MARKER,
    PackResult,
    pack_shard,
)
from raying.errors import ConfigError
from raying.options import StorageOptions, settings
from raying.storage import files as _storage
from raying.storage.spec import travelling_options

# The random stream of pack's row order (apart from the samplers' streams of the same seed).
_PACK_STREAM = 0x5041434B
# Source row groups a shard of Parquet input should draw from for its rows to mix: fewer,
# and pack warns that a source sorted by class gives shards of few classes.
MIN_GROUPS_PER_SHARD = 8

logger = logging.getLogger(__name__)


def pack(src: str | Manifest, dst: str, *, decode_size: int | None = None,
         shard_rows: int | None = None,
         row_group_rows: int | None = None,
         storage: StorageOptions | dict | None = None,
         dst_storage: StorageOptions | dict | None = None, on_error: str = "skip",
         verify: bool = False, progress: bool = True, label: str | None = "folder",
         overwrite: bool = False, shuffle: bool = True, seed: int = 0,
         columns: list[str] | tuple[str, ...] | dict[str, str] | None = None,
         format: str = "auto",  # noqa: A002 - Manifest.scan's name
         image_column: str | None = None,
         classes: list[str] | None = None) -> PackResult:
    """Write an image dataset (an image folder, or Parquet of encoded images) as Parquet
    shards, one Ray task per shard.

    Columns: ``id``, ``label``, ``image`` (the encoded file bytes as ``binary``) and ``path``;
    with ``decode_size=S`` the image is decoded, resized (shorter side) and center-cropped to
    SxS and stored as ``fixed_size_binary`` uint8 HWC plus ``height``, ``width``,
    ``channels``. Row groups of ``row_group_rows`` keep reads local; the class names travel in
    the schema metadata. Bad files are skipped and listed (``on_error="skip"``) or stop the
    pack (``"raise"``). Scan the result with ``Manifest.scan(dst, format="parquet",
    label="label")``.

    ``label="folder"`` takes each image's class from its subfolder; ``label=None`` packs a
    flat, unlabelled folder (label -1). A destination that already holds Parquet files is
    refused (their rows would be read with the new shards'); ``overwrite=True`` deletes them
    first.

    ``format`` is :meth:`Manifest.scan`'s (``"auto"``: Parquet when the folder holds
    ``.parquet`` files; a folder of images and Parquet files is refused until it says
    ``"images"`` or ``"parquet"``). Parquet input (``src`` a folder of Parquet files, or a
    Parquet ``Manifest``) is read as :meth:`Manifest.scan` reads it: ``label`` names the label column (``"folder"`` reads
    ``label``), ``image_column`` names the image column where it is neither ``image`` nor
    the files' one binary column, and ``columns=[...]`` carries extra columns (captions, boxes, metadata) into
    the shards under their own names and types (a dict ``{name: key}`` writes column
    ``name`` as ``key``), e.g. to pre-decode a captioned set with its
    captions (an extra column holding nulls is refused, as the scan refuses it). The shards'
    ``id`` column holds each row's number in the source (files, row groups, rows in order)
    and ``path`` its location there (``file#rgG/rowR``); a scan of the packed set numbers its
    rows afresh, so a batch's ``id`` is the packed row's. Pixels already stored pre-decoded
    are refused: there is nothing to decode. ``classes=[...]`` labels by those class names,
    in that order, as :meth:`Manifest.scan` does (a validation split packed with the
    training split's classes).

    ``shuffle=True`` (the default) writes the rows in a random order drawn from ``seed``:
    readers of Parquet read whole row groups and shuffle rows within a window of a few of
    them, so rows in folder order would fill each row group with one class, and every batch
    with a few (on a 10-class folder, 4 classes per batch of 64 on average). Each row keeps
    its source ``id`` and ``path``; ``shuffle=False`` keeps the folder's order. From Parquet
    input the order is random across whole source row groups and within each shard (each
    shard task reads only its own row groups, not the whole dataset): a shard mixes the
    rows of the ``shard_rows / rows per group`` source groups it takes, so a source sorted by
    class, in row groups of more than ``shard_rows / 8`` rows, gives shards of few classes
    (logged as a warning); write such a source with smaller row groups, or shuffled.
    """
    import ray

    from raying.engine.ray_setup import ensure_ray

    shard_rows = settings().pack_shard_rows if shard_rows is None else shard_rows
    row_group_rows = settings().pack_row_group_rows if row_group_rows is None else row_group_rows
    if on_error not in ("skip", "raise"):
        msg = f"pack(on_error=...) must be 'skip' or 'raise', got {on_error!r}"
        raise ConfigError(msg)
    if shard_rows < 1 or row_group_rows < 1:
        msg = (f"rows must be >= 1, got shard_rows={shard_rows} and "
               f"row_group_rows={row_group_rows}")
        raise ConfigError(msg)
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        msg = f"pack(seed=...) must be a non-negative int, got {seed!r}"
        raise ConfigError(msg)
    if decode_size is not None and decode_size < 1:
        msg = f"decode_size must be a positive number of pixels, got {decode_size!r}"
        raise ConfigError(msg)
    t0 = time.perf_counter()
    if isinstance(src, Manifest):
        if columns:
            msg = ("pack(columns=...) is for a folder it scans; a Manifest carries the "
                   "columns it was scanned with: Manifest.scan(src, columns=[...])")
            raise ConfigError(msg)
        if image_column is not None:
            msg = ("pack(image_column=...) is for a folder it scans; a Manifest carries the "
                   "image column it was scanned with: Manifest.scan(src, image_column=...)")
            raise ConfigError(msg)
        if classes is not None:
            msg = ("pack(classes=...) is for a folder it scans; a Manifest carries the "
                   "classes it was scanned with: Manifest.scan(src, classes=[...])")
            raise ConfigError(msg)
        manifest = src
    else:
        manifest = Manifest.scan(src, format=format, label=label, storage=storage,
                                 columns=columns, image_column=image_column, classes=classes)
    taken = [c for c in (manifest.meta.get("columns") or {}) if c in PACK_COLUMNS]
    if taken:
        msg = (f"columns {taken} would overwrite columns pack writes itself {PACK_COLUMNS}; "
               f"rename them in the source, or leave them out of columns=")
        raise ConfigError(msg)
    if manifest.format == "parquet" and manifest.meta.get("decoded"):
        msg = (f"{manifest.root} stores pre-decoded pixels (fixed-size binary of "
               f"{'x'.join(map(str, manifest.meta['decoded']))}); pack reads encoded images "
               f"(an image folder, or Parquet of JPEG/PNG bytes), so there is nothing to pack")
        raise ConfigError(msg)
    # Options as the read tasks must get them: the endpoint and region this process took from
    # its environment included (a worker's environment may lack them).
    out_opts = travelling_options(dst, dst_storage if dst_storage is not None else storage)
    out_fs, out_root = _storage.resolve(dst, out_opts)
    _refuse_inside_source(src if isinstance(src, str) else manifest.root, manifest.storage,
                          out_fs, out_root, dst)
    old = _check_destination(out_fs, out_root, dst, overwrite=overwrite,  # before Ray starts
                             options=out_opts)
    ensure_ray()  # before the destination is cleared or made: a Ray not reached leaves it
    _clear_destination(out_fs, old)
    _storage.make_dirs(out_fs, out_root)
    stale = f"{out_root.rstrip('/')}/{STOP_MARKER}"  # from a pack here that stopped
    if _storage.exists(out_fs, stale):
        out_fs.delete_file(stale)
    _remove_pending(out_fs, out_root)  # shards of a pack here that was killed
    task: Any = ray.remote(num_cpus=1, max_retries=3)(pack_shard)  # type: ignore[arg-type]
    shipped = copy.copy(manifest)
    shipped.storage = travelling_options(manifest.root, manifest.storage)
    if manifest.format == "parquet":
        shipped.row_group_table()  # worked out once here, not in every shard task
    src_ref = ray.put(shipped)
    n = len(manifest)
    rng = np.random.default_rng([int(seed), _PACK_STREAM])
    if not shuffle:
        order = np.arange(n, dtype=np.int64)
    elif manifest.format == "parquet":
        order = _local_shuffle(manifest, shard_rows, rng)
    else:
        order = rng.permutation(n).astype(np.int64)
    refs = []
    for k, start in enumerate(range(0, n, shard_rows)):
        ids = order[start:start + shard_rows]
        refs.append(task.remote(src_ref, ids, dst, out_opts,
                                PENDING_NAME.format(SHARD_NAME.format(k)),
                                decode_size=decode_size, row_group_rows=row_group_rows,
                                on_error=on_error, verify=verify))
    names = [SHARD_NAME.format(k) for k in range(len(refs))]
    try:
        results = _wait_all(refs, total=n, progress=progress)
        for name in names:  # every shard written: each takes its name
            _storage.move(out_fs, f"{out_root.rstrip('/')}/{PENDING_NAME.format(name)}",
                          f"{out_root.rstrip('/')}/{name}")
    except BaseException:
        # A pack that stops part-way must not leave shards that scan as a whole dataset.
        _remove_shards(refs, out_fs, out_root,
                       [*names, *(PENDING_NAME.format(name) for name in names)])
        raise
    named = {PENDING_NAME.format(name): name for name in names}
    for r in results:  # the shards by the names they took
        r["shard"] = named[r["shard"]]
    results.sort(key=lambda r: r["shard"])
    skipped = [s for r in results for s in r["skipped"]]
    return PackResult(dst=dst, shards=[r["shard"] for r in results],
                      rows=sum(r["rows"] for r in results),
                      bytes_written=sum(r["bytes"] for r in results), skipped=skipped,
                      seconds=time.perf_counter() - t0)


def _local_shuffle(manifest: Manifest, shard_rows: int, rng: np.random.Generator
                   ) -> np.ndarray:
    """A random order of a Parquet manifest's ids in which each shard's rows come from a few
    whole source row groups: the row groups in a random order, cut into shards, and the
    rows shuffled within each shard. A shard task then reads only its own row groups (a fully
    random order would have every task read every row group of the dataset); rows mix
    across the ``shard_rows / rows per group`` groups a shard takes."""
    _, _, start, rows = manifest.row_group_table()
    per_shard = shard_rows / max(1.0, float(np.median(rows)))
    if per_shard < MIN_GROUPS_PER_SHARD and len(start) > per_shard:
        logger.warning(
            "pack: each shard's rows come from about %.1f source row groups (%d rows per "
            "group, shard_rows=%d): rows mix within those groups only, so a source sorted by "
            "class gives shards of few classes; write the source with smaller row groups or "
            "in a shuffled order", max(per_shard, 1.0), int(np.median(rows)), shard_rows)
    perm = rng.permutation(len(start))
    order = np.concatenate([np.arange(start[k], start[k] + rows[k], dtype=np.int64)
                            for k in perm])
    for a in range(0, len(order), shard_rows):
        order[a:a + shard_rows] = rng.permutation(order[a:a + shard_rows])
    return order


def _refuse_inside_source(src: str, storage: Any, out_fs: Any, out_root: str,
                          dst: str) -> None:
    """Refuse a destination at or under the source folder: the shards would become part of
    the source (a later scan of an image folder then finds Parquet files beside its images
    and refuses it; one of Parquet would read the shards' rows twice); and one that holds the
    source (a folder, or one file), whose scan would read the source with the shards."""
    import pyarrow.fs as pafs

    try:
        src_fs, src_root = _storage.resolve(src, StorageOptions.coerce(storage))
        one_file = src_fs.get_file_info(src_root).type == pafs.FileType.File
    except Exception:  # noqa: BLE001 - a source this cannot place: the scan already read it
        return
    if type(src_fs) is not type(out_fs):
        return
    a, b = src_root.rstrip("/"), out_root.rstrip("/")
    if isinstance(src_fs, pafs.LocalFileSystem):  # through symbolic links
        a, b = os.path.realpath(a), os.path.realpath(b)
    if not one_file and (b == a or b.startswith(a + "/")):
        msg = (f"{dst} lies inside the source {src}: the shards would join the dataset they "
               f"are packed from. Pack into a folder outside it")
        raise ConfigError(msg)
    if a.startswith(b + "/"):
        msg = (f"the source {src} lies inside {dst}: a scan of {dst} would read the source "
               f"with the shards (and overwrite=True would delete a Parquet source before "
               f"it is read). Pack into a folder that does not hold the source")
        raise ConfigError(msg)


def _check_destination(fs: Any, root: str, dst: str, *, overwrite: bool,
                       options: Any = None) -> list[Any]:
    """The Parquet files already at the destination's top level, for ``overwrite`` to delete;
    refused when there are any without it, when its subfolders hold any, when it holds image
    files (a scan of it would find both kinds and ask which to read), and on S3 when its
    bucket does not exist (pack makes folders, not buckets)."""
    try:
        found = _storage.list_files(fs, root, extensions=PARQUET_EXTENSIONS + IMAGE_EXTENSIONS)
    except _storage.NotFoundError:
        _refuse_missing_bucket(fs, root, dst, options)
        return []
    images = [i for i in found if not i.path.lower().endswith(PARQUET_EXTENSIONS)]
    if images:
        top = root.rstrip("/")
        name = images[0].path[len(top) + 1:] if images[0].path.startswith(top + "/") else (
            images[0].path)
        msg = (f"{dst} holds {len(images)} image file(s) ({name}, ...): a scan of it would "
               f"find the shards beside them and could not tell which dataset to read "
               f"(overwrite=True deletes only Parquet files). Pack into a folder of its own")
        raise ConfigError(msg)
    old = [i for i in found if i.path.lower().endswith(PARQUET_EXTENSIONS)]  # what a scan reads
    if not old:
        return []
    if not overwrite:
        name = old[0].path.rsplit("/", 1)[-1]
        msg = (f"{dst} already holds {len(old)} Parquet file(s) ({name}, ...): a scan of it "
               f"would read their rows with the new shards'. Pack into an empty folder, or "
               f"pass overwrite=True to delete them first")
        raise ConfigError(msg)
    top = root.rstrip("/")
    nested = [i.path[len(top) + 1:] for i in old if i.path.rpartition("/")[0] != top]
    if nested:
        # Another dataset in a subfolder: overwrite=True replaces a pack, it does not delete
        # whatever a folder holds.
        msg = (f"{dst} holds Parquet files in its subfolders ({', '.join(nested[:3])}"
               f"{', ...' if len(nested) > 3 else ''}), which a scan of it would read with "
               f"the shards; overwrite=True deletes only the Parquet files at its top level. "
               f"Pack into a folder of its own")
        raise ConfigError(msg)
    return old


def _refuse_missing_bucket(fs: Any, root: str, dst: str, options: Any) -> None:
    """On S3, refuse a destination whose bucket does not exist, before any work: the shards'
    writes would each fail on it after the whole source was read."""
    import pyarrow.fs as pafs

    from raying.storage.errors import missing_error

    if not isinstance(fs, pafs.S3FileSystem):
        return
    bucket = root.split("/", 1)[0]
    try:
        missing = fs.get_file_info(bucket).type == pafs.FileType.NotFound
    except Exception:  # noqa: BLE001 - unknown here: the writes say what goes wrong
        return
    if missing:
        err = missing_error(fs, root, dst, options)
        raise type(err)(f"{err}; pack writes into a bucket that exists: create it first, "
                        f"or pack into another") from None


def _clear_destination(fs: Any, old: list[Any]) -> None:
    """Delete the Parquet files :func:`_check_destination` found."""
    for info in old:
        try:
            fs.delete_file(info.path)
        except Exception as exc:
            raise _storage.storage_error(exc, info.path, action="delete") from None


def _remove_pending(fs: Any, root: str) -> None:
    """Remove the shards a pack into ``root`` wrote and never named (it was killed)."""
    import fnmatch

    try:
        infos = _storage.list_files(fs, root, recursive=False, skip_prefixes=".")
    except _storage.NotFoundError:
        return
    for info in infos:
        if fnmatch.fnmatch(info.path.rsplit("/", 1)[-1], PENDING_NAME.format("part-*.parquet")):
            try:
                fs.delete_file(info.path)
            except Exception as exc:
                raise _storage.storage_error(exc, info.path, action="delete") from None


def _remove_shards(refs: list[Any], fs: Any, root: str, names: list[str]) -> None:
    """Stop the shard tasks still to run and remove every shard this pack wrote: a marker
    in the destination tells each task to write nothing (``ray.cancel`` of a task as it
    completes can abort the driver in Ray 2.60); once they have ended, the shards go."""
    import pyarrow.fs as pafs
    import ray

    marker = f"{root.rstrip('/')}/{STOP_MARKER}"
    try:
        _storage.write_bytes_atomic(fs, marker, b"")
        fenced = True
    except Exception as exc:  # noqa: BLE001 - said below; the tasks are still waited for
        logger.debug("pack: could not write %s (%s)", marker, exc)
        fenced = False
    try:
        _, running = ray.wait(refs, num_returns=len(refs), timeout=60)
    except Exception as exc:  # noqa: BLE001 - Ray itself gone: the pack's own error goes on
        logger.warning("pack: could not wait for the shard tasks of this stopped pack (%s)",
                       exc)
        running = refs
    for name in [*names, *([STOP_MARKER] if fenced and not running else [])]:
        path = f"{root.rstrip('/')}/{name}"
        try:
            if fs.get_file_info(path).type != pafs.FileType.NotFound:
                fs.delete_file(path)
        except Exception as exc:  # noqa: BLE001 - said, and the pack's own error goes on
            logger.warning("pack: could not remove %s of this stopped pack (%s); remove it "
                           "before scanning the destination", path, exc)
    if running and fenced:
        logger.warning("pack: %d shard tasks of this stopped pack still run; %s in the "
                       "destination keeps them from writing (the next pack there removes it)",
                       len(running), STOP_MARKER)
    elif running:
        logger.warning("pack: %d shard tasks of this stopped pack still run, and the marker "
                       "that would keep them from writing (%s) could not be written: they "
                       "may still write shards to %s; remove its Parquet files before "
                       "scanning it", len(running), STOP_MARKER, root)


def _wait_all(refs: list[Any], *, total: int, progress: bool) -> list[dict[str, Any]]:
    import ray

    from raying.engine.progress import progress_bar

    out = []
    pending = list(refs)
    with progress_bar(total=total, desc="pack", unit="img", enabled=progress) as bar:
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            try:
                res = ray.get(done[0])
            except ray.exceptions.RayTaskError as exc:
                cause = getattr(exc, "cause", None)
                if isinstance(cause, Exception) and not isinstance(cause, ray.exceptions.RayError):
                    raise cause from None
                raise
            out.append(res)
            bar.update(res["rows"] + len(res["skipped"]))
    return out
