"""SQLite helpers of the cache tiers' index: write transactions under a writers' flock."""

from __future__ import annotations

import contextlib
import sqlite3
import time
from collections.abc import Iterator

from raying.options import DEFAULT_CACHE_LOCK_TIMEOUT_S

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows: SQLite's own locking alone
    fcntl = None  # type: ignore[assignment]

# SQLite's default limit on host parameters per statement is 999 (older builds).
_SQL_CHUNK = 500


@contextlib.contextmanager
def _write(conn: sqlite3.Connection, lock_fd: int | None) -> Iterator[None]:
    """One write transaction; the lock is taken at BEGIN so the decisions inside hold.

    Writers first queue on an flock of the tier's lock file: the kernel wakes the next one
    the moment the lock frees, where SQLite's own busy handler polls with sleeps of up to
    100 ms once several processes contend.
    """
    if lock_fd is not None:
        fcntl.flock(lock_fd, fcntl.LOCK_EX)
    try:
        conn.execute("BEGIN IMMEDIATE")
        try:
            yield
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        conn.execute("COMMIT")
    finally:
        if lock_fd is not None:
            fcntl.flock(lock_fd, fcntl.LOCK_UN)


def _retry_locked(call, lock_fd: int | None) -> None:
    """Run ``call`` under the writers' flock, retrying while SQLite reports a lock.

    Switching a new index to WAL needs the database to itself; processes opening the tier at
    the same moment (Ray workers starting together) take turns instead of failing.
    """
    deadline = time.monotonic() + DEFAULT_CACHE_LOCK_TIMEOUT_S
    delay = 0.001
    while True:
        if lock_fd is not None:
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
        try:
            call()
            return
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) or time.monotonic() > deadline:
                raise
        finally:
            if lock_fd is not None:
                fcntl.flock(lock_fd, fcntl.LOCK_UN)
        time.sleep(delay)
        delay = min(0.05, delay * 2)


def _chunks(items: list[str]) -> Iterator[list[str]]:
    for i in range(0, len(items), _SQL_CHUNK):
        yield items[i:i + _SQL_CHUNK]


def _marks(part: list[str]) -> str:
    return ",".join("?" * len(part))
