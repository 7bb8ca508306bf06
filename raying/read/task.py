"""The read task: one unit of the plan read, decoded and augmented, block by block, with its
account. Runs in Ray workers (both engines) and in-process alike."""

from __future__ import annotations

import functools
import mmap
import os
import time
from collections.abc import Iterator
from typing import Any

import numpy as np

from raying.dataset import columns as _columns
from raying.errors import RAISE_FIX, DecodeError
from raying.options import use
from raying.read import memory as _memory
from raying.read import parquet as _parquet
from raying.read import stages as _stages
from raying.read.account import UnitAccount, add_counters
from raying.read.sources import Part, open_source
from raying.read.spec import ReadSpec, dataset_key
from raying.read.stages import DEFAULT_STAGE_ROWS, join, run_chunk
from raying.sampling.plan import ReadUnit
from raying.storage import files as _storage

__all__ = ["BLOCK_KEYS", "ReadSpec", "dataset_key", "empty_block", "iter_unit", "run_unit"]

BLOCK_KEYS = ("id", "label", "image", "weight", "prob")

# A worker's own memory is read from /proc (smaps_rollup: 2-3 ms with the object store
# mapped, 2-3 % of a 256-row unit's decode) at most this often; a newly imported framework
# forces a fresh reading, so what a user stage's imports cost shows at once.
WORKER_MEMORY_EVERY_S = 1.0
_worker_memory: list[Any] = [None, 0.0, ()]  # KiB, monotonic time, frameworks loaded


def empty_block(size: int, columns: tuple[tuple[str, Any], ...] = ()
                ) -> dict[str, np.ndarray]:
    """A block with no rows and the right dtypes and shapes (extra ``columns`` too: the
    (name, description) pairs of ``ReadSpec.columns``)."""
    block: dict[str, np.ndarray] = {
        "id": np.zeros(0, np.int64), "label": np.zeros(0, np.int64),
        "image": np.zeros((0, size, size, 3), np.uint8),
        "weight": np.zeros(0, np.float32), "prob": np.zeros(0, np.float64)}
    for name, desc in columns:
        block[name] = _columns.empty(desc)
    return block


_out_buffer: np.ndarray | None = None


def _output(n: int, size: int, rows: int) -> np.ndarray:
    """This process's reusable output array (``rows`` rows, the unit's largest block, so a
    short first block does not make it grow): written in place, no fresh pages per block."""
    global _out_buffer
    if _out_buffer is None or _out_buffer.shape[0] < n or _out_buffer.shape[1] != size:
        _out_buffer = small_pages((max(n, rows, 1), size, size, 3))
    return _out_buffer[:n]


def small_pages(shape: tuple[int, ...]) -> np.ndarray:
    """A zeroed uint8 array on private anonymous pages of the base size, not huge pages.

    numpy asks for transparent huge pages on arrays of 4 MiB or more; on a node whose memory
    is fragmented (a fresh Ray node: the object store, a dozen processes), the kernel then
    compacts memory in the page fault, and a fresh worker's first writes into its output
    buffer took 0.07-0.26 s per 38 MB instead of ~0.03 s (measured in Ray workers, 2 cores).
    The buffer is written once per block and reused, so huge pages buy nothing after.
    """
    nbytes = max(1, int(np.prod(shape)))
    flags = getattr(mmap, "MAP_PRIVATE", 0) | getattr(mmap, "MAP_ANONYMOUS", 0)
    try:
        pages = mmap.mmap(-1, nbytes, flags=flags) if flags else mmap.mmap(-1, nbytes)
    except (OSError, ValueError, TypeError):
        return np.zeros(shape, dtype=np.uint8)
    advice = getattr(mmap, "MADV_NOHUGEPAGE", None)
    if advice is not None:
        try:
            pages.madvise(advice)
        except OSError:
            pass  # a kernel without THP: base pages already
    return np.frombuffer(pages, dtype=np.uint8, count=nbytes).reshape(shape)


def run_unit(spec: ReadSpec, unit: ReadUnit, paths: list[str] | None = None
             ) -> tuple[dict[str, np.ndarray], UnitAccount]:
    """Read, decode and augment one unit: its whole block and its account (see iter_unit)."""
    parts = list(iter_unit(spec, unit, paths, block_rows=None, reuse_output=False))
    blocks = [p[0] for p in parts]
    block = blocks[0] if len(blocks) == 1 else {
        k: np.concatenate([b[k] for b in blocks]) for k in blocks[0]}
    return block, functools.reduce(UnitAccount.merge, [p[1] for p in parts])


