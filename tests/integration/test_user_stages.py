"""User stages and extra Parquet columns through real Ray: both paths, torch and tf."""

from __future__ import annotations

import numpy as np
import pytest

import raying
from tests.unit.read.test_stages import write_parquet_set

SIZE = 16
COLUMNS = ["caption", "n", "boxes"]


def make_stages():
    """A seeded colour shift, then an inversion that adds a column. Built here (not at module
    level) so that Ray ships them by value, whatever the workers can import."""
    def jitter(batch, rng, scale=20):
        shift = rng.integers(-scale, scale + 1, size=(len(batch["id"]), 1, 1, 3))
        batch["image"] = np.clip(batch["image"].astype(np.int16) + shift, 0,
                                 255).astype(np.uint8)
        return batch

    def invert(batch):
        batch["image"] = 255 - batch["image"]
        batch["caption_len"] = np.array([len(c) for c in batch["caption"]], dtype=np.int64)
        return batch

    return jitter, invert


@pytest.fixture(scope="module")
def parquet_set(tmp_path_factory):
    return write_parquet_set(tmp_path_factory.mktemp("pq"))


def staged_pipeline(root, *, seed=0, stages=True):
    m = raying.Manifest.scan(str(root), columns=COLUMNS)
    pipe = raying.Pipeline(m, transform=raying.ImageTransform(size=SIZE),
                           sampler=raying.UniformSampler(seed=seed),
                           config=raying.PipelineConfig(block_rows=8))
    if stages:
        jitter, invert = make_stages()
        pipe = pipe.map_batches(jitter, with_rng=True).map_batches(invert)
    return pipe


def by_id(batches, key):
    return {int(i): v for b in batches for i, v in zip(b["id"], b[key], strict=True)}


def test_chained_stages_and_columns_on_both_paths(parquet_set, ray_local):
    pipe = staged_pipeline(parquet_set)
    fast = list(pipe.iter_batches(batch_size=10, epoch=1))
    rd = list(pipe.dataset(1).iter_batches(batch_size=10, batch_format="numpy"))
    plain = staged_pipeline(parquet_set, stages=False)
    base = by_id(plain.iter_batches(batch_size=10, epoch=1), "image")
    fast_img, rd_img = by_id(fast, "image"), by_id(rd, "image")
    assert sorted(fast_img) == sorted(rd_img) == list(range(36))
    for i in range(36):
        np.testing.assert_array_equal(fast_img[i], rd_img[i])  # same pixels on both paths
        # Both stages ran, in order: undoing the inversion leaves a shift of at most 20.
        shift = (255 - fast_img[i]).astype(np.int16) - base[i]
        assert np.abs(shift).max() <= 20
    assert any(np.abs((255 - fast_img[i]).astype(np.int16) - base[i]).max() > 0
               for i in range(36))
    for batches in (fast, rd):
        assert by_id(batches, "caption") == {i: f"sample {i}" for i in range(36)}
        assert by_id(batches, "caption_len") == {i: len(f"sample {i}") for i in range(36)}
        assert by_id(batches, "n") == {i: 10 * i for i in range(36)}
        for i, row in by_id(batches, "boxes").items():
            np.testing.assert_array_equal(np.asarray(row, np.float32),
                                          np.full(i % 4, i + 0.5, np.float32))
    # Same seed and epoch: same pixels from a new pipeline; another epoch: others.
    again = by_id(staged_pipeline(parquet_set).iter_batches(batch_size=10, epoch=1), "image")
    other = by_id(staged_pipeline(parquet_set).iter_batches(batch_size=10, epoch=2), "image")
    assert all(np.array_equal(again[i], fast_img[i]) for i in range(36))
    assert sum(np.array_equal(other[i], fast_img[i]) for i in range(36)) < 3
    pipe.close()
    plain.close()


def test_extra_columns_in_torch_and_tf_batches(parquet_set, ray_local):
    torch = pytest.importorskip("torch")
    pipe = staged_pipeline(parquet_set, stages=False)
    got = {}
    for b in pipe.iter_torch_batches(batch_size=7, epoch=0, device="cpu", normalize=False):
        assert isinstance(b["caption"], list) and b["n"].dtype == torch.int64
        assert isinstance(b["boxes"], list) and all(t.dtype == torch.float32 for t in b["boxes"])
        for k, i in enumerate(b["id"].tolist()):
            got[i] = (b["caption"][k], int(b["n"][k]), b["boxes"][k].tolist())
    assert got == {i: (f"sample {i}", 10 * i, [i + 0.5] * (i % 4)) for i in range(36)}

    tf = pytest.importorskip("tensorflow")
    got = {}
    for b in pipe.to_tf(batch_size=7, epoch=0):
        assert b["caption"].dtype == tf.string and b["n"].dtype == tf.int64
        assert isinstance(b["boxes"], tf.RaggedTensor) and b["boxes"].dtype == tf.float32
        for k, i in enumerate(b["id"].numpy().tolist()):
            got[i] = (b["caption"][k].numpy().decode(), int(b["n"][k]),
                      b["boxes"][k].numpy().tolist())
    assert got == {i: (f"sample {i}", 10 * i, [i + 0.5] * (i % 4)) for i in range(36)}
    pipe.close()


