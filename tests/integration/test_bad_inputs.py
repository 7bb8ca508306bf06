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
    assert not corpus.case(err.path).good
    assert err.reason == corpus.case(err.path).reason
    pipe.close()
