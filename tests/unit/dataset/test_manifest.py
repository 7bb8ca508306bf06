"""Manifest.scan/save/load on image folders and Parquet, and every dataset-level error."""

from __future__ import annotations

import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

import raying
from raying.tools.datagen import make_image_folder


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_image_folder(tmp_path_factory.mktemp("imgs"), n=12, classes=3, size=(16, 20),
                             formats=("jpg", "png"))


def _parquet(path, n=10, *, label=None, image=True, **extra):
    cols = {"id": pa.array(range(n), pa.int64())}
    if image:
        cols["image"] = pa.array([b"\xff\xd8\xff" + bytes([i]) for i in range(n)], pa.binary())
    if label is not None:
        cols["label"] = label
    cols.update(extra)
    pq.write_table(pa.table(cols), path, row_group_size=4)
    return path


def test_scan_folder_ids_sorted_labels_from_folders(folder):
    m = raying.Manifest.scan(str(folder))
    assert len(m) == 12 and m.format == "images"
    assert m.classes == ["class_00", "class_01", "class_02"]
    paths = m.path_of(np.arange(12))
    assert paths == sorted(paths)
    for p, lab in zip(paths, m.labels, strict=True):
        assert m.classes[lab] == p.split("/")[0]
    assert (m.sizes > 0).all()


def test_scan_file_uri_and_no_label(folder):
    m = raying.Manifest.scan(f"file://{folder}", label=None)
    assert len(m) == 12 and (m.labels == -1).all() and m.classes is None


def test_scan_save_and_load_take_a_pathlib_path(folder, tmp_path):
    import pathlib

    m = raying.Manifest.scan(pathlib.Path(folder))
    assert len(m) == 12 and m.root == raying.Manifest.scan(str(folder)).root
    m.save(tmp_path / "m.parquet")
    assert len(raying.Manifest.load(tmp_path / "m.parquet")) == 12
    with pytest.raises(raying.ConfigError, match="path or URI string"):
        raying.Manifest.scan(str(folder).encode())


def test_label_function(folder):
    m = raying.Manifest.scan(str(folder), label=lambda p: int(p.split("/")[1][:6]) % 2)
    assert set(m.labels.tolist()) == {0, 1}


def test_hive_labels_negative_or_spelled_twice_are_refused(tmp_path):
    for folders, pattern in ((("label=-1", "label=1"), r"'-1' is a negative label"),
                             (("label=01", "label=1"), r"'01' and '1' are the same class id 1")):
        root = tmp_path / "_".join(folders).replace("=", "")
        for name in folders:
            (root / name).mkdir(parents=True)
            _parquet(root / name / "part-0.parquet", 4)
        with pytest.raises(raying.DataError, match=pattern):
            raying.Manifest.scan(str(root), label="label")


def test_pipes_and_devices_are_named_in_a_warning(tmp_path):
    """Entries that are not regular files (a named pipe, a link to a device) are left out of
    a listing, as links that lead nowhere are: said, not silently. (A folder of its own: a
    copy of the module's folder would copy /dev/zero without end.)"""
    own = make_image_folder(tmp_path / "imgs", n=6, classes=2, size=(16, 20))
    os.mkfifo(own / "class_00" / "pipe.jpg")
    os.symlink("/dev/zero", own / "class_01" / "zero.jpg")
    with pytest.warns(UserWarning, match=r"2 entries are not regular files .* left out of "
                                         r"the scan \(e\.g\. .*pipe\.jpg, .*zero\.jpg\)"):
        m = raying.Manifest.scan(str(own))
    paths = list(m.path_of(np.arange(len(m))))
    assert len(paths) == 6 and not any(p.endswith(("pipe.jpg", "zero.jpg")) for p in paths)


def test_links_that_lead_nowhere_are_named_in_a_warning(folder, tmp_path):
    # A split made of links into a store: a link whose target is gone would be left out of
    # the listing without a word.
    split = tmp_path / "split"
    for src in sorted(folder.rglob("*.jpg"))[:4]:
        (split / src.parent.name).mkdir(parents=True, exist_ok=True)
        (split / src.parent.name / src.name).symlink_to(src)
    (split / "class_00" / "gone.jpg").symlink_to(tmp_path / "nowhere.jpg")
    (split / "class_01" / "again").symlink_to(folder / "class_02")  # a second link: listed
    with pytest.warns(UserWarning, match=r"1 symbolic links lead to nothing and are left out "
                                         r"of the scan \(e\.g\. .*gone\.jpg -> .*nowhere\.jpg\)"):
        m = raying.Manifest.scan(str(split))
    paths = list(m.path_of(np.arange(len(m))))
    assert not any("gone" in p for p in paths)
    assert len(paths) == 4 + len(list((folder / "class_02").iterdir()))
    # A link back up the tree would list each image again at every level (some 40 times;
    # for hours where two loops cross): refused, naming the link.
    (split / "class_00" / "loop").symlink_to(split)
    with pytest.raises(raying.DataError, match=r"symbolic link .*class_00/loop -> .*split "
                                               r"makes a loop"):
        raying.Manifest.scan(str(split))
    # Loops across folders (two links each way: the listing ran for hours).
    (split / "class_00" / "loop").unlink()
    for k in (1, 2):
        (split / "class_00" / f"to_1_{k}").symlink_to("../class_01")
        (split / "class_01" / f"to_0_{k}").symlink_to("../class_00")
    with pytest.raises(raying.DataError, match=r"symbolic link .*/to_\d_\d -> \.\./class_0\d "
                                               r"makes a loop"):
        raying.Manifest.scan(str(split))


