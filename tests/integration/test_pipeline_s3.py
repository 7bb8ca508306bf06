"""The same pipeline over a live S3 endpoint (moto on 127.0.0.1) and a local path."""

from __future__ import annotations

import numpy as np
import pytest

import raying


@pytest.fixture(scope="module")
def s3_images(s3_server, s3_endpoint, image_folder):
    # s3_endpoint first: the AWS environment is set before Ray starts its workers.
    return s3_server.upload_folder(image_folder, "raying-images", "train")


def _epoch(pipe, epoch):
    ids, labels, images = [], [], []
    for b in pipe.iter_batches(batch_size=16, epoch=epoch):
        ids.append(b["id"])
        labels.append(b["label"])
        images.append(b["image"])
    return np.concatenate(ids), np.concatenate(labels), np.concatenate(images)


def test_s3_and_local_give_identical_ids_labels_pixels(s3_images, s3_endpoint, image_folder,
                                                       ray_local):
    local = raying.Manifest.scan(str(image_folder))
    remote = raying.Manifest.scan(s3_images, storage={"endpoint_url": s3_endpoint})
    assert len(remote) == len(local) == 60
    assert remote.classes == local.classes
    assert np.array_equal(remote.labels, local.labels)
    assert remote.path_of(np.arange(60)) == local.path_of(np.arange(60))
    tf = raying.ImageTransform(size=32)
    cfg = raying.PipelineConfig(block_rows=16)
    a = _epoch(raying.Pipeline(local, transform=tf, config=cfg), 0)
    b = _epoch(raying.Pipeline(remote, transform=tf, config=cfg), 0)
    assert sorted(b[0].tolist()) == list(range(60))
    for x, y in zip(a, b, strict=True):
        assert np.array_equal(x, y)


def test_s3_endpoint_from_environment(s3_images, s3_endpoint, monkeypatch, ray_local):
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_endpoint)
    raying.storage.clear_cache()
    m = raying.Manifest.scan(s3_images)
    assert len(m) == 60


def test_s3_missing_prefix_is_a_clear_error(s3_images, s3_endpoint, ray_local):
    with pytest.raises(raying.StorageError, match="does not exist|no such|not found"):
        raying.Manifest.scan("s3://raying-images/nope", storage={"endpoint_url": s3_endpoint})
