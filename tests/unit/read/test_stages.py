"""User stages (Pipeline.map_batches) and extra Parquet columns, read in-process (no Ray)."""

from __future__ import annotations

import pickle
import threading

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import raying
from raying.options import IOConfig
from raying.read.stages import stage_rng
from raying.read.task import empty_block, run_unit
from raying.tools.datagen import encode, synth_image

SIZE = 16


def write_parquet_set(root, *, files=((0, 20), (20, 36)), row_group_size=6):
    """Parquet files of real JPEGs with a caption (str), a number (int32) and a
    variable-length float list per row; every value is a function of the row's id."""
    rng = np.random.default_rng(0)
    for f, (lo, hi) in enumerate(files):
        ids = range(lo, hi)
        pq.write_table(pa.table({
            "image": pa.array([encode(synth_image(rng, i % 3, 3, 24, 32), "jpg") for i in ids],
                              pa.binary()),
            "label": pa.array([i % 3 for i in ids], pa.int64()),
            "caption": pa.array([f"sample {i}" for i in ids]),
            "n": pa.array([i * 10 for i in ids], pa.int32()),
            "boxes": pa.array([[i + 0.5] * (i % 4) for i in ids], pa.list_(pa.float32())),
            "tag": pa.array([{"k": i} for i in ids]),
        }), f"{root}/part-{f}.parquet", row_group_size=row_group_size)
    return root


@pytest.fixture(scope="module")
def parquet_set(tmp_path_factory):
    return write_parquet_set(tmp_path_factory.mktemp("pq"))


def read_epoch(pipe, epoch):
    """Every block of ``epoch``, read in this process, concatenated in plan order."""
    blocks = []
    for u in pipe.plan(epoch).units:
        unit, paths = pipe._fill(u)
        blocks.append(run_unit(pipe._spec, unit, paths)[0])
    return {k: np.concatenate([b[k] for b in blocks]) for k in blocks[0]}


def jitter(batch, rng, scale=20):
    shift = rng.integers(-scale, scale + 1, size=(len(batch["id"]), 1, 1, 3))
    batch["image"] = np.clip(batch["image"].astype(np.int16) + shift, 0, 255).astype(np.uint8)
    return batch


def invert(batch):
    batch["image"] = 255 - batch["image"]
    batch["inverted"] = np.ones(len(batch["id"]), dtype=bool)
    return batch


def broken(batch):
    return batch["no such column"]


# -- extra columns: scan -------------------------------------------------------------------------
def test_scan_records_columns_and_they_survive_save_load(parquet_set, tmp_path):
    m = raying.Manifest.scan(str(parquet_set), columns=["caption", "n", "boxes"])
    assert m.meta["columns"] == {"caption": {"kind": "string"},
                                 "n": {"kind": "number", "dtype": "int64"},
                                 "boxes": {"kind": "list", "dtype": "float32"}}
    m.save(str(tmp_path / "m.parquet"))
    back = raying.Manifest.load(str(tmp_path / "m.parquet"))
    assert back.meta["columns"] == m.meta["columns"]
    # Carrying columns changes no id, size or file: the dataset's identity stays.
    assert m.fingerprint() == raying.Manifest.scan(str(parquet_set)).fingerprint()


def test_scan_column_missing_from_one_file_names_file_and_column(tmp_path):
    write_parquet_set(tmp_path)
    t = pq.read_table(tmp_path / "part-1.parquet").drop_columns(["caption"])
    pq.write_table(t, tmp_path / "part-1.parquet")
    with pytest.raises(raying.DataError,
                       match=r"part-1.parquet has no column 'caption' asked for by columns="):
        raying.Manifest.scan(str(tmp_path), columns=["caption"])


@pytest.mark.parametrize(("columns", "error", "pattern"), [
    (["tag"], raying.DataError, r"column 'tag' has type struct<k: int64>, which raying cannot"),
    (["id"], raying.ConfigError, r"names \['id'\], which every batch already has"),
    (["label"], raying.ConfigError, r"names \['label'\], which every batch already has"),
    ("caption", raying.ConfigError,
     r"columns must be a list of column names \(or a dict .*\), got 'caption'"),
])
def test_scan_refuses_columns_it_cannot_carry(parquet_set, columns, error, pattern):
    with pytest.raises(error, match=pattern):
        raying.Manifest.scan(str(parquet_set), columns=columns)


def test_scan_refuses_columns_for_an_image_folder(tmp_path):
    from raying.tools.datagen import make_image_folder

    root = make_image_folder(tmp_path / "imgs", n=3, classes=1, size=(8, 8))
    with pytest.raises(raying.ConfigError, match=r"reads Parquet columns, but .* image folder"):
        raying.Manifest.scan(str(root), columns=["caption"])


def _with_own_ids(root):
    """The Parquet set with columns named as batch keys: the source's own string ``id`` and a
    float ``weight``, both functions of the row."""
    root.mkdir()
    write_parquet_set(root)
    for f, lo in (("part-0", 0), ("part-1", 20)):
        t = pq.read_table(root / f"{f}.parquet")
        n = t.num_rows
        t = t.append_column("id", pa.array([f"img-{lo + k:05d}" for k in range(n)]))
        t = t.append_column("weight", pa.array([(lo + k) / 4 for k in range(n)], pa.float64()))
        pq.write_table(t, root / f"{f}.parquet", row_group_size=6)
    return root


def test_columns_named_as_batch_keys_come_under_keys_of_their_own(tmp_path):
    root = _with_own_ids(tmp_path / "src")
    with pytest.raises(raying.ConfigError,
                       match=r"names \['id', 'weight'\].*columns=\{'id': 'source_id', "
                             r"'weight': 'weight_'\}"):
        raying.Manifest.scan(str(root), columns=["id", "weight"])
    m = raying.Manifest.scan(str(root), columns={"id": "source_id", "weight": "sample_weight",
                                                 "label": "label_raw", "caption": "caption"})
    assert m.meta["columns"] == {
        "source_id": {"kind": "string", "source": "id"},
        "sample_weight": {"kind": "number", "dtype": "float64", "source": "weight"},
        "label_raw": {"kind": "number", "dtype": "int64", "source": "label"},
        "caption": {"kind": "string"}}
    m.save(str(tmp_path / "m.parquet"))
    m = raying.Manifest.load(str(tmp_path / "m.parquet"))
    pipe = raying.Pipeline(m, transform=raying.ImageTransform(size=SIZE),
                           sampler=raying.UniformSampler(seed=3))
    got = read_epoch(pipe, 0)
    ids = got["id"]
    assert ids.dtype == np.int64 and sorted(ids.tolist()) == list(range(36))
    assert got["source_id"].tolist() == [f"img-{i:05d}" for i in ids]
    np.testing.assert_array_equal(got["sample_weight"], ids / 4)
    assert (got["label_raw"] == ids % 3).all() and (got["label"] == ids % 3).all()
    assert got["caption"].tolist() == [f"sample {i}" for i in ids]
    assert got["weight"].dtype == np.float32 and (got["weight"] == 1).all()  # the sampler's
    pipe.close()


