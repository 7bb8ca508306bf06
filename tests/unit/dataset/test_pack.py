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


def _captioned(root):
    """write_parquet_set's two files, with the image of id 7 null and the caption column
    stored as large_string in the second file."""
    import pyarrow as pa

    from tests.unit.read.test_stages import write_parquet_set

    root.mkdir()
    write_parquet_set(root, files=((0, 20), (20, 36)))
    t = pq.read_table(root / "part-0.parquet")
    images = t.column("image").to_pylist()
    images[7] = None
    t = t.set_column(t.schema.get_field_index("image"), "image", pa.array(images, pa.binary()))
    pq.write_table(t, root / "part-0.parquet", row_group_size=6)
    t = pq.read_table(root / "part-1.parquet")
    t = t.set_column(t.schema.get_field_index("caption"), "caption",
                     t.column("caption").cast(pa.large_string()))
    pq.write_table(t, root / "part-1.parquet", row_group_size=6)
    return root


@pytest.mark.parametrize("decode_size", [None, 16])
def test_a_shard_of_parquet_rows_carries_their_extra_columns_by_id(tmp_path, decode_size):
    """Rows of several files and row groups, in a shuffled order: each packed row keeps its
    source id, label, location and extra columns (one type across files); a null image is
    set aside and listed."""
    import pyarrow as pa

    src = _captioned(tmp_path / "src")
    m = raying.Manifest.scan(str(src), columns=["caption", "n", "boxes"])
    ids = np.random.default_rng(0).permutation(len(m))[:24]
    out = tmp_path / "out"
    out.mkdir()
    res = pack_shard(m, ids, str(out), StorageOptions(), "part-00000.parquet",
                     decode_size=decode_size, row_group_rows=8, on_error="skip", verify=True)
    kept = [int(i) for i in ids if i != 7]
    assert res["rows"] == len(kept)
    assert [(s["id"], s["reason"]) for s in res["skipped"]] == ([(7, "null_image")]
                                                                if 7 in ids else [])
    t = pq.read_table(out / "part-00000.parquet")
    assert t.column("id").to_pylist() == kept
    assert t.column("label").to_pylist() == [i % 3 for i in kept]
    assert t.schema.field("caption").type == pa.string()
    assert t.column("caption").to_pylist() == [f"sample {i}" for i in kept]
    assert t.column("n").to_pylist() == [i * 10 for i in kept]
    assert t.column("boxes").to_pylist() == [[i + 0.5] * (i % 4) for i in kept]
    assert t.column("path").to_pylist() == m.path_of(np.array(kept))
    if decode_size:
        assert t.schema.field("image").type == pa.binary(decode_size * decode_size * 3)
    else:
        source = {}
        for f in ("part-0", "part-1"):
            s = pq.read_table(src / f"{f}.parquet")
            base = 0 if f == "part-0" else 20
            source.update({base + k: v for k, v in enumerate(s.column("image").to_pylist())})
        assert t.column("image").to_pylist() == [source[i] for i in kept]


def test_rows_of_an_unreadable_parquet_file_are_set_aside_as_read_errors(tmp_path):
    src = _captioned(tmp_path / "src")
    m = raying.Manifest.scan(str(src), columns=["caption"])
    (src / "part-1.parquet").write_bytes(b"PAR1 not parquet any more PAR1")
    out = tmp_path / "out"
    out.mkdir()
    ids = np.array([3, 25, 4, 30])
    res = pack_shard(m, ids, str(out), StorageOptions(), "part-00000.parquet",
                     decode_size=None, row_group_rows=8, on_error="skip", verify=False)
    assert res["rows"] == 2
    assert sorted((s["id"], s["reason"]) for s in res["skipped"]) == [(25, "read_error"),
                                                                     (30, "read_error")]
    t = pq.read_table(out / "part-00000.parquet")
    assert t.column("id").to_pylist() == [3, 4]
    assert t.column("caption").to_pylist() == ["sample 3", "sample 4"]
    with pytest.raises(raying.DataError, match=r"part-1\.parquet#rg0/row5: read_error"):
        pack_shard(m, ids, str(out), StorageOptions(), "part-00001.parquet",
                   decode_size=None, row_group_rows=8, on_error="raise", verify=False)