def test_parq_files_are_parquet_and_a_file_named_is_read_as_format_says(tmp_path):
    root = tmp_path / "p"
    root.mkdir()
    _parquet(root / "part.0.parq", 4)  # fastparquet's and Dask's ending
    _parquet(root / "part.1.parquet", 4)
    assert len(raying.Manifest.scan(str(root), label=None)) == 8
    _parquet(tmp_path / "table.bin", 4)
    assert len(raying.Manifest.scan(str(tmp_path / "table.bin"), format="parquet",
                                    label=None)) == 4


def test_a_file_the_uri_names_is_read_or_refused_by_its_own_name(tmp_path):
    """A Parquet file named by the URI is read whatever its name (a _-prefixed one is
    bookkeeping only in a folder's listing); what is refused names the file, not its folder,
    and a file inside a hive partition says where its label comes from."""
    root = tmp_path / "d"
    root.mkdir()
    _parquet(root / "_train.parquet", 4)
    assert len(raying.Manifest.scan(str(root / "_train.parquet"), label=None)) == 4
    (root / "_SUCCESS").write_bytes(b"")
    with pytest.raises(raying.DataError, match=r"_SUCCESS names one file, which is neither "
                                               r"Parquet"):
        raying.Manifest.scan(str(root / "_SUCCESS"))
    _parquet(root / "good.parquet", 4)
    pq.write_table(pa.table({"id": pa.array([], pa.int64()),
                             "image": pa.array([], pa.binary())}), root / "empty.parquet")
    with pytest.raises(raying.DataError, match=r"empty\.parquet \(the file the URI names\)"):
        raying.Manifest.scan(str(root / "empty.parquet"), label=None)
    part = tmp_path / "h" / "label=cat"
    part.mkdir(parents=True)
    _parquet(part / "part-0.parquet", 4)
    with pytest.raises(raying.DataError, match=r"part-0\.parquet \(the file the URI names\).*"
                                               r"hive partition's label .* scan .*/h$"):
        raying.Manifest.scan(str(part / "part-0.parquet"))
    assert set(raying.Manifest.scan(str(tmp_path / "h")).classes) == {"cat"}
    # One image named: refused under label='folder' naming that file, read with label=None.
    cls = tmp_path / "i" / "cat"
    cls.mkdir(parents=True)
    Image.new("RGB", (8, 8)).save(cls / "a.jpg")
    with pytest.raises(raying.DataError, match=r"cat/a\.jpg names one image file, and "
                                               r"label='folder'.*pass label=None$"):
        raying.Manifest.scan(str(cls / "a.jpg"))
    assert len(raying.Manifest.scan(str(cls / "a.jpg"), label=None)) == 1


def test_a_hive_folder_of_null_labels_is_refused(tmp_path):
    # pandas and Spark write rows of a null partition value under __HIVE_DEFAULT_PARTITION__;
    # as a class it would sort the integer folders as names and renumber them all.
    root = tmp_path / "h"
    for name in ("label=2", "label=10", "label=__HIVE_DEFAULT_PARTITION__"):
        (root / name).mkdir(parents=True)
        _parquet(root / name / "part-0.parquet", 4)
    with pytest.raises(raying.DataError, match=r"label=__HIVE_DEFAULT_PARTITION__/part-0"
                                               r"\.parquet: its rows have a null label"):
        raying.Manifest.scan(str(root), label="label")


def test_files_of_no_rows_are_left_out_whatever_their_schema_says(tmp_path):
    # pandas writes an empty object column as type null: such a file holds no sample.
    import pandas as pd

    root = tmp_path / "p"
    root.mkdir()
    df = pd.DataFrame({"image": [b"a%d" % k for k in range(6)], "label": [0, 1] * 3})
    df.iloc[0:0].to_parquet(root / "a.parquet")  # sorts first: the scan's reference schema
    df.iloc[:3].to_parquet(root / "b.parquet")
    df.iloc[3:].to_parquet(root / "c.parquet")
    assert pq.read_schema(root / "a.parquet").field("image").type == pa.null()
    m = raying.Manifest.scan(str(root), label="label")
    assert (len(m), m.files) == (6, ["b.parquet", "c.parquet"])
    np.testing.assert_array_equal(m.labels, [0, 1, 0, 1, 0, 1])
    df.iloc[0:0].to_parquet(root / "b.parquet")
    df.iloc[0:0].to_parquet(root / "c.parquet")
    with pytest.raises(raying.DataError, match="holds Parquet files but no rows"):
        raying.Manifest.scan(str(root), label="label")


