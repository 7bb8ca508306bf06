"""Worker side of a read task: fetch one unit's bytes, decode and augment, account for it."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from raying.errors import RAISE_FIX, CredentialsError, DataError, DecodeError, StorageError
from raying.options import DEFAULT_MAX_IMAGE_PIXELS, IOConfig, StorageOptions
from raying.read import decoded_cache as _decoded
from raying.read import fetch as _io_fetch  # issue 5: planned, cached reads (raying/read/fetch.py)
from raying.read.views import Rows, binary_views
from raying.sampling.plan import ReadUnit
from raying.storage import files as _storage

BLOCK_KEYS = ("id", "label", "image", "weight", "prob")


@dataclasses.dataclass(frozen=True)
class ReadSpec:
    """What every read task of a pipeline needs besides its unit; small and picklable."""

    root: str
    storage: StorageOptions
    fmt: str
    files: tuple[str, ...]
    image_column: str | None
    decoded: tuple[int, int, int] | None
    transform: Any
    seed: int
    on_error: str = "skip"
    max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS
    io: Any = None  # issue 5: a raying.options.IOConfig; None reads as before
    # Bytes of the node's memory tier for decoded pixels (0 = off; see raying.read.decoded_cache).
    decoded_cache_bytes: int = 0
    decoded_cache_dir: str = ""
    cache_namespace: str = ""

    @property
    def dataset_key(self) -> str:
        """The dataset's identity in cache keys: its URI and the S3 endpoint, if any (the same
        bucket and prefix on two endpoints are two datasets)."""
        return dataset_key(self.root, self.storage)

    @classmethod
    def of(cls, manifest: Any, transform: Any, seed: int, on_error: str, *,
           max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS, io: Any = None) -> ReadSpec:
        decoded = manifest.meta.get("decoded")
        return cls(root=manifest.root, storage=manifest.storage, fmt=manifest.format,
                   files=tuple(manifest.files), image_column=manifest.meta.get("image_column"),
                   decoded=tuple(decoded) if decoded else None, transform=transform,
                   seed=int(seed), on_error=on_error, max_pixels=int(max_pixels),
                   io=_io_fetch.IOConfig.coerce(io))  # issue 5


def dataset_key(root: str, storage: StorageOptions | None) -> str:
    """See :attr:`ReadSpec.dataset_key`."""
    endpoint = storage.endpoint_url if storage is not None else None
    return f"{root}@{endpoint}" if endpoint else root


def empty_block(size: int) -> dict[str, np.ndarray]:
    """A block with no rows and the right dtypes and shapes."""
    return {"id": np.zeros(0, np.int64), "label": np.zeros(0, np.int64),
            "image": np.zeros((0, size, size, 3), np.uint8),
            "weight": np.zeros(0, np.float32), "prob": np.zeros(0, np.float64)}


_out_buffer: np.ndarray | None = None


def _output(n: int, size: int) -> np.ndarray:
    """This process's reusable output array: written in place, no fresh pages per block."""
    global _out_buffer
    if _out_buffer is None or _out_buffer.shape[0] < n or _out_buffer.shape[1] != size:
        _out_buffer = np.empty((max(n, 1), size, size, 3), dtype=np.uint8)
    return _out_buffer[:n]


def run_unit(spec: ReadSpec, unit: ReadUnit, paths: list[str] | None = None, *,
             reuse_output: bool = False) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """Read, decode and augment one unit: its whole block and its account (see iter_unit)."""
    parts = list(iter_unit(spec, unit, paths, block_rows=None, reuse_output=False))
    blocks = [p[0] for p in parts]
    block = blocks[0] if len(blocks) == 1 else {
        k: np.concatenate([b[k] for b in blocks]) for k in blocks[0]}
    return block, merge_accounts([p[1] for p in parts])