def iter_unit(spec: ReadSpec, unit: ReadUnit, paths: list[str] | None = None, *,
              block_rows: int | None = None, reuse_output: bool = False,
              first_block_rows: int | None = None
              ) -> Iterator[tuple[dict[str, np.ndarray], UnitAccount]]:
    """Read one unit once, then decode and augment it ``block_rows`` rows at a time.

    Yields ``(block, account)`` per sub-block, so the first rows reach the trainer while the
    rest of a large unit (a window of Parquet row groups) still decodes. A block holds only
    the rows that decoded, in the unit's order; its account has rows in and out, every skipped
    sample with its reason, bytes read, seconds, and ``final=True`` on the unit's last block.
    Under ``on_error="raise"`` the first bad sample raises an error naming its file.

    Extra Parquet columns (``spec.columns``) are read once per unit and sliced like the ids;
    user stages (``spec.stages``) then run on each non-empty block, before the rows a resumed
    unit skips are dropped (so a resumed block draws the numbers of the whole one). A user
    stage's error is raised whatever ``on_error`` says.

    ``first_block_rows`` makes the first block that short (the rest stay ``block_rows``), so
    the first rows of an epoch reach the trainer after a fraction of a unit's decode.

    ``reuse_output=True`` writes the images into a buffer this process keeps between blocks;
    only for callers that copy each block out before asking for the next (a Ray generator
    task stores each yielded value in the object store before it resumes).
    """
    use(spec.settings)  # the driver's RAYING_* settings, whatever this worker's environment
    t0 = time.perf_counter()
    ids = np.asarray(unit.ids, dtype=np.int64)
    n = len(ids)
    step = max(1, block_rows or n)
    fs, root = _storage.resolve(spec.root, spec.storage)
    source = open_source(spec, fs, root, unit, ids, paths)
    extra: dict[str, np.ndarray] = {}
    extra_bytes = 0
    extra_io: dict[str, int] = {}
    if spec.columns:
        extra, extra_bytes = _parquet.read_columns(spec, fs, root, unit, ids, extra_io)
    read_s = time.perf_counter() - t0  # reads done when the source opened
    labels = _or_default(unit.labels, n, -1, np.int64)
    weights = _or_default(unit.weights, n, 1.0, np.float32)
    probs = _or_default(unit.probs, n, np.nan, np.float64)
    skip = unit.skip_rows
    node = _node_id()
    for a, b in _block_bounds(n, step, first_block_rows):
        t1 = time.perf_counter()
        part = slice(a, b)
        out = _output(b - a, spec.transform.size, min(step, n)) if reuse_output else None
        cols = {"id": ids, "label": labels, "weight": weights, "prob": probs, **extra}
        if spec.stages and b > a:
            got, block = _staged(spec, unit, source, a, b, out, cols)
        else:
            got = source.part(part, out)
            _raise_first(spec, got)
            block = {k: v[part][got.ok] for k, v in cols.items()}
            block["image"] = got.images
        if skip:
            drop = min(skip, len(block["id"]))
            block = {k: v[drop:] for k, v in block.items()}
            skip -= drop
        account = UnitAccount(
            epoch=unit.epoch, unit=unit.index, rows_in=b - a, rows_out=len(block["id"]),
            skipped=[(int(e.sample_id), e.path or "", e.reason, e.detail) for e in got.errors],
            bytes_read=got.bytes_read + (extra_bytes if a == 0 else 0), read_s=(read_s if a == 0 else 0.0) + got.read_s,
            decode_s=time.perf_counter() - t1, node=node, final=b >= n,
            io=_with_retries(got.io, extra_io) if a == 0 and extra_io else got.io,
            pid=os.getpid(), worker_kib=_worker_kib() if b >= n else 0,
            frameworks=_memory.loaded_frameworks() if b >= n else ())
        yield block, account


def _worker_kib() -> int:
    """This process's own memory (KiB), read afresh at most every WORKER_MEMORY_EVERY_S."""
    now, loaded = time.monotonic(), _memory.loaded_frameworks()
    kib, at, seen = _worker_memory
    if kib is None or now - at >= WORKER_MEMORY_EVERY_S or loaded != seen:
        kib = _memory.own_kib()
        _worker_memory[:] = [kib, now, loaded]
    return kib


