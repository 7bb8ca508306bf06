"""Single flight in the cache (raying.read.cache.inflight): a file being fetched is not fetched twice.

Two readers (threads of one process, or processes of a node) that miss the same files at the
same time: the second waits for the first's read instead of going to slow storage again.
What an owner leaves (not admitted, failed, died) the waiter fetches itself, at once.
"""

from __future__ import annotations

import dataclasses
import hashlib
import multiprocessing
import os
import threading
import time
from pathlib import Path

import pyarrow.fs as pafs
import pytest

from raying.options import DEFAULT_CACHE_INFLIGHT_S, CacheConfig, IOConfig
from raying.read import fetch
from raying.read.cache.dirtier import DirTier
from raying.read.cache.inflight import InflightClaims
from raying.read.cache.tiered import open_cache
from raying.storage import slow

LATENCY_S = 0.3  # per request of the owner's reads: the waiter arrives while they run


def _files(root: Path, n: int, size: int = 4000) -> list[str]:
    root.mkdir(parents=True, exist_ok=True)
    out = []
    for i in range(n):
        p = root / f"{i:03d}.jpg"
        h = hashlib.sha256(str(p).encode()).digest()
        p.write_bytes((h * (size // 32 + 1))[:size])
        out.append(str(p))
    return out


def _io(tmp: Path, *, memory_bytes: int = 10**6, background: bool = True) -> IOConfig:
    return IOConfig(cache=CacheConfig(memory_bytes=memory_bytes, memory_dir=str(tmp / "mem"),
                                      background_writes=background), concurrency=2)


def _claimed(tmp: Path) -> int:
    tier = DirTier(str(tmp / "mem"), 10**6)
    with tier._lock:
        return tier._db().execute("SELECT COUNT(*) FROM inflight").fetchone()[0]


def _wait_for_claims(tmp: Path, n: int, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while _claimed(tmp) < n:
        assert time.monotonic() < deadline, "the owner never claimed its misses"
        time.sleep(0.005)


def _fetch_in_thread(fs, paths, io, out: dict) -> threading.Thread:
    def go() -> None:
        out["datas"], out["account"] = fetch.fetch_files(fs, paths, io=io,
                                                         scores=[0.5] * len(paths),
                                                         namespace="ns")
    t = threading.Thread(target=go)
    t.start()
    return t


def _owner_waits_for_a_waiter(tmp_path: Path, monkeypatch) -> pafs.FileSystem:
    """A filesystem whose reads wait until a thread of this process waits on claims (the
    gate file): the owner's reads, ~0.3 s, must not end before the waiter, a thread started
    after them, comes to find the claims (on a loaded machine it may come later)."""
    from raying.read.cache.inflight import SingleFlight

    gate = str(tmp_path / "waiting")
    wait_shared = SingleFlight.wait_shared

    def announced(self, *args, **kwargs):
        Path(gate).touch()
        return wait_shared(self, *args, **kwargs)

    monkeypatch.setattr(SingleFlight, "wait_shared", announced)
    return pafs.PyFileSystem(_GatedHandler(pafs.LocalFileSystem(),
                                           slow.coerce_tier((LATENCY_S, None)), gate))


@pytest.mark.parametrize("background", [True, False])
def test_threads_missing_the_same_files_fetch_each_once(tmp_path, background, monkeypatch):
    paths = _files(tmp_path / "src", 6)
    fs_a = _owner_waits_for_a_waiter(tmp_path, monkeypatch)
    fs_b = slow.slow_filesystem(pafs.LocalFileSystem(), (LATENCY_S, None))
    io = _io(tmp_path, background=background)
    a: dict = {}
    ta = _fetch_in_thread(fs_a, paths[:4], io, a)
    _wait_for_claims(tmp_path, 4)
    b: dict = {}
    tb = _fetch_in_thread(fs_b, paths[2:], io, b)  # 2 shared with a, 2 of its own
    ta.join()
    tb.join()
    requests = sum(slow.io_counters(f).snapshot()["requests"] for f in (fs_a, fs_b))
    assert requests == 6  # each distinct file once, not 8
    assert a["account"]["io_requests"] == 4 and b["account"]["io_requests"] == 2
    assert b["account"]["io_reads_shared"] == 2 and a["account"]["io_reads_shared"] == 0
    for datas, ps in ((a["datas"], paths[:4]), (b["datas"], paths[2:])):
        assert [bytes(d) for d in datas] == [Path(p).read_bytes() for p in ps]
    open_cache(io.cache, namespace="ns").flush()
    assert _claimed(tmp_path) == 0  # every claim released


class _GatedHandler(slow.SlowFileSystemHandler):
    """Reads wait until ``gate`` exists: the owner holds its claims until the waiter waits."""

    def __init__(self, base, tier, gate: str) -> None:
        super().__init__(base, tier)
        self.gate = gate

    def __reduce__(self):
        return (_GatedHandler, (self.base, self.tier, self.gate))

    def request(self, nbytes: int = 0, *, count: int = 1) -> None:
        deadline = time.monotonic() + 120
        while not os.path.exists(self.gate) and time.monotonic() < deadline:
            time.sleep(0.005)
        super().request(nbytes, count=count)


def _other_process(paths: list[str], mem: str, q, gate: str) -> None:
    from raying.read.cache.inflight import SingleFlight

    wait_shared = SingleFlight.wait_shared

    def announced(self, *args, **kwargs):  # the owner's reads start once we wait
        Path(gate).touch()
        return wait_shared(self, *args, **kwargs)

    SingleFlight.wait_shared = announced  # type: ignore[method-assign]
    fs = slow.slow_filesystem(pafs.LocalFileSystem(), (LATENCY_S, None))
    io = IOConfig(cache=CacheConfig(memory_bytes=10**6, memory_dir=mem), concurrency=2)
    datas, account = fetch.fetch_files(fs, paths, io=io, scores=[0.5] * len(paths),
                                       namespace="ns")
    q.put(([bytes(d) for d in datas], account, slow.io_counters(fs).snapshot()))


def test_a_process_waits_for_another_process_fetching_the_same_files(tmp_path):
    paths = _files(tmp_path / "src", 4)
    gate = str(tmp_path / "waiting")
    # the owner's reads wait for the other process to wait on its claims (a spawned process
    # takes seconds to start on a loaded machine: it must not find the entries already cached)
    fs = pafs.PyFileSystem(_GatedHandler(pafs.LocalFileSystem(),
                                         slow.coerce_tier((LATENCY_S, None)), gate))
    io = _io(tmp_path)
    a: dict = {}
    ta = _fetch_in_thread(fs, paths, io, a)
    _wait_for_claims(tmp_path, 4)
    ctx = multiprocessing.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_other_process, args=(paths, str(tmp_path / "mem"), q, gate))
    p.start()
    datas, account, counters = q.get(timeout=120)
    p.join(30)
    ta.join()
    assert counters["requests"] == 0 and account["io_reads_shared"] == 4
    assert datas == [Path(x).read_bytes() for x in paths]
    assert a["account"]["io_requests"] == 4


def test_claims_of_a_dead_owner_are_void(tmp_path):
    paths = _files(tmp_path / "src", 3)
    ctx = multiprocessing.get_context("spawn")
    dead = ctx.Process(target=time.sleep, args=(0,))
    dead.start()
    dead.join()
    io = _io(tmp_path)
    cache = open_cache(io.cache, namespace="ns")
    tier = cache.tiers[0][1]
    with tier._lock:  # claims left by a worker that was killed mid-fetch
        conn = tier._db()
        conn.executemany("INSERT INTO inflight VALUES (?, ?, ?, ?)",
                         [(d, "killed", dead.pid, time.time()) for d in
                          (tier_digest(cache, p) for p in paths)])
    assert _claimed(tmp_path) == 3
    fs = slow.slow_filesystem(pafs.LocalFileSystem(), (0.0, None))
    t0 = time.monotonic()
    datas, account = fetch.fetch_files(fs, paths, io=io, scores=[0.5] * 3, namespace="ns")
    assert time.monotonic() - t0 < DEFAULT_CACHE_INFLIGHT_S  # did not wait out the claims
    assert account["io_requests"] == 3 and account["io_reads_shared"] == 0
    assert [bytes(d) for d in datas] == [Path(p).read_bytes() for p in paths]


def tier_digest(cache, path: str) -> str:
    from raying.read.cache.entry import digest_of

    return digest_of(cache._keys([path])[0])


def test_what_the_owner_does_not_cache_the_waiter_fetches_itself(tmp_path):
    # A tier too small for any entry: the owner's admission is refused, its claims released.
    paths = _files(tmp_path / "src", 3, size=4000)
    fs = slow.slow_filesystem(pafs.LocalFileSystem(), (LATENCY_S, None))
    io = _io(tmp_path, memory_bytes=1000, background=False)
    a: dict = {}
    ta = _fetch_in_thread(fs, paths, io, a)
    _wait_for_claims(tmp_path, 3)
    b: dict = {}
    tb = _fetch_in_thread(fs, paths, io, b)
    ta.join()
    tb.join()
    assert [bytes(d) for d in b["datas"]] == [Path(p).read_bytes() for p in paths]
    assert a["account"]["io_requests"] == 3 and a["account"]["cache_admitted_memory"] == 0
    assert b["account"]["io_requests"] == 3 and b["account"]["io_reads_shared"] == 0


def test_a_failed_read_releases_its_claim_and_the_waiter_sees_its_own_error(tmp_path,
                                                                            monkeypatch):
    paths = _files(tmp_path / "src", 2)
    missing = str(tmp_path / "src" / "gone.jpg")
    fs_a = _owner_waits_for_a_waiter(tmp_path, monkeypatch)
    fs_b = slow.slow_filesystem(pafs.LocalFileSystem(), (LATENCY_S, None))
    io = _io(tmp_path)
    a: dict = {}
    ta = _fetch_in_thread(fs_a, [*paths, missing], io, a)
    _wait_for_claims(tmp_path, 3)
    b: dict = {}
    tb = _fetch_in_thread(fs_b, [missing, paths[0]], io, b)
    ta.join()
    tb.join()
    assert isinstance(a["datas"][2], BaseException) and isinstance(b["datas"][0], BaseException)
    assert "gone.jpg" in str(b["datas"][0])
    assert bytes(b["datas"][1]) == Path(paths[0]).read_bytes()
    assert b["account"]["io_reads_shared"] == 1
    open_cache(io.cache, namespace="ns").flush()
    assert _claimed(tmp_path) == 0


def test_local_files_take_no_claims(tmp_path, monkeypatch):
    paths = _files(tmp_path / "src", 2)
    io = _io(tmp_path, background=False)
    calls = []
    monkeypatch.setattr(InflightClaims, "claim", lambda self, keys, owner: calls.append(keys))
    _, account = fetch.fetch_files(pafs.LocalFileSystem(), paths, io=io, scores=[0.5] * 2,
                                   namespace="ns")
    assert account["io_requests"] == 2 and account["io_reads_shared"] == 0
    assert os.path.exists(tmp_path / "mem" / "index.sqlite") and calls == []
    fs = slow.slow_filesystem(pafs.LocalFileSystem(), (0.0, None))  # a slow tier does claim
    with pytest.raises(TypeError):  # the stub returns None where a list is due
        fetch.fetch_files(fs, [*paths, paths[0] + ".x"], io=io, scores=[0.5] * 3,
                          namespace="ns")
    assert len(calls) == 1


def _read_parquet_in_process(path: str, mem: str, q) -> None:
    from raying.read.parquet import read_chunks
    from raying.read.planner import OpStats

    stats = OpStats()
    io = IOConfig(cache=CacheConfig(memory_bytes=10**6, memory_dir=mem,
                                    background_writes=False))
    arrays = read_chunks(pafs.LocalFileSystem(), [(path, 0), (path, 2)], "image", io=io,
                         scores=[0.5, 0.5], namespace="pq", stats=stats)
    q.put(([a.to_pylist() for a in arrays], stats.requests))


def test_parquet_footers_and_chunks_are_shared_by_the_node_processes(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = str(tmp_path / "part.parquet")
    pq.write_table(pa.table({"id": list(range(40)),
                             "image": [bytes([i]) * (50 + i) for i in range(40)]}),
                   path, row_group_size=10)
    ctx = multiprocessing.get_context("spawn")
    results = []
    for _ in range(2):  # two fresh processes, one after the other, sharing one tier
        q = ctx.Queue()
        p = ctx.Process(target=_read_parquet_in_process, args=(path, str(tmp_path / "m"), q))
        p.start()
        results.append(q.get(timeout=120))
        p.join(30)
    (first, n1), (second, n2) = results
    want = pq.ParquetFile(path)
    assert first == second == [want.read_row_group(g, columns=["image"]).column(0).to_pylist()
                               for g in (0, 2)]
    assert n1 >= 2 and n2 == 0  # the second process asks storage for nothing, footer included


def test_threads_reading_the_same_row_groups_fetch_each_chunk_once(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from raying.read.parquet import footer, read_chunks
    from raying.read.planner import OpStats

    path = str(tmp_path / "part.parquet")
    pq.write_table(pa.table({"id": list(range(40)), "other": [b"z" * 500] * 40,
                             "image": [bytes([i]) * (50 + i) for i in range(40)]}),
                   path, row_group_size=10)
    fs = slow.slow_filesystem(pafs.LocalFileSystem(), (LATENCY_S, None))
    io = dataclasses.replace(_io(tmp_path), gap_bytes=0)  # one request per chunk
    footer(fs, path, namespace="pq")  # footers apart: this is about the chunks
    out: dict = {}

    def go(name: str, groups: list[int]) -> threading.Thread:
        def run() -> None:
            stats = OpStats()
            arrays = read_chunks(fs, [(path, g) for g in groups], "image", io=io,
                                 namespace="pq", stats=stats)
            out[name] = (arrays, stats.requests, stats.shared)
        t = threading.Thread(target=run)
        t.start()
        return t

    ta = go("a", [0, 2])
    _wait_for_claims(tmp_path, 2)
    tb = go("b", [2, 0, 3])
    ta.join()
    tb.join()
    want = pq.ParquetFile(path)
    for name, groups in (("a", [0, 2]), ("b", [2, 0, 3])):
        got = [a.to_pylist() for a in out[name][0]]
        assert got == [want.read_row_group(g, columns=["image"]).column(0).to_pylist()
                       for g in groups]
    assert out["a"][1] == 2 and out["b"][1] == 1  # b fetched only group 3 itself
    assert out["a"][2] == 0 and out["b"][2] == 2  # and says it took two from a's reads
