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
from collections.abc import Sequence

from raying.io._entry import digest_of
from raying.io._sqlite import _chunks, _marks, _write
from raying.io.options import DEFAULT_CACHE_INFLIGHT_S


class InflightClaims:
    """Mixed into DirTier: claim / release / list the claims on keys (see module docstring)."""

    _lock: threading.Lock

    def _db(self) -> sqlite3.Connection:  # pragma: no cover - provided by DirTier
        raise NotImplementedError

    def _lock_fd(self) -> int | None:  # pragma: no cover - provided by DirTier
        raise NotImplementedError

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
    """Whether process ``pid`` of this node still runs (a claim of a dead one is void)."""
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    return True