def test_a_storage_outage_stops_the_shard_instead_of_setting_its_rows_aside(tmp_path,
                                                                           monkeypatch):
    from raying.errors import StorageError
    from raying.storage import files

    root = make_image_folder(tmp_path / "imgs", n=6, classes=2, size=(8, 8))
    m = raying.Manifest.scan(str(root))

    def down(fs, paths, **_):
        err = StorageError("cannot reach the storage")
        err.outage = True
        return [err] * len(paths)

    monkeypatch.setattr(files, "read_many", down)
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(StorageError, match=r"6 of the 6 reads .* could not reach the storage"
                                           r".*run pack again"):
        pack_shard(m, np.arange(6), str(out), StorageOptions(), "part-00000.parquet",
                   decode_size=None, row_group_rows=8, on_error="skip", verify=False)
    assert list(out.iterdir()) == []


def test_a_shard_of_a_stopped_pack_writes_nothing(tmp_path):
    from raying.dataset.pack import STOP_MARKER

    root = make_image_folder(tmp_path / "imgs", n=6, classes=2, size=(8, 8))
    m = raying.Manifest.scan(str(root))
    out = tmp_path / "out"
    out.mkdir()
    (out / STOP_MARKER).write_bytes(b"")
    res = pack_shard(m, np.arange(6), str(out), StorageOptions(), "part-00000.parquet",
                     decode_size=None, row_group_rows=8, on_error="skip", verify=False)
    assert (res["rows"], res["stopped"]) == (0, True)
    assert sorted(p.name for p in out.iterdir()) == [STOP_MARKER]


def test_a_column_carried_under_another_key_is_packed_under_that_key(tmp_path):
    """A source column named as a batch key (its own ``id``) is read by its name and written
    under the key it is carried as; the packed set scans back with that key."""
    import pyarrow as pa

    src = _captioned(tmp_path / "src")
    for f, lo in (("part-0", 0), ("part-1", 20)):
        t = pq.read_table(src / f"{f}.parquet")
        t = t.append_column("id", pa.array([f"img-{lo + k}" for k in range(t.num_rows)]))
        pq.write_table(t, src / f"{f}.parquet", row_group_size=6)
    m = raying.Manifest.scan(str(src), columns={"id": "source_id", "caption": "text"})
    res = _pack_all(m, tmp_path / "out")
    t = pq.read_table(tmp_path / "out" / "part-00000.parquet")
    kept = t.column("id").to_pylist()
    assert res["rows"] == len(kept) == 35 and 7 not in kept  # the null image set aside
    assert t.column("source_id").to_pylist() == [f"img-{i}" for i in kept]
    assert t.column("text").to_pylist() == [f"sample {i}" for i in kept]
    back = raying.Manifest.scan(str(tmp_path / "out"), columns=["source_id", "text"])
    assert back.meta["columns"] == {"source_id": {"kind": "string"}, "text": {"kind": "string"}}


