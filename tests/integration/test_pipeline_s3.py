"""The same pipeline over a live S3 endpoint (moto on 127.0.0.1) and a local path."""

from __future__ import annotations

import numpy as np
import pytest

import raying
from raying.storage.spec import clear_cache


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
    # One root, one fingerprint, however the URI is spelled (a resume is refused otherwise).
    for spelling in (s3_images.rstrip("/") + "/", "s3a" + s3_images[2:]):
        other = raying.Manifest.scan(spelling, storage={"endpoint_url": s3_endpoint})
        assert (other.root, other.fingerprint()) == (remote.root, remote.fingerprint())
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


def test_s3_endpoint_from_environment(s3_images, s3_endpoint, monkeypatch, ray_local,
                                      tmp_path):
    # Set after Ray started its workers, as in a notebook: the workers' environment lacks it,
    # so the read tasks and pack's tasks must get the endpoint this process took.
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_endpoint)
    clear_cache()
    m = raying.Manifest.scan(s3_images)
    assert len(m) == 60
    assert m.storage.endpoint_url is None  # the manifest keeps what the user gave
    pipe = raying.Pipeline(m, transform=raying.ImageTransform(size=32))
    ids, _, _ = _epoch(pipe, 0)
    assert sorted(ids.tolist()) == list(range(60))
    assert pipe.stats()["skipped"] == []
    result = raying.pack(s3_images, str(tmp_path / "packed"))
    assert result.rows == 60


def test_s3_missing_prefix_is_a_clear_error(s3_images, s3_endpoint, ray_local):
    with pytest.raises(raying.StorageError, match="does not exist|no such|not found"):
        raying.Manifest.scan("s3://raying-images/nope", storage={"endpoint_url": s3_endpoint})


def test_pack_into_a_missing_bucket_is_refused_before_any_work(s3_endpoint, image_folder,
                                                              monkeypatch):
    """The bucket is checked before Ray starts: the shards' writes each failed on it after
    the whole source was read, and a warning claimed a stop marker it could not write."""
    import raying.engine.ray_setup as ray_setup

    def no_ray(*a, **k):
        raise AssertionError("pack started Ray for a destination it cannot write")

    monkeypatch.setattr(ray_setup, "ensure_ray", no_ray)
    with pytest.raises(raying.StorageError,
                       match=r"bucket 'raying-no-such-bucket' does not exist at "
                             r"http://127\.0\.0\.1:\d+.*create it first"):
        raying.pack(str(image_folder), "s3://raying-no-such-bucket/packed",
                    dst_storage={"endpoint_url": s3_endpoint}, progress=False)


def test_s3_parquet_through_the_cache_matches_local(s3_server, s3_endpoint, image_folder,
                                                    tmp_path_factory, ray_local):
    from raying.options import CacheConfig, IOConfig
    from raying.read.fetch import ACCOUNT_KEYS

    packed = tmp_path_factory.mktemp("s3-packed")
    raying.pack(str(image_folder), str(packed), shard_rows=25, row_group_rows=8,
                progress=False)
    uri = s3_server.upload_folder(packed, "raying-parquet", "train")
    local = raying.Manifest.scan(str(packed), format="parquet", label="label")
    remote = raying.Manifest.scan(uri, format="parquet", label="label",
                                  storage={"endpoint_url": s3_endpoint})
    cache_dir = tmp_path_factory.mktemp("s3-cache")
    io = IOConfig(cache=CacheConfig(memory_bytes=10**8, memory_dir=str(cache_dir),
                                    background_writes=False))
    tf = raying.ImageTransform(size=16)
    # keep_warm off: epoch 1 must not start reading before epoch 0 has admitted everything.
    off = {"block_rows": 16, "decoded_cache": "off", "keep_warm": False}
    plain = raying.Pipeline(local, transform=tf, config=raying.PipelineConfig(**off))
    cached = raying.Pipeline(remote, transform=tf, config=raying.PipelineConfig(**off, io=io))
    try:
        for epoch in (0, 1):
            accounts = []
            add = cached.account.add
            cached.account.add = lambda a, add=add, seen=accounts: (seen.append(a), add(a))
            a = _epoch(plain, epoch)
            b = _epoch(cached, epoch)
            cached.account.add = add
            for x, y in zip(a, b, strict=True):
                assert np.array_equal(x, y)
            totals = {k: sum(acc.io.get(k, 0) for acc in accounts) for k in ACCOUNT_KEYS}
            assert totals["cache_lookups"] > 0
            if epoch == 0:
                assert totals["io_requests"] > 0 and totals["io_bytes_fetched"] > 0
            else:  # the image chunks and the footers come from the tier, nothing from S3
                assert totals["cache_hits_memory"] == totals["cache_lookups"]
                assert totals["io_requests"] == 0
    finally:
        plain.close()
        cached.close()


