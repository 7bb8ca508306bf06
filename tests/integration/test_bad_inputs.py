"""A corpus of bad files mixed into good ones: skip keeps every good id, raise names the file."""

from __future__ import annotations

import numpy as np
import pytest

import raying
from tests.corpus.images import make_image_corpus


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return make_image_corpus(tmp_path_factory.mktemp("corpus"), n_good=24, seed=0)


def test_skip_delivers_every_good_id_and_reports_every_bad_one(corpus, ray_local):
    kinds = {c.kind for c in corpus.bad}
    assert len(kinds) >= 10, kinds
    m = raying.Manifest.scan(str(corpus.root))
    paths = m.path_of(np.arange(len(m)))
    good_ids = {i for i, p in enumerate(paths) if corpus.case(p).good}
    bad = {i: corpus.case(p).reason for i, p in enumerate(paths) if not corpus.case(p).good}
    pipe = raying.Pipeline(m, transform=raying.ImageTransform(size=32), on_error="skip",
                           config=raying.PipelineConfig(block_rows=8,
                                                        max_image_pixels=corpus.max_pixels))
    ids = [i for b in pipe.iter_batches(batch_size=8, epoch=0) for i in b["id"].tolist()]
    assert sorted(ids) == sorted(good_ids), "every good id exactly once"
    st = pipe.stats()
    reported = {s["id"]: s for s in st["skipped"]}
    assert set(reported) == set(bad)
    for i, reason in bad.items():
        assert reported[i]["reason"] == reason, (paths[i], reported[i])
        assert reported[i]["path"] == paths[i]
    assert st["skipped_count"] == len(bad)
    pipe.close()


def test_raise_names_the_file(corpus, ray_local):
    m = raying.Manifest.scan(str(corpus.root))
    pipe = raying.Pipeline(m, transform=raying.ImageTransform(size=32), on_error="raise",
                           config=raying.PipelineConfig(block_rows=8))
    with pytest.raises(raying.DecodeError) as info:
        for _ in pipe.iter_batches(batch_size=8, epoch=0):
            pass
    err = info.value
    assert err.path and err.path in str(err)
    assert f"{m.root.rstrip('/')}/{err.path}" in str(err)  # the whole path, not the relative one
    assert "on_error='skip'" in str(err) and "replace or remove" in str(err)  # and the fix
    assert not corpus.case(err.path).good
    assert err.reason == corpus.case(err.path).reason
    pipe.close()


