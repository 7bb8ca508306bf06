"""Settings raying cannot use are ConfigErrors when they are given, naming the fix."""

from __future__ import annotations

import os

import numpy as np
import pytest

import raying
from raying.errors import ConfigError
from raying.options import CacheConfig


@pytest.mark.parametrize(("field", "value", "pattern"), [
    ("block_rows", 2.5, "block_rows=.*integer >= 1"),
    ("block_rows", "64", "block_rows=.*integer >= 1"),
    ("block_rows", 0, "block_rows=.*integer >= 1"),
    ("window", 1.5, "window=.*integer >= 1 or None"),
    ("keep_warm", "no", "keep_warm=.*True or False"),
    ("task_num_cpus", 0, "task_num_cpus=.*> 0"),
])
def test_pipeline_config_values(field, value, pattern):
    with pytest.raises(ConfigError, match=pattern):
        raying.PipelineConfig(**{field: value})


def test_pipeline_config_accepts_numpy_integers():
    assert raying.PipelineConfig(block_rows=np.int64(64), window=np.int32(2)).block_rows == 64


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
