"""A local dataset that this node does not hold (its folder missing or emptied here) stops
the read naming the node and the fix; its files are not set aside as bad samples."""

from __future__ import annotations

import shutil

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import raying
from raying.read.task import iter_unit
from raying.tools.datagen import encode, make_image_folder


def _read(m, tmp_path, on_error="skip"):
    pipe = raying.Pipeline(m, on_error=on_error, transform=raying.ImageTransform(size=8),
                           sampler=raying.UniformSampler(seed=1),
                           config=raying.PipelineConfig(block_rows=8, decoded_cache="off"))
    try:
        spec = pipe._ready_spec()
        got = []
        for unit in pipe.plan(0).units:
            unit, paths = pipe._fill(unit)
            got.extend(iter_unit(spec, unit, paths, block_rows=8))
        return got
    finally:
        pipe.close()


@pytest.mark.parametrize("how", ["moved", "emptied"])
def test_an_image_folder_this_node_does_not_hold_stops_the_read(tmp_path, how):
    root = make_image_folder(tmp_path / "imgs", n=16, classes=2, size=(8, 8))
    m = raying.Manifest.scan(str(root))
    if how == "moved":
        root.rename(tmp_path / "elsewhere")
        said = rf"{root} does not exist on this node \("
    else:  # a folder of that name, without the dataset (an empty mount on another node)
        for entry in root.iterdir():
            shutil.rmtree(entry)
        said = rf"{root} is empty on this node \("
    with pytest.raises(raying.StorageError, match=said + r".*storage every node reaches"):
        _read(m, tmp_path)


@pytest.mark.parametrize("gone", ["a file", "a class folder"])
def test_files_removed_from_a_folder_that_holds_others_are_bad_samples_set_aside(tmp_path,
                                                                               gone):
    """Removed on purpose (whole units of them, too): set aside and reported, as before."""
    root = make_image_folder(tmp_path / "imgs", n=32, classes=4, size=(8, 8))
    m = raying.Manifest.scan(str(root))
    files = sorted(root.rglob("*.jpg"))
    if gone == "a file":
        removed = [files[3]]
        files[3].unlink()
    else:
        removed = [f for f in files if f.parent.name == "class_00"]
        shutil.rmtree(root / "class_00")
    got = _read(m, tmp_path)
    skipped = sorted((s[2], s[1]) for _, account in got for s in account.skipped)
    assert skipped == sorted(("read_error", str(f.relative_to(root))) for f in removed)
    assert sum(len(b["id"]) for b, _ in got) == 32 - len(removed)


def test_a_missing_parquet_file_is_named_not_called_corrupt(tmp_path):
    img = encode(np.zeros((4, 4, 3), np.uint8), "png")
    root = tmp_path / "pq"
    root.mkdir()
    for k in range(2):
        pq.write_table(pa.table({"image": [img] * 8, "label": [0, 1] * 4}),
                       root / f"part-{k}.parquet")
    m = raying.Manifest.scan(str(root))
    (root / "part-1.parquet").unlink()
    with pytest.raises(raying.DataError, match=r"part-1.parquet does not exist: it was removed "
                                               r"or moved since the manifest was scanned"):
        _read(m, tmp_path)
    (root / "part-0.parquet").unlink()  # nothing left: this node does not hold the dataset
    with pytest.raises(raying.StorageError, match=rf"{root} is empty on this node \(.*\) "
                                                  r"\(part-.\.parquet not found\)"):
        _read(m, tmp_path)