@pytest.mark.parametrize(("fn", "pattern"), [
    (lambda p: None if p.startswith("class_01") else "a",
     r"returned None \(NoneType\) for 'class_01/.*' under .*; return a class name \(str\) or "
     r"a class index"),
    (lambda p: 1.5, r"returned 1.5 \(float\) for 'class_00/"),
    (lambda p: [1], r"returned \[1\] \(list\)"),
    (lambda p: 2**70, r"returned 1180591620717411303424 for 'class_00/.*' under .*; a class "
                      r"index must be an int from 0 to 2\*\*63 - 1"),
    (lambda p: "cat" if p.startswith("class_00") else 3,
     r"returned class names \(str, e.g. for 'class_00/.*'\) and class indices \(int, e.g. "
     r"for 'class_01/"),
])
def test_label_function_values_other_than_names_or_indices_are_refused(folder, fn, pattern):
    with pytest.raises(raying.DataError, match=pattern):
        raying.Manifest.scan(str(folder), label=fn)
    m = raying.Manifest.scan(str(folder), label=lambda p: p.startswith("class_01"))
    assert m.labels.tolist() == [int(p.startswith("class_01")) for p in m.column("path")]
    with pytest.raises(KeyError) as info:  # the function's own error, the image named
        raying.Manifest.scan(str(folder), label=lambda p: {}[p])
    assert any("raised by the label function given to Manifest.scan, for 'class_00/" in n
               for n in info.value.__notes__)


def test_save_load_roundtrip(folder, tmp_path):
    m = raying.Manifest.scan(str(folder))
    m.save(str(tmp_path / "m.parquet"))
    back = raying.Manifest.load(str(tmp_path / "m.parquet"))
    assert len(back) == len(m) and back.classes == m.classes and back.root == m.root
    assert np.array_equal(back.labels, m.labels)
    assert back.path_of(np.arange(12)) == m.path_of(np.arange(12))
    assert back.fingerprint() == m.fingerprint()
    # Storage options under the other names StorageOptions takes (boto's, s3fs's).
    for given in ({"endpoint": "http://127.0.0.1:9"},
                  {"aws_access_key_id": "AKIAEXAMPLE", "aws_secret_access_key": "s" * 40}):
        back = raying.Manifest.load(str(tmp_path / "m.parquet"), storage=given)
        assert back.fingerprint() == m.fingerprint()
    assert back.storage.access_key_id == "AKIAEXAMPLE"


def test_save_refuses_a_name_that_says_another_format(folder, tmp_path):
    """A manifest is Parquet: saving it as m.json would hand a reader of m.json binary."""
    m = raying.Manifest.scan(str(folder))
    with pytest.raises(raying.ConfigError, match=r"written as Parquet, not JSON.*m\.parquet"):
        m.save(str(tmp_path / "m.json"))
    assert not (tmp_path / "m.json").exists()
    for name in ("manifest", "json", "train.manifest"):  # no suffix, or another: the user's
        m.save(tmp_path / name)
        assert len(raying.Manifest.load(tmp_path / name)) == len(m)


def test_images_at_top_level_need_label_none(tmp_path):
    make_image_folder(tmp_path, n=2, classes=1, size=(8, 8))
    (tmp_path / "stray.jpg").write_bytes((tmp_path / "class_00" / "000000.jpg").read_bytes())
    with pytest.raises(raying.DataError, match="stray.jpg.*label=None"):
        raying.Manifest.scan(str(tmp_path))


def test_empty_folder_and_missing_uri(tmp_path):
    with pytest.raises(raying.DataError, match="is empty"):
        raying.Manifest.scan(str(tmp_path))
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(raying.DataError, match=r"no images .* found endings \.txt"):
        raying.Manifest.scan(str(tmp_path))
    with pytest.raises(raying.StorageError, match="does not exist") as info:
        raying.Manifest.scan(str(tmp_path / "nope"))
    assert isinstance(info.value, FileNotFoundError)  # as a missing file or manifest is
    with pytest.raises(raying.ConfigError, match="format must be one of"):
        raying.Manifest.scan(str(tmp_path), format="tfrecord")
    with pytest.raises(raying.ConfigError, match="scheme"):
        raying.Manifest.scan("ftp://host/data")


def test_parquet_rows_and_row_groups(tmp_path):
    _parquet(tmp_path / "a.parquet", 10, label=pa.array([1] * 10))
    _parquet(tmp_path / "b.parquet", 6, label=pa.array([2] * 6))
    m = raying.Manifest.scan(str(tmp_path), label="label")
    assert m.format == "parquet" and len(m) == 16
    f, g, start, rows = m.row_group_table()
    assert f.tolist() == [0, 0, 0, 1, 1] and rows.tolist() == [4, 4, 2, 4, 2]
    assert start.tolist() == [0, 4, 8, 10, 14]
    assert m.labels.tolist() == [1] * 10 + [2] * 6
    assert m.path_of(13) == ["b.parquet#rg0/row3"]


def test_parquet_string_labels_become_classes(tmp_path):
    _parquet(tmp_path / "a.parquet", 4, label=pa.array(["dog", "cat", "dog", "eel"]))
    m = raying.Manifest.scan(str(tmp_path), format="parquet", label="label")
    assert m.classes == ["cat", "dog", "eel"] and m.labels.tolist() == [1, 0, 1, 2]


