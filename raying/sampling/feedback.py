"""Feedback from trainers: per-sample losses buffered and sent to the store without blocking."""

from __future__ import annotations

import atexit
import logging
import threading
import time
from typing import Any

import numpy as np

from raying.errors import ConfigError
from raying.options import settings
from raying.sampling.weights import to_numpy

logger = logging.getLogger(__name__)


def _dims(x: Any) -> tuple[int, ...] | None:
    """The shape of an array, tensor or list from its metadata (no copy off a device);
    None where it is not known (a ragged list, a symbolic dimension)."""
    shape = getattr(x, "shape", None)
    try:
        return tuple(int(d) for d in (np.shape(x) if shape is None else shape))
    except (TypeError, ValueError):
        return None


def _kind(x: Any) -> str | None:
    """The numpy kind (``"f"``, ``"i"``, ``"u"``, ``"b"``, ``"c"``, ...) of an array's,
    tensor's or list's values, from their dtype's name where they are not numpy (torch's
    ``torch.float32``, tf's ``<dtype: 'int64'>``): nothing is copied off a device."""
    dtype = getattr(x, "dtype", None)
    if isinstance(dtype, np.dtype):
        return dtype.kind
    if dtype is None:
        try:
            return np.asarray(x).dtype.kind
        except (TypeError, ValueError):
            return None
    name = str(dtype)
    for token, kind in (("bool", "b"), ("complex", "c"), ("float", "f"), ("uint", "u"),
                        ("int", "i"), ("string", "S")):
        if token in name:
            return kind
    return None


def shape_problem(ids_shape: tuple[int, ...] | None, shape: tuple[int, ...] | None,
                  ids: int, losses: int) -> str | None:
    """What is wrong with reporting losses of ``shape`` (``losses`` values) for ids of
    ``ids_shape`` (``ids`` values), or None: a reduced loss, per-token losses, or losses whose
    layout would pair them with the ids by accident. A plain length mismatch is not one
    here: the store rejects and counts those."""
    if shape is not None and len(shape) == 0 and ids != 1:
        return (f"raying.report: one loss for {ids} ids, a reduced (mean) loss; pass the "
                f"per-sample losses (e.g. CrossEntropyLoss(reduction='none'))")
    if shape is None or len(shape) < 2:
        return None
    if shape[0] == ids and losses != ids:
        # Per-token or per-pixel losses: a caller bug at every step, not bad data.
        return (f"raying.report: one loss per sample expected, got losses of shape {shape} "
                f"for {ids} ids; reduce each sample's other axes first "
                f"(e.g. loss.reshape(len(ids), -1).mean(1))")
    if shape[0] != ids and losses == ids and shape != ids_shape and shape != (1, ids):
        # (2, 2) losses for 4 ids: flattened they would pair up by accident of layout
        # (losses shaped as their ids are, gathered (workers, batch) say, pair up).
        return (f"raying.report: losses of shape {shape} for {ids} ids; pass one loss per "
                f"id, of shape ({ids},) (or ({ids}, 1)), in the order of the ids")
    return None


def check_report(ids: Any, losses: Any) -> None:
    """Refuse, from their metadata alone, what every sampler's ``report`` refuses: ids that
    are not integers, losses that are not real numbers, a reduced loss, per-token losses
    and layouts that pair by accident. For samplers that drop losses (uniform, weighted),
    so that a loop that reports wrong values fails now, not once it changes sampler; a
    length mismatch is logged once (a prioritized sampler rejects and counts it)."""
    kind = _kind(ids)
    if kind is not None and kind not in "iuf":
        msg = (f"raying.report: ids must be integers, got {type(ids).__name__} of "
               f"{getattr(ids, 'dtype', kind)}; pass the int64 ids of the batch (batch['id'])")
        raise ConfigError(msg)
    kind = _kind(losses)
    if kind is None or kind not in "iuf":
        got = type(losses).__name__ + (f" of {losses.dtype}" if hasattr(losses, "dtype") else "")
        msg = (f"raying.report: losses must be real numbers (float or integer arrays or "
               f"tensors, one per id), got {got}")
        raise ConfigError(msg)
    ids_shape, shape = _dims(ids), _dims(losses)
    if ids_shape is None or shape is None:
        return
    n, size = int(np.prod(ids_shape)), int(np.prod(shape))
    problem = shape_problem(ids_shape, shape, n, size)
    if problem is not None:
        raise ConfigError(problem)
    global _warned_length
    if n != size and not _warned_length:
        _warned_length = True
        logger.warning("raying.report: %d ids but losses of shape %s; this sampler does not use "
                       "losses, but a prioritized one would reject and count the batch (pass "
                       "one loss per id)", n, shape)


