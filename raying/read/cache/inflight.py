"""Single flight for a cache tier: claims on the files some read is fetching right now.

Two read tasks of a node (or two threads of one) that miss the same file at the same time
would fetch it twice from slow storage. Before fetching its misses a read claims them in the
first tier's index (table ``inflight``); a miss already claimed by a live owner is not
fetched again: the read waits until the owner's entry is admitted (then reads it from the
tier) or the claim is released without one (then fetches it itself). A claim is void once
its owner's process is gone or it is older than ``DEFAULT_CACHE_INFLIGHT_S``, so a killed
worker never blocks the others for long.
"""

from __future__ import annotations

import os
import sqlite3
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from raying.options import DEFAULT_CACHE_INFLIGHT_S
from raying.read.cache.entry import digest_of
from raying.read.cache.pids import alive as pid_alive
from raying.read.cache.sqlite import _chunks, _marks, _write


class InflightClaims:
    """The claims on keys held in one tier's index: claim, release, list (module docstring).

    Args:
        db: the tier's SQLite connection of this process (opened on first use).
        lock: the tier's lock, held around every use of the connection.
        lock_fd: the tier's writers' lock file, taken around every write transaction.
    """

    def __init__(self, db: Callable[[], sqlite3.Connection], lock: threading.Lock,
                 lock_fd: Callable[[], int | None]) -> None:
        self._db, self._lock, self._lock_fd = db, lock, lock_fd

    def claim(self, keys: Sequence[str], owner: str, *,
              stale_s: float = DEFAULT_CACHE_INFLIGHT_S) -> list[bool]:
        """Claim the fetch of each key for ``owner``; True where the claim is now ours.

        A key already claimed by a live owner (a claim younger than ``stale_s`` whose process
        is alive) stays with it: the caller waits for that read (:meth:`claims`) instead of
        fetching the file again. Claims of dead or stale owners are taken over.
        """
        digests = [digest_of(k) for k in keys]
        if not digests:
            return []
        now = time.time()
        held: dict[str, str] = {}
        with self._lock:
            conn = self._db()
            with _write(conn, self._lock_fd()):
                conn.execute("DELETE FROM inflight WHERE since < ?", (now - stale_s,))
                for part in _chunks(sorted(set(digests))):
                    q = f"SELECT digest, owner, pid FROM inflight WHERE digest IN ({_marks(part)})"
                    for d, who, pid in conn.execute(q, part).fetchall():
                        if _alive(pid):
                            held[d] = who
                        else:
                            conn.execute("DELETE FROM inflight WHERE digest = ?", (d,))
                conn.executemany("INSERT INTO inflight VALUES (?, ?, ?, ?)",
                                 [(d, owner, os.getpid(), now)
                                  for d in sorted(set(digests)) if d not in held])
        return [held.get(d, owner) == owner for d in digests]

    def release(self, keys: Sequence[str], owner: str) -> None:
        """Drop ``owner``'s claims on ``keys`` (its fetch ended: admitted, refused or failed)."""
        digests = sorted({digest_of(k) for k in keys})
        if not digests:
            return
        with self._lock:
            conn = self._db()
            with _write(conn, self._lock_fd()):
                conn.executemany("DELETE FROM inflight WHERE digest = ? AND owner = ?",
                                 [(d, owner) for d in digests])

    def claims(self, keys: Sequence[str], *, stale_s: float = DEFAULT_CACHE_INFLIGHT_S
               ) -> set[str]:
        """The keys still claimed by a live owner (a read: no writers' lock taken)."""
        by_digest = {digest_of(k): k for k in keys}
        if not by_digest:
            return set()
        out: set[str] = set()
        since = time.time() - stale_s
        with self._lock:
            conn = self._db()
            for part in _chunks(sorted(by_digest)):
                q = (f"SELECT digest, pid FROM inflight WHERE since >= ? AND digest IN "
                     f"({_marks(part)})")
                out.update(by_digest[d] for d, pid in conn.execute(q, [since, *part])
                           if _alive(pid))
        return out


def _alive(pid: int) -> bool:
    """Whether a claim's owner still runs (this process always does)."""
    return pid == os.getpid() or pid_alive(pid)


class SingleFlight:
    """A cache's single flight: claim misses, release them, wait for other owners' reads.

    Args:
        tiers: the cache's tiers, fastest first; claims live in the first one's index.
        queued: ``full keys -> {position: payload}`` of entries this process offered to the
            cache and has not written yet (a thread of this process fetched them).
    """

    def __init__(self, tiers: list[tuple[str, Any]],
                 queued: Callable[[list[str]], dict[int, memoryview]]) -> None:
        self.tiers, self._queued = tiers, queued

    def claim(self, full: list[str], owner: str) -> list[bool]:
        """Claim the fetch of each (namespaced) key: True where it is ours to fetch."""
        return self.tiers[0][1].claims_index.claim(full, owner)

    def release(self, full: list[str], owner: str) -> None:
        """Drop ``owner``'s claims on ``full``."""
        if full:
            self.tiers[0][1].claims_index.release(full, owner)

    def wait_shared(self, full: list[str], scores: Sequence[float] | None = None, *,
                    timeout_s: float = DEFAULT_CACHE_INFLIGHT_S) -> list[memoryview | None]:
        """Wait for the reads other owners claimed on ``full``; their payloads, or None.

        A key's payload comes from this process's writer queue (a thread of this process
        fetched it) or from a tier once its owner's admission landed; None where the owner
        released its claim without an entry (not admitted, failed), died, or ``timeout_s``
        passed: the caller fetches those itself.
        """
        out: list[memoryview | None] = [None] * len(full)
        left = list(range(len(full)))
        claims = self.tiers[0][1].claims_index
        deadline = time.monotonic() + timeout_s
        delay = 0.001
        while left:
            queued = self._queued([full[i] for i in left])
            if queued:
                for j, payload in queued.items():
                    out[left[j]] = payload
                left = [i for i in left if out[i] is None]
            if not left:
                break
            held = claims.claims([full[i] for i in left])  # before the lookup: no race
            done = [i for i in left if full[i] not in held]
            for _, tier in self.tiers:
                if not done:
                    break
                found, _ = tier.get_many(
                    [full[i] for i in done],
                    [scores[i] for i in done] if scores is not None else None, draws=0)
                for j, payload in found.items():
                    out[done[j]] = payload
                done = [i for i in done if out[i] is None]
            left = [i for i in left if full[i] in held and out[i] is None]
            if not left or time.monotonic() > deadline:
                break
            time.sleep(delay)
            delay = min(0.02, delay * 2)
        return out
