"""The prioritized sampler: reads drawn from the priority store, which trainers' losses shape."""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import threading
import time
from collections.abc import Mapping
from typing import Any

import numpy as np

from raying.errors import ConfigError
from raying.options import DEFAULT_GUARD_AFTER, settings
from raying.sampling.plan import EpochPlan, ReadUnit, occurrence_ranks

logger = logging.getLogger(__name__)

# A buffered plan is dropped (and a fresh one drawn) once this process has sent reports since
# it was drawn, or once it is this old (reports from other processes, e.g. Train workers).
# Dropping the rest of a plan does not bias sampling: each draw was made from P at its time.
DEFAULT_PLAN_MAX_AGE_S = 1.0
# Epochs whose plans are kept at once: the one being read and the next (its first units are
# submitted as this one ends).
_PLAN_EPOCHS = 2


@dataclasses.dataclass
class _Plan:
    """The rest of a plan drawn for one epoch (see PrioritizedSampler.fill)."""

    ids: np.ndarray
    probs: np.ndarray
    weights: np.ndarray
    sends: int  # the reports sent when it was drawn: any later one makes it stale
    drawn: float  # time.monotonic() when it was drawn
    length: int
# Stores up to this many ids draw their first plans in the driver while the actor starts (a
# table of n ids, 60-90 bytes per id, kept until the actor answers); beyond it the wait for
# the actor is a small share of an epoch.
FRESH_PLAN_MAX_IDS = 1 << 20


