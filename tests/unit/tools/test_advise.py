"""Unit tests of `raying advise`'s decision table on given measurements (no I/O, no Ray)."""

from __future__ import annotations

import pytest

import raying
from raying.options import epoch_block_rows as raying_epoch_block_rows
from raying.tools.advise import format_report, recommend

GIB = 1024**3


def _data(**kw):
    base = {"format": "images", "files": 100_000, "samples": 100_000, "bytes": 10 * GIB,
            "file_bytes_p10": 60_000, "file_bytes_p50": 100_000, "file_bytes_p90": 160_000,
            "sample_bytes": 100_000, "pre_decoded": False}
    base.update(kw)
    return base


def _store(**kw):
    base = {"kind": "s3", "simulated": False, "latency_s": 0.03, "whole_file_s": 0.032,
            "latency_share": 0.94, "bandwidth_bytes_per_s": 1e6,
            "bandwidth_from": "parallel small reads (a lower bound)",
            "serial_files_per_s": 31.0, "parallel_files_per_s": 450.0,
            "parallel_speedup": 14.5, "probe_reads": 49}
    base.update(kw)
    return base


def _machine(**kw):
    base = {"cores": 8, "memory_bytes": 64 * GIB, "memory_available_bytes": 48 * GIB,
            "shm_free_bytes": 32 * GIB, "disk_free_bytes": 500 * GIB, "disk_dir": "/tmp",
            "gpus": 0, "gpu_name": None, "decode_ms_per_image": 2.0}
    base.update(kw)
    return base


def _advice(data, store, machine):
    advice, config = recommend(data, store, machine)
    return {a["setting"]: a for a in advice}, config


def test_s3_small_files_pack_cache_and_many_reads_in_flight():
    a, config = _advice(_data(), _store(), _machine())
    assert a["pack"]["value"].startswith("yes")
    assert "94% of reading it whole" in a["pack"]["reason"]
    assert a["read_concurrency"]["value"] == 64
    assert a["cache"]["value"].startswith("memory 10.0 GiB")  # the dataset fits in memory
    assert config["io"]["cache"]["disk_bytes"] == 0
    # Room for every file's entry, its header included: the whole dataset is admitted.
    from raying.read.cache.entry import entry_bytes

    assert config["io"]["cache"]["memory_bytes"] == 10 * GIB + 100_000 * entry_bytes(0)
    assert "fits the memory tier" in a["cache"]["reason"]


def test_fast_local_storage_keeps_the_defaults():
    store = _store(kind="local", latency_s=2e-5, whole_file_s=1e-4, latency_share=0.2,
                   bandwidth_bytes_per_s=2e9, bandwidth_from="one 8.0 MiB read",
                   parallel_speedup=1.1)
    a, config = _advice(_data(files=500, samples=500, bytes=50 * 2**20), store, _machine())
    assert a["pack"]["value"] == "no" and a["cache"]["value"] == "none"
    assert a["read_concurrency"]["value"] == 1 and config["io"]["cache"] is None
    assert a["window"]["value"] == 16


def test_local_parquet_of_one_large_file_keeps_the_defaults():
    """One 8 MiB file in the page cache: read whole in 4.7 ms (not "within 1 ms"), and the
    parallel probe reads the one file (no gain: "serial"); its first byte and bandwidth still
    make it fast local storage, not a serial device to put a cache in front of."""
    data = _data(format="parquet", files=1, samples=1500, bytes=8 * 2**20,
                 rows_per_row_group=256, row_group_bytes=1400 * 1024, sample_bytes=5500)
    store = _store(kind="local", latency_s=4e-5, whole_file_s=4.7e-3, latency_share=0.01,
                   bandwidth_bytes_per_s=1.9e9, bandwidth_from="one 8.0 MiB read",
                   parallel_speedup=1.0)
    a, config = _advice(data, store, _machine(cores=2))
    assert a["cache"]["value"] == "none" and config["io"]["cache"] is None
    assert a["read_concurrency"]["value"] == 1 and a["window"]["value"] == 4
    # The same reads behind a slow first byte (a disk head, a network filesystem) are not.
    a, config = _advice(data, dict(store, latency_s=2e-3), _machine(cores=2))
    assert a["cache"]["value"] != "none" and a["read_concurrency"]["value"] == 2
    assert "one request at a time" in a["read_concurrency"]["reason"]
    assert a["window"]["value"] == 2


