"""Row views of what a read unit holds, without gather copies (used by raying.read.task)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa


class Rows:
    """Rows ``pos`` of a (N, h, w, c) array as a sequence of views: no gather copy.
    ``valid``: per row of ``pos``, whether it holds pixels (False: a null cell, whose slot
    holds whatever the writer left there), or None when every row does."""

    def __init__(self, array: np.ndarray, pos: np.ndarray,
                 valid: np.ndarray | None = None) -> None:
        self.array, self.pos, self.valid = array, pos, valid

    def __len__(self) -> int:
        return len(self.pos)

    def __getitem__(self, key):
        if isinstance(key, slice) or (isinstance(key, np.ndarray) and key.dtype == bool):
            return Rows(self.array, self.pos[key],
                        None if self.valid is None else self.valid[key])
        return self.array[self.pos[key]]


def binary_views(values: pa.ChunkedArray, pos: np.ndarray) -> list[Any]:
    """Zero-copy memoryviews of the values at ``pos`` (None for nulls)."""
    bounds = np.cumsum([0] + [len(c) for c in values.chunks])
    out: list[Any] = [None] * len(pos)
    views = []
    for c in values.chunks:
        off_type = np.int64 if pa.types.is_large_binary(c.type) else np.int32
        bufs = c.buffers()
        offs = np.frombuffer(bufs[1], dtype=off_type)[c.offset:c.offset + len(c) + 1]
        data = memoryview(bufs[2]) if bufs[2] is not None else memoryview(b"")
        valid = None if c.null_count == 0 else np.asarray(c.is_valid())
        views.append((offs, data, valid))
    which = np.searchsorted(bounds, pos, side="right") - 1
    for i, (p, w) in enumerate(zip(pos, which, strict=True)):
        offs, data, valid = views[w]
        r = int(p - bounds[w])
        if valid is not None and not valid[r]:
            continue
        out[i] = data[int(offs[r]):int(offs[r + 1])]
    return out