@pytest.mark.parametrize(("columns", "pattern"), [
    ({"caption": "id"}, r"names \['id'\], which every batch already has"),
    ({"caption": "c", "n": "c"}, r"gives two columns the same batch key"),
    ({"caption": ""}, r"both non-empty strings"),
    ({"image": "raw"}, r"names .image., the image column"),
    ({"label": "label"}, r"names \['label'\]"),
])
def test_renamed_columns_are_checked(parquet_set, columns, pattern):
    with pytest.raises(raying.ConfigError, match=pattern):
        raying.Manifest.scan(str(parquet_set), columns=columns)


def test_label_column_as_a_plain_extra_column_points_to_a_key_of_its_own(parquet_set):
    with pytest.raises(raying.ConfigError,
                       match=r"carry it as stored under another key: columns=\{'n': 'n_raw'\}"):
        raying.Manifest.scan(str(parquet_set), label="n", columns=["n"])


@pytest.mark.parametrize("fmt", ["images", "parquet"])
def test_each_draw_of_an_id_drawn_again_gets_a_crop_of_its_own(tmp_path, fmt):
    """A class-balanced epoch draws the rare class's images many times: as with torch's
    WeightedRandomSampler, each draw is cropped and flipped on its own (not the same pixels
    every time), and the epoch is still the same when read again."""
    from raying.tools.datagen import make_image_folder

    root = make_image_folder(tmp_path / "imgs", n=60, classes=2, size=(40, 48), seed=1)
    for p in sorted((root / "class_01").iterdir())[3:]:
        p.unlink()  # 3 rare images beside 30 others
    m = raying.Manifest.scan(str(root))
    if fmt == "parquet":
        from raying.dataset.pack import pack_shard
        from raying.options import StorageOptions

        (tmp_path / "pq").mkdir()
        pack_shard(m, np.arange(len(m)), str(tmp_path / "pq"), StorageOptions(),
                   "part-00000.parquet", decode_size=None, row_group_rows=8, on_error="raise",
                   verify=False)
        m = raying.Manifest.scan(str(tmp_path / "pq"), label="label")

    def epoch():
        pipe = raying.Pipeline(m, transform=raying.ImageTransform(size=SIZE, random_crop=True,
                                                                  flip=True),
                               sampler=raying.WeightedSampler(class_balanced=True, seed=2,
                                                              samples_per_epoch=120),
                               config=raying.PipelineConfig(block_rows=16))
        got = read_epoch(pipe, 0)
        pipe.close()
        return got

    got = epoch()
    rare = [i for i in np.unique(got["id"]) if m.labels[i] == 1]
    assert len(rare) == 3
    for i in rare:
        rows = got["image"][got["id"] == i]
        assert len(rows) >= 10  # about 120 / 2 / 3 draws each
        distinct = {r.tobytes() for r in rows}
        assert len(distinct) >= len(rows) - 1, (i, len(rows), len(distinct))
    again = epoch()
    np.testing.assert_array_equal(again["id"], got["id"])
    np.testing.assert_array_equal(again["image"], got["image"])


# -- extra columns: read -------------------------------------------------------------------------
def test_extra_columns_arrive_aligned_with_ids(parquet_set):
    m = raying.Manifest.scan(str(parquet_set), columns=["caption", "n", "boxes"])
    pipe = raying.Pipeline(m, transform=raying.ImageTransform(size=SIZE),
                           sampler=raying.UniformSampler(seed=3))
    got = read_epoch(pipe, 0)
    ids = got["id"]
    assert sorted(ids.tolist()) == list(range(36))
    assert not (np.diff(ids) > 0).all()  # shuffled: alignment is not an accident of order
    assert got["caption"].tolist() == [f"sample {i}" for i in ids]
    assert got["n"].dtype == np.int64 and (got["n"] == ids * 10).all()
    assert got["boxes"].dtype == object
    for i, row in zip(ids, got["boxes"], strict=True):
        assert row.dtype == np.float32
        np.testing.assert_array_equal(row, np.full(i % 4, i + 0.5, np.float32))
    pipe.close()


@pytest.mark.parametrize("io", [False, True])
@pytest.mark.parametrize(("change", "sizes"), [
    ("regrouped", True), ("cut", True), ("fewer_groups", True), ("row_dropped", True),
    ("regrouped", False), ("cut", False), ("fewer_groups", False)])
def test_a_parquet_file_rewritten_since_the_scan_stops_the_read_naming_it(tmp_path, io,
                                                                           sizes, change):
    """Rows of a file rewritten since the scan would come under other ids (row 11's pixels
    as id 17): the read stops, naming the file and the fix, whatever on_error says. A
    manifest that knows the files' sizes (``sizes``) finds any change of size; one that does
    not (an older manifest) finds row groups whose rows differ (a group of as many rows but
    other images slips past it)."""
    root = tmp_path / "src"
    root.mkdir()
    write_parquet_set(root)
    m = raying.Manifest.scan(str(root), columns=["caption"])
    assert len(m.meta["file_sizes"]) == 2
    if not sizes:
        del m.meta["file_sizes"]
    t = pq.read_table(root / "part-0.parquet")  # 20 rows in row groups of 6, 6, 6, 2
    if change == "regrouped":  # the same rows, groups of 5
        pq.write_table(t, root / "part-0.parquet", row_group_size=5)
    elif change == "row_dropped":  # row 1 gone: groups of 6, 6, 6, 1 (other rows in each)
        pq.write_table(t.filter(pa.array([k != 1 for k in range(t.num_rows)])),
                       root / "part-0.parquet", row_group_size=6)
    elif change == "cut":  # 10 rows left: groups of 6 and 4
        pq.write_table(t.slice(0, 10), root / "part-0.parquet", row_group_size=6)
    else:  # 12 rows: two of the four groups
        pq.write_table(t.slice(0, 12), root / "part-0.parquet", row_group_size=6)
    config = raying.PipelineConfig(io=IOConfig(cache=None)) if io else None
    if sizes:
        pattern = (r"part-0\.parquet was rewritten since the manifest was scanned \(\d+ bytes, "
                   r"the scan found \d+\); its rows would come under other ids: scan the "
                   r"dataset again")
    else:
        pattern = (r"part-0\.parquet( was rewritten since the manifest was scanned: row groups "
                   r"\d+ \(\d+ rows of \d+ image bytes each, the scan found \d+ of \d+\)|"
                   r": cannot read row groups .*changed since the manifest was scanned: "
                   r"rescan it)")
    for on_error in ("skip", "raise"):
        pipe = raying.Pipeline(m, transform=raying.ImageTransform(size=SIZE),
                               sampler=raying.UniformSampler(seed=3), on_error=on_error,
                               config=config)
        with pytest.raises(raying.DataError, match=pattern):
            read_epoch(pipe, 0)
        pipe.close()


def _reorder_in_place(path, *, later_s=10):
    """Rows reversed within each row group of an uncompressed file: the same size, the same
    rows per group, other rows under each position; modified ``later_s`` seconds on."""
    import os

    pf = pq.ParquetFile(path)
    groups = [pf.read_row_group(g) for g in range(pf.num_row_groups)]
    rows = pf.metadata.row_group(0).num_rows
    mtime = os.stat(path).st_mtime
    table = pa.concat_tables([t.take(pa.array(range(t.num_rows - 1, -1, -1))) for t in groups])
    pq.write_table(table, path, row_group_size=rows, compression="none")
    os.utime(path, (mtime + later_s, mtime + later_s))