def test_columns_under_keys_of_their_own_on_both_paths_and_tf(tmp_path, ray_local):
    """The source's own ``id`` and ``weight`` columns, carried as ``source_id`` and
    ``sample_weight``, beside raying's dense ids and importance weights."""
    tf = pytest.importorskip("tensorflow")
    from tests.unit.read.test_stages import _with_own_ids

    root = _with_own_ids(tmp_path / "src")
    m = raying.Manifest.scan(str(root), columns={"id": "source_id", "weight": "sample_weight"})
    pipe = raying.Pipeline(m, transform=raying.ImageTransform(size=SIZE),
                           sampler=raying.UniformSampler(seed=0),
                           config=raying.PipelineConfig(block_rows=8))
    want = {i: (f"img-{i:05d}", i / 4) for i in range(36)}
    for batches in (pipe.iter_batches(batch_size=10, epoch=0),
                    pipe.dataset(0).iter_batches(batch_size=10, batch_format="numpy")):
        got = {}
        for b in batches:
            assert b["id"].dtype == np.int64 and (b["weight"] == 1).all()
            for i, s, w in zip(b["id"], b["source_id"], b["sample_weight"], strict=True):
                got[int(i)] = (str(s), float(w))
        assert got == want
    got = {}
    for b in pipe.to_tf(batch_size=10, epoch=0):
        assert b["source_id"].dtype == tf.string and b["sample_weight"].dtype == tf.float64
        for k, i in enumerate(b["id"].numpy().tolist()):
            got[i] = (b["source_id"][k].numpy().decode(), float(b["sample_weight"][k]))
    assert got == want
    pipe.close()


def test_to_tf_carries_what_stages_add_and_soft_labels(parquet_set, ray_local):
    """The tf signature follows the stages' first batch: added columns (numbers, numpy
    strings, per-row lists) and a label made float (n, 3) arrive as they were returned."""
    tf = pytest.importorskip("tensorflow")

    def soften(batch):
        n = len(batch["id"])
        soft = np.full((n, 3), 0.1, np.float32)
        soft[np.arange(n), batch["label"]] = 0.8
        batch["label"] = soft
        batch["twice"] = batch["id"] * 2.0
        batch["name"] = np.array([f"s{i}" for i in batch["id"]])
        batch["tags"] = np.array([[f"a{i}", f"b{i}"] for i in batch["id"]])  # (n, 2) strings
        rows = np.empty(n, dtype=object)
        rows[:] = [np.arange(i % 3, dtype=np.int32) for i in batch["id"]]
        batch["steps"] = rows
        return batch

    pipe = staged_pipeline(parquet_set, stages=False).map_batches(soften)
    for epoch in range(2):
        got = {}
        for b in pipe.to_tf(batch_size=7, epoch=epoch):
            assert b["label"].dtype == tf.float32 and b["label"].shape[1:] == (3,)
            assert isinstance(b["steps"], tf.RaggedTensor) and b["steps"].dtype == tf.int32
            for k, i in enumerate(b["id"].numpy().tolist()):
                got[i] = (int(np.argmax(b["label"][k])), float(b["twice"][k]),
                          b["name"][k].numpy().decode(), b["steps"][k].numpy().tolist(),
                          [t.decode() for t in b["tags"][k].numpy().tolist()])
        assert got == {i: (i % 3, 2.0 * i, f"s{i}", list(range(i % 3)), [f"a{i}", f"b{i}"])
                       for i in range(36)}
    pipe.close()


