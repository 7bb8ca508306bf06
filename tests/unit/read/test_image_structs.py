"""A Parquet image column of Hugging Face ``Image`` structs (``{bytes, path}``): read by its
bytes; a cell with only a path is set aside as missing with an error that names that path
and says it is not followed, the other rows delivered."""

from __future__ import annotations

import io

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

import raying
from raying.errors import DecodeError
from raying.options import CacheConfig, IOConfig
from raying.read.task import iter_unit


def _png(value: int) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.full((16, 16, 3), value, np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def _write(path, cells) -> None:
    images = pa.array(cells, pa.struct([("bytes", pa.binary()), ("path", pa.string())]))
    table = pa.table({"image": images, "label": pa.array(range(len(cells)), pa.int64())})
    pq.write_table(table, path, row_group_size=4)


def _cells():
    cells = [{"bytes": _png(10 * k), "path": f"img/{k}.png"} for k in range(8)]
    cells[2] = {"bytes": None, "path": "photos/cat 2.jpg"}  # the image left outside the file
    cells[5] = None  # a null struct: no path to name
    return cells


def _read(tmp_path, on_error, decoded_cache="off", io=None):
    m = raying.Manifest.scan(str(tmp_path / "hf.parquet"), format="parquet", label="label")
    pipe = raying.Pipeline(m, on_error=on_error, sampler=raying.UniformSampler(seed=1),
                           transform=raying.ImageTransform(size=16, random_crop=False,
                                                           flip=False),
                           config=raying.PipelineConfig(decoded_cache=decoded_cache, io=io))
    try:
        unit, paths = pipe._fill(pipe.plan(0).units[0])
        return list(iter_unit(pipe._ready_spec(), unit, paths, block_rows=64))
    finally:
        pipe.close()


@pytest.mark.parametrize("planned", [False, True])
def test_a_path_only_cell_is_set_aside_naming_its_path_and_the_other_rows_arrive(tmp_path,
                                                                                planned):
    _write(tmp_path / "hf.parquet", _cells())
    io = None
    if planned:  # coalesced, cached column chunks: the read tasks' path with an IOConfig
        io = IOConfig(cache=CacheConfig(memory_bytes=8 << 20, memory_dir=str(tmp_path / "mem"),
                                        disk_bytes=8 << 20, disk_dir=str(tmp_path / "disk"),
                                        background_writes=False))
    got = _read(tmp_path, "skip", io=io)
    ids = np.concatenate([b["id"] for b, _ in got])
    images = np.concatenate([b["image"] for b, _ in got])
    assert sorted(ids.tolist()) == [0, 1, 3, 4, 6, 7]
    for i, img in zip(ids.tolist(), images, strict=True):
        assert np.unique(img).tolist() == [10 * i]
    skipped = sorted((s for _, a in got for s in a.skipped), key=lambda s: s[0])
    # Each skip is (id, location, reason, detail).
    assert [(s[0], s[2]) for s in skipped] == [(2, "missing"), (5, "missing")], skipped
    assert skipped[0][1].endswith("hf.parquet#rg0/row2")
    assert "'photos/cat 2.jpg'" in skipped[0][3] and "never the files" in skipped[0][3]
    assert skipped[1][3] == "no image data (None)"  # a null cell names no path


def test_under_raise_the_error_names_the_location_and_the_path(tmp_path):
    cells = _cells()
    cells[5] = {"bytes": _png(50), "path": None}  # the path-only cell is the only bad one
    _write(tmp_path / "hf.parquet", cells)
    with pytest.raises(DecodeError) as info:
        _read(tmp_path, "raise")
    text = str(info.value)
    assert "hf.parquet#rg0/row2" in text and "'photos/cat 2.jpg'" in text, text


def test_with_the_decoded_cache_on_the_path_only_cell_is_reported_alike(tmp_path):
    _write(tmp_path / "hf.parquet", _cells())
    got = _read(tmp_path, "skip", decoded_cache=1 << 20)
    ids = sorted(np.concatenate([b["id"] for b, _ in got]).tolist())
    assert ids == [0, 1, 3, 4, 6, 7]
    skipped = {s[0]: s[3] for _, a in got for s in a.skipped}
    assert set(skipped) == {2, 5} and "'photos/cat 2.jpg'" in skipped[2]