@pytest.mark.parametrize("io", [False, True])
def test_a_rewrite_of_the_same_size_is_found_by_its_modification_time(tmp_path, io):
    root = tmp_path / "src"
    root.mkdir()
    write_parquet_set(root)
    for f in ("part-0", "part-1"):  # uncompressed, as raying pack writes
        pq.write_table(pq.read_table(root / f"{f}.parquet"), root / f"{f}.parquet",
                       row_group_size=6, compression="none")
    m = raying.Manifest.scan(str(root), columns=["caption"])
    size = (root / "part-1.parquet").stat().st_size
    _reorder_in_place(root / "part-1.parquet")
    assert (root / "part-1.parquet").stat().st_size == size
    config = raying.PipelineConfig(io=IOConfig(cache=None)) if io else None
    # A local dataset scanned on another machine (each node reading its own copy, of its
    # own times) is not judged by the times.
    elsewhere = raying.Manifest.scan(str(root), columns=["caption"])
    elsewhere.meta["file_mtimes"] = m.meta["file_mtimes"]
    elsewhere.meta["scanned_on"] = "another-node"
    pipe = raying.Pipeline(elsewhere, transform=raying.ImageTransform(size=SIZE),
                           sampler=raying.UniformSampler(seed=3), config=config)
    assert sum(len(run_unit(pipe._ready_spec(), *pipe._fill(u))[0]["id"])
               for u in pipe.plan(0).units) == 36
    pipe.close()
    pipe = raying.Pipeline(m, transform=raying.ImageTransform(size=SIZE),
                           sampler=raying.UniformSampler(seed=3), config=config)
    with pytest.raises(raying.FileChangedError,
                       match=r"part-1\.parquet was rewritten since the manifest was scanned "
                             r"\(modified at \d+, the scan found \d+ .*with as many bytes: "
                             r"rewritten, or touched or copied over\)"):
        [run_unit(pipe._ready_spec(), *pipe._fill(u)) for u in pipe.plan(0).units]
    pipe.close()
    again = raying.Manifest.scan(str(root), columns=["caption"])  # the fix the error names
    pipe = raying.Pipeline(again, transform=raying.ImageTransform(size=SIZE),
                           sampler=raying.UniformSampler(seed=3), config=config)
    blocks = [run_unit(pipe._ready_spec(), *pipe._fill(u))[0] for u in pipe.plan(0).units]
    got = {k: np.concatenate([b[k] for b in blocks]) for k in blocks[0]}
    pipe.close()
    rows = pa.concat_tables([pq.read_table(root / "part-0.parquet"),
                             pq.read_table(root / "part-1.parquet")])
    truth = rows.column("caption").to_pylist()  # row k of the files is id k now
    assert got["caption"].tolist() == [truth[i] for i in got["id"]]


def test_row_groups_kept_for_a_unit_are_not_served_to_the_scan_of_a_rewritten_file(tmp_path):
    """A worker keeps a unit's row groups for a few seconds (for the unit's next slices): a
    pipeline over a new scan of a rewritten file, reading the same unit at once, reads the
    new rows, not the kept ones."""
    root = tmp_path / "src"
    root.mkdir()
    write_parquet_set(root, files=((0, 36),))

    def read(m):
        pipe = raying.Pipeline(m, transform=raying.ImageTransform(size=SIZE),
                               sampler=raying.UniformSampler(seed=3))
        blocks = [run_unit(pipe._ready_spec(), *pipe._fill(u))[0] for u in pipe.plan(0).units]
        pipe.close()
        return {k: np.concatenate([b[k] for b in blocks]) for k in blocks[0]}

    from raying.read import parquet

    first = read(raying.Manifest.scan(str(root), columns=["caption"]))
    t = pq.read_table(root / "part-0.parquet")  # the rows in reverse: other images per id
    pq.write_table(t.take(pa.array(range(t.num_rows - 1, -1, -1))), root / "part-0.parquet",
                   row_group_size=6)
    again = raying.Manifest.scan(str(root), columns=["caption"])
    second = read(again)
    with parquet._UNIT_GROUPS_LOCK:
        parquet._UNIT_GROUPS["unit"], parquet._UNIT_GROUPS["tables"] = None, {}
    fresh = read(again)  # nothing kept
    assert first["caption"].tolist() == [f"sample {i}" for i in first["id"]]
    assert second["caption"].tolist() == [f"sample {35 - i}" for i in second["id"]]
    np.testing.assert_array_equal(second["image"], fresh["image"])
    assert not np.array_equal(second["image"], first["image"])


def test_a_scan_after_a_rewrite_reads_the_new_files_not_the_footers_kept_from_before(
        tmp_path):
    """The planned path keeps each file's footer once read. The same rows written again with
    another codec keep the manifest's fingerprint (rows, image bytes per row, names) but not
    the file's bytes: a new scan's pipeline reads the new footers, and the same pixels."""
    root = tmp_path / "src"
    root.mkdir()
    write_parquet_set(root)
    config = raying.PipelineConfig(io=IOConfig(cache=None))

    def read(m):  # as the pipeline's read tasks do, with the spec it ships them
        pipe = raying.Pipeline(m, transform=raying.ImageTransform(size=SIZE),
                               sampler=raying.UniformSampler(seed=3), config=config)
        blocks = [run_unit(pipe._ready_spec(), *pipe._fill(u))[0] for u in pipe.plan(0).units]
        pipe.close()
        return {k: np.concatenate([b[k] for b in blocks]) for k in blocks[0]}

    before = read(raying.Manifest.scan(str(root)))
    for f in ("part-0", "part-1"):
        t = pq.read_table(root / f"{f}.parquet")
        pq.write_table(t, root / f"{f}.parquet", row_group_size=6, compression="zstd")
    again = raying.Manifest.scan(str(root))
    after = read(again)
    np.testing.assert_array_equal(before["id"], after["id"])
    np.testing.assert_array_equal(before["image"], after["image"])


@pytest.mark.parametrize("statistics", [True, False])
def test_extra_column_nulls_stop_the_scan_or_the_read_naming_file_and_column(tmp_path,
                                                                             statistics):
    """Nulls in a flat extra column stop the scan where the footer counts them, else the
    read (a file written without statistics)."""
    write_parquet_set(tmp_path, files=((0, 6), (6, 12)))
    t = pq.read_table(tmp_path / "part-1.parquet")
    t = t.set_column(t.schema.get_field_index("caption"), "caption",
                     pa.array(["a", None, "c", "d", "e", "f"]))
    pq.write_table(t, tmp_path / "part-1.parquet", write_statistics=statistics)
    error = r"part-1\.parquet: extra column 'caption' has 1 null values.*fill them"
    if statistics:
        with pytest.raises(raying.DataError, match=error):
            raying.Manifest.scan(str(tmp_path), columns=["caption"])
        return
    pipe = raying.Pipeline(raying.Manifest.scan(str(tmp_path), columns=["caption"]),
                           transform=raying.ImageTransform(size=SIZE))
    with pytest.raises(raying.DataError, match=error):
        read_epoch(pipe, 0)


