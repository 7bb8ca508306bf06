"""Listing and validating a dataset for Manifest.scan: image folders and Parquet sets."""

from __future__ import annotations

import concurrent.futures as cf
import math
import socket
import warnings
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from raying.errors import ConfigError, DataError
from raying.options import StorageOptions, settings
from raying.storage import errors as _storage_errors
from raying.storage import files as _storage

DECODED_SHAPE_COLUMNS = ("height", "width", "channels")
HIVE_NULL = "__HIVE_DEFAULT_PARTITION__"  # a hive partition folder's value for null


def list_dataset(fs: pafs.FileSystem, path: str, uri: str,
                 report: dict[str, list[str]] | None = None,
                 options: StorageOptions | None = None) -> list[pafs.FileInfo]:
    """Every file of the dataset (one listing call), or the single file the URI names;
    ``report`` (see ``list_files``) gets the folders listed."""
    info = _storage.file_info(fs, path, uri)
    if info.type == pafs.FileType.NotFound:
        down = _storage.unreachable(fs, uri)
        if down is not None:
            raise down
        raise _storage_errors.missing_error(fs, path, uri, options)
    if info.type == pafs.FileType.File:
        return [info]
    # Names starting with "_" are kept here (a class folder may be "_other"); Parquet scans
    # drop them (Spark's _temporary, _SUCCESS): see parquet_members.
    if isinstance(fs, pafs.LocalFileSystem):
        _storage.check_links(path, uri)
    files = _storage.list_files(fs, path, recursive=True, skip_prefixes=".", report=report)
    if not files:
        msg = f"{uri} is empty: no files to read; point raying at a folder of images or Parquet"
        raise DataError(msg)
    return files


def parquet_members(root: str, infos: list[pafs.FileInfo], endings: tuple[str, ...]
                    ) -> list[pafs.FileInfo]:
    """The Parquet files of a listing, without Spark/Hive bookkeeping (``_``-prefixed names)."""
    return [i for i in infos if i.path.lower().endswith(endings)
            and not any(part.startswith("_") for part in _relative(root, i.path).split("/"))]


def use_classes(m: Any, classes: list[str] | None) -> Any:
    """Relabel ``m`` by the given class names (see ``Manifest.scan(classes=...)``)."""
    if classes is None:
        return m
    if isinstance(classes, (str, bytes)):
        msg = f"classes must be a list of class names, got the string {classes!r}"
        raise ConfigError(msg)
    classes = [str(c) for c in classes]
    if len(set(classes)) != len(classes):
        msg = f"classes must be distinct names, got {classes}"
        raise ConfigError(msg)
    labels = m._cols["label"]
    if m.classes is None:  # integer labels (or none): they must index the list
        if len(labels) and labels.max() >= len(classes):
            msg = (f"{m.root}: label {int(labels.max())} has no name in classes= "
                   f"({len(classes)} names)")
            raise DataError(msg)
    else:
        unknown = sorted(set(m.classes) - set(classes))
        if unknown:
            msg = (f"{m.root} has classes {unknown} that are not in classes={classes}; add "
                   f"them, or scan without classes=")
            raise DataError(msg)
        index = np.array([classes.index(c) for c in m.classes], dtype=np.int64)
        known = labels >= 0
        m._cols["label"] = np.where(known, index[np.maximum(labels, 0)], labels)
    m.classes = classes
    return m


def _relative(root: str, path: str) -> str:
    root = root.rstrip("/")
    if path == root:
        return path.rsplit("/", 1)[-1]
    return path[len(root) + 1:] if path.startswith(root + "/") else path


