"""The priority store's actor body: queue, tick loop, snapshots and restore."""

from __future__ import annotations

import io
import json
import logging
import math
import threading
import time
from typing import Any

import numpy as np

from raying.errors import ConfigError
from raying.sampling.table import PriorityTable

logger = logging.getLogger(__name__)

# How often a capped or guarded table recomputes its quantile thresholds (a full pass over
# the rows and a rebuild of the tree: ~35 ms per million rows): every second, and for a
# table of more than REFRESH_ROWS_PER_S rows once per that many rows, so the pass takes a
# few percent of the store's time at any size.
DEFAULT_CAP_REFRESH_S = 1.0
REFRESH_ROWS_PER_S = 1_000_000



def coalesce(ids: np.ndarray, values: np.ndarray, mode: str, ema: float,
             current: Any) -> tuple[np.ndarray, np.ndarray]:
    """Fold the updates of one tick into one value per id.

    Args:
        ids: ids in arrival order (valid, int64).
        values: their priorities.
        mode: ``"last"`` (the latest report wins), ``"max"`` (the largest report of the tick
            wins) or ``"ema"`` (each report in order moves the stored priority by ``ema``:
            ``p <- (1 - ema) * p + ema * v``).
        ema: the EMA step in ``(0, 1]``.
        current: callable giving the stored priorities of unique ids (for ``"ema"``).

    Returns:
        ``(unique_ids, values)``, ids sorted.
    """
    order = np.argsort(ids, kind="stable")  # keeps arrival order within an id
    ids = ids[order]
    values = values[order]
    starts = np.flatnonzero(np.r_[True, ids[1:] != ids[:-1]])
    unique = ids[starts]
    if mode == "last":
        ends = np.r_[starts[1:], ids.size] - 1
        return unique, values[ends]
    if mode == "max":
        return unique, np.maximum.reduceat(values, starts)
    # EMA of m reports v_1..v_m onto p: (1-e)^m p + sum_j e (1-e)^(m-j) v_j.
    sizes = np.diff(np.r_[starts, ids.size])
    rank = np.arange(ids.size) - np.repeat(starts, sizes)
    after = np.repeat(sizes, sizes) - 1 - rank  # reports that came after this one
    keep = 1.0 - ema
    folded = np.add.reduceat(ema * values * np.power(keep, after), starts)
    return unique, np.power(keep, sizes) * current(unique) + folded


def encode_snapshot(table_state: dict[str, Any], store_counters: dict[str, Any]) -> bytes:
    """An ``.npz`` of the table state: arrays as arrays, everything else as one JSON entry."""
    arrays: dict[str, Any] = {key: value for key, value in table_state.items()
                              if isinstance(value, np.ndarray)}
    meta = {key: value for key, value in table_state.items() if key not in arrays}
    for key in ("cap", "guard_threshold", "guard_level"):
        if key in meta:
            meta[key] = None if math.isinf(meta[key]) else meta[key]
    text = json.dumps({"table": meta, "store": store_counters})
    buffer = io.BytesIO()
    arrays["__meta__"] = np.frombuffer(text.encode(), dtype=np.uint8)
    np.savez(buffer, **arrays)
    return buffer.getvalue()


def decode_snapshot(data: bytes) -> tuple[dict[str, Any], dict[str, Any]]:
    """The inverse of ``encode_snapshot``: ``(table_state, store_counters)``."""
    with np.load(io.BytesIO(data), allow_pickle=False) as npz:
        meta = json.loads(npz["__meta__"].tobytes().decode())
        state = dict(meta["table"])
        state["cap"] = math.inf if state["cap"] is None else state["cap"]
        for key in npz.files:
            if key != "__meta__":
                state[key] = npz[key]
    return state, meta["store"]


def _restarted() -> bool:
    """Whether Ray is re-running this actor's constructor after the actor died."""
    import warnings

    import ray

    # Ray's property reads its own deprecated ``actor_id``, whose warning would reach the
    # driver's console from every store that starts.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return bool(ray.get_runtime_context().was_current_actor_reconstructed)


# Longest wait before a failed snapshot is tried again (sooner with a shorter interval).
SNAPSHOT_RETRY_S = 5.0