def test_extra_column_nulls_name_the_file_and_nulls_inside_lists_stop_the_read(tmp_path):
    write_parquet_set(tmp_path, files=((0, 6), (6, 12)))
    t = pq.read_table(tmp_path / "part-1.parquet")
    t = t.set_column(t.schema.get_field_index("boxes"), "boxes",
                     pa.array([[1.0], [2.0, None], [], [3.0], [4.0], [5.0]], pa.list_(pa.float32())))
    pq.write_table(t, tmp_path / "part-1.parquet")
    pipe = raying.Pipeline(raying.Manifest.scan(str(tmp_path), columns=["boxes"]),
                           transform=raying.ImageTransform(size=SIZE))
    with pytest.raises(raying.DataError, match=r"part-1\.parquet: extra column 'boxes' has 1 "
                                               r"null values inside its lists"):
        read_epoch(pipe, 0)


def scale_boxes(batch):
    for row in batch["boxes"]:  # in place, as the guide lets a stage change values
        row *= 2
    batch["n"] += 1
    return batch


def test_a_stage_changes_every_extra_column_in_place_list_rows_too(parquet_set):
    m = raying.Manifest.scan(str(parquet_set), columns=["boxes", "n"])
    pipe = raying.Pipeline(m, transform=raying.ImageTransform(size=SIZE)).map_batches(scale_boxes)
    got = read_epoch(pipe, 0)
    for i, row, n in zip(got["id"], got["boxes"], got["n"], strict=True):
        np.testing.assert_array_equal(row, np.full(i % 4, 2 * (i + 0.5), np.float32))
        assert n == i * 10 + 1


def test_extra_column_stored_as_int32_in_one_file_and_int64_in_another(tmp_path):
    write_parquet_set(tmp_path, files=((0, 10), (10, 20)), row_group_size=4)
    for f, typ in ((0, pa.int32()), (1, pa.int64())):
        t = pq.read_table(tmp_path / f"part-{f}.parquet")
        t = t.set_column(t.schema.get_field_index("n"), "n", t.column("n").cast(typ))
        t = t.set_column(t.schema.get_field_index("caption"), "caption",
                         t.column("caption").cast(pa.large_string() if f else pa.string()))
        pq.write_table(t, tmp_path / f"part-{f}.parquet", row_group_size=4)
    m = raying.Manifest.scan(str(tmp_path), columns=["n", "caption"])
    pipe = raying.Pipeline(m, transform=raying.ImageTransform(size=SIZE),
                           sampler=raying.UniformSampler(seed=1), config=raying.PipelineConfig(
                               block_rows=20))  # one unit spans both files
    got = read_epoch(pipe, 0)
    assert sorted(got["id"].tolist()) == list(range(20))
    assert got["n"].dtype == np.int64 and (got["n"] == got["id"] * 10).all()
    assert got["caption"].tolist() == [f"sample {i}" for i in got["id"]]
    pipe.close()


@pytest.mark.parametrize(("types", "ok"), [
    ((pa.float16(), pa.float32()), True),
    ((pa.float32(), pa.float64()), False),
    ((pa.list_(pa.float32()), pa.list_(pa.float64())), False),
])
def test_extra_column_float_widths_across_files(tmp_path, types, ok):
    """float16 and float32 are carried alike (float32); float32 beside float64 (or lists of
    them) is a schema mismatch naming both files, as the docs say."""
    write_parquet_set(tmp_path, files=((0, 6), (6, 12)))
    for f, typ in enumerate(types):
        t = pq.read_table(tmp_path / f"part-{f}.parquet")
        col = t.column("boxes") if pa.types.is_list(typ) else pa.array(
            [i + 0.5 for i in range(6 * f, 6 * f + 6)])
        t = t.append_column("x", col.cast(typ))
        pq.write_table(t, tmp_path / f"part-{f}.parquet")
    if not ok:
        with pytest.raises(raying.DataError, match=r"schema mismatch in column 'x': "
                                                   r".*part-1\.parquet.*part-0\.parquet"):
            raying.Manifest.scan(str(tmp_path), columns=["x"])
        return
    pipe = raying.Pipeline(raying.Manifest.scan(str(tmp_path), columns=["x"]),
                           transform=raying.ImageTransform(size=SIZE))
    got = read_epoch(pipe, 0)
    assert got["x"].dtype == np.float32
    np.testing.assert_array_equal(got["x"], got["id"] + 0.5)
    pipe.close()


def test_uint64_column_above_int64_stops_the_read_instead_of_wrapping(tmp_path):
    write_parquet_set(tmp_path, files=((0, 6),))
    t = pq.read_table(tmp_path / "part-0.parquet")
    t = t.append_column("big", pa.array([2**63 + i for i in range(6)], pa.uint64()))
    t = t.append_column("small", pa.array(range(6), pa.uint64()))
    pq.write_table(t, tmp_path / "part-0.parquet")
    ok = raying.Pipeline(raying.Manifest.scan(str(tmp_path), columns=["small"]),
                         transform=raying.ImageTransform(size=SIZE))
    got = read_epoch(ok, 0)
    assert (got["small"] == got["id"]).all()
    pipe = raying.Pipeline(raying.Manifest.scan(str(tmp_path), columns=["big"]),
                           transform=raying.ImageTransform(size=SIZE))
    with pytest.raises(raying.DataError, match=r"'big' \(uint64\) holds 92233720368547758\d\d, "
                                               r"above int64's range"):
        read_epoch(pipe, 0)


def test_empty_block_has_the_extra_columns():
    block = empty_block(8, (("caption", {"kind": "string"}),
                            ("xy", {"kind": "array", "dtype": "float32", "width": 2})))
    assert block["caption"].dtype == object and block["caption"].shape == (0,)
    assert block["xy"].shape == (0, 2) and block["xy"].dtype == np.float32
    assert block["image"].shape == (0, 8, 8, 3)


# -- user stages ---------------------------------------------------------------------------------
def test_chained_stages_run_in_order_and_leave_the_original_pipeline(parquet_set):
    m = raying.Manifest.scan(str(parquet_set))
    base = raying.Pipeline(m, transform=raying.ImageTransform(size=SIZE),
                           sampler=raying.UniformSampler(seed=1))
    staged = base.map_batches(jitter, with_rng=True).map_batches(invert)
    plain = read_epoch(base, 0)
    assert "inverted" not in plain  # the original pipeline is unchanged
    got = read_epoch(staged, 0)
    assert got["inverted"].all()
    np.testing.assert_array_equal(got["id"], plain["id"])
    # invert ran after jitter: undoing it gives the jittered pixels, a bounded shift of the
    # plain ones, the same shift for every pixel of a channel where nothing clipped.
    diff = (255 - got["image"]).astype(np.int16) - plain["image"]
    assert np.abs(diff).max() <= 20 and np.abs(diff).max() > 0
    staged.close()
    base.close()