def scan_images(cls, root: str, uri: str, infos: list[pafs.FileInfo], label: Any,
                opts: StorageOptions, dirs: list[str] | None = None):
    """Build an image-folder manifest: ids in sorted path order, labels from folders (a
    folder of ``dirs``, the listing's, with no image gets a warning: it has no label)."""
    top = root.rstrip("/") + "/"
    cut = len(top)
    rel = sorted((i.path[cut:] if i.path.startswith(top) else _relative(root, i.path),
                  -1 if i.size is None else i.size) for i in infos)
    paths = np.array([r for r, _ in rel], dtype=object)
    sizes = np.array([s for _, s in rel], dtype=np.int64)
    classes: list[str] | None = None
    if label is None:
        labels = np.full(len(paths), -1, dtype=np.int64)
    elif label == "folder":
        names = []
        for p in paths:
            cut = p.find("/")
            if cut < 0:
                msg = (f"label='folder' needs each image inside a class subfolder, but {uri} "
                       f"holds {p!r} at its top level; move images into class folders or pass "
                       f"label=None")
                raise DataError(msg)
            names.append(p[:cut])
        classes = sorted(set(names))
        empty = sorted(d for d in (dirs or ()) if "/" not in d and d not in set(classes))
        if empty:
            warnings.warn(f"{uri}: class folders {empty} hold no images, so they get no label "
                          f"and the labels of the folders after them shift; pass classes=[...] "
                          f"to Manifest.scan (raying scan --classes) to fix the label of every "
                          f"class name",
                          UserWarning, stacklevel=3)
        index = {c: k for k, c in enumerate(classes)}
        labels = np.fromiter((index[n] for n in names), dtype=np.int64, count=len(names))
    elif callable(label):
        raw = []
        for p in paths:
            try:
                raw.append(label(p))
            except Exception as exc:
                if hasattr(exc, "add_note"):  # Python 3.11 and later
                    exc.add_note(f"(raised by the label function given to Manifest.scan, "
                                 f"for {p!r} under {uri})")
                raise
        _check_label_values(raw, paths, uri)
        labels, classes = _labels_from_values(raw, f"label function on {uri}")
    else:
        msg = (f"an image folder's labels come from label='folder' (its class folders), a "
               f"function of the path, or label=None (unlabelled); got {label!r} (a column "
               f"name labels Parquet only)")
        raise ConfigError(msg)
    cols = {"path": paths, "label": labels, "size": sizes}
    return cls(root=uri, fmt="images", columns=cols, classes=classes, storage=opts)


def _check_label_values(raw: list[Any], paths: Any, uri: str) -> None:
    """A label function's values: class names (str) or class indices (int; a bool is 0 or
    1), one kind for every image; None, floats and the like are refused naming the first image that got one
    (a None turned into a class "None" would label those images silently)."""
    kinds = set()
    for v, p in zip(raw, paths, strict=True):
        if isinstance(v, str):
            kinds.add("str")
        elif isinstance(v, (int, np.integer, np.bool_)):  # a bool is the class 0 or 1
            if not 0 <= int(v) < 2**63:
                msg = (f"the label function returned {int(v)} for {p!r} under {uri}; a class "
                       f"index must be an int from 0 to 2**63 - 1")
                raise DataError(msg)
            kinds.add("int")
        else:
            msg = (f"the label function returned {v!r} ({type(v).__name__}) for {p!r} under "
                   f"{uri}; return a class name (str) or a class index (int >= 0) for every "
                   f"image: leave out images without a class before the scan (or scan with "
                   f"label=None)")
            raise DataError(msg)
    if len(kinds) > 1:
        first = {k: next(p for v, p in zip(raw, paths, strict=True)
                         if (k == "str") == isinstance(v, str)) for k in kinds}
        msg = (f"the label function returned class names (str, e.g. for {first['str']!r}) and "
               f"class indices (int, e.g. for {first['int']!r}) under {uri}; return one kind "
               f"for every image")
        raise DataError(msg)


def _labels_from_values(raw: list[Any], where: str) -> tuple[np.ndarray, list[str] | None]:
    if all(isinstance(v, (int, np.integer, np.bool_)) for v in raw):
        labels = np.asarray(raw, dtype=np.int64)
        if len(labels) and labels.min() < 0:
            msg = f"{where} gave a negative label ({labels.min()}); labels must be >= 0"
            raise DataError(msg)
        return labels, None
    names = [str(v) for v in raw]
    classes = sorted(set(names))
    index = {c: k for k, c in enumerate(classes)}
    return np.asarray([index[n] for n in names], dtype=np.int64), classes


def _read_footer(fs: pafs.FileSystem, path: str, uri_of: str) -> pq.FileMetaData:
    try:
        return pq.read_metadata(path, filesystem=fs)
    except (pa.ArrowInvalid, OSError) as exc:
        if isinstance(exc, OSError) and _storage.is_credentials_error(exc):
            raise _storage.storage_error(exc, uri_of) from None
        msg = (f"{uri_of} is not a readable Parquet file ({_short(exc)}); it may be truncated "
               f"or not Parquet: rewrite it or remove it from the dataset")
        raise DataError(msg) from None


def _read_columns(fs: pafs.FileSystem, path: str, columns: list[str]) -> pa.Table:
    """``columns`` of one Parquet file. Through ``ParquetFile``, not ``pq.read_table``: that
    goes through ``pyarrow.dataset``, whose first import (pandas with it) took ~0.3 s of a
    cold scan here. Raises what ``read_table`` raises: ``OSError``, or ``ArrowInvalid`` for a
    file that is not Parquet or lacks a column."""
    with fs.open_input_file(path) as fh:
        pf = pq.ParquetFile(fh, pre_buffer=True)  # one request per row group on S3, as read_table
        names = pf.schema_arrow.names
        missing = [c for c in columns if c not in names]
        if missing:
            msg = f"no column {missing[0]!r} (the file has {names})"
            raise pa.ArrowInvalid(msg)
        return pf.read(columns=columns)


