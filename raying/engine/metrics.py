"""The account of a run: rows delivered and skipped (with reasons), bytes, time, stalls."""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Any

import numpy as np

from raying.read.account import UnitAccount

logger = logging.getLogger("raying")

# Skipped samples kept with their details; beyond this only counts by reason are kept.
MAX_SKIPPED_LISTED = 10_000


class RunAccount:
    """Accumulates the per-unit accounts of read tasks and the consumer's timings."""

    def __init__(self, manifest: Any = None) -> None:
        self._lock = threading.Lock()
        self.rows_in = 0
        self.rows_out = 0
        self.units = 0
        self.bytes_read = 0
        self.read_s = 0.0
        self.decode_s = 0.0
        self.skipped: list[dict[str, Any]] = []
        self.skipped_by_reason: collections.Counter[str] = collections.Counter()
        self._skipped_ids: set[int] = set()
        self.skip_events = 0
        self.retries = 0
        self.io: dict[str, float] = {}
        self.rows_by_node: dict[str, int] = {}
        # (node, pid) of each read worker -> its largest own memory (KiB) seen at a unit's end
        self.worker_kib: dict[tuple[str | None, int], int] = {}
        # (node, pid) of each read worker -> the heavy frameworks it had imported
        self.worker_frameworks: dict[tuple[str | None, int], set[str]] = {}
        self._iter_s = 0.0  # wall seconds spent inside iteration loops (stall share's base)
        self._logged = 0
        # Samples set aside beyond the listed ones, by (epoch, reason), not logged yet.
        self._unlisted: collections.Counter[tuple[int, str]] = collections.Counter()
        # The epoch each set-aside sample was first skipped in.
        self._aside_epoch: dict[int, int] = {}
        # Draws of samples set aside before, skipped again: (epoch, set aside in an earlier
        # epoch) -> [draws, their ids], not logged yet; and whether a line about those of an
        # earlier epoch went out at WARNING already.
        self._again: dict[tuple[int, bool], list[Any]] = {}
        self._warned_again = False
        self.stall = [0.0]  # seconds the consumer waited for a batch (shared with prefetch)
        self.rows_delivered = 0
        self._t_first: float | None = None
        self._t_last: float | None = None
        self._t_start = time.perf_counter()
        n = len(manifest) if manifest is not None else 0
        self._seen_ever = np.zeros(n, dtype=bool)
        self._seen_epoch = np.zeros(n, dtype=bool)
        self._epoch: int | None = None
        self._w = [0, 0.0, 0.0, np.inf, 0.0]  # count, sum, sum of squares, min, max
        # Per epoch: rows read (delivered to the iterator), and their weights' min and max.
        self._per_epoch: dict[int, list[float]] = {}

    def observe_block(self, epoch: int, block: dict[str, Any]) -> None:
        """Sampling health: which ids were drawn (this epoch, ever) and the weights' spread."""
        if not len(self._seen_ever):
            return
        if epoch != self._epoch:
            self._epoch = epoch
            self._seen_epoch[:] = False
        ids = block["id"]
        self._seen_epoch[ids] = True
        self._seen_ever[ids] = True
        w = np.asarray(block["weight"], dtype=np.float64)
        rec = self._per_epoch.setdefault(int(epoch), [0, np.inf, -np.inf])
        rec[0] += len(ids)
        if w.size:
            rec[1] = min(rec[1], float(w.min()))
            rec[2] = max(rec[2], float(w.max()))
        if w.size:
            c = self._w
            c[0] += w.size
            c[1] += float(w.sum())
            c[2] += float((w * w).sum())
            c[3] = min(c[3], float(w.min()))
            c[4] = max(c[4], float(w.max()))

    def health(self) -> dict[str, Any]:
        """Coverage of this epoch, share never drawn, importance-weight spread, and per epoch
        the samples read and the range of their weights."""
        n = len(self._seen_ever)
        count, total, squares, low, high = self._w
        mean = std = None
        if count:
            mean = total / count
            std = float(np.sqrt(max(squares / count - mean * mean, 0.0)))
        # A process that read nothing (a Train driver: its workers read) has no coverage to
        # tell; 0 and 1 would read as "nothing drawn" beside the store's counts.
        read = n and self._per_epoch
        return {"coverage_epoch": float(self._seen_epoch.mean()) if read else None,
                "never_drawn_share": float(1.0 - self._seen_ever.mean()) if read else None,
                "weight_mean": mean, "weight_std": std,
                "weight_min": low if count else None, "weight_max": high if count else None,
                "per_epoch": [{"epoch": e, "samples_read": int(r[0]),
                               "weight_min": r[1] if r[0] else None,
                               "weight_max": r[2] if r[0] else None}
                              for e, r in sorted(self._per_epoch.items())]}

    def skipped_ids(self) -> set[int]:
        """Every id set aside so far (a copy)."""
        with self._lock:
            return set(self._skipped_ids)

    def add(self, account: UnitAccount) -> list[int]:
        """One read task's account (called in plan order by the executor).

        Returns the ids set aside for the first time (a bad file is bad in every epoch: it is
        listed and logged once, and counted again only in ``skip_events``).
        """
        fresh: list[int] = []
        with self._lock:
            self.units += int(account.final)  # a unit's blocks and slices count once
            self.rows_in += account.rows_in
            self.rows_out += account.rows_out
            self.bytes_read += account.bytes_read
            self.read_s += account.read_s
            self.decode_s += account.decode_s
            node = account.node
            if node is not None:
                self.rows_by_node[node] = self.rows_by_node.get(node, 0) + account.rows_out
            for key, value in account.io.items():
                self.io[key] = self.io.get(key, 0) + value
            if account.pid and account.worker_kib:
                key = (node, account.pid)
                self.worker_kib[key] = max(self.worker_kib.get(key, 0), account.worker_kib)
                self.worker_frameworks.setdefault(key, set()).update(account.frameworks)
            for sid, path, reason, detail in account.skipped:
                self.skip_events += 1
                if int(sid) in self._skipped_ids:
                    epoch = int(account.epoch)
                    earlier = self._aside_epoch.get(int(sid), epoch) < epoch
                    again = self._again.setdefault((epoch, earlier), [0, set()])
                    again[0] += 1
                    again[1].add(int(sid))
                    continue
                self._skipped_ids.add(int(sid))
                self._aside_epoch[int(sid)] = int(account.epoch)
                fresh.append(int(sid))
                self.skipped_by_reason[reason] += 1
                if len(self.skipped) < MAX_SKIPPED_LISTED:
                    self.skipped.append({"id": int(sid), "path": path, "reason": reason,
                                         "detail": detail, "epoch": account.epoch})
                else:
                    self._unlisted[(int(account.epoch), reason)] += 1
        return fresh

    def delivery_state(self) -> tuple[Any, ...]:
        """What the consumer's side holds (rows delivered, ids seen, weights), to put back
        with :meth:`restore_delivery` after a look at a batch no user receives."""
        return (self.rows_delivered, self._t_first, self._t_last, self._epoch,
                self._seen_ever.copy(), self._seen_epoch.copy(), list(self._w),
                {e: list(r) for e, r in self._per_epoch.items()}, self.stall[0])

    def restore_delivery(self, state: tuple[Any, ...]) -> None:
        (self.rows_delivered, self._t_first, self._t_last, self._epoch, seen_ever, seen_epoch,
         self._w, self._per_epoch, self.stall[0]) = state
        self._seen_ever[:] = seen_ever
        self._seen_epoch[:] = seen_epoch

    def delivered(self, n: int) -> None:
        now = time.perf_counter()
        if self._t_first is None:
            self._t_first = now
        self._t_last = now
        self.rows_delivered += n

    def end_epoch(self, epoch: int) -> None:
        """Log the samples set aside so far, once each (nothing fails silently); those beyond
        the ``MAX_SKIPPED_LISTED`` listed in ``stats()['skipped']`` are counted in it too; and
        the draws of samples set aside before that were skipped again."""
        with self._lock:
            new = self.skipped[self._logged:]
            unlisted, self._unlisted = self._unlisted, collections.Counter()
            self._logged = len(self.skipped)
            again, self._again = self._again, {}
        self._log_new(epoch, new, unlisted)
        for (e, earlier) in sorted(again):
            self._log_again(e, earlier, *again[(e, earlier)])

    def _log_new(self, epoch: int, new: list[dict[str, Any]],
                 unlisted: collections.Counter[tuple[int, str]]) -> None:
        """One line per epoch for the samples first set aside in it."""
        if not new and not unlisted:
            return
        # Under the epoch each was read in: an epoch that raised logs its skips at the next
        # epoch's end.
        by_epoch: dict[int, list[dict[str, Any]]] = {}
        for s in new:
            by_epoch.setdefault(int(s.get("epoch", epoch)), []).append(s)
        for e in sorted(set(by_epoch) | {e for e, _ in unlisted}):
            some = by_epoch.get(e, [])
            extra = collections.Counter({r: c for (ee, r), c in unlisted.items() if ee == e})
            reasons = collections.Counter(s["reason"] for s in some) + extra
            total = len(some) + sum(extra.values())
            shown = "; ".join(f"id {s['id']} {s['path']}: {s['reason']}" for s in some[:5])
            more = f" (+{total - len(some[:5])} more)" if total > len(some[:5]) else ""
            listed = (f"; the first {MAX_SKIPPED_LISTED:,} of the run are listed in "
                      f"pipe.stats()['skipped'], all counted in skipped_count" if extra
                      else "; see pipe.stats()['skipped']")
            logger.warning("raying skipped %d bad samples in epoch %d (%s): %s%s%s", total, e,
                           dict(reasons), shown or "none listed", more, listed)

    def _log_again(self, epoch: int, earlier: bool, draws: int, ids: set[int]) -> None:
        """Say that an epoch delivered fewer rows than it drew: draws of samples already set
        aside, skipped again. Those set aside in an earlier epoch were drawn because the epoch
        was planned before they were found, or because the sampler still draws them: the
        first such line is a warning, later ones (a Train worker's share meets its bad samples
        in every epoch) are logged at INFO, as are the repeated draws, within their epoch, of
        a sampler that draws with replacement."""
        shown = ", ".join(str(i) for i in sorted(ids)[:5]) + (" ..." if len(ids) > 5 else "")
        if not earlier:
            logger.info("raying skipped %d more draws of %d bad samples in epoch %d (ids %s): "
                        "its sampler drew them more than once; counted in "
                        "pipe.stats()['skip_events']", draws, len(ids), epoch, shown)
            return
        level = logging.INFO if self._warned_again else logging.WARNING
        self._warned_again = True
        logger.log(level,
                   "raying skipped %d draws of %d samples set aside in an earlier epoch again "
                   "in epoch %d (ids %s), which delivers that many fewer rows than it drew: "
                   "its plan was drawn before they were found (the next epoch is planned while "
                   "the last reads of the one before run), or its sampler still draws them (a "
                   "Train worker's share of a weighted plan, a prioritized sampler's uniform "
                   "floor). Counted in pipe.stats()['skip_events']", draws, len(ids), epoch,
                   shown)

    def iterated(self, seconds: float) -> None:
        """Wall time of one iteration loop, from its first request to its end."""
        self._iter_s += seconds

    def summary(self) -> dict[str, Any]:
        with self._lock:
            elapsed = (self._t_last - self._t_first) if self._t_first and self._t_last else 0.0
            wall = self._iter_s
            return {
                "rows_delivered": self.rows_delivered,
                "rows_read": self.rows_in,
                "units": self.units,
                "throughput_rows_per_s": (self.rows_delivered / elapsed) if elapsed > 0 else 0.0,
                "stall_s": self.stall[0],
                "stall_share": (self.stall[0] / wall) if wall > 0 else 0.0,
                "bytes_read": self.bytes_read,
                "worker_read_s": self.read_s,
                "worker_decode_s": self.decode_s,
                "skipped_count": sum(self.skipped_by_reason.values()),
                "skip_events": self.skip_events,
                "read_retries": self.retries + int(self.io.get("io_retries", 0)),
                "io": _io_summary(self.io),
                "rows_by_node": dict(self.rows_by_node),
                "skipped_by_reason": dict(self.skipped_by_reason),
                "skipped": list(self.skipped),
                "read_workers": workers_summary(self.worker_kib, self.worker_frameworks),
            }


