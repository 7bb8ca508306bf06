"""tf.data output: the pipeline's batches as a prefetched tf.data.Dataset."""

from __future__ import annotations

import itertools
import logging
from typing import Any

import numpy as np

from raying.errors import ConfigError, require
from raying.loader.batches import BatchAssembler, _channel_stats
from raying.options import DEFAULT_MEAN, DEFAULT_STD

logger = logging.getLogger(__name__)


def _tf():
    return require("tensorflow", purpose="for to_tf() and the Keras callback")


def to_tf(pipe: Any, *, batch_size: int, epoch: int | None, normalize: bool,
          as_supervised: bool, prefetch_batches: int | None, drop_last: bool,
          mean: Any = None, std: Any = None):
    """A tf.data.Dataset over ``pipe``'s batches.

    Each pass over the dataset (each Keras epoch) reads the next epoch of the plan, starting
    at ``epoch`` (None: the epoch a ``state_dict`` loaded before this call resumes, from its
    position, else 0); so ``model.fit(ds, epochs=3)`` sees epochs ``epoch, epoch+1, epoch+2``, each
    in its own order (any pass counts, ``ds.take(1)`` too; with Keras ``steps_per_epoch``,
    which keeps one iterator, fit ``ds.repeat()``). Elements are dicts with the batch
    contract's keys (``image`` uint8 NHWC, or float32 NHWC normalized with
    ``normalize=True``), or ``(image, label, weight)`` with ``as_supervised=True``, which
    Keras ``fit`` takes as (x, y, sample_weight).

    Extra Parquet columns (``Manifest.scan(columns=...)``) come under their names: numbers as
    tensors of their dtype, strings and bytes as ``tf.string``, fixed-size lists as
    ``(n, width)`` tensors and variable-length lists as ``tf.RaggedTensor`` ``(n, None)``.
    With ``map_batches`` stages the signature is taken from the first batch of the first
    epoch, read once here (not counted in ``stats()``, not moving ``state_dict()``): every
    column but ``image`` arrives as the stages return it (columns they add or drop, a label
    made float or 2-D, a Parquet column cast, padded or turned into strings).
    """
    tf = _tf()
    BatchAssembler(batch_size, drop_last=drop_last)  # bad arguments fail here, before Ray starts
    mean = _channel_stats("mean", DEFAULT_MEAN if mean is None else mean)
    std = _channel_stats("std", DEFAULT_STD if std is None else std)
    if not all(x > 0 for x in std):
        msg = f"std must be 3 numbers > 0 (per RGB channel, on the 0-1 scale), got {std}"
        raise ConfigError(msg)
    pipe._depth(prefetch_batches)
    # Start Ray (if needed) in this thread, not in tf.data's.
    pipe._block_stream().set_batch_rows(batch_size)
    size = pipe.transform.size
    if epoch is None:  # where a loaded state_dict resumes, else the first epoch
        epoch = pipe._resume[0] if pipe._resume is not None else 0
    counter = itertools.count(int(epoch))
    # The pass in progress (its epoch), None between passes: a pass that starts while the one
    # before stopped inside its epoch means the rest of that epoch was dropped. "resumed":
    # the first pass is the rest of an epoch a loaded state resumes mid-way (its rows done).
    resume = pipe._resume
    open_pass: dict[str, Any] = {
        "epoch": None, "warned": False, "first": True,
        "resumed": (int(resume[3]) if resume is not None and resume[0] == int(epoch)
                    and any(resume[1:]) else None)}

    n = None if not drop_last else batch_size
    signature = {
        "id": tf.TensorSpec((n,), tf.int64),
        "label": tf.TensorSpec((n,), tf.int64),
        "image": tf.TensorSpec((n, size, size, 3), tf.uint8),
        "weight": tf.TensorSpec((n,), tf.float32),
        "prob": tf.TensorSpec((n,), tf.float64),
    }
    columns = dict(pipe._spec.columns)
    for name, desc in columns.items():
        signature[name] = _column_spec(tf, desc, n)
    # Variable-length list columns (name -> dtype), carried as RaggedTensor.
    ragged = {name: desc["dtype"] for name, desc in columns.items() if desc["kind"] == "list"}
    if pipe._spec.stages:
        # map_batches functions may add, drop or retype columns (a soft label, a Parquet
        # column cast or padded): the signature follows the first batch of the first epoch,
        # read once here, for every column but the image (whose contract the stages keep).
        first = pipe._first_batch(batch_size=batch_size,
                                  epoch=int(epoch), drop_last=drop_last)
        if first is None and pipe.config.shard is None:
            why = (f"fewer rows than batch_size={batch_size} (drop_last=True)" if drop_last
                   else "no rows")
            msg = (f"to_tf: epoch {int(epoch)} has {why}, so it gives no batch, and the "
                   f"dataset's signature is what the map_batches functions return for its "
                   f"first batch; lower batch_size or pass drop_last=False")
            raise ConfigError(msg)
        if first is not None:  # (an empty share of a sharded epoch: the iteration says so)
            signature = {"image": signature["image"]}
            ragged = {}
            for name, value in first.items():
                if name != "image":
                    signature[name], dtype = _batch_spec(tf, name, value, n)
                    if dtype is not None:
                        ragged[name] = dtype

    # Columns of strings (numpy object arrays may hold a None a tf.string cannot).
    strings = [name for name, spec in signature.items()
               if isinstance(spec, tf.TensorSpec) and spec.dtype == tf.string]

    def gen():
        e = next(counter)
        first, open_pass["first"] = open_pass["first"], False
        if not first and open_pass["resumed"] is not None:
            logger.warning(
                "to_tf: a second pass over this dataset began (epoch %d), and its first pass "
                "was the rest of epoch %d, resumed after %d rows: Keras fit without "
                "steps_per_epoch takes the first pass's length for every epoch's and cuts "
                "the later epochs to it, without an error. Finish the resumed epoch in a fit "
                "of its own (model.fit(ds, epochs=1)), then fit pipe.to_tf(epoch=%d) for the "
                "epochs after it (docs/guide-tf.md)", e, e - 1, open_pass["resumed"], e)
            open_pass["resumed"] = None
        left = open_pass["epoch"]
        if (left is not None and not open_pass["warned"]
                and pipe.state_dict()["epoch"] == left):
            open_pass["warned"] = True
            logger.warning(
                "to_tf: epoch %d was left before its end (its position: %s rows delivered) "
                "and a pass over epoch %d began: the rest of epoch %d is not read. A pass "
                "stopped early does so (ds.take(n), a loop that breaks, steps_per_epoch), and "
                "so does Keras fit without steps_per_epoch when an epoch is longer than the "
                "dataset's first pass (a resumed epoch's rest, or a first epoch that set "
                "samples aside): see docs/guide-tf.md", left, pipe.state_dict()["delivered"],
                e, left)
        open_pass["epoch"] = e
        for batch in pipe.iter_batches(batch_size=batch_size, epoch=e,
                                       prefetch_batches=prefetch_batches, drop_last=drop_last):
            if set(batch) != set(signature):
                msg = (f"to_tf: a batch of epoch {e} carries columns {sorted(batch)}, but the "
                       f"dataset's signature (the Parquet columns and what the map_batches "
                       f"functions returned for the first batch) has {sorted(signature)}; "
                       f"return the same columns for every batch")
                raise ConfigError(msg)
            for name in strings:
                if batch[name].dtype == object and any(v is None for v in batch[name]):
                    msg = (f"to_tf: column {name!r} holds None in a batch of epoch {e} "
                           f"(ids {batch['id'][:8].tolist()}...), which a tf.string tensor "
                           f"cannot hold; return '' (or another marker) instead")
                    raise ConfigError(msg)
            for name, dtype in ragged.items():
                rows = batch[name]
                lengths = np.fromiter((len(r) for r in rows), dtype=np.int64, count=len(rows))
                flat = np.concatenate(list(rows)) if len(rows) else np.zeros(0, dtype)
                # (an empty row, np.array([]) for "no boxes", is float64 whatever the others)
                kinds = [r.dtype for r in rows if len(r)]
                got = np.result_type(*kinds) if kinds else np.dtype(dtype)
                # Integers only where they fit (int64 rows into an int32 signature would
                # wrap); floats and ints into floats as numpy casts them.
                safe = "safe" if np.dtype(dtype).kind in "iu" else "same_kind"
                if not np.can_cast(got, dtype, casting=safe):
                    msg = (f"to_tf: column {name!r} has rows of {got} in a batch of "
                           f"epoch {e}, but the dataset's signature holds {np.dtype(dtype)} "
                           f"(its first batch's rows); return the same dtype in every row, "
                           f"e.g. np.asarray(row, np.float32)")
                    raise ConfigError(msg)
                batch = {**batch, name: tf.RaggedTensor.from_row_lengths(
                    flat.astype(dtype, copy=False), lengths)}
            yield batch
        open_pass["epoch"] = None
    ds = tf.data.Dataset.from_generator(gen, output_signature=signature)
    if normalize:
        shift = tf.constant([m * 255.0 for m in mean], tf.float32)
        inv = tf.constant([1.0 / (s * 255.0) for s in std], tf.float32)

        def norm(b):
            b = dict(b)
            b["image"] = (tf.cast(b["image"], tf.float32) - shift) * inv
            return b

        ds = ds.map(norm, num_parallel_calls=tf.data.AUTOTUNE)
    if as_supervised:
        ds = ds.map(lambda b: (b["image"], b["label"], b["weight"]))
    return ds.prefetch(tf.data.AUTOTUNE)


