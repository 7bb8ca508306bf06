"""Keras model.fit on pipe.to_tf: per-sample losses reach the priority store."""

from __future__ import annotations

import os

import numpy as np
import pytest

import raying

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
keras = pytest.importorskip("keras")
pytest.importorskip("tensorflow")


def _model(classes: int, size: int):
    return keras.Sequential([keras.Input((size, size, 3)),
                             keras.layers.Conv2D(8, 3, strides=2, activation="relu"),
                             keras.layers.GlobalAveragePooling2D(),
                             keras.layers.Dense(classes)])


def test_fit_reports_per_sample_losses_to_the_store(image_folder, ray_local):
    import raying.loader.keras as rk
    from raying.sampling import store as st

    m = raying.Manifest.scan(str(image_folder))
    pipe = raying.Pipeline(m, transform=raying.ImageTransform(size=16),
                           sampler=raying.PrioritizedSampler(beta=0.5, seed=3,
                                                             samples_per_epoch=64),
                           config=raying.PipelineConfig(block_rows=32))
    handle = pipe.sampler.handle if pipe.store_name else None
    assert handle is not None
    assert np.all(st.priorities(handle) == 1.0)

    seen = []
    model = rk.FeedbackModel(_model(len(m.classes), 16), pipe)
    model.compile(optimizer="adam",
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    spy = keras.callbacks.LambdaCallback(on_train_batch_end=lambda b, logs: seen.append(b))
    history = model.fit(pipe.to_tf(batch_size=16, normalize=True), epochs=2, verbose=0,
                        callbacks=[spy])

    assert len(history.history["loss"]) == 2 and seen
    assert model.reporter.reported == 2 * 64  # every training sample, every epoch
    st.flush(handle)  # the reporter flushed at epoch end; wait until the store applied it
    stats = st.stats(handle)
    assert stats["updates_received"] == 2 * 64 and stats["rejected"]["nan"] == 0
    after = st.priorities(handle)
    assert np.count_nonzero(after != 1.0) >= 32, "reported ids must hold their losses"
    assert np.all(np.isfinite(after)) and np.all(after >= 0)
    pipe.close()


def test_per_sample_losses_are_the_unreduced_compiled_loss():
    import tensorflow as tf

    import raying.loader.keras as rk

    got = []
    n = 24
    rng = np.random.default_rng(0)
    data = {"image": rng.random((n, 8, 8, 3), dtype=np.float32),
            "label": np.arange(n, dtype=np.int64) % 3,
            "weight": np.ones(n, np.float32), "id": np.arange(n, dtype=np.int64) + 100}
    inner = _model(3, 8)
    model = rk.FeedbackModel(inner, lambda ids, losses: got.append((ids, losses)))
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    model.compile(optimizer=keras.optimizers.SGD(learning_rate=0.0), loss=loss)
    model.fit(tf.data.Dataset.from_tensor_slices(data).batch(8), epochs=1, verbose=0)
    ids = np.concatenate([g[0] for g in got])
    losses = np.concatenate([g[1] for g in got])
    assert sorted(ids.tolist()) == list(range(100, 100 + n))
    # learning rate 0: the weights did not move, so the losses can be recomputed exactly.
    expect = keras.losses.sparse_categorical_crossentropy(
        data["label"], inner(data["image"]), from_logits=True).numpy()
    np.testing.assert_allclose(losses[np.argsort(ids)], expect, rtol=1e-5)


def test_tuples_train_but_say_once_that_no_loss_is_reported(caplog):
    # (x, y, sample_weight) tuples (to_tf(as_supervised=True)) carry no ids: the model
    # trains, no loss can reach the sampler, and the user is told so.
    import logging

    import keras
    import tensorflow as tf

    import raying.loader.keras as rk

    got = []
    rng = np.random.default_rng(0)
    x = rng.random((24, 8, 8, 3), dtype=np.float32)
    y = np.arange(24, dtype=np.int64) % 3
    model = rk.FeedbackModel(_model(3, 8), lambda ids, losses: got.append(ids))
    model.compile(optimizer="sgd",
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    with caplog.at_level(logging.WARNING, logger="raying"):
        model.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(8), epochs=2, verbose=0)
    said = [r.getMessage() for r in caplog.records if "carry no ids" in r.getMessage()]
    assert len(said) == 1 and "without as_supervised=True" in said[0]
    assert got == []


def test_jit_compile_is_refused():
    import raying.loader.keras as rk

    model = rk.FeedbackModel(_model(3, 8), lambda ids, losses: None)
    with pytest.raises(raying.ConfigError, match="jit_compile=True"):
        model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy",
                      jit_compile=True)


