"""The read path with an IOConfig: same samples as without, cache filled by the read tasks."""

from __future__ import annotations

import numpy as np
import pytest

import raying
from raying.options import CacheConfig, IOConfig
from raying.read import decoded_dirs, fetch, parquet
from raying.read.spec import ReadSpec
from raying.read.task import run_unit
from raying.sampling.plan import ManifestLookup, chunk_units


@pytest.fixture(scope="module")
def manifest(image_folder):
    return raying.Manifest.scan(str(image_folder))


def _io(tmp_path, policy="priority"):
    return IOConfig(cache=CacheConfig(memory_bytes=10**7, memory_dir=str(tmp_path / "mem"),
                                      disk_bytes=10**7, disk_dir=str(tmp_path / "disk"),
                                      policy=policy, background_writes=False))


def test_run_unit_with_io_gives_the_same_block_and_accounts_for_the_cache(manifest, tmp_path):
    tf = raying.ImageTransform(size=32)
    plain = ReadSpec.of(manifest, tf, 0, "skip")
    cached = ReadSpec.of(manifest, tf, 0, "skip", io=_io(tmp_path))
    ids = np.array([5, 3, 5, 40, 12, 3, 59], dtype=np.int64)
    lookup = ManifestLookup(manifest)
    results = []
    for spec in (plain, cached, cached):
        (unit,) = chunk_units(0, ids, 16)
        unit.probs = np.full(len(ids), 1 / 60)
        unit, paths = lookup.complete(unit)
        results.append(run_unit(spec, unit, paths))
    (b0, a0), (b1, a1), (b2, a2) = results
    a0, a1, a2 = a0.io, a1.io, a2.io  # the io_*/cache_* counters of each unit's account
    for k in b0:
        assert np.array_equal(b0[k], b1[k]) and np.array_equal(b0[k], b2[k])
    # The plain path reports its requests (one per path read, repeats included: it has no
    # dedupe) and its read amplification; no cache counters. (It counted no requests, and
    # stats() showed io_requests 0 beside the bytes fetched.)
    assert {k for k in a0 if k.startswith(("io_", "cache_"))} == {
        "io_requests", "io_bytes_fetched", "io_bytes_delivered"}
    assert a0["io_requests"] == len(ids) == 7
    assert a0["io_bytes_fetched"] == a0["io_bytes_delivered"]
    assert set(fetch.ACCOUNT_KEYS) <= set(a1)
    assert a1["io_requests"] == 5 and a1["io_reads_deduped"] == 2
    assert a1["cache_lookups"] == 5 and a1["cache_hits_memory"] == 0
    assert a2["io_requests"] == 0 and a2["cache_hits_memory"] == 5
    assert fetch.summarize(a2)["cache_hit_ratio"] == 1.0


def _collect(pipe, epoch):
    accounts = []
    add = pipe.account.add

    def record(account):
        accounts.append(account)
        add(account)

    pipe.account.add = record
    ids, images = [], []
    for b in pipe.iter_batches(batch_size=16, epoch=epoch):
        ids.append(b["id"])
        images.append(b["image"])
    pipe.account.add = add
    totals = {k: sum(a.io.get(k, 0) for a in accounts) for k in fetch.ACCOUNT_KEYS}
    return np.concatenate(ids), np.concatenate(images), totals


def _same_two_epochs(m, tmp_path, size):
    """Epochs 0 and 1 with and without an LRU cache: identical; the cached run's totals."""
    tf = raying.ImageTransform(size=size)
    # About the raw-bytes tiers; keep_warm off: epoch 1's first reads would otherwise start
    # while epoch 0's last ones still admit, and miss what those had not written yet.
    off = {"block_rows": 16, "decoded_cache": "off", "keep_warm": False}
    base = raying.Pipeline(m, transform=tf, config=raying.PipelineConfig(**off))
    pipe = raying.Pipeline(m, transform=tf,
                           config=raying.PipelineConfig(**off, io=_io(tmp_path, "lru")))
    out = []
    try:
        for epoch in (0, 1):
            ids0, img0, _ = _collect(base, epoch)
            ids1, img1, totals = _collect(pipe, epoch)
            assert np.array_equal(ids0, ids1) and np.array_equal(img0, img1)
            out.append(totals)
    finally:
        base.close()
        pipe.close()
    return out