def workers_summary(worker_kib: dict[tuple[str | None, int], int],
                    frameworks: dict[tuple[str | None, int], set[str]] | None = None
                    ) -> dict[str, Any]:
    """The read workers' count and own memory (largest seen per worker, MB), and the heavy
    frameworks each had imported (only the workers that had any)."""
    mb = [v / 1024.0 for v in worker_kib.values()]

    def name(key: tuple[str | None, int]) -> str:
        return f"{key[0] or 'local'}:{key[1]}"

    def order(kv: tuple[tuple[str | None, int], Any]) -> tuple[str, int]:
        return str(kv[0][0]), kv[0][1]

    return {"count": len(mb), "pss_mb_max": max(mb) if mb else None,
            "pss_mb_mean": sum(mb) / len(mb) if mb else None, "pss_mb_sum": sum(mb),
            "by_worker": {name(k): round(v / 1024.0, 1)
                          for k, v in sorted(worker_kib.items(), key=order)},
            "frameworks": {name(k): sorted(v)
                           for k, v in sorted((frameworks or {}).items(), key=order) if v}}


def _io_summary(totals: dict[str, float]) -> dict[str, Any]:
    """Read amplification and cache hit ratios from the summed io_*/cache_* counters."""
    from raying.read.fetch import summarize

    out = summarize(totals)
    out["retries"] = int(totals.get("io_retries", 0))
    if not totals.get("cache_lookups"):  # no cache configured: leave out the empty ratios
        out = {k: v for k, v in out.items() if not k.startswith("cache_")}
    if totals.get("cache_decoded_lookups"):
        out["cache_decoded_lookups"] = int(totals["cache_decoded_lookups"])
        out["cache_decoded_hits"] = int(totals.get("cache_decoded_hits", 0))
        out["decoded_cache_hit_ratio"] = out["cache_decoded_hits"] / out["cache_decoded_lookups"]
    return out