def _raise_first(spec: ReadSpec, got: Part) -> None:
    if got.errors and spec.on_error == "raise":
        e = got.errors[0]
        raise DecodeError(e.reason, e.detail, path=e.path, sample_id=e.sample_id,
                          root=spec.root, fix=RAISE_FIX)


def _staged(spec: ReadSpec, unit: ReadUnit, source: Any, a: int, b: int,
            out: np.ndarray | None, cols: dict[str, np.ndarray]
            ) -> tuple[Part, dict[str, np.ndarray]]:
    """Rows ``[a, b)`` decoded and run through the user stages a chunk at a time: each chunk
    goes through the stages right after its decode, while its pixels are in cache. Chunks
    start at multiples of ``DEFAULT_STAGE_ROWS`` of the unit's rows (the same chunks however
    the unit is cut into blocks). Returns the rows' Part (its images unused) and the block."""
    step = DEFAULT_STAGE_ROWS
    calls = _stages.stage_call_rows(spec.transform.size)
    oks, errors, parts = [], [], []
    io: dict[str, int] = {}
    nbytes, read_s = 0, 0.0
    pos = 0  # rows of ``out`` holding staged images (never past the chunk being decoded)
    c0 = a
    while c0 < b:
        c1 = min(b, (c0 // step + 1) * step)
        sub = slice(c0, c1)
        got = source.part(sub, None if out is None else out[c0 - a:c1 - a])
        _raise_first(spec, got)
        oks.append(got.ok)
        errors.extend(got.errors)
        add_counters(io, got.io)
        nbytes += got.bytes_read
        read_s += got.read_s
        chunk = {k: v[sub][got.ok] for k, v in cols.items()}
        chunk["image"] = got.images
        rows = len(chunk["id"])
        # One generator per stage and chunk, drawn from by the chunk's calls in turn.
        rngs = _stages.chunk_rngs(spec.stages, spec.seed, unit.epoch, chunk["id"])
        for s0 in range(0, rows, calls):  # the stages a few rows at a time (see stages.py)
            part = chunk if calls >= rows else {k: v[s0:s0 + calls] for k, v in chunk.items()}
            if out is not None:
                # The buffer takes the stage's output next, and the next block's decode: the
                # stage gets pixels of its own, which it may keep (a mosaic's or a memory
                # bank's earlier images) or view from another column. One copy of a call's
                # rows while they are in cache (~0.3 % of the bench's jitter stage).
                part = {**part, "image": part["image"].copy()}
            staged = run_chunk(spec.stages, part, seed=spec.seed, epoch=unit.epoch,
                               size=spec.transform.size, rngs=rngs)
            if out is not None:  # the rows' pixels into the block's buffer while in cache
                k = len(staged["id"])
                staged["image"] = _into(out[pos:pos + k], staged["image"])
                pos += k
            parts.append(staged)
        c0 = c1
    ok = np.concatenate(oks)
    if parts:
        # With a buffer the chunks' images already lie in order in out[:pos]: no fresh pages.
        block = join(spec.stages, parts, epoch=unit.epoch,
                     image=None if out is None else out[:pos])
    else:  # no row decoded: the block's columns, empty
        block = {k: v[a:a] for k, v in cols.items()}
        block["image"] = np.empty((0, spec.transform.size, spec.transform.size, 3), np.uint8)
    return Part(np.empty(0), ok, errors, io, nbytes, read_s), block


def _into(dst: np.ndarray, image: np.ndarray) -> np.ndarray:
    """``image`` copied into ``dst`` (same shape)."""
    np.copyto(dst, image)
    return dst


def _block_bounds(n: int, step: int, first: int | None) -> list[tuple[int, int]]:
    """``[(start, end), ...]`` of a unit's blocks: ``step`` rows each, the first one ``first``
    rows when that is shorter; one empty block for an empty unit."""
    if n == 0:
        return [(0, 0)]
    starts = [0]
    nxt = first if first is not None and 0 < first < min(step, n) else step
    while nxt < n:
        starts.append(nxt)
        nxt += step
    return list(zip(starts, [*starts[1:], n], strict=True))


def _with_retries(io: dict[str, int], extra_io: dict[str, int]) -> dict[str, int]:
    """``io`` with the retries of the extra columns' reads added."""
    out = dict(io)
    out["io_retries"] = out.get("io_retries", 0) + extra_io.get("io_retries", 0)
    return out


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