def test_with_rng_same_seed_and_epoch_same_pixels_other_epoch_other(parquet_set):
    m = raying.Manifest.scan(str(parquet_set))

    def staged(seed):
        return raying.Pipeline(m, transform=raying.ImageTransform(size=SIZE, random_crop=False,
                                                                  flip=False),
                               sampler=raying.UniformSampler(seed=seed)).map_batches(
            jitter, with_rng=True, fn_kwargs={"scale": 40})

    a0, b0 = read_epoch(staged(5), 0), read_epoch(staged(5), 0)
    np.testing.assert_array_equal(a0["image"], b0["image"])
    a1 = read_epoch(staged(5), 1)
    order0, order1 = np.argsort(a0["id"]), np.argsort(a1["id"])
    # Without random crop or flip, the only epoch-to-epoch change is the stage's draws.
    assert not np.array_equal(a0["image"][order0], a1["image"][order1])


def test_stage_rng_depends_on_seed_epoch_stage_and_ids_only():
    ids = np.array([4, 9, 2])
    draw = lambda *a: stage_rng(*a).integers(1 << 30, size=4).tolist()  # noqa: E731
    assert draw(1, 2, 0, ids) == draw(1, 2, 0, ids.copy())
    assert len({tuple(draw(1, 2, 0, ids)), tuple(draw(1, 3, 0, ids)),
                tuple(draw(2, 2, 0, ids)), tuple(draw(1, 2, 1, ids)),
                tuple(draw(1, 2, 0, ids[::-1].copy()))}) == 5


def test_a_raising_stage_names_itself_epoch_ids_and_traceback_even_under_skip(parquet_set):
    m = raying.Manifest.scan(str(parquet_set))
    pipe = raying.Pipeline(m, transform=raying.ImageTransform(size=SIZE), on_error="skip",
                           sampler=raying.UniformSampler(seed=0)).map_batches(broken)
    first = pipe.plan(2).units[0]
    unit, paths = pipe._fill(first)
    # The ids of the call's rows, every one (the unit's first chunk of 16): none left out.
    ids = ", ".join(str(i) for i in unit.ids[:16])
    with pytest.raises(raying.UserFunctionError,
                       match=rf"map_batches function .*broken raised KeyError: 'no such column' "
                             rf"\(epoch 2, ids \[{ids}\]\)") as info:
        run_unit(pipe._spec, unit, paths)
    err = info.value
    assert err.function.endswith("broken") and err.epoch == 2
    assert 'return batch["no such column"]' in str(err)  # the user's line, in the message
    assert isinstance(err.__cause__, KeyError)
    back = pickle.loads(pickle.dumps(err))  # as it travels from a Ray worker
    assert str(back) == str(err) and back.ids == err.ids


@pytest.mark.parametrize(("fn", "pattern"), [
    (lambda b: None, r"returned NoneType; expected the batch"),
    (lambda b: {**b, "id": b["id"][::-1]}, r"changed or dropped the 'id' column"),
    (lambda b: {k: v[:-1] for k, v in b.items()}, r"changed or dropped the 'id' column"),
    (lambda b: {**b, 1: np.zeros(len(b["id"]))}, r"returned the column key 1 \(int\); name "
                                                 r"columns by strings"),
    (lambda b: {**b, "extra": np.zeros(3)}, r"returned column 'extra' with 3 rows; expected"),
    (lambda b: {**b, "image": b["image"] / 255.0},
     r"returned float64 \(\d+, 16, 16, 3\); expected 'image' as uint8"),
    (lambda b: {**b, "id": b["id"].astype(np.float64)},
     r"returned the 'id' column as float64; keep the ids as they came \(int64\)"),
    (lambda b: {k: v for k, v in b.items() if k != "label"}, r"dropped the 'label' column"),
    (lambda b: {**b, "label": b["label"].astype(str)},
     r"returned the 'label' column as <U\d+; expected numbers"),
    (lambda b: {**b, "weight": b["weight"][:, None]},
     r"returned the 'weight' column as float32 \(\d+, 1\); expected float32 \(\d+,\)"),
    (lambda b: {k: v for k, v in b.items() if k != "prob"}, r"dropped the 'prob' column"),
    (lambda b: {**b, "weight": np.where(b["id"] % 2 == 1, np.nan, 1.0)},
     r"returned 'weight' values \[nan.*must be finite and >= 0"),
    (lambda b: {**b, "weight": -b["weight"]}, r"returned 'weight' values \[-1.0"),
    # Ragged rows, which numpy cannot make an array of, in the columns checked by name.
    (lambda b: {**b, "label": [[0] * (k % 3 + 1) for k in range(len(b["id"]))]},
     r"returned column 'label' as list, which is not an array"),
    (lambda b: {**b, "weight": [[1.0] * (k % 3 + 1) for k in range(len(b["id"]))]},
     r"returned column 'weight' as list, which is not an array"),
    # A column whose dtype or row shape depends on the call (a chunk of 16 rows, then the
    # unit's short rest): numpy would merge int64 into float64, or fail in its own words.
    (lambda b: {**b, "v": b["id"].astype(np.float32 if len(b["id"]) == 16 else np.int64)},
     r"returned column 'v' as int64 of row shape \(\) for some rows and float32 of row "
     r"shape \(\) for others"),
    (lambda b: {**b, "pair": np.zeros((len(b["id"]), len(b["id"])), np.float32)},
     r"returned column 'pair' as float32 of row shape \(\d+,\) for some rows and float32 of "
     r"row shape \(16,\) for others"),
])
def test_a_stage_that_breaks_the_batch_is_named(parquet_set, fn, pattern):
    m = raying.Manifest.scan(str(parquet_set))
    pipe = raying.Pipeline(m, transform=raying.ImageTransform(size=SIZE)).map_batches(fn)
    with pytest.raises(raying.UserFunctionError, match=r"map_batches function .*<lambda> "
                                                        + pattern):
        read_epoch(pipe, 0)


def test_an_error_names_every_id_a_stage_call_can_see():
    from raying.errors import IDS_SHOWN
    from raying.read.stages import DEFAULT_STAGE_ROWS

    assert IDS_SHOWN >= DEFAULT_STAGE_ROWS


IDS_SHOWN_ROWS = 16


def test_an_error_says_ids_were_left_out_only_when_they_were():
    import pickle

    full = raying.UserFunctionError("f", 2, np.arange(IDS_SHOWN_ROWS), "raised E: x")
    assert str(full) == f"map_batches function f raised E: x (epoch 2, ids {list(range(16))})"
    more = raying.UserFunctionError("f", 2, np.arange(40), "raised E: x")
    assert more.ids == list(range(16)) and more.rows == 40
    assert str(more).endswith(f"ids {list(range(16))}... of 40 rows)")
    again = pickle.loads(pickle.dumps(more))  # as it travels from a read task
    assert str(again) == str(more) and again.rows == 40


