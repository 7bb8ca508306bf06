"""Unit tests of the read planner, tier profiles and planned reads (raying.io); no Ray."""

from __future__ import annotations

import threading
import time

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest

from raying.errors import ConfigError
from raying.options import CacheConfig, IOConfig
from raying.read import fetch, parquet, planner
from raying.read.planner import Piece, ReadOp
from raying.storage import slow, tiers
from raying.storage.files import NotFoundError


def _slots(ops):
    return [tuple(p.slot for p in op.pieces) for op in ops]


# --- planning (pure) -------------------------------------------------------------------------


def test_plan_files_reads_each_file_once_in_directory_order():
    paths = ["/d/b/2.jpg", "/d/a/9.jpg", "/d/b/1.jpg", "/d/a/9.jpg", "/d/a/10.jpg"]
    ops = planner.plan_files(paths)
    assert [op.path for op in ops] == ["/d/a/10.jpg", "/d/a/9.jpg", "/d/b/1.jpg", "/d/b/2.jpg"]
    assert _slots(ops) == [(4,), (1, 3), (2,), (0,)]
    assert all(op.offset is None and op.length is None for op in ops)
    assert len(planner.plan_files(paths, dedupe=False)) == 5


def test_coalesce_merges_ranges_closer_than_the_gap_and_orders_by_offset():
    ranges = [("f", 300, 100), ("f", 0, 100), ("f", 150, 100), ("f", 1000, 10),
              ("g", 0, 5)]
    ops = planner.coalesce_ranges(ranges, gap_bytes=50)
    assert [(op.path, op.offset, op.length) for op in ops] == [
        ("f", 0, 400), ("f", 1000, 10), ("g", 0, 5)]
    assert _slots(ops) == [(1, 2, 0), (3,), (4,)]
    assert ops[0].useful_bytes == 300  # the holes 100-150 and 250-300 are read through


def test_coalesce_respects_zero_gap_max_request_and_overlaps():
    ranges = [("f", 0, 100), ("f", 100, 100), ("f", 201, 10)]
    ops = planner.coalesce_ranges(ranges, gap_bytes=0)
    assert [(op.offset, op.length) for op in ops] == [(0, 200), (201, 10)]
    ops = planner.coalesce_ranges(ranges, gap_bytes=10, max_request_bytes=150)
    assert [(op.offset, op.length) for op in ops] == [(0, 100), (100, 111)]
    ops = planner.coalesce_ranges([("f", 0, 100), ("f", 50, 20), ("f", 0, 100)], gap_bytes=0)
    assert [(op.offset, op.length) for op in ops] == [(0, 100)]
    assert ops[0].useful_bytes == 100
    big = planner.coalesce_ranges([("f", 0, 500)], gap_bytes=0, max_request_bytes=100)
    assert [(op.offset, op.length) for op in big] == [(0, 500)]


def test_coalesce_rejects_bad_arguments():
    with pytest.raises(ConfigError, match="gap_bytes >= 0 and max_request_bytes >= 1"):
        planner.coalesce_ranges([("f", 0, 1)], gap_bytes=-1)
    with pytest.raises(ConfigError, match="range 0 of 'f' has offset -1"):
        planner.coalesce_ranges([("f", -1, 1)], gap_bytes=0)


def test_row_group_runs_join_adjacent_row_groups_of_a_file():
    groups = np.array([[1, 4, 0], [0, 2, 0], [0, 3, 0], [0, 7, 0], [1, 5, 0], [0, 2, 0],
                       [1, 7, 0]])
    assert planner.row_group_runs(groups) == [(0, [2, 3]), (0, [7]), (1, [4, 5]), (1, [7])]
    assert planner.row_group_runs(np.zeros((0, 3), np.int64)) == []


# --- tiers ------------------------------------------------------------------------------------


def test_tier_profiles_bound_concurrency_by_kind():
    assert tiers.profile_for(pafs.LocalFileSystem()).concurrency == 1
    hdd = tiers.profile_for(slow.slow_filesystem(pafs.LocalFileSystem(), "hdd"))
    s3 = tiers.profile_for(slow.slow_filesystem(pafs.LocalFileSystem(), "s3"))
    assert hdd.concurrency == 2
    assert s3.concurrency >= 32
    assert s3.concurrency > hdd.concurrency
    small = tiers.fill_concurrency(0.005, 50e6, request_bytes=2_000)
    large = tiers.fill_concurrency(0.005, 50e6, request_bytes=2_000_000)
    assert small == tiers.MAX_CONCURRENCY and large <= 4
    assert tiers.fill_concurrency(0.0, 50e6) == 1