@pytest.mark.parametrize("typ", [pa.int8(), pa.uint16(), pa.int32(), pa.int64(),
                                 pa.float16(), pa.float32(), pa.float64()])
def test_parquet_numeric_labels_of_every_width_across_row_groups(tmp_path, typ):
    # Row groups of 4 rows: the label column arrives in several chunks (offsets included).
    want = [3, 0, 2, 1, 1, 0, 2, 3, 0, 1]
    values = np.asarray(want, dtype=typ.to_pandas_dtype())
    _parquet(tmp_path / "a.parquet", 10, label=pa.array(values, typ))
    _parquet(tmp_path / "b.parquet", 10, label=pa.array(values[::-1].copy(), typ))
    m = raying.Manifest.scan(str(tmp_path), format="parquet", label="label")
    assert m.labels.dtype == np.int64 and m.labels.tolist() == want + want[::-1]


def test_numeric_values_are_read_from_sliced_and_empty_chunks():
    from raying.dataset.scan import _numbers

    base = pa.array(np.arange(10, dtype=np.int16))
    arr = pa.chunked_array([base.slice(3, 4), base.slice(0, 0), base.slice(8)],
                           type=pa.int16())
    got = _numbers(arr)
    assert got.dtype == np.int16 and got.tolist() == [3, 4, 5, 6, 8, 9]
    assert _numbers(pa.chunked_array([], type=pa.float32())).tolist() == []
    empty = pa.chunked_array([pa.array([], pa.int64())])
    assert _numbers(empty).dtype == np.int64 and len(_numbers(empty)) == 0