def test_parquet_null_and_corrupt_image_bytes(tmp_path, ray_local):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from raying.tools.datagen import encode, synth_image

    rng = np.random.default_rng(0)
    good = [encode(synth_image(rng, i % 2, 2, 24, 24), "jpg") for i in range(20)]
    images = list(good)
    images[3] = None                      # a null cell
    images[7] = good[7][: len(good[7]) // 3]  # truncated bytes
    images[11] = b"not an image at all"
    labels = [i % 2 for i in range(20)]
    pq.write_table(pa.table({"image": pa.array(images, pa.binary()),
                             "label": pa.array(labels, pa.int64())}),
                   tmp_path / "part-0.parquet", row_group_size=6)
    m = raying.Manifest.scan(str(tmp_path), label="label")
    pipe = raying.Pipeline(m, transform=raying.ImageTransform(size=16),
                           config=raying.PipelineConfig(block_rows=8))
    ids = sorted(i for b in pipe.iter_batches(batch_size=8, epoch=0) for i in b["id"].tolist())
    assert ids == [i for i in range(20) if i not in (3, 7, 11)]
    skipped = {s["id"]: s for s in pipe.stats()["skipped"]}
    assert {k: v["reason"] for k, v in skipped.items()} == {
        3: "missing", 7: "truncated", 11: "not_an_image"}
    assert skipped[7]["path"] == "part-0.parquet#rg1/row1"
    pipe.close()
    strict = raying.Pipeline(m, transform=raying.ImageTransform(size=16), on_error="raise",
                             config=raying.PipelineConfig(block_rows=8))
    with pytest.raises(raying.DecodeError, match=r"part-0.parquet#rg\d/row\d"):
        list(strict.iter_batches(batch_size=8, epoch=0))
    strict.close()


def test_dataset_path_reports_and_sets_aside_bad_files(corpus, ray_local):
    """Epochs read through ``pipe.dataset(e)`` (Ray Train's path) report their skipped files in
    ``pipe.stats()`` like the iterators do, and a prioritized store stops favouring them."""
    m = raying.Manifest.scan(str(corpus.root))
    paths = m.path_of(np.arange(len(m)))
    bad = {i for i, p in enumerate(paths) if not corpus.case(p).good}
    cfg = raying.PipelineConfig(block_rows=8, max_image_pixels=corpus.max_pixels)
    pipe = raying.Pipeline(m, transform=raying.ImageTransform(size=16), config=cfg)
    ids = [i for b in pipe.dataset(0).iter_batches(batch_size=8) for i in b["id"].tolist()]
    assert sorted(ids) == sorted(set(range(len(m))) - bad)
    st = pipe.stats()
    assert {s["id"] for s in st["skipped"]} == bad and st["skipped_count"] == len(bad)
    assert st["dataset"]["rows_read"] == len(m)
    pipe.close()
    assert {s["id"] for s in pipe.stats(sampling=False)["skipped"]} == bad  # kept after close

    sampler = raying.PrioritizedSampler(alpha=1.0, uniform_mix=0.1, seed=0,
                                        samples_per_epoch=4 * len(m))
    prio = raying.Pipeline(m, transform=raying.ImageTransform(size=16), sampler=sampler,
                           config=cfg)
    prio.report(np.arange(len(m)), np.full(len(m), 2.0))
    got = [i for b in prio.dataset(0).iter_batches(batch_size=8) for i in b["id"].tolist()]
    assert not set(got) & bad
    skipped = {s["id"] for s in prio.stats()["skipped"]}
    assert skipped and skipped <= bad
    pri = prio.priorities()
    assert np.all(pri[sorted(skipped)] == 0.0), pri[sorted(skipped)]
    assert np.all(pri[sorted(set(got))] == 2.0)
    prio.close()


def test_an_epoch_where_every_sample_is_bad_is_an_error_not_an_empty_epoch(tmp_path, ray_local):
    for k in range(10):
        (tmp_path / "cls").mkdir(exist_ok=True)
        (tmp_path / "cls" / f"{k}.jpg").write_bytes(b"not a jpeg " * k)
    m = raying.Manifest.scan(str(tmp_path))
    pipe = raying.Pipeline(m, transform=raying.ImageTransform(size=16),
                           config=raying.PipelineConfig(block_rows=4))
    with pytest.raises(raying.DataError, match="every one of the 10 samples") as info:
        list(pipe.iter_batches(batch_size=4, epoch=0))
    import re

    assert re.search(r"cls/\d\.jpg: (empty|not_an_image)", str(info.value)) and "pipe.stats()['skipped']" in str(info.value)
    assert pipe.stats()["skipped_count"] == 10
    pipe.close()
    # The Ray Data path too (what a TorchTrainer(datasets=...) reads): the task that brings in
    # the epoch's last unit raises, rather than Ray Data handing over an empty epoch.
    pipe = raying.Pipeline(m, transform=raying.ImageTransform(size=16),
                           config=raying.PipelineConfig(block_rows=4))
    with pytest.raises(raying.DataError, match="every one of the 10 samples read in epoch 1"):
        pipe.dataset(1).count()
    assert pipe.stats()["skipped_count"] == 10
    pipe.close()


def test_raise_reads_the_other_failing_tasks_errors_instead_of_leaving_them_unhandled(
        corpus, ray_local, caplog, capfd):
    # Read tasks in flight beside the one that raised fail too (the corpus has a bad file in
    # most units): their errors are read and logged by file, not left for Ray to print as an
    # "Unhandled error" traceback when it frees them.
    import logging
    import time

    m = raying.Manifest.scan(str(corpus.root))
    pipe = raying.Pipeline(m, transform=raying.ImageTransform(size=32), on_error="raise",
                           config=raying.PipelineConfig(block_rows=4))
    with caplog.at_level(logging.WARNING, logger="raying"), pytest.raises(raying.DecodeError):
        for _ in pipe.iter_batches(batch_size=4, epoch=0):
            pass
    deadline = time.monotonic() + 30
    others: list[str] = []
    while time.monotonic() < deadline and not others:
        time.sleep(0.2)
        others = [r.getMessage() for r in caplog.records if "failed too" in r.getMessage()]
    assert others, "no other read task failed: the corpus no longer has a bad file per unit"
    assert any(c.path in others[0] for c in corpus.bad), others[0]
    assert len(set(others)) == len(others), others  # each error once, with its count
    # Each says the epoch its task read (the next epoch's first units are read ahead).
    assert all(o.startswith(("another read task of the stopped epoch 0 failed too",
                             "another read task of epoch 1, read ahead, failed too"))
               for o in others), others
    import gc

    gc.collect()
    time.sleep(1.0)
    assert "Unhandled error" not in capfd.readouterr().err
    pipe.close()
