"""One cache tier: a size-bounded directory of checksummed entries with a SQLite (WAL) index.

Layout of a tier directory::

    index.sqlite (+ -wal, -shm)   entries(digest, nbytes, crc, score, seen, born, ready),
                                  meta(clock)
    lock                          writers queue on its flock
    data/ab/abcdef...             one file per entry: 16-byte header (magic, crc32, length)
                                  then the payload
    inflight (a table)            claims on files being fetched by some read (single flight)

Safety between processes (every Ray worker of a node shares the tier):

* Lookups read the index without locking (WAL readers never wait) and verify each file's
  header and checksum against the index; a bad or missing file is a miss, and its row goes.
* Admission reserves room in one ``BEGIN IMMEDIATE`` transaction (one writer at a time,
  across processes): it deletes the victims' files and rows and inserts the new rows as
  pending. The files are then written without the lock (temp file + rename: no reader ever
  sees a partial file) and marked ready. Every file on disk belongs to a row and the rows
  never exceed the capacity, so neither does the directory, at any moment.
* A writer that dies leaves pending rows (evicted first once stale) and perhaps a temp file
  (swept on a later open); a row whose file vanished is dropped at its next lookup.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sqlite3
import threading
import time
import zlib
from collections.abc import Iterator, Sequence

from raying.options import (
    DEFAULT_CACHE_DECAY_READS,
    DEFAULT_CACHE_LOCK_TIMEOUT_S,
    DEFAULT_CACHE_ORPHAN_AGE_S,
    DEFAULT_CACHE_PENDING_S,
)
from raying.read.cache.entry import digest_of, entry_bytes, read_entry, unlink, write_entry
from raying.read.cache.inflight import InflightClaims
from raying.read.cache.sqlite import _chunks, _marks, _retry_locked, _write, fcntl

logger = logging.getLogger(__name__)

# Draws of lookups that found nothing a process may hold back before it writes them to the
# tier's clock (a write transaction, under the writers' flock, per lookup otherwise: the whole
# cost of an epoch-0 lookup that misses). They go in with its next write of the index; the
# clock only ages entries (the priority policy's decay, over draws of the order of the data
# set), so a few hundred draws late change no decision that matters.
_DEFERRED_DRAWS_MAX = 1024

_SCHEMA = """
CREATE TABLE IF NOT EXISTS entries (
    digest TEXT PRIMARY KEY, nbytes INTEGER NOT NULL, crc INTEGER NOT NULL,
    score REAL NOT NULL, seen INTEGER NOT NULL, born REAL NOT NULL,
    ready INTEGER NOT NULL) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS entries_seen ON entries(seen);
