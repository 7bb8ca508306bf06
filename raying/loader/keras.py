"""Keras feedback: the per-sample losses of ``model.fit`` reach the priority store, unblocking.

Keras reduces the loss before any callback sees it, so the per-sample values have to be taken
inside the step. ``FeedbackModel`` wraps a model and keeps Keras' own ``train_step`` (loss
scaling, regularization, metrics, optimizer); its ``compute_loss`` also computes the unreduced
loss of the same forward pass and hands ``(ids, losses)`` out of the graph::

    to_tf batch {image, label, weight, id} -> train_step(x=image, y=label, sample_weight=weight)
      compute_loss: Keras' weighted loss (for the gradient)
                    + per-sample loss, stop_gradient -> numpy_function: queue.append (~us)
    LossReporter.on_train_batch_end: drain queue -> pipe.report / raying.report (fire-and-forget)

Example:
    >>> pipe = raying.Pipeline(m, sampler=raying.PrioritizedSampler(beta=0.5))
    >>> model = raying.loader.keras.FeedbackModel(keras_model, pipe)
    >>> model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(
    ...     from_logits=True), metrics=["accuracy"])
    >>> model.fit(pipe.to_tf(batch_size=64, normalize=True), epochs=3)
    >>> keras_model.save("model.keras")   # save the inner model, not the wrapper

Under Ray Train (``TensorflowTrainer``), pass the store's name instead of the pipeline:
``FeedbackModel(model, pipe.store_name)``.
"""

from __future__ import annotations

import collections
import functools
import logging
import threading
from typing import Any

from raying.errors import ConfigError, require

# Keys of the pipeline's batch dicts (the batch contract).
DEFAULT_KEYS = {"x": "image", "y": "label", "weight": "weight", "id": "id"}

# Both are built on first access (module __getattr__), so importing this module loads no Keras.
__all__ = ["FeedbackModel", "LossReporter"]  # noqa: F822


def _report_fn(target: Any):
    """``(ids, losses) -> None`` for a Pipeline, a sampler, a store name or a callable."""
    if isinstance(target, str):
        from raying.sampling.feedback import report

        return functools.partial(report, store=target)
    report_method = getattr(target, "report", None)
    if callable(report_method):
        return report_method
    if callable(target):
        return target
    msg = (f"the feedback target must be a raying.Pipeline, a priority store name (str) or a "
           f"callable(ids, losses), got {type(target).__name__}")
    raise ConfigError(msg)


def _flush_fn(target: Any):
    if isinstance(target, str):
        from raying.sampling.feedback import flush_all

        return flush_all
    sampler = getattr(target, "sampler", target)
    flush = getattr(sampler, "flush", None)
    return flush if callable(flush) else (lambda: None)


