"""The packed format: Parquet shards of encoded or pre-decoded images, one shard written per call."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from raying.dataset.manifest import Manifest
from raying.errors import DataError
from raying.options import (
    StorageOptions,
)
from raying.storage import files as _storage

SHARD_NAME = "part-{:05d}.parquet"
# Left in the destination by a pack that stopped part-way: its shard tasks still to write
# write nothing (scans skip "_" names; the next pack into the folder removes it).
STOP_MARKER = "_raying_pack_stopped"
# A shard is written under this name (scans skip "_" names) and takes its own once every
# shard of the pack is written: a pack killed part-way (SIGKILL, a lost SSH session, the OOM
# killer) leaves nothing a scan reads as a whole, smaller dataset.
PENDING_NAME = "_{}.pending"
# Columns a packed shard has beside the image and label (the last three when pre-decoded).
PACK_COLUMNS = ("id", "path", "height", "width", "channels")


@dataclasses.dataclass
class PackResult:
    """What `pack` wrote: shards, rows, and the samples it set aside (with reasons)."""

    dst: str
    shards: list[str]
    rows: int
    bytes_written: int
    skipped: list[dict[str, Any]]
    seconds: float

    def summary(self) -> dict[str, Any]:
        return {"dst": self.dst, "shards": len(self.shards), "rows": self.rows,
                "bytes_written": self.bytes_written, "skipped": len(self.skipped),
                "seconds": round(self.seconds, 3)}


def _schema(decoded: tuple[int, int, int] | None, classes: list[str] | None,
            source: str, extra: dict[str, pa.DataType] | None = None) -> pa.Schema:
    image_type = pa.binary(int(np.prod(decoded))) if decoded else pa.binary()
    fields = [pa.field("id", pa.int64()), pa.field("label", pa.int64()),
              pa.field("image", image_type), pa.field("path", pa.string())]
    if decoded:
        fields += [pa.field("height", pa.int32()), pa.field("width", pa.int32()),
                   pa.field("channels", pa.int32())]
    fields += [pa.field(name, t) for name, t in (extra or {}).items()]
    meta = {b"raying.source": source.encode()}
    if classes is not None:
        meta[b"raying.classes"] = json.dumps(classes).encode()
    return pa.schema(fields, metadata=meta)


def pack_shard(src: Manifest, ids: np.ndarray, dst_uri: str, dst_storage: StorageOptions,
               shard_name: str, *, decode_size: int | None, row_group_rows: int,
               on_error: str, verify: bool) -> dict[str, Any]:
    """Pack the images ``ids`` of ``src`` into one Parquet file (runs as a Ray task); nothing
    when the pack stopped meanwhile (:data:`STOP_MARKER`)."""
    from raying.errors import DecodeError
    from raying.image.decode import image_size
    from raying.image.transform import ImageTransform

    out_fs, out_root = _storage.resolve(dst_uri, dst_storage)
    stopped = f"{out_root.rstrip('/')}/{STOP_MARKER}"
    nothing = {"shard": shard_name, "rows": 0, "bytes": 0, "skipped": [], "stopped": True}
    if _storage.exists(out_fs, stopped):
        return nothing
    fs, root = _storage.resolve(src.root, src.storage)
    extra: dict[str, pa.ChunkedArray] = {}
    if src.format == "parquet":
        datas, paths, extra = parquet_values(src, fs, root, ids)
    else:
        paths = [str(p) for p in src.column("path")[ids]]
        datas = _storage.read_many(fs, [f"{root.rstrip('/')}/{p}" for p in paths])
    # A storage that is down or refuses access is no property of these samples (Parquet rows
    # share their file's read error): stop, as the read tasks do, instead of packing the
    # shard without them. Nor is a local dataset this node does not hold (a shard task on
    # another node of a cluster).
    if any(isinstance(d, _storage.NotFoundError) for d in datas):
        _storage.check_local_root(
            src.root, scanned_on=str(src.meta.get("scanned_on") or ""),
            fix="pack on a machine (or a one-node Ray) that holds it: RAY_ADDRESS unset "
                "packs with a local Ray")
    _storage.refuse_outage(datas, again="run pack again")
    skipped: list[dict[str, Any]] = []
    keep = np.ones(len(ids), dtype=bool)
    for k, d in enumerate(datas):
        reason = detail = None
        if isinstance(d, BaseException):
            reason, detail = "read_error", str(d).splitlines()[0][:200] if str(d) else ""
        elif isinstance(d, RowProblem):
            reason, detail = d.reason, d.detail
        elif not decode_size:
            try:
                if verify:
                    from raying.image.decode import decode_image

                    decode_image(d)
                else:
                    image_size(d)
            except DecodeError as exc:
                reason, detail = exc.reason, exc.detail
        if reason is not None:
            keep[k] = False
            skipped.append({"id": int(ids[k]), "path": paths[k], "reason": reason,
                            "detail": detail})
    decoded_shape = (decode_size, decode_size, 3) if decode_size else None
    if decode_size:
        tf = ImageTransform(size=decode_size, random_crop=False, flip=False)
        good = [d if keep[k] else None for k, d in enumerate(datas)]
        res = tf.apply_encoded(good, ids, seed=0, epoch=0)
        bad = np.flatnonzero(keep & ~np.asarray(res.ok))
        for pos, err in zip(np.flatnonzero(~np.asarray(res.ok)), res.errors, strict=True):
            if keep[pos]:
                skipped.append({"id": int(ids[pos]), "path": paths[pos], "reason": err.reason,
                                "detail": err.detail})
        keep[bad] = False
        # (rows, bytes per image); a shard whose every image was bad has no rows
        flat = res.images.reshape(len(res.images), decode_size * decode_size * 3)
        image_col = pa.FixedSizeBinaryArray.from_buffers(
            pa.binary(flat.shape[1]), len(flat), [None, pa.py_buffer(flat)])
    else:
        image_col = pa.array([bytes(d) for k, d in enumerate(datas)  # type: ignore[arg-type]
                              if keep[k]], pa.binary())
    if on_error == "raise" and skipped:
        s = skipped[0]
        msg = f"{src.root.rstrip('/')}/{s['path']}: {s['reason']} {s['detail']}".rstrip()
        raise DataError(msg + "; fix or remove the file, or pack with on_error='skip'")
    kept = ids[keep]
    cols: dict[str, Any] = {"id": pa.array(kept, pa.int64()),
                            "label": pa.array(src.labels[kept], pa.int64()),
                            "image": image_col,
                            "path": pa.array([p for k, p in enumerate(paths) if keep[k]],
                                             pa.string())}
    if decoded_shape:
        for name, v in zip(("height", "width", "channels"), decoded_shape, strict=True):
            cols[name] = pa.array(np.full(len(kept), v, dtype=np.int32))
    kept_pos = pa.array(np.flatnonzero(keep), pa.int64())
    for name, values in extra.items():
        cols[name] = values.take(kept_pos)
    schema = _schema(decoded_shape, src.classes, src.root,
                     {name: values.type for name, values in extra.items()})
    table = pa.table(cols, schema=schema)
    sink = pa.BufferOutputStream()
    # Statistics for the extra columns too: a later scan counts their nulls from them.
    pq.write_table(table, sink, row_group_size=row_group_rows, compression="none",
                   use_dictionary=["label"], write_statistics=["id", "label", *extra])
    data = sink.getvalue()
    if _storage.exists(out_fs, stopped):
        return nothing
    _storage.write_bytes_atomic(out_fs, f"{out_root.rstrip('/')}/{shard_name}", data.to_pybytes())
    return {"shard": shard_name, "rows": len(kept), "bytes": data.size, "skipped": skipped}


@dataclasses.dataclass(frozen=True)
class RowProblem:
    """Why a source row cannot be packed (set aside and listed under ``reason``)."""

    reason: str
    detail: str


def parquet_values(src: Manifest, fs: Any, root: str, ids: np.ndarray
                   ) -> tuple[list[Any], list[str], dict[str, pa.ChunkedArray]]:
    """The rows ``ids`` of a Parquet manifest: each one's encoded image (bytes), or the
    exception its file raised, or a :class:`RowProblem` (a null image, a row the file no
    longer has); its location (``file#rgG/rowR``); and the manifest's extra
    columns in ``ids`` order, each of the one Arrow type raying carries it as
    (``columns.arrow_type``). Each file's row groups are read once, the image column and the
    extra columns only.

    Raises:
        DataError: an extra column holds nulls (which the scan finds only where the footers
            count them) or integers raying cannot carry (uint64 above int64's range), naming
            the file and the column, as the scan and the read paths do.
    """
    from raying.dataset.columns import _check_range, arrow_type
    from raying.dataset.scan import image_bytes_per_row, image_leaves

    image_col = src.meta.get("image_column") or "image"
    descs: dict[str, dict[str, Any]] = dict(src.meta.get("columns") or {})
    f = src.column("file")[ids].astype(np.int64)
    g = src.column("row_group")[ids].astype(np.int64)
    r = src.column("row")[ids].astype(np.int64)
    datas: list[Any] = [None] * len(ids)
    file_sizes = [int(x) for x in src.meta.get("file_sizes") or ()]
    file_mtimes = [int(x) for x in src.meta.get("file_mtimes") or ()]
    # What the scan found in the shard's row groups: rows, and image bytes per row.
    rg_f, rg_g, rg_start, rg_rows = src.row_group_table()
    touched = np.unique(np.searchsorted(rg_start, np.asarray(ids, np.int64), side="right") - 1)
    scanned = {(int(rg_f[k]), int(rg_g[k])): (int(rg_rows[k]), int(src.column("size")[
        rg_start[k]])) for k in touched.tolist()}
    # Each extra column's Parquet name, by the batch key it is carried (and written) under.
    sources = {key: desc.get("source", key) for key, desc in descs.items()}
    parts: dict[str, list[tuple[np.ndarray, pa.Array]]] = {name: [] for name in descs}
    failed: list[np.ndarray] = []
    for fi in np.unique(f):
        sel = np.flatnonzero(f == fi)
        groups = sorted({int(x) for x in g[sel]})
        rel = src.files[int(fi)]
        path = f"{root.rstrip('/')}/{rel}"
        try:
            changed = _changed_since_scan(fs, path, int(fi), file_sizes, file_mtimes,
                                          src.meta.get("scanned_on"))
            if changed:
                for k in sel:  # other rows under these ids: none of the file's is packed
                    datas[k] = RowProblem("read_error", f"{rel} was rewritten since the scan "
                                          f"({changed}); scan the source again")
                failed.append(sel)
                continue
            with _storage.open_input(fs, path) as fh:
                pf = pq.ParquetFile(fh)
                table = pf.read_row_groups(groups, columns=[image_col, *sources.values()])
                sizes = [pf.metadata.row_group(k).num_rows for k in groups]
                leaves = image_leaves(pf.metadata, image_col)
                now = {k: (n, image_bytes_per_row(pf.metadata, k, leaves))
                       for k, n in zip(groups, sizes, strict=True)}
        except (OSError, pa.ArrowException) as exc:
            err = exc if isinstance(exc, OSError) else OSError(str(exc))
            for k in sel:
                datas[k] = err
            failed.append(sel)
            continue
        # read_row_groups returns the groups in the order asked: each one's first row.
        first = dict(zip(groups, np.cumsum([0, *sizes[:-1]]).tolist(), strict=True))
        size = dict(zip(groups, sizes, strict=True))
        # A row group other than the scan's (rows, or image bytes) holds other rows under
        # these ids: none of its rows is packed.
        # (Without the files' sizes, an older manifest: its bytes may be measured otherwise.)
        same = {k: (now[k] if file_sizes else now[k][0]) == (
            scanned.get((int(fi), k), now[k]) if file_sizes else
            scanned.get((int(fi), k), now[k])[0]) for k in groups}
        there = np.array([same[int(grp)] and int(row) < size[int(grp)]
                          for grp, row in zip(g[sel], r[sel], strict=True)], dtype=bool)
        gone, sel = sel[~there], sel[there]
        for k in gone:  # the file was rewritten since the scan
            grp = int(g[k])
            (n0, b0), (n1, b1) = scanned[(int(fi), grp)], now[grp]
            datas[k] = RowProblem("read_error", f"{rel} was rewritten since the scan (row "
                                  f"group {grp} has {n1} rows of {b1} image bytes each, the "
                                  f"scan found {n0} of {b0}); scan the source again")
        if len(gone):
            failed.append(gone)
        starts = np.array([first[int(x)] for x in g[sel]], dtype=np.int64)
        rows = pa.array(starts + r[sel], pa.int64())
        images = table.column(image_col).take(rows).combine_chunks()
        paths: list[Any] = [None] * len(sel)
        if pa.types.is_struct(images.type):  # {bytes, path}: Hugging Face Image
            if images.type.get_field_index("path") >= 0:
                paths = images.field(images.type.get_field_index("path")).to_pylist()
            images = images.field(images.type.get_field_index("bytes"))
        for k, value, ref in zip(sel, images.to_pylist(), paths, strict=True):
            datas[k] = value if value is not None else RowProblem(
                "null_image", f"the image column holds no bytes in this row (it names the "
                f"file {ref!r}, which pack does not fetch)" if ref else
                "the image column is null in this row")
        for name in descs:
            col = table.column(sources[name]).take(rows)
            flat = col.combine_chunks()
            if descs[name]["kind"] in ("list", "array"):
                flat = flat.flatten()
            _check_range(flat, descs[name].get("dtype", ""), name=sources[name],
                         where=src.root.rstrip("/") + "/" + rel)
            col = col.cast(arrow_type(descs[name])).combine_chunks()
            nulls = sel[_null_rows(col)]
            if len(nulls):  # as the scan and the read paths refuse them: the column's fault
                where = src.path_of(ids[nulls[:1]])[0]
                msg = (f"{src.root.rstrip('/')}/{where}: extra column {sources[name]!r} has "
                       f"null values ({len(nulls)} in this shard's rows, or inside their "
                       f"lists); raying carries no nulls in extra columns: fill them (e.g. '' "
                       f"or -1, or NaN for floats) in the data, or leave {sources[name]!r} out "
                       f"of columns= (raying pack: --columns)")
                raise DataError(msg)
            parts[name].append((sel, col))
    for name, desc in descs.items():
        for lost in failed:  # rows of unreadable files or gone: nulls of the type, not kept
            parts[name].append((lost, pa.nulls(len(lost), arrow_type(desc))))
    extra: dict[str, pa.ChunkedArray] = {}
    for name, got in parts.items():
        order = np.concatenate([sel for sel, _ in got]) if got else np.zeros(0, np.int64)
        values = pa.chunked_array([a for _, a in got], type=arrow_type(descs[name]))
        inverse = np.empty(len(order), np.int64)
        inverse[order] = np.arange(len(order))
        extra[name] = values.take(pa.array(inverse, pa.int64()))
    return datas, src.path_of(ids), extra


def _changed_since_scan(fs: Any, path: str, f: int, sizes: list[int], mtimes: list[int],
                        scanned_on: str | None) -> str | None:
    """How file ``f`` differs from the scan's listing (``scan.changed_since_scan``), or None:
    the same, or not known (no sizes; a lookup that fails leaves it to the read)."""
    if f >= len(sizes):
        return None
    try:
        info = fs.get_file_info(path)
    except Exception:  # noqa: BLE001 - the read meets the same failure and names it
        return None
    if info.type != pafs.FileType.File:
        return None
    from raying.dataset.scan import changed_since_scan

    return changed_since_scan(info, f, sizes, mtimes, scanned_on)


def _null_rows(values: pa.Array) -> np.ndarray:
    """Which rows of ``values`` are null or, for lists, hold a null item."""
    import pyarrow.compute as pc

    mask = np.asarray(values.is_null().to_numpy(zero_copy_only=False), dtype=bool).copy()
    if pa.types.is_list(values.type) or pa.types.is_fixed_size_list(values.type):
        items = pc.list_flatten(values)
        if items.null_count:
            parents = pc.list_parent_indices(values).to_numpy()
            mask[parents[np.asarray(items.is_null().to_numpy(zero_copy_only=False))]] = True
    return mask