def test_a_small_image_set_gets_blocks_that_give_every_read_task_of_the_window_rows():
    store = _store(kind="local", latency_s=2e-5, whole_file_s=1e-4, latency_share=0.2,
                   bandwidth_bytes_per_s=2e9, bandwidth_from="one 8.0 MiB read",
                   parallel_speedup=1.1)
    a, config = _advice(_data(files=120, samples=120, bytes=12 * 2**20), store,
                        _machine(cores=2, decode_ms_per_image=0.5))
    assert a["window"]["value"] == 4
    assert config["block_rows"] == 16 and 16 * 4 <= 120 < 32 * 4
    assert "120 samples over the window's 4 read tasks" in a["block_rows"]["reason"]
    # A tiny set: blocks of at least 8 rows, not one task per image.
    _, config = _advice(_data(files=10, samples=10, bytes=2**20), store,
                        _machine(cores=2, decode_ms_per_image=0.5))
    assert config["block_rows"] == 8
    # 256 samples: blocks of 64 would give the window's 4 tasks rows, but a pipeline cuts
    # an epoch of fewer than 8 blocks into ~8: advise says the 32 it reads with.
    a, config = _advice(_data(files=256, samples=256, bytes=25 * 2**20), store,
                        _machine(cores=2, decode_ms_per_image=0.5))
    assert config["block_rows"] == 32 == raying_epoch_block_rows(256, 64)
    assert "cuts an epoch of fewer than 8 blocks" in a["block_rows"]["reason"]
    # A large set keeps the per-task decode target.
    a, config = _advice(_data(), store, _machine(cores=2, decode_ms_per_image=0.5))
    assert config["block_rows"] >= 64 and "per-task cost" in a["block_rows"]["reason"]


def test_disk_head_parquet_large_dataset_gets_a_disk_tier_and_two_reads():
    data = _data(format="parquet", files=40, samples=400_000, bytes=200 * GIB,
                 rows_per_row_group=256, row_group_bytes=25 * 2**20, sample_bytes=100_000)
    store = _store(kind="local (simulated slow tier)", simulated=True, latency_s=0.008,
                   whole_file_s=0.2, latency_share=0.04, bandwidth_bytes_per_s=120e6,
                   bandwidth_from="one 8.0 MiB read", parallel_speedup=0.95)
    a, config = _advice(data, store, _machine())
    assert a["pack"]["value"] == "already Parquet"
    assert a["read_concurrency"]["value"] == 2
    assert "one request at a time" in a["read_concurrency"]["reason"]
    assert "+ disk" in a["cache"]["value"] and config["io"]["cache"]["disk_bytes"] > 0
    assert a["block_rows"]["value"] == 256 and a["window"]["value"] == 8


def test_gpus_that_outrun_the_cpus_get_pre_decoding_when_storage_carries_pixels():
    store = _store(kind="local", latency_s=5e-5, whole_file_s=2e-4, latency_share=0.25,
                   bandwidth_bytes_per_s=3e9, bandwidth_from="one 8.0 MiB read",
                   parallel_speedup=3.0)
    a, _ = _advice(_data(), store, _machine(gpus=4, gpu_name="H200", cores=8))
    assert a["pre_decode"]["value"].startswith("yes: raying pack --decode-size 256")
    a, _ = _advice(_data(), _store(bandwidth_bytes_per_s=100e6,
                                   bandwidth_from="one 8.0 MiB read"),
                   _machine(gpus=4, gpu_name="H200", cores=8))
    assert a["pre_decode"]["value"] == "no" and "GPU" in a["pre_decode"]["reason"]


def test_report_text_names_each_measurement():
    data = dict(_data(), paths=[], sizes=[])
    report = {"uri": "s3://b/p", "measured": {"dataset": data, "storage": _store(),
                                              "machine": _machine()}}
    report["advice"], report["config"] = recommend(data, report["measured"]["storage"],
                                                   report["measured"]["machine"])
    text = format_report(report)
    assert "first byte 30.00 ms" in text and "because" in text and "measured:" in text