CREATE TABLE IF NOT EXISTS meta (k TEXT PRIMARY KEY, v INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS inflight (
    digest TEXT PRIMARY KEY, owner TEXT NOT NULL, pid INTEGER NOT NULL,
    since REAL NOT NULL) WITHOUT ROWID;
INSERT OR IGNORE INTO meta VALUES ('clock', 0);
INSERT OR IGNORE INTO meta VALUES ('version', 2);
"""


def dir_id(path: str) -> tuple[int, int] | None:
    """``(device, inode)`` of the directory at ``path``, None when there is none."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino)


class DirTier:
    """A size-bounded, checksummed, multi-process cache directory (see the module docstring).

    Args:
        root: the directory (created if needed).
        capacity_bytes: the most bytes of entries (headers included) it ever holds.
        policy: ``"priority"``: evict the lowest expected future reads, admit only what beats
            the entries it would evict; ``"lru"``: evict the least recently drawn, admit all.
        decay_reads: caps an entry's expected reads at ``decay_reads / draws since it was
            last drawn`` (priority policy).
        name: for stats and messages (``"memory"``, ``"disk"``).
    """

    def __init__(self, root: str, capacity_bytes: int, *, policy: str = "priority",
                 decay_reads: float = DEFAULT_CACHE_DECAY_READS, name: str = "") -> None:
        self.root = os.path.abspath(root)
        self.capacity = int(capacity_bytes)
        self.policy = policy
        self.decay = float(decay_reads)
        self.name = name or self.root
        self._data = os.path.join(self.root, "data")
        for k in range(256):  # the fan-out folders, made once rather than at every write
            os.makedirs(os.path.join(self._data, f"{k:02x}"), exist_ok=True)
        self.root_id = dir_id(self.root)  # which directory this is (one removed and made
        self._lock = threading.Lock()      # again under the same path is another)
        self._deferred_draws = 0  # draws of missed lookups not in the clock yet
        self._deferred_pid = os.getpid()  # ... of this process (a forked child has none)
        self._conn: sqlite3.Connection | None = None
        self._pid = -1
        self._fd: int | None = None
        self._fd_pid = -1
        # Claims on keys some read is fetching, in this tier's index (single flight).
        self.claims_index = InflightClaims(self._db, self._lock, self._lock_fd)
        with self._lock:
            self._db()
        self.sweep_orphans()

    # -- the index -----------------------------------------------------------------------------
    def _db(self) -> sqlite3.Connection:
        if self._conn is None or self._pid != os.getpid():  # a forked child opens its own
            try:
                conn = self._open_index()
            except sqlite3.DatabaseError as exc:
                if isinstance(exc, sqlite3.OperationalError):  # locked, no room: not damage
                    raise
                self._set_index_aside(exc)
                conn = self._open_index()
            self._conn, self._pid = conn, os.getpid()
        return self._conn

    def _set_index_aside(self, exc: BaseException) -> None:
        """A damaged index (not a database, malformed) is moved aside; the tier starts empty.

        Under the writers' flock, so that one process moves it and the others find the new
        one. Entry files it listed become orphans, removed by :meth:`sweep_orphans`.
        """
        fd = self._lock_fd()
        if fd is not None:
            fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            try:
                self._open_index().close()  # another process may have replaced it already
                return
            except sqlite3.DatabaseError:
                pass
            stamp = time.strftime("%Y%m%d-%H%M%S")
            index = os.path.join(self.root, "index.sqlite")
            for suffix in ("", "-wal", "-shm"):
                if os.path.exists(index + suffix):
                    os.replace(index + suffix, f"{index}.damaged-{stamp}{suffix}")
            logger.warning("raying cache tier %s: its index was damaged (%s); moved aside to "
                           "index.sqlite.damaged-%s, the tier starts empty", self.root, exc,
                           stamp)
        finally:
            if fd is not None:
                fcntl.flock(fd, fcntl.LOCK_UN)

    def _open_index(self) -> sqlite3.Connection:
        conn = sqlite3.connect(os.path.join(self.root, "index.sqlite"),
                               timeout=DEFAULT_CACHE_LOCK_TIMEOUT_S, isolation_level=None,
                               check_same_thread=False)
        try:
            _retry_locked(lambda: conn.execute("PRAGMA journal_mode=WAL"), self._lock_fd())
            conn.execute("PRAGMA synchronous=NORMAL")
            with _write(conn, self._lock_fd()):
                cols = [r[1] for r in conn.execute("PRAGMA table_info(entries)")]
                if cols and "ready" not in cols:  # an older layout: a cache may start empty
                    conn.execute("DROP TABLE entries")
                for stmt in _SCHEMA.strip().split(";"):
                    if stmt.strip():
                        conn.execute(stmt)
        except BaseException:
            conn.close()
            raise
        return conn

    def _lock_fd(self) -> int | None:
        """A descriptor of the tier's lock file (this process's), or None without fcntl."""
        if fcntl is None:
            return None
        if self._fd is None or self._fd_pid != os.getpid():
            self._fd = os.open(os.path.join(self.root, "lock"), os.O_RDWR | os.O_CREAT, 0o644)
            self._fd_pid = os.getpid()
        return self._fd

    def _path(self, digest: str) -> str:
        return os.path.join(self._data, digest[:2], digest)

    # -- reads ---------------------------------------------------------------------------------
    def get_many(self, keys: Sequence[str], scores: Sequence[float] | None = None, *,
                 draws: int | None = None, touch: Sequence[str] = (),
                 touch_scores: Sequence[float] | None = None
                 ) -> tuple[dict[int, memoryview], int]:
        """Look up ``keys``; verified payloads of the hits, by position, and corrupt count.

        Hits are marked as drawn now (recency; for the priority policy their score becomes
        the given one, the sampler's latest probability); so are the ``touch`` keys, drawn
        but served by a tier above, which are not read. ``draws`` advances the tier's clock
        (default ``len(keys)``), which ages the entries that are not drawn.
        """
        digests = [digest_of(k) for k in keys]
        rows: dict[str, tuple[int, int]] = {}
        if digests:
            with self._lock:
                conn = self._db()
                for part in _chunks(sorted(set(digests))):
                    q = (f"SELECT digest, nbytes, crc FROM entries WHERE ready = 1 AND digest IN "
                         f"({_marks(part)})")
                    rows.update({d: (n, c) for d, n, c in conn.execute(q, part)})
        good: dict[str, memoryview] = {}
        bad: set[str] = set()
        for d, (nbytes, crc) in rows.items():
            payload = read_entry(self._path(d), nbytes, crc)
            if payload is None:
                bad.add(d)
            else:
                good[d] = payload
        corrupt = sum(int(os.path.exists(self._path(d))) for d in bad)
        found = {k: good[d] for k, d in enumerate(digests) if d in good}
        touched: dict[str, float | None] = {}
        for k in found:
            touched[digests[k]] = float(scores[k]) if scores is not None else None
        for k, key in enumerate(touch):
            touched[digest_of(key)] = (float(touch_scores[k]) if touch_scores is not None
                                       else None)
        drawn = len(keys) if draws is None else int(draws)
        with self._lock:
            if not touched and not bad and self._held_draws() + drawn < _DEFERRED_DRAWS_MAX:
                self._deferred_draws += drawn  # nothing to write but the clock: later
                return found, corrupt
        with self._lock:
            conn = self._db()
            held = self._held_draws()
            with _write(conn, self._lock_fd()):
                clock = self._clock(conn) + drawn + held
                conn.execute("UPDATE meta SET v = ? WHERE k = 'clock'", (clock,))
                conn.executemany(
                    "UPDATE entries SET seen = ?, score = COALESCE(?, score) WHERE digest = ?",
                    [(clock, s, d) for d, s in touched.items()])
                for d in bad:  # only if the row still describes the file found bad
                    cur = conn.execute("DELETE FROM entries WHERE digest = ? AND nbytes = ? "
                                       "AND crc = ? AND ready = 1", (d, *rows[d]))
                    if cur.rowcount:
                        unlink(self._path(d))
            self._deferred_draws -= held  # written (a rolled-back write keeps them held)
        if corrupt:
            logger.warning("raying cache %s: %d corrupt entries dropped (they are refetched)",
                           self.name, corrupt)
        return found, corrupt

    # -- writes --------------------------------------------------------------------------------
    def put_many(self, keys: Sequence[str], payloads: Sequence[bytes | memoryview],
                 scores: Sequence[float] | None = None, *,
                 crcs: Sequence[int] | None = None) -> tuple[int, int]:
        """Offer entries; returns (admitted, evicted).

        LRU admits everything that fits the capacity, evicting the least recently drawn.
        Priority offers candidates from the highest score down and admits one only while the
        entries it would evict all have lower expected reads than its own score.

        Three steps keep the index lock short: reserve (under the lock: choose victims,
        delete their files and rows, insert the new rows as pending), write the new files
        (no lock: their room is reserved), mark them ready (under the lock). Lookups skip
        pending rows; a pending row older than ``DEFAULT_CACHE_PENDING_S`` (its writer died)
        is the first to be evicted.

        Args:
            keys, payloads, scores: the entries and their expected reads (priority policy).
            crcs: CRC-32 of each payload when the caller has it (tiers share it).
        """
        if self.capacity <= 0 or not keys:
            return 0, 0
        cands: dict[str, tuple[int, float]] = {}
        for k, key in enumerate(keys):
            size = entry_bytes(len(payloads[k]))
            if size <= self.capacity:
                score = float(scores[k]) if scores is not None else 0.0
                d = digest_of(key)
                if d not in cands or cands[d][1] < score:
                    cands[d] = (k, score)
        if not cands:
            return 0, 0
        admit, evicted = self._reserve(cands, payloads, crcs)
        written = []
        for d, crc in admit:
            try:
                write_entry(self._path(d), payloads[cands[d][0]], crc)
                written.append(d)
            except OSError as exc:
                if os.path.isdir(self._data):
                    logger.warning("raying cache %s: could not write an entry (%s)", self.name,
                                   exc)
                else:  # the tier was removed (a closed pipeline's decoded pixels): drop it
                    logger.debug("raying cache %s: removed, entry dropped", self.name)
        with self._lock:
            conn = self._db()
            with _write(conn, self._lock_fd()):
                failed = [(d,) for d, _ in admit if d not in written]
                conn.executemany("DELETE FROM entries WHERE digest = ? AND ready = 0", failed)
                for d in written:
                    cur = conn.execute("UPDATE entries SET ready = 1 WHERE digest = ? AND "
                                       "ready = 0", (d,))
                    if not cur.rowcount:  # our stale reservation was taken back: not ours now
                        unlink(self._path(d))
        return len(written), evicted

    def _reserve(self, cands: dict[str, tuple[int, float]],
                 payloads: Sequence[bytes | memoryview], crcs: Sequence[int] | None
                 ) -> tuple[list[tuple[str, int]], int]:
        """Choose admissions and victims, delete the victims, insert pending rows."""
        with self._lock:
            conn = self._db()
            with _write(conn, self._lock_fd()):
                present: set[str] = set()
                for part in _chunks(sorted(cands)):
                    q = f"SELECT digest FROM entries WHERE digest IN ({_marks(part)})"
                    present.update(d for (d,) in conn.execute(q, part))
                order = [d for d in cands if d not in present]
                if self.policy == "priority":
                    order.sort(key=lambda d: -cands[d][1])
                sizes = {d: entry_bytes(len(payloads[cands[d][0]])) for d in order}
                clock = self._clock(conn)
                held = self._held_draws()
                if held:  # this process's missed lookups, held back
                    clock += held
                    conn.execute("UPDATE meta SET v = ? WHERE k = 'clock'", (clock,))
                used = conn.execute("SELECT COALESCE(SUM(nbytes), 0) FROM entries").fetchone()[0]
                need = used + sum(sizes.values()) - self.capacity
                victims = self._victims(conn, clock, need) if need > 0 else iter(())
                admit: list[tuple[str, int]] = []
                evict = []
                for d in order:
                    k, score = cands[d]
                    while used + sizes[d] > self.capacity:
                        v = next(victims, None)
                        if v is None or (self.policy == "priority" and v[2] >= score):
                            break
                        evict.append(v)
                        used -= v[1]
                    if used + sizes[d] > self.capacity:
                        break
                    admit.append((d, int(crcs[k]) if crcs is not None
                                  else zlib.crc32(payloads[k])))
                    used += sizes[d]
                for d, _, _ in evict:  # before commit: no one can use the room before it is free
                    unlink(self._path(d))
                conn.executemany("DELETE FROM entries WHERE digest = ?",
                                 [(d,) for d, _, _ in evict])
                now = time.time()
                conn.executemany("INSERT INTO entries VALUES (?, ?, ?, ?, ?, ?, 0)",
                                 [(d, sizes[d], crc, cands[d][1], clock, now)
                                  for d, crc in admit])
            self._deferred_draws -= held  # written (a rolled-back write keeps them held)
        return admit, len(evict)

    def _victims(self, conn: sqlite3.Connection, clock: int, need: int
                 ) -> Iterator[tuple[str, int, float]]:
        """Entries in eviction order, enough to free ``need`` bytes (fetched before deletes).

        Pending rows are never victims unless stale (their writer died): those go first.
        """
        stale = time.time() - DEFAULT_CACHE_PENDING_S
        if self.policy == "priority":
            q = ("SELECT digest, nbytes, CASE WHEN ready THEN MIN(score, ? / (? - seen + 1.0)) "
                 "ELSE -1.0 END AS eff FROM entries WHERE ready = 1 OR born < ? "
                 "ORDER BY eff ASC")
            cur = conn.execute(q, (self.decay, clock, stale))
        else:
            cur = conn.execute("SELECT digest, nbytes, CASE WHEN ready THEN seen ELSE -1 END AS "
                               "s FROM entries WHERE ready = 1 OR born < ? ORDER BY s ASC, "
                               "born ASC", (stale,))
        out, freed = [], 0
        for row in cur:
            out.append(row)
            freed += row[1]
            if freed >= need:
                break
        cur.close()
        return iter(out)

    # -- upkeep --------------------------------------------------------------------------------
    def _clock(self, conn: sqlite3.Connection) -> int:
        return conn.execute("SELECT v FROM meta WHERE k = 'clock'").fetchone()[0]

    def used_bytes(self) -> int:
        """Bytes of entries the index holds."""
        with self._lock:
            conn = self._db()
            return conn.execute("SELECT COALESCE(SUM(nbytes), 0) FROM entries").fetchone()[0]

    def __len__(self) -> int:
        with self._lock:
            return self._db().execute("SELECT COUNT(*) FROM entries").fetchone()[0]

    def sweep_orphans(self, max_age_s: float = DEFAULT_CACHE_ORPHAN_AGE_S) -> int:
        """Delete entry and temp files without an index row older than ``max_age_s``."""
        with self._lock:
            known = {d for (d,) in self._db().execute("SELECT digest FROM entries")}
        removed, now = 0, time.time()
        for sub in os.listdir(self._data):
            folder = os.path.join(self._data, sub)
            if not os.path.isdir(folder):
                continue
            for name in os.listdir(folder):
                if name in known:
                    continue
                path = os.path.join(folder, name)
                with contextlib.suppress(OSError):
                    if now - os.stat(path).st_mtime > max_age_s:
                        os.unlink(path)
                        removed += 1
        return removed

    def _held_draws(self) -> int:
        """Draws this process holds back from the clock (under ``self._lock``)."""
        if self._deferred_pid != os.getpid():  # a forked child: the parent's are its own
            self._deferred_draws, self._deferred_pid = 0, os.getpid()
        return self._deferred_draws

    def close(self) -> None:
        """Write the draws this process held back, then close its index connection and lock
        file."""
        with self._lock:
            held = self._held_draws()
            if held and self._conn is not None and self._pid == os.getpid():
                try:
                    with _write(self._conn, self._lock_fd()):
                        clock = self._clock(self._conn) + held
                        self._conn.execute("UPDATE meta SET v = ? WHERE k = 'clock'", (clock,))
                    self._deferred_draws = 0
                except (sqlite3.Error, OSError):  # the tier removed or failing: aged no more
                    logger.debug("raying cache %s: held draws not written", self.name,
                                 exc_info=True)
            if self._conn is not None and self._pid == os.getpid():
                self._conn.close()
            if self._fd is not None and self._fd_pid == os.getpid():
                os.close(self._fd)
            self._conn, self._fd = None, None