class EpochTally:
    """Rows read and delivered by one iteration's read tasks, passing each account on."""

    def __init__(self, on_account: Any) -> None:
        self.rows_in = 0
        self.rows_out = 0
        self.first_skips: list[Any] = []
        self._next = on_account

    def add(self, account: UnitAccount) -> None:
        self.rows_in += account.rows_in
        self.rows_out += account.rows_out
        if len(self.first_skips) < 3:
            self.first_skips.extend(account.skipped[:3])
        self._next(account)

    def refuse_all_bad(self, n: int, root: str, epoch: int) -> None:
        """Raise DataError if every sample read was set aside as bad (a wrong URI, format or
        column, not bad luck; a tiny epoch, e.g. a resumed tail, is let pass)."""
        msg = all_bad_message(self.rows_in, self.rows_out, self.first_skips, n, root, epoch)
        if msg is not None:
            from raying.errors import DataError

            raise DataError(msg)


def all_bad_message(rows_in: int, rows_out: int, first_skips: list[Any], n: int, root: str,
                    epoch: int) -> str | None:
    """The error for an epoch whose every sample read was set aside as bad, or None (some
    row delivered, nothing skipped, or fewer rows read than ``min(n, 8)``)."""
    if rows_in < min(n, 8) or rows_out or not first_skips:
        return None
    shown = "; ".join(f"{path or sid}: {reason}" for sid, path, reason, _ in first_skips[:3])
    return (f"every one of the {rows_in} samples read in epoch {epoch} of {root} was "
            f"set aside as bad ({shown}); nothing to train on. Check that the URI, format "
            f"and image column are the intended ones; the list is in "
            f"pipe.stats()['skipped']")