def _numbers(arr: pa.ChunkedArray) -> np.ndarray:
    """The values of a numeric column without nulls, copied from its data buffers: Arrow's
    ``to_numpy`` imports pandas on its first call (~0.3 s of a cold scan here)."""
    dtype = np.dtype(arr.type.to_pandas_dtype())
    parts = [np.frombuffer(c.buffers()[1], dtype=dtype, count=len(c),
                           offset=c.offset * dtype.itemsize) for c in arr.chunks if len(c)]
    return np.concatenate(parts) if parts else np.zeros(0, dtype)


def _short(exc: BaseException) -> str:
    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return text[:200]


def scan_parquet(cls, fs: pafs.FileSystem, root: str, uri: str, infos: list[pafs.FileInfo],
                 label_col: str | None, image_col: str | None, opts: StorageOptions, *,
                 columns: list[tuple[str, str]] | None = None, classes_given: bool = False):
    """Build a Parquet manifest: one id per row, in (file, row group, row) order; the extra
    ``columns`` ((Parquet name, batch key) pairs) are checked in every file and described in
    ``meta["columns"]`` under their batch keys. ``classes_given``: the caller relabels by
    names of its own (``Manifest.scan(classes=...)``), so no hive class can go missing."""
    infos = sorted(infos, key=lambda i: i.path)
    rels = [_relative(root, i.path) for i in infos]
    uris = [f"{uri.rstrip('/')}/{r}" if len(infos) > 1 or infos[0].path != root else uri
            for r in rels]
    workers = 1 if isinstance(fs, pafs.LocalFileSystem) else settings().remote_read_threads
    with cf.ThreadPoolExecutor(max_workers=workers) as pool:
        footers = list(pool.map(lambda a: _read_footer(fs, a[0].path, a[1]),
                                zip(infos, uris, strict=True)))
    # Files of no rows add no sample, and their schema may say nothing of the data: pandas
    # writes an empty object column as type null (Dask and Spark jobs write empty parts).
    held = [k for k, fm in enumerate(footers) if fm.num_rows > 0]
    if not held:
        msg = f"{uri} holds Parquet files but no rows; the dataset is empty"
        raise DataError(msg)
    empty_rels = [rels[k] for k in range(len(footers)) if footers[k].num_rows == 0]
    if len(held) < len(footers):
        infos, rels, uris, footers = ([xs[k] for k in held] for xs in (infos, rels, uris,
                                                                       footers))
    schema0 = footers[0].schema.to_arrow_schema()
    image_col = pick_image_column(schema0, image_col, uris[0])
    for fm, u in zip(footers[1:], uris[1:], strict=True):
        _check_same_schema(schema0, fm.schema.to_arrow_schema(), u, uris[0], image_col, label_col)
    extra = _extra_columns(columns or [], footers, uris, image_col, label_col)
    hive = None
    if label_col is not None and label_col not in schema0.names:
        hive = _hive_values(rels, label_col)  # label=cat/part-0.parquet (pandas partition_cols)
        if hive is not None and HIVE_NULL in hive:  # where pandas and Spark put null labels
            where = uris[hive.index(HIVE_NULL)]
            msg = (f"{where}: its rows have a null label (their hive folder is "
                   f"{label_col}={HIVE_NULL}/); fill or drop those rows (raying never fills "
                   f"labels silently)")
            raise DataError(msg)
        if hive is None:
            msg = (f"{uris[0]} has no label column {label_col!r} (columns: {schema0.names}) "
                   f"and is not under a hive partition folder {label_col}=<value>/; pass "
                   f"label='<column or partition key>' or label=None for unlabelled data")
            raise DataError(msg)
    decoded = _decoded_shape(schema0, image_col, fs, infos, uris)
    if decoded is not None:
        _check_decoded_shapes(fs, infos, uris, decoded, workers)

    file_idx, rg_idx, row_idx, sizes = [], [], [], []
    biggest = (0, 0, 0)  # (image bytes, file, row group)
    for k, fm in enumerate(footers):
        leaves = _image_leaves(fm.schema, image_col)
        for g in range(fm.num_row_groups):
            n = fm.row_group(g).num_rows
            per_row = image_bytes_per_row(fm, g, leaves)
            file_idx.append(np.full(n, k, dtype=np.int32))
            rg_idx.append(np.full(n, g, dtype=np.int32))
            row_idx.append(np.arange(n, dtype=np.int32))
            sizes.append(np.full(n, per_row, dtype=np.int64))
            biggest = max(biggest, (n * per_row, k, g))
    if biggest[0] > LARGE_ROW_GROUP_BYTES:
        # pyarrow and pandas write a file as one row group of up to ~1 M rows.
        warnings.warn(f"{uris[biggest[1]]}: row group {biggest[2]} holds "
                      f"{biggest[0] / 2**30:.1f} GiB of images, and a read task reads a row "
                      f"group's image column whole (each read unit that takes some of its "
                      f"rows reads all of it, in memory): rewrite the data in smaller row "
                      f"groups (raying pack SRC DST, or pyarrow's row_group_size=...)",
                      stacklevel=3)
    if not file_idx or sum(len(a) for a in file_idx) == 0:
        msg = f"{uri} holds Parquet files but no rows; the dataset is empty"
        raise DataError(msg)
    cols: dict[str, np.ndarray] = {
        "file": np.concatenate(file_idx), "row_group": np.concatenate(rg_idx),
        "row": np.concatenate(row_idx), "size": np.concatenate(sizes)}
    # The names raying pack recorded are those of its own "label" column: not of another
    # column chosen as the label, nor of an unlabelled scan; a ClassLabel's are its column's.
    classes = _classes_from_metadata(schema0, label_col)
    if label_col is None:
        cols["label"] = np.full(len(cols["file"]), -1, dtype=np.int64)
    elif hive is not None:
        file_labels, found = _hive_labels(hive)
        cols["label"] = file_labels[cols["file"]]
        classes = found if found is not None else classes
        if found is not None and not classes_given:
            _warn_empty_partitions(uri, label_col, empty_rels, found)
    else:
        labels, found = _read_labels(fs, infos, uris, label_col, workers)
        cols["label"] = labels
        if found is None and classes is not None and len(labels) and (
                labels.max() >= len(classes)):
            warnings.warn(f"{uri}: the file's metadata names {len(classes)} classes, but label "
                          f"column {label_col!r} holds label {int(labels.max())}; the names "
                          f"are not used (pass classes=[...] to name the labels)", stacklevel=3)
            classes = None
        classes = found if found is not None else classes
    meta: dict[str, Any] = {"image_column": image_col, "label_column": label_col,
                            "decoded": decoded,
                            # Each file's bytes and modification time (whole seconds, -1
                            # unknown) as listed: a read finds a file rewritten since.
                            "file_sizes": [int(i.size) for i in infos],
                            "file_mtimes": [mtime_s(i) for i in infos]}
    if isinstance(fs, pafs.LocalFileSystem):  # each node may hold a copy, of its own times
        meta["scanned_on"] = socket.gethostname()
    if extra:
        meta["columns"] = extra
    return cls(root=uri, fmt="parquet", columns=cols, classes=classes, storage=opts,
               files=rels, meta=meta)