def test_to_tf_follows_stages_that_retype_pad_or_drop_parquet_columns(parquet_set, ray_local):
    """A Parquet column a stage casts, pads to a fixed width or drops arrives in tf as the
    stage returns it (as in torch), and the batch read to learn the signature is neither
    counted in stats() nor moves the resume position."""
    tf = pytest.importorskip("tensorflow")

    def retype(batch):
        batch["n"] = batch["n"].astype(np.float32) / 10  # int64 -> float32
        padded = np.zeros((len(batch["id"]), 3), np.float32)  # ragged -> (n, 3)
        for k, row in enumerate(batch["boxes"]):
            padded[k, :len(row)] = row
        batch["boxes"] = padded
        del batch["caption"]
        return batch

    pipe = staged_pipeline(parquet_set, stages=False).map_batches(retype)
    ds = pipe.to_tf(batch_size=7, epoch=0)
    before = pipe.stats(sampling=False)
    assert before["rows_delivered"] == 0 and before["rows_read"] == 0
    assert before["units"] == 0 and before["io"]["io_bytes_fetched"] == 0
    assert pipe.state_dict()["delivered"] == 0
    got = {}
    for b in ds:
        assert "caption" not in b
        assert b["n"].dtype == tf.float32 and b["boxes"].shape[1:] == (3,)
        for k, i in enumerate(b["id"].numpy().tolist()):
            got[i] = (float(b["n"][k]), b["boxes"][k].numpy().tolist())
    assert got == {i: (float(np.float32(10 * i) / 10),
                       [i + 0.5] * (i % 4) + [0.0] * (3 - i % 4)) for i in range(36)}
    after = pipe.stats(sampling=False)
    assert after["rows_delivered"] == 36 and after["rows_read"] == 36
    pipe.close()


def test_to_tf_refuses_by_name_rows_it_would_truncate_and_strings_that_are_none(parquet_set,
                                                                               ray_local):
    """After the first batch fixed the signature, a later batch whose per-row arrays are
    float where the signature says int, or whose string column holds None, stops with an
    error naming the column (not a silent cast to int, not tf's own error; tf.data carries
    an error of the generator as its InvalidArgumentError, with raying's message)."""
    tf = pytest.importorskip("tensorflow")

    def later_floats(batch):
        rows = np.empty(len(batch["id"]), dtype=object)
        rows[:] = [np.array([i, 2 * i]) if i < 7 else np.array([i + 0.5]) for i in batch["id"]]
        batch["boxes"] = rows
        return batch

    def empty_rows(batch):  # "no boxes" as np.array([]), a float64 beside int rows
        rows = np.empty(len(batch["id"]), dtype=object)
        rows[:] = [np.array([]) if i % 5 == 4 else np.array([i]) for i in batch["id"]]
        batch["cls"] = rows
        return batch

    m = raying.Manifest.scan(str(parquet_set), columns=COLUMNS)
    pipe = raying.Pipeline(m, transform=raying.ImageTransform(size=SIZE),
                           sampler=raying.UniformSampler(seed=0, shuffle=False),
                           config=raying.PipelineConfig(block_rows=8)).map_batches(empty_rows)
    got = {}
    for b in pipe.to_tf(batch_size=7, epoch=0):
        assert b["cls"].dtype == tf.int64
        for k, i in enumerate(b["id"].numpy().tolist()):
            got[i] = b["cls"][k].numpy().tolist()
    pipe.close()
    assert got == {i: [] if i % 5 == 4 else [i] for i in range(36)}

    def later_none(batch):
        batch["caption"] = np.array([c if i < 7 else None for c, i in
                                     zip(batch["caption"], batch["id"], strict=True)],
                                    dtype=object)
        return batch

    def later_wider(batch):  # int32 rows in the first batch, then int64 ones past int32
        rows = np.empty(len(batch["id"]), dtype=object)
        rows[:] = [np.array([i], np.int32) if i < 7 else np.array([2**40 + i], np.int64)
                   for i in batch["id"]]
        batch["boxes"] = rows
        return batch

    for fn, match in ((later_floats, r"column 'boxes' has rows of float64 .* holds int64"),
                      (later_wider, r"column 'boxes' has rows of int64 .* holds int32"),
                      (later_none, r"column 'caption' holds None")):
        m = raying.Manifest.scan(str(parquet_set), columns=COLUMNS)
        pipe = raying.Pipeline(m, transform=raying.ImageTransform(size=SIZE),
                               sampler=raying.UniformSampler(seed=0, shuffle=False),
                               config=raying.PipelineConfig(block_rows=8)).map_batches(fn)
        with pytest.raises((raying.ConfigError, tf.errors.InvalidArgumentError), match=match):
            for _ in pipe.to_tf(batch_size=7, epoch=0):
                pass
        pipe.close()