_warned_length = False


class Reporter:
    """Buffers (id, loss) pairs and sends them to a priority store in batches.

    ``add`` converts and appends (microseconds); every ``flush_ids`` ids or ``flush_s``
    seconds the buffer goes to the store with a fire-and-forget actor call. Nothing on this
    path waits for the store. Length mismatches are rejected and counted (the store counts
    NaN, inf, negative values and out-of-range ids).

    Args:
        handle: the store (a picklable ``StoreHandle``).
        flush_ids: send when this many ids are buffered.
        flush_s: ... or when the oldest buffered report is this old.
    """

    def __init__(self, handle: Any, *, flush_ids: int | None = None,
                 flush_s: float | None = None) -> None:
        self.handle = handle
        self.flush_ids = int(settings().report_flush_ids if flush_ids is None else flush_ids)
        self.flush_s = float(settings().report_flush_s if flush_s is None else flush_s)
        self._ids: list[np.ndarray] = []
        self._values: list[np.ndarray] = []
        self._count = 0
        self._since: float | None = None
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()  # one flush from buffer to store at a time
        self.sent = 0
        self.sends = 0
        self.dropped = 0  # reports left when the store's Ray session ended
        self.rejected_length = 0

    @property
    def pending(self) -> int:
        """Ids buffered, not sent yet."""
        return self._count

    def add(self, ids: Any, losses: Any) -> None:
        """Buffer one batch of reports; send if the buffer is due."""
        i = to_numpy(ids, dtype=None)
        if i.dtype.kind not in "iuf":  # bools would count as id 1, strings fail in numpy
            msg = (f"raying.report: ids must be integers, got dtype {i.dtype}; pass the int64 "
                   f"ids of the batch (batch['id'])")
            raise ConfigError(msg)
        try:
            v = to_numpy(losses, dtype=None)
        except (TypeError, ValueError):
            v = None
        # Real numbers only: numpy would turn "5.0" and b"1" into 5.0 and 1.0, drop a complex
        # loss's imaginary part, and None into NaN.
        if v is None or v.dtype.kind not in "iuf":
            got = type(losses).__name__ if v is None else f"{type(losses).__name__} of {v.dtype}"
            msg = (f"raying.report: losses must be real numbers (float or integer arrays or "
                   f"tensors, one per id), got {got}")
            raise ConfigError(msg) from None
        problem = shape_problem(_dims(ids), _dims(losses), i.size, v.size)
        if problem is not None:
            raise ConfigError(problem)
        v = v.astype(np.float64, copy=False)
        # Float ids travel as floats: the store rejects and counts non-integral ones (a cast
        # here would truncate 1.5 to 1 and credit the loss to another sample).
        i = i.astype(np.float64 if i.dtype.kind == "f" else np.int64, copy=False)
        if i.size != v.size:
            with self._lock:
                self.rejected_length += max(i.size, v.size)
            if self.rejected_length == max(i.size, v.size):
                hint = ("reduce the other axes of a loss computed with reduction='none', "
                        "e.g. loss.mean(dim=1)" if v.ndim > 1 else
                        "the ids and the losses of the same batch")
                logger.warning("raying.report: %d ids but losses of shape %s; the batch is "
                               "rejected and counted, as every later such batch is (pass one "
                               "loss per id: %s)", i.size, tuple(v.shape), hint)
            from raying.sampling.store import update_async

            update_async(self.handle, i, v)  # the store counts it as a length mismatch
            return
        with self._lock:
            self._ids.append(i)
            self._values.append(v)
            self._count += i.size
            now = time.monotonic()
            first = self._since is None
            since = now if self._since is None else self._since
            self._since = since
            due = self._count >= self.flush_ids or now - since >= self.flush_s
        if due:
            self.flush()
        elif first:  # the flush_s promise holds even if no further report comes
            timer = threading.Timer(self.flush_s, self.flush)
            timer.daemon = True
            timer.start()

    def flush(self) -> bool:
        """Send what is buffered now (still without waiting for the store); True when this
        call sent something.

        Reports still buffered when Ray was shut down are dropped: the store went with the
        session, and a call now (this flush also runs on a timer) would start a new local
        Ray, or fail on the old handle after a new ``ray.init()``.
        """
        import ray

        from raying.sampling.store import update_async

        # From taking the buffer to submitting it, one flush at a time: the timer's flush and
        # the training thread's would otherwise reach the store out of order, and under
        # "last wins" an older loss would overwrite a newer one (a Ray actor runs one
        # caller's calls in the order they were submitted).
        with self._send_lock:
            with self._lock:
                if not self._ids:
                    return False
                ids = np.concatenate(self._ids)
                values = np.concatenate(self._values)
                self._ids, self._values, self._count, self._since = [], [], 0, None
            if not ray.is_initialized():
                self._drop(ids.size)
                return False
            try:
                update_async(self.handle, ids, values)
            except Exception as exc:
                if "different cluster" not in str(exc) and "Can't find actor" not in str(exc):
                    raise
                self._drop(ids.size)  # a handle of a session that ended: its store is gone
                return False
            self.sent += ids.size
            self.sends += 1
            return True


    def set_aside(self, ids: np.ndarray) -> None:
        """Give ``ids`` priority 0 outright: after the reports buffered before them (sent
        first, in order), and not folded by the store's coalesce mode (an ``"ema"`` store
        would move a bad sample's priority only part of the way to 0, and draw it again)."""
        import ray

        from raying.sampling.store import update_async

        self.flush()
        with self._send_lock:
            if not ray.is_initialized():
                self._drop(ids.size)
                return
            try:
                update_async(self.handle, ids, np.zeros(ids.size), exact=True)
            except Exception as exc:
                if "different cluster" not in str(exc) and "Can't find actor" not in str(exc):
                    raise
                self._drop(ids.size)
                return
            self.sent += ids.size
            self.sends += 1

    def _drop(self, n: int) -> None:
        if not self.dropped:
            logger.warning("raying.report: %d reports to priority store %s were dropped: its "
                           "Ray session ended (ray.shutdown) before they were sent", n,
                           getattr(self.handle, "name", "?"))
        self.dropped += n


