"""Settings raying cannot use are ConfigErrors when they are given, naming the fix."""

from __future__ import annotations

import os

import numpy as np
import pytest

import raying
from raying.errors import ConfigError
from raying.options import CacheConfig, IOConfig, StoreConfig


@pytest.mark.parametrize(("field", "value", "pattern"), [
    ("block_rows", 2.5, "block_rows=.*integer >= 1"),
    ("block_rows", "64", "block_rows=.*integer >= 1"),
    ("block_rows", 0, "block_rows=.*integer >= 1"),
    ("window", 1.5, "window=.*integer >= 1 or None"),
    ("keep_warm", "no", "keep_warm=.*True or False"),
    ("task_num_cpus", 0, "task_num_cpus=.*> 0"),
    ("decoded_cache", "on", r"decoded_cache=...\) must be 'auto', 'off' .* got 'on'"),
    ("decoded_cache", -5, r"decoded_cache=...\) must be .* got -5"),
    ("decoded_cache", True, r"decoded_cache=...\) must be .* got True"),
    ("decoded_cache", 1.5, r"decoded_cache=...\) must be .* got 1.5"),
])
def test_pipeline_config_values(field, value, pattern):
    with pytest.raises(ConfigError, match=pattern):
        raying.PipelineConfig(**{field: value})


def test_pipeline_config_accepts_numpy_integers():
    assert raying.PipelineConfig(block_rows=np.int64(64), window=np.int32(2)).block_rows == 64
    assert raying.PipelineConfig(decoded_cache=2e9).decoded_cache == 2_000_000_000  # bytes


@pytest.mark.parametrize(("mean", "std", "pattern"), [
    ((0.5,), (0.5,), "mean must be 3 finite numbers"),
    ((0.5, 0.5, 0.5), (0.0, 1.0, 1.0), "std must be 3 numbers > 0"),
    ((0.5, 0.5, float("nan")), (1, 1, 1), "mean must be 3 finite"),
    ("abc", (1, 1, 1), "mean must be 3 finite"),
])
def test_normalization_stats(mean, std, pattern):
    from raying.loader.batches import TorchConverter

    with pytest.raises(ConfigError, match=pattern):
        TorchConverter("cpu", normalize=True, mean=mean, std=std)


def test_cache_directories_checked_where_the_pipeline_is_built(tmp_path):
    a_file = tmp_path / "file"
    a_file.write_text("x")
    with pytest.raises(ConfigError, match=r"disk_dir=.*is a file, not a directory"):
        CacheConfig(disk_bytes=1, disk_dir=str(a_file)).check_dirs()
    with pytest.raises(ConfigError, match=r"memory_dir=.*cannot create it"):
        CacheConfig(memory_bytes=1, memory_dir=str(a_file / "sub")).check_dirs()
    fresh = tmp_path / "new" / "tier"
    CacheConfig(disk_bytes=1, disk_dir=str(fresh)).check_dirs()
    assert fresh.is_dir()
    if os.geteuid() != 0:  # root may write anywhere
        ro = tmp_path / "ro"
        ro.mkdir(mode=0o500)
        with pytest.raises(ConfigError, match="not writable"):
            CacheConfig(disk_bytes=1, disk_dir=str(ro)).check_dirs()


def test_pipeline_refuses_a_cache_dir_that_is_a_file(tmp_path):
    from raying.options import IOConfig
    from raying.tools.datagen import make_image_folder

    root = make_image_folder(tmp_path / "imgs", n=4, classes=2, size=(8, 8))
    (tmp_path / "f").write_text("x")
    io = IOConfig(cache=CacheConfig(disk_bytes=2**20, disk_dir=str(tmp_path / "f")))
    with pytest.raises(ConfigError, match="is a file"):
        raying.Pipeline(raying.Manifest.scan(str(root)),
                        transform=raying.ImageTransform(size=8),
                        config=raying.PipelineConfig(io=io))


def test_classes_must_be_a_list_not_a_string(tmp_path):
    from raying.tools.datagen import make_image_folder

    root = make_image_folder(tmp_path / "imgs", n=4, classes=2, size=(8, 8))
    with pytest.raises(ConfigError, match="list of class names, got the string"):
        raying.Manifest.scan(str(root), classes="class_00")


def test_settings_read_every_raying_variable_once_from_the_environment():
    from raying.options import ENVIRONMENT, Settings

    env = {"RAYING_BLOCK_ROWS": "64", "RAYING_READ_RETRY_BACKOFF_S": "0.5",
           "RAYING_OBJECT_STORE_MB": "0", "RAYING_PREFETCH_BATCHES": " "}
    s = Settings.from_env(env)
    assert (s.block_rows, s.read_retry_backoff_s, s.object_store_mb) == (64, 0.5, 0)
    assert s.prefetch_batches == Settings().prefetch_batches  # blank: the default
    # Every variable names a field of Settings, so none is read anywhere else.
    fields = {f.name for f in __import__("dataclasses").fields(Settings)}
    assert {field for field, _ in ENVIRONMENT.values()} == fields


def test_a_bad_environment_value_names_the_variable():
    from raying.options import Settings

    with pytest.raises(ConfigError, match=r"environment variable RAYING_READ_RETRIES must be "
                                          r"an integer, got 'five'; unset it or fix it"):
        Settings.from_env({"RAYING_READ_RETRIES": "five"})


