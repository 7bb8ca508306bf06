"""Integration fixtures: one local Ray per test module, and small generated datasets."""

from __future__ import annotations

import pytest

from raying.tools.datagen import make_image_folder


@pytest.fixture(scope="module")
def ray_local():
    """A real local Ray (never a stray cluster), shared by the tests of one module."""
    import ray

    if ray.is_initialized():
        ray.shutdown()
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
             object_store_memory=512 * 1024**2)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def image_folder(tmp_path_factory):
    """60 images, JPEG and PNG mixed, 3 classes, 64x48 px."""
    root = tmp_path_factory.mktemp("images")
    return make_image_folder(root, n=60, classes=3, size=(48, 64), seed=1,
                             formats=("jpg", "png"))