def test_per_row_arrays_stay_lists_on_the_ray_data_path_whatever_their_lengths(parquet_set,
                                                                                ray_local):
    """Ray Data turns an object column into a fixed-shape tensor in a block whose rows have
    one length: the dataset path hands them over as lists, one 1-D array per row, always."""
    def steps(batch):  # every row 2 long for ids of the first file, 2 or 3 for the others
        rows = np.empty(len(batch["id"]), dtype=object)
        rows[:] = [np.arange(2 if i < 20 else 2 + i % 2, dtype=np.int32) for i in batch["id"]]
        batch["steps"] = rows
        return batch

    # One row group (6 rows) a block: blocks of the first file hold rows of one length.
    m = raying.Manifest.scan(str(parquet_set), columns=COLUMNS)
    pipe = raying.Pipeline(m, transform=raying.ImageTransform(size=SIZE),
                           sampler=raying.UniformSampler(seed=0, window_row_groups=1),
                           config=raying.PipelineConfig(block_rows=8)).map_batches(steps)
    seen = 0
    for b in pipe.dataset(0).iter_batches(batch_size=None, batch_format="numpy"):
        for name in ("boxes", "steps"):
            assert b[name].dtype == object and b[name].shape == (len(b["id"]),), (name, b[name])
        for i, box, step in zip(b["id"], b["boxes"], b["steps"], strict=True):
            np.testing.assert_array_equal(box, np.full(i % 4, i + 0.5, np.float32))
            assert step.dtype == np.int32 and len(step) in (2, 3)
            seen += 1
    assert seen == 36
    pipe.close()


def test_a_raising_stage_stops_both_paths_naming_itself_epoch_and_ids(parquet_set, ray_local,
                                                                       caplog):
    def scale_boxes(batch):
        batch["boxes"] = batch["boxes"] * 2.0  # object array of arrays: fine; then:
        raise ValueError("boxes must be normalised first")

    m = raying.Manifest.scan(str(parquet_set), columns=COLUMNS)
    pipe = raying.Pipeline(m, transform=raying.ImageTransform(size=SIZE), on_error="skip",
                           config=raying.PipelineConfig(block_rows=8)).map_batches(scale_boxes)
    # block_rows=8: a call sees 8 rows, and the error names all of them.
    pattern = (r"map_batches function .*scale_boxes raised ValueError: boxes must be "
               r"normalised first \(epoch 3, ids \[\d+(, \d+){7}\]\)")
    with caplog.at_level("WARNING", logger="raying"), \
            pytest.raises(raying.UserFunctionError, match=pattern) as info:
        list(pipe.iter_batches(batch_size=8, epoch=3))
    assert 'raise ValueError("boxes must be normalised first")' in str(info.value)
    # The same function failing in the other read tasks (epoch 4's read ahead too) is the
    # raised error's bug: not logged again as other failures.
    assert "scale_boxes" not in caplog.text, caplog.text
    with pytest.raises(raying.UserFunctionError, match=pattern) as info:
        list(pipe.dataset(3).iter_batches(batch_size=8))
    assert 'raise ValueError("boxes must be normalised first")' in str(info.value)
    assert pipe.stats(sampling=False)["skipped_count"] == 0  # a bug is not a bad sample
    pipe.close()