_reporters: dict[tuple[str, str | None, str | None], Reporter] = {}
_registry_lock = threading.Lock()


def report(ids: Any, losses: Any, *, store: str, namespace: str | None = None) -> None:
    """Report per-sample losses to the priority store named ``store``, without blocking.

    For Ray Train workers, which hold no Pipeline: the pipeline's store name is
    ``pipe.store_name`` (pass it to the workers in ``train_loop_config``).

    Args:
        ids: the batch's ``id`` column (torch, tf, numpy or a list).
        losses: one loss per id, same length (unreduced: ``reduction="none"``).
        store: the store's name.
        namespace: its Ray namespace, if not the job's.
    """
    if not isinstance(store, str) or not store:
        msg = f"report(..., store=...) needs the priority store's name, got {store!r}"
        raise ConfigError(msg)
    from raying.sampling.store import ray_session

    # Per Ray session too: a store of the same name after ray.shutdown() and ray.init() is
    # another actor, and the old handle reaches nothing.
    key = (store, namespace, ray_session())
    rep = _reporters.get(key)
    if rep is None:
        from raying.sampling.store import get_store

        with _registry_lock:
            rep = _reporters.get(key)
            if rep is None:
                rep = Reporter(get_store(store, namespace=namespace))
                _reporters[key] = rep
    rep.add(ids, losses)


def flush_all() -> None:
    """Send every buffered report of this process (called at exit and by ``Pipeline.close``)."""
    for rep in list(_reporters.values()):
        try:
            rep.flush()
        except Exception:  # noqa: BLE001 - at exit the store may already be gone
            logger.debug("could not flush reports to %s", rep.handle.name, exc_info=True)


atexit.register(flush_all)