def group_rows(rows_per_group: int, group_sizes: np.ndarray) -> int:
    """Rows to draw per chosen row group: ``rows_per_group``, at most a quarter of a typical
    group's rows. The draws inside a group are with replacement: 16 of a 4-row group would
    repeat each of its images ~4 times in a batch (an epoch of 2,048 draws saw 435 ids); a
    quarter keeps ~88 % of a group's draws distinct. 1 means flat draws."""
    typical = int(np.median(group_sizes)) if len(group_sizes) else 1
    return max(1, min(int(rows_per_group), typical // 4))


def group_order(ids: np.ndarray, rows_per_group: int, rng: np.random.Generator) -> np.ndarray:
    """An order of grouped draws that keeps each stage-one pick's ``rows_per_group`` draws
    together (ascending inside it), with the picks in a random order.

    ``PriorityTable.sample_in_groups`` returns its draws as runs of ``rows_per_group``, one run
    per chosen row group. Units take the buffer of draws front to back, and the buffer is
    redrawn as reports arrive: sorted by id, every epoch's units would read the lowest ids of
    each buffer (a sliding window, and only the dataset's start while reports keep coming);
    merged by row group, an epoch would read a few row groups many times over.
    """
    pick = np.arange(len(ids)) // max(1, int(rows_per_group))
    rank = rng.permutation(int(pick[-1]) + 1 if len(ids) else 0)
    return np.lexsort((ids, rank[pick]))


def _fill_salt() -> int:
    """A random number of 32 bits and more, never 0: a unit's draws' keys of their own."""
    return int.from_bytes(os.urandom(4), "little") + (1 << 32)


class PrioritizedSampler:
    """Draws each read's ids from a priority store that per-sample losses keep up to date.

    Sample ``i`` is drawn with probability ``P_i = (1 - eps) * p_i**alpha / sum_j p_j**alpha
    + eps / N`` where ``p_i`` is its latest reported loss (all start equal, so the first epoch
    is uniform) and ``eps = uniform_mix`` keeps every sample reachable. Every batch carries
    ``prob`` (``P_i``) and ``weight``, the importance weight ``(N * P_i)**-beta`` normalised
    to at most 1, which makes the expected weighted loss equal the uniform one when
    ``beta = 1``.

    Ids are drawn when a read is submitted, so losses reported during an epoch shape the rest
    of it; staleness is bounded by the reads in flight (a buffered plan is dropped as soon as
    new losses are sent, or after ``DEFAULT_PLAN_MAX_AGE_S``). An "epoch" is ``samples_per_epoch``
    draws (default ``N``). For Parquet, ``rows_per_group > 1`` draws row groups by their
    priority mass and then rows inside them (the probabilities stay exact), so each row group
    read serves several samples.

    Args:
        alpha: priority exponent (0 = uniform, 1 = proportional to loss).
        beta: importance-weight exponent (0 = all weights 1).
        uniform_mix: share ``eps`` of draws made uniformly. It also bounds the weights: they
            are normalised by the least likely sample's, which is at least ``eps / N``; with
            ``uniform_mix=0`` and ``beta > 0`` one sample of a near-zero loss makes every
            other weight near zero (weigh the loss ``sum(w * loss) / sum(w)`` then).
        seed: seeds the store's generator and the augmentation.
        systematic: low-variance (stratified) plans instead of i.i.d. draws (the driver's
            plans; the read tasks of ``pipe.dataset(e)`` draw their units i.i.d.).
        samples_per_epoch: draws per epoch; default the dataset size.
        rows_per_group: Parquet rows drawn per chosen row group (1 = flat draws); at most a
            quarter of a typical row group's rows (draws inside a group repeat ids).
        guard: the noisy-label guard (off by default): a sample whose last ``guard_after``
            (default 6) reported losses were all in the top quarter of priorities and did not
            fall by a fifth is drawn at the median priority until a loss falls out of that top
            quarter (a mislabelled sample never stops being "hard"; a learnable one's loss
            falls as it is drawn; see PriorityTable). In the sampler study (docs/concepts.md)
            it cost nothing on clean labels, kept the rare-mode speed-up under 20 % label
            noise and settled above uniform's clean accuracy. It stays off by default because
            on the demo's clean data, whose rare classes take many draws before their losses
            fall, it held them down like flipped labels (3 seeds: rare-class accuracy at
            1,200 steps 45-54 % against 95-97 % unguarded). Turn it on where labels may be
            noisy.
            ``table={"guard_after": k, "guard_quantile": q}`` tunes it.
        table: more table options (``cap_quantile``, ``age_after``, ``age_rate``,
            ``initial_priority``, ``guard_after``, ``guard_quantile``), a dict or
            ``TableConfig``.
        store: store options (``coalesce``, ``ema``, ``snapshot_uri``,
            ``snapshot_every_updates``, ``snapshot_interval_s``, ``shard_rows``), a dict or
            ``StoreConfig``.
        prior: static weights under the losses: a ``WeightedSampler`` (its ``weights`` and
            ``class_balanced``), one weight per sample, or a dict ``{class: weight}``. Draws
            follow ``P_i = (1 - eps) * w_i p_i**alpha / sum_j w_j p_j**alpha
            + eps * w_i / sum_j w_j``: the prior alone until losses arrive (a class-balanced
            prior balances the first epoch and the floor), then losses re-weight within it.
            ``prob`` and ``weight`` are those of ``P_i``. The store is then one shard.
    """

    name = "prioritized"
    lazy = True
    uses_store = True

    def __init__(self, alpha: float = 1.0, beta: float = 0.0, uniform_mix: float = 0.1,
                 seed: int = 0, *, systematic: bool = True,
                 samples_per_epoch: int | None = None, rows_per_group: int = 16,
                 guard: bool = False, table: Mapping[str, Any] | Any = None,
                 store: Mapping[str, Any] | Any = None, prior: Any = None) -> None:
        if not (0.0 <= beta <= 1.0):
            msg = f"PrioritizedSampler(beta=...) must be in [0, 1], got {beta!r}"
            raise ConfigError(msg)
        if samples_per_epoch is not None and (
                isinstance(samples_per_epoch, bool)
                or not isinstance(samples_per_epoch, (int, np.integer)) or samples_per_epoch < 1):
            msg = (f"PrioritizedSampler(samples_per_epoch=...) must be an int >= 1 or None, got "
                   f"{samples_per_epoch!r}")
            raise ConfigError(msg)
        if rows_per_group < 1:
            msg = f"PrioritizedSampler(rows_per_group=...) must be >= 1, got {rows_per_group!r}"
            raise ConfigError(msg)
        import dataclasses

        from raying.sampling.table import TableConfig

        if table is None:
            extra: dict[str, Any] = {}
        elif isinstance(table, Mapping):
            extra = dict(table)
        elif isinstance(table, TableConfig):
            extra = dataclasses.asdict(table)
        else:
            msg = f"PrioritizedSampler(table=...) must be a dict or TableConfig, got {table!r}"
            raise ConfigError(msg)
        extra.update(alpha=alpha, uniform_mix=uniform_mix, seed=seed, beta=beta)
        if not guard:
            extra["guard_after"] = None
        elif extra.get("guard_after") is None:
            extra["guard_after"] = DEFAULT_GUARD_AFTER
        self.guard = bool(guard)
        try:
            self.table_config = TableConfig(**extra)
        except TypeError as exc:  # a key TableConfig does not have
            known = sorted(f.name for f in dataclasses.fields(TableConfig)
                           if f.name not in ("alpha", "uniform_mix", "seed", "beta"))
            msg = f"PrioritizedSampler(table=...): {exc}; its keys are {known}"
            raise ConfigError(msg) from None
        self.alpha, self.beta, self.uniform_mix, self.seed = alpha, beta, uniform_mix, seed
        self.systematic = systematic
        self.samples_per_epoch = samples_per_epoch
        self.rows_per_group = rows_per_group
        self.store_options = store
        self.prior = prior
        self._prior_in_store = False
        self.handle: Any = None
        self.store_name: str | None = None
        self._reporter: Any = None
        self._final_stats: dict[str, Any] | None = None  # the store's last stats, after close
        self._starts: np.ndarray | None = None
        self._group_rows = 1  # rows drawn per chosen row group (see group_rows)
        # Per epoch: its current plan's ids, probabilities and weights not yet given to a
        # unit, the reports sent and the time when it was drawn, and its length. An epoch's
        # units draw only from its own plans: the next epoch's first units, submitted while
        # this one ends (keep_warm), must not take the rest of this epoch's plan.
        self._bufs: dict[int, _Plan] = {}
        self._live_chunk = 0
        self._draw_sends = 0  # sends the draw being made did itself (see fill)
        self._lock = threading.Lock()
        self._n = 0
        self._created = False
        self._copy = False
        self._shuffle = np.random.default_rng()
        self._per_epoch: dict[int, dict[str, Any]] = {}
        # A store this sampler just created: its actors' start (ready calls) while it runs,
        # and the prior it was given while no loss has reached it (see _fresh_plan).
        self._starting: list[Any] | None = None
        self._fresh = False
        self._fresh_prior: np.ndarray | None = None
        self._fresh_table: Any = None
        self._fresh_samples = 0  # ids drawn here, for stats (the store counts its own)
        self._start_deadline = 0.0

    # -- picklable for Ray Data read tasks (the handle travels; buffers stay behind) -----------
    def __getstate__(self) -> dict[str, Any]:
        # A copy (a read task of pipe.dataset(e)) asks the store for its plans: the store must
        # have started, within the start's own timeout (a copy's calls have a shorter one).
        self._await_start()
        state = dict(self.__dict__)
        state.update(_reporter=None, _bufs={}, _lock=None, _starting=None, _fresh=False,
                     _fresh_prior=None, _fresh_table=None)
        if state.get("handle") is not None and state.get("prior") is not None:
            # The bound store holds the prior; copies need not carry it.
            state.update(prior=None, _prior_in_store=True)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()
        # A copy inside a Ray Data read task fills one unit: it draws just that many ids.
        self._copy = True
        self._shuffle = np.random.default_rng()  # fresh entropy, not the pickled state

    def __repr__(self) -> str:
        return (f"PrioritizedSampler(alpha={self.alpha}, beta={self.beta}, "
                f"uniform_mix={self.uniform_mix}, seed={self.seed}, guard={self.guard}"
                f"{', prior=...' if self.prior is not None else ''})")

    # -- set-up --------------------------------------------------------------------------------
    def bind(self, manifest: Any, *, name: str) -> None:
        """Create (or find, after a driver restart) the pipeline's priority store."""
        from raying.sampling.binding import bind_store
        from raying.sampling.feedback import Reporter

        if (self.handle is not None and self._reporter is not None
                and self.store_name == f"{name}-priorities"):
            return  # bound here already (a map_batches pipeline shares this sampler and store)
        from raying.options import StoreConfig
        from raying.sampling import store as st

        self._n = len(manifest)
        self.store_name = f"{name}-priorities"
        prior = self._prior_weights(manifest)
        self._forget_start()
        self._fresh_samples = 0
        with self._lock:
            self._bufs, self._live_chunk = {}, 0
        # Only a store without a snapshot to restore is known to hold its initial state until
        # a loss reaches it: its actor starts (a worker process, ~1 s) while the driver draws
        # the first plans (see _fresh_plan). Any other store is waited for here.
        fresh = (self._n <= FRESH_PLAN_MAX_IDS
                 and StoreConfig.coerce(self.store_options).snapshot_uri is None)
        self.handle, self._created = bind_store(self.store_name, self._n,
                                                table=self.table_config,
                                                store=self.store_options, prior=prior,
                                                wait=not fresh)
        self._reporter = Reporter(self.handle)
        if self._created and fresh:
            self._starting = st.start_refs(self.handle)
            self._start_deadline = time.monotonic() + st.DEFAULT_STORE_START_TIMEOUT_S
            self._fresh, self._fresh_prior = True, prior
        self._starts, self._group_rows = None, 1  # as this manifest says (bound again)
        if manifest.format == "parquet" and self.rows_per_group > 1:
            _, _, starts, rows = manifest.row_group_table()
            self._group_rows = group_rows(self.rows_per_group, rows)
            if self._group_rows > 1:
                self._starts = starts

    def _prior_weights(self, manifest: Any) -> np.ndarray | None:
        """The prior resolved against the dataset's labels (validated here), or None."""
        if self.prior is None:
            return None
        from raying.sampling.weighted import prior_probabilities

        return prior_probabilities(self.prior, manifest)

    # -- plans ---------------------------------------------------------------------------------
    def plan(self, manifest: Any, epoch: int, *, block_rows: int) -> EpochPlan:
        """Lazy units: ids are drawn from the store when each unit is submitted."""
        total = self.samples_per_epoch or len(manifest)
        if self.handle is not None and self.table_config.guard_after is not None \
                and epoch not in self._per_epoch:
            from raying.sampling import store as st

            self._await_start()
            self.flush()
            guard = st.stats(self.handle)["guard"]
            # The guard as the epoch starts: persistently high-loss share of the top priorities.
            self._per_epoch[epoch] = {
                "epoch": int(epoch), "persistent_top_share": guard["persistent_top_share"],
                "guarded_rows": guard["guarded_rows"]}
        units = []
        for k in range(math.ceil(total / block_rows)):
            draw = min(block_rows, total - k * block_rows)
            units.append(ReadUnit(epoch=epoch, index=k, draw=draw))
        return EpochPlan(epoch=epoch, units=units, sampler=self.name)

    def _fresh_plan(self, chunk: int) -> Any:
        """A plan drawn here from the store's initial state, while its actor starts: a table
        built as the actor builds its own (the same settings and prior, flat priorities),
        with the sampler's own generator. None once the actor answers, or once the store
        may hold anything else (a loss sent, a state loaded): plans then come from it."""
        import dataclasses

        from raying.sampling import store as st
        from raying.sampling.table import PriorityTable

        if self._starting is None:
            return None
        if self._reporter is not None and self._reporter.pending:
            # Losses reported and still buffered (e.g. a scoring pass just before the first
            # epoch) must shape these draws: sent now, the plan comes from the store.
            if self._reporter.flush():
                self._draw_sends += 1
        if (self._fresh and self._reporter is not None and self._reporter.sends == 0
                and time.monotonic() < self._start_deadline
                and not st.wait_ready(self.handle, self._starting, timeout_s=0)):
            table = self._fresh_table
            if table is None:
                table = self._fresh_table = PriorityTable(
                    self._n, **dataclasses.asdict(self.table_config), prior=self._fresh_prior)
            if self._starts is not None:
                ids, probs = table.sample_in_groups(chunk, self._starts, self._group_rows,
                                                    rng=self._shuffle)
            else:
                ids, probs = table.sample(chunk, systematic=self.systematic, rng=self._shuffle)
            self._fresh_samples += len(ids)
            return st.Plan(ids, probs, self._n, table.min_probability())
        self._await_start()
        return None

    def _await_start(self) -> None:
        """Wait for the store this sampler created to start (its start's error or timeout, if
        any, raised here); from then on plans come from it."""
        from raying.sampling import store as st

        starting = self._starting
        if starting is None or self.handle is None:
            return
        left = max(self._start_deadline - time.monotonic(), 1.0)
        try:
            st.wait_ready(self.handle, starting, timeout_s=left)
        except st.StoreTimeoutError:
            msg = (f"priority store {self.handle.name!r} did not start within "
                   f"{st.DEFAULT_STORE_START_TIMEOUT_S:g} s of its creation; check that a node "
                   f"can host it (`ray status`; PrioritizedSampler(store={{'actor_options': "
                   f"...}}) if you set where it runs)")
            raise st.StoreTimeoutError(msg) from None
        self._forget_start()

    def _forget_start(self) -> None:
        self._starting, self._fresh, self._fresh_prior, self._fresh_table = None, False, None, None

    def _draw(self, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        from raying.sampling import store as st

        # A plan of plan_chunk_ids ids (stratified over them), or of one epoch's where that
        # is fewer (stratified over the epoch while it stays current); while reports keep
        # making plans stale, about twice what the last one served before it went stale.
        chunk = min(settings().plan_chunk_ids, max(self.samples_per_epoch or self._n, 1))
        if self._live_chunk:
            chunk = min(chunk, self._live_chunk)
        chunk = k if self._copy else max(chunk, k)
        plan = self._fresh_plan(chunk)
        if plan is not None:
            order = (group_order(plan.ids, self._group_rows, self._shuffle)
                     if self._starts is not None else self._shuffle.permutation(chunk))
        elif self._starts is not None:
            plan = st.sample_grouped_plan(self.handle, chunk, self._starts, self._group_rows)
            order = group_order(plan.ids, self._group_rows, self._shuffle)
        else:
            # A copy in a read task (pipe.dataset(e)) draws its own unit of ids, i.i.d.: a
            # systematic plan of one unit's size lies on a few evenly spaced patterns (under
            # flat priorities, 1,000 ids in units of 128: about 8), so two tasks would read
            # the very same ids. The driver's plans are stratified over plan_chunk_ids.
            plan = st.sample_plan(self.handle, chunk,
                                  systematic=self.systematic and not self._copy)
            # A systematic plan comes sorted by id; shuffle it so each unit is a random part.
            # Fresh entropy: copies in read tasks must not share a shuffle (or their ids).
            order = self._shuffle.permutation(chunk)
        ids, probs = plan.ids[order], plan.probs[order]
        return ids, probs, plan.weights(self.beta).astype(np.float32)[order]

    def fill(self, unit: ReadUnit) -> ReadUnit:
        """Give a lazy unit its ids, probabilities and importance weights (driver or task)."""
        if unit.ids is not None:
            return unit
        if self.handle is None:
            msg = "PrioritizedSampler is not bound to a store; build a Pipeline with it first"
            raise ConfigError(msg)
        with self._lock:
            sends = self._reporter.sends if self._reporter is not None else 0
            now = time.monotonic()
            buf = self._bufs.get(unit.epoch)
            stale = buf is not None and (sends != buf.sends
                                         or now - buf.drawn > DEFAULT_PLAN_MAX_AGE_S)
            if buf is None or len(buf.ids) < unit.draw or stale:
                if stale:
                    # Reports made the plan stale after this many of its ids: draw about
                    # twice that next (the store's work and the reply grow with it).
                    self._live_chunk = max(2 * (buf.length - len(buf.ids)), 1)
                elif self._live_chunk:  # served to its end: plans grow back
                    self._live_chunk = min(2 * self._live_chunk, settings().plan_chunk_ids)
                # The draw sends the reports it finds buffered first (the plan holds them):
                # the plan is stale after the sends that come later, not after that one
                # (a send by another thread meanwhile still makes it stale).
                self._draw_sends = 0
                ids, probs, weights = self._draw(unit.draw)
                sends += self._draw_sends
                buf = self._bufs[unit.epoch] = _Plan(ids, probs, weights, sends, now, len(ids))
                for old in sorted(self._bufs)[:-_PLAN_EPOCHS]:
                    if old != unit.epoch:
                        del self._bufs[old]
            ids, probs, weights = buf.ids, buf.probs, buf.weights
            buf.ids, buf.probs, buf.weights = (ids[unit.draw:], probs[unit.draw:],
                                               weights[unit.draw:])
        part = slice(0, unit.draw)
        if self._starts is not None:  # one unit reads whole row groups: keep its rows together
            order = np.argsort(ids[part], kind="stable")
            ids, probs, weights = ids[part][order], probs[part][order], weights[part][order]
        unit.ids, unit.probs, unit.weights = ids[part], probs[part], weights[part]
        # Draws with replacement: an id drawn again, in this unit or in another (units are
        # drawn apart, by other processes and Train workers too), is augmented apart: a salt
        # of the fill's own, added to the draw's rank in the unit. (A prioritized epoch's ids
        # come from live losses, so its pixels are not reproducible anyway.)
        unit.occurrence = occurrence_ranks(unit.ids) + _fill_salt()
        return unit

    # -- feedback, stats, state ----------------------------------------------------------------
    def report(self, ids: Any, losses: Any) -> None:
        """Buffer losses as priorities; they reach the store without blocking the step."""
        if self._reporter is None:
            msg = "PrioritizedSampler is not bound to a store; build a Pipeline with it first"
            raise ConfigError(msg)
        self._reporter.add(ids, losses)

    def flush(self) -> None:
        if self._reporter is not None:
            self._reporter.flush()

    def stats(self) -> dict[str, Any]:
        from raying.sampling import store as st

        if self.handle is None:
            return dict(self._final_stats or {"sampler": self.name})
        self._await_start()
        self.flush()
        out = st.stats(self.handle)
        out["samples"] = out.get("samples", 0) + self._fresh_samples  # drawn while it started
        out["sampler"] = self.name
        out["prior"] = self.prior is not None or self._prior_in_store
        out["reports_sent"] = self._reporter.sent if self._reporter else 0
        out["reports_rejected_length"] = self._reporter.rejected_length if self._reporter else 0
        out["per_epoch"] = [self._per_epoch[e] for e in sorted(self._per_epoch)]
        return out

    def state_dict(self) -> dict[str, Any]:
        """The store's tables (priorities included) and the sampler's settings."""
        from raying.sampling import store as st

        self._await_start()
        self.flush()
        tables = st.state_dict(self.handle) if self.handle is not None else None
        return {"sampler": self.name, "seed": self.seed, "alpha": self.alpha,
                "tables": tables}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        from raying.sampling import store as st

        if state.get("sampler") != self.name:
            msg = (f"state was saved by a {state.get('sampler')!r} sampler; this pipeline uses "
                   f"{self.name!r}")
            raise ConfigError(msg)
        tables = state.get("tables")
        # (a state saved before the store started has no tables, but its alpha)
        self._check_table_settings(tables[0].get("config") or {} if tables else
                                   {"alpha": state.get("alpha", self.alpha)})
        self._await_start()
        if tables is not None and self.handle is not None:
            st.load_state_dict(self.handle, tables)
        with self._lock:
            self._bufs = {}

    def _check_table_settings(self, saved: Mapping[str, Any]) -> None:
        """Refuse, naming the sampler's arguments, a state whose priority table was made with
        other settings (they shape the priorities and the draws; ``beta`` only the weights of
        later draws, so a schedule may change it between checkpoints)."""
        own = dataclasses.asdict(self.table_config)
        diff = sorted(k for k in own if k != "beta" and k in saved and saved[k] != own[k])
        if not diff:
            return
        def argument(key: str) -> str:
            if key in ("alpha", "uniform_mix", "seed"):
                return f"{key}={saved[key]!r}"
            if key == "guard_after" and saved[key] is None:
                return "guard=False"
            if key == "guard_after":
                return f"guard=True, table={{'guard_after': {saved[key]!r}}}"
            return f"table={{{key!r}: {saved[key]!r}}}"

        where = ", ".join(argument(k) for k in diff)
        msg = (f"state was saved by a PrioritizedSampler with "
               f"{ {k: saved[k] for k in diff} }; this pipeline's has "
               f"{ {k: own[k] for k in diff} }: its priorities mean other draws. Build the "
               f"sampler with the saved settings: PrioritizedSampler({where}, ...)")
        raise ConfigError(msg)

    def set_aside(self, ids: Any) -> None:
        """Samples that failed to read or decode get priority 0, so (with ``alpha > 0``) only
        the uniform floor (``uniform_mix``) still draws them, until aging (``age_after``)
        moves their priority back toward the mean; they are reported in the pipeline's stats
        and skipped at each read."""
        if self._reporter is not None:
            self._reporter.set_aside(np.asarray(ids, dtype=np.int64).reshape(-1))

    def forget_store(self) -> None:
        """Let go of the store of a Ray session that has ended (the store went with it):
        buffered reports are dropped, nothing is sent."""
        self._forget_start()
        self.handle = None
        self._reporter = None

    def close(self, *, release_store: bool = True) -> None:
        """Flush reports; with ``release_store``, stop the store this sampler created."""
        from raying.sampling import store as st

        self.flush()
        if (release_store and self.handle is not None and self._created
                and self._starting is not None and self._fresh
                and self._reporter is not None and self._reporter.sends == 0
                and not st.wait_ready(self.handle, self._starting, timeout_s=0)):
            # Still starting and never sent a loss: it holds nothing to keep or report (and
            # one that cannot start would hold close up for the start's timeout).
            self._final_stats = {"sampler": self.name, "samples": self._fresh_samples,
                                 "store_closed": True}
            self._forget_start()
            st.kill_store(self.handle, snapshot=False)
            self.handle = None
            self._reporter = None
            return
        if release_store and self.handle is not None and self._created:
            from raying.options import StoreConfig

            try:  # what stats() said last, for stats() after close
                self._final_stats = {**self.stats(), "store_closed": True}
                answers = True
            except st.StoreTimeoutError as exc:  # its node lost, the actor not back yet
                self._final_stats, answers = None, False
                logger.warning("%s; close() stops it without its final figures or snapshot",
                               exc)
            except Exception:  # noqa: BLE001 - a store already gone (Ray shut down)
                self._final_stats, answers = None, True
            # A snapshot only where the store writes them, and only from one that answers:
            # close() must not wait out a second timeout, nor leave the store running.
            snapshot = answers and StoreConfig.coerce(self.store_options).snapshot_uri is not None
            try:
                st.kill_store(self.handle, snapshot=snapshot)
            except st.StoreTimeoutError as exc:
                logger.warning("%s; close() stops the store without it", exc)
                st.kill_store(self.handle, snapshot=False)
            self.handle = None
            self._reporter = None