def test_layouts_of_joined_parts_differ_only_in_rows_or_string_width():
    from raying.read.stages import layout_mismatch

    a = {"s": np.array(["a", "bb"]), "x": np.zeros((2, 3), np.float32), "o": np.empty(2, object)}
    b = {"s": np.array(["ccc"]), "x": np.zeros((1, 3), np.float32), "o": np.empty(1, object)}
    assert layout_mismatch([a, b]) is None
    assert layout_mismatch([a, {**b, "x": np.zeros((1, 4), np.float32)}])[0] == 1
    assert layout_mismatch([a, b, {**b, "x": np.zeros((1, 3), np.float64)}])[0] == 2
    assert layout_mismatch([a, {**b, "s": np.array([b"x"])}]) is not None


def test_blocks_columns_are_compared_by_name_dtype_and_row_shape():
    from raying.read.stages import column_template, columns_problem

    first = column_template({"id": np.arange(3), "s": np.array(["a", "bb", "c"]),
                             "x": np.zeros((3, 2), np.float32)})
    assert all(len(v) == 0 for v in first.values())
    same = {"id": np.arange(2), "s": np.array(["ccc", "d"]), "x": np.ones((2, 2), np.float32)}
    assert columns_problem(first, same) is None
    assert "for some blocks and" in columns_problem(first, {**same, "y": np.arange(2)})
    assert "'x' as float64" in columns_problem(first, {**same, "x": np.ones((2, 2))})
    assert "row shape (3,)" in columns_problem(first, {**same, "x": np.ones((2, 3), np.float32)})


def test_a_partial_is_named_by_the_function_it_wraps():
    import functools

    from raying.read.stages import UserStage

    name = UserStage(functools.partial(invert)).name
    assert name.startswith("functools.partial(") and "invert" in name


def test_fixed_width_strings_a_stage_adds_come_as_objects_as_on_the_dataset_path():
    """numpy <U / |S columns leave the stages as object arrays of str / bytes: the dataset
    path's Arrow strings come back so, and the iterator path kept the fixed width."""
    from raying.read import stages as st

    def add(batch):
        batch["name"] = np.array([f"s{i}" for i in batch["id"]])
        batch["key"] = np.array([b"k%d" % i for i in batch["id"]])
        return batch

    block = {"id": np.arange(3), "label": np.zeros(3, np.int64),
             "weight": np.ones(3, np.float32), "prob": np.ones(3),
             "image": np.zeros((3, 4, 4, 3), np.uint8)}
    out = st.run_chunk((st.UserStage(add),), block, seed=0, epoch=0, size=4)
    assert out["name"].dtype == object and list(out["name"]) == ["s0", "s1", "s2"]
    assert out["key"].dtype == object and list(out["key"]) == [b"k0", b"k1", b"k2"]


def test_stages_that_cannot_be_loaded_where_they_arrive_say_so_when_called():
    """A spec's stages travel with their functions as bytes of their own: where those cannot
    be loaded (a module missing there), the stages still unpickle, and calls fail by name."""
    import pickle

    from raying.read import stages as st

    weights = np.arange(1000, dtype=np.float32)
    chain = st.StageChain([st.UserStage(invert), st.UserStage(jitter, with_rng=True,
                                                               fn_kwargs=(("w", weights),))])
    back = pickle.loads(pickle.dumps(chain))
    assert isinstance(back, st.StageChain) and [s.name for s in back] == [s.name for s in chain]
    assert back[0].fn is invert and back[1].with_rng
    np.testing.assert_array_equal(dict(back[1].fn_kwargs)["w"], weights)
    # The functions' module renamed to one no process has (same length: the pickle stays
    # valid), as a node without the user's module sees it.
    module = invert.__module__
    payload = st._dumps([invert, jitter]).replace(
        module.encode(), b"no_such_module_here"[:len(module)].ljust(len(module), b"_"))
    broken = st._shipped_chain(tuple(s.name for s in chain), (False, True),
                               ((), (("w", weights),)), payload)
    assert [s.name for s in broken] == [s.name for s in chain]
    block = {"id": np.arange(2), "label": np.zeros(2, np.int64),
             "weight": np.ones(2, np.float32), "prob": np.ones(2),
             "image": np.zeros((2, 4, 4, 3), np.uint8)}
    with pytest.raises(raying.UserFunctionError,
                       match=r"function .*invert cannot be loaded in the read worker \(with "
                             r"the pipeline's other map_batches functions\) "
                             r"\(ModuleNotFoundError: No module named 'no_such_module_h.*"
                             r"\(epoch 2, ids \[0, 1\]") as info:
        st.run_chunk(tuple(broken), block, seed=0, epoch=2, size=4)
    assert "ModuleNotFoundError" in info.value.traceback_text


def test_a_chains_functions_from_the_drivers_script_share_its_globals():
    """Two stages of the driver's script (module __main__), pickled together, share one
    globals dict where they arrive, as in the driver: one may leave state for the next."""
    import pickle

    from raying.read import stages as st

    namespace: dict = {"__name__": "__main__"}
    exec("SEEN = []\n"
         "def first(batch):\n    SEEN.append(1)\n    return batch\n"
         "def second(batch):\n    batch['seen'] = np.full(len(batch['id']), len(SEEN))\n"
         "    return batch\n", {**namespace, "np": np}, namespace)
    chain = st.StageChain([st.UserStage(namespace["first"]), st.UserStage(namespace["second"])])
    back = pickle.loads(pickle.dumps(chain))
    assert back[0].fn.__globals__ is back[1].fn.__globals__
    assert back[0].fn.__globals__ is not namespace


def test_map_batches_refuses_what_it_cannot_run(parquet_set):
    m = raying.Manifest.scan(str(parquet_set))
    pipe = raying.Pipeline(m, transform=raying.ImageTransform(size=SIZE))
    with pytest.raises(raying.ConfigError, match=r"needs a function of the batch dict, got int"):
        pipe.map_batches(3)
    lock = threading.Lock()
    with pytest.raises(raying.ConfigError, match=r"cannot be pickled"):
        pipe.map_batches(lambda b: b if lock else b)
    import ctypes  # pickling a pointer raises ValueError, not a PicklingError

    pointer = ctypes.pointer(ctypes.c_int(1))
    with pytest.raises(raying.ConfigError, match=r"cannot be pickled \(ValueError: ctypes"):
        pipe.map_batches(lambda b: b if pointer else b)
    with pytest.raises(raying.ConfigError, match=r"fn_kwargs has 'rng'"):
        pipe.map_batches(jitter, with_rng=True, fn_kwargs={"rng": 1})
    # A call the read tasks would make and the function does not take fails here, before
    # any read: rng= where there is no rng parameter, none where one is required, a missing
    # or unknown fn_kwargs key.
    with pytest.raises(raying.ConfigError, match=r"call fn\(batch, rng=...\), which "
                                                 r"invert\(batch\) does not take.*add an "
                                                 r"rng parameter"):
        pipe.map_batches(invert, with_rng=True)
    with pytest.raises(raying.ConfigError, match=r"pass with_rng=True to get rng="):
        pipe.map_batches(jitter)
    with pytest.raises(raying.ConfigError, match=r"unexpected keyword argument 'scale'"):
        pipe.map_batches(invert, fn_kwargs={"scale": 2})
    with pytest.raises(raying.ConfigError, match=r"fn_kwargs must be a dict .* got list \[1\]"):
        pipe.map_batches(invert, fn_kwargs=[1])
    pipe.map_batches(lambda batch, **kw: batch, with_rng=True, fn_kwargs={"scale": 2})
    pipe.plan(0)  # started: binding the sampler twice would be ambiguous
    with pytest.raises(raying.ConfigError, match=r"map_batches on Pipeline .* after it started"):
        pipe.map_batches(invert)