# --- running requests ---------------------------------------------------------------------------


@pytest.fixture
def files(tmp_path):
    out = {}
    for name in ("a/1.bin", "a/2.bin", "b/3.bin"):
        p = tmp_path / name
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(bytes(range(256)) * 4)
        out[name] = str(p)
    return out


def test_run_ops_serves_every_piece_and_counts_requests(files):
    fs = slow.slow_filesystem(pafs.LocalFileSystem(), (0.0, None))
    path = files["a/1.bin"]
    ranges = [(path, 10, 5), (path, 20, 5), (path, 900, 3)]
    ops = planner.coalesce_ranges(ranges, gap_bytes=16)
    stats = planner.OpStats()
    out = planner.run_ops(fs, ops, 3, concurrency=4, stats=stats)
    data = bytes(range(256)) * 4
    assert [bytes(o) for o in out] == [data[10:15], data[20:25], data[900:903]]
    assert stats.requests == 2 and stats.bytes_fetched == 15 + 3
    assert slow.io_counters(fs).snapshot()["bytes_read"] == 18


def test_run_ops_failure_fills_only_its_slots(files):
    fs = pafs.LocalFileSystem()
    ops = [ReadOp(files["a/1.bin"], None, None, (Piece(0),)),
           ReadOp(files["a/1.bin"] + ".missing", None, None, (Piece(1), Piece(2)))]
    out = planner.run_ops(fs, ops, 3, concurrency=2, retries=1)
    assert isinstance(out[0], bytes)
    assert isinstance(out[1], NotFoundError) and out[2] is out[1]


def test_fetch_files_reads_repeats_once_and_keeps_order(files):
    fs = slow.slow_filesystem(pafs.LocalFileSystem(), (0.0, None))
    paths = [files["b/3.bin"], files["a/1.bin"], files["b/3.bin"], files["a/2.bin"]]
    datas, account = fetch.fetch_files(fs, paths, io=IOConfig())
    assert [bytes(d) for d in datas] == [open(p, "rb").read() for p in paths]
    assert account["io_requests"] == 3 and account["io_reads_deduped"] == 1
    assert account["io_bytes_fetched"] == 3 * 1024
    assert account["io_bytes_delivered"] == 4 * 1024
    assert slow.io_counters(fs).snapshot()["opens"] == 3


def test_read_samples_without_io_is_read_many(files):
    class Spec:
        io = None
        root = "/"

    paths = [files["a/1.bin"], files["a/1.bin"]]  # a repeat is read again: two requests
    datas, account = fetch.read_samples(Spec(), pafs.LocalFileSystem(), paths, None)
    assert account == {"io_requests": 2}
    assert bytes(datas[0]) == bytes(datas[1]) == open(files["a/1.bin"], "rb").read()


def test_summarize_gives_ratios():
    s = fetch.summarize({"io_bytes_fetched": 50, "io_bytes_delivered": 100, "io_requests": 4,
                         "cache_lookups": 10, "cache_hits_memory": 3, "cache_hits_disk": 2})
    assert s["read_amplification"] == 0.5 and s["io_requests"] == 4
    assert s["cache_hit_ratio"] == 0.5 and s["cache_hit_ratio_memory"] == 0.3
    assert set(fetch.ACCOUNT_KEYS) <= set(s)
    # Bytes read by requests no one counted (pyarrow's reads of Parquet without io): the
    # count is unknown, not 0; nothing read at all is 0.
    assert fetch.summarize({"io_bytes_fetched": 50})["io_requests"] is None
    assert fetch.summarize({})["io_requests"] == 0


# --- Parquet ------------------------------------------------------------------------------------


@pytest.fixture
def parquet_file(tmp_path):
    n = 800
    table = pa.table({"id": pa.array(np.arange(n)), "label": pa.array(np.arange(n) % 3),
                      "image": pa.array([bytes([i % 251]) * (200 + i) for i in range(n)]),
                      "path": pa.array([f"p{i}" for i in range(n)])})
    path = tmp_path / "part-0.parquet"
    pq.write_table(table, path, row_group_size=100, compression="none",
                   use_dictionary=["label"])
    return str(path)


def test_adjacent_row_groups_become_one_ranged_read(parquet_file):
    fs = slow.slow_filesystem(pafs.LocalFileSystem(), (0.0, None))
    io = IOConfig(gap_bytes=4096)  # the other columns of a row group fit in the gap
    stats = planner.OpStats()
    groups = [5, 1, 2, 3, 7]
    got = parquet.read_chunks(fs, [(parquet_file, g) for g in groups], "image", io=io,
                              stats=stats)
    ref = pq.ParquetFile(parquet_file)
    for g, arr in zip(groups, got, strict=True):
        assert arr.equals(ref.read_row_group(g, columns=["image"]).column(0).combine_chunks())
    # footer + runs [1, 2, 3] and [5] (merged with 3's run? no: row group 4 lies between) + [7]
    assert stats.requests == 1 + 3
    wanted = sum(parquet.chunk_range(ref.metadata, g, "image")[1] for g in groups)
    assert stats.bytes_fetched - ref.metadata.serialized_size - 8 < 1.05 * wanted