def merge_accounts(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """One account from the accounts of a unit's sub-blocks."""
    out = dict(parts[0])
    for extra in parts[1:]:
        for key, value in extra.items():
            if key in ("rows_in", "rows_out", "bytes_read", "read_s", "decode_s") or (
                    key.startswith(("io_", "cache_")) and isinstance(value, (int, float))):
                out[key] = out.get(key, 0) + value
            elif key == "skipped":
                out[key] = list(out[key]) + list(value)
        out["final"] = extra.get("final", False)
    return out


def iter_unit(spec: ReadSpec, unit: ReadUnit, paths: list[str] | None = None, *,
              block_rows: int | None = None, reuse_output: bool = False
              ) -> Iterator[tuple[dict[str, np.ndarray], dict[str, Any]]]:
    """Read one unit once, then decode and augment it ``block_rows`` rows at a time.

    Yields ``(block, account)`` per sub-block, so the first rows reach the trainer while the
    rest of a large unit (a window of Parquet row groups) still decodes. A block holds only
    the rows that decoded, in the unit's order; its account has rows in and out, every skipped
    sample with its reason, bytes read, seconds, and ``final=True`` on the unit's last block.
    Under ``on_error="raise"`` the first bad sample raises an error naming its file.

    ``reuse_output=True`` writes the images into a buffer this process keeps between blocks;
    only for callers that copy each block out before asking for the next (a Ray generator
    task stores each yielded value in the object store before it resumes).
    """
    t0 = time.perf_counter()
    ids = np.asarray(unit.ids, dtype=np.int64)
    n = len(ids)
    step = max(1, block_rows or n)
    fs, root = _storage.resolve(spec.root, spec.storage)
    io_account: dict[str, int] = {}  # issue 5: io_*/cache_* counters (raying.read.fetch)
    pixels = None
    # With the decoded cache on, pixels are looked up (and misses fetched and decoded) one
    # sub-block at a time, so a task holds block_rows decoded images, not its whole unit.
    load_part: Any = None
    nbytes = 0
    if spec.fmt == "images":
        if paths is None:
            msg = "an image read unit needs the paths of its ids"
            raise DataError(msg)
        full = [f"{root.rstrip('/')}/{p}" for p in paths]
        where: list[str] = list(paths)
        if spec.decoded_cache_bytes:
            def load_part(part: slice):
                def fetch(miss: list[int]):
                    picked = [full[part][k] for k in miss]
                    return _io_fetch.read_samples(spec, fs, picked, unit)

                return _decoded.load_arrays(spec, ids[part], where[part], fetch)

            datas: Any = []
        else:
            datas, io_account = _io_fetch.read_samples(spec, fs, full, unit)  # issue 5
            nbytes = sum(len(d) for d in datas
                         if isinstance(d, (bytes, bytearray, memoryview)))
    elif spec.decoded_cache_bytes and spec.decoded is None:
        where = _row_locations(spec, unit, ids)
        read: dict[str, Any] = {}

        def load_part(part: slice):
            def fetch(miss: list[int]):  # the unit's row groups, read once, only on a miss
                fetched = 0
                acct: dict[str, int] = {}
                if "values" not in read:
                    read["values"], _, fetched = _read_parquet_rows(spec, fs, root, unit, ids,
                                                                    acct)
                values = read["values"][part]
                picked = [values[k] for k in miss]
                delivered = sum(len(v) for v in picked if isinstance(v, (bytes, memoryview)))
                return picked, {**acct, "io_bytes_fetched": int(fetched),
                                "io_bytes_delivered": int(delivered)}

            arrays, acct, _ = _decoded.load_arrays(spec, ids[part], where[part], fetch)
            return arrays, acct, acct.get("io_bytes_fetched", 0)

        datas = []
    else:
        datas, where, nbytes = _read_parquet_rows(spec, fs, root, unit, ids, io_account)
        if spec.decoded is not None and not isinstance(datas, list):
            pixels = datas
    read_s = time.perf_counter() - t0
    if load_part is None and "io_bytes_fetched" not in io_account:  # plain read path
        if pixels is not None:
            delivered = n * int(np.prod(spec.decoded or (0,)))
        else:
            delivered = sum(len(d) for d in datas if isinstance(d, (bytes, bytearray, memoryview)))
        io_account = {**io_account, "io_bytes_fetched": int(nbytes),
                      "io_bytes_delivered": int(delivered)}
    labels = _or_default(unit.labels, n, -1, np.int64)
    weights = _or_default(unit.weights, n, 1.0, np.float32)
    probs = _or_default(unit.probs, n, np.nan, np.float64)
    skip = unit.skip_rows
    for a in range(0, max(n, 1), step):
        t1 = time.perf_counter()
        b = min(n, a + step)
        part = slice(a, b)
        out = _output(b - a, spec.transform.size) if reuse_output else None
        part_account: dict[str, int] = io_account if a == 0 else {}
        part_bytes = nbytes if a == 0 else 0
        part_read_s = read_s if a == 0 else 0.0
        if load_part is not None:
            arrays, part_account, part_bytes = load_part(part)
            if "io_bytes_fetched" not in part_account:
                part_account = {**part_account, "io_bytes_fetched": int(part_bytes),
                                "io_bytes_delivered": int(part_bytes)}
            part_read_s += time.perf_counter() - t1
            images, ok, errors = _decoded.transform_arrays(spec, unit, ids[part], arrays, out)
        elif pixels is not None:
            images, ok, errors = _transform_decoded(spec, unit, ids[part], pixels[part], out)
        else:
            images, ok, errors = _transform_encoded(spec, unit, ids[part], datas[part],
                                                    where[part], out)
        if errors and spec.on_error == "raise":
            e = errors[0]
            raise DecodeError(e.reason, e.detail, path=e.path, sample_id=e.sample_id,
                              root=spec.root, fix=RAISE_FIX)
        block = {"id": ids[part][ok], "label": labels[part][ok], "image": images,
                 "weight": weights[part][ok], "prob": probs[part][ok]}
        if skip:
            drop = min(skip, len(block["id"]))
            block = {k: v[drop:] for k, v in block.items()}
            skip -= drop
        account = {"epoch": unit.epoch, "unit": unit.index, "rows_in": b - a,
                   "node": _node_id(), "rows_out": len(block["id"]),
                   "skipped": [(int(e.sample_id), e.path or "", e.reason, e.detail)
                               for e in errors],
                   "bytes_read": int(part_bytes), "read_s": part_read_s,
                   "decode_s": time.perf_counter() - t1, "final": b >= n}
        account.update(part_account)  # issue 5
        yield block, account


def _node_id() -> str | None:
    """The Ray node this read ran on (None outside Ray), for where-decode-ran accounts."""
    import sys

    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        return None
    return ray.get_runtime_context().get_node_id()


def _or_default(values: np.ndarray | None, n: int, fill: float, dtype) -> np.ndarray:
    if values is None:
        return np.full(n, fill, dtype=dtype)
    return np.asarray(values, dtype=dtype)


def _transform_encoded(spec: ReadSpec, unit: ReadUnit, ids: np.ndarray, datas: list[Any],
                       where: list[str], out: np.ndarray | None = None):
    clean: list[Any] = []
    pre_errors: dict[int, DecodeError] = {}
    for k, d in enumerate(datas):
        if isinstance(d, BaseException):
            pre_errors[k] = DecodeError("read_error", _first_line(d), path=where[k],
                                        sample_id=int(ids[k]))
            clean.append(None)
        else:
            clean.append(d)
    res = spec.transform.apply_encoded(clean, ids, seed=spec.seed, epoch=unit.epoch,
                                       max_pixels=spec.max_pixels, out=out)
    ok = np.asarray(res.ok, dtype=bool)
    # The transform lists its errors in input order, one for each row that is not ok.
    errors = []
    for pos, e in zip(np.flatnonzero(~ok), res.errors, strict=True):
        errors.append(pre_errors.get(int(pos)) or DecodeError(
            e.reason, e.detail, path=where[pos], sample_id=int(ids[pos])))
    return res.images, ok, errors


def _transform_decoded(spec: ReadSpec, unit: ReadUnit, ids: np.ndarray, pixels: Any,
                       out: np.ndarray | None = None):
    images = spec.transform.apply_decoded(pixels, ids, seed=spec.seed, epoch=unit.epoch,
                                          out=out)
    return images, np.ones(len(ids), dtype=bool), []


def _first_line(exc: BaseException) -> str:
    text = str(exc)
    return (text.splitlines()[0] if text else type(exc).__name__)[:200]


def _read_parquet_rows(spec: ReadSpec, fs, root: str, unit: ReadUnit, ids: np.ndarray,
                       account: dict[str, int] | None = None):
    """The image values of ``ids``, reading each needed row group once.

    With ``spec.io`` set, the row groups' image chunks are fetched as a planned window
    through the cache (:func:`raying.read.parquet.read_unit_groups`) and ``account`` gets the
    ``io_*``/``cache_*`` counters; else each file's row groups are read with pyarrow.

    Returns (values, locations, bytes): values is a list of buffers (encoded images, None for
    nulls) or, for pre-decoded data, one (n, h, w, c) uint8 array; bytes are those fetched
    (planned path) or the Arrow size of what was read.
    """
    groups = unit.row_groups
    if groups is None or len(groups) == 0:
        msg = "a Parquet read unit needs its row groups"
        raise DataError(msg)
    col = spec.image_column or "image"
    order = np.lexsort((groups[:, 1], groups[:, 0]))
    groups = groups[order]
    chunks: list[pa.Array] = []
    starts: list[tuple[int, int]] = []
    nbytes = 0
    io = IOConfig.coerce(getattr(spec, "io", None))
    if io is not None:  # issue 5: planned, coalesced, cached column chunks
        from raying.read.parquet import UnitGroupError, read_unit_groups

        paths = [_file_path(spec, root, int(f)) for f in groups[:, 0]]
        try:
            arrays, acct = read_unit_groups(spec, fs, paths, groups, col, unit, io)
        except UnitGroupError as exc:
            raise _parquet_error(spec, spec.files[exc.file], exc.groups, exc.cause) from None
        offset = 0
        for (_, _, g_start), arr in zip(groups.tolist(), arrays, strict=True):
            starts.append((int(g_start), offset))
            offset += len(arr)
            chunks.append(arr)
        nbytes = acct.pop("io_bytes_fetched", 0)
        if account is not None:
            account.update(acct)
    for f in (np.unique(groups[:, 0]) if io is None else ()):  # else: read above
        sel = groups[groups[:, 0] == f]
        rel = spec.files[int(f)]
        try:
            with _storage.open_input(fs, _file_path(spec, root, int(f))) as fh:
                pf = pq.ParquetFile(fh)
                table = pf.read_row_groups([int(g) for g in sel[:, 1]], columns=[col])
        except (pa.ArrowInvalid, OSError) as exc:
            raise _parquet_error(spec, rel, sel[:, 1].tolist(), exc) from None
        arr = table.column(col)
        nbytes += table.nbytes
        # read_row_groups returns the groups in the order asked; track each group's first row.
        offset = sum(len(c) for c in chunks)
        for g_start, g_rows in _group_rows(sel, pf):
            starts.append((g_start, offset))
            offset += g_rows
        chunks.extend(arr.chunks)
    first_ids = np.array([s for s, _ in starts], dtype=np.int64)
    offsets = np.array([o for _, o in starts], dtype=np.int64)
    sort = np.argsort(first_ids)
    first_ids, offsets = first_ids[sort], offsets[sort]
    k = np.searchsorted(first_ids, ids, side="right") - 1
    pos = offsets[k] + (ids - first_ids[k])
    if chunks and pa.types.is_struct(chunks[0].type):  # {bytes, path}: Hugging Face Image
        k = chunks[0].type.get_field_index("bytes")
        chunks = [c.flatten()[k] for c in chunks]  # flatten keeps the struct's nulls
    values = pa.chunked_array(chunks) if chunks else pa.chunked_array([], pa.binary())
    if spec.decoded is not None:
        flat = values.combine_chunks() if values.num_chunks != 1 else values.chunk(0)
        h, w, c = spec.decoded
        buf = np.frombuffer(flat.buffers()[1], dtype=np.uint8)
        buf = buf[flat.offset * h * w * c:(flat.offset + len(flat)) * h * w * c]
        return Rows(buf.reshape(len(flat), h, w, c), pos), None, nbytes
    return binary_views(values, pos), _row_locations(spec, unit, ids), nbytes


def _file_path(spec: ReadSpec, root: str, f: int) -> str:
    """Path on the filesystem of the dataset's ``f``-th Parquet file."""
    rel = spec.files[f] if spec.files else root
    return f"{root.rstrip('/')}/{rel}" if rel != root else root


def _parquet_error(spec: ReadSpec, rel: str, groups: list[int], exc: BaseException
                   ) -> DataError | StorageError:
    if isinstance(exc, StorageError) and not isinstance(exc, FileNotFoundError):
        # Unreachable or refused storage says nothing about the file: keep the storage error.
        kind = type(exc) if isinstance(exc, CredentialsError) else StorageError
        return kind(f"{spec.root.rstrip('/')}/{rel}: cannot read row groups {groups}: "
                    f"{_first_line(exc)}")
    return DataError(f"{spec.root.rstrip('/')}/{rel}: cannot read row groups {groups} "
                     f"({_first_line(exc)}); the file may be corrupt or changed since the "
                     f"manifest was scanned: rescan it")


def _group_rows(sel: np.ndarray, pf: pq.ParquetFile):
    for _, g, start in sel:
        yield int(start), pf.metadata.row_group(int(g)).num_rows


def _row_locations(spec: ReadSpec, unit: ReadUnit, ids: np.ndarray) -> list[str]:
    groups: Any = unit.row_groups
    first = groups[:, 2]
    sort = np.argsort(first)
    k = sort[np.searchsorted(first[sort], ids, side="right") - 1]
    return [f"{spec.files[int(groups[j, 0])]}#rg{int(groups[j, 1])}/row{int(i - groups[j, 2])}"
            for i, j in zip(ids, k, strict=True)]