def test_torch_converter_keeps_strings_as_lists_and_ragged_rows_as_tensors():
    torch = pytest.importorskip("torch")
    from raying.loader.batches import TorchConverter

    boxes = np.empty(2, dtype=object)
    boxes[0], boxes[1] = np.array([1.5, 2.5], np.float32), np.zeros(0, np.float32)
    batch = {"id": np.array([3, 4]), "image": np.zeros((2, 4, 4, 3), np.uint8),
             "caption": np.array(["a", "b"], dtype=object), "n": np.array([7, 8]),
             "boxes": boxes}
    conv = TorchConverter("cpu", normalize=False)
    out = conv.device_put(conv.host(batch))
    assert out["caption"] == ["a", "b"]
    assert out["n"].dtype == torch.int64 and out["n"].tolist() == [7, 8]
    assert [t.tolist() for t in out["boxes"]] == [[1.5, 2.5], []]
    assert out["boxes"][0].dtype == torch.float32


@pytest.mark.parametrize("io", [None, "planned"])
def test_columns_and_stages_on_the_planned_path_and_a_resumed_unit(parquet_set, tmp_path, io):
    from raying.options import CacheConfig, IOConfig

    config = raying.PipelineConfig(io=IOConfig(cache=CacheConfig(
        memory_bytes=10**7, memory_dir=str(tmp_path / "mem"))) if io else None)
    m = raying.Manifest.scan(str(parquet_set), columns=["caption", "boxes"])
    pipe = raying.Pipeline(m, transform=raying.ImageTransform(size=SIZE), config=config,
                           sampler=raying.UniformSampler(seed=2)).map_batches(jitter,
                                                                               with_rng=True)
    unit, paths = pipe._fill(pipe.plan(0).units[0])
    whole, _ = run_unit(pipe._spec, unit, paths)
    assert whole["caption"].tolist() == [f"sample {i}" for i in whole["id"]]
    # A unit re-run to resume after its first 5 rows gives the rest of the same pixels: the
    # stage drew for the whole block before the rows were dropped.
    unit.skip_rows = 5
    rest, _ = run_unit(pipe._spec, unit, paths)
    np.testing.assert_array_equal(rest["id"], whole["id"][5:])
    np.testing.assert_array_equal(rest["image"], whole["image"][5:])
    assert rest["caption"].tolist() == whole["caption"][5:].tolist()
    pipe.close()


def test_stages_see_a_block_in_chunks_joined_in_order():
    from raying.errors import UserFunctionError
    from raying.read.stages import DEFAULT_STAGE_ROWS, UserStage, apply_stages

    n, size = 3 * DEFAULT_STAGE_ROWS + 5, 4
    block = {"id": np.arange(100, 100 + n), "label": np.arange(n) % 3,
             "image": np.zeros((n, size, size, 3), np.uint8),
             "weight": np.ones(n, np.float32), "prob": np.full(n, 0.5)}
    seen = []

    def mark(batch):
        seen.append(len(batch["id"]))
        batch["image"] = batch["image"] + (batch["id"] % 200).astype(np.uint8)[:, None, None,
                                                                                None]
        batch["first"] = np.full(len(batch["id"]), batch["id"][0])
        return batch

    out = apply_stages((UserStage(mark),), dict(block), seed=0, epoch=0, size=size)
    assert seen == [DEFAULT_STAGE_ROWS] * 3 + [5]
    assert np.array_equal(out["id"], block["id"])  # every row, in the block's order
    assert np.array_equal(out["image"][:, 0, 0, 0], (block["id"] % 200).astype(np.uint8))
    assert np.array_equal(np.unique(out["first"]), block["id"][::DEFAULT_STAGE_ROWS])

    def moody(batch):  # a column for some chunks only
        if batch["id"][0] > 100:
            batch["extra"] = np.ones(len(batch["id"]))
        return batch

    with pytest.raises(UserFunctionError, match=r"returned columns .* for some rows"):
        apply_stages((UserStage(moody),), dict(block), seed=0, epoch=0, size=size)


def _same(batch):
    return batch


def _in_place(batch):
    batch["image"][:, 0] = 7
    return batch


def _reversed_view(batch):  # a view of the input that overlaps where the buffer writes
    batch["image"] = batch["image"][::-1]
    return batch