def test_pipeline_with_a_cache_delivers_the_same_epochs_and_hits_later(manifest, tmp_path,
                                                                       ray_local):
    first, second = _same_two_epochs(manifest, tmp_path, 32)
    assert first["cache_lookups"] == second["cache_lookups"] == 60
    assert first["io_requests"] == 60
    # Every file was admitted in epoch 0 by the read tasks' worker processes.
    assert second["cache_hits_memory"] == 60 and second["io_requests"] == 0


def test_prioritized_pipeline_with_a_priority_cache(manifest, tmp_path, ray_local):
    s = raying.PrioritizedSampler(alpha=1.0, uniform_mix=0.1, seed=2, samples_per_epoch=120)
    io = IOConfig(cache=CacheConfig(memory_bytes=15 * int(manifest.sizes.mean()),
                                    memory_dir=str(tmp_path / "mem")))
    pipe = raying.Pipeline(manifest, transform=raying.ImageTransform(size=16), sampler=s,
                           config=raying.PipelineConfig(block_rows=40, io=io,
                                                        decoded_cache="off"))
    try:
        pipe.report(np.arange(60), np.where(manifest.labels == 0, 20.0, 0.1))
        hits = 0
        for epoch in (0, 1):
            ids, _, totals = _collect(pipe, epoch)
            assert len(ids) == 120
            hits += totals["cache_hits_memory"]
        assert hits > 0
        assert 0 < totals["io_bytes_fetched"] < totals["io_bytes_delivered"]
    finally:
        pipe.close()


def test_decoded_cache_serves_later_epochs_with_the_same_pixels(manifest, ray_local):
    import os

    tf = raying.ImageTransform(size=32)
    base = raying.Pipeline(manifest, transform=tf,
                           config=raying.PipelineConfig(block_rows=16, decoded_cache="off"))
    pipe = raying.Pipeline(manifest, transform=tf,
                           config=raying.PipelineConfig(block_rows=16, decoded_cache=64 << 20,
                                                        decoded_cache_fill=None))
    try:
        for epoch in (0, 1, 2):
            ids0, img0, _ = _collect(base, epoch)
            ids1, img1, _ = _collect(pipe, epoch)
            assert np.array_equal(ids0, ids1) and np.array_equal(img0, img1)
        st = pipe.stats(sampling=False)["io"]
        # Epoch 0 decodes and fills the cache (decoded_cache_fill=None: every sample at its
        # first read); epochs 1 and 2 are served from it (up to 120 hits; epoch 1's first
        # units are read ahead while epoch 0 drains, so a few may miss ids whose epoch-0
        # part had not finished yet).
        assert st["cache_decoded_lookups"] == 180
        assert st["cache_decoded_hits"] >= 90 and st["decoded_cache_hit_ratio"] >= 0.5
        directory = decoded_dirs.cache_dir(pipe._ready_spec().decoded_cache_name)
        assert os.path.isdir(directory)
    finally:
        base.close()
        pipe.close()
    assert not os.path.exists(directory), "close() frees the node's decoded pixels"


def test_reads_in_flight_at_close_do_not_bring_the_decoded_pixels_back(manifest, ray_local):
    import os
    import time

    tf = raying.ImageTransform(size=32)
    for stop_after in (None, 1):  # a whole epoch (the next one's reads start: keep_warm), a break
        pipe = raying.Pipeline(manifest, transform=tf,
                               config=raying.PipelineConfig(block_rows=8, decoded_cache=64 << 20,
                                                            decoded_cache_fill=None,
                                                            keep_warm=True))
        directory = decoded_dirs.cache_dir(pipe._ready_spec().decoded_cache_name)
        for k, _ in enumerate(pipe.iter_batches(batch_size=8, epoch=0)):
            if stop_after is not None and k + 1 >= stop_after:
                break
        pipe.close()
        deadline = time.monotonic() + 6.0  # the dropped read tasks finish meanwhile
        while time.monotonic() < deadline:
            assert not os.path.exists(directory), (stop_after, os.listdir(directory))
            time.sleep(0.05)


