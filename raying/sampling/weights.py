"""Trainers' arrays as numpy, checks of priority updates and table states, and the
importance-weight formula."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from raying.errors import ConfigError

# Why an update entry was refused; each entry counts under its first reason in this order.
REJECT_REASONS = ("length_mismatch", "not_integer", "out_of_range", "nan", "inf", "negative")


def to_numpy(values: Any, *, dtype: Any) -> np.ndarray:
    """A 1-D numpy array from torch (any device), tf, numpy, lists or scalars."""
    if hasattr(values, "detach"):  # torch
        values = values.detach()
        if values.device.type != "cpu":
            values = values.cpu()
        try:
            values = values.numpy()
        except TypeError:  # bfloat16, float8: no numpy dtype
            if not values.is_floating_point():
                raise
            values = values.float().numpy()
    elif hasattr(values, "numpy") and not isinstance(values, np.ndarray):  # tf eager tensors
        values = values.numpy()
    if isinstance(values, np.ndarray) and values.dtype.kind == "V" and (
            "float" in values.dtype.name):
        # bfloat16 and float8 (ml_dtypes, as tf's and jax's numpy() give them): no numpy
        # kind of their own, but they convert to float32 exactly.
        values = values.astype(np.float32)
    return np.asarray(values, dtype=dtype).reshape(-1)


def check_updates(ids: Any, priorities: Any, n: int,
                  ) -> tuple[np.ndarray, np.ndarray, dict[str, int]]:
    """Split a batch of updates into valid entries and counts of rejected ones.

    Args:
        ids: sample ids, integer (or integral float) array-like of any shape.
        priorities: priorities, real array-like with as many elements as ids.
        n: number of rows; valid ids are in ``[0, n)``.

    Returns:
        ``(ids, priorities, rejected)``: the valid entries as int64 / float64 arrays in their
        original order, and ``{reason: count}`` for the non-zero rejection reasons.

    Raises:
        ConfigError: if ids or priorities are not numeric at all (a caller bug, not bad data).
    """
    try:
        values = to_numpy(priorities, dtype=np.float64)
    except (TypeError, ValueError, RuntimeError):
        msg = (f"priorities must be real numbers, got {type(priorities).__name__}; pass a numpy "
               f"array, list or tensor of per-sample losses")
        raise ConfigError(msg) from None
    try:
        ids = to_numpy(ids, dtype=None)
    except (TypeError, ValueError, RuntimeError):
        msg = (f"ids must be integers, got {type(ids).__name__}; pass the int64 ids of the "
               f"batch (batch['id'])")
        raise ConfigError(msg) from None
    if ids.dtype.kind not in "iuf" or ids.dtype == np.bool_:
        msg = (f"ids must be integers, got dtype {ids.dtype}; pass the int64 ids of the "
               f"batch (batch['id'])")
        raise ConfigError(msg)
    empty_ids = np.zeros(0, dtype=np.int64)
    if ids.size != values.size:
        return empty_ids, np.zeros(0), {"length_mismatch": max(ids.size, values.size)}
    rejected: dict[str, int] = {}
    ok = None
    if ids.dtype.kind == "f":
        bad = ~(np.isfinite(ids) & (np.floor(ids) == ids))
        ok = _count(bad, None, "not_integer", rejected)
    bad = (ids < 0) | (ids >= n)
    ok = _count(bad, ok, "out_of_range", rejected)
    if not np.all(np.isfinite(values)):
        ok = _count(np.isnan(values), ok, "nan", rejected)
        ok = _count(np.isinf(values), ok, "inf", rejected)
    ok = _count(values < 0, ok, "negative", rejected)
    if ok is None:
        return ids.astype(np.int64, copy=False), values, rejected
    return ids[ok].astype(np.int64), values[ok], rejected


def _count(bad: np.ndarray, ok: np.ndarray | None, reason: str,
           rejected: dict[str, int]) -> np.ndarray | None:
    """Record entries that are bad and still ok under `reason`; return the new ok mask."""
    if not bad.any():
        return ok
    if ok is not None:
        bad &= ok
    count = int(bad.sum())
    if count:
        rejected[reason] = rejected.get(reason, 0) + count
    return ~bad if ok is None else ok & ~bad


_FLOAT32_TINY = float(np.finfo(np.float32).tiny)


def importance_weights(probs: Any, *, size: int, min_prob: float, beta: float) -> np.ndarray:
    """Importance weights ``w = (size * P)**-beta / (size * min_prob)**-beta``.

    Prioritized-replay weights normalised by the largest weight the distribution can give
    (that of its least likely row), so ``0 < w <= 1`` for every row that can be drawn, and the
    scale does not depend on which rows happen to be in the batch.

    Args:
        probs: sampling probabilities of the drawn rows.
        size: number of rows ``N`` of the whole distribution.
        min_prob: least positive probability over all ``N`` rows.
        beta: exponent; 0 gives weights of 1, 1 fully corrects the sampling bias.

    Returns:
        float64 weights, same shape as ``probs``, at least float32's smallest normal number.
    """
    probs = np.asarray(probs, dtype=np.float64)
    if beta == 0.0:
        return np.ones_like(probs)
    w = np.power(size * probs, -beta) / np.power(size * min_prob, -beta)
    # At least float32's smallest normal number: batches carry float32 weights, and a row
    # far likelier than the least likely one (no uniform floor, extreme losses) would
    # otherwise weigh exactly 0 there, its loss silently dropped.
    return np.maximum(w, _FLOAT32_TINY)


def check_state(state: Mapping[str, Any], n: int, own: dict[str, Any], *, strict: bool,
                version: int) -> tuple[np.ndarray, np.ndarray]:
    """The priorities and last-update clocks of a table state, checked against the table.

    ``own`` is the table's config as a dict; with ``strict`` the saved one must equal it,
    but for ``beta``: it shapes only the weights of later draws, not the priorities or the
    distribution, and a schedule anneals it from one checkpoint to the next.
    """
    if state.get("version") != version:
        msg = (f"table state version must be {version}, got {state.get('version')!r}; "
               f"was it saved by another raying version?")
        raise ConfigError(msg)
    if int(state["n"]) != n:
        msg = (f"table state holds {state['n']} rows, this table has {n}; build the "
               f"table with n={state['n']}")
        raise ConfigError(msg)
    if strict:
        diff = sorted(key for key in own
                      if key != "beta" and own[key] != state["config"].get(key))
        if diff:
            got = {key: state["config"].get(key) for key in diff}
            msg = (f"table state was saved with {got}, this table has "
                   f"{ {key: own[key] for key in diff} }; build the table with the saved "
                   f"settings, or pass strict=False to keep this table's")
            raise ConfigError(msg)
    raw = np.asarray(state["priorities"], dtype=np.float64)
    last = np.asarray(state["last_update"], dtype=np.int64)
    if raw.shape != (n,) or last.shape != (n,) or not np.all(np.isfinite(raw)) \
            or np.any(raw < 0):
        msg = (f"table state priorities must be {n} finite values >= 0 with as many "
               f"last_update entries; got shapes {raw.shape} and {last.shape}")
        raise ConfigError(msg)
    return raw, last
