"""`raying pack`: an image folder to Parquet shards of encoded or pre-decoded images."""

from __future__ import annotations

import dataclasses
import json
import time
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from raying import storage as _storage
from raying.config import (
    DEFAULT_PACK_ROW_GROUP_ROWS,
    DEFAULT_PACK_SHARD_ROWS,
    StorageOptions,
)
from raying.errors import ConfigError, DataError
from raying.manifest import Manifest

SHARD_NAME = "part-{:05d}.parquet"


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
            source: str) -> pa.Schema:
    image_type = pa.binary(int(np.prod(decoded))) if decoded else pa.binary()
    fields = [pa.field("id", pa.int64()), pa.field("label", pa.int64()),
              pa.field("image", image_type), pa.field("path", pa.string())]
    if decoded:
        fields += [pa.field("height", pa.int32()), pa.field("width", pa.int32()),
                   pa.field("channels", pa.int32())]
    meta = {b"raying.source": source.encode()}
    if classes is not None:
        meta[b"raying.classes"] = json.dumps(classes).encode()
    return pa.schema(fields, metadata=meta)


def pack_shard(src: Manifest, ids: np.ndarray, dst_uri: str, dst_storage: StorageOptions,
               shard_name: str, *, decode_size: int | None, row_group_rows: int,
               on_error: str, verify: bool) -> dict[str, Any]:
    """Pack the images ``ids`` of ``src`` into one Parquet file (runs as a Ray task)."""
    from raying.decode import image_size
    from raying.errors import DecodeError
    from raying.transforms import ImageTransform

    fs, root = _storage.resolve(src.root, src.storage)
    paths = [str(p) for p in src.column("path")[ids]]
    datas = _storage.read_many(fs, [f"{root.rstrip('/')}/{p}" for p in paths])
    skipped: list[dict[str, Any]] = []
    keep = np.ones(len(ids), dtype=bool)
    for k, d in enumerate(datas):
        reason = detail = None
        if isinstance(d, BaseException):
            reason, detail = "read_error", str(d).splitlines()[0][:200] if str(d) else ""
        elif not decode_size:
            try:
                if verify:
                    from raying.decode import decode_image

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
        flat = res.images.reshape(len(res.images), -1)
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
    schema = _schema(decoded_shape, src.classes, src.root)
    table = pa.table(cols, schema=schema)
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink, row_group_size=row_group_rows, compression="none",
                   use_dictionary=["label"], write_statistics=["id", "label"])
    data = sink.getvalue()
    out_fs, out_root = _storage.resolve(dst_uri, dst_storage)
    _storage.write_bytes_atomic(out_fs, f"{out_root.rstrip('/')}/{shard_name}", data.to_pybytes())
    return {"shard": shard_name, "rows": len(kept), "bytes": data.size, "skipped": skipped}


def pack(src: str | Manifest, dst: str, *, decode_size: int | None = None,
         shard_rows: int = DEFAULT_PACK_SHARD_ROWS,
         row_group_rows: int = DEFAULT_PACK_ROW_GROUP_ROWS,
         storage: StorageOptions | dict | None = None,
         dst_storage: StorageOptions | dict | None = None, on_error: str = "skip",
         verify: bool = False, progress: bool = True, label: str | None = "folder",
         overwrite: bool = False) -> PackResult:
    """Write an image dataset as Parquet shards, one Ray task per shard.

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
    """
    import ray

    from raying.pipeline import ensure_ray

    if shard_rows < 1 or row_group_rows < 1:
        msg = (f"shard_rows and row_group_rows must be >= 1, got {shard_rows} and "
               f"{row_group_rows}")
        raise ConfigError(msg)
    if decode_size is not None and decode_size < 1:
        msg = f"decode_size must be a positive number of pixels, got {decode_size!r}"
        raise ConfigError(msg)
    t0 = time.perf_counter()
    manifest = src if isinstance(src, Manifest) else Manifest.scan(
        src, format="images", label=label, storage=storage)
    if manifest.format != "images":
        msg = f"pack reads image folders; {manifest.root} is {manifest.format}"
        raise ConfigError(msg)
    out_opts = StorageOptions.coerce(dst_storage if dst_storage is not None else storage)
    out_fs, out_root = _storage.resolve(dst, out_opts)
    _clear_destination(out_fs, out_root, dst, overwrite=overwrite)
    _storage.make_dirs(out_fs, out_root)
    ensure_ray()
    task: Any = ray.remote(num_cpus=1, max_retries=3)(pack_shard)  # type: ignore[arg-type]
    src_ref = ray.put(manifest)
    n = len(manifest)
    refs = []
    for k, start in enumerate(range(0, n, shard_rows)):
        ids = np.arange(start, min(n, start + shard_rows), dtype=np.int64)
        refs.append(task.remote(src_ref, ids, dst, out_opts, SHARD_NAME.format(k),
                                decode_size=decode_size, row_group_rows=row_group_rows,
                                on_error=on_error, verify=verify))
    results = _wait_all(refs, total=n, progress=progress)
    results.sort(key=lambda r: r["shard"])
    skipped = [s for r in results for s in r["skipped"]]
    return PackResult(dst=dst, shards=[r["shard"] for r in results],
                      rows=sum(r["rows"] for r in results),
                      bytes_written=sum(r["bytes"] for r in results), skipped=skipped,
                      seconds=time.perf_counter() - t0)


def _clear_destination(fs: Any, root: str, dst: str, *, overwrite: bool) -> None:
    """Refuse (or, with ``overwrite``, delete) Parquet files already under the destination."""
    try:
        old = _storage.list_files(fs, root, extensions=(".parquet",))
    except _storage.NotFoundError:
        return
    if not old:
        return
    if not overwrite:
        name = old[0].path.rsplit("/", 1)[-1]
        msg = (f"{dst} already holds {len(old)} Parquet file(s) ({name}, ...): a scan of it "
               f"would read their rows with the new shards'. Pack into an empty folder, or "
               f"pass overwrite=True (raying pack --overwrite) to delete them first")
        raise ConfigError(msg)
    for info in old:
        try:
            fs.delete_file(info.path)
        except Exception as exc:
            raise _storage.storage_error(exc, info.path, action="delete") from None


def _wait_all(refs: list[Any], *, total: int, progress: bool) -> list[dict[str, Any]]:
    import ray

    from raying.progress import progress_bar

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
