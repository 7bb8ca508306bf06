"""Parquet of pre-decoded pixels (fixed-size binary with height, width, channels columns):
its shape found past empty row groups and null shapes, its null cells set aside."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import raying
from raying.read.task import iter_unit


def _table(pixels, heights=None):
    n = len(pixels)
    heights = [8] * n if heights is None else heights
    return pa.table({"image": pa.array(pixels, pa.binary(192)),
                     "label": pa.array([0] * n, pa.int64()),
                     "height": pa.array(heights, pa.int32()),
                     "width": pa.array([8] * n, pa.int32()),
                     "channels": pa.array([3] * n, pa.int32())})


def _pixels(n, start=0):
    return [np.full((8, 8, 3), 100 + start + k, np.uint8).tobytes() for k in range(n)]


def test_a_null_pixel_cell_is_set_aside_as_missing_and_the_other_rows_are_delivered(tmp_path):
    pixels = _pixels(6)
    pixels[3] = None  # its slot holds zeros: it must not arrive as a black image
    pq.write_table(_table(pixels), tmp_path / "p.parquet")
    m = raying.Manifest.scan(str(tmp_path))
    pipe = raying.Pipeline(m, on_error="skip", sampler=raying.UniformSampler(seed=1),
                           transform=raying.ImageTransform(size=8, random_crop=False,
                                                           flip=False),
                           config=raying.PipelineConfig(decoded_cache="off"))
    unit, paths = pipe._fill(pipe.plan(0).units[0])
    got = list(iter_unit(pipe._ready_spec(), unit, paths, block_rows=64))
    ids = np.concatenate([b["id"] for b, _ in got])
    images = np.concatenate([b["image"] for b, _ in got])
    assert sorted(ids.tolist()) == [0, 1, 2, 4, 5]
    for i, img in zip(ids.tolist(), images, strict=True):
        assert np.unique(img).tolist() == [100 + i]
    skipped = [s for _, a in got for s in a.skipped]
    # Each skip is (id, path, reason, detail).
    assert [(s[0], s[2]) for s in skipped] == [(3, "missing")], skipped
    assert skipped[0][1].endswith("p.parquet#rg0/row3")
    pipe.close()


def test_the_shape_is_taken_past_empty_row_groups_files_and_null_shapes(tmp_path):
    with pq.ParquetWriter(tmp_path / "a.parquet", _table(_pixels(1)).schema) as w:
        w.write_table(_table(_pixels(0)))  # a writer that flushed an empty batch first
        w.write_table(_table(_pixels(5)))
    m = raying.Manifest.scan(str(tmp_path))
    assert len(m) == 5 and m.meta["decoded"] == [8, 8, 3]
    (tmp_path / "a.parquet").unlink()
    pq.write_table(_table(_pixels(0)), tmp_path / "a.parquet")  # no rows at all
    pq.write_table(_table(_pixels(3)), tmp_path / "b.parquet")
    m = raying.Manifest.scan(str(tmp_path))
    assert len(m) == 3 and m.meta["decoded"] == [8, 8, 3]


def test_a_null_shape_is_refused_naming_the_file_and_the_row(tmp_path):
    pq.write_table(_table(_pixels(3), heights=[8, None, 8]), tmp_path / "p.parquet")
    with pytest.raises(raying.DataError, match=r"p.parquet: row 1 has a null height, not 8 as "
                                               r"the other rows"):
        raying.Manifest.scan(str(tmp_path))
    pq.write_table(_table(_pixels(2), heights=[None, None]), tmp_path / "p.parquet")
    with pytest.raises(raying.DataError, match=r"no row gives the shape of the pre-decoded "
                                               r"pixels"):
        raying.Manifest.scan(str(tmp_path))