def test_s3_outage_raises_instead_of_skipping_every_sample(image_folder, ray_local):
    """An endpoint that goes down after the scan is not 'bad input': the epoch must fail
    loudly (default on_error='skip'), not end normally with nothing delivered."""
    from tests.s3server import start_s3_server

    with start_s3_server() as server:
        uri = server.upload_folder(image_folder, "outage", "imgs")
        m = raying.Manifest.scan(uri, storage=server.storage_options)
        server.stop(keep_data=True, snapshot=False)
        pipe = raying.Pipeline(m, transform=raying.ImageTransform(size=16),
                               config=raying.PipelineConfig(block_rows=16,
                                                            decoded_cache="off"))
        with pytest.raises(raying.StorageError, match=r"16 of the 16 reads of this unit could "
                                                      r"not reach the storage.*not outages"):
            for _ in pipe.iter_batches(batch_size=16, epoch=0):
                pass
        # The failed tasks' retries are counted, though their accounts were lost with them:
        # each of the raising unit's 16 reads was tried RAYING_READ_RETRIES (5) times.
        before = pipe.stats(sampling=False)["read_retries"]
        assert before >= 16 * 4
        # The same on pipe.dataset(e), Ray Train's path: the read task hands them to the
        # account actor before it raises.
        with pytest.raises(Exception, match=r"could not reach the storage"):
            for _ in pipe.dataset(1).iter_batches(batch_size=16):
                pass
        assert pipe.stats(sampling=False)["read_retries"] >= before + 16 * 4
        pipe.close()
        # Parquet: the unreachable endpoint is a storage error, not "the file may be corrupt".
        server.start()
        server.upload_folder(image_folder, "outage", "imgs")  # the restart lost the bucket
        dst = "s3://outage/packed"
        raying.pack(m, dst, dst_storage=server.storage_options, progress=False)
        pm = raying.Manifest.scan(dst, format="parquet", label="label",
                                  storage=server.storage_options)
        server.stop(keep_data=True, snapshot=False)
        pipe = raying.Pipeline(pm, transform=raying.ImageTransform(size=16),
                               config=raying.PipelineConfig(block_rows=16,
                                                            decoded_cache="off"))
        with pytest.raises(raying.StorageError, match="cannot reach") as info:
            for _ in pipe.iter_batches(batch_size=16, epoch=0):
                pass
        assert "corrupt" not in str(info.value)
        # Each open was tried RAYING_READ_RETRIES (5) times: counted as the images' are.
        assert pipe.stats(sampling=False)["read_retries"] >= 4
        pipe.close()


def test_same_bucket_on_two_endpoints_never_shares_cache_entries(tmp_path, ray_local):
    """s3://data/train on two endpoints are two datasets: one shared tier must not serve the
    first endpoint's bytes for the second's keys."""
    from raying.options import CacheConfig, IOConfig
    from raying.tools.datagen import make_image_folder
    from tests.s3server import start_s3_server

    io = IOConfig(cache=CacheConfig(disk_bytes=64 * 2**20, disk_dir=str(tmp_path / "disk")))
    tf = raying.ImageTransform(size=16)
    cfg = {"decoded_cache": "off", "block_rows": 16}
    with start_s3_server() as one, start_s3_server() as two:
        for k, server in enumerate((one, two)):
            src = make_image_folder(tmp_path / f"src{k}", n=16, classes=2, size=(24, 24),
                                    seed=100 + k)
            server.upload_folder(src, "data", "train")
        got = []
        for server in (one, two):
            m = raying.Manifest.scan("s3://data/train", storage=server.storage_options)
            plain = _epoch(raying.Pipeline(m, transform=tf,
                                           config=raying.PipelineConfig(**cfg)), 0)
            pipe = raying.Pipeline(m, transform=tf, config=raying.PipelineConfig(**cfg, io=io))
            cached = _epoch(pipe, 0)
            pipe.close()
            assert np.array_equal(plain[0], cached[0]) and np.array_equal(plain[2], cached[2])
            got.append(cached[2])
        assert not np.array_equal(got[0], got[1]), "the endpoints hold different images"