def _fresh(batch):
    batch["image"] = (batch["image"] // 2).astype(np.uint8)
    return batch


def _keeps_input(batch):  # new columns that are views of the input pixels, then a new image
    batch["clean"] = batch["image"]
    batch["thumb"] = batch["image"][:, ::4, ::4]
    rows = np.empty(len(batch["id"]), object)  # one view per row, in an object column
    for k in range(len(rows)):
        rows[k] = batch["image"][k, 0, :4]
    batch["rows"] = rows
    batch["image"] = 255 - batch["image"]
    return batch


def test_a_stage_may_change_reserved_values_and_soft_labels_but_not_their_dtypes(parquet_set):
    def soften(batch):
        n = len(batch["id"])
        batch["id"] = batch["id"].astype(np.int32)  # same ids, another integer type
        batch["weight"] = batch["weight"].astype(np.float64) * 2  # float64 back: cast
        soft = np.full((n, 3), 0.05)
        soft[np.arange(n), batch["label"]] = 0.9
        batch["label"] = soft  # soft labels (n, classes)
        return batch

    m = raying.Manifest.scan(str(parquet_set))
    pipe = raying.Pipeline(m, transform=raying.ImageTransform(size=SIZE)).map_batches(soften)
    got = read_epoch(pipe, 0)
    assert got["id"].dtype == np.int64 and sorted(got["id"].tolist()) == list(range(36))
    assert got["weight"].dtype == np.float32 and (got["weight"] == 2).all()
    assert got["prob"].dtype == np.float64
    assert got["label"].shape == (36, 3) and (got["label"].argmax(1) == got["id"] % 3).all()
    pipe.close()


@pytest.mark.parametrize("fn", [_same, _in_place, _reversed_view, _fresh, _keeps_input])
def test_staged_blocks_in_the_reused_buffer_equal_fresh_ones(tmp_path, fn):
    """A read task's reused output buffer (chunks staged and written in place, bad rows
    compacted out) gives the same blocks as fresh arrays, whatever a stage returns."""
    from raying.read.stages import DEFAULT_STAGE_ROWS
    from raying.read.task import iter_unit
    from raying.tools.datagen import make_image_folder

    root = make_image_folder(tmp_path / "img", n=3 * DEFAULT_STAGE_ROWS + 7, classes=2,
                             size=(24, 32), seed=3, formats=("jpg",))
    files = sorted(p for p in root.rglob("*.jpg"))
    for bad in (files[1], files[DEFAULT_STAGE_ROWS + 4], files[-1]):
        bad.write_bytes(b"not a jpeg")
    m = raying.Manifest.scan(str(root))
    pipe = raying.Pipeline(m, transform=raying.ImageTransform(size=SIZE),
                           sampler=raying.UniformSampler(seed=1)).map_batches(fn)
    for block_rows in (None, 20):
        fresh, reused = [], []
        for u in pipe.plan(0).units:
            unit, paths = pipe._fill(u)
            fresh += [{k: v.copy() for k, v in b.items()} for b, _ in
                      iter_unit(pipe._spec, unit, paths, block_rows=block_rows)]
            reused += [{k: v.copy() for k, v in b.items()} for b, _ in
                       iter_unit(pipe._spec, unit, paths, block_rows=block_rows,
                                 reuse_output=True)]
        assert sum(len(b["id"]) for b in fresh) == len(files) - 3
        if fn is _keeps_input:  # the views kept the input pixels, not the stage's image
            for b in fresh + reused:
                np.testing.assert_array_equal(b["clean"], 255 - b["image"])
                np.testing.assert_array_equal(b["thumb"], b["clean"][:, ::4, ::4])
                for k, row in enumerate(b["rows"]):
                    np.testing.assert_array_equal(row, b["clean"][k, 0, :4])
        assert len(fresh) == len(reused)
        for f, r in zip(fresh, reused, strict=True):
            assert sorted(f) == sorted(r)
            for k in f:
                if f[k].dtype == object:
                    for x, y in zip(f[k], r[k], strict=True):
                        np.testing.assert_array_equal(x, y, err_msg=k)
                else:
                    np.testing.assert_array_equal(f[k], r[k], err_msg=k)
    pipe.close()


class _KeepsEarlier:
    """A stage that keeps every input it saw (a mosaic's or a memory bank's earlier images,
    and a view of them) with a copy taken at the call, then returns new pixels."""

    def __init__(self):
        self.kept = []

    def __call__(self, batch):
        image = batch["image"]
        self.kept.append((image, image[:, ::-1], image.copy()))
        batch["image"] = 255 - image
        return batch


def test_images_a_stage_keeps_from_earlier_calls_stay_as_it_got_them(tmp_path):
    """The read task reuses its output buffer for the stage's output and the next block: what
    a stage keeps of its input must not change under it on any path."""
    from raying.read.task import iter_unit
    from raying.tools.datagen import make_image_folder

    root = make_image_folder(tmp_path / "img", n=70, classes=2, size=(24, 32), seed=8,
                             formats=("jpg",))
    for reuse in (False, True):
        stage = _KeepsEarlier()
        pipe = raying.Pipeline(raying.Manifest.scan(str(root)),
                               transform=raying.ImageTransform(size=SIZE),
                               sampler=raying.UniformSampler(seed=1)).map_batches(stage)
        for u in pipe.plan(0).units:
            for _ in iter_unit(pipe._spec, *pipe._fill(u), block_rows=20,
                               reuse_output=reuse):
                pass
        assert sum(len(k[0]) for k in stage.kept) == 70
        for image, flipped, copy in stage.kept:
            np.testing.assert_array_equal(image, copy)
            np.testing.assert_array_equal(flipped, copy[:, ::-1])
        pipe.close()


def test_stage_call_rows_keep_a_call_small_and_divide_a_chunk():
    from raying.read.stages import DEFAULT_STAGE_ROWS, STAGE_CALL_BYTES, stage_call_rows

    for size in (8, 16, 64, 100, 128, 224, 512, 1024):
        rows = stage_call_rows(size)
        assert DEFAULT_STAGE_ROWS % rows == 0
        assert rows == 1 or rows * size * size * 3 <= STAGE_CALL_BYTES
        assert rows == DEFAULT_STAGE_ROWS or 2 * rows * size * size * 3 > STAGE_CALL_BYTES
    assert stage_call_rows(224) == 1 and stage_call_rows(16) == DEFAULT_STAGE_ROWS


def _seeded_128px(root, fn, *, seed: int):
    """A pipeline of 128 px crops (4-row calls of the stages) with ``fn`` as a seeded stage."""
    return raying.Pipeline(raying.Manifest.scan(str(root)),
                           transform=raying.ImageTransform(size=128),
                           sampler=raying.UniformSampler(seed=seed)).map_batches(fn,
                                                                                 with_rng=True)


def test_seeded_stage_in_small_calls_gives_the_same_pixels_however_blocks_are_cut(tmp_path):
    """At 128 px a call of the stages sees 4 rows; a unit cut into aligned blocks (a short
    first block, then 32s) draws the same numbers as the whole unit."""
    from raying.read.stages import stage_call_rows
    from raying.read.task import iter_unit
    from raying.tools.datagen import make_image_folder

    assert stage_call_rows(128) == 4
    root = make_image_folder(tmp_path / "img", n=70, classes=2, size=(24, 32), seed=5,
                             formats=("jpg",))
    calls = []

    def seeded(batch, rng):
        calls.append(len(batch["id"]))
        return jitter(batch, rng)

    pipe = _seeded_128px(root, seeded, seed=4)
    unit, paths = pipe._fill(pipe.plan(0).units[0])
    whole = run_unit(pipe._spec, unit, paths)[0]
    assert set(calls) == {4}
    cut = [{k: v.copy() for k, v in b.items()} for b, _ in  # the buffer is reused
           iter_unit(pipe._spec, unit, paths, block_rows=32, first_block_rows=16,
                     reuse_output=True)]
    assert len(cut) > 1
    np.testing.assert_array_equal(np.concatenate([b["id"] for b in cut]), whole["id"])
    np.testing.assert_array_equal(np.concatenate([b["image"] for b in cut]), whole["image"])
    pipe.close()


def test_a_chunks_calls_draw_in_turn_from_the_chunks_generator(tmp_path):
    """At 128 px a chunk of 16 rows runs as 4 calls of 4; they share the chunk's generator
    (one per stage and chunk, not one per call), drawing from it in order."""
    from raying.read.stages import DEFAULT_STAGE_ROWS, stage_call_rows, stage_rng
    from raying.tools.datagen import make_image_folder

    assert stage_call_rows(128) == 4
    root = make_image_folder(tmp_path / "img", n=2 * DEFAULT_STAGE_ROWS, classes=2,
                             size=(24, 32), seed=6, formats=("jpg",))

    def draws(batch, rng):
        batch["draw"] = rng.integers(0, 1 << 40, size=len(batch["id"]))
        return batch

    pipe = _seeded_128px(root, draws, seed=8)
    unit, paths = pipe._fill(pipe.plan(3).units[0])
    block = run_unit(pipe._spec, unit, paths)[0]
    assert len(block["id"]) == 2 * DEFAULT_STAGE_ROWS
    for a in range(0, len(block["id"]), DEFAULT_STAGE_ROWS):
        ids = block["id"][a:a + DEFAULT_STAGE_ROWS]
        rng = stage_rng(pipe._spec.seed, 3, 0, ids)
        want = np.concatenate([rng.integers(0, 1 << 40, size=4) for _ in range(4)])
        np.testing.assert_array_equal(block["draw"][a:a + DEFAULT_STAGE_ROWS], want)
    pipe.close()