@functools.cache
def _classes() -> tuple[type, type]:
    keras = require("keras", purpose="for raying.loader.keras")
    tf = require("tensorflow", purpose="for raying.loader.keras (the TensorFlow backend)")
    if keras.backend.backend() != "tensorflow":
        msg = (f"raying.loader.keras needs Keras' TensorFlow backend, got "
               f"{keras.backend.backend()!r}; set KERAS_BACKEND=tensorflow")
        raise ConfigError(msg)

    class LossReporter(keras.callbacks.Callback):  # type: ignore[name-defined,misc]
        """Sends the per-sample losses a ``FeedbackModel`` hands it; never waits.

        ``put`` is called from inside the training step (a queue append); every
        ``on_train_batch_end`` drains the queue into the target's non-blocking ``report``, and
        every epoch end flushes the buffered reports to the store.

        Args:
            target: a ``raying.Pipeline``, a priority store name, or ``callable(ids, losses)``.

        Attributes:
            reported: ids reported so far.
            steps: training steps whose losses were reported.
        """

        def __init__(self, target: Any) -> None:
            super().__init__()
            self._report = _report_fn(target)
            self._flush = _flush_fn(target)
            self._queue: collections.deque = collections.deque()
            self._lock = threading.Lock()
            self.reported = 0
            self.steps = 0

        def put(self, ids: Any, losses: Any) -> None:
            # Inputs may be views of buffers the runtime reuses after the step: copy them.
            self._queue.append((ids.copy(), losses.copy()))

        def drain(self) -> None:
            with self._lock:
                while self._queue:
                    ids, losses = self._queue.popleft()
                    self._report(ids, losses)
                    self.reported += int(ids.size)
                    self.steps += 1

        def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
            self.drain()

        def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
            self.drain()
            self._flush()

        def on_train_end(self, logs: Any = None) -> None:
            self.drain()
            self._flush()

    class FeedbackModel(keras.Model):  # type: ignore[name-defined,misc]
        """A Keras model that reports each training sample's loss to the priority store.

        It trains ``model`` exactly as ``model.fit`` would (Keras' ``train_step``, with the
        batch's importance ``weight`` as ``sample_weight``), and reports the unreduced loss of
        every sample by its ``id``. Batches are the dicts of ``pipe.to_tf(...)``; ``(x, y)``
        or ``(x, y, sample_weight)`` tuples train without reporting.

        Args:
            model: the Keras model to train (save it, not the wrapper).
            target: where losses go: a ``raying.Pipeline`` (``pipe.report``), the name of a
                priority store (``raying.report(..., store=name)``, for Ray Train workers), or
                ``callable(ids, losses)``.
            per_sample_loss: ``fn(y_true, y_pred) -> (batch,)`` losses; default the compiled
                loss without its reduction.
            keys: batch keys for ``x``, ``y``, ``weight`` and ``id`` (default the pipeline's).
        """

        def __init__(self, model: Any, target: Any, *, per_sample_loss: Any = None,
                     keys: dict[str, str] | None = None, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            if not isinstance(model, keras.Model):
                msg = f"FeedbackModel(model=...) must be a keras.Model, got {type(model).__name__}"
                raise ConfigError(msg)
            unknown = set(keys or {}) - set(DEFAULT_KEYS)
            if unknown:
                msg = (f"FeedbackModel(keys=...) takes {sorted(DEFAULT_KEYS)}, got unknown "
                       f"{sorted(unknown)}")
                raise ConfigError(msg)
            self.inner = model
            self.reporter = LossReporter(target)
            self._keys = {**DEFAULT_KEYS, **(keys or {})}
            self._per_sample = per_sample_loss
            self._step_ids = None
            self._warned_tuples = False

        def call(self, inputs: Any, training: Any = None) -> Any:
            if isinstance(inputs, dict) and self._keys["x"] in inputs:
                # A whole batch dict, as Keras passes it when it builds the model under a
                # distribution strategy: the model sees the image.
                inputs = inputs[self._keys["x"]]
            return self.inner(inputs, training=training)

        def compile(self, optimizer: Any = "rmsprop", loss: Any = None, *args: Any,
                    jit_compile: Any = False, **kwargs: Any) -> None:
            """``keras.Model.compile`` (its arguments, by position or name); XLA stays off
            (the hand-over is a host function)."""
            if jit_compile is True:
                msg = ("FeedbackModel.compile(jit_compile=True) is not supported: the loss "
                       "hand-over runs on the host, which XLA cannot compile; leave it False")
                raise ConfigError(msg)
            if self._per_sample is None:
                self._per_sample = _unreduced(keras, loss)
            super().compile(optimizer, loss, *args, jit_compile=False, **kwargs)

        def _unpack(self, data: Any) -> tuple[Any, Any, Any, Any]:
            if isinstance(data, dict):
                k = self._keys
                return data[k["x"]], data.get(k["y"]), data.get(k["weight"]), data.get(k["id"])
            x, y, sw = keras.utils.unpack_x_y_sample_weight(data)
            return x, y, sw, None

        def train_step(self, data: Any) -> Any:
            x, y, sw, ids = self._unpack(data)
            if ids is None and not self._warned_tuples:  # once per trace of the step
                self._warned_tuples = True
                logging.getLogger("raying").warning(
                    "FeedbackModel trains on (x, y[, sample_weight]) tuples, which carry no "
                    "ids: no loss is reported and the sampler gets no feedback; feed it the "
                    "batch dicts, pipe.to_tf(...) without as_supervised=True")
            self._step_ids = ids  # read by compute_loss during this trace
            try:
                return super().train_step((x, y, sw))
            finally:
                self._step_ids = None

        def test_step(self, data: Any) -> Any:
            x, y, sw, _ = self._unpack(data)
            return super().test_step((x, y, sw))

        def predict_step(self, data: Any) -> Any:
            x, _, _, _ = self._unpack(data)
            return super().predict_step((x,))

        def compute_loss(self, x: Any = None, y: Any = None, y_pred: Any = None,
                         sample_weight: Any = None, training: bool = True) -> Any:
            if isinstance(x, dict) and y is None:  # a whole batch dict (the strategy's build)
                k = self._keys
                y = x.get(k["y"])
                sample_weight = x.get(k["weight"]) if sample_weight is None else sample_weight
                x = x[k["x"]]
            loss = super().compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight,
                                        training=training)
            ids = self._step_ids
            if training and ids is not None and self._per_sample is not None:
                per = tf.cast(tf.stop_gradient(self._per_sample(y, y_pred)), tf.float32)
                if per.shape.rank is not None and per.shape.rank > 1:
                    per = tf.reduce_mean(per, axis=list(range(1, per.shape.rank)))
                tf.numpy_function(self.reporter.put, [tf.cast(ids, tf.int64), per], [],
                                  stateful=True, name="raying_report_losses")
            return loss

        def fit(self, *args: Any, callbacks: Any = None, **kwargs: Any) -> Any:
            """``keras.Model.fit``, with this model's ``LossReporter`` among the callbacks."""
            callbacks = list(callbacks or [])
            if not any(cb is self.reporter for cb in callbacks):
                callbacks.append(self.reporter)
            return super().fit(*args, callbacks=callbacks, **kwargs)

    return FeedbackModel, LossReporter


def _unreduced(keras: Any, loss: Any):
    """The per-sample form of a compiled loss: a Loss object's ``call``, or the function."""
    if loss is None:
        return None
    if isinstance(loss, (list, tuple, dict)):
        msg = ("FeedbackModel needs a single loss to report per sample, got "
               f"{type(loss).__name__}; pass per_sample_loss=fn(y_true, y_pred)")
        raise ConfigError(msg)
    fn = keras.losses.get(loss)
    if isinstance(fn, keras.losses.Loss):
        return fn.call  # the loss before its reduction
    return fn


def __getattr__(name: str) -> Any:
    # Keras and TensorFlow load on first use, not on `import raying.loader.keras`.
    if name == "FeedbackModel":
        return _classes()[0]
    if name == "LossReporter":
        return _classes()[1]
    msg = f"module 'raying.loader.keras' has no attribute {name!r}"
    raise AttributeError(msg)