def test_parquet_sample_count_is_exact_for_files_of_different_rows(tmp_path):
    import pyarrow as pa
    import pyarrow.fs as pafs
    import pyarrow.parquet as pq

    from raying.tools.advise_measure import measure_dataset

    for name, n in (("a", 48), ("b", 16)):
        pq.write_table(pa.table({"image": pa.array([b"x" * 100] * n)}),
                       tmp_path / f"{name}.parquet")
    got = measure_dataset(pafs.LocalFileSystem(), str(tmp_path), str(tmp_path))
    assert (got["samples"], got["samples_estimated"]) == (64, False)


def test_the_dataset_is_counted_as_the_scan_counts_it(tmp_path):
    """An image class folder "_other" is a class; a Parquet set's empty first part, of no
    schema to speak of, neither speaks for the set nor gives the decode sample."""
    import pandas as pd
    import pyarrow.fs as pafs

    from raying.tools import advise_measure as m
    from raying.tools.datagen import make_image_folder

    fs = pafs.LocalFileSystem()
    root = make_image_folder(tmp_path / "img", n=12, classes=3, size=(16, 16), seed=1)
    (root / "class_00").rename(root / "_other")
    got = m.measure_dataset(fs, str(root), str(root))
    assert got["samples"] == len(raying.Manifest.scan(str(root))) == 12
    images = [p.read_bytes() for p in sorted(root.rglob("*.jpg"))]
    pq_root = tmp_path / "pq"
    pq_root.mkdir()
    df = pd.DataFrame({"image": images, "label": [0, 1] * 6})
    df.iloc[0:0].to_parquet(pq_root / "part-000.parquet")
    df.iloc[:6].to_parquet(pq_root / "part-001.parquet", row_group_size=3)
    df.iloc[6:].to_parquet(pq_root / "part-002.parquet", row_group_size=3)
    got = m.measure_dataset(fs, str(pq_root), str(pq_root))
    assert (got["samples"], got["rows_per_row_group"], got["image_column"]) == (12, 3, "image")
    assert got["files"] == 2  # as the scan: a file of no rows holds no sample
    assert len(m.sample_images(fs, got).images) == 3  # the first row group of part-001
    for name in ("part-001.parquet", "part-002.parquet"):
        df.iloc[0:0].to_parquet(pq_root / name)
    with pytest.raises(raying.DataError, match="holds Parquet files but no rows"):
        m.measure_dataset(fs, str(pq_root), str(pq_root))


def test_labels_the_scan_would_refuse_are_said_in_the_report(tmp_path):
    """advise measures what Manifest.scan(uri) takes as labels, and says where the scan as
    given refuses the dataset (images outside class folders, Parquet of no label column),
    with the same fix: a full recommendation alone would leave that for the first run."""
    import shutil

    import pandas as pd
    import pyarrow.fs as pafs

    from raying.tools import advise_measure as m
    from raying.tools.datagen import make_image_folder

    fs = pafs.LocalFileSystem()
    root = make_image_folder(tmp_path / "img", n=12, classes=3, size=(16, 16), seed=1)
    got = m.measure_dataset(fs, str(root), str(root))
    assert got["labels"] == "3 class folders" and not got.get("labels_refused")
    flat = tmp_path / "flat"
    flat.mkdir()
    for k, f in enumerate(sorted(root.rglob("*.jpg"))[:5]):
        shutil.copy(f, flat / f"{k}.jpg")
    shutil.copytree(root / "class_00", flat / "class_00")
    got = m.measure_dataset(fs, str(flat), str(flat))
    assert got["labels_refused"] and got["labels"].startswith(
        "5 of 9 images lie at the top level, in no class folder")
    with pytest.raises(raying.DataError, match="at its top level"):
        raying.Manifest.scan(str(flat))
    images = [p.read_bytes() for p in sorted(root.rglob("*.jpg"))]
    pq_root = tmp_path / "pq"
    pq_root.mkdir()
    pd.DataFrame({"image": images, "target": [0, 1] * 6}).to_parquet(pq_root / "p.parquet")
    got = m.measure_dataset(fs, str(pq_root), str(pq_root))
    assert got["labels_refused"] and "no 'label' column (columns: image, target)" in got["labels"]
    with pytest.raises(raying.DataError, match="has no label column 'label'"):
        raying.Manifest.scan(str(pq_root))
    pd.DataFrame({"image": images, "label": [0, 1] * 6}).to_parquet(pq_root / "p.parquet")
    got = m.measure_dataset(fs, str(pq_root), str(pq_root))
    assert got["labels"] == "column 'label' (int64)" and not got.get("labels_refused")
    report = {"uri": "x", "measured": {"dataset": {**_data(), "labels": "3 class folders"},
                                       "storage": _store(), "machine": _machine()},
              "advice": [], "config": recommend(_data(), _store(), _machine())[1]}
    assert "  labels   3 class folders" in format_report(report)