def test_compile_takes_the_optimizer_and_loss_by_position():
    import raying.loader.keras as rk

    model = rk.FeedbackModel(_model(3, 8), lambda ids, losses: None)
    model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    assert model._per_sample is not None  # the per-sample loss, from the positional loss


def _steps_per_epoch():
    steps: list[int] = []
    spy = keras.callbacks.LambdaCallback(on_epoch_begin=lambda e, logs: steps.append(0),
                                         on_train_batch_end=lambda b, logs: steps.__setitem__(
                                             -1, steps[-1] + 1))
    return steps, spy


def test_a_mid_epoch_resume_under_fit_is_said_and_the_guide_s_recipe_trains_whole_epochs(
        image_folder, ray_local, caplog):
    """Keras takes an epoch's length from the dataset's first pass: a resumed epoch's rest
    would cut every later epoch to it. A second pass over such a dataset says so (whether
    to_tf was given the epoch or took it from the state), and the guide's recipe (the rest
    of the epoch in a fit of its own, then the next epochs) trains every epoch whole."""
    import logging

    m = raying.Manifest.scan(str(image_folder))  # 60 images: 8 batches of 8 per epoch

    def make():
        return raying.Pipeline(m, transform=raying.ImageTransform(size=16),
                               sampler=raying.UniformSampler(seed=2),
                               config=raying.PipelineConfig(block_rows=16))

    a = make()
    it = a.iter_batches(batch_size=8, epoch=0, prefetch_batches=0)
    for _ in range(5):
        next(it)
    state = a.state_dict()
    it.close()
    a.close()

    def said():
        return [r.getMessage() for r in caplog.records
                if "its first pass was the rest of epoch 0" in r.getMessage()]

    net = _model(len(m.classes), 16)
    net.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    for epoch in (None, 0):  # the epoch the state resumes, or that epoch named
        pipe = make()
        pipe.load_state_dict(state)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="raying"):
            net.fit(pipe.to_tf(batch_size=8, epoch=epoch, as_supervised=True), epochs=2,
                    verbose=0)
        assert len(said()) == 1 and "pipe.to_tf(epoch=1)" in said()[0], epoch
        pipe.close()
    pipe = make()
    pipe.load_state_dict(state)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="raying"):
        steps, spy = _steps_per_epoch()
        net.fit(pipe.to_tf(batch_size=8, epoch=None, as_supervised=True), epochs=1, verbose=0,
                callbacks=[spy])
        assert steps == [3]  # 20 rows left of epoch 0
        steps, spy = _steps_per_epoch()
        net.fit(pipe.to_tf(batch_size=8, epoch=pipe.state_dict()["epoch"],
                           as_supervised=True), epochs=3, verbose=0, callbacks=[spy])
    assert steps == [8, 8, 8]
    assert said() == []  # the recipe is not warned about
    assert pipe.stats()["rows_delivered"] == 20 + 3 * 60
    pipe.close()


def test_a_pass_left_inside_its_epoch_is_said_when_the_next_begins(image_folder, ray_local,
                                                                   caplog):
    import logging

    m = raying.Manifest.scan(str(image_folder))
    pipe = raying.Pipeline(m, transform=raying.ImageTransform(size=16),
                           config=raying.PipelineConfig(block_rows=16))
    ds = pipe.to_tf(batch_size=1, epoch=0)
    for _ in ds.take(2):  # 2 of epoch 0's 60 batches (and what tf.data prefetched)
        pass
    inside = pipe.state_dict()["epoch"] == 0
    with caplog.at_level(logging.WARNING, logger="raying"):
        assert sum(1 for _ in ds) == 60  # epoch 1, whole
    said = [r.getMessage() for r in caplog.records if "left before its end" in r.getMessage()]
    assert len(said) == (1 if inside else 0), (inside, said)
    assert inside, "tf.data prefetched all of epoch 0: the case is not exercised"
    assert "A pass stopped early does so (ds.take(n)" in said[0], said  # this case's cause
    pipe.close()
