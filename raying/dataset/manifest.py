"""The manifest: every sample of a dataset with a dense, stable id, its location and label."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from raying.errors import ConfigError, DataError
from raying.options import STORAGE_ALIASES, StorageOptions
from raying.storage import files as _storage
from raying.storage.errors import NotFoundError

logger = logging.getLogger(__name__)

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".jpe", ".jfif", ".png", ".bmp", ".gif", ".webp", ".tif",
                    ".tiff")
PARQUET_EXTENSIONS = (".parquet", ".pq", ".parq")  # .parq: fastparquet's and Dask's
MANIFEST_VERSION = 1
# Names a manifest file is refused under: it is Parquet whatever its name says.
_NOT_PARQUET = frozenset({"json", "csv", "txt", "yaml", "yml", "jsonl", "pkl", "pickle"})
_FORMATS = ("auto", "images", "parquet")

LabelSpec = str | Callable[[str], Any] | None


class Manifest:
    """Every sample of a dataset, listed once, with a dense id ``0..N-1`` in sorted order.

    For an image folder a sample is a file; its label comes from its class subfolder
    (``label="folder"``), from a function of its relative path, or is absent (-1). For Parquet
    a sample is a row; its location is (file, row group, row) and its label comes from a
    column. Ids follow the sorted order of paths (and of row groups and rows inside a file), so
    the same data always gets the same ids.

    Build one with :meth:`scan`, keep it with :meth:`save` and :meth:`load`.
    """

    def __init__(self, *, root: str, fmt: str, columns: dict[str, np.ndarray],
                 classes: list[str] | None, storage: StorageOptions | None = None,
                 files: list[str] | None = None, meta: dict[str, Any] | None = None) -> None:
        self.root = root
        self.format = fmt
        self.classes = classes
        self.storage = StorageOptions.coerce(storage)
        self.files = files or []
        self.meta = dict(meta or {})
        self._cols = columns
        n = len(columns["label"])
        for name, col in columns.items():
            if len(col) != n:
                msg = f"manifest column {name!r} has {len(col)} rows, expected {n}"
                raise DataError(msg)

    # -- construction --------------------------------------------------------------------------
    @classmethod
    def scan(cls, uri: str | os.PathLike, format: str = "auto", label: LabelSpec = "folder",
             storage: StorageOptions | dict | None = None, *,
             image_column: str | None = None,
             extensions: tuple[str, ...] = IMAGE_EXTENSIONS,
             classes: list[str] | None = None,
             columns: list[str] | tuple[str, ...] | dict[str, str] | None = None
             ) -> Manifest:
        """List a dataset once and give every sample an id.

        Args:
            uri: a folder or file: plain path (a ``str`` or ``pathlib.Path``), ``file://``,
                ``s3://bucket/prefix`` or ``hdfs://host:port/path``.
            format: ``"images"``, ``"parquet"`` or ``"auto"`` (Parquet when the folder holds
                ``.parquet`` files, images otherwise; a folder holding both is refused,
                asking which).
            label: for images, ``"folder"`` (class subfolders), a function of the relative
                path returning a class name or int, or None. For Parquet, the name of the label
                column (``"folder"`` is read as ``"label"``), or None.
            storage: options for remote storage; see :class:`raying.options.StorageOptions`.
            image_column: Parquet column holding the image; default ``image`` or the only
                binary column.
            extensions: image file endings to include (case-insensitive, dot optional).
            classes: the class names, in label order, to use instead of those found here:
                scan a validation split with ``classes=train.classes`` so that its labels
                mean what the training split's do (a class missing from it, or empty, would
                otherwise shift every later label). A class found that is not in the list is
                an error.
            columns: Parquet only: more columns to carry into every batch under their own
                names (captions, boxes, per-sample metadata): numbers, strings, bytes, and
                lists of numbers (see :mod:`raying.dataset.columns`). Every file must have
                them, with one type. A dict ``{parquet_name: batch_key}`` carries a column
                under another key: a column whose name every batch already uses for its
                own (``id``, ``weight``, ``prob``) comes through as
                ``columns={"id": "source_id"}``.

        Returns:
            The manifest. One listing of the storage, no Ray tasks.
        """
        from raying.dataset import scan as _scan

        if format not in _FORMATS:
            msg = f"format must be one of {_FORMATS}, got {format!r}"
            raise ConfigError(msg)
        opts = StorageOptions.coerce(storage)
        from raying.storage.spec import uri_string

        uri = uri_string(uri)
        if "://" not in uri or uri.lower().startswith("file:"):
            # One spelling per local folder (a relative root would also resolve against the
            # reader's working directory, and the fingerprint would differ per spelling).
            from raying.storage.spec import _local_path

            uri = _local_path(uri)
        else:  # and one per remote root: s3a://b/p/ is s3://b/p (the fingerprint, the caches)
            from raying.storage.spec import S3_SCHEME_ALIASES

            scheme, _, rest = uri.partition("://")
            scheme = "s3" if scheme.lower() in S3_SCHEME_ALIASES else scheme.lower()
            host, _, path = rest.partition("/")
            if scheme == "s3" or path.strip("/"):  # hdfs://nn:9000/ keeps its root's "/"
                rest = rest.rstrip("/")
            uri = f"{scheme}://{rest}"
        fs, path = _storage.resolve(uri, opts)
        listed: dict[str, list[str]] = {}
        infos = _scan.list_dataset(fs, path, uri, listed, opts)
        named = len(infos) == 1 and infos[0].path.rstrip("/") == path.rstrip("/")
        file_uri = uri
        if named:
            # One file named by the URI: its folder is the root, the file its only member.
            path = path.rstrip("/").rpartition("/")[0] or "/"
            uri = uri.rstrip("/").rpartition("/")[0] or "/"
        parquet = _scan.parquet_members(path, infos, PARQUET_EXTENSIONS)
        if named and (format == "parquet" or infos[0].path.lower().endswith(PARQUET_EXTENSIONS)):
            parquet = infos  # the user named it (a _-prefixed name too), or says what it is
        if isinstance(extensions, str):
            extensions = (extensions,)
        endings = tuple("." + e.lower().lstrip(".") for e in extensions)  # ".JPG", "png" too
        image_flags = [i.path.lower().endswith(endings) for i in infos]
        if format == "auto":
            format = "parquet" if parquet else "images"
            images = sum(image_flags)
            if parquet and images:
                # A folder of both: a captions.parquet beside an image folder, or a few
                # pictures beside Parquet shards. Which one the user means is theirs to say.
                msg = (f"{uri} holds both Parquet files ({len(parquet)}, e.g. "
                       f"{parquet[0].path.rpartition('/')[2]}) and image files ({images}); say "
                       f"which it is: format='images' (the Parquet files are left out) or "
                       f"format='parquet' (the images are left out)")
                raise ConfigError(msg)
        columns = _extra_columns(columns, format, uri)
        if format == "parquet":
            if not parquet:
                endings = ", ".join(f"*{e}" for e in PARQUET_EXTENSIONS)
                msg = (f"no Parquet files ({endings}) found under {uri}; check the URI (one "
                       f"file of another ending is read when the URI names it), or use "
                       f"format='images' for an image folder")
                raise DataError(msg)
            col = "label" if label == "folder" else label
            if col is not None and not isinstance(col, str):
                msg = f"for Parquet, label must be a column name or None, got {label!r}"
                raise ConfigError(msg)
            try:
                m = _scan.scan_parquet(cls, fs, path, uri, parquet, col, image_column, opts,
                                       columns=columns, classes_given=classes is not None)
            except DataError as exc:
                if not named:
                    raise
                # The messages name the root, the file's folder: say which file was meant.
                folder = uri.rstrip("/").rpartition("/")[2]
                hive = ("; a hive partition's label comes from its folder name when the "
                        f"dataset's root is scanned: scan {uri.rstrip('/').rpartition('/')[0]}"
                        if "=" in folder else "")
                raise DataError(f"{file_uri} (the file the URI names): {exc}{hive}") from None
            return _scan.use_classes(m, classes)
        if columns:
            msg = (f"columns={[a for a, _ in columns]} reads Parquet columns, but {uri} is "
                   f"scanned as an image "
                   f"folder (format={format!r}), which has none; drop columns=, or point at "
                   f"Parquet files")
            raise ConfigError(msg)
        images = [i for i, image in zip(infos, image_flags, strict=True) if image]
        _left_out([i for i, image in zip(infos, image_flags, strict=True) if not image],
                  uri, len(images))
        if not images and named:
            msg = (f"{file_uri} names one file, which is neither Parquet "
                   f"({', '.join(PARQUET_EXTENSIONS)}) nor an image ({', '.join(extensions)}); "
                   f"point at the dataset's folder or at a data file (format='parquet' reads "
                   f"Parquet under another name)")
            raise DataError(msg)
        if not images:
            seen = sorted({_ext(i.path) for i in infos})
            fix = ("these are Parquet files: pass format='parquet' (or format='auto')"
                   if set(seen) & set(PARQUET_EXTENSIONS) else
                   "check the URI, or pass Manifest.scan(..., extensions=[...]) with the "
                   "endings its images have")
            msg = (f"no images ({', '.join(extensions)}) found under {uri}"
                   f"{'; found endings ' + ', '.join(seen[:8]) if seen else ' (it is empty)'}; "
                   f"{fix}")
            raise DataError(msg)
        if named and label == "folder":
            msg = (f"{file_uri} names one image file, and label='folder' (the default) takes "
                   f"labels from the class folders of a dataset's folder: scan the folder "
                   f"that holds its class folder, or, to read this one image unlabelled, "
                   f"pass label=None")
            raise DataError(msg)
        return _scan.use_classes(_scan.scan_images(cls, path, uri, images, label, opts,
                                                   dirs=None if classes else listed.get("dirs")),
                                 classes)

    # -- persistence ---------------------------------------------------------------------------
    def save(self, uri: str, storage: StorageOptions | dict | None = None) -> None:
        """Write the manifest as one Parquet file (columns per sample, the rest as metadata)."""
        name = os.fspath(uri)
        last = name.rstrip("/").rsplit("/", 1)[-1]
        suffix = last.rpartition(".")[2].lower() if "." in last else ""
        if suffix in _NOT_PARQUET:
            stem = name[:len(name) - len(suffix)]
            msg = (f"a manifest is written as Parquet, not {suffix.upper()}: {name!r} would be "
                   f"a Parquet file under a .{suffix} name; save it as {stem + 'parquet'!r}")
            raise ConfigError(msg)
        opts = StorageOptions.coerce(storage) if storage is not None else self.storage
        fs, path = _storage.resolve(uri, opts)
        table = pa.table({name: pa.array(col) for name, col in self._cols.items()})
        meta = {"version": MANIFEST_VERSION, "root": self.root, "format": self.format,
                "classes": self.classes, "files": self.files, "meta": self.meta,
                "storage": self.storage.public_dict()}
        table = table.replace_schema_metadata({b"raying.dataset.manifest": json.dumps(meta).encode()})
        sink = pa.BufferOutputStream()
        pq.write_table(table, sink)
        _storage.write_bytes_atomic(fs, path, sink.getvalue().to_pybytes())

    @classmethod
    def load(cls, uri: str, storage: StorageOptions | dict | None = None) -> Manifest:
        """Read a manifest written by :meth:`save`."""
        opts = StorageOptions.coerce(storage)
        fs, path = _storage.resolve(uri, opts)
        # Read as any file is (retried; refused keys and unreachable storage named as such),
        # then parsed: only what fails to parse is a manifest to write again.
        try:
            data = _storage.read_bytes(fs, path)
        except NotFoundError:
            msg = f"no manifest at {uri}; write one with Manifest.scan(...).save({uri!r})"
            raise NotFoundError(msg) from None
        try:
            table = pq.read_table(pa.BufferReader(data))
        except (pa.ArrowInvalid, OSError) as exc:
            msg = f"{uri} is not a readable manifest ({exc}); scan the dataset again"
            raise DataError(msg) from None
        raw = (table.schema.metadata or {}).get(b"raying.dataset.manifest")
        if raw is None:
            msg = f"{uri} is a Parquet file but not a raying manifest; write one with Manifest.save"
            raise DataError(msg)
        meta = json.loads(raw)
        cols = {name: table.column(name).to_numpy(zero_copy_only=False)
                for name in table.column_names}
        if "path" in cols:
            cols["path"] = np.asarray(cols["path"], dtype=object)
        saved = {k: v for k, v in meta.get("storage", {}).items() if v is not None}
        if storage is not None:  # the caller's settings and keys (never saved) win
            fields = dataclasses.asdict(opts)
            given = ({STORAGE_ALIASES.get(k, k): fields[STORAGE_ALIASES.get(k, k)]
                      for k in storage} if isinstance(storage, Mapping)
                     else {k: v for k, v in fields.items() if v})
            if any(given.get(k) for k in ("access_key_id", "secret_access_key",
                                          "session_token", "profile")):
                saved.pop("anonymous", None)  # a set scanned unsigned, read with keys now
            saved.update(given)
        return cls(root=meta["root"], fmt=meta["format"], columns=cols,
                   classes=meta.get("classes"), storage=StorageOptions.coerce(saved),
                   files=meta.get("files"), meta=meta.get("meta"))

    # -- access --------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._cols["label"])

    def __repr__(self) -> str:
        classes = f", classes={len(self.classes)}" if self.classes else ""
        return f"Manifest({self.format}, {len(self)} samples, root={self.root!r}{classes})"

    @property
    def labels(self) -> np.ndarray:
        """int64 label per id; -1 where the dataset has no label."""
        return self._cols["label"]

    @property
    def sizes(self) -> np.ndarray:
        """Encoded bytes per id (file size for images; value size for Parquet), -1 if unknown."""
        return self._cols["size"]

    def column(self, name: str) -> np.ndarray:
        """One per-id column: ``label``, ``size``, ``path`` (images), ``file``, ``row_group``,
        ``row`` (Parquet)."""
        return self._cols[name]

    def path_of(self, ids: np.ndarray | int) -> list[str]:
        """Human-readable location of each id (relative path, or file#row_group/row)."""
        idx = np.atleast_1d(np.asarray(ids, dtype=np.int64))
        if self.format == "images":
            return [str(p) for p in self._cols["path"][idx]]
        f, g, r = self._cols["file"][idx], self._cols["row_group"][idx], self._cols["row"][idx]
        return [f"{self.files[a]}#rg{b}/row{c}" for a, b, c in zip(f, g, r, strict=True)]

    def row_group_table(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Parquet only: per row group (file index, row-group index, first id, row count).

        Worked out once per manifest (a pass over every row) and kept, pickled with it: the
        copies Ray tasks get of a manifest computed here do not work it out again."""
        kept = self.__dict__.get("_row_groups")
        if kept is not None:
            return kept
        f = self._cols["file"].astype(np.int64)
        g = self._cols["row_group"].astype(np.int64)
        key = f * (1 << 32) + g
        starts = np.flatnonzero(np.r_[True, key[1:] != key[:-1]])
        counts = np.diff(np.r_[starts, len(key)])
        table = (f[starts], g[starts], starts.astype(np.int64), counts.astype(np.int64))
        for a in table:
            a.flags.writeable = False
        self._row_groups = table
        return table

    def fingerprint(self) -> str:
        """A short hash of the dataset's identity (root, format, sizes), for cache keys."""
        h = hashlib.sha256()
        h.update(f"{self.root}|{self.format}|{len(self)}".encode())
        h.update(np.ascontiguousarray(self._cols["size"]).tobytes())
        if self.format == "images":
            h.update("\n".join(map(str, self._cols["path"])).encode())
        else:
            h.update("\n".join(self.files).encode())
        return h.hexdigest()[:16]

    def full_path(self, rel: str) -> str:
        """The filesystem path (within the resolved filesystem) of a relative location."""
        _, root = _storage.resolve(self.root, self.storage)
        return f"{root.rstrip('/')}/{rel}" if rel else root


def _extra_columns(columns: Any, format: str, uri: str) -> list[tuple[str, str]]:
    """``columns=`` as (Parquet name, batch key) pairs: distinct names and keys, no key one
    that every batch has."""
    from raying.dataset.columns import RESERVED

    if columns is None:
        return []
    if isinstance(columns, dict):
        pairs = list(columns.items())
        if not all(isinstance(a, str) and isinstance(b, str) and a and b for a, b in pairs):
            msg = (f"columns as a dict maps Parquet column names to batch keys, both "
                   f"non-empty strings, got {columns!r}")
            raise ConfigError(msg)
    elif isinstance(columns, (str, bytes)) or not all(isinstance(c, str) and c
                                                        for c in columns):
        msg = (f"columns must be a list of column names (or a dict of Parquet name -> batch "
               f"key), got {columns!r}")
        raise ConfigError(msg)
    else:
        pairs = [(c, c) for c in columns]
        if len({a for a, _ in pairs}) != len(pairs):
            msg = f"columns must be distinct names, got {list(columns)}"
            raise ConfigError(msg)
    keys = [b for _, b in pairs]
    if len(set(keys)) != len(keys):
        msg = f"columns gives two columns the same batch key: {columns!r}"
        raise ConfigError(msg)
    taken = [b for b in keys if b in RESERVED]
    if taken:
        renames = ", ".join(f"{a!r}: {'source_id' if b == 'id' else b + '_'!r}"
                            for a, b in pairs if b in RESERVED)
        msg = (f"columns={columns!r} names {taken}, which every batch already has "
               f"({', '.join(RESERVED)}); carry such a column under another key with a dict, "
               f"columns={{{renames}}} (the label column is label=, the image column "
               f"image_column=); the dataset's own image or label column is carried already: "
               f"leave it out")
        raise ConfigError(msg)
    return pairs


def _left_out(infos: list, uri: str, kept: int) -> None:
    """Say which files of an image folder the scan left out for their endings (``infos``: a
    README, a labels.csv; or images under an ending not asked for), so that none goes
    unnoticed."""
    other: dict[str, int] = {}
    for i in infos:
        other[_ext(i.path)] = other.get(_ext(i.path), 0) + 1
    if other and kept:
        seen = ", ".join(f"{e} ({n})" for e, n in sorted(other.items(), key=lambda x: -x[1])[:6])
        logger.warning("raying: scan of %s left out %d files whose endings are not among the "
                       "image endings scanned: %s; pass Manifest.scan(..., extensions=[...]) "
                       "to include them", uri, sum(other.values()), seen)


def _ext(path: str) -> str:
    dot = path.rfind(".")
    return path[dot:].lower() if dot > path.rfind("/") else "(none)"