def test_an_unreadable_parquet_footer_is_a_data_error_naming_the_file(tmp_path):
    import pyarrow as pa
    import pyarrow.fs as pafs
    import pyarrow.parquet as pq
    import pytest

    from raying.errors import DataError
    from raying.tools.advise_measure import measure_dataset

    pq.write_table(pa.table({"image": pa.array([b"x"], pa.binary()), "label": [0]}),
                   tmp_path / "a.parquet")
    (tmp_path / "b.parquet").write_bytes(b"")
    with pytest.raises(DataError, match=r"b\.parquet is not a readable Parquet file.*remove it"):
        measure_dataset(pafs.LocalFileSystem(), str(tmp_path), str(tmp_path))


def test_a_node_without_gpus_is_not_told_its_demand_equals_its_decode_rate():
    a, _ = _advice(_data(), _store(), _machine(gpus=0, cores=2))
    assert a["pre_decode"]["value"] == "no"
    assert "no GPU found" in a["pre_decode"]["reason"]
    assert "no GPU found" in a["pre_decode"]["measured"]
    assert "demand" not in a["pre_decode"]["measured"]


def test_sampled_images_that_cannot_be_read_or_decoded_are_counted_and_named(tmp_path):
    """The decode probe sets aside a file gone since the listing and a corrupt one, times the
    rest, and the report says how many of the sample failed and which."""
    from pathlib import Path

    import pyarrow.fs as pafs

    from raying.tools import advise_measure as m
    from raying.tools.datagen import make_image_folder

    root = make_image_folder(tmp_path, n=8, classes=2, size=(40, 32), seed=1, formats=("jpg",))
    fs = pafs.LocalFileSystem()
    data = m.measure_dataset(fs, str(root), str(root))
    paths = sorted(data["paths"])
    Path(paths[1]).write_bytes(b"not a jpeg")
    Path(paths[5]).unlink()
    sample = m.sample_images(fs, {**data, "paths": paths}, n=8)
    assert len(sample.images) == 7 and len(sample.unreadable) == 1
    assert paths[5] in sample.unreadable[0]
    mach = m.measure_machine(sample)
    assert (mach["decode_sampled"], mach["decode_failed"]) == (8, 2)
    assert mach["decode_ms_per_image"] > 0  # over the six good images
    named = " ".join(mach["decode_failures"])
    assert paths[1] in named and paths[5] in named
    report = {"uri": str(root), "measured": {"dataset": _data(), "storage": _store(),
                                             "machine": mach},
              "advice": [], "config": {"block_rows": 64, "window": 4, "prefetch_batches": 2,
                                       "io": {"concurrency": 8, "cache": None}}}
    text = format_report(report)
    assert "2 of 8 sampled images could not be read or decoded (the decode time is over the " \
           "rest)" in text
    bad = m.measure_machine(m.ImageSample([b"junk"], ["x.jpg"]))
    assert bad["decode_ms_per_image"] is None and bad["decode_failures"][0].startswith("x.jpg: ")


def test_each_dataset_s_cache_gets_folders_of_its_own():
    """Pipelines sharing a tier folder must agree on its capacity, and the advice sizes a
    tier for one dataset: two datasets' advice names two folders (the same one again for
    the same URI), each in the code the report prints."""
    from raying.options import DEFAULT_MEMORY_CACHE_DIR, CacheConfig

    big = _data(bytes=600 * GIB)  # past the memory tier: a disk tier too
    dirs = {}
    for uri in ("s3://bucket/train", "s3://other/train", "s3://bucket/train"):
        advice, config = recommend(big, _store(), _machine(), uri=uri)
        cache = config["io"]["cache"]
        assert cache["memory_dir"].startswith(DEFAULT_MEMORY_CACHE_DIR + "/train-")
        assert cache["disk_dir"].startswith("/tmp/raying-cache/train-")
        CacheConfig(**cache)  # a valid config as it stands
        text = format_report({"uri": uri, "advice": advice, "config": config, "measured": {
            "dataset": big, "storage": _store(), "machine": _machine()}})
        assert f"memory_dir={cache['memory_dir']!r}" in text
        dirs.setdefault(uri, set()).add((cache["memory_dir"], cache["disk_dir"]))
    assert len(dirs["s3://bucket/train"]) == 1  # the same dataset, the same folders
    (a,), (b,) = dirs["s3://bucket/train"], dirs["s3://other/train"]
    assert a[0] != b[0] and a[1] != b[1]