def test_parquet_input_is_shuffled_so_each_shard_reads_only_a_few_row_groups(tmp_path,
                                                                           caplog):
    """pack's order for Parquet input: every id once, random, and each shard's ids within the
    few source row groups it takes (with a fully random order every shard task would read
    every row group of the dataset)."""
    from raying.engine.pack import _local_shuffle

    src = _captioned(tmp_path / "src")  # 36 rows in 7 row groups (6, 6, 6, 2 and 6, 6, 4)
    m = raying.Manifest.scan(str(src))
    groups = {}
    f, g, start, rows = m.row_group_table()
    for k, (a, r) in enumerate(zip(start, rows, strict=True)):
        groups.update({int(i): k for i in range(a, a + r)})
    with caplog.at_level("WARNING", logger="raying.engine.pack"):
        order = _local_shuffle(m, 12, np.random.default_rng(0))
    # Two source groups per shard: a class-sorted source would give shards of few classes.
    assert any("about 2.0 source row groups" in r.getMessage() for r in caplog.records)
    caplog.clear()
    with caplog.at_level("WARNING", logger="raying.engine.pack"):
        _local_shuffle(m, 60, np.random.default_rng(0))  # ten groups per shard: no warning
    assert not caplog.records
    assert sorted(order.tolist()) == list(range(36)) and order.tolist() != list(range(36))
    touched = []
    for a in range(0, 36, 12):
        shard = order[a:a + 12]
        touched.append({groups[int(i)] for i in shard})
        assert shard.tolist() != sorted(shard.tolist())  # shuffled within the shard
    # Runs of whole groups: only a shard boundary splits a group, so the shards touch at
    # most 7 + 2 groups in all (a random order: about 3 x 6).
    assert sum(len(t) for t in touched) <= len(start) + 2, touched
    again = _local_shuffle(m, 12, np.random.default_rng(0))
    other = _local_shuffle(m, 12, np.random.default_rng(1))
    assert np.array_equal(order, again) and not np.array_equal(order, other)


def _pack_all(m, out, name="part-00000.parquet", **kw):
    out.mkdir(exist_ok=True)
    return pack_shard(m, np.arange(len(m)), str(out), StorageOptions(), name,
                      decode_size=None, row_group_rows=8, on_error="skip", verify=False, **kw)


@pytest.mark.parametrize("null_in", [None, "cap", "xs"])
def test_parquet_rows_pack_cannot_carry_are_set_aside_and_null_columns_refused(tmp_path,
                                                                              null_in):
    """A Hugging Face image that only names a file is set aside and listed, the other rows
    packed; a null extra value, or a null inside a
    list (in a file without statistics, which the scan cannot see), stops the pack naming
    the file and column, as the scan and the read paths refuse them."""
    import pyarrow as pa

    from raying.tools.datagen import encode, synth_image

    rng = np.random.default_rng(0)
    jpg = [encode(synth_image(rng, i % 2, 2, 24, 32), "jpg") for i in range(8)]
    cap = ["a", "b", "c", "d", "e", "f", "g", "h"]
    xs = [[1.0], [2.0], [3.0], [4.0], [], [6.0], [7.0], [8.0]]
    if null_in == "cap":
        cap[1] = None
    elif null_in == "xs":
        xs[2] = [3.0, None]
    src = tmp_path / "src"
    src.mkdir()
    pq.write_table(pa.table({
        "image": pa.array([{"bytes": b, "path": None} if i != 5 else
                           {"bytes": None, "path": "elsewhere/5.jpg"}
                           for i, b in enumerate(jpg)],
                          pa.struct([("bytes", pa.binary()), ("path", pa.string())])),
        "label": pa.array([i % 2 for i in range(8)], pa.int64()),
        "cap": pa.array(cap), "xs": pa.array(xs, pa.list_(pa.float32())),
    }), src / "a.parquet", row_group_size=4, write_statistics=False)
    m = raying.Manifest.scan(str(src), columns=["cap", "xs"])
    if null_in is not None:
        with pytest.raises(raying.DataError, match=rf"a\.parquet#rg0/row\d: extra column "
                                                   rf"'{null_in}' has null values.*fill them"):
            _pack_all(m, tmp_path / "out")
        return
    res = _pack_all(m, tmp_path / "out")
    why = {s["id"]: (s["reason"], s["detail"]) for s in res["skipped"]}
    assert sorted(why) == [5], why
    assert why[5][0] == "null_image" and "elsewhere/5.jpg" in why[5][1]
    packed = pq.read_table(tmp_path / "out" / "part-00000.parquet")
    assert packed.column("id").to_pylist() == [0, 1, 2, 3, 4, 6, 7]
    assert packed.column("cap").to_pylist() == ["a", "b", "c", "d", "e", "g", "h"]
    assert packed.column("xs").to_pylist() == [[1.0], [2.0], [3.0], [4.0], [], [7.0], [8.0]]


