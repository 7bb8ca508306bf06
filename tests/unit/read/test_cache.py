"""Unit tests of the tiered cache (raying.read.cache.tiered): bounds, policies, corruption, processes."""

from __future__ import annotations

import hashlib
import multiprocessing
import os
import random
import sqlite3
import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pyarrow.fs as pafs
import pytest

from raying.errors import ConfigError
from raying.options import CacheConfig, IOConfig
from raying.read import fetch
from raying.read.cache.tiered import (
    CacheStats,
    DirTier,
    TieredCache,
    decode_array,
    encode_array,
    open_cache,
)
from raying.read.cache.tiered import entry_bytes as eb
from raying.storage import slow


def _dir_bytes(root: Path) -> int:
    total = 0
    for dirpath, _, names in os.walk(root / "data"):
        for n in names:
            try:
                total += os.stat(os.path.join(dirpath, n)).st_size
            except FileNotFoundError:  # deleted while we walked
                pass
    return total


def _files(root: Path) -> list[Path]:
    return [p for p in (root / "data").rglob("*") if p.is_file()]


def payload_of(key: str, size: int | None = None) -> bytes:
    """The bytes every process expects under ``key`` (sizes 300..2,300)."""
    h = hashlib.sha256(key.encode()).digest()
    n = size if size is not None else 300 + h[0] * 8
    return (h * (n // 32 + 1))[:n]


# --- bounds and policies ------------------------------------------------------------------------


def test_cache_never_exceeds_its_size(tmp_path):
    cap = 20_000
    tier = DirTier(str(tmp_path / "t"), cap, policy="priority")
    rng = random.Random(0)
    for step in range(60):
        keys = [f"k{rng.randrange(200)}" for _ in range(8)]
        tier.get_many(keys, [rng.random() for _ in keys])
        tier.put_many(keys, [payload_of(k) for k in keys], [rng.random() for _ in keys])
        assert tier.used_bytes() <= cap, step
        assert _dir_bytes(tmp_path / "t") <= cap, step
    assert tier.used_bytes() > cap // 2
    # An entry larger than the whole tier is never admitted.
    assert tier.put_many(["huge"], [b"x" * cap], [1.0]) == (0, 0)
    lru = DirTier(str(tmp_path / "l"), cap, policy="lru")
    for _ in range(60):
        keys = [f"k{rng.randrange(200)}" for _ in range(8)]
        lru.put_many(keys, [payload_of(k) for k in keys])
        assert _dir_bytes(tmp_path / "l") <= cap and lru.used_bytes() <= cap


def test_lru_evicts_the_least_recently_drawn(tmp_path):
    tier = DirTier(str(tmp_path), 3 * eb(100), policy="lru")
    for k in "abc":
        assert tier.put_many([k], [payload_of(k, 100)]) == (1, 0)
    found, _ = tier.get_many(["a"])  # a is drawn again: b is now the oldest
    assert list(found) == [0]
    assert tier.put_many(["d"], [payload_of("d", 100)]) == (1, 1)
    found, _ = tier.get_many(["a", "b", "c", "d"])
    assert sorted(found) == [0, 2, 3]


def test_priority_evicts_the_lowest_and_admits_only_what_beats_it(tmp_path):
    tier = DirTier(str(tmp_path), 3 * eb(100), policy="priority", decay_reads=1e9)
    tier.put_many(list("abc"), [payload_of(k, 100) for k in "abc"], [0.5, 0.1, 0.3])
    assert tier.put_many(["d"], [payload_of("d", 100)], [0.2]) == (1, 1)  # b (0.1) goes
    assert tier.put_many(["e"], [payload_of("e", 100)], [0.05]) == (0, 0)  # below all
    found, _ = tier.get_many(list("abcde"), draws=0)
    assert sorted(found) == [0, 2, 3]
    # Candidates are offered from the highest: y (0.9) takes d's (0.2) room; x (0.25) would
    # have to evict c (0.3) and is refused.
    assert tier.put_many(["x", "y"], [payload_of("x", 100), payload_of("y", 100)],
                         [0.25, 0.9]) == (1, 1)
    found, _ = tier.get_many(list("acdxy"), draws=0)
    assert sorted(found) == [0, 1, 4]


def test_priority_forgets_entries_that_stop_being_drawn(tmp_path):
    tier = DirTier(str(tmp_path), 2 * eb(100), policy="priority", decay_reads=2.0)
    tier.put_many(["hot", "was-hot"], [payload_of("hot", 100), payload_of("was-hot", 100)],
                  [0.5, 0.6])
    for _ in range(10):  # 1,000 draws in which "hot" is drawn and "was-hot" never
        tier.get_many(["hot"], [0.5], draws=100)
    # "was-hot" may expect at most 2 reads per 1,000 draws now: a 0.01 newcomer beats it.
    assert tier.put_many(["new"], [payload_of("new", 100)], [0.01]) == (1, 1)
    found, _ = tier.get_many(["hot", "was-hot", "new"])
    assert sorted(found) == [0, 2]



@pytest.mark.parametrize("lookups", [10, 30])  # under and over what a process holds back
def test_draws_of_lookups_that_miss_age_the_entries_too(tmp_path, lookups):
    """A lookup that finds nothing writes its draws to the clock later (with the process's
    next write of the index), but it does write them: entries not drawn meanwhile age."""
    tier = DirTier(str(tmp_path), 2 * eb(100), policy="priority", decay_reads=2.0)
    tier.put_many(["a", "b"], [payload_of("a", 100), payload_of("b", 100)], [0.5, 0.6])

    def clock():
        with sqlite3.connect(str(tmp_path / "index.sqlite")) as conn:
            return conn.execute("SELECT v FROM meta WHERE k = 'clock'").fetchone()[0]

    for k in range(lookups):
        assert tier.get_many([f"absent{k}"], [0.1], draws=100) == ({}, 0)
    # held back, not written, while under the limit (1,024 draws), then written with the
    # lookup that would pass it: 10 lookups write nothing; 30 write at the 11th and 22nd
    assert clock() == {10: 0, 30: 2_200}[lookups]
    # a and b may expect at most 2 reads per 1,000 draws now: a 0.01 newcomer beats them
    assert tier.put_many(["new"], [payload_of("new", 100)], [0.01]) == (1, 1)
    assert clock() == lookups * 100  # the put wrote what was held
    for k in range(3):
        tier.get_many([f"absent-again{k}"], draws=10)
    tier.close()
    assert clock() == lookups * 100 + 30  # and the close
    fresh = DirTier(str(tmp_path / "fresh"), 2 * eb(100), policy="priority", decay_reads=2.0)
    fresh.put_many(["a", "b"], [payload_of("a", 100), payload_of("b", 100)], [0.5, 0.6])
    assert fresh.put_many(["new"], [payload_of("new", 100)], [0.01]) == (0, 0)  # not aged

def _two_tiers_filled(tmp_path, memory_entries: int, namespace: str):
    """A synchronous LRU memory + disk cache with four 1,000-byte entries offered to it."""
    cfg = CacheConfig(memory_bytes=memory_entries * eb(1000), memory_dir=str(tmp_path / "m"),
                      disk_bytes=10 * eb(1000), disk_dir=str(tmp_path / "d"), policy="lru",
                      background_writes=False)
    cache = TieredCache(cfg, namespace=namespace)
    keys = [f"f{i}" for i in range(4)]
    cache.put_many(keys, [payload_of(k, 1000) for k in keys])
    return cache, keys


def test_tiers_serve_in_order_and_promote(tmp_path):
    cache, keys = _two_tiers_filled(tmp_path, 2, "ds")
    stats = CacheStats()
    got = cache.get_many(keys, stats=stats)
    assert [bytes(g) for g in got] == [payload_of(k, 1000) for k in keys]
    assert stats.hits == {"memory": 2, "disk": 2}
    assert stats.admitted["memory"] == 2  # the disk hits were promoted (LRU admits)
    again = CacheStats()
    cache.get_many(keys[2:], stats=again)
    assert again.hits == {"memory": 2}
    assert again.account()["cache_hits_memory"] == 2 and again.hit_ratio("memory") == 1.0
    assert cache.used_bytes() == {"memory": 2 * eb(1000), "disk": 4 * eb(1000)}


@pytest.mark.parametrize("error", [sqlite3.OperationalError("database or disk is full"),
                                   OSError(28, "No space left on device"),
                                   PermissionError(1, "Operation not permitted")])
def test_a_failing_tier_is_read_around_and_counted(tmp_path, error, caplog):
    """A full or read-only filesystem under a tier makes its lookups misses and skips its
    writes (counted, warned once), while the other tier keeps serving: no read fails."""
    cache, keys = _two_tiers_filled(tmp_path, 4, "full")
    memory = dict(cache.tiers)["memory"]

    def fail(*args, **kwargs):
        raise error

    memory.get_many = fail
    memory.put_many = fail
    stats = CacheStats()
    with caplog.at_level("WARNING"):
        got = cache.get_many(keys, stats=stats)
        cache.get_many(keys, stats=stats)
        cache.put_many(["new"], [payload_of("new", 1000)], stats=stats)
    assert [bytes(g) for g in got] == [payload_of(k, 1000) for k in keys]  # from the disk
    assert stats.hits == {"disk": 8} and stats.failed == 5  # 2 lookups, 2 promotions, 1 put
    assert stats.account()["cache_failed"] == stats.failed
    warned = [r.getMessage() for r in caplog.records if "tier at" in r.getMessage()]
    assert len(warned) == 2, warned  # once per operation, not per call
    assert "reading around it" in warned[0] and str(tmp_path / "m") in warned[0]


def test_background_writes_fill_the_cache_without_blocking(tmp_path, monkeypatch):
    cfg = CacheConfig(memory_bytes=10**6, memory_dir=str(tmp_path / "m"))
    cache = TieredCache(cfg, namespace="bg")
    keys = [f"f{i}" for i in range(5)]
    cache.put_many(keys, [payload_of(k, 1000) for k in keys], [0.5] * 5)
    assert cache.flush(timeout_s=30)
    assert cache.take_background_stats().admitted == {"memory": 5}
    assert cache.take_background_stats().admitted == {}  # reported once
    assert [bytes(g) for g in cache.get_many(keys)] == [payload_of(k, 1000) for k in keys]
    # While the writer is behind, offers past the queue's bound are dropped and counted
    # (an offer to an empty queue is always taken).
    monkeypatch.setattr(cache, "_queue_limit", 1500)
    gate = threading.Event()
    slow_offer = cache._offer
    monkeypatch.setattr(cache, "_offer", lambda *a, **k: (gate.wait(10), slow_offer(*a, **k)))
    cache.put_many(["g0", "g1"], [payload_of("g0", 1000), payload_of("g1", 1000)])
    cache.put_many(["g2"], [payload_of("g2", 1000)])
    gate.set()
    assert cache.flush(timeout_s=30)
    stats = cache.take_background_stats()
    assert stats.dropped == 1 and stats.admitted == {"memory": 2}
    # Entries from slow storage may wait for room (wait_s) instead: the writer catches up
    # and nothing is dropped.
    gate.clear()
    cache.put_many(["h0", "h1"], [payload_of("h0", 1000), payload_of("h1", 1000)])
    threading.Timer(0.3, gate.set).start()
    cache.put_many(["h2"], [payload_of("h2", 1000)], wait_s=30)
    assert cache.flush(timeout_s=30)
    stats = cache.take_background_stats()
    assert stats.dropped == 0 and stats.admitted == {"memory": 3}


def test_namespaces_keep_datasets_apart(tmp_path):
    cfg = CacheConfig(memory_bytes=10**6, memory_dir=str(tmp_path), background_writes=False)
    a, b = TieredCache(cfg, namespace="a"), TieredCache(cfg, namespace="b")
    a.put_many(["k"], [b"from a"])
    assert b.get_many(["k"]) == [None]
    assert bytes(a.get_many(["k"])[0]) == b"from a"


def test_decoded_arrays_round_trip(tmp_path):
    import time

    from raying.read.decoded_cache import DecodedCache

    cache = DecodedCache(str(tmp_path / "pipe"), 10**6, namespace="ds")
    arr = np.arange(2 * 3 * 3, dtype=np.uint8).reshape(2, 3, 3)
    cache.put([7], [arr])
    deadline = time.monotonic() + 10
    while cache.get(np.array([7]))[0] is None and time.monotonic() < deadline:
        time.sleep(0.05)  # entries are written by the tier's background writer
    out = cache.get(np.array([7, 8]))
    assert np.array_equal(out[0], arr) and out[0].dtype == np.uint8 and out[1] is None
    assert np.array_equal(decode_array(encode_array(arr.astype(np.float32))), arr)


def test_cache_config_validation_names_the_argument(tmp_path):
    with pytest.raises(ConfigError, match=r"CacheConfig\(policy=...\) must be one of"):
        CacheConfig(policy="fifo")
    with pytest.raises(ConfigError, match=r"CacheConfig\(disk_bytes=10\) needs disk_dir"):
        CacheConfig(disk_bytes=10)
    with pytest.raises(ConfigError, match=r"CacheConfig\(memory_bytes=...\) must be an integer"):
        CacheConfig(memory_bytes=-1)
    # A folder permissions allow (root) but where no file can be made: refused when built.
    with pytest.raises(ConfigError, match=r"CacheConfig\(disk_dir='/proc'\)(: cannot write a "
                                          r"file there| is not writable by this user)"):
        CacheConfig(disk_bytes=2**20, disk_dir="/proc").check_dirs()
    CacheConfig(disk_bytes=2**20, disk_dir=str(tmp_path / "ok")).check_dirs()
    assert list((tmp_path / "ok").iterdir()) == []  # the probe file is gone


# --- corruption ---------------------------------------------------------------------------------


def _entry_file(root: Path) -> Path:
    (path,) = [p for p in _files(root) if not p.name.endswith(".tmp")]
    return path


@pytest.mark.parametrize("damage", ["flip", "truncate", "header", "empty"])
def test_a_corrupt_entry_is_detected_and_dropped(tmp_path, damage):
    tier = DirTier(str(tmp_path), 10_000)
    tier.put_many(["k"], [payload_of("k", 1000)], [1.0])
    path = _entry_file(tmp_path)
    data = bytearray(path.read_bytes())
    if damage == "flip":
        data[500] ^= 0xFF
    elif damage == "truncate":
        data = data[:700]
    elif damage == "header":
        data[4:8] = (zlib.crc32(b"other")).to_bytes(4, "little")
    else:
        data = bytearray()
    path.write_bytes(bytes(data))
    found, corrupt = tier.get_many(["k"])
    assert found == {} and corrupt == 1
    assert len(tier) == 0 and not path.exists()


def test_a_large_entry_is_checksummed_once_until_its_file_changes(tmp_path):
    from raying.read.cache import entry as _entry

    tier = DirTier(str(tmp_path), 10**7)
    big = payload_of("big", _entry.MMAP_MIN_BYTES * 2)  # read through mmap
    tier.put_many(["k"], [big], [1.0])
    path = _entry_file(tmp_path)
    calls = []
    real = zlib.crc32

    def counting(data, *args):
        calls.append(len(data))
        return real(data, *args)

    _entry._VERIFIED.clear()
    _entry.zlib.crc32 = counting
    try:
        for _ in range(3):
            found, corrupt = tier.get_many(["k"])
            assert bytes(found[0]) == big and corrupt == 0
        assert calls == [len(big)]  # the first read checks the payload, later reads skip it
        data = bytearray(path.read_bytes())
        data[-10] ^= 0xFF  # damaged in place, same size: a new mtime, so checked again
        path.write_bytes(bytes(data))
        os.utime(path, ns=(time.time_ns(), time.time_ns() + 10**9))
        found, corrupt = tier.get_many(["k"])
        assert found == {} and corrupt == 1 and len(calls) == 2
    finally:
        _entry.zlib.crc32 = real


def test_a_corrupt_cache_file_is_refetched_and_nothing_wrong_is_served(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    paths = []
    for i in range(3):
        (src / f"{i}.jpg").write_bytes(payload_of(f"img{i}", 5000))
        paths.append(str(src / f"{i}.jpg"))
    fs = slow.slow_filesystem(pafs.LocalFileSystem(), (0.0, None))
    io = IOConfig(cache=CacheConfig(memory_bytes=10**6, memory_dir=str(tmp_path / "mem"),
                                    background_writes=False))
    first, acc1 = fetch.fetch_files(fs, paths, io=io, scores=[0.1, 0.2, 0.3], namespace="n")
    assert acc1["io_requests"] == 3 and acc1["cache_admitted_memory"] == 3
    for f in _files(tmp_path / "mem"):  # damage every cached entry in a different way
        data = bytearray(f.read_bytes())
        data[len(data) // 2] ^= 0x01
        f.write_bytes(bytes(data))
    second, acc2 = fetch.fetch_files(fs, paths, io=io, scores=[0.1, 0.2, 0.3], namespace="n")
    assert [bytes(d) for d in second] == [Path(p).read_bytes() for p in paths]
    assert acc2["cache_corrupt"] == 3 and acc2["cache_hits_memory"] == 0
    assert acc2["io_requests"] == 3 and acc2["cache_admitted_memory"] == 3
    third, acc3 = fetch.fetch_files(fs, paths, io=io, scores=[0.1, 0.2, 0.3], namespace="n")
    assert acc3["cache_hits_memory"] == 3 and acc3["io_requests"] == 0
    assert [bytes(d) for d in third] == [Path(p).read_bytes() for p in paths]


def test_orphans_of_a_crashed_writer_are_swept(tmp_path):
    tier = DirTier(str(tmp_path), 10_000)
    tier.put_many(["k"], [payload_of("k", 100)])
    stray = tmp_path / "data" / "ab" / ("ab" + "0" * 38)
    stray.write_bytes(b"left by a writer that died")
    temp = tmp_path / "data" / "cd" / "cdx.1234.tmp"
    temp.write_bytes(b"partial")
    assert tier.sweep_orphans(max_age_s=0.0) == 2
    assert not stray.exists() and not temp.exists()
    assert sorted(tier.get_many(["k"])[0]) == [0]


# --- processes sharing one directory ------------------------------------------------------------

_CAP = 40_000


def _hammer(root: str, seed: int, rounds: int, policy: str) -> tuple[int, int, int]:
    """A worker process: random gets (verified byte for byte) and puts on a shared tier."""
    tier = DirTier(root, _CAP, policy=policy)
    rng = random.Random(seed)
    hits = wrong = puts = 0
    for _ in range(rounds):
        keys = list({f"k{rng.randrange(120)}" for _ in range(10)})
        scores = [rng.random() for _ in keys]
        found, _ = tier.get_many(keys, scores)
        for j, payload in found.items():
            hits += 1
            wrong += bytes(payload) != payload_of(keys[j])
        miss = [j for j in range(len(keys)) if j not in found]
        admitted, _ = tier.put_many([keys[j] for j in miss],
                                    [payload_of(keys[j]) for j in miss],
                                    [scores[j] for j in miss])
        puts += admitted
    return hits, wrong, puts


@pytest.mark.parametrize("policy", ["priority", "lru"])
def test_processes_sharing_a_directory_corrupt_nothing(tmp_path, policy):
    root = tmp_path / "shared"
    DirTier(str(root), _CAP, policy=policy)  # create it once, as a node's first worker does
    seen_max = [0]
    stop = threading.Event()

    def watch():
        # Files change only inside a writer's index transaction (victims deleted before new
        # files are written); holding the write lock while walking gives a true snapshot.
        conn = sqlite3.connect(root / "index.sqlite", timeout=60, isolation_level=None)
        while not stop.is_set():
            conn.execute("BEGIN IMMEDIATE")
            seen_max[0] = max(seen_max[0], _dir_bytes(root))
            conn.execute("ROLLBACK")
            time.sleep(0.01)
        conn.close()

    watcher = threading.Thread(target=watch)
    watcher.start()
    ctx = multiprocessing.get_context("spawn")
    try:
        with ctx.Pool(4) as pool:
            results = pool.starmap(_hammer, [(str(root), s, 80, policy) for s in range(4)])
    finally:
        stop.set()
        watcher.join()
    hits = sum(r[0] for r in results)
    assert sum(r[1] for r in results) == 0  # every hit byte-identical to what was put
    assert hits > 50 and sum(r[2] for r in results) > 30
    assert seen_max[0] <= _CAP
    # The index and the files agree: every row has its intact file, no file lacks a row.
    tier = DirTier(str(root), _CAP, policy=policy)
    assert tier.used_bytes() <= _CAP
    keys = [f"k{i}" for i in range(120)]
    found, corrupt = tier.get_many(keys)
    assert corrupt == 0 and len(found) == len(tier)
    assert all(bytes(found[j]) == payload_of(keys[j]) for j in found)
    assert len([p for p in _files(root) if not p.name.endswith(".tmp")]) == len(tier)
    assert not [p for p in _files(root) if p.name.endswith(".tmp")]


def _open_and_use(root: str, seed: int) -> int:
    tier = DirTier(root, _CAP)
    key = f"opener-{seed}"
    tier.put_many([key], [payload_of(key)], [1.0])
    return len(tier.get_many([key])[0])


def test_processes_and_threads_opening_a_new_tier_together(tmp_path):
    root = str(tmp_path / "fresh")  # not created beforehand: all race to create the index
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(4) as pool:
        assert pool.starmap(_open_and_use, [(root, s) for s in range(8)]) == [1] * 8
    cfg = CacheConfig(memory_bytes=10**6, memory_dir=str(tmp_path / "threads"))
    with ThreadPoolExecutor(8) as ex:
        caches = list(ex.map(lambda _: open_cache(cfg, namespace="t"), range(8)))
    assert all(c is caches[0] for c in caches)



def test_a_damaged_index_is_set_aside_and_the_tier_starts_empty(tmp_path, caplog):
    root = tmp_path / "t"
    tier = DirTier(str(root), 1_000_000, policy="lru")
    keys = [f"k{i}" for i in range(5)]
    tier.put_many(keys, [payload_of(k) for k in keys])
    assert len(tier.get_many(keys)[0]) == 5
    tier.close()
    for name in ("index.sqlite-wal", "index.sqlite-shm"):
        (root / name).unlink(missing_ok=True)
    (root / "index.sqlite").write_bytes(b"this is not a database" * 100)
    with caplog.at_level("WARNING"):
        again = DirTier(str(root), 1_000_000, policy="lru")
    assert "index was damaged" in caplog.text and str(root) in caplog.text
    assert list(root.glob("index.sqlite.damaged-*"))
    assert again.get_many(keys)[0] == {}, "nothing is served without an index"
    again.put_many(keys[:2], [payload_of(k) for k in keys[:2]])
    found = again.get_many(keys[:2])[0]
    assert [bytes(found[k]) for k in (0, 1)] == [payload_of(k) for k in keys[:2]]
    again.sweep_orphans(max_age_s=0)
    assert again.used_bytes() == _dir_bytes(root) > 0  # the old entries are gone


def test_a_tier_removed_between_runs_is_made_again_in_a_process_that_outlives_them(tmp_path):
    """docs/io.md: free a tier by removing its directory when no run uses it. A Ray worker
    keeps its opened tiers: the next run's open_cache makes the tier again (it dropped every
    entry for the rest of the process, silently), for every namespace on it; a decoded
    cache's removed directory (a closed pipeline's) stays removed."""
    import shutil

    root = tmp_path / "tier"
    config = CacheConfig(memory_bytes=1 << 20, memory_dir=str(root), background_writes=False)
    first = open_cache(config, namespace="a", reopen_removed=True)
    other = open_cache(config, namespace="b", reopen_removed=True)
    first.put_many(["k"], [payload_of("k")], [1.0])
    assert bytes(first.get_many(["k"])[0]) == payload_of("k")
    shutil.rmtree(root)
    for namespace, old in (("a", first), ("b", other)):
        again = open_cache(config, namespace=namespace, reopen_removed=True)
        assert again is not old and root.is_dir()
        key = f"k-{namespace}"
        again.put_many([key], [payload_of(key)], [1.0])
        assert bytes(again.get_many([key])[0]) == payload_of(key)
        assert open_cache(config, namespace=namespace, reopen_removed=True) is again
    assert len(_files(root)) == 2  # both in the tier made again, both indexed
    decoded = CacheConfig(memory_bytes=1 << 20, memory_dir=str(tmp_path / "decoded"),
                          background_writes=False)
    kept = open_cache(decoded, namespace="d")
    shutil.rmtree(tmp_path / "decoded")
    assert open_cache(decoded, namespace="d") is kept
    assert not (tmp_path / "decoded").exists()


def test_a_tier_folder_this_node_cannot_use_is_read_around(tmp_path, caplog):
    """The driver checks a tier's folder on its own node; on another node the same path may
    be read-only, full or a file: the read there went down with a bare OSError at every
    epoch. The tier is left out on that node, once said, and the reads go on."""
    import logging

    from raying.options import CacheConfig
    from raying.read.cache.tiered import TieredCache

    (tmp_path / "a-file").write_text("x")
    bad = str(tmp_path / "a-file" / "tier")
    config = CacheConfig(memory_bytes=2**20, memory_dir=str(tmp_path / "mem"),
                         disk_bytes=2**20, disk_dir=bad)
    with caplog.at_level(logging.WARNING, logger="raying.read.cache.tiered"):
        cache = TieredCache(config)
        again = TieredCache(config)
    try:
        assert [name for name, _ in cache.tiers] == ["memory"]
        said = [r.getMessage() for r in caplog.records]
        assert len(said) == 1 and f"the disk tier at {bad} cannot be used on this node" in said[0]
        cache.put_many(["k"], [b"payload"])
        cache.flush()
        assert bytes(cache.get_many(["k"])[0]) == b"payload"
    finally:
        cache.close()
        again.close()


@pytest.mark.parametrize("error", [sqlite3.OperationalError("database or disk is full"),
                                   OSError(28, "No space left on device")])
def test_claims_on_a_full_index_fetch_everything_and_are_counted(tmp_path, error, caplog):
    """Single flight's claims live in the first tier's index: on a full or read-only one,
    a read of slow storage fetches every miss itself (it failed the read task before)."""
    from raying.read.fetch import fetch_missing

    cfg = CacheConfig(memory_bytes=10 * eb(1000), memory_dir=str(tmp_path / "m"),
                      background_writes=False)
    cache = TieredCache(cfg, namespace="claims")

    def fail(*args, **kwargs):
        raise error

    cache._flight.claim = fail
    cache._flight.release = fail
    cache._flight.wait_shared = fail
    keys = [f"f{i}" for i in range(4)]
    got: list = [None] * 4
    stats = CacheStats()
    with caplog.at_level("WARNING"):
        shared = fetch_missing(cache, keys, [0, 1, 2, 3], got, None,
                               lambda idx: [payload_of(keys[i], 1000) for i in idx],
                               stats=stats, share=True)
    assert shared == 0 and [bytes(g) for g in got] == [payload_of(k, 1000) for k in keys]
    assert stats.failed >= 1 and cache.stats.failed >= 1
    assert any("failed a claim" in r.getMessage() for r in caplog.records)
    assert cache.wait_shared(keys, stats=stats) == [None] * 4
    cache.release(keys, "someone", stats=stats)  # said once, never raised


def test_a_tier_whose_index_cannot_open_is_left_out(tmp_path, monkeypatch, caplog):
    """A node whose tier folder is full when its index opens (sqlite cannot make its WAL
    files) reads around that tier instead of failing every read."""
    import raying.read.cache.tiered as tiered

    def fail(*args, **kwargs):
        raise sqlite3.OperationalError("disk I/O error")

    monkeypatch.setattr(tiered, "_tier", fail)
    with caplog.at_level("WARNING"):
        cache = TieredCache(CacheConfig(memory_bytes=10 * eb(1000),
                                        memory_dir=str(tmp_path / "m")), namespace="open")
    assert cache.tiers == []
    assert cache.get_many(["a"]) == [None]
