"""InfoBatch: each epoch, read every hard sample and a random share of the well-learned ones.

The policy of Qin et al., "InfoBatch: Lossless Training Speed Up by Unbiased Dynamic Data
Pruning" (ICLR 2024), over raying's priority store: the losses trainers report are the scores,
so the user's dataset code does not change and the plan is made on the driver of a cluster.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Mapping
from typing import Any

import numpy as np

from raying.errors import ConfigError
from raying.options import DEFAULT_GUARD_AFTER, settings
from raying.sampling.aside import SetAside
from raying.sampling.plan import (
    EpochPlan,
    ReadUnit,
    chunk_units,
    row_group_units,
    row_groups_of,
    set_occurrences,
    unit_rows_cap,
)

# Mixed into the seed of every pruning plan, so it never shares a stream with other plans.
_PLAN_STREAM = 0x1B7C4
# Plans kept per sampler, the most recently asked for: the epoch being read, the next one
# (planned while this one drains) and one more (a look at a later plan, pipe.plan(e + 2),
# must not drop the scores of the epoch being read); their scores travel in state_dict so
# a resumed epoch gets the same plan.
_PLANS_KEPT = 3


def anneal_start(epochs: int | None, anneal: float) -> int | None:
    """The first epoch that reads every sample: ``ceil(anneal * epochs)``, and at the latest
    the last epoch when ``anneal < 1`` (a short run, e.g. 4 epochs at 0.875, would otherwise
    never train on the full data); ``epochs`` (never) with ``anneal == 1``; None: never."""
    if epochs is None:
        return None
    start = int(math.ceil(anneal * epochs - 1e-9))
    return min(start, epochs - 1) if anneal < 1.0 else start


# Scores within this relative distance of the mean count as at it, not below: the mean of
# equal scores is off by a rounding error either way (1.0000000000000004 for all ones
# under some priors), which would prune every sample of an epoch meant to keep them all.
_MEAN_TIE = 1e-9


def below_mean(scores: np.ndarray, mean: float) -> np.ndarray:
    """Which ``scores`` lie below ``mean`` by more than its rounding (``_MEAN_TIE``)."""
    return scores < mean - _MEAN_TIE * abs(mean)


def _mean(scores: np.ndarray, weights: np.ndarray | None = None) -> float:
    """The (``weights``-weighted) mean of the scores that are not NaN; 0 for none."""
    seen = ~np.isnan(scores)
    if not seen.any():
        return 0.0
    x = scores[seen]
    top = float(np.max(np.abs(x)))
    if not 0.0 < top < np.inf:
        return top
    x = x / top  # losses near float64's top would sum to inf (and every comparison fail)
    if weights is None:
        return float(x.mean()) * top
    w = weights[seen]
    return float(w @ x / w.sum()) * top if w.sum() > 0 else 0.0


def _kish(weights: np.ndarray) -> float | None:
    """Kish's effective sample size of an epoch's importance weights, (sum w)^2 / sum w^2:
    the number of equally weighted samples whose weighted sum varies as the plan's does
    (the kept count when nothing is up-weighted; fewer the more the weights spread)."""
    if not weights.size:
        return None
    w = weights.astype(np.float64) / float(np.max(weights))
    return float(w.sum() ** 2 / (w @ w))


def prune_plan(scores: np.ndarray, prune_ratio: float, rng: np.random.Generator, *,
               mean: float | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Which samples an epoch keeps, with their inclusion probabilities and weights.

    A sample whose score is below the mean score is *well learned*: it is kept with
    probability ``1 - prune_ratio``, independently of the others, and a kept one carries
    weight ``1 / (1 - prune_ratio)``, so the expected weighted loss (and gradient) of the
    epoch equals the full epoch's. Every sample at or above the mean is kept with weight 1,
    and so is every sample with no score (NaN: no loss reported yet, e.g. one a
    ``drop_last`` batch or a shortened epoch left out), which the mean leaves out.

    Args:
        scores: one score (the latest reported loss, NaN for none) per candidate sample.
        prune_ratio: the share ``r`` of the well-learned samples dropped, in ``[0, 1)``.
        rng: the plan's generator; one uniform number is drawn per candidate, kept or not.
        mean: the threshold; default the mean of ``scores`` (a prior's plan passes the
            prior-weighted mean, the expected score of one draw).

    Returns:
        ``(keep, probs, weights)``: a boolean mask over ``scores``, and for every candidate
        its inclusion probability (``1 - r`` or 1) and weight (``1 / (1 - r)`` or 1).
    """
    scores = np.asarray(scores, dtype=np.float64)
    coins = rng.random(scores.size)
    if mean is None:
        mean = _mean(scores)
    low = below_mean(scores, mean)  # False for NaN: a sample never scored is kept
    keep = ~low | (coins >= prune_ratio)
    probs = np.where(low, 1.0 - prune_ratio, 1.0)
    weights = np.where(low, 1.0 / (1.0 - prune_ratio), 1.0)
    return keep, probs, weights


