"""A manifest stand-in for plan tests: labels, a format and (Parquet) a row-group table."""

from __future__ import annotations

import numpy as np


class FakeManifest:
    """What samplers read of a manifest: its size, format, labels, classes and row groups."""

    def __init__(self, labels, *, fmt: str = "images", group_rows: int | None = None) -> None:
        self.labels = np.asarray(labels, dtype=np.int64)
        self.format = fmt
        self.classes = [f"class_{k:02d}" for k in range(int(self.labels.max()) + 1)]
        self._group_rows = group_rows

    def __len__(self) -> int:
        return int(self.labels.size)

    def row_group_table(self):
        n, g = len(self), self._group_rows or 1
        start = np.arange(0, n, g, dtype=np.int64)
        rows = np.minimum(g, n - start)
        files = start // (4 * g)  # four row groups per file
        index = (start // g) % 4
        return files, index, start, rows