def _extra_columns(columns: list[tuple[str, str]], footers: list[pq.FileMetaData],
                   uris: list[str], image_col: str, label_col: str | None
                   ) -> dict[str, dict[str, Any]]:
    """The description of each extra column (see raying.dataset.columns) under its batch key,
    checked in every file: present, of a type raying carries, and of one description across
    files. A column carried under another key than its Parquet name says so (``source``)."""
    from raying.dataset.columns import describe

    out: dict[str, dict[str, Any]] = {}
    for name, key in columns:
        if name == image_col or (name == label_col and key == name):
            # The label column under a key of its own is carried as it is stored (a class
            # name, say) beside ``label``, the class index.
            what = "image" if name == image_col else "label"
            msg = (f"columns= names {name!r}, the {what} column, which every batch already "
                   f"carries (as {what!r}); leave it out of columns= (raying pack: --columns)"
                   + ("" if what == "image" else f", or carry it as stored under another key: "
                      f"columns={{{name!r}: '{name}_raw'}}"))
            raise ConfigError(msg)
        first: dict[str, Any] | None = None
        for fm, u in zip(footers, uris, strict=True):
            schema = fm.schema.to_arrow_schema()
            if name not in schema.names:
                msg = (f"{u} has no column {name!r} asked for by columns= (columns: "
                       f"{schema.names}); every file of the dataset must have it, or drop it "
                       f"from columns=")
                raise DataError(msg)
            t = schema.field(name).type
            desc = describe(t)
            if desc is None:
                msg = (f"{u}: column {name!r} has type {t}, which raying cannot carry into "
                       f"batches; expected numbers, strings, bytes, or (fixed-size) lists of "
                       f"numbers: convert it, or leave it out of columns= (raying pack: --columns)")
                raise DataError(msg)
            nulls = _footer_nulls(fm, name) if desc["kind"] in _FLAT_KINDS else 0
            if nulls:
                msg = (f"{u}: extra column {name!r} has {nulls} null values; raying carries no "
                       f"nulls in extra columns: fill them (e.g. '' or -1, or NaN for floats) "
                       f"in the data, or leave {name!r} out of columns= (raying pack: --columns)")
                raise DataError(msg)
            if first is None:
                first = desc
            elif desc != first:
                msg = (f"schema mismatch in column {name!r}: {u} has {t} where {uris[0]} has "
                       f"{footers[0].schema.to_arrow_schema().field(name).type}; rewrite the "
                       f"files with one schema")
                raise DataError(msg)
        desc = dict(first or {})
        if key != name:
            desc["source"] = name
        out[key] = desc
    return out