def test_a_parquet_scan_does_not_import_pandas(tmp_path):
    """Arrow's to_numpy imports pandas at its first call, ~0.3 s of a cold scan; the scan
    reads labels and footers without it (pandas is installed here: Ray Data needs it)."""
    import subprocess
    import sys

    _parquet(tmp_path / "a.parquet", 10, label=pa.array(range(10), pa.int64()),
             caption=pa.array([str(i) for i in range(10)]))
    code = ("import sys, raying; "
            f"m = raying.Manifest.scan({str(tmp_path)!r}, format='parquet', label='label', "
            "columns=['caption']); "
            "assert len(m) == 10 and m.labels.tolist() == list(range(10)); "
            "print('pandas' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=120)
    assert out.stdout.strip().splitlines()[-1] == "False", out.stdout + out.stderr


def test_parquet_missing_label_column_is_named(tmp_path):
    _parquet(tmp_path / "a.parquet", 4)
    with pytest.raises(raying.DataError, match=r"a.parquet has no label column 'label'"):
        raying.Manifest.scan(str(tmp_path), format="parquet", label="label")
    assert len(raying.Manifest.scan(str(tmp_path), format="parquet", label=None)) == 4


@pytest.mark.parametrize("labels, pattern", [
    (pa.array([0.0, float("nan"), 1.0, 2.0]), r"a.parquet: label column 'label' has 1 NaN"),
    (pa.array([0, None, 1, 2], pa.int64()), r"a.parquet: label column 'label' has 1 null"),
    (pa.array([0, -3, 1, 2]), r"a.parquet: label column 'label' has negative labels"),
    (pa.array([0, 2**63 + 5, 1, 2], pa.uint64()),
     r"a.parquet: label column 'label' has labels above 2\*\*63 - 1 \(e.g. "
     r"9223372036854775813 at row 1\)"),
    # 'label' is a reserved key: the hint carries it under another one.
    (pa.array([0.5, 1.0, 1.0, 2.0]), r"non-integer values.* scan with label=None, "
                                     r"columns=\{'label': 'target'\}"),
])
def test_parquet_bad_labels_are_never_silent(tmp_path, labels, pattern):
    _parquet(tmp_path / "a.parquet", 4, label=labels)
    with pytest.raises(raying.DataError, match=pattern):
        raying.Manifest.scan(str(tmp_path), label="label")
    if "target" in pattern:  # the hint works as given
        m = raying.Manifest.scan(str(tmp_path), label=None, columns={"label": "target"})
        assert m.meta["columns"]["target"] == {"kind": "number", "dtype": "float64",
                                               "source": "label"}


def test_a_float_target_column_is_pointed_to_columns(tmp_path):
    _parquet(tmp_path / "a.parquet", 4, y=pa.array([0.5, 1.0, 1.5, 2.0]))
    with pytest.raises(raying.DataError, match=r"scan with label=None, columns=\['y'\]"):
        raying.Manifest.scan(str(tmp_path), label="y")
    m = raying.Manifest.scan(str(tmp_path), label=None, columns=["y"])
    assert len(m) == 4


def test_label_columns_written_as_string_large_string_or_dictionary_read_as_one(tmp_path):
    # pyarrow, polars and pandas categoricals write class names each their own way.
    _parquet(tmp_path / "a.parquet", 4, label=pa.array(["cat", "dog", "cat", "dog"]))
    _parquet(tmp_path / "b.parquet", 4, label=pa.array(["eel", "cat", "cat", "cat"],
                                                       pa.large_string()))
    _parquet(tmp_path / "c.parquet", 4,
             label=pa.array(["dog", "dog", "eel", "cat"]).dictionary_encode())
    m = raying.Manifest.scan(str(tmp_path), label="label")
    assert m.classes == ["cat", "dog", "eel"]
    assert [m.classes[k] for k in m.labels] == ["cat", "dog", "cat", "dog", "eel", "cat", "cat",
                                                "cat", "dog", "dog", "eel", "cat"]
    _parquet(tmp_path / "c.parquet", 4, label=pa.array([0, 1, 2, 0]))  # names beside ids
    with pytest.raises(raying.DataError, match=r"schema mismatch in column 'label': .*c.parquet"):
        raying.Manifest.scan(str(tmp_path), label="label")


def test_corrupt_parquet_names_the_file(tmp_path):
    _parquet(tmp_path / "a.parquet", 4, label=pa.array([0] * 4))
    good = (tmp_path / "a.parquet").read_bytes()
    (tmp_path / "b.parquet").write_bytes(good[: len(good) // 2])
    with pytest.raises(raying.DataError, match=r"b.parquet is not a readable Parquet file"):
        raying.Manifest.scan(str(tmp_path), label="label")


def test_schema_mismatch_names_both_files(tmp_path):
    _parquet(tmp_path / "a.parquet", 4, label=pa.array([0] * 4))
    _parquet(tmp_path / "b.parquet", 4, label=pa.array(["x"] * 4))
    with pytest.raises(raying.DataError, match=r"schema mismatch in column 'label': .*b.parquet"):
        raying.Manifest.scan(str(tmp_path), label="label")
    _parquet(tmp_path / "b.parquet", 4, image=False, label=pa.array([0] * 4),
             pixels=pa.array([b"x"] * 4))
    with pytest.raises(raying.DataError, match=r"b.parquet has no column 'image'"):
        raying.Manifest.scan(str(tmp_path), label="label")


def test_no_image_column_is_explained(tmp_path):
    _parquet(tmp_path / "a.parquet", 4, image=False, label=pa.array([0] * 4),
             x=pa.array([b"1"] * 4), y=pa.array([b"2"] * 4))
    with pytest.raises(raying.DataError, match="image_column="):
        raying.Manifest.scan(str(tmp_path), label="label")
    m = raying.Manifest.scan(str(tmp_path), label="label", image_column="y")
    assert m.meta["image_column"] == "y"


def test_image_column_of_the_wrong_type_is_refused_at_scan(tmp_path):
    for name, col, pattern in (("s", pa.array(["/x/0.jpg"] * 4), "type string.*file paths"),
                               ("i", pa.array([1, 2, 3, 4]), "type int64")):
        (tmp_path / name).mkdir()
        pq.write_table(pa.table({"image": col, "label": [0] * 4}),
                       tmp_path / name / "a.parquet")
        with pytest.raises(raying.DataError, match=pattern):
            raying.Manifest.scan(str(tmp_path / name), label="label")
    hf = pa.array([{"bytes": b"\xff\xd8", "path": "0.jpg"}] * 4)
    (tmp_path / "hf").mkdir()
    pq.write_table(pa.table({"img": hf, "label": [0] * 4}), tmp_path / "hf" / "a.parquet")
    assert raying.Manifest.scan(str(tmp_path / "hf"), label="label").meta["image_column"] == "img"


def test_predecoded_rows_must_share_one_shape(tmp_path):
    px = pa.array([bytes(4 * 16 * 3)] * 2, pa.binary(4 * 16 * 3))
    pq.write_table(pa.table({"image": px, "height": [4, 16], "width": [16, 4],
                             "channels": [3, 3]}), tmp_path / "a.parquet")
    with pytest.raises(raying.DataError, match=r"row 1 has height 16, not 4.*--decode-size"):
        raying.Manifest.scan(str(tmp_path), label=None)


def test_one_spelling_per_local_root(folder, tmp_path, monkeypatch):
    """Relative, trailing-slash and file:// spellings give one absolute root (and
    fingerprint), so a saved manifest reads from any working directory."""
    monkeypatch.chdir(folder.parent)
    rel = raying.Manifest.scan(folder.name)
    assert rel.root == str(folder)
    for uri in (f"{folder}/", f"file://{folder}"):
        assert raying.Manifest.scan(uri).fingerprint() == rel.fingerprint()
    rel.save(str(tmp_path / "m.parquet"))
    monkeypatch.chdir("/")
    assert raying.Manifest.load(str(tmp_path / "m.parquet")).root == str(folder)


def test_a_single_file_is_a_dataset_of_one(folder, tmp_path):
    m = raying.Manifest.scan(str(folder))
    one = m.path_of(0)[0]
    single = raying.Manifest.scan(f"{folder}/{one}", label=None)
    assert len(single) == 1 and single.root == f"{folder}/{one.split('/')[0]}"
    assert single.path_of(0) == [one.split("/")[1]]
    _parquet(tmp_path / "p.parquet", 6)
    pm = raying.Manifest.scan(str(tmp_path / "p.parquet"), label=None)
    assert len(pm) == 6 and pm.root == str(tmp_path) and pm.files == ["p.parquet"]


def test_underscore_names_kept_for_images_dropped_for_parquet(folder, tmp_path):
    import shutil

    imgs = tmp_path / "imgs"
    shutil.copytree(folder, imgs)
    (imgs / "class_00").rename(imgs / "_other")
    (imgs / "class_01" / "x.JPG").write_bytes((folder / raying.Manifest.scan(
        str(folder)).path_of(0)[0]).read_bytes())
    m = raying.Manifest.scan(str(imgs))
    assert len(m) == 13 and m.classes == ["_other", "class_01", "class_02"]
    jpegs = len([f for f in imgs.rglob("*") if f.suffix.lower() == ".jpg"])
    assert 1 < jpegs < 13
    for ext in ((".JPG",), ("jpg",), ".jpg"):  # endings match whatever their case or dot
        assert len(raying.Manifest.scan(str(imgs), extensions=ext)) == jpegs
    pq_root = tmp_path / "pq"
    (pq_root / "_temporary").mkdir(parents=True)
    _parquet(pq_root / "part-0.parquet", 5)
    _parquet(pq_root / "_temporary" / "part-0.parquet", 5)  # a Spark job's leftovers
    assert len(raying.Manifest.scan(str(pq_root), label=None)) == 5


def test_jpeg_endings_browsers_save_are_scanned_and_other_files_left_out_are_named(
        folder, tmp_path, caplog):
    import shutil

    imgs = tmp_path / "imgs"
    shutil.copytree(folder, imgs)
    first = imgs / raying.Manifest.scan(str(imgs)).path_of(0)[0]
    for ending in ("jfif", "JPE"):
        shutil.copy(first, first.with_name(f"saved.{ending}"))
    (imgs / "README.md").write_text("a dataset")
    (imgs / "class_01" / "notes.txt").write_text("x")
    (imgs / "class_01" / "more.txt").write_text("y")
    with caplog.at_level("WARNING", logger="raying.dataset.manifest"):
        m = raying.Manifest.scan(str(imgs))
    assert len(m) == 14 and {p.rpartition("/")[2] for p in m.column("path")} >= {
        "saved.jfif", "saved.JPE"}
    said = [r.getMessage() for r in caplog.records]
    assert any("left out 3 files whose endings are not among the image endings scanned: "
               ".txt (2), .md (1); pass Manifest.scan(..., extensions=[...])" in t
               for t in said), said
    caplog.clear()
    with caplog.at_level("WARNING", logger="raying.dataset.manifest"):
        raying.Manifest.scan(str(folder))  # nothing left out: nothing said
    assert not caplog.records


def test_validation_split_scanned_with_the_training_classes(folder, tmp_path):
    import shutil

    train = raying.Manifest.scan(str(folder))
    val = tmp_path / "val"
    shutil.copytree(folder, val)
    shutil.rmtree(val / "class_01")  # a class with no validation images
    alone = raying.Manifest.scan(str(val))
    assert alone.classes == ["class_00", "class_02"]  # class_02 would be label 1 here
    m = raying.Manifest.scan(str(val), classes=train.classes)
    assert m.classes == train.classes
    for p, lab in zip(m.path_of(np.arange(len(m))), m.labels, strict=True):
        assert train.classes[lab] == p.split("/")[0]
    with pytest.raises(raying.DataError, match=r"\['class_02'\] that are not in classes="):
        raying.Manifest.scan(str(val), classes=["class_00", "class_01"])
    # Parquet with string labels, and integer labels that must fit the list.
    _parquet(tmp_path / "s.parquet", 4, label=pa.array(["b", "b", "d", "b"]))
    ps = raying.Manifest.scan(str(tmp_path / "s.parquet"), label="label",
                              classes=["a", "b", "c", "d"])
    assert ps.labels.tolist() == [1, 1, 3, 1] and ps.classes == ["a", "b", "c", "d"]
    (tmp_path / "i").mkdir()
    _parquet(tmp_path / "i" / "x.parquet", 4, label=pa.array([0, 2, 1, 0]))
    with pytest.raises(raying.DataError, match="label 2 has no name"):
        raying.Manifest.scan(str(tmp_path / "i"), label="label", classes=["a", "b"])


def test_hive_partition_folders_give_the_labels(tmp_path):
    """pandas ``to_parquet(partition_cols=["label"])`` moves the label into ``label=<v>/``
    folders; the scan reads it from there (names sorted into classes, integers kept)."""
    names = ["cat", "dog", "eel"]
    for key, values in (("label", names), ("cls", ["0", "1", "2"])):
        root = tmp_path / key
        for v in values:
            for part in range(2):
                d = root / f"{key}={v}"
                d.mkdir(parents=True, exist_ok=True)
                ks = [values.index(v) + 3 * (2 * j + part) for j in range(2)]
                pq.write_table(pa.table({"image": pa.array([b"x%d" % k for k in ks], pa.binary()),
                                         "k": ks}), d / f"part-{part}.parquet")
        m = raying.Manifest.scan(str(root), format="parquet", label=key)
        files = [root / f for f in m.files]
        k = np.concatenate([pq.read_table(f).column("k").to_numpy() for f in files])
        assert len(m) == len(k) == 12
        np.testing.assert_array_equal(m.labels, k % 3)  # each row's own partition value
        if key == "label":
            assert m.classes == names
    with pytest.raises(raying.DataError, match="hive partition folder species=<value>/"):
        raying.Manifest.scan(str(tmp_path / "label"), format="parquet", label="species")


def test_a_class_folder_without_images_is_warned_about(folder, tmp_path):
    import shutil
    import warnings

    root = tmp_path / "imgs"
    shutil.copytree(folder, root)
    for f in (root / "class_01").iterdir():
        f.unlink()
    (root / "class_01" / "notes.txt").write_text("no images here")
    (root / ".cache").mkdir()  # hidden: not a class
    with pytest.warns(UserWarning, match=r"class folders \['class_01'\] hold no images, so "
                                         r"they get no label .* pass classes=\[\.\.\.\]"):
        m = raying.Manifest.scan(str(root))
    assert m.classes == ["class_00", "class_02"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # classes= given: the labels are fixed, no warning
        m = raying.Manifest.scan(str(root), classes=["class_00", "class_01", "class_02"])
        raying.Manifest.scan(str(folder))  # every folder has images: no warning
    assert m.labels.max() == 2


def test_a_hive_partition_without_rows_is_warned_about(tmp_path):
    """Hive partitions of names are numbered in sorted order: one whose files hold no rows
    (a Spark or Dask job writes empty parts) gets no label and shifts those after it, as an
    image folder's empty class folder does; integer values are labels and shift nothing."""
    import warnings

    for key, values in (("label", ["cat", "dog", "empty", "zebra"]), ("cls", ["0", "1", "2"])):
        root = tmp_path / key
        for v in values:
            rows = 0 if v in ("empty", "1") else 2
            d = root / f"{key}={v}"
            d.mkdir(parents=True)
            pq.write_table(pa.table({"image": pa.array([b"x"] * rows, pa.binary())}),
                           d / "part-0.parquet")
            if rows:  # a partition with an empty part beside a full one is not empty
                pq.write_table(pa.table({"image": pa.array([], pa.binary())}),
                               d / "part-1.parquet")
    with pytest.warns(UserWarning, match=r"hive partitions \['label=empty/'\] hold no rows, so "
                                         r"their classes get no label .* classes=\[\.\.\.\]"):
        m = raying.Manifest.scan(str(tmp_path / "label"), format="parquet")
    assert m.classes == ["cat", "dog", "zebra"] and m.labels.tolist() == [0, 0, 1, 1, 2, 2]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # classes= given: every name keeps its label
        m = raying.Manifest.scan(str(tmp_path / "label"), format="parquet",
                                 classes=["cat", "dog", "empty", "zebra"])
        assert m.labels.tolist() == [0, 0, 1, 1, 3, 3]
        m = raying.Manifest.scan(str(tmp_path / "cls"), format="parquet", label="cls")
        assert m.labels.tolist() == [0, 0, 2, 2]


def test_files_mixing_binary_kinds_and_their_own_metadata_scan_and_read(tmp_path):
    # Writers differ: pyarrow's binary beside polars' large_binary for the same encoded
    # images; width/height metadata in some files only (they shape only pre-decoded pixels).
    import io

    from PIL import Image

    from raying.read.task import iter_unit

    def jpegs(values):
        out = []
        for v in values:
            buf = io.BytesIO()
            Image.fromarray(np.full((12, 16, 3), v, np.uint8)).save(buf, format="PNG")
            out.append(buf.getvalue())
        return out

    # The image column's place differs (a's metadata columns come first): a sample's size is
    # its own file's image column's.
    a_png, b_png = jpegs(range(0, 80, 10)), jpegs(range(80, 160, 10))
    pq.write_table(pa.table({"label": [0] * 8, "width": [16] * 8, "height": [12] * 8,
                             "image": pa.array(a_png, pa.binary())}), tmp_path / "a.parquet")
    pq.write_table(pa.table({"label": [1] * 8, "image": pa.array(b_png, pa.large_binary()),
                             "width": [16.0] * 8}), tmp_path / "b.parquet")
    m = raying.Manifest.scan(str(tmp_path))
    assert len(m) == 16
    mean = np.mean([len(b) for b in a_png + b_png])
    assert (m.sizes >= mean * 0.9).all() and (m.sizes <= mean * 1.5).all(), (m.sizes, mean)
    pipe = raying.Pipeline(m, transform=raying.ImageTransform(size=8, random_crop=False,
                                                              flip=False))
    got = {}
    for u in pipe.plan(0).units:
        unit, paths = pipe._fill(u)
        for block, _ in iter_unit(pipe._spec, unit, paths):
            for i, img in zip(block["id"], block["image"], strict=True):
                got[int(i)] = int(img[0, 0, 0])
    assert sorted(got) == list(range(16))
    assert [got[i] for i in range(16)] == list(range(0, 160, 10))
    pipe.close()
    # Pre-decoded pixels still need height/width/channels in every file.
    (tmp_path / "b.parquet").unlink()
    (tmp_path / "a.parquet").unlink()
    pix = pa.array([bytes(12)] * 4, pa.binary(12))
    pq.write_table(pa.table({"image": pix, "label": [0] * 4, "height": [2] * 4,
                             "width": [2] * 4, "channels": [3] * 4}), tmp_path / "a.parquet")
    pq.write_table(pa.table({"image": pix, "label": [0] * 4, "height": [2] * 4,
                             "width": [2] * 4}), tmp_path / "b.parquet")
    with pytest.raises(raying.DataError, match=r"b.parquet has no column 'channels'"):
        raying.Manifest.scan(str(tmp_path))
    # Encoded bytes beside a struct of them is still a mismatch.
    (tmp_path / "a.parquet").unlink()
    (tmp_path / "b.parquet").unlink()
    pq.write_table(pa.table({"image": pa.array(jpegs([0, 1]), pa.binary()), "label": [0, 1]}),
                   tmp_path / "a.parquet")
    struct = pa.array([{"bytes": b} for b in jpegs([0, 1])],
                      pa.struct([("bytes", pa.binary())]))
    pq.write_table(pa.table({"image": struct, "label": [0, 1]}), tmp_path / "b.parquet")
    with pytest.raises(raying.DataError, match=r"schema mismatch in column 'image'"):
        raying.Manifest.scan(str(tmp_path))


def test_the_class_names_a_pack_recorded_go_only_with_its_label_column(tmp_path):
    """raying pack records its label column's class names in the schema: an unlabelled scan
    or another label column of the same files must not carry them."""
    import json

    from raying.tools.datagen import encode

    img = encode(np.zeros((4, 4, 3), np.uint8), "png")
    table = pa.table({"image": [img] * 6, "label": [0, 1, 2, 0, 1, 2], "score": list(range(6))})
    table = table.replace_schema_metadata({b"raying.classes": json.dumps(["a", "b", "c"])})
    pq.write_table(table, tmp_path / "p.parquet")
    assert raying.Manifest.scan(str(tmp_path)).classes == ["a", "b", "c"]
    unlabelled = raying.Manifest.scan(str(tmp_path), label=None)
    assert unlabelled.classes is None and set(unlabelled.labels.tolist()) == {-1}
    other = raying.Manifest.scan(str(tmp_path), label="score")
    assert other.classes is None and other.labels.tolist() == list(range(6))


def test_a_hugging_face_class_label_names_the_integer_labels_of_its_column(tmp_path):
    """``datasets`` writes its features (a ClassLabel's names) in the schema's
    ``huggingface`` metadata: they name that column's integer labels."""
    import json

    from raying.tools.datagen import encode

    img = encode(np.zeros((4, 4, 3), np.uint8), "png")
    features = {"image": {"_type": "Image"},
                "fine": {"names": ["ant", "bee", "cat", "dog"], "_type": "ClassLabel"},
                "coarse": {"dtype": "int64", "_type": "Value"}}
    meta = {b"huggingface": json.dumps({"info": {"features": features}})}
    table = pa.table({"image": [img] * 6, "fine": [3, 0, 2, 1, 3, 0],
                      "coarse": [0, 1, 0, 1, 0, 1]}).replace_schema_metadata(meta)
    pq.write_table(table, tmp_path / "p.parquet")
    fine = raying.Manifest.scan(str(tmp_path), label="fine")
    assert fine.classes == ["ant", "bee", "cat", "dog"]
    assert fine.labels.tolist() == [3, 0, 2, 1, 3, 0]
    assert raying.Manifest.scan(str(tmp_path), label="coarse").classes is None  # a Value
    # Names that do not cover the labels are not used, and the scan says so.
    features["coarse"] = {"names": ["x"], "_type": "ClassLabel"}
    meta = {b"huggingface": json.dumps({"info": {"features": features}})}
    pq.write_table(table.replace_schema_metadata(meta), tmp_path / "p.parquet")
    with pytest.warns(UserWarning, match="names 1 classes, but label column 'coarse' holds "
                                         "label 1; the names are not used"):
        assert raying.Manifest.scan(str(tmp_path), label="coarse").classes is None


def test_scanning_a_saved_manifest_says_what_it_is(tmp_path):
    make_image_folder(tmp_path / "imgs", n=4, classes=2, size=(8, 8))
    m = raying.Manifest.scan(str(tmp_path / "imgs"))
    m.save(str(tmp_path / "m.parquet"))
    with pytest.raises(raying.DataError, match=r"m.parquet is a manifest .* "
                                               r"raying.Manifest.load"):
        raying.Manifest.scan(str(tmp_path / "m.parquet"))
    assert len(raying.Manifest.load(str(tmp_path / "m.parquet"))) == 4


def test_a_row_group_of_gigabytes_of_images_is_warned_about(tmp_path, monkeypatch):
    """Each read unit reads a row group's image column whole: a file written as one row group
    (pyarrow's and pandas' default) of many images costs its whole size per read."""
    from raying.dataset import scan

    _parquet(tmp_path / "big.parquet", n=40)
    monkeypatch.setattr(scan, "LARGE_ROW_GROUP_BYTES", 10)
    with pytest.warns(UserWarning, match=r"big.parquet: row group \d+ holds .* GiB of images.*"
                                         r"raying pack SRC DST"):
        raying.Manifest.scan(str(tmp_path), label=None)
    monkeypatch.setattr(scan, "LARGE_ROW_GROUP_BYTES", 1 << 30)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        raying.Manifest.scan(str(tmp_path), label=None)
