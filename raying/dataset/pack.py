"""The packed format: Parquet shards of encoded or pre-decoded images, one shard written per call."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from raying.dataset.manifest import Manifest
from raying.errors import DataError
from raying.options import (
    StorageOptions,
)
from raying.storage import files as _storage

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
    from raying.errors import DecodeError
    from raying.image.decode import image_size
    from raying.image.transform import ImageTransform

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
    schema = _schema(decoded_shape, src.classes, src.root)
    table = pa.table(cols, schema=schema)
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink, row_group_size=row_group_rows, compression="none",
                   use_dictionary=["label"], write_statistics=["id", "label"])
    data = sink.getvalue()
    out_fs, out_root = _storage.resolve(dst_uri, dst_storage)
    _storage.write_bytes_atomic(out_fs, f"{out_root.rstrip('/')}/{shard_name}", data.to_pybytes())
    return {"shard": shard_name, "rows": len(kept), "bytes": data.size, "skipped": skipped}