# Kinds of extra column whose nulls a Parquet footer counts exactly. A list column's count
# is its leaf's, where writers count an empty list as a null too: those are found at read.
_FLAT_KINDS = ("number", "string", "bytes")


def _footer_nulls(fm: pq.FileMetaData, name: str) -> int:
    """Nulls of the flat column ``name`` that the footer's statistics count (0 where a row
    group has no statistics: the read still finds them)."""
    total = 0
    for g in range(fm.num_row_groups):
        rg = fm.row_group(g)
        for j in range(rg.num_columns):
            col = rg.column(j)
            if col.path_in_schema == name:
                st = col.statistics
                if st is not None and st.has_null_count:
                    total += int(st.null_count)
    return total


def _warn_empty_partitions(uri: str, key: str, empty_rels: list[str],
                           found: list[str]) -> None:
    """Warn of hive partitions whose files hold no rows: named classes are numbered in sorted
    order, so such a class gets no label and the classes after it shift (as an image folder's
    empty class folder does); integer partition values are labels themselves and shift
    nothing."""
    values: set[str] = set()
    for rel in empty_rels:
        values.update(_hive_values([rel], key) or ())  # a file outside any partition: none
    empty = sorted(values - set(found))
    if empty:
        folders = [f"{key}={v}/" for v in empty]
        warnings.warn(f"{uri}: hive partitions {folders} hold no rows, so their classes get no "
                      f"label and the labels of the classes after them shift; pass "
                      f"classes=[...] to Manifest.scan (raying scan --classes) to fix the label "
                      f"of every class name", UserWarning, stacklevel=4)


def _hive_values(rels: list[str], key: str) -> list[str] | None:
    """The value of the hive partition folder ``key=value`` of each file, or None if a file
    is not under one."""
    from urllib.parse import unquote

    out = []
    for rel in rels:
        parts = [p for p in rel.split("/")[:-1] if p.startswith(f"{key}=")]
        if not parts:
            return None
        out.append(unquote(parts[-1][len(key) + 1:]))
    return out


def _hive_labels(values: list[str]) -> tuple[np.ndarray, list[str] | None]:
    """Per-file labels from partition values: integers as class ids, else sorted names.

    Raises:
        DataError: a negative id (-1 is the manifest's "no label"), or two spellings of one
            id (``label=1/`` beside ``label=01/``), which would merge two folders' classes.
    """
    if all(v.lstrip("-").isdigit() for v in values):
        ids = [int(v) for v in values]
        if min(ids) < 0:
            bad = next(v for v in values if int(v) < 0)
            msg = (f"hive partition value {bad!r} is a negative label; labels must be class "
                   f"ids >= 0 (rename the folder)")
            raise DataError(msg)
        spelled: dict[int, str] = {}
        for v, k in zip(values, ids, strict=True):
            if spelled.setdefault(k, v) != v:
                msg = (f"hive partition values {spelled[k]!r} and {v!r} are the same class id "
                       f"{k}: rename one folder so that each class has one spelling")
                raise DataError(msg)
        return np.asarray(ids, dtype=np.int64), None
    classes = sorted(set(values))
    index = {c: i for i, c in enumerate(classes)}
    return np.asarray([index[v] for v in values], dtype=np.int64), classes


# A row group whose image bytes exceed this gets a warning at the scan (read whole per unit).
LARGE_ROW_GROUP_BYTES = 1 << 30


def image_type_ok(t: pa.DataType) -> bool:
    """Encoded bytes (binary, large_binary), pre-decoded pixels (fixed_size_binary), or a
    struct with a binary ``bytes`` field (the Hugging Face ``Image`` feature's layout)."""
    if pa.types.is_struct(t):
        k = t.get_field_index("bytes")
        return k >= 0 and (pa.types.is_binary(t.field(k).type)
                           or pa.types.is_large_binary(t.field(k).type))
    return (pa.types.is_binary(t) or pa.types.is_large_binary(t)
            or pa.types.is_fixed_size_binary(t))


