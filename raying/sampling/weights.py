"""Checks of table settings and priority updates, and the importance-weight formula."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from raying.errors import ConfigError

# Share of the gap to the mean that a stale priority closes per update call (see `age`).
DEFAULT_AGE_RATE = 0.05
# Why an update entry was refused; each entry counts under its first reason in this order.
REJECT_REASONS = ("length_mismatch", "not_integer", "out_of_range", "nan", "inf", "negative")


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
    ids = np.asarray(ids).reshape(-1)
    try:
        values = np.asarray(priorities, dtype=np.float64).reshape(-1)
    except (TypeError, ValueError):
        msg = (f"priorities must be real numbers, got {type(priorities).__name__}; pass a numpy "
               f"array, list or tensor of per-sample losses")
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
        float64 weights, same shape as ``probs``.
    """
    probs = np.asarray(probs, dtype=np.float64)
    if beta == 0.0:
        return np.ones_like(probs)
    return np.power(size * probs, -beta) / np.power(size * min_prob, -beta)


def _number(name: str, value: Any, *, low: float, high: float = math.inf,
            low_open: bool = False, hint: str) -> float:
    ok = isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool)
    if ok:
        value = float(value)
        ok = math.isfinite(value) and (value > low if low_open else value >= low) and value <= high
    if not ok:
        bound = f"> {low}" if low_open else f">= {low}"
        upper = f" and <= {high}" if math.isfinite(high) else ""
        msg = f"{name} must be a finite number {bound}{upper}, got {value!r}; {hint}"
        raise ConfigError(msg)
    return value


@dataclasses.dataclass(frozen=True)
class TableConfig:
    """The settings of a PriorityTable; see PriorityTable for what each one does.

    Args:
        alpha: priority exponent (0 = uniform, 1 = proportional).
        uniform_mix: share ``eps`` of the uniform floor in the sampling mixture.
        beta: default importance-weight exponent.
        cap_quantile: clip priorities above this quantile, or None.
        age_after: update calls without a refresh after which a priority starts aging, or None.
        age_rate: share of the gap to the mean closed per update call once aging.
        initial_priority: the priority every row starts with.
        seed: seed of the table's random generator.
    """

    alpha: float = 1.0
    uniform_mix: float = 0.0
    beta: float = 0.0
    cap_quantile: float | None = None
    age_after: int | None = None
    age_rate: float = DEFAULT_AGE_RATE
    initial_priority: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        _number("alpha", self.alpha, low=0.0,
                hint="pass e.g. alpha=0.6 (0 samples uniformly, 1 in proportion to priority)")
        _number("uniform_mix", self.uniform_mix, low=0.0, high=1.0,
                hint="pass the share of uniform draws, e.g. uniform_mix=0.1")
        _number("beta", self.beta, low=0.0,
                hint="pass e.g. beta=0.4 (0 = no importance correction, 1 = full)")
        if self.cap_quantile is not None:
            _number("cap_quantile", self.cap_quantile, low=0.0, high=1.0, low_open=True,
                    hint="pass e.g. cap_quantile=0.99, or None for no cap")
        if self.age_after is not None and (
                isinstance(self.age_after, bool) or not isinstance(self.age_after, (int, np.integer))
                or self.age_after < 1):
            msg = (f"age_after must be an integer >= 1 (update calls) or None, got "
                   f"{self.age_after!r}; pass e.g. age_after=100, or None to disable aging")
            raise ConfigError(msg)
        _number("age_rate", self.age_rate, low=0.0, high=1.0, low_open=True,
                hint="pass the share of the gap to the mean closed per update, e.g. 0.05")
        _number("initial_priority", self.initial_priority, low=0.0,
                hint="pass the priority rows start with, e.g. initial_priority=1.0")
        if isinstance(self.seed, bool) or not isinstance(self.seed, (int, np.integer)) \
                or self.seed < 0:
            msg = f"seed must be an integer >= 0, got {self.seed!r}; pass e.g. seed=0"
            raise ConfigError(msg)

    @classmethod
    def coerce(cls, value: TableConfig | Mapping[str, Any] | None) -> TableConfig:
        """Accept a TableConfig, a dict of its fields, or None (the defaults)."""
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        if isinstance(value, Mapping):
            fields = {f.name for f in dataclasses.fields(cls)}
            unknown = sorted(set(value) - fields)
            if unknown:
                msg = (f"table option(s) {unknown} not known; expected some of "
                       f"{sorted(fields)}")
                raise ConfigError(msg)
            return cls(**value)
        msg = f"table config must be a TableConfig, a dict or None, got {type(value).__name__}"
        raise ConfigError(msg)


def check_state(state: Mapping[str, Any], n: int, own: dict[str, Any], *, strict: bool,
                version: int) -> tuple[np.ndarray, np.ndarray]:
    """The priorities and last-update clocks of a table state, checked against the table.

    ``own`` is the table's config as a dict; with ``strict`` the saved one must equal it.
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
        diff = sorted(key for key in own if own[key] != state["config"].get(key))
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
