"""A state_dict from before Parquet plans dealt large windows into parts resumes safely."""

from __future__ import annotations

import logging

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

import raying
from raying.tools.datagen import encode


def _pipe(tmp_path):
    img = encode(np.zeros((4, 4, 3), np.uint8), "png")
    pq.write_table(pa.table({"image": [img] * 64, "label": [0, 1] * 32}), tmp_path / "p.parquet")
    return raying.Pipeline(raying.Manifest.scan(str(tmp_path)),
                           config=raying.PipelineConfig(block_rows=8))


def test_an_old_parquet_position_inside_an_epoch_restarts_the_epoch(tmp_path, caplog):
    pipe = _pipe(tmp_path)
    state = pipe.state_dict()
    assert state["version"] == 2
    old = dict(state, version=1, epoch=3, unit=2, row=5, delivered=200)
    with caplog.at_level(logging.WARNING):
        pipe.load_state_dict(old)
    assert pipe._resume == (3, 0, 0, 0)  # the rows delivered before are delivered again
    assert "epoch 3 restarts from its first row" in caplog.text
    caplog.clear()
    pipe.load_state_dict(dict(old, version=2))  # today's position: taken as saved
    assert pipe._resume == (3, 2, 5, 200) and not caplog.text
    pipe.load_state_dict(dict(old, unit=0, row=0))  # an epoch's start means the same
    assert pipe._resume == (3, 0, 0, 200) and not caplog.text
    pipe.close()


def _jitter(batch):
    return batch


def _jitter_rng(batch, rng, strength=0.4):
    return batch


def test_a_resume_into_other_augmentation_is_told_and_the_same_one_is_not(tmp_path, caplog):
    saved = _pipe(tmp_path).map_batches(_jitter_rng, with_rng=True)
    state = saved.state_dict()
    assert state["augment"]["stages"] == [f"{__name__}._jitter_rng (with_rng)"]
    same = _pipe(tmp_path).map_batches(_jitter_rng, with_rng=True)
    with caplog.at_level(logging.WARNING):
        same.load_state_dict(state)
    assert "other augmentation" not in caplog.text
    others = [_pipe(tmp_path).map_batches(_jitter),  # another stage
              _pipe(tmp_path).map_batches(_jitter_rng, with_rng=True,  # other arguments
                                          fn_kwargs={"strength": 0.5}),
              _pipe(tmp_path),  # none
              raying.Pipeline(saved.manifest, transform=raying.ImageTransform(size=160),
                              config=raying.PipelineConfig(block_rows=8))]  # another size
    for other in others:
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            other.load_state_dict(state)
        assert "the state was saved by a pipeline of other augmentation" in caplog.text
        assert "_jitter_rng (with_rng)" in caplog.text
        other.close()
    for p in (saved, same):
        p.close()