def pick_image_column(schema: pa.Schema, wanted: str | None, where: str) -> str:
    """The image column of a Parquet file's ``schema``: ``wanted``, else ``image``, else its
    one binary column; a ``DataError`` naming ``where`` otherwise."""
    if b"raying.dataset.manifest" in (schema.metadata or {}):
        msg = (f"{where} is a manifest (Manifest.save, raying scan --save), not a dataset: "
               f"load it with raying.Manifest.load(...), or scan the dataset it lists")
        raise DataError(msg)
    if wanted is not None:
        if wanted not in schema.names:
            msg = f"{where} has no image column {wanted!r} (columns: {schema.names})"
            raise DataError(msg)
        name = wanted
    elif "image" in schema.names:
        name = "image"
    else:
        binary = [f.name for f in schema if image_type_ok(f.type)]
        if len(binary) != 1:
            msg = (f"{where}: cannot tell which column holds the images (binary columns: "
                   f"{binary}); pass image_column='<name>'")
            raise DataError(msg)
        name = binary[0]
    t = schema.field(name).type
    if not image_type_ok(t):
        hint = ("; it holds text (file paths?): scan the image folder itself instead"
                if pa.types.is_string(t) or pa.types.is_large_string(t) else "")
        msg = (f"{where}: image column {name!r} has type {t}; raying reads encoded image bytes "
               f"(binary, large_binary), pre-decoded pixels (fixed_size_binary) or a struct "
               f"with a binary 'bytes' field{hint}; pass image_column='<name>' for another "
               f"column")
        raise DataError(msg)
    return name


def _check_same_schema(a: pa.Schema, b: pa.Schema, uri_b: str, uri_a: str, image_col: str,
                       label_col: str | None) -> None:
    # height/width/channels give pre-decoded pixels their shape; beside encoded images they
    # are the user's own metadata (extra columns are checked by their own rules).
    decoded = image_col in a.names and pa.types.is_fixed_size_binary(a.field(image_col).type)
    for col in [image_col, label_col, *(DECODED_SHAPE_COLUMNS if decoded else ())]:
        if col is None or (col not in a.names and col not in b.names):
            continue
        if col not in b.names:
            msg = (f"schema mismatch: {uri_b} has no column {col!r}, which {uri_a} has; all "
                   f"files of a dataset must share the image and label columns")
            raise DataError(msg)
        if col not in a.names:
            msg = f"schema mismatch: {uri_b} has a column {col!r} that {uri_a} lacks"
            raise DataError(msg)
        ta, tb = a.field(col).type, b.field(col).type
        if col == image_col and _encoded_kind(ta) is not None:
            same = _encoded_kind(ta) == _encoded_kind(tb)  # binary and large_binary read alike
        elif col == label_col:  # read per file: only the kind of label must agree
            same = _label_kind(ta) == _label_kind(tb)
        else:
            same = ta == tb or (_is_int(ta) and _is_int(tb))
        if not same:
            msg = (f"schema mismatch in column {col!r}: {uri_b} has {tb} where {uri_a} has "
                   f"{ta}; rewrite the files with one schema")
            raise DataError(msg)


def _label_kind(t: pa.DataType) -> str:
    """What a label column holds, as the labels are read (per file): class names (string,
    large_string, dictionary-encoded: writers differ), or integers, or floats, or another
    type (its own name)."""
    if pa.types.is_dictionary(t) or pa.types.is_string(t) or pa.types.is_large_string(t):
        return "names"
    if pa.types.is_integer(t):
        return "int"
    if pa.types.is_floating(t):
        return "float"
    return str(t)


def _encoded_kind(t: pa.DataType) -> str | None:
    """'bytes' for encoded image bytes (binary, large_binary), 'struct' for a struct with
    such a ``bytes`` field, None for anything else."""
    if pa.types.is_binary(t) or pa.types.is_large_binary(t):
        return "bytes"
    if pa.types.is_struct(t) and image_type_ok(t):
        return "struct"
    return None


