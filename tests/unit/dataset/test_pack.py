"""Packing one shard (what each of `raying pack`'s Ray tasks runs), without a cluster."""

from __future__ import annotations

import numpy as np
import pyarrow.parquet as pq
import pytest

import raying
from raying.dataset.pack import pack_shard
from raying.options import StorageOptions
from raying.tools.datagen import make_image_folder


@pytest.mark.parametrize("decode_size", [None, 16])
def test_a_shard_whose_every_image_is_bad_is_packed_empty_and_lists_them(tmp_path,
                                                                        decode_size):
    root = str(make_image_folder(str(tmp_path / "src"), n=4, classes=1, size=(32, 32)))
    paths = sorted((tmp_path / "src").rglob("*.jpg"))
    data = paths[0].read_bytes()
    paths[0].write_bytes(data[: len(data) // 2])  # the first image truncated
    m = raying.Manifest.scan(root)
    out = tmp_path / "out"
    out.mkdir()
    res = pack_shard(m, np.array([0]), str(out), StorageOptions(), "part-00000.parquet",
                     decode_size=decode_size, row_group_rows=8, on_error="skip",
                     verify=True)
    assert res["rows"] == 0 and [s["id"] for s in res["skipped"]] == [0], res
    assert pq.read_table(out / "part-00000.parquet").num_rows == 0
    good = pack_shard(m, np.array([1, 2]), str(out), StorageOptions(), "part-00001.parquet",
                      decode_size=decode_size, row_group_rows=8, on_error="skip",
                      verify=True)
    assert good["rows"] == 2 and not good["skipped"]