def test_parquet_chunks_come_from_the_cache_the_second_time(parquet_file, tmp_path):
    fs = slow.slow_filesystem(pafs.LocalFileSystem(), (0.0, None))
    io = IOConfig(cache=CacheConfig(memory_bytes=10**7, memory_dir=str(tmp_path / "mem")))
    first, second = planner.OpStats(), planner.OpStats()
    a = parquet.read_chunks(fs, [(parquet_file, 0), (parquet_file, 4)], "image", io=io,
                            stats=first, namespace="t")
    b = parquet.read_chunks(fs, [(parquet_file, 4), (parquet_file, 0)], "image", io=io,
                            stats=second, namespace="t")
    assert first.requests >= 2 and second.requests == 0
    assert a[0].equals(b[1]) and a[1].equals(b[0])


def test_a_file_rewritten_in_place_is_read_anew_under_its_new_dataset_key(parquet_file,
                                                                          tmp_path):
    """A new pack over the same path is another dataset (another namespace: the manifest's
    fingerprint): neither the process's footer nor the cache's chunks of the old file serve
    it, though both keep serving the old namespace's reads in the same process."""
    fs = slow.slow_filesystem(pafs.LocalFileSystem(), (0.0, None))
    io = IOConfig(cache=CacheConfig(memory_bytes=10**7, memory_dir=str(tmp_path / "mem")))
    old = parquet.read_chunks(fs, [(parquet_file, 1)], "image", io=io, namespace="old")
    n = 300  # fewer, longer rows in other row groups: the old footer points elsewhere
    new_images = [bytes([7 + i % 200]) * (900 + i) for i in range(n)]
    pq.write_table(pa.table({"id": pa.array(np.arange(n)), "image": pa.array(new_images)}),
                   parquet_file, row_group_size=60, compression="none")
    stats = planner.OpStats()
    [got] = parquet.read_chunks(fs, [(parquet_file, 1)], "image", io=io, namespace="new",
                                stats=stats)
    assert got.to_pylist() == new_images[60:120]
    assert stats.requests >= 2  # the new footer and the chunk, from the file
    [again] = parquet.read_chunks(fs, [(parquet_file, 1)], "image", io=io, namespace="old")
    assert again.equals(old[0])  # the old namespace's cached chunk (stale, but its own)


def test_parquet_missing_column_is_a_clear_error(parquet_file):
    with pytest.raises(Exception, match="Parquet column 'pixels' not found"):
        parquet.read_chunks(pafs.LocalFileSystem(), [(parquet_file, 0)], "pixels",
                            io=IOConfig())


# --- prefetching --------------------------------------------------------------------------------


def test_prefetcher_fetches_ahead_in_order_and_surfaces_errors():
    started: list[int] = []
    gate = threading.Event()

    def fetch_one(w):
        started.append(w)
        if w == 0:
            gate.wait(5)
        if w == 3:
            raise ValueError("window 3 failed")
        return w * 10

    it = planner.Prefetcher(range(5), fetch_one, depth=1)
    deadline = time.monotonic() + 5
    first = None

    def take():
        nonlocal first
        first = next(it)

    t = threading.Thread(target=take)
    t.start()
    while 1 not in started and time.monotonic() < deadline:
        time.sleep(0.01)
    assert 1 in started  # window 1 is fetched while window 0 is still being fetched
    gate.set()
    t.join(5)
    assert first == (0, 0)
    assert next(it) == (1, 10) and next(it) == (2, 20)
    with pytest.raises(ValueError, match="window 3 failed"):
        next(it)
    it.close()
    with pytest.raises(ConfigError, match="depth=...\\) must be >= 0"):
        planner.Prefetcher([], fetch_one, depth=-1)


def test_io_config_validation_names_the_argument():
    with pytest.raises(ConfigError, match=r"IOConfig\(concurrency=...\) must be >= 1 or None"):
        IOConfig(concurrency=0)
    assert IOConfig.coerce({"cache": {"memory_bytes": 10}}).cache.memory_bytes == 10
    with pytest.raises(ConfigError, match="io must be an IOConfig, a dict or None"):
        IOConfig.coerce(3)