def mtime_s(info: pafs.FileInfo) -> int:
    """A listed file's modification time in whole seconds (-1 when the storage gives none):
    listings and single lookups of one object agree to the second on every storage (S3's
    listing gives milliseconds, its HEAD seconds)."""
    mtime = info.mtime
    return -1 if mtime is None else int(mtime.timestamp() // 1)


def changed_since_scan(info: pafs.FileInfo, f: int, sizes: Any, mtimes: Any,
                       scanned_on: str | None) -> str | None:
    """How file ``f`` of a Parquet manifest, looked up now (``info``, a file), differs from
    the scan's listing (``sizes``, ``mtimes``: ``meta["file_sizes"]``, ``["file_mtimes"]``),
    or None. A local file's time counts only on the machine that scanned it
    (``scanned_on``): a copy of the dataset on each node has times of its own."""
    size, want_size = int(info.size), int(sizes[f])
    stamp = mtime_s(info)
    want_stamp = int(mtimes[f]) if f < len(mtimes) else -1
    if scanned_on and scanned_on != socket.gethostname():
        want_stamp = -1
    if size != want_size:
        return f"{size} bytes, the scan found {want_size}"
    if stamp >= 0 and want_stamp >= 0 and stamp != want_stamp:
        return (f"modified at {stamp}, the scan found {want_stamp} (seconds since 1970), with "
                f"as many bytes: rewritten, or touched or copied over")
    return None


def image_bytes_per_row(fm: pq.FileMetaData, group: int, leaves: list[int]) -> int:
    """The image column's stored (uncompressed) bytes per row in row group ``group``: each
    row's ``size`` in a Parquet manifest, and with the group's rows what a read checks to
    know the file is still the one scanned."""
    rg = fm.row_group(group)
    return sum(rg.column(i).total_uncompressed_size for i in leaves) // max(rg.num_rows, 1)


def image_leaves(fm: pq.FileMetaData, image_col: str) -> list[int]:
    """:func:`_image_leaves` of a file's metadata, from its first row group's column paths.

    Not from ``fm.schema``: pyarrow's ``FileMetaData`` and its ``ParquetSchema`` refer to
    each other, so a footer whose schema was touched lives until the cyclic garbage collector
    runs. Read tasks parse a footer per unit; with footers of megabytes (thousands of row
    groups) each read worker held ~1 GB of them.
    """
    if not fm.num_row_groups:
        return _image_leaves(fm.schema, image_col)
    group = fm.row_group(0)
    return _leaves_of([group.column(i).path_in_schema for i in range(group.num_columns)],
                      image_col)


def _image_leaves(schema: pq.ParquetSchema, image_col: str) -> list[int]:
    """The Parquet leaf columns of this file's image column (its position among a file's
    leaves depends on the columns before it, nested ones included): the column itself, or a
    struct's ``bytes`` field."""
    return _leaves_of([schema.column(i).path for i in range(len(schema))], image_col)


def _leaves_of(paths: list[str], image_col: str) -> list[int]:
    for want in (image_col, f"{image_col}.bytes"):
        if want in paths:
            return [paths.index(want)]
    return [i for i, p in enumerate(paths) if p.startswith(f"{image_col}.")]


def _is_int(t: pa.DataType) -> bool:
    return pa.types.is_integer(t)


def _decoded_shape(schema: pa.Schema, image_col: str, fs, infos, uris) -> list[int] | None:
    """(h, w, c) when the image column holds pre-decoded uint8 pixels, else None: the shape
    of the first row that gives one (a file or row group may be empty, a row's shape null)."""
    field = schema.field(image_col)
    if not pa.types.is_fixed_size_binary(field.type):
        return None
    if not all(c in schema.names for c in DECODED_SHAPE_COLUMNS):
        msg = (f"{uris[0]}: column {image_col!r} is fixed_size_binary (pre-decoded pixels) but "
               f"the columns {DECODED_SHAPE_COLUMNS} that give its shape are missing")
        raise DataError(msg)
    shape = None
    for info, where in zip(infos, uris, strict=True):
        try:
            t = _read_columns(fs, info.path, list(DECODED_SHAPE_COLUMNS))
        except (pa.ArrowInvalid, OSError) as exc:
            msg = f"{where}: cannot read columns {DECODED_SHAPE_COLUMNS} ({_short(exc)})"
            raise DataError(msg) from None
        given = np.ones(t.num_rows, dtype=bool)
        for c in DECODED_SHAPE_COLUMNS:
            given &= np.asarray(t.column(c).is_valid().to_numpy(zero_copy_only=False), bool)
        if given.any():
            row = int(np.flatnonzero(given)[0])
            shape = [int(t.column(c)[row].as_py()) for c in DECODED_SHAPE_COLUMNS]
            break
    if shape is None:
        msg = (f"{uris[0]}: no row gives the shape of the pre-decoded pixels in {image_col!r} "
               f"(columns {DECODED_SHAPE_COLUMNS} empty or null); re-pack with raying pack "
               f"--decode-size")
        raise DataError(msg)
    if math.prod(shape) != field.type.byte_width:
        msg = (f"{where}: height*width*channels = {shape} does not match the "
               f"{field.type.byte_width} bytes of column {image_col!r}")
        raise DataError(msg)
    return shape


def _check_decoded_shapes(fs, infos, uris, shape: list[int], workers: int) -> None:
    """Every row of pre-decoded pixels must have the shape of the first (one reshape for all)."""
    def one(k: int) -> None:
        try:
            t = _read_columns(fs, infos[k].path, list(DECODED_SHAPE_COLUMNS))
        except (pa.ArrowInvalid, OSError) as exc:
            msg = f"{uris[k]}: cannot read columns {DECODED_SHAPE_COLUMNS} ({_short(exc)})"
            raise DataError(msg) from None
        for c, want in zip(DECODED_SHAPE_COLUMNS, shape, strict=True):
            col = t.column(c)
            got = (_numbers(col) if pa.types.is_integer(col.type) and not col.null_count
                   else col.to_numpy(zero_copy_only=False))
            bad = np.flatnonzero(got != want)
            if len(bad):
                row = int(bad[0])
                value = col[row].as_py()
                said = f"a null {c}" if value is None else f"{c} {value}"
                msg = (f"{uris[k]}: row {row} has {said}, not {want} as the other rows: "
                       f"pre-decoded pixels must share one shape (h, w, c) = "
                       f"{tuple(shape)}; re-pack with raying pack --decode-size")
                raise DataError(msg)

    with cf.ThreadPoolExecutor(max_workers=workers) as pool:
        list(pool.map(one, range(len(infos))))


def _classes_from_metadata(schema: pa.Schema, label_col: str | None) -> list[str] | None:
    """The class names the writer recorded for integer labels: raying pack's for its
    ``label`` column, or a Hugging Face ``ClassLabel``'s names for ``label_col`` (the
    ``huggingface`` schema metadata that ``datasets`` writes)."""
    import json

    meta = schema.metadata or {}
    raw = meta.get(b"raying.classes")
    if raw and label_col == "label":
        return json.loads(raw)
    raw = meta.get(b"huggingface")
    if not raw or label_col is None:
        return None
    try:
        feature = json.loads(raw)["info"]["features"][label_col]
    except (ValueError, KeyError, TypeError):
        return None
    names = feature.get("names") if isinstance(feature, dict) else None
    if (not isinstance(feature, dict) or feature.get("_type") != "ClassLabel"
            or not isinstance(names, list) or not names):
        return None
    return [str(n) for n in names]


def _read_labels(fs, infos, uris, col: str, workers: int) -> tuple[np.ndarray, list[str] | None]:
    def one(k: int) -> pa.ChunkedArray:
        try:
            return _read_columns(fs, infos[k].path, [col]).column(col)
        except (pa.ArrowInvalid, OSError) as exc:
            msg = f"{uris[k]}: cannot read label column {col!r} ({_short(exc)})"
            raise DataError(msg) from None

    with cf.ThreadPoolExecutor(max_workers=workers) as pool:
        parts = list(pool.map(one, range(len(infos))))
    ptype = parts[0].type
    if pa.types.is_string(ptype) or pa.types.is_large_string(ptype) or pa.types.is_dictionary(ptype):
        for k, arr in enumerate(parts):
            if arr.null_count:
                msg = (f"{uris[k]}: label column {col!r} has {arr.null_count} null values; "
                       f"fill or drop those rows (raying never fills labels silently)")
                raise DataError(msg)
        names = [str(v) for arr in parts for v in arr.to_pylist()]
        classes = sorted(set(names))
        index = {c: i for i, c in enumerate(classes)}
        return np.asarray([index[n] for n in names], dtype=np.int64), classes
    out = []
    for k, arr in enumerate(parts):
        if not (pa.types.is_integer(arr.type) or pa.types.is_floating(arr.type)):
            msg = (f"{uris[k]}: label column {col!r} has type {arr.type}; expected integers or "
                   f"strings")
            raise DataError(msg)
        if arr.null_count:
            msg = (f"{uris[k]}: label column {col!r} has {arr.null_count} null values; fill or "
                   f"drop those rows (raying never fills labels silently)")
            raise DataError(msg)
        values = _numbers(arr)
        if pa.types.is_floating(arr.type):
            bad = ~np.isfinite(values)
            if bad.any():
                msg = (f"{uris[k]}: label column {col!r} has {int(bad.sum())} NaN or infinite "
                       f"values (first at row {int(np.flatnonzero(bad)[0])}); fix the labels")
                raise DataError(msg)
            if (values != np.round(values)).any():
                from raying.dataset.columns import RESERVED

                how = (f"scan with label=None, columns={{{col!r}: 'target'}} ({col!r} is a "
                       f"key raying keeps for its own column)" if col in RESERVED else
                       f"scan with label=None, columns=[{col!r}]")
                msg = (f"{uris[k]}: label column {col!r} holds non-integer values; expected "
                       f"class ids. For other targets (regression values, soft labels) {how}: "
                       f"the column then reaches every batch as it is")
                raise DataError(msg)
        over = (values > np.uint64(2**63 - 1) if values.dtype.kind == "u" else
                values.astype(np.float64) >= 2.0**63 if values.dtype.kind == "f" else None)
        if over is not None and over.any():
            first = int(np.flatnonzero(over)[0])
            msg = (f"{uris[k]}: label column {col!r} has labels above 2**63 - 1 (e.g. "
                   f"{values[first]} at row {first}); labels must be class ids >= 0 that fit "
                   f"int64")
            raise DataError(msg)
        values = values.astype(np.int64)
        if len(values) and (values == -1).all():
            msg = (f"{uris[k]}: label column {col!r} holds -1 in every row (packed without "
                   f"labels): scan it with label=None")
            raise DataError(msg)
        if len(values) and values.min() < 0:
            first = int(np.flatnonzero(values < 0)[0])
            msg = (f"{uris[k]}: label column {col!r} has negative labels (e.g. {values[first]} "
                   f"at row {first}); labels must be class ids >= 0")
            raise DataError(msg)
        out.append(values)
    return np.concatenate(out), None