def test_a_stage_whose_module_the_workers_cannot_import_stops_both_paths_by_name(
        parquet_set, ray_local, tmp_path, monkeypatch):
    """A function from a module only the driver can import (a local module a cluster's
    nodes lack: here its folder joins sys.path after the workers started). The dataset
    path retried its read tasks without end; the iterator's error named no function."""
    import sys

    (tmp_path / "driver_only_stages.py").write_text("def keep(batch):\n    return batch\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "driver_only_stages", raising=False)
    import driver_only_stages

    m = raying.Manifest.scan(str(parquet_set), columns=COLUMNS)
    pipe = raying.Pipeline(m, transform=raying.ImageTransform(size=SIZE),
                           config=raying.PipelineConfig(block_rows=8))
    pipe = pipe.map_batches(driver_only_stages.keep)
    pattern = (r"map_batches function driver_only_stages\.keep cannot be loaded in the read "
               r"worker \(ModuleNotFoundError: No module named 'driver_only_stages'\).*"
               r"runtime_env.*\(epoch 1, ids \[")
    try:
        with pytest.raises(raying.UserFunctionError, match=pattern):
            list(pipe.iter_batches(batch_size=8, epoch=1))
        with pytest.raises(raying.UserFunctionError, match=pattern):
            list(pipe.dataset(1).iter_batches(batch_size=8))
    finally:
        pipe.close()
        sys.modules.pop("driver_only_stages", None)


def test_read_tasks_whose_rows_were_all_set_aside_keep_the_stage_columns(tmp_path, ray_local):
    """On the dataset path, a read task with no good row yields no block (a stage's columns
    are unknown without rows): every batch carries the column the stage adds, and every good
    row arrives."""
    import pathlib

    from raying.tools.datagen import make_image_folder

    root = make_image_folder(tmp_path, n=48, classes=2, size=(24, 20), seed=3,
                             formats=("jpg",))
    files = sorted(pathlib.Path(root).rglob("*.jpg"))
    for f in files[:40]:  # blocks of 4 rows: most read tasks have no good row
        f.write_bytes(b"not a jpeg")

    def tag(batch):
        batch["extra"] = batch["label"].astype(np.float32) + 0.5
        return batch

    pipe = raying.Pipeline(raying.Manifest.scan(root), transform=raying.ImageTransform(size=SIZE),
                           on_error="skip",
                           config=raying.PipelineConfig(block_rows=4)).map_batches(tag)
    try:
        got = list(pipe.dataset(0).iter_batches(batch_size=3, batch_format="numpy"))
        assert sum(len(b["id"]) for b in got) == 8
        for b in got:
            np.testing.assert_array_equal(b["extra"], b["label"] + 0.5)
    finally:
        pipe.close()


def test_stage_output_ray_data_would_change_is_refused_on_the_dataset_path_too(parquet_set,
                                                                               ray_local):
    # Ray Data merges the blocks of its read tasks: a column missing from some is filled
    # with nulls, dtypes are unified, None turns into NaN, complex into Python objects.
    # Every path stops such output with the same error instead.
    def retype(batch):  # the dtype of "score" depends on which rows a call got
        low = int(batch["id"].min()) < len(batch["id"]) * 2
        batch["score"] = np.zeros(len(batch["id"]), np.int64 if low else np.float32)
        return batch

    def sometimes(batch):  # a column only some calls return
        if int(batch["id"].min()) % 2 == 0:
            batch["extra"] = np.ones(len(batch["id"]), np.float32)
        return batch

    def nones(batch):
        batch["maybe"] = np.array([None] * len(batch["id"]), dtype=object)
        return batch

    def complexes(batch):
        batch["z"] = np.ones(len(batch["id"]), np.complex64)
        return batch

    def text_and_bytes(batch):  # Arrow would make every row bytes
        rows = np.empty(len(batch["id"]), dtype=object)
        rows[:] = [f"s{i}" if i % 2 else b"b" for i in batch["id"]]
        batch["tag"] = rows
        return batch

    def text_or_bytes(batch):  # str rows in some blocks, bytes in others: bytes throughout
        rows = np.empty(len(batch["id"]), dtype=object)
        odd = int(batch["id"].min()) % 2
        rows[:] = [b"b" if odd else "s" for _ in batch["id"]]
        batch["tag"] = rows
        return batch

    def days(batch):  # Arrow has no day unit: Ray Data would hand back datetime64[s]
        batch["day"] = np.full(len(batch["id"]), np.datetime64("2026-01-02", "D"))
        return batch

    def row_dtypes(batch):  # per-row arrays of float32 for some calls, float64 for others
        low = int(batch["id"].min()) < len(batch["id"]) * 2
        rows = np.empty(len(batch["id"]), dtype=object)
        for i in range(len(rows)):
            rows[i] = np.zeros(i % 3 + 1, np.float32 if low else np.float64)
        batch["rows"] = rows
        return batch

    m = raying.Manifest.scan(str(parquet_set), columns=COLUMNS)
    cases = ((retype, r"returned column 'score' as \w+ of row shape \(\) for some rows and "),
             (sometimes, r"returned columns \[.*\] for some blocks and \[.*\] for others"),
             (nones, r"returned column 'maybe' with None in it"),
             (complexes, r"returned column 'z' as complex64"),
             (text_and_bytes, r"returned column 'tag' mixing str and bytes"),
             (text_or_bytes, r"returned column 'tag' with rows of (str|bytes) for some blocks "
                             r"and of (str|bytes) for others"),
             (days, r"returned column 'day' as datetime64\[D\], .* return it as "
                    r"datetime64\[s\]"),
             (row_dtypes, r"returned column 'rows' with rows of 1-D float\d\d arrays for some "
                          r"blocks and of 1-D float\d\d arrays for others"))
    for fn, problem in cases:
        pipe = raying.Pipeline(m, transform=raying.ImageTransform(size=SIZE),
                               config=raying.PipelineConfig(block_rows=8)).map_batches(fn)
        pattern = rf"map_batches function .*{fn.__name__} {problem}"
        if fn in (retype, sometimes):  # the iterator path refuses these as it joins blocks
            with pytest.raises(raying.UserFunctionError, match=pattern):
                list(pipe.iter_batches(batch_size=8, epoch=0))
        with pytest.raises(raying.UserFunctionError, match=pattern):
            list(pipe.dataset(0).iter_batches(batch_size=8))
        pipe.close()

    def millis(batch):  # a unit Arrow has: carried as it is
        batch["at"] = np.full(len(batch["id"]), np.datetime64("2026-01-02T03:04:05.678", "ms"))
        return batch

    pipe = raying.Pipeline(m, transform=raying.ImageTransform(size=SIZE)).map_batches(millis)
    got = [b["at"] for b in pipe.dataset(0).iter_batches(batch_size=8)]
    assert {a.dtype for a in got} == {np.dtype("datetime64[ms]")}
    assert (np.concatenate(got) == np.datetime64("2026-01-02T03:04:05.678", "ms")).all()
    pipe.close()


def test_a_stage_that_imports_torch_shows_in_the_workers_memory(parquet_set, ray_local):
    """Read workers import what a stage needs; the cost shows in pipe.stats()["memory"]."""
    def plain(batch):
        batch["image"] = 255 - batch["image"]
        return batch

    def with_torch(batch):
        import torch  # imported in the read worker, at the first call

        batch["image"] = torch.from_numpy(batch["image"]).flip(2).numpy()
        return batch

    def worker_mb(fn):
        pipe = staged_pipeline(parquet_set, stages=False).map_batches(fn)
        rows = sum(len(b["id"]) for b in pipe.iter_batches(batch_size=16, epoch=0))
        mem = pipe.stats()["memory"]
        pipe.close()
        assert rows > 0 and mem["read_workers"] >= 1, mem
        return mem["read_worker_mb_max"], mem["read_worker_frameworks"]

    # numpy first: the same worker processes then import torch for the second pipeline.
    (before, _), (after, frameworks) = worker_mb(plain), worker_mb(with_torch)
    assert after >= before + 50, (before, after)
    # every worker that ran the stage names torch as what it loaded
    assert frameworks and all("torch" in names for names in frameworks.values()), frameworks


def _call_mean(batch):
    """No rng, but looks across the rows of its call: each row's green channel becomes the
    call's mean pixel, so rows grouped otherwise come out otherwise."""
    image = batch["image"].copy()
    image[..., 1] = int(batch["image"].mean())
    batch["image"] = image
    return batch


def test_a_stage_sees_the_same_rows_together_whatever_the_batch_size(tmp_path, ray_local):
    from raying.tools.datagen import make_image_folder

    root = make_image_folder(tmp_path, n=640, classes=2, size=(24, 20), seed=3,
                             formats=("jpg",))
    # Units of 80 rows: the first block of each of the epoch's first units is cut short, at
    # whole batches where the stages' 16-row chunks allow (64 rows for batches of 12, not 72,
    # which would split the chunk of rows 64-80 between two calls).
    pipe = raying.Pipeline(raying.Manifest.scan(root), transform=raying.ImageTransform(size=16),
                           config=raying.PipelineConfig(block_rows=80)).map_batches(_call_mean)
    try:
        assert pipe.block_rows() == 80
        ref = {int(i): im.copy() for b in pipe.dataset(0).iter_batches(
            batch_size=64, batch_format="numpy") for i, im in zip(b["id"], b["image"],
                                                                  strict=True)}
        assert len(ref) == 640
        for batch_size in (12, 100, 64):
            got = {int(i): im.copy() for b in pipe.iter_batches(batch_size=batch_size, epoch=0)
                   for i, im in zip(b["id"], b["image"], strict=True)}
            differ = [i for i in ref if not np.array_equal(ref[i], got[i])]
            assert not differ, (batch_size, len(differ))
    finally:
        pipe.close()


def test_a_stage_sees_the_same_rows_together_in_parquet_units_of_several_blocks(tmp_path,
                                                                                ray_local):
    """Units of 200 Parquet rows read as blocks of 100 (not a multiple of the stages'
    16-row chunks): a short first block moved every later block edge of the iterator's
    first units, and with them the chunks a stage sees together (128 of 1,600 rows
    differed from dataset(e)'s, at batches of 8)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from raying.tools.datagen import encode

    rng = np.random.default_rng(5)
    images = [encode(rng.integers(0, 255, (24, 24, 3), dtype=np.uint8), "jpg")
              for _ in range(1600)]
    table = pa.table({"image": pa.array(images, pa.binary()),
                      "label": pa.array(np.arange(1600) % 3, pa.int64())})
    (tmp_path / "pq").mkdir()
    pq.write_table(table, tmp_path / "pq" / "part-0.parquet", row_group_size=50)
    m = raying.Manifest.scan(str(tmp_path / "pq"))

    def pipeline():
        return raying.Pipeline(m, transform=raying.ImageTransform(size=16),
                               sampler=raying.UniformSampler(seed=0),
                               config=raying.PipelineConfig(block_rows=100)
                               ).map_batches(_call_mean)

    pipe = pipeline()
    try:
        assert {u.num_rows for u in pipe.plan(0).units} == {200}
        ref = {int(i): im.copy() for b in pipe.dataset(0).iter_batches(
            batch_size=64, batch_format="numpy") for i, im in zip(b["id"], b["image"],
                                                                  strict=True)}
    finally:
        pipe.close()
    assert len(ref) == 1600
    for batch_size in (8, 256):
        pipe = pipeline()
        try:
            got = {int(i): im.copy() for b in pipe.iter_batches(batch_size=batch_size, epoch=0)
                   for i, im in zip(b["id"], b["image"], strict=True)}
        finally:
            pipe.close()
        differ = [i for i in ref if not np.array_equal(ref[i], got[i])]
        assert not differ, (batch_size, len(differ))


SLOW_FAILURES = """
import os, sys, time
import numpy as np
import ray
import raying
import raying.engine.stream as stream

stream.DEFAULT_READ_OUT_S = 0.5  # the stopped epoch's other tasks outlive the read-out wait
root, flag = sys.argv[1], sys.argv[2]


def flaky(batch, fast, flag):
    if os.path.exists(flag):
        if not np.isin(batch["id"], fast).any():
            time.sleep(2.5)
        raise RuntimeError("storage went away")
    time.sleep(0.4)  # the rerun still reads when the stopped epoch's tasks fail
    return batch


ray.init(address="local", include_dashboard=False, num_cpus=2)
m = raying.Manifest.scan(root)
cfg = raying.PipelineConfig(block_rows=8, keep_warm=False, decoded_cache="off")
plain = raying.Pipeline(m, transform=raying.ImageTransform(size=8), config=cfg)
fast = plain.plan(0).units[0].ids
plain.close()
pipe = raying.Pipeline(m, transform=raying.ImageTransform(size=8), config=cfg).map_batches(
    flaky, fn_kwargs={"fast": fast, "flag": flag})
try:
    for _ in pipe.iter_batches(batch_size=8, epoch=0):
        pass
except raying.UserFunctionError as exc:
    print("stopped:", "storage went away" in str(exc), flush=True)
    print("held:", len(pipe._stream._unread), flush=True)  # still running, not dropped
os.remove(flag)
print("rerun rows:", sum(len(b["id"]) for b in pipe.iter_batches(batch_size=8, epoch=0)),
      flush=True)
time.sleep(3)  # the stopped epoch's tasks fail meanwhile
print("epoch 1 rows:", sum(len(b["id"]) for b in pipe.iter_batches(batch_size=8, epoch=1)),
      flush=True)
for _ in range(100):  # read once they finished (a busy machine may start them late)
    if not pipe._stream._unread:
        break
    time.sleep(0.2)
    pipe._stream._reap_unread()
print("still held:", len(pipe._stream._unread), flush=True)
pipe.close()
time.sleep(1)
ray.shutdown()
"""


def test_a_stopped_epochs_slow_tasks_are_read_not_printed_as_unhandled(tmp_path):
    # After an epoch stopped, its tasks still running past the read-out wait were dropped;
    # each one's error surfaced later as Ray's "Unhandled error" traceback in the middle of
    # the user's rerun (a trial's S3 outage of 20 s: 2 such tracebacks, 2 of 2 runs). They
    # are held now and read once they finish.
    import os
    import subprocess
    import sys

    from raying.tools.datagen import make_image_folder

    root = make_image_folder(tmp_path / "img", n=48, classes=2, size=(12, 12))
    flag = tmp_path / "failing"
    flag.write_text("")
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    out = subprocess.run([sys.executable, "-c", SLOW_FAILURES, str(root), str(flag)],
                         capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "stopped: True" in out.stdout and "rerun rows: 48" in out.stdout, out.stdout
    assert "epoch 1 rows: 48" in out.stdout, out.stdout
    held = int(out.stdout.split("held: ")[1].split()[0])
    assert held >= 1 and "still held: 0" in out.stdout, out.stdout
    text = out.stdout + out.stderr
    assert "Unhandled error" not in text, text[-3000:]


def test_to_tf_refuses_an_epoch_of_no_batch_when_stages_give_its_signature(parquet_set,
                                                                           ray_local):
    """With drop_last and fewer rows than a batch the stages' signature has no batch to come
    from: refused by name (the built-in signature it fell back to made Keras fail on a soft
    label's rank)."""
    pytest.importorskip("tensorflow")

    def soft(batch):
        batch["label"] = np.eye(3, dtype=np.float32)[batch["label"] % 3]
        return batch

    m = raying.Manifest.scan(str(parquet_set), columns=COLUMNS)
    pipe = raying.Pipeline(m, transform=raying.ImageTransform(size=SIZE)).map_batches(soft)
    with pytest.raises(raying.ConfigError, match=r"to_tf: epoch 0 has fewer rows than "
                                                 r"batch_size=64 \(drop_last=True\)"):
        pipe.to_tf(batch_size=64, epoch=0, drop_last=True)
    pipe.close()


def test_to_tf_of_an_empty_share_under_stages_is_an_empty_dataset(image_folder, ray_local,
                                                                  caplog):
    """A Train worker whose share of a sharded epoch is empty gets an empty dataset and the
    empty share's warning, not the refusal of an epoch of no batch (its advice is not this
    case's)."""
    import dataclasses
    import logging

    pytest.importorskip("tensorflow")
    m = raying.Manifest.scan(str(image_folder))  # 60 rows: 4 units of 16 for 8 shares
    cfg = dataclasses.replace(raying.PipelineConfig(block_rows=16), shard=(6, 8))
    pipe = raying.Pipeline(m, transform=raying.ImageTransform(size=16),
                           config=cfg).map_batches(_same)
    with caplog.at_level(logging.WARNING, logger="raying"):
        assert sum(1 for _ in pipe.to_tf(batch_size=8, epoch=0)) == 0
    assert any("worker 6 of 8 got no rows" in r.getMessage() for r in caplog.records)
    pipe.close()


def _same(batch):
    return batch


def _slow(batch):
    import time

    time.sleep(1.0)
    return batch


def test_a_block_waited_on_long_is_said_and_still_delivered(image_folder, ray_local, caplog,
                                                            monkeypatch):
    """A read task that neither finishes nor fails (a storage read that hangs; here a stage
    that blocks) is said in a warning while the iteration waits, naming the epoch and unit;
    the iteration still delivers every row once it comes."""
    import logging

    import raying.engine.stream as stream

    monkeypatch.setattr(stream, "STALL_WARN_S", 0.3)
    m = raying.Manifest.scan(str(image_folder))
    pipe = raying.Pipeline(m, transform=raying.ImageTransform(size=16),
                           config=raying.PipelineConfig(block_rows=32)).map_batches(_slow)
    try:
        with caplog.at_level(logging.WARNING, logger="raying"):
            ids = np.concatenate([b["id"] for b in pipe.iter_batches(batch_size=16, epoch=0)])
        assert sorted(ids.tolist()) == list(range(len(m)))
        said = [r.getMessage() for r in caplog.records if "has waited" in r.getMessage()]
        assert said and all(w.startswith("raying: epoch 0 has waited") for w in said)
        assert "read unit" in said[0] and "goes on waiting" in said[0]
    finally:
        pipe.close()


def test_a_closed_pipelines_waits_are_not_said(image_folder, ray_local, caplog, monkeypatch):
    """A loop left early, then the pipeline closed while its reader thread still waits on
    a slow read: the thread stops there, and says nothing more (it went on saying it waited,
    during close() and after)."""
    import logging
    import time

    import raying.engine.stream as stream

    monkeypatch.setattr(stream, "STALL_WARN_S", 0.3)
    m = raying.Manifest.scan(str(image_folder))
    cfg = raying.PipelineConfig(block_rows=16)
    first = [int(i) for i in raying.Pipeline(m, config=cfg).plan(0).units[0].ids]
    pipe = raying.Pipeline(m, transform=raying.ImageTransform(size=16), config=cfg)
    pipe = pipe.map_batches(_slower, fn_kwargs={"fast": first})
    with caplog.at_level(logging.WARNING, logger="raying"):
        it = pipe.iter_batches(batch_size=16, epoch=0, prefetch_batches=4)
        next(it)  # the first unit is fast; the reader thread goes on to wait for the next
        it.close()
        time.sleep(0.5)
        before = sum("has waited" in r.getMessage() for r in caplog.records)
        pipe.close()  # waits for the read still running (~2.5 s more)
        time.sleep(1.0)
        # (one may be on its way as close() begins)
        assert sum("has waited" in r.getMessage() for r in caplog.records) <= before + 1


def _slower(batch, fast=()):
    import time

    if not set(batch["id"].tolist()) & set(fast):
        time.sleep(3.0)
    return batch