@pytest.mark.parametrize(("name", "raw", "pattern"), [
    ("RAYING_BLOCK_ROWS", "-5", r"an integer >= 1, got '-5'"),  # an empty epoch, silently
    ("RAYING_BLOCK_ROWS", "0", r"an integer >= 1, got '0'"),
    ("RAYING_READ_RETRIES", "0", r"an integer >= 1, got '0'"),  # every read a "bad sample"
    ("RAYING_INFLIGHT_TASKS_PER_CPU", "-1", r"an integer >= 1"),
    ("RAYING_PREFETCH_BATCHES", "-1", r"an integer >= 0, got '-1'"),
    ("RAYING_OBJECT_STORE_MB", "-5", r"an integer >= 0, got '-5'"),
    ("RAYING_ROI_DECODE", "7", r"an integer in \[0, 1\], got '7'"),
    ("RAYING_READ_RETRY_BACKOFF_S", "nan", r"a number >= 0, got 'nan'"),
    ("RAYING_STORE_TICK_S", "0", r"a number > 0, got '0'"),
    ("RAYING_REPORT_FLUSH_S", "inf", r"a number > 0, got 'inf'"),
])
def test_an_environment_value_out_of_range_names_the_variable(name, raw, pattern):
    from raying.options import Settings

    with pytest.raises(ConfigError, match=rf"environment variable {name} must be {pattern}"):
        Settings.from_env({name: raw})


def test_the_library_reads_no_raying_variable_outside_options():
    import pathlib
    import re

    root = pathlib.Path(raying.__file__).parent
    readers = []
    for path in root.rglob("*.py"):
        if path.name == "options.py" or "bench" in path.parts:
            continue
        for k, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"environ(\.get)?\s*[\[(]\s*[\"']RAYING_", line):
                readers.append(f"{path.relative_to(root)}:{k}")
    assert readers == [], readers


def test_a_pipeline_ships_its_settings_with_the_read_spec(monkeypatch, tmp_path):
    from raying.options import Settings, use
    from raying.tools.datagen import make_image_folder

    monkeypatch.setattr("raying.options._active", None)  # restored after the test

    root = make_image_folder(tmp_path / "imgs", n=8, classes=2, size=(16, 16))
    monkeypatch.setenv("RAYING_MAX_IMAGE_PIXELS", "100")
    monkeypatch.setenv("RAYING_BLOCK_ROWS", "8")
    pipe = raying.Pipeline(raying.Manifest.scan(str(root)))
    monkeypatch.delenv("RAYING_MAX_IMAGE_PIXELS")  # read once: later changes do not count
    assert pipe._spec.settings.max_image_pixels == 100 and pipe._spec.max_pixels == 100
    assert pipe.config.block_rows is None and pipe.settings.block_rows == 8
    assert pipe.block_rows() == 8  # 32 with the default of 256
    use(Settings())


def test_the_configuration_guide_lists_every_variable():
    import pathlib

    from raying.options import ENVIRONMENT

    guide = (pathlib.Path(raying.__file__).parents[1] / "docs" / "configuration.md").read_text()
    rows = {line.split("|")[1].strip().strip("`") for line in guide.splitlines()
            if line.startswith("| `RAYING_")}
    assert rows == set(ENVIRONMENT)


def test_the_default_sampler_takes_the_environment_the_pipeline_read(monkeypatch, tmp_path):
    from raying.tools.datagen import make_image_folder

    m = raying.Manifest.scan(str(make_image_folder(tmp_path / "i", n=4, classes=1,
                                                   size=(8, 8))))
    for window in ("7", "2"):
        monkeypatch.setenv("RAYING_PARQUET_WINDOW_ROW_GROUPS", window)
        pipe = raying.Pipeline(m)
        assert pipe.settings.parquet_window_row_groups == int(window)
        assert pipe.sampler.window_row_groups == int(window)  # not the last pipeline's
        pipe.close()


@pytest.mark.parametrize(("make", "pattern"), [
    (lambda: IOConfig(concurrency="4"), r"IOConfig\(concurrency=...\) must be an int, got '4'"),
    (lambda: IOConfig(prefetch_windows=True), r"IOConfig\(prefetch_windows=...\) must be an int"),
    (lambda: IOConfig(cache={"bogus": 1}), r"IOConfig cache option\(s\) \['bogus'\] not known"),
    (lambda: IOConfig.coerce({"cachee": None}), r"io option\(s\) \['cachee'\] not known"),
    (lambda: raying.PipelineConfig(io={"gap_bytes": -1}), r"IOConfig\(gap_bytes=...\) must be"),
    (lambda: raying.PipelineConfig(max_image_pixels=-5),
     r"PipelineConfig\(max_image_pixels=...\) must be an integer >= 1 or None, got -5"),
    (lambda: IOConfig(max_request_bytes=None), r"max_request_bytes=...\) must be an int, got None"),
    (lambda: IOConfig(dedupe="no"), r"IOConfig\(dedupe=...\) must be True or False"),
    (lambda: CacheConfig(decay_reads="2"), r"CacheConfig\(decay_reads=...\) must be a finite"),
    (lambda: CacheConfig(memory_dir=None, memory_bytes=10), r"needs memory_dir="),
    (lambda: CacheConfig(share_reads="yes"), r"share_reads=...\) must be True or False"),
    (lambda: raying.PipelineConfig(ray_remote_args="x"),
     r"ray_remote_args=...\) must be a dict of Ray task options"),
    (lambda: raying.PipelineConfig(task_num_cpus=float("inf")), r"must be a finite number > 0"),
    (lambda: StoreConfig(tick_s=True), r"tick_s must be a number in"),
    (lambda: StoreConfig(tick_s=float("inf")), r"tick_s must be a number in"),
])
def test_config_values_of_the_wrong_type_or_name_are_config_errors_at_construction(make,
                                                                                   pattern):
    with pytest.raises(raying.ConfigError, match=pattern):
        make()