# --- Parquet through the planner and the cache ---------------------------------------------------


@pytest.fixture(scope="module")
def packs(image_folder, tmp_path_factory, ray_local):
    out = {}
    for name, size in (("encoded", None), ("decoded", 16)):
        dst = tmp_path_factory.mktemp(f"pq-{name}")
        raying.pack(str(image_folder), str(dst), decode_size=size, shard_rows=25,
                    row_group_rows=8, progress=False)
        out[name] = dst
    return out


def _parquet_unit(m, ids):
    (unit,) = chunk_units(0, np.asarray(ids, dtype=np.int64), 64)
    unit.probs = np.full(len(unit.ids), 1 / len(m))
    return ManifestLookup(m).complete(unit)


@pytest.mark.parametrize("kind", ["encoded", "decoded"])
def test_parquet_unit_with_io_reads_planned_chunks_and_hits_the_cache(packs, kind, tmp_path):
    m = raying.Manifest.scan(str(packs[kind]), format="parquet", label="label")
    tf = raying.ImageTransform(size=16)
    plain = ReadSpec.of(m, tf, 0, "skip")
    cached = ReadSpec.of(m, tf, 0, "skip", io=_io(tmp_path))
    ids = [3, 30, 31, 9, 58, 3, 17, 45]
    _, _, starts, _ = m.row_group_table()
    groups = len(set(np.searchsorted(starts, ids, side="right").tolist()))
    results = []
    for spec in (plain, cached, cached, cached):
        if len(results) == 2:
            # A worker keeps the chunks it read last for units of the same epoch reading the
            # same groups (the parts of a window): the read after it stands for a later
            # epoch's, from the cache.
            parquet._UNIT_GROUPS["unit"], parquet._UNIT_GROUPS["tables"] = None, {}
        results.append(run_unit(spec, *_parquet_unit(m, ids)))
    (b0, _), (b1, a1), (b2, a2), (b3, a3) = results
    a1, a2, a3 = a1.io, a2.io, a3.io
    for k in b0:
        assert np.array_equal(b0[k], b1[k]) and np.array_equal(b0[k], b2[k]), k
        assert np.array_equal(b0[k], b3[k]), k
    # Taken from the worker's keep: no request, no lookup, nothing fetched.
    assert a3["io_requests"] == a3["cache_lookups"] == a3["io_bytes_fetched"] == 0
    assert sorted(b1["id"].tolist()) == sorted(ids)
    assert set(fetch.ACCOUNT_KEYS) <= set(a1)
    assert a1["cache_lookups"] > 0 and a1["cache_hits_memory"] == 0
    assert 0 < a1["io_requests"] <= a1["cache_lookups"] + 3  # chunks coalesced, + footers
    assert a1["cache_lookups"] == groups
    assert a2["io_requests"] == 0 and a2["cache_hits_memory"] == a1["cache_lookups"]
    assert a1["io_bytes_fetched"] > 0 and a2["io_bytes_fetched"] == 0


def test_parquet_with_io_names_the_corrupt_file(packs, tmp_path):
    import shutil

    import pyarrow.parquet as pq

    from raying.errors import DataError
    from raying.read.parquet import chunk_range

    src = tmp_path / "bad"
    shutil.copytree(packs["encoded"], src)
    victim = sorted(src.rglob("*.parquet"))[1]
    start, _ = chunk_range(pq.read_metadata(victim), 0, "image")
    data = bytearray(victim.read_bytes())
    data[start:start + 64] = b"\xff" * 64  # the first page header of the image column
    victim.write_bytes(bytes(data))
    m = raying.Manifest.scan(str(src), format="parquet", label="label")
    spec = ReadSpec.of(m, raying.ImageTransform(size=16), 0, "raise", io=_io(tmp_path))
    with pytest.raises(DataError, match=victim.name + r".*rescan it"):
        run_unit(spec, *_parquet_unit(m, list(range(len(m)))))