def test_a_local_dataset_has_one_cache_folder_however_its_path_is_spelt(tmp_path,
                                                                         monkeypatch):
    from raying.tools.advise import _dataset_folder

    (tmp_path / "a" / "train").mkdir(parents=True)
    (tmp_path / "b" / "train").mkdir(parents=True)
    monkeypatch.chdir(tmp_path / "a")
    here = {_dataset_folder(u) for u in ("train", "./train", str(tmp_path / "a" / "train"))}
    assert len(here) == 1
    monkeypatch.chdir(tmp_path / "b")
    assert _dataset_folder("train") not in here  # another folder of the same name



def test_pre_decoded_parquet_on_fast_storage_is_not_called_io_bound():
    """A pack of pre-decoded pixels decodes in ~0 ms and arrives in ~0 ms: a ratio of the two
    said "I/O-bound" and the deepest prefetch."""
    data = _data(format="parquet", files=1, samples=300, bytes=2 * 2**20, pre_decoded=True,
                 rows_per_row_group=64, row_group_bytes=440 * 1024, sample_bytes=6912)
    store = _store(kind="local", latency_s=2e-5, whole_file_s=1e-3, latency_share=0.02,
                   bandwidth_bytes_per_s=2e9, bandwidth_from="one 2.0 MiB read",
                   parallel_speedup=1.0)
    a, _ = _advice(data, store, _machine(cores=2, decode_ms_per_image=0.0))
    assert a["prefetch_batches"]["value"] == 2
    assert "under a millisecond" in a["prefetch_batches"]["reason"]
    # Decoding that is measured and slower than the fetch keeps its reason.
    a, _ = _advice(data, store, _machine(cores=2, decode_ms_per_image=2.0))
    assert "decodes slower than it arrives" in a["prefetch_batches"]["reason"]


def test_a_probe_without_parallel_reads_does_not_make_the_storage_serial():
    """A one-file dataset over 4 MiB gives the probe no parallel reads to make: its 1.0x was
    taken for storage serving one request at a time ("a disk head") on S3."""
    data = _data(format="parquet", files=1, samples=6000, bytes=8 * 2**20,
                 rows_per_row_group=6000, row_group_bytes=8 * 2**20, sample_bytes=1300)
    store = _store(latency_s=0.01, whole_file_s=0.2, latency_share=0.05,
                   bandwidth_bytes_per_s=50e6, bandwidth_from="one 8.0 MiB read",
                   parallel_speedup=1.0, parallel_reads=1)
    a, _ = _advice(data, store, _machine(cores=2))
    assert "disk head" not in a["read_concurrency"]["reason"]
    assert a["read_concurrency"]["value"] != 2
    report = {"uri": "s3://b/p", "measured": {"dataset": dict(data, paths=[], sizes=[]),
                                              "storage": store, "machine": _machine(cores=2)}}
    report["advice"], report["config"] = recommend(data, store, _machine(cores=2))
    assert "parallel reads not measured" in format_report(report)
    # Measured (16 reads in flight) and flat: serial, as before.
    a, _ = _advice(data, dict(store, parallel_reads=16), _machine(cores=2))
    assert "disk head" in a["read_concurrency"]["reason"]


def test_parquet_of_tiny_row_groups_on_slow_storage_is_advised_to_be_packed_again():
    """Row groups of 3 rows on S3: each request (30 ms to its first byte) brings 3 samples;
    on a fast local disk they cost little and the advice says so."""
    data = _data(format="parquet", files=14, samples=40, bytes=2 * 2**20,
                 rows_per_row_group=3, row_group_bytes=16 * 1024, sample_bytes=5500)
    a, _ = _advice(data, _store(), _machine())
    assert a["pack"]["value"] == "yes: raying pack SRC DST"
    assert "row groups of ~3 rows" in a["pack"]["reason"] and "256 rows" in a["pack"]["reason"]
    fast = _store(kind="local", latency_s=0.0001, whole_file_s=0.0002, latency_share=0.5,
                  bandwidth_bytes_per_s=2e9)
    a, _ = _advice(data, fast, _machine())
    assert a["pack"]["value"] == "already Parquet" and "small ones cost little" in \
        a["pack"]["reason"]