class InfoBatchSampler:
    """Reads fewer samples per epoch by pruning well-learned ones, with unbiased rescaling.

    Each epoch's plan is made when the epoch starts, from the latest loss of every sample in
    the pipeline's priority store (``pipe.report(ids, losses)``): every sample at or above the
    mean loss is read; each one below it is dropped with probability ``prune_ratio`` and, when
    kept, carries ``weight = 1 / (1 - prune_ratio)``. Multiply the per-sample loss by
    ``batch["weight"]`` before averaging (``(batch["weight"] * loss).mean()``): the epoch's
    expected gradient is then that of the full data. From epoch ``ceil(anneal * epochs)`` on
    (the last epoch at the latest, when ``anneal < 1``) every epoch reads every sample with
    weight 1 (InfoBatch's annealing: the last epochs train on the full data, so the rescaling
    leaves no bias at the end). The first epoch reads
    everything too: no sample has a score yet, and one that still has none later (a
    ``drop_last`` batch or an epoch cut short left it out) is read with weight 1.

    ``prob`` in the batch is the sample's inclusion probability in this epoch (1 or
    ``1 - prune_ratio``). Plans are reproducible from the seed, the epoch and the scores;
    the scores an epoch was planned with are saved in ``state_dict``, so an epoch resumed
    mid-way reads the rest of the same plan. Samples set aside as unreadable are left out of
    later plans. Parquet plans keep the locality of uniform ones (row groups in a shuffled
    order, rows shuffled within a window of row groups).

    Args:
        prune_ratio: share ``r`` of the below-mean samples dropped each epoch, in ``[0, 1)``.
        anneal: share of ``epochs`` after which pruning stops, in ``(0, 1]``.
        epochs: the run's number of epochs; None prunes every epoch (no annealing).
        seed: the seed of the plans.
        window_row_groups: Parquet row groups shuffled together in one read task.
        store: store options (``coalesce``, ``snapshot_uri``, ...), a dict or ``StoreConfig``.
        prior: static weights under the pruning: a ``WeightedSampler`` (its ``weights`` and
            ``class_balanced``), one weight per sample, or a dict ``{class: weight}``. An
            epoch is then ``samples_per_epoch`` draws with replacement in proportion to the
            prior (``q_i``), as ``WeightedSampler`` makes them, and pruning applies to each
            draw: a draw of a sample whose loss is below the prior-weighted mean loss (the
            expected loss of one draw) is dropped with probability ``prune_ratio`` and, when
            kept, carries ``1 / (1 - prune_ratio)``. The expected weighted loss of an epoch
            is that of the prior's full epoch. ``prob`` is then the probability that one draw
            yields the sample and keeps it: ``q_i * (1 - prune_ratio)`` or ``q_i``. Annealed
            epochs and the first one keep every draw.
        samples_per_epoch: draws per epoch under a prior (default: the dataset's size); only
            with ``prior`` (without one, an epoch reads each kept sample once).
    """

    name = "infobatch"
    lazy = False
    uses_store = True

    def __init__(self, prune_ratio: float = 0.5, anneal: float = 0.875,
                 epochs: int | None = None, seed: int = 0, *,
                 window_row_groups: int | None = None,
                 store: Mapping[str, Any] | Any = None, prior: Any = None,
                 samples_per_epoch: int | None = None) -> None:
        if isinstance(prune_ratio, bool) or not isinstance(prune_ratio, (int, float, np.integer,
                                                              np.floating)) \
                or not 0.0 <= prune_ratio < 1.0:
            msg = (f"InfoBatchSampler(prune_ratio=...) must be in [0, 1), got {prune_ratio!r}; "
                   f"pass the share of well-learned samples to drop, e.g. 0.5")
            raise ConfigError(msg)
        if isinstance(anneal, bool) or not isinstance(anneal, (int, float, np.integer,
                                                              np.floating)) \
                or not 0.0 < anneal <= 1.0:
            msg = (f"InfoBatchSampler(anneal=...) must be in (0, 1], got {anneal!r}; pass the "
                   f"share of epochs after which every sample is read, e.g. 0.875")
            raise ConfigError(msg)
        if epochs is not None and (isinstance(epochs, bool)
                                   or not isinstance(epochs, (int, np.integer)) or epochs < 1):
            msg = (f"InfoBatchSampler(epochs=...) must be an integer >= 1 or None, got "
                   f"{epochs!r}; pass the number of epochs the run trains for")
            raise ConfigError(msg)
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
            msg = f"InfoBatchSampler(seed=...) must be a non-negative int, got {seed!r}"
            raise ConfigError(msg)
        if samples_per_epoch is not None and (
                prior is None or isinstance(samples_per_epoch, bool)
                or not isinstance(samples_per_epoch, (int, np.integer)) or samples_per_epoch < 1):
            msg = (f"InfoBatchSampler(samples_per_epoch={samples_per_epoch!r}) needs a prior "
                   f"and an integer >= 1; without a prior an epoch reads each kept sample "
                   f"once, so leave it None")
            raise ConfigError(msg)
        window = settings().parquet_window_row_groups if window_row_groups is None \
            else window_row_groups
        if window < 1:
            msg = f"InfoBatchSampler(window_row_groups=...) must be >= 1, got {window!r}"
            raise ConfigError(msg)
        self.prune_ratio = float(prune_ratio)
        self.anneal = float(anneal)
        self.epochs = None if epochs is None else int(epochs)
        self.seed = int(seed)
        self.window_row_groups = int(window)
        self.store_options = store
        self.prior = prior
        self.samples_per_epoch = None if samples_per_epoch is None else int(samples_per_epoch)
        self._prior_q: np.ndarray | None = None
        self.handle: Any = None
        self.store_name: str | None = None
        self._reporter: Any = None
        self._created = False
        self._n = 0
        self._scores: dict[int, np.ndarray] = {}
        self._aside = SetAside()
        self._per_epoch: dict[int, dict[str, Any]] = {}
        self._lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        # Copies travel to Ray Data read tasks: units are complete, nothing of this is needed.
        # The prior's probabilities are dropped too (N floats); a copy that plans (a Train
        # worker) recomputes them from ``prior`` and the manifest's labels.
        state = dict(self.__dict__)
        state.update(_reporter=None, _lock=None, _scores={}, _prior_q=None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return (f"InfoBatchSampler(prune_ratio={self.prune_ratio}, anneal={self.anneal}, "
                f"epochs={self.epochs}, seed={self.seed}"
                f"{', prior=...' if self.prior is not None else ''})")

    # -- set-up --------------------------------------------------------------------------------
    def bind(self, manifest: Any, *, name: str) -> None:
        """Create (or find, after a driver restart) the store that holds the losses."""
        from raying.sampling.binding import bind_store
        from raying.sampling.feedback import Reporter

        if (self.handle is not None and self._reporter is not None
                and self.store_name == f"{name}-priorities"):
            return  # bound here already (a map_batches pipeline shares this sampler and store)
        self._n = len(manifest)
        self._prior_q = self.prior_probabilities(manifest)  # validated before a store exists
        self.store_name = f"{name}-priorities"
        # The table only holds the scores (the plans are made here); its guard statistics
        # report how much of the top of the loss ranking is persistently high-loss.
        table = {"alpha": 1.0, "uniform_mix": 0.0, "seed": self.seed,
                 "guard_after": DEFAULT_GUARD_AFTER}
        self.handle, self._created = bind_store(self.store_name, self._n, table=table,
                                                store=self.store_options)
        self._reporter = Reporter(self.handle)

    def prior_probabilities(self, manifest: Any) -> np.ndarray | None:
        """The prior's draw probability of every sample (None without a prior)."""
        if self.prior is None:
            return None
        if self._prior_q is not None and self._prior_q.size == len(manifest):
            return self._prior_q
        from raying.sampling.weighted import prior_probabilities

        self._prior_q = prior_probabilities(self.prior, manifest)
        return self._prior_q

    # -- plans ---------------------------------------------------------------------------------
    def scores(self) -> np.ndarray:
        """Every sample's latest reported loss; NaN for a sample with none reported yet
        (kept, weight 1, left out of the mean)."""
        from raying.sampling import store as st

        if self.handle is None:
            msg = "InfoBatchSampler is not bound to a store; build a Pipeline with it first"
            raise ConfigError(msg)
        self.flush()
        return st.scores(self.handle)

    def plan(self, manifest: Any, epoch: int, *, block_rows: int) -> EpochPlan:
        """The plan of ``epoch``, from the scores as the epoch starts (fixed once made)."""
        with self._lock:
            scores = self._scores.pop(epoch, None)
            if scores is None:
                scores = self.scores()
            self._scores[epoch] = scores  # the most recently asked for last
            for old in list(self._scores)[:-_PLANS_KEPT]:
                del self._scores[old]
        return self.plan_from_scores(manifest, epoch, scores, block_rows=block_rows)

    def plan_from_scores(self, manifest: Any, epoch: int, scores: np.ndarray, *,
                         block_rows: int) -> EpochPlan:
        """The plan of ``epoch`` for the given scores (pure numpy; :meth:`plan` reads them).

        Args:
            manifest: the dataset (its size, format and row groups).
            epoch: the epoch; with the seed it fixes every random choice of the plan.
            scores: one score per id.
            block_rows: ids per read unit (about).
        """
        n = len(manifest)
        scores = np.asarray(scores, dtype=np.float64)
        if scores.shape != (n,):
            msg = (f"InfoBatchSampler needs one score per sample: expected {n}, got shape "
                   f"{scores.shape}; is the store bound to another dataset?")
            raise ConfigError(msg)
        rng = np.random.default_rng([self.seed, int(epoch), _PLAN_STREAM])
        active = np.ones(n, dtype=bool)
        active[self._aside.for_plan(epoch)] = False
        candidates = np.flatnonzero(active)
        start = anneal_start(self.epochs, self.anneal)
        annealed = start is not None and epoch >= start
        ratio = 0.0 if annealed else self.prune_ratio
        q = self.prior_probabilities(manifest)
        if q is not None:
            return self._prior_plan(manifest, epoch, scores, q, active, ratio, annealed, rng,
                                    block_rows)
        keep_c, probs_c, weights_c = prune_plan(scores[candidates], ratio, rng)
        keep = np.zeros(n, dtype=bool)
        keep[candidates[keep_c]] = True
        probs = np.zeros(n)
        probs[candidates] = probs_c
        weights = np.zeros(n)
        weights[candidates] = weights_c
        kept = int(keep.sum())
        if manifest.format == "parquet":
            units = self._parquet_units(manifest, epoch, keep, rng, block_rows,
                                        kept / max(1, n))
        else:
            units = chunk_units(epoch, rng.permutation(np.flatnonzero(keep)).astype(np.int64),
                                block_rows)
        for u in units:
            ids: Any = u.ids
            u.probs = probs[ids]
            u.weights = weights[ids].astype(np.float32)
        below = float(np.mean(below_mean(scores[candidates], _mean(scores[candidates])))) \
            if candidates.size else 0.0
        w_kept = weights[keep]
        self._per_epoch[int(epoch)] = {
            "epoch": int(epoch), "planned": kept, "candidates": int(candidates.size),
            "pruned_share": 1.0 - kept / candidates.size if candidates.size else 0.0,
            "below_mean_share": below, "annealed": bool(annealed),
            "plan_weight_min": float(w_kept.min()) if kept else None,
            "plan_weight_max": float(w_kept.max()) if kept else None,
            "plan_ess": _kish(w_kept)}
        return EpochPlan(epoch=epoch, units=units, sampler=self.name)

    def _prior_plan(self, manifest: Any, epoch: int, scores: np.ndarray, q: np.ndarray,
                    active: np.ndarray, ratio: float, annealed: bool,
                    rng: np.random.Generator, block_rows: int) -> EpochPlan:
        """An epoch of draws in proportion to the prior, each pruned like a sample."""
        from raying.sampling.weighted import WeightedSampler, draw_units, without

        balanced = isinstance(self.prior, WeightedSampler) and self.prior.class_balanced
        q = without(q, np.flatnonzero(~active), manifest.labels if balanced else None)
        if not q.sum() > 0.0:
            msg = ("InfoBatchSampler: every sample with a positive prior weight was set aside "
                   "as unreadable; nothing is left to draw")
            raise ConfigError(msg)
        q = q / q.sum()
        k = self.samples_per_epoch or len(manifest)
        draws = rng.choice(len(manifest), size=k, replace=True, p=q).astype(np.int64)
        mean = _mean(scores, q)
        keep, _, weights_d = prune_plan(scores[draws], ratio, rng, mean=mean)
        kept = draws[keep]
        # A sample's keep probability and weight depend on its score only, so every draw of
        # it carries the same ones.
        low = below_mean(scores, mean)
        probs = q * np.where(low, 1.0 - ratio, 1.0)
        weights = np.where(low, 1.0 / (1.0 - ratio), 1.0)
        units = draw_units(manifest, epoch, kept, rng, block_rows)
        set_occurrences(units)  # drawn with replacement: each draw of an id augmented apart
        for u in units:
            ids: Any = u.ids
            u.probs = probs[ids]
            u.weights = weights[ids].astype(np.float32)
        w_kept = weights_d[keep]
        self._per_epoch[int(epoch)] = {
            "epoch": int(epoch), "planned": int(kept.size), "candidates": int(k),
            "pruned_share": 1.0 - kept.size / k,
            "below_mean_share": float(np.mean(low[draws])) if k else 0.0,
            "annealed": bool(annealed),
            "plan_weight_min": float(w_kept.min()) if kept.size else None,
            "plan_weight_max": float(w_kept.max()) if kept.size else None,
            "plan_ess": _kish(w_kept)}
        return EpochPlan(epoch=epoch, units=units, sampler=self.name)

    def _parquet_units(self, manifest: Any, epoch: int, keep: np.ndarray,
                       rng: np.random.Generator, block_rows: int,
                       share: float) -> list[ReadUnit]:
        """Uniform-style row-group windows, each holding only its kept rows."""
        from raying.sampling.uniform import _groups_for

        f, g, start, rows = manifest.row_group_table()
        order = rng.permutation(len(start))
        # Windows wide enough that the rows kept in one still fill about a block.
        wanted = int(math.ceil(block_rows / max(share, 1e-3)))
        window = max(self.window_row_groups, _groups_for(rows, wanted))
        units: list[ReadUnit] = []
        for u in row_group_units(epoch, f, g, start, rows, order, window, rng,
                                 max_rows=unit_rows_cap(int(rows.sum()), wanted)):
            ids: Any = u.ids
            ids = ids[keep[ids]]
            if ids.size:
                units.append(ReadUnit(epoch=epoch, index=len(units), draw=int(ids.size),
                                      ids=ids, row_groups=row_groups_of(ids, f, g, start)))
        return units

    def fill(self, unit: ReadUnit) -> ReadUnit:
        """Units are complete when planned."""
        return unit

    # -- feedback, stats, state ----------------------------------------------------------------
    def report(self, ids: Any, losses: Any) -> None:
        """Buffer losses as scores; they reach the store without blocking the step."""
        if self._reporter is None:
            msg = "InfoBatchSampler is not bound to a store; build a Pipeline with it first"
            raise ConfigError(msg)
        self._reporter.add(ids, losses)

    def set_aside(self, ids: Any) -> None:
        """Samples that failed to read or decode are left out of later plans."""
        self._aside.add(ids)

    def flush(self) -> None:
        if self._reporter is not None:
            self._reporter.flush()

    def stats(self) -> dict[str, Any]:
        """The store's health and, per planned epoch, samples planned and the share pruned."""
        from raying.sampling import store as st

        out: dict[str, Any] = {"sampler": self.name, "seed": self.seed,
                               "prune_ratio": self.prune_ratio,
                               "anneal_start": anneal_start(self.epochs, self.anneal)}
        if self.handle is not None:
            self.flush()
            out.update(st.stats(self.handle))
            out["sampler"] = self.name
            # The store's ESS and smallest probability describe a draw in proportion to its
            # table, which this sampler never makes (it keeps or prunes each sample): an
            # epoch's effective size is its plan's, ``plan_ess`` in ``per_epoch``.
            for key in ("ess", "ess_fraction", "min_prob"):
                out.pop(key, None)
        out["per_epoch"] = [self._per_epoch[e] for e in sorted(self._per_epoch)]
        return out

    def state_dict(self) -> dict[str, Any]:
        """The store's tables, the scores of the epochs planned, and the settings."""
        from raying.sampling import store as st

        self.flush()
        tables = st.state_dict(self.handle) if self.handle is not None else None
        with self._lock:
            plans = {int(e): s.copy() for e, s in self._scores.items()}
        return {"sampler": self.name, "seed": self.seed, "prune_ratio": self.prune_ratio,
                "anneal": self.anneal, "epochs": self.epochs,
                "samples_per_epoch": self.samples_per_epoch, "prior": self.prior is not None,
                "tables": tables,
                "plan_scores": plans, **self._aside.state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from :meth:`state_dict`: same scores, so a resumed epoch has the same plan."""
        from raying.sampling import store as st

        if state.get("sampler") != self.name:
            msg = (f"state was saved by a {state.get('sampler')!r} sampler; this pipeline uses "
                   f"{self.name!r}")
            raise ConfigError(msg)
        saved = {k: state.get(k) for k in ("seed", "prune_ratio", "anneal", "epochs",
                                            "samples_per_epoch")}
        saved["prior"] = bool(state.get("prior", False))
        own = {"seed": self.seed, "prune_ratio": self.prune_ratio, "anneal": self.anneal,
               "epochs": self.epochs, "samples_per_epoch": self.samples_per_epoch,
               "prior": self.prior is not None}
        if saved != own:
            msg = (f"state was saved with InfoBatchSampler{saved}, this pipeline has {own}; "
                   f"build the sampler with the saved settings")
            raise ConfigError(msg)
        if state.get("tables") is not None and self.handle is not None:
            st.load_state_dict(self.handle, state["tables"])
        with self._lock:
            self._scores = {int(e): np.asarray(s, dtype=np.float64)
                            for e, s in state.get("plan_scores", {}).items()}
        self._aside.load(state)

    def forget_store(self) -> None:
        """Let go of the store of a Ray session that has ended (the store went with it):
        buffered reports are dropped, nothing is sent."""
        self.handle = None
        self._reporter = None

    def close(self, *, release_store: bool = True) -> None:
        """Flush reports; with ``release_store``, stop the store this sampler created."""
        from raying.sampling import store as st

        self.flush()
        if release_store and self.handle is not None and self._created:
            st.kill_store(self.handle, snapshot=True)
            self.handle = None
            self._reporter = None