@pytest.mark.parametrize(("change", "sizes"), [("row_dropped", True), ("last_row_lost", True),
                                               ("last_row_lost", False)])
def test_a_file_rewritten_since_the_scan_never_packs_another_row_under_an_id(tmp_path, sizes,
                                                                             change):
    """Row 1 dropped (the file rewritten in groups of 6 again: the first groups keep their
    row counts but hold other rows), or the last row lost: none of the file's rows is packed
    under a wrong id; the other file's rows are. A manifest that does not know the files'
    sizes (an older one) sets aside the row groups whose rows changed; a group of as many
    rows but other images slips past that check, so only the layout change is asked of it."""
    import pyarrow as pa

    src = _captioned(tmp_path / "src")
    m = raying.Manifest.scan(str(src), columns=["caption"])
    if not sizes:
        del m.meta["file_sizes"]
    t = pq.read_table(src / "part-0.parquet")
    keep = [k != 1 for k in range(20)] if change == "row_dropped" else [k < 19 for k in range(20)]
    pq.write_table(t.filter(pa.array(keep)), src / "part-0.parquet", row_group_size=6)
    res = _pack_all(m, tmp_path / "out")
    packed = pq.read_table(tmp_path / "out" / "part-00000.parquet")
    ids = packed.column("id").to_pylist()
    assert packed.column("caption").to_pylist() == [f"sample {i}" for i in ids]
    why = {s["id"]: s["detail"] for s in res["skipped"]}
    assert set(range(20, 36)) <= set(ids) and not set(ids) & set(why)
    if sizes:
        assert sorted(why) == list(range(20))
        assert "part-0.parquet was rewritten since the scan (" in why[0] and "bytes" in why[0]
    else:  # only the last group (ids 18, 19) changed: ids 0-17 are still theirs
        assert sorted(why) == [7, 18, 19] and ids.count(7) == 0  # (7: its null image)
        assert "(row group 3 has 1 rows of" in why[18]


def test_a_uint64_extra_column_above_int64_stops_pack_naming_file_and_column(tmp_path):
    import pyarrow as pa

    src = _captioned(tmp_path / "src")
    for f in ("part-0", "part-1"):
        t = pq.read_table(src / f"{f}.parquet")
        big = [2**63 + i if f == "part-1" else i for i in range(t.num_rows)]
        pq.write_table(t.append_column("big", pa.array(big, pa.uint64())),
                       src / f"{f}.parquet", row_group_size=6)
    m = raying.Manifest.scan(str(src), columns=["big"])
    with pytest.raises(raying.DataError, match=r"part-1\.parquet: extra column 'big' \(uint64\)"):
        _pack_all(m, tmp_path / "out")


@pytest.mark.parametrize("state", ["missing", "empty"])
def test_a_shard_on_a_node_without_the_local_dataset_stops_the_pack(tmp_path, state):
    """A shard task on a node that lacks the local folder (a cluster's other node) set every
    image aside as unreadable, and the pack succeeded with a part of the dataset."""
    import shutil

    root = str(make_image_folder(str(tmp_path / "src"), n=4, classes=1, size=(32, 32)))
    m = raying.Manifest.scan(root)
    shutil.rmtree(root)
    if state == "empty":
        (tmp_path / "src").mkdir()  # a mount point with nothing mounted
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(raying.StorageError, match=rf"{root} (does not exist|is empty) on this "
                                                  rf"node .*pack on a machine"):
        pack_shard(m, np.arange(4), str(out), StorageOptions(), "part-00000.parquet",
                   decode_size=None, row_group_rows=8, on_error="skip", verify=False)
    assert not list(out.iterdir())
