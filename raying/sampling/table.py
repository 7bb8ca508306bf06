"""PriorityTable: float64 priorities in a sum tree, sampled from a mixture with a uniform floor."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from raying.errors import ConfigError
from raying.options import (
    DEFAULT_AGE_RATE,
    DEFAULT_GUARD_DECLINE,
    DEFAULT_GUARD_QUANTILE,
    MAX_PRIORITY_LEAF,
    TableConfig,
)
from raying.sampling.sumtree import LeafMinima, SumTree
from raying.sampling.weights import (
    REJECT_REASONS,
    check_state,
    check_updates,
    importance_weights,
)

_STATE_VERSION = 1


class PriorityTable:
    """Per-sample priorities that decide which samples are drawn next, in pure numpy.

    Row ``i`` of ``n`` holds a priority ``p_i >= 0`` (typically a recent loss). Draws follow the
    mixture ``P_i = (1 - eps) * p_i**alpha / sum_j p_j**alpha + eps / n`` with
    ``eps = uniform_mix``: ``alpha`` sharpens or flattens the priorities, ``eps`` is a uniform
    floor that keeps every row reachable. A float64 sum tree holds ``p_i**alpha``; batched
    updates recompute the touched parents from their children, so the root never drifts.

    Behaviour worth knowing:

    * Rows start at ``initial_priority``, so sampling is uniform until losses arrive.
    * If every priority is zero the table samples uniformly (``P_i = 1/n``).
    * NaN, infinite and negative priorities, ids outside ``[0, n)`` or not integral, and
      calls whose ids and priorities differ in length are rejected, counted by reason in
      ``rejected`` and never inserted; the valid entries of the same call still apply, and
      of repeated ids in one call the last one wins.
    * ``cap_quantile=q`` clips priorities above the q-quantile of the stored priorities. The
      threshold is recomputed by ``refresh_cap()`` (the priority store calls it periodically;
      until the first call nothing is clipped); updates are clipped at the current threshold.
    * Aging: the table's clock counts update calls. A row not refreshed for ``age_after`` calls
      moves toward the current mean priority by ``age_rate`` per further call, applied in one
      vectorized pass by ``age()`` (compounded over the calls since the previous pass).
    * The noisy-label guard (``guard_after=k``): each row counts its consecutive reports at
      or above the ``guard_quantile`` of the stored priorities (the threshold, and the median
      priority, are recomputed by ``refresh_guard()``, which the store calls with the cap).
      A report extends the streak only if its loss has not fallen by ``DEFAULT_GUARD_DECLINE``
      of the streak's first loss; one that has is progress and starts a new streak from it.
      A row with ``k`` or more such reports in a row is *persistently high-loss*: it is drawn
      as if its priority were at most the median priority, until a report falls below the
      threshold. Progress keeps a row from being held, but does not release a held one: a
      mislabelled sample the model starts to memorise shows falling losses too, and drawing
      it at its own priority then would speed the memorising up. A learnable hard sample's
      loss falls as it is drawn; a mislabelled one's stays high, and without the guard it
      would keep a large share of the draws. The median, not the mean: under label noise the
      mean is inflated by the noisy rows' own losses, and holding them there would still draw
      them several times as often as a typical sample.
    * Importance weights ``w = (n * P)**-beta / max_j (n * P_j)**-beta``: the maximum is taken
      over the whole table (the row of least positive probability), not over the batch, so
      ``0 < w <= 1`` and weights of different batches are comparable.

    Args:
        n: number of rows (sample ids ``0 .. n-1``).
        alpha: priority exponent; 0 samples uniformly, 1 in proportion to priority.
        uniform_mix: share of the uniform floor ``eps`` in ``[0, 1]``.
        beta: default importance-weight exponent for ``weights``.
        cap_quantile: clip priorities above this quantile, in ``(0, 1]``; None disables.
        age_after: update calls without refresh before a row ages; None disables aging.
        age_rate: share of the distance to the mean closed per update call while aging.
        initial_priority: the priority every row starts with.
        seed: seed of the generator used by ``sample`` (saved in ``state_dict``).
        guard_after: consecutive high-loss reports without progress after which a row is
            drawn at the median priority at most; None disables the guard.
        guard_quantile: the quantile of stored priorities that counts as high loss.
        prior: static weights ``w_i >= 0`` (None: all equal). They re-weight both parts of
            the mixture: ``P_i = (1 - eps) * w_i p_i**alpha / sum_j w_j p_j**alpha
            + eps * w_i / sum_j w_j``, so before any loss arrives draws follow the prior, and
            losses shape draws within it. A row of weight 0 is never drawn.
    """

    def __init__(self, n: int, *, alpha: float = 1.0, uniform_mix: float = 0.0,
                 beta: float = 0.0, cap_quantile: float | None = None,
                 age_after: int | None = None, age_rate: float = DEFAULT_AGE_RATE,
                 initial_priority: float = 1.0, seed: int = 0,
                 guard_after: int | None = None,
                 guard_quantile: float = DEFAULT_GUARD_QUANTILE,
                 prior: Any = None) -> None:
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
            msg = f"n must be an integer >= 1 (the number of samples), got {n!r}"
            raise ConfigError(msg)
        self.n = int(n)
        self.config = TableConfig(alpha=alpha, uniform_mix=uniform_mix, beta=beta,
                                  cap_quantile=cap_quantile, age_after=age_after,
                                  age_rate=age_rate, initial_priority=initial_priority,
                                  seed=seed, guard_after=guard_after,
                                  guard_quantile=guard_quantile)
        self._rng = np.random.Generator(np.random.PCG64(self.config.seed))
        self._raw = np.full(self.n, float(self.config.initial_priority))
        self._last = np.zeros(self.n, dtype=np.int64)
        self._clock = 0
        self._aged_clock = 0
        self._cap = math.inf
        # The guard: consecutive high-loss reports per row, the threshold they are counted
        # against and the level a flagged row is drawn at (both inf until refresh_guard).
        self._streak = np.zeros(self.n, dtype=np.int64)
        self._streak_ref = np.zeros(self.n)  # the loss of each streak's first report
        self._guard_threshold = math.inf
        self._guard_level = math.inf
        self.rejected: dict[str, int] = dict.fromkeys(REJECT_REASONS, 0)
        self.counters: dict[str, int] = {"update_calls": 0, "updates_applied": 0,
                                         "samples": 0, "aged_rows": 0}
        # The prior, scaled to mean 1 (so the mixture's coefficients stay those of no prior),
        # in a tree of its own for the floor's share of each subtree.
        self._prior: np.ndarray | None = None
        self._prior_tree: SumTree | None = None
        if prior is not None:
            w = np.asarray(prior, dtype=np.float64).reshape(-1)
            if w.size != self.n or not np.all(np.isfinite(w)) or np.any(w < 0) \
                    or not w.sum() > 0:
                msg = (f"prior must hold {self.n} finite weights >= 0, not all zero; got "
                       f"{w.size} with min {w.min() if w.size else None}")
                raise ConfigError(msg)
            self._prior = w * (self.n / w.sum())
            self._prior_tree = SumTree(self._prior)
        self._tree = SumTree(self._leaf_values(self._raw))
        self._minima = LeafMinima()

    @classmethod
    def from_config(cls, n: int, config: TableConfig | Mapping[str, Any] | None) -> PriorityTable:
        """Build a table from a TableConfig or a dict of its fields."""
        return cls(n, **dataclasses.asdict(TableConfig.coerce(config)))

    def __len__(self) -> int:
        return self.n

    def __repr__(self) -> str:
        c = self.config
        return (f"PriorityTable(n={self.n}, alpha={c.alpha}, uniform_mix={c.uniform_mix}, "
                f"total={self.total():.6g})")

    # --- writes -------------------------------------------------------------------------------

    def update(self, ids: Any, priorities: Any) -> int:
        """Set the priorities of a batch of rows.

        Args:
            ids: sample ids, integer array-like (any shape, flattened).
            priorities: new priorities, same length; typically per-sample losses.

        Returns:
            The number of rows written (after rejections and de-duplication).
        """
        ids, values, rejected = check_updates(ids, priorities, self.n)
        for reason, count in rejected.items():
            self.rejected[reason] += count
        if ids.size == 0:
            return 0
        if ids.size > 1 and not np.all(ids[1:] > ids[:-1]):
            order = np.argsort(ids, kind="stable")
            ids = ids[order]
            values = values[order]
            last = np.empty(ids.size, dtype=bool)  # the last of each run of equal ids wins
            np.not_equal(ids[:-1], ids[1:], out=last[:-1])
            last[-1] = True
            ids = ids[last]
            values = values[last]
        self._clock += 1
        self._raw[ids] = values
        self._last[ids] = self._clock
        if self.config.guard_after is not None:
            high = values >= self._guard_threshold
            cur, ref = self._streak[ids], self._streak_ref[ids]
            progress = (cur > 0) & (values < ref * (1.0 - DEFAULT_GUARD_DECLINE))
            held = cur >= self.config.guard_after  # released only by a report below the threshold
            streak = np.where(high, np.where(progress & ~held, 1, cur + 1), 0)
            self._streak[ids] = streak
            self._streak_ref[ids] = np.where(streak == 1, values, ref)
        leaves = self._leaf_values(values, ids)
        self._minima.replace(self._tree.leaves[ids], leaves)
        self._tree.set(ids, leaves)
        self.counters["update_calls"] += 1
        self.counters["updates_applied"] += int(ids.size)
        return int(ids.size)

    def age(self) -> int:
        """Move priorities not refreshed for ``age_after`` update calls toward the mean.

        Each such row closes ``age_rate`` of its gap to the current mean priority per update
        call since it went stale (or since the previous ``age()``), compounded. A no-op when
        aging is off or no update call happened since the last pass.

        Returns:
            The number of rows that moved.
        """
        after = self.config.age_after
        if after is None or self._clock == self._aged_clock:
            return 0
        calls = self._clock - np.maximum(self._last + after, self._aged_clock)
        self._aged_clock = self._clock
        stale = np.flatnonzero(calls > 0)
        if stale.size == 0:
            return 0
        mean = float(self._raw.mean())
        keep = np.power(1.0 - self.config.age_rate, calls[stale].astype(np.float64))
        self._raw[stale] = mean + (self._raw[stale] - mean) * keep
        if stale.size > self.n // 4:
            self._tree.leaves[:] = self._leaf_values(self._raw)
            self._tree.rebuild()
        else:
            self._tree.set(stale, self._leaf_values(self._raw[stale], stale))
        self._minima.invalidate()
        self.counters["aged_rows"] += int(stale.size)
        return int(stale.size)

    def refresh_cap(self) -> float:
        """Recompute the cap threshold from the current priorities and re-clip every row.

        Returns:
            The threshold now in force (inf when ``cap_quantile`` is None).
        """
        if self.config.cap_quantile is None:
            return math.inf
        self._cap = float(np.quantile(self._raw, self.config.cap_quantile))
        self._tree.leaves[:] = self._leaf_values(self._raw)
        self._tree.rebuild()
        self._minima.invalidate()
        return self._cap

    def refresh_guard(self) -> float:
        """Recompute the guard's high-loss threshold and level from the current priorities.

        Returns:
            The threshold now in force (inf when the guard is off).
        """
        if self.config.guard_after is None:
            return math.inf
        self._guard_threshold = float(np.quantile(self._raw, self.config.guard_quantile))
        self._guard_level = float(np.median(self._raw))
        self._tree.leaves[:] = self._leaf_values(self._raw)
        self._tree.rebuild()
        self._minima.invalidate()
        return self._guard_threshold

    def guarded(self) -> np.ndarray:
        """Mask of the rows the guard holds at the median priority (persistently high-loss)."""
        after = self.config.guard_after
        if after is None:
            return np.zeros(self.n, dtype=bool)
        return self._streak >= after

    def guard_summary(self) -> dict[str, float | int | None]:
        """How many rows are persistently high-loss, and their share of the top priorities.

        ``top_rows`` are the rows at or above the high-loss threshold; ``persistent_top`` of
        them are held by the guard. A store combines shards by summing the counts.
        """
        if self.config.guard_after is None:
            return {"threshold": None, "level": None, "guarded": 0, "top_rows": 0,
                    "persistent_top": 0}
        flagged = self.guarded()
        top = self._raw >= self._guard_threshold
        return {"threshold": None if math.isinf(self._guard_threshold)
                else self._guard_threshold,
                "level": None if math.isinf(self._guard_level) else self._guard_level,
                "guarded": int(flagged.sum()), "top_rows": int(top.sum()),
                "persistent_top": int((top & flagged).sum())}

    def _leaf_values(self, raw: np.ndarray, ids: np.ndarray | None = None) -> np.ndarray:
        """``min(p**alpha, MAX_PRIORITY_LEAF)`` of rows ``ids`` (all when None), after the cap
        and the guard; the bound on leaves keeps the sums finite for a diverging loss."""
        v = np.minimum(raw, self._cap) if math.isfinite(self._cap) else raw
        if self.config.guard_after is not None and math.isfinite(self._guard_level):
            flagged = self._streak >= self.config.guard_after
            if ids is not None:
                flagged = flagged[ids]
            if flagged.any():
                v = np.where(flagged, np.minimum(v, self._guard_level), v)
        alpha = self.config.alpha
        if alpha == 1.0:
            out = np.array(v, dtype=np.float64, copy=True)
        else:
            with np.errstate(over="ignore"):
                out = np.power(v, alpha)
        if self._prior is not None:
            out *= self._prior if ids is None else self._prior[ids]
        return np.minimum(out, MAX_PRIORITY_LEAF, out=out)

    # --- reads --------------------------------------------------------------------------------

    def total(self) -> float:
        """The sum of ``p_i**alpha`` over all rows (after the cap): the root of the tree."""
        return self._tree.total

    def coefficients(self) -> tuple[float, float]:
        """``(a, b)`` such that ``P_i = a * p_i**alpha + b``; ``(0, 1/n)`` if all are zero."""
        total = self._tree.total
        if total > 0.0:
            return (1.0 - self.config.uniform_mix) / total, self.config.uniform_mix / self.n
        return 0.0, 1.0 / self.n

    def probabilities(self, ids: Any = None) -> np.ndarray:
        """Sampling probabilities ``P_i`` of the given ids (all rows when None)."""
        a, b = self.coefficients()
        idx = None if ids is None else self._index(ids)
        leaves = self._tree.leaves if idx is None else self._tree.leaves[idx]
        return a * leaves + b * self._floor(idx)

    def _floor(self, idx: np.ndarray | None) -> Any:
        """The floor's weight of rows ``idx`` (all when None): 1, or the prior."""
        if self._prior is None:
            return 1.0
        return self._prior if idx is None else self._prior[idx]

    @property
    def prior(self) -> np.ndarray | None:
        """The prior, scaled to mean 1 (None without one); a copy."""
        return None if self._prior is None else self._prior.copy()

    def priorities(self, ids: Any = None) -> np.ndarray:
        """The stored priorities (before alpha and the cap) of the given ids, as a copy."""
        return self._raw.copy() if ids is None else self._raw[self._index(ids)]

    def reported(self) -> np.ndarray:
        """Whether each row's priority was ever updated (a loss reported), as a new array."""
        return self._last > 0

    @property
    def rng(self) -> np.random.Generator:
        """The table's random generator (its state is part of ``state_dict``)."""
        return self._rng

    def leaf_minima(self) -> tuple[float, float]:
        """``(min, least positive)`` of ``p_i**alpha`` (inf if none), cached until a write."""
        return self._minima.get(self._tree.leaves)

    def min_probability(self) -> float:
        """The least positive ``P_i`` of the table: the row whose weight is 1."""
        a, b = self.coefficients()
        if self._prior is not None:  # the floor differs by row: no shortcut through the minima
            probs = a * self._tree.leaves + b * self._prior
            return float(np.min(probs, where=probs > 0.0, initial=np.inf))
        if a == 0.0:
            return b
        low, low_positive = self.leaf_minima()
        return a * low + b if b > 0.0 else a * low_positive

    def weights(self, probs: Any, beta: float | None = None) -> np.ndarray:
        """Importance weights ``(n*P)**-beta / (n*P_min)**-beta`` of probabilities from this table.

        Args:
            probs: probabilities returned by ``sample`` or ``probabilities``.
            beta: the exponent; the table's ``beta`` when None.
        """
        beta = self.config.beta if beta is None else beta
        return importance_weights(probs, size=self.n, min_prob=self.min_probability(),
                                  beta=beta)

    def importance_weights(self, ids: Any, beta: float | None = None) -> np.ndarray:
        """Importance weights of the given ids under the current distribution."""
        return self.weights(self.probabilities(ids), beta)

    def ess(self) -> float:
        """Effective sample size of the distribution, ``1 / sum_i P_i**2`` (n when uniform)."""
        probs = self.probabilities()
        return float(1.0 / np.dot(probs, probs))

    def leaf_summary(self) -> dict[str, float]:
        """Sums and minima of ``p_i**alpha`` that a sharded store combines across tables, and
        the floor's weights: ``cross = sum(leaf * floor)``, ``floor_sq = sum(floor**2)`` (a
        uniform floor: ``total`` and ``n``). With a prior, ``min_prob`` is the table's exact
        least positive probability (such a store is one shard)."""
        leaves = self._tree.leaves
        low, low_positive = self.leaf_minima()
        out = {"n": self.n, "total": self._tree.total, "sum_sq": float(np.dot(leaves, leaves)),
               "min": low, "min_positive": low_positive, "cross": self._tree.total,
               "floor_sq": float(self.n)}
        if self._prior is not None:
            out.update(cross=float(np.dot(leaves, self._prior)),
                       floor_sq=float(np.dot(self._prior, self._prior)),
                       min_prob=self.min_probability())
        return out

    def age_summary(self) -> dict[str, float | int | None]:
        """Ages (update calls since each row's last refresh): mean, p50, p90, max, shares."""
        ages = self._clock - self._last
        p50, p90 = np.percentile(ages, [50, 90])
        after = self.config.age_after
        return {"clock": self._clock, "mean": float(ages.mean()), "p50": float(p50),
                "p90": float(p90), "max": int(ages.max()),
                "never_updated_share": float(np.mean(self._last == 0)),
                "stale_share": None if after is None else float(np.mean(ages >= after))}

    # --- sampling -----------------------------------------------------------------------------

    def sample(self, k: int, *, systematic: bool = False,
               rng: np.random.Generator | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Draw ``k`` ids from the mixture ``P``.

        I.i.d. draws come in random order. A systematic (low-variance) plan places ``k``
        stratified positions ``(j + U) / k`` on the mixture's CDF with one uniform ``U``: row
        ``i`` then appears ``floor(k*P_i)`` or ``ceil(k*P_i)`` times, and the plan comes out in
        ascending id order (good for read locality; shuffle it if order matters).

        Args:
            k: number of draws (plans of >= 4096 amortise the per-call cost).
            systematic: a stratified plan instead of i.i.d. draws.
            rng: a generator to use instead of the table's own (which ``state_dict`` saves).

        Returns:
            ``(ids, probs)``: int64 ids and their float64 probabilities ``P_i``.
        """
        if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 0:
            msg = f"k must be an integer >= 0 (the number of draws), got {k!r}"
            raise ConfigError(msg)
        rng = self._rng if rng is None else rng
        k = int(k)
        if systematic:
            positions = (np.arange(k, dtype=np.float64) + rng.random()) / max(k, 1)
        else:
            positions = rng.random(k)
        self.counters["samples"] += k
        a, b = self.coefficients()
        return self.locate(positions * (a * self._tree.total + b * self.n), a=a, b=b)

    def sample_in_groups(self, k: int, starts: Any, rows_per_group: int, *,
                         rng: np.random.Generator | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Draw ``k`` ids in two stages that keep reads local (Parquet row groups).

        Groups are contiguous id ranges ``[starts[g], starts[g+1])`` (the last ends at ``n``).
        Stage one draws ``ceil(k / rows_per_group)`` groups, each with probability equal to its
        mixture mass ``sum_{i in g} P_i``; stage two draws ``rows_per_group`` ids inside each
        chosen group with probability ``P_i / mass_g``. Every draw therefore has the marginal
        probability ``P_g * P_i / mass_g = P_i`` exactly, which is what ``probs`` returns, while
        a plan touches ``k / rows_per_group`` groups instead of up to ``k``.

        Args:
            k: number of ids.
            starts: sorted first id of every group (``starts[0] == 0``).
            rows_per_group: ids drawn inside each chosen group.
            rng: a generator instead of the table's own.
        """
        if rows_per_group < 1:
            msg = f"rows_per_group must be >= 1, got {rows_per_group!r}"
            raise ConfigError(msg)
        rng = self._rng if rng is None else rng
        starts = np.asarray(starts, dtype=np.int64)
        ends = np.append(starts[1:], self.n)
        groups = -(-int(k) // int(rows_per_group))
        anchors, _ = self.sample(groups, rng=rng)
        self.counters["samples"] += int(k) - groups  # ids drawn, as sample() counts them
        g = np.searchsorted(starts, anchors, side="right") - 1
        lo = np.repeat(starts[g], rows_per_group)[:k]
        hi = np.repeat(ends[g], rows_per_group)[:k]
        a, b = self.coefficients()
        if self._prior_tree is not None:
            c_lo = a * self._tree.prefix(lo) + b * self._prior_tree.prefix(lo)
            c_hi = a * self._tree.prefix(hi) + b * self._prior_tree.prefix(hi)
        else:
            c_lo = a * self._tree.prefix(lo) + b * lo
            c_hi = a * self._tree.prefix(hi) + b * hi
        positions = c_lo + rng.random(lo.size) * (c_hi - c_lo)
        ids, probs = self.locate(positions, a=a, b=b)
        # Rounding at a group's edge must not leave the group drawn in stage one.
        ids = np.clip(ids, lo, hi - 1)
        return ids, a * self._tree.leaves[ids] + b * self._floor(ids)

    def locate(self, positions: np.ndarray, *, a: float, b: float) -> tuple[np.ndarray, np.ndarray]:
        """Ids at positions of the mass ``a * p_i**alpha + b`` (low level; ``sample`` uses it).

        A sharded store passes the global coefficients, so each shard samples its part of
        the global mixture and returns exact global probabilities.

        Args:
            positions: float64 positions in ``[0, a * total() + b * n)``, copied.
            a: mass per unit of ``p**alpha``.
            b: mass added to every row.

        Returns:
            ``(ids, probs)`` with ``probs = a * p_i**alpha + b``.
        """
        positions = np.asarray(positions, dtype=np.float64)
        if a > 0.0:
            ids = self._tree.descend(positions / a, b / a, self._prior_tree)
        elif self._prior_tree is not None:
            ids = self._prior_tree.descend(positions / b, 0.0)
        else:
            ids = np.minimum(np.floor(positions / b).astype(np.int64), self.n - 1)
        return ids, a * self._tree.leaves[ids] + b * self._floor(ids)

    def _index(self, ids: Any) -> np.ndarray:
        idx = np.asarray(ids)
        if idx.dtype.kind not in "iu" or (idx.size and (idx.min() < 0 or idx.max() >= self.n)):
            msg = f"ids must be integers in [0, {self.n}), got dtype {idx.dtype} with " \
                  f"range [{idx.min() if idx.size else ''}, {idx.max() if idx.size else ''}]"
            raise ConfigError(msg)
        return idx.astype(np.int64, copy=False)

    # --- state --------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume: config, priorities, clocks, counters, generator state."""
        return {"version": _STATE_VERSION, "n": self.n,
                "config": dataclasses.asdict(self.config),
                "priorities": self._raw.copy(), "last_update": self._last.copy(),
                "clock": self._clock, "aged_clock": self._aged_clock, "cap": self._cap,
                "streak": self._streak.copy(), "streak_ref": self._streak_ref.copy(),
                "guard_threshold": self._guard_threshold,
                "guard_level": self._guard_level,
                "rejected": dict(self.rejected), "counters": dict(self.counters),
                "rng": self._rng.bit_generator.state}

    def load_state_dict(self, state: Mapping[str, Any], *, strict: bool = True) -> None:
        """Restore a ``state_dict``.

        Args:
            state: a dict from ``state_dict`` (possibly round-tripped through a snapshot).
            strict: require the saved config to equal this table's; with False, keep this
                table's config and take only the priorities, clocks, counters and generator.
        """
        raw, last = check_state(state, self.n, dataclasses.asdict(self.config), strict=strict,
                                version=_STATE_VERSION)
        self._raw = raw.copy()
        self._last = last.copy()
        self._clock = int(state["clock"])
        self._aged_clock = int(state["aged_clock"])
        self._cap = float(state["cap"]) if self.config.cap_quantile is not None else math.inf
        self.rejected = dict.fromkeys(REJECT_REASONS, 0) | {
            k: int(v) for k, v in state["rejected"].items()}
        self.counters = {k: int(v) for k, v in state["counters"].items()}
        self._rng.bit_generator.state = state["rng"]
        # States saved before the guard existed have no streaks: every row starts at zero.
        streak = np.asarray(state.get("streak", np.zeros(self.n)), dtype=np.int64)
        if streak.shape != (self.n,):
            msg = (f"table state streak must hold {self.n} counts, got shape {streak.shape}; "
                   f"was it saved by another table?")
            raise ConfigError(msg)
        self._streak = streak.copy()
        # States saved before streaks kept their first loss: the current one stands in.
        ref = np.asarray(state.get("streak_ref", raw), dtype=np.float64)
        self._streak_ref = ref.copy() if ref.shape == (self.n,) else raw.copy()
        on = self.config.guard_after is not None
        threshold, level = state.get("guard_threshold"), state.get("guard_level")
        self._guard_threshold = float(threshold) if on and threshold is not None else math.inf
        self._guard_level = float(level) if on and level is not None else math.inf
        self._tree = SumTree(self._leaf_values(self._raw))
        self._minima.invalidate()