def test_parquet_pipeline_with_a_cache_delivers_the_same_epochs(packs, tmp_path, ray_local):
    m = raying.Manifest.scan(str(packs["encoded"]), format="parquet", label="label")
    first, second = _same_two_epochs(m, tmp_path, 16)
    assert first["io_requests"] > 0 and first["cache_lookups"] > 0
    # Every row group's chunk, and every file's footer, was admitted in epoch 0: a worker
    # process new since then finds both in the tier.
    assert second["io_requests"] == 0
    assert second["cache_hits_memory"] == second["cache_lookups"] > 0


def test_hugging_face_image_structs_read_like_binary(packs, tmp_path, ray_local):
    """A Parquet image column of structs {bytes, path} (the Hugging Face ``Image`` feature's
    layout) reads as its bytes, plainly and through the planned, cached path."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    hf = tmp_path / "hf"
    hf.mkdir()
    for f in sorted(packs["encoded"].glob("*.parquet")):
        t = pq.read_table(f)
        images = t.column("image").combine_chunks()
        paths = t.column("path").combine_chunks()
        struct = pa.StructArray.from_arrays([images, paths], names=["bytes", "path"])
        t = t.set_column(t.schema.get_field_index("image"), "image", struct)
        pq.write_table(t.drop_columns(["path"]), hf / f.name, row_group_size=8)
    binary = raying.Manifest.scan(str(packs["encoded"]), format="parquet", label="label")
    m = raying.Manifest.scan(str(hf), format="parquet", label="label")
    assert len(m) == len(binary) == 60
    tf = raying.ImageTransform(size=16)
    want = _collect(raying.Pipeline(binary, transform=tf, config=raying.PipelineConfig(
        block_rows=16, decoded_cache="off")), 0)
    for io in (None, _io(tmp_path, "lru")):
        cfg = raying.PipelineConfig(block_rows=16, decoded_cache="off", io=io)
        pipe = raying.Pipeline(m, transform=tf, config=cfg)
        ids, images, _ = _collect(pipe, 0)
        pipe.close()
        assert np.array_equal(ids, want[0]) and np.array_equal(images, want[1])
    # With the decoded cache on ("auto", for a job long enough to repay it), the same ids; it
    # sizes itself from the structs' bytes.
    from raying.read.decoded_cache import DEFAULT_DECODED_CACHE_MIN_EPOCHS

    pipe = raying.Pipeline(m, transform=tf, config=raying.PipelineConfig(
        block_rows=16, epochs=DEFAULT_DECODED_CACHE_MIN_EPOCHS))
    ids, images, _ = _collect(pipe, 0)
    pipe.close()
    assert np.array_equal(ids, want[0]) and images.shape == want[1].shape


def test_a_dataset_packed_again_in_place_is_not_served_from_the_warm_tiers(image_folder,
                                                                            tmp_path, ray_local):
    """``raying pack --overwrite`` to the same folder (another shuffle): a pipeline over the
    new files, on the tiers the old ones filled, gets every id's own label and pixels, as a
    read without tiers does (the tiers served the old row groups under the new ids)."""
    dst = tmp_path / "pq"
    io = IOConfig(cache=CacheConfig(memory_bytes=8 << 20, memory_dir=str(tmp_path / "mem"),
                                    disk_bytes=8 << 20, disk_dir=str(tmp_path / "disk"),
                                    background_writes=False))

    def epoch(io_config):
        m = raying.Manifest.scan(str(dst))
        pipe = raying.Pipeline(m, transform=raying.ImageTransform(size=16, random_crop=False,
                                                                  flip=False),
                               config=raying.PipelineConfig(block_rows=16, io=io_config,
                                                            decoded_cache=None))
        out = {}
        for b in pipe.iter_batches(batch_size=32, epoch=0):
            for i, label, image in zip(b["id"], b["label"], b["image"], strict=True):
                out[int(i)] = (int(label), image.tobytes())
        pipe.close()
        return out

    raying.pack(str(image_folder), str(dst), shard_rows=25, row_group_rows=8, seed=0,
                progress=False)
    first = epoch(io)
    raying.pack(str(image_folder), str(dst), shard_rows=25, row_group_rows=8, seed=1,
                overwrite=True, progress=False)
    cached, direct = epoch(io), epoch(None)
    assert cached == direct
    assert sum(first[i] != direct[i] for i in direct) > len(direct) // 2  # a real reshuffle