class StoreActor:
    """One shard of the priority store: rows ``[lo, lo + n)`` of the global id space.

    Reporters' updates are queued by ``update`` (cheap, no table work); a daemon thread applies
    them once per tick, coalesced, then ages the table, refreshes the cap and snapshots when
    due. Reads (``sample``, ``prepare``, ``stats``, ...) first apply what is queued, so they see
    every update that reached the actor before them.
    """

    def __init__(self, name: str, lo: int, n: int, table: dict[str, Any],
                 options: dict[str, Any], snapshot_path: str | None,
                 layout: dict[str, Any], prior: Any = None) -> None:
        from raying.storage import files as storage

        self.name = name
        self.lo = lo
        self._layout = layout
        self.options = options
        self.table = PriorityTable(n, **table, prior=prior)
        self._lock = threading.Lock()  # guards the table and the counters
        self._snapshot_lock = threading.Lock()  # one snapshot write at a time
        self._pending: list[tuple[np.ndarray, np.ndarray]] = []
        self.counters = {"received": 0, "coalesced": 0, "ticks": 0, "snapshots": 0,
                         "snapshot_errors": 0, "restores": 0, "restored_updates": 0,
                         "restarts": 0}
        self.last_snapshot_time: float | None = None
        self.last_snapshot_error: str | None = None
        self._applied_at_snapshot = 0  # updates applied when the last snapshot was taken
        self._applied_at_saved = 0  # ... and when the last successful one was taken
        self._captured = 0  # snapshots captured (numbered in capture order) ...
        self._written = 0  # ... and the number of the last one written: an older is stale
        self._retry_at = 0.0  # after a failed snapshot, no new attempt before this (monotonic)
        self._last_cap_refresh = 0.0
        self._snapshot: tuple[Any, str] | None = None
        restarted = _restarted()
        if snapshot_path is not None:
            fs, path = storage.resolve(snapshot_path, options.get("storage"))
            self._snapshot = (fs, path)
            if (options.get("restore", True) or restarted) and storage.exists(fs, path):
                state, counters = decode_snapshot(storage.read_bytes(fs, path))
                try:
                    self.table.load_state_dict(state)
                except ConfigError as exc:
                    # What differs, without the table's own fix (strict=False), which is
                    # not among a store user's options.
                    what = str(exc).split("; build the table")[0]
                    msg = (f"priority store {name}: the snapshot at {snapshot_path} does not "
                           f"fit this store ({what}); build the sampler with the settings the "
                           f"snapshot was saved with, or start afresh: another snapshot_uri, "
                           f"or store={{'restore': False}} (its snapshot is then overwritten)")
                    raise ConfigError(msg) from None
                self.counters.update(counters)
                self.counters["restores"] += 1
                self.counters["restored_updates"] = self.table.counters["updates_applied"]
                self._applied_at_snapshot = self.table.counters["updates_applied"]
                self._applied_at_saved = self._applied_at_snapshot
                self.last_snapshot_time = time.time()
                logger.info("priority store %s restored %s from %s", name,
                            self.table.counters["updates_applied"], snapshot_path)
        if restarted:
            self.counters["restarts"] += 1
            if not self.counters["restores"]:
                # Ray restarted the shard (its process or node was lost) with nothing to
                # restore: training goes on, but on the initial priorities. Said, not hidden.
                logger.warning(
                    "priority store %s was restarted (its process or node was lost) %s: its "
                    "priorities start again from their initial values; set "
                    "StoreConfig(snapshot_uri=...) (PrioritizedSampler(store={'snapshot_uri': "
                    "...})) to restore them from the last snapshot", name,
                    "without a snapshot_uri" if snapshot_path is None else
                    f"and found no snapshot at {snapshot_path} yet")
        self._last_snapshot_clock = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._tick_loop, name=f"{name}-tick", daemon=True)
        self._thread.start()

    # --- writes -------------------------------------------------------------------------------

    def update(self, ids: np.ndarray, values: np.ndarray,
               rejected: dict[str, int] | None = None, exact: bool = False) -> None:
        """Queue validated local ids and priorities; count entries the caller rejected.
        ``exact``: write the values as they are, after the updates queued before them, not
        folded by the coalesce mode (a sample set aside gets 0, not an EMA step toward it)."""
        with self._lock:
            if ids.size and exact:
                self._apply_pending()
                self.table.update(ids, values)
                self.counters["received"] += int(ids.size)
            elif ids.size:
                self._pending.append((ids, values))
                self.counters["received"] += int(ids.size)
            for reason, count in (rejected or {}).items():
                self.table.rejected[reason] = self.table.rejected.get(reason, 0) + int(count)

    def _apply_pending(self) -> int:
        """Apply the queued updates in one vectorized pass (the lock is held)."""
        if not self._pending:
            return 0
        batches, self._pending = self._pending, []
        ids = np.concatenate([b[0] for b in batches])
        values = np.concatenate([b[1] for b in batches])
        mode = self.options["coalesce"]
        if mode != "last":  # the table itself lets the last report of an id win
            ids, values = coalesce(ids, values, mode, self.options["ema"], self.table.priorities)
        written = self.table.update(ids, values)
        self.counters["coalesced"] += int(sum(b[0].size for b in batches)) - written
        self.table.age()
        return written

    def _tick_loop(self) -> None:
        tick_s = self.options["tick_s"]
        while not self._stop.wait(tick_s):
            try:
                self._tick()
            except Exception:  # noqa: BLE001 - the loop must outlive one bad tick
                logger.exception("priority store %s: tick failed", self.name)

    def _tick(self) -> None:
        with self._lock:
            self._apply_pending()
            self.counters["ticks"] += 1
            now = time.monotonic()
            config = self.table.config
            every = max(DEFAULT_CAP_REFRESH_S, self.table.n / REFRESH_ROWS_PER_S)
            if ((config.cap_quantile is not None or config.guard_after is not None)
                    and now - self._last_cap_refresh >= every):
                self.table.refresh_cap()
                self.table.refresh_guard()
                self._last_cap_refresh = now
            since = self.table.counters["updates_applied"] - self._applied_at_snapshot
            due = self._snapshot is not None and since > 0 and now >= self._retry_at and (
                since >= self.options["snapshot_every_updates"]
                or now - self._last_snapshot_clock >= self.options["snapshot_interval_s"])
            captured = self._capture() if due else None
        if captured is not None:
            self._write(*captured)

    # --- snapshots ----------------------------------------------------------------------------

    def _capture(self) -> tuple[dict[str, Any], dict[str, Any], int, int]:
        """Copy what a snapshot holds (the lock is held); the write happens outside it."""
        self._applied_at_snapshot = self.table.counters["updates_applied"]
        self._last_snapshot_clock = time.monotonic()
        self.counters["snapshots"] += 1
        self._captured += 1
        counters = {k: v for k, v in self.counters.items() if k != "restored_updates"}
        return self.table.state_dict(), counters, self._applied_at_snapshot, self._captured

    def _write(self, state: dict[str, Any], counters: dict[str, Any], applied: int,
               number: int) -> None:
        from raying.storage import files as storage

        if self._snapshot is None:
            return
        fs, path = self._snapshot
        try:
            with self._snapshot_lock:
                if number < self._written:
                    # A later capture (snapshot_now at close, while this tick waited for the
                    # lock) is written already: this older state must not replace it.
                    with self._lock:
                        self.counters["snapshots"] -= 1
                    return
                storage.write_bytes_atomic(fs, path, encode_snapshot(state, counters))
                self._written = number
        except Exception as exc:  # noqa: BLE001 - a failed snapshot must not stop the store
            # What this one held counts as not snapshotted, and the next attempt comes after
            # the interval (at most SNAPSHOT_RETRY_S): a storage that refuses writes is not
            # asked again at every tick.
            with self._lock:
                self.counters["snapshot_errors"] += 1
                self.counters["snapshots"] -= 1
                self._applied_at_snapshot = min(self._applied_at_snapshot,
                                                self._applied_at_saved)
                self._retry_at = time.monotonic() + min(
                    self.options["snapshot_interval_s"], SNAPSHOT_RETRY_S)
            self.last_snapshot_error = f"{type(exc).__name__}: {exc}"
            logger.warning("priority store %s: snapshot failed: %s", self.name, exc)
            return
        with self._lock:
            self._applied_at_saved = max(self._applied_at_saved, applied)
        self.last_snapshot_time = time.time()
        self.last_snapshot_error = None

    def snapshot_now(self) -> dict[str, Any] | None:
        """Apply what is queued and write a snapshot now; None when no snapshot URI is set."""
        if self._snapshot is None:
            return None
        with self._lock:
            self._apply_pending()
            captured = self._capture()
        self._write(*captured)
        return {"path": self._snapshot[1], "updates_applied": captured[2],
                "error": self.last_snapshot_error}

    # --- reads --------------------------------------------------------------------------------

    def ready(self) -> bool:
        """True once the constructor ran (and any restore finished)."""
        return True

    def flush(self) -> int:
        """Apply what is queued now; returns the rows written."""
        with self._lock:
            return self._apply_pending()

    def layout(self) -> dict[str, Any]:
        """The whole store's shard bounds and mixture share, for ``get_store``."""
        return self._layout

    def sample(self, k: int, systematic: bool) -> tuple[np.ndarray, np.ndarray, int, float]:
        """A plan from this shard alone (the single-shard store): ids, probs, size, min prob."""
        with self._lock:
            self._apply_pending()
            ids, probs = self.table.sample(k, systematic=systematic)
            return ids + self.lo, probs, self.table.n, self.table.min_probability()

    def sample_in_groups(self, k: int, starts: np.ndarray, rows_per_group: int
                         ) -> tuple[np.ndarray, np.ndarray, int, float]:
        """A two-stage plan (groups by mass, then rows inside them); single-shard stores."""
        with self._lock:
            self._apply_pending()
            ids, probs = self.table.sample_in_groups(k, starts, rows_per_group)
            return ids + self.lo, probs, self.table.n, self.table.min_probability()

    def prepare(self) -> dict[str, Any]:
        """Apply what is queued; return the sums a two-level plan needs, and a fresh seed."""
        with self._lock:
            self._apply_pending()
            low, low_positive = self.table.leaf_minima()
            return {"n": self.table.n, "total": self.table.total(), "min": low,
                    "min_positive": low_positive,
                    "seed": int(self.table.rng.integers(2**63))}

    def locate(self, positions: np.ndarray, a: float, b: float) -> tuple[np.ndarray, np.ndarray]:
        """Global ids and exact global probabilities at positions of this shard's mass."""
        with self._lock:
            ids, probs = self.table.locate(positions, a=a, b=b)
            self.table.counters["samples"] += int(ids.size)
            return ids + self.lo, probs

    def priorities(self, ids: np.ndarray | None = None) -> np.ndarray:
        """The stored priorities of local ids (all rows when None)."""
        with self._lock:
            self._apply_pending()
            return self.table.priorities(ids)

    def scores(self) -> np.ndarray:
        """Every local row's latest reported loss, NaN where none was reported."""
        with self._lock:
            self._apply_pending()
            out = self.table.priorities()
            out[~self.table.reported()] = np.nan
            return out

    def stats(self) -> dict[str, Any]:
        """Counters, the leaf sums, the age summary and snapshot health of this shard."""
        with self._lock:
            self._apply_pending()
            return {"lo": self.lo, "counters": dict(self.counters),
                    "table_counters": dict(self.table.counters),
                    "rejected": dict(self.table.rejected),
                    "pending": int(sum(b[0].size for b in self._pending)),
                    "updates_since_snapshot":
                        self.table.counters["updates_applied"] - self._applied_at_saved,
                    "last_snapshot_time": self.last_snapshot_time,
                    "last_snapshot_error": self.last_snapshot_error,
                    "leaves": self.table.leaf_summary(), "age": self.table.age_summary(),
                    "guard": self.table.guard_summary()}

    def state_dict(self) -> dict[str, Any]:
        """The table's state after applying what is queued."""
        with self._lock:
            self._apply_pending()
            return self.table.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Replace the table's state (pending updates are dropped)."""
        with self._lock:
            self._pending = []
            self.table.load_state_dict(state)
            # The loaded state is not in any snapshot yet: the next tick writes one.
            self._applied_at_snapshot = self._applied_at_saved = -1
            self._last_snapshot_clock = -math.inf