def _batch_spec(tf: Any, name: str, value: np.ndarray, n: int | None):
    """The tf spec of a column as a numpy batch holds it, and the dtype of its rows when it
    is a variable-length list (carried ragged), else None."""
    if value.dtype.kind in "US":
        return tf.TensorSpec((n, *value.shape[1:]), tf.string), None
    if value.dtype == object:
        row = value[0] if len(value) else ""
        if isinstance(row, (str, bytes)):
            return tf.TensorSpec((n,), tf.string), None
        if isinstance(row, np.ndarray) and row.ndim == 1 and row.dtype.kind in "biuf":
            # The rows' common dtype (ints beside floats: floats), not the first row's alone.
            # (empty rows left out: np.array([]) is float64 beside rows of ints)
            kinds = [r.dtype for r in value if isinstance(r, np.ndarray) and len(r)]
            dtype = np.result_type(*kinds) if kinds else row.dtype
            if dtype.kind not in "biuf":
                msg = (f"to_tf: column {name!r} mixes rows of {sorted({str(k) for k in kinds})}, "
                       f"which have no common numeric dtype; return 1-D numeric rows of one "
                       f"dtype")
                raise ConfigError(msg)
            return tf.RaggedTensorSpec((n, None), tf.as_dtype(dtype), ragged_rank=1), dtype
        if isinstance(row, (int, float, bool, np.number, np.bool_)):
            msg = (f"to_tf: column {name!r} is an object array of {type(row).__name__} "
                   f"numbers, which tf.data cannot type row by row; return it as a numeric "
                   f"array, e.g. np.asarray(list(values)) (its rows' dtype)")
        else:
            msg = (f"to_tf: column {name!r} holds {type(row).__name__} rows, which tf.data "
                   f"has no type for; return a numeric array, or rows of strings, bytes or "
                   f"1-D numeric arrays")
        raise ConfigError(msg)
    try:
        dtype = tf.as_dtype(value.dtype)
    except TypeError:
        msg = (f"to_tf: column {name!r} holds {value.dtype}, which tf has no type for; "
               f"convert it in the map_batches function (e.g. to int64 or str)")
        raise ConfigError(msg) from None
    return tf.TensorSpec((n, *value.shape[1:]), dtype), None


def _column_spec(tf: Any, desc: dict[str, Any], n: int | None):
    """The tf spec of an extra column (see :mod:`raying.dataset.columns`)."""
    kind = desc["kind"]
    if kind in ("string", "bytes"):
        return tf.TensorSpec((n,), tf.string)
    dtype = tf.as_dtype(desc["dtype"])
    if kind == "number":
        return tf.TensorSpec((n,), dtype)
    if kind == "array":
        return tf.TensorSpec((n, int(desc["width"])), dtype)
    return tf.RaggedTensorSpec((n, None), dtype, ragged_rank=1)