def test_pre_decoded_pixels_of_a_size_fast_storage_serves_are_not_prefetched_deepest():
    """Pixels of 224 px on a fast disk: a batch arrives in a few ms and nothing is decoded.
    The ratio against a decode of 0 was infinite (16 batches, ~600 MB, "I/O-bound")."""
    data = _data(format="parquet", files=1, samples=300, bytes=45 * 2**20, pre_decoded=True,
                 rows_per_row_group=64, row_group_bytes=9 * 2**20, sample_bytes=150528)
    store = _store(kind="local", latency_s=2e-5, whole_file_s=1e-3, latency_share=0.02,
                   bandwidth_bytes_per_s=26e9, bandwidth_from="one 8.0 MiB read",
                   parallel_speedup=1.0)
    a, _ = _advice(data, store, _machine(cores=2, decode_ms_per_image=0.0))
    assert a["prefetch_batches"]["value"] <= 3
    assert "stored decoded" in a["prefetch_batches"]["reason"]
    # Pixels from slow storage keep the deep prefetch of an I/O-bound loader.
    slow = _store(kind="s3", bandwidth_bytes_per_s=50e6)
    a, _ = _advice(data, slow, _machine(cores=2, decode_ms_per_image=0.0))
    assert a["prefetch_batches"]["value"] > 2 and "I/O-bound" in a["prefetch_batches"]["reason"]


def test_the_storage_probe_names_files_it_cannot_read_and_measures_the_others(tmp_path):
    """A file the probe cannot read (removed since the listing; no permission) is named and
    left out of the figures: it raised a bare error before. None readable: a StorageError."""
    from pathlib import Path

    import pyarrow.fs as pafs

    from raying.tools import advise_measure as m
    from raying.tools.datagen import make_image_folder

    root = make_image_folder(tmp_path, n=8, classes=2, size=(40, 32), seed=1, formats=("jpg",))
    fs = pafs.LocalFileSystem()
    data = m.measure_dataset(fs, str(root), str(root))
    gone = sorted(data["paths"])[3]
    Path(gone).unlink()
    store = m.measure_storage(fs, data)
    assert [u.split(":")[0] for u in store["probe_unreadable"]] == [gone]
    assert store["latency_s"] > 0 and store["bandwidth_bytes_per_s"] > 0
    report = {"uri": str(root), "measured": {"dataset": _data(), "storage": store,
                                             "machine": _machine()},
              "advice": [], "config": {"block_rows": 64, "window": 4, "prefetch_batches": 2,
                                       "io": {"concurrency": 8, "cache": None}}}
    assert f"1 of the files the storage probe read could not be read (left out of its " \
           f"figures): {gone}" in format_report(report)
    for p in data["paths"]:
        Path(p).unlink(missing_ok=True)
    with pytest.raises(raying.StorageError, match="none of the .* files the storage probe "
                                                  "read could be read"):
        m.measure_storage(fs, data)


def test_a_folder_of_images_and_parquet_is_refused_unless_the_format_is_named(tmp_path):
    import pyarrow as pa
    import pyarrow.fs as pafs
    import pyarrow.parquet as pq

    from raying.tools import advise_measure as m
    from raying.tools.datagen import make_image_folder

    root = make_image_folder(tmp_path / "ds", n=8, classes=2, size=(40, 32), seed=1,
                             formats=("jpg",))
    pq.write_table(pa.table({"image": [b"x"], "label": [0]}), root / "extra.parquet")
    fs = pafs.LocalFileSystem()
    with pytest.raises(raying.ConfigError, match=r"holds both Parquet files \(1\) and image "
                                                 r"files \(8\).*--format images\|parquet"):
        m.measure_dataset(fs, str(root), str(root))
    assert m.measure_dataset(fs, str(root), str(root), format="images")["files"] == 8
    assert m.measure_dataset(fs, str(root), str(root), format="parquet")["format"] == "parquet"
