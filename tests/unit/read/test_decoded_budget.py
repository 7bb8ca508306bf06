"""The decoded cache's budget: on only where the decoded dataset fits, never for pixels."""

from __future__ import annotations

import os

import numpy as np
import pytest

from raying.errors import ConfigError
from raying.read import decoded_cache, decoded_dirs


class _M:
    def __init__(self, n, fmt="images", decoded=None):
        self.n, self.format, self.meta = n, fmt, ({"decoded": decoded} if decoded else {})

    def __len__(self):
        return self.n


@pytest.mark.parametrize("off", ["off", None, 0, False])
def test_off_is_zero(off):
    assert decoded_cache.plan_budget(off, _M(10)) == 0


def test_a_fixed_budget_is_taken_as_given_except_for_pixels():
    assert decoded_cache.plan_budget(12345, _M(10)) == 12345
    assert decoded_cache.plan_budget(12345, _M(10, "parquet", (8, 8, 3))) == 0  # already pixels


def test_auto_turns_on_only_when_the_decoded_set_fits(monkeypatch):
    monkeypatch.setattr(decoded_cache, "auto_budget", lambda *a, **k: 10_000_000)
    asked = []

    def sizes(ids):
        asked.append(len(ids))
        return [(100, 100)] * len(ids)  # 30 KB decoded each

    long = decoded_cache.DEFAULT_DECODED_CACHE_MIN_EPOCHS
    fits = decoded_cache.plan_budget("auto", _M(300), size_of=sizes, epochs=long)  # ~9.5 MB
    too_big = decoded_cache.plan_budget("auto", _M(400), size_of=sizes, epochs=long)  # ~12.6 MB
    assert fits == 10_000_000 and too_big == 0
    assert asked == [16, 16]  # headers of a probe, not of every file
    unknown = decoded_cache.plan_budget("auto", _M(10), size_of=lambda ids: [None] * len(ids),
                                        epochs=long)
    assert unknown == 0  # no header read: no estimate, no cache
    # The shares of a sharded pipeline (Train workers) each cache a copy, maybe on one
    # node: "auto" asks room for every copy, a budget in bytes is split among them.
    halves = decoded_cache.plan_budget("auto", _M(150), size_of=sizes, epochs=long, copies=2)
    assert halves == 5_000_000
    assert decoded_cache.plan_budget("auto", _M(300), size_of=sizes, epochs=long,
                                     copies=2) == 0
    assert decoded_cache.plan_budget(12_000, _M(10), copies=4) == 3_000


def test_auto_stays_off_unless_enough_epochs_follow_to_repay_the_first(monkeypatch):
    monkeypatch.setattr(decoded_cache, "auto_budget", lambda *a, **k: 10_000_000)
    asked = []

    def sizes(ids):
        asked.append(len(ids))
        return [(100, 100)] * len(ids)

    long = decoded_cache.DEFAULT_DECODED_CACHE_MIN_EPOCHS
    assert decoded_cache.plan_budget("auto", _M(300), size_of=sizes) == 0  # epochs unknown
    assert decoded_cache.plan_budget("auto", _M(300), size_of=sizes, epochs=long - 1) == 0
    assert asked == []  # no header is read for a cache that cannot pay
    assert decoded_cache.plan_budget("auto", _M(300), size_of=sizes, epochs=long) == 10_000_000
    # an explicit budget is the user's choice, whatever the epochs
    assert decoded_cache.plan_budget(5_000_000, _M(300), size_of=sizes, epochs=1) == 5_000_000


@pytest.mark.parametrize("bad", [0, -1, 2.5, True])
def test_pipeline_config_refuses_a_bad_epoch_count(bad):
    from raying.options import PipelineConfig

    with pytest.raises(ConfigError, match=r"PipelineConfig\(epochs=...\) must be an integer"):
        PipelineConfig(epochs=bad)


@pytest.mark.parametrize("bad", ["on", -5, 2.5, True])
def test_a_bad_setting_names_the_choices(bad):
    with pytest.raises(ConfigError, match=r"decoded_cache must be 'auto', 'off' or a positive "
                                          r"number of bytes"):
        decoded_cache.plan_budget(bad, _M(10))


# -- per node: the root, the owner rule, the node's own cap --------------------------------------
def test_each_node_reads_its_root_from_its_environment(monkeypatch, tmp_path):
    monkeypatch.setenv(decoded_dirs.DECODED_CACHE_DIR_ENV, str(tmp_path / "node"))
    assert decoded_dirs.cache_dir("p") == str(tmp_path / "node" / "p")
    monkeypatch.delenv(decoded_dirs.DECODED_CACHE_DIR_ENV)
    assert decoded_dirs.cache_dir("p") == decoded_dirs.DEFAULT_DECODED_CACHE_DIR + "/p"


def test_the_sweep_removes_dead_owners_only(monkeypatch, tmp_path):
    import os
    import socket
    import subprocess

    monkeypatch.setenv(decoded_dirs.DECODED_CACHE_DIR_ENV, str(tmp_path))
    gone = subprocess.Popen(["true"])
    gone.wait()
    here = socket.gethostname()
    owners = {
        "live-here": f"{here} {os.getpid()}",
        "dead-here": f"{here} {gone.pid}",
        "dead-job": "elsewhere 1 10.0.0.1:6379 02000000",
        "live-job": "elsewhere 1 10.0.0.1:6379 03000000",
        "other-cluster": "elsewhere 1 10.9.9.9:6379 02000000",
        "old-format-here": f"{here} {gone.pid}",  # written before the Ray part existed
    }
    for name, owner in owners.items():
        decoded_dirs.mark_owner(str(tmp_path / name), owner)
    decoded_dirs.mark_owner(str(tmp_path / "live-here"), "someone else")  # first owner stays
    removed = decoded_dirs.sweep(frozenset({"02000000"}), "10.0.0.1:6379")
    assert sorted(removed) == ["dead-here", "dead-job", "old-format-here"]
    assert sorted(os.listdir(tmp_path)) == ["live-here", "live-job", "other-cluster"]
    with open(tmp_path / "live-here" / ".owner") as fh:
        assert fh.read() == owners["live-here"]


def test_auto_caps_the_budget_at_the_nodes_own_share(monkeypatch, tmp_path):
    from raying.read.spec import ReadSpec

    monkeypatch.setenv(decoded_dirs.DECODED_CACHE_DIR_ENV, str(tmp_path))
    monkeypatch.setattr(decoded_cache, "auto_budget", lambda *a, **k: 5 << 20)
    opened = []
    monkeypatch.setattr(decoded_cache.DecodedCache, "__init__",
                        lambda self, d, b, ns, admit=1.0: opened.append((d, b)))
    base = dict(root="/x", storage=None, fmt="images", files=(), image_column=None,
                decoded=None, transform=None, seed=0, decoded_cache_bytes=1 << 30,
                decoded_cache_name="p", decoded_cache_owner="h 1")
    decoded_cache.DecodedCache.of(ReadSpec(**base, decoded_cache_auto=True))
    decoded_cache.DecodedCache.of(ReadSpec(**base, decoded_cache_auto=False))
    assert opened == [(str(tmp_path / "p"), 5 << 20), (str(tmp_path / "p"), 1 << 30)]


def test_every_process_of_a_node_takes_the_first_ones_auto_budget(monkeypatch, tmp_path):
    """Free memory falls as the cache fills: a worker started later measuring its own budget
    would open the directory smaller and evict what the others cached."""
    directory = str(tmp_path / "p")
    assert decoded_dirs.node_budget(directory, lambda: 9 << 20) == 9 << 20
    monkeypatch.setattr(decoded_dirs, "_BUDGETS", {})  # another process of the node
    assert decoded_dirs.node_budget(directory, lambda: 2 << 20) == 9 << 20
    assert sorted(os.listdir(directory)) == [".budget"]  # no temp file left
    other = str(tmp_path / "q")  # another pipeline measures its own
    assert decoded_dirs.node_budget(other, lambda: 2 << 20) == 2 << 20
    # A root it cannot write to: its own measure, no error, steady in this process.
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert decoded_dirs.node_budget(str(blocker / "p"), lambda: 3 << 20) == 3 << 20
    assert decoded_dirs.node_budget(str(blocker / "p"), lambda: 1 << 20) == 3 << 20
    # A pipeline built again under the name of a closed one (its folder removed and made
    # anew) records its own budget, and a long-lived worker takes that one, not its memo.
    import shutil

    shutil.rmtree(directory)
    assert decoded_dirs.node_budget(directory, lambda: 4 << 20) == 4 << 20
    monkeypatch.setattr(decoded_dirs, "_BUDGETS", {})  # a worker of the new pipeline
    assert decoded_dirs.node_budget(directory, lambda: 1 << 20) == 4 << 20


# -- a budget smaller than the decoded set: a fixed subset, not a thrashing LRU -------------------
def test_the_admitted_subset_has_the_share_and_is_fixed():
    ids = np.arange(200_000)
    for share in (0.1, 0.37, 0.9):
        mask = decoded_cache.admitted(ids, share)
        assert abs(mask.mean() - share) < 0.005
        assert np.array_equal(mask, decoded_cache.admitted(ids[::-1], share)[::-1])
    assert decoded_cache.admitted(ids, 1.0).all()


def test_admit_share_sizes_the_subset_to_the_budget():
    m = _M(1000)

    def size_of(ids):
        return [(100, 100)] * len(ids)  # 30 kB each, ~31.6 MB in all with the overhead

    total = decoded_cache.decoded_size(m, size_of)
    assert total == pytest.approx((30_000 * 1.05 + 64) * 1000)
    assert decoded_cache.admit_share(int(total * 2), m, size_of) == 1.0
    share = decoded_cache.admit_share(int(total / 2), m, size_of)
    assert share == pytest.approx(decoded_cache.DEFAULT_DECODED_CACHE_FILL / 2, rel=1e-3)


def test_a_partial_fit_keeps_hitting_where_an_lru_would_thrash(tmp_path):
    rng = np.random.default_rng(3)
    n = 400
    pixels = {i: np.full((40, 40, 3), i % 251, np.uint8) for i in range(n)}
    entry = len(decoded_cache.encode_array(pixels[0]))
    budget = entry * n // 2

    def epochs(cache):
        hits = []
        for _ in range(4):
            order = rng.permutation(n)
            got = 0
            for k in range(0, n, 40):
                ids = order[k:k + 40]
                found = cache.get(ids)
                got += sum(f is not None for f in found)
                for i, f in zip(ids, found, strict=True):
                    if f is not None:
                        assert np.array_equal(f, pixels[int(i)])
                miss = [int(i) for i, f in zip(ids, found, strict=True) if f is None]
                cache.put(miss, [pixels[i] for i in miss])
                cache._tier.flush(10.0)  # the background writer drops offers it is behind on
            hits.append(got / n)
        return hits

    share = decoded_cache.DEFAULT_DECODED_CACHE_FILL * 0.5
    subset = epochs(decoded_cache.DecodedCache(str(tmp_path / "s"), budget, "t", share))
    lru = epochs(decoded_cache.DecodedCache(str(tmp_path / "l"), budget, "t"))
    assert subset[0] == 0.0 and min(subset[1:]) > 0.8 * share, subset
    assert max(lru[1:]) < min(subset[1:]), (lru, subset)


# --- the fill budget ------------------------------------------------------------------------------


def test_the_fill_budget_spends_only_what_the_read_time_and_the_hits_earned():
    b = decoded_cache.FillBudget(0.05)
    assert b.allow(10) == 0  # no credit before any read work
    b.earn(0.100)  # a part of 100 ms earns 5 ms
    assert b.allow(10) == 1  # the first fill measures what one costs
    b.spend(1, 0.002)
    assert b.credit == pytest.approx(0.003)
    assert b.allow(10) == 1  # 3 ms of credit, 2 ms a fill
    b.spend(1, 0.002)
    assert b.allow(10) == 0
    b.earn(0.200)  # +10 ms
    assert b.allow(10) == 5 and b.allow(3) == 3
    # Hits earn what they saved (decode and crop minus lookup and crop), once both are known.
    b.note(16, 16 * 0.0004, 0, 0.0)
    b.earn(0.0, hits=10)
    assert b.credit == pytest.approx(0.011)  # no hit timed yet: nothing credited
    b.note(0, 0.0, 8, 8 * 0.0001)
    b.earn(0.0, hits=10)
    assert b.credit == pytest.approx(0.011 + 10 * 0.0003)
    b.note(0, 0.0, 4, 4 * 0.001)  # hits dearer than decoding earn nothing, never debt
    before = b.credit
    b.earn(0.0, hits=100)
    assert b.credit >= before


def test_without_a_share_every_admitted_miss_is_filled_at_once():
    b = decoded_cache.FillBudget(None)
    assert b.allow(7) == 7 and b.allow(0) == 0
    b.spend(7, 1.0)
    assert b.allow(7) == 7


@pytest.mark.parametrize("bad", [0, -0.1, float("nan"), float("inf"), True, "5%"])
def test_pipeline_config_refuses_a_bad_fill_share(bad):
    import raying

    with pytest.raises(ConfigError, match="decoded_cache_fill"):
        raying.PipelineConfig(decoded_cache_fill=bad)
    assert raying.PipelineConfig(decoded_cache_fill=None).decoded_cache_fill is None
    assert raying.PipelineConfig().decoded_cache_fill == 0.04


class _FixedBudget(decoded_cache.FillBudget):
    """The fill budget's calls with a fixed economy instead of timings (its arithmetic on
    given timings is tested above): each part earns half a fill, each hit one more."""

    def allow(self, n):
        return min(max(n, 0), int(self.credit))

    def spend(self, n, seconds):
        self.credit -= n

    def earn(self, seconds, hits=0, overhead=0.0):
        self.credit += 0.5 + hits
        self.calls = [*getattr(self, "calls", []), (seconds, hits, overhead)]


def test_the_cache_fills_over_epochs_within_its_budget_with_unchanged_pixels(tmp_path,
                                                                              monkeypatch):
    """In one process, as a read worker runs units: with a budget the first epoch writes
    only what it allows, later epochs hit those entries, which earn more fills, and write
    more. Without a share the first epoch writes every entry. Both give the same pixels in
    every epoch, hit or miss: a cached pipeline decodes its misses at full scale, as its hits
    were (with the cache off, a DCT-scaled decode may differ by a few levels)."""
    import raying
    from raying.read.task import iter_unit
    from raying.tools.datagen import make_image_folder

    budgets = {}
    real = decoded_cache.fill_budget
    monkeypatch.setattr(decoded_cache, "fill_budget", lambda d, share: real(d, share)
                        if share is None else budgets.setdefault(d, _FixedBudget(share)))
    n = 96
    root = make_image_folder(tmp_path / "imgs", n=n, classes=3, size=(64, 80), seed=4)
    m = raying.Manifest.scan(str(root))
    tf = raying.ImageTransform(size=32)

    def pipe(**cfg):
        return raying.Pipeline(m, transform=tf, config=raying.PipelineConfig(block_rows=16, **cfg))

    def epoch(p, e):
        spec, images, hits = p._ready_spec(), [], 0
        for unit in p.plan(e).units:
            u, paths = p._fill(unit)
            for block, account in iter_unit(spec, u, paths, block_rows=8):
                images.append(block["image"])
                hits += account.io.get("cache_decoded_hits", 0)
        return np.concatenate(images), hits

    def entries(p):
        d = os.path.join(decoded_dirs.cache_dir(p._ready_spec().decoded_cache_name), "data")
        return sum(len(f) for _, _, f in os.walk(d))

    off, budgeted, eager = pipe(decoded_cache="off"), pipe(decoded_cache=64 << 20), pipe(
        decoded_cache=64 << 20, decoded_cache_fill=None)
    try:
        hits, written = [], []
        for e in range(4):
            want, h_eager = epoch(eager, e)
            assert h_eager == (0 if e == 0 else n), (e, h_eager)
            if e == 0:
                assert entries(eager) == n
            got, h = epoch(budgeted, e)
            np.testing.assert_array_equal(got, want)
            hits.append(h)
            written.append(entries(budgeted))
            uncached, _ = epoch(off, e)
            assert uncached.shape == got.shape
            assert np.abs(uncached.astype(int) - got).max() <= 16
        assert 0 < written[0] < n // 3, written
        assert hits[0] == 0 and hits[1] == written[0], (hits, written)
        assert written == sorted(written) and written[-1] > written[0], written
        assert written[1] - written[0] > written[0], written  # the hits earned more fills
        assert len(budgets) == 1  # the budgeted pipeline's, in this process
        # What the read told the budget: every part, with its hits and, while nothing was
        # cached yet, its missed lookups as the cache's overhead
        calls = next(iter(budgets.values())).calls
        assert len(calls) == 4 * n // 8  # 8-row parts, 4 epochs
        assert sum(h for _, h, _ in calls) == sum(hits)
        first = calls[:n // 8]
        assert all(h == 0 and o > 0 for _, h, o in first), first
        assert all(0 <= o and 0 < sec for sec, _, o in calls), calls
    finally:
        for p in (off, budgeted, eager):
            p.close()


def _open_files_under(path) -> list[str]:
    base = os.path.realpath(path)
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(base):
            out.append(target)
    return out


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="Linux /proc")
def test_a_closed_pipeline_s_cache_files_are_let_go_at_the_next_read(monkeypatch, tmp_path):
    """A read worker outlives the pipelines it reads for: once a pipeline is released, the
    worker's next decoded-cache read of any pipeline closes the released one's index, WAL and
    lock files (deleted, their tmpfs pages would stay allocated while they are open) and
    forgets it; another pipeline's cache stays open and keeps its entries."""
    monkeypatch.setenv(decoded_dirs.DECODED_CACHE_DIR_ENV, str(tmp_path))
    pixels = [np.full((8, 8, 3), i, np.uint8) for i in range(20)]
    caches = {}
    for name in ("closed", "open"):
        cache = decoded_cache.DecodedCache(decoded_dirs.cache_dir(name), 1 << 20, name)
        cache.put(list(range(20)), pixels)
        cache._tier.flush(10.0)
        caches[name] = cache
    assert _open_files_under(tmp_path / "closed")
    assert decoded_dirs.close_released() == 0  # nothing released yet: nothing closed
    decoded_dirs.release("closed")
    assert not os.path.exists(tmp_path / "closed")
    assert decoded_dirs.close_released() == 1
    assert _open_files_under(tmp_path / "closed") == []
    assert _open_files_under(tmp_path / "open")
    got = caches["open"].get(np.arange(20))
    assert all(np.array_equal(g, p) for g, p in zip(got, pixels, strict=True))
    assert decoded_dirs.close_released() == 0
    decoded_dirs.release("open")
    assert decoded_dirs.close_released() == 1
    assert _open_files_under(tmp_path) == []


def test_a_claim_takes_up_a_closed_pipeline_s_name_again(monkeypatch, tmp_path):
    # A Train worker's share directory keeps its name from run to run: the tombstone the last
    # run's close left (for its late read tasks) must not turn the next run's cache off.
    monkeypatch.setenv(decoded_dirs.DECODED_CACHE_DIR_ENV, str(tmp_path / "node"))
    name = "job-0of2"
    decoded_dirs.claim(name, decoded_dirs.owner_id())
    decoded_dirs.release(name)
    assert decoded_dirs.released(decoded_dirs.cache_dir(name))
    decoded_dirs.claim(name, decoded_dirs.owner_id())
    assert not decoded_dirs.released(decoded_dirs.cache_dir(name))
    assert os.path.isdir(decoded_dirs.cache_dir(name))
    decoded_dirs.release(name)


def test_a_decoded_cache_root_that_cannot_hold_folders_is_named_with_the_fix(tmp_path,
                                                                            monkeypatch):
    afile = tmp_path / "afile"
    afile.write_text("")
    monkeypatch.setenv(decoded_dirs.DECODED_CACHE_DIR_ENV, str(afile))
    with pytest.raises(ConfigError, match=r"RAYING_DECODED_CACHE_DIR='.*afile' must name a "
                                          r"folder .*PipelineConfig\(decoded_cache='off'\)"):
        decoded_dirs.claim("p-1", decoded_dirs.owner_id())


def test_the_misses_of_a_cached_unit_are_scored_by_their_own_rows(monkeypatch, tmp_path):
    """With the decoded cache on, a unit's misses are fetched alone: the bytes cache must rank
    each by its own row's P_i, not by the unit's first rows'."""
    import dataclasses

    import raying
    from raying.options import CacheConfig, IOConfig
    from raying.read import fetch
    from raying.read.spec import ReadSpec
    from raying.read.task import run_unit
    from raying.sampling.plan import ManifestLookup, ReadUnit
    from raying.tools.datagen import make_image_folder

    monkeypatch.setenv("RAYING_DECODED_CACHE_DIR", str(tmp_path / "decoded"))
    root = make_image_folder(tmp_path / "imgs", n=8, classes=1, size=(16, 16))
    m = raying.Manifest.scan(str(root))
    io = IOConfig(cache=CacheConfig(memory_bytes=1 << 20, memory_dir=str(tmp_path / "bytes")))
    spec = dataclasses.replace(
        ReadSpec.of(m, raying.ImageTransform(size=8), seed=0, on_error="skip", io=io),
        decoded_cache_bytes=8 << 20, decoded_cache_name="scores", decoded_cache_fill=None,
        cache_namespace="scores")
    seen = []
    real = fetch.fetch_files

    def spy(fs, paths, *, io, scores=None, namespace=""):
        seen.append(dict(zip(paths, scores, strict=True)))
        return real(fs, paths, io=io, scores=scores, namespace=namespace)

    monkeypatch.setattr(fetch, "fetch_files", spy)
    lookup = ManifestLookup(m)
    ids, probs = np.arange(8), np.arange(1, 9) / 100.0
    try:
        run_unit(spec, *lookup.complete(ReadUnit(0, 0, 4, ids=ids[:4], probs=probs[:4])))
        seen.clear()
        run_unit(spec, *lookup.complete(ReadUnit(1, 0, 8, ids=ids, probs=probs)))
        full = [f"{root}/{p}" for p in m.path_of(ids)]
        assert seen == [{full[k]: probs[k] for k in range(4, 8)}]  # ids 0-3 hit
    finally:
        decoded_dirs.release("scores")


def test_a_share_of_a_sharded_pipeline_gets_its_share_of_the_budget(tmp_path, monkeypatch):
    import raying
    from raying.tools.datagen import make_image_folder

    monkeypatch.setenv("RAYING_DECODED_CACHE_DIR", str(tmp_path / "decoded"))
    m = raying.Manifest.scan(str(make_image_folder(tmp_path / "i", n=8, classes=2,
                                                   size=(16, 16))))
    for shard, want in ((None, 1_000_000), ((1, 4), 250_000)):
        p = raying.Pipeline(m, config=raying.PipelineConfig(shard=shard,
                                                            decoded_cache=1_000_000))
        try:
            assert p._ready_spec().decoded_cache_bytes == want
        finally:
            p.close()


def test_the_sweep_removes_only_decoded_cache_folders(monkeypatch, tmp_path):
    """With the root on a folder others use too (RAYING_DECODED_CACHE_DIR=/dev/shm), an old
    folder without an owner is swept only when it has a decoded cache's layout."""
    import time

    monkeypatch.setenv(decoded_dirs.DECODED_CACHE_DIR_ENV, str(tmp_path))
    other = tmp_path / "other-app"
    other.mkdir()
    (other / "segment").write_bytes(b"1")
    photos = tmp_path / "photos"
    (photos / "data" / "2024").mkdir(parents=True)
    (photos / "index.sqlite").write_bytes(b"")  # another program's database
    late = tmp_path / "closed-pipeline"  # what a late write of a closed pipeline leaves
    (late / "data" / "3f").mkdir(parents=True)
    (late / "data" / "3f" / "entry").write_bytes(b"pixels")
    old = time.time() - 2 * decoded_dirs.DEFAULT_ORPHAN_AGE_S
    for path in (other, photos, late):
        os.utime(path, (old, old))
    assert decoded_dirs.sweep() == ["closed-pipeline"]
    assert other.exists() and photos.exists() and not late.exists()


def test_a_write_racing_the_release_leaves_no_folder(monkeypatch, tmp_path):
    """A read task's write already past its tombstone check when the pipeline is released
    (it makes its fan-out folder again) does not leave the folder behind."""
    import threading
    import time

    monkeypatch.setenv(decoded_dirs.DECODED_CACHE_DIR_ENV, str(tmp_path))
    folder = decoded_dirs.cache_dir("racing")
    os.makedirs(os.path.join(folder, "data", "00"))
    stop = time.monotonic() + 0.3

    def late_writes():
        k = 0
        while time.monotonic() < stop:
            fan = os.path.join(folder, "data", f"{k % 256:02x}")
            os.makedirs(fan, exist_ok=True)
            try:
                with open(os.path.join(fan, f"e{k}"), "wb") as fh:
                    fh.write(b"x" * 1000)
            except FileNotFoundError:  # the removal took the fan-out folder just made
                pass
            k += 1

    writer = threading.Thread(target=late_writes)
    writer.start()
    time.sleep(0.05)
    decoded_dirs.release("racing")
    writer.join()
    assert not os.path.exists(folder)


def test_a_name_built_again_gets_a_cache_of_its_own_in_a_process_that_had_the_old_one(
        monkeypatch, tmp_path):
    """A worker that read a closed pipeline's cache, reading for a new pipeline of the same
    name (its folder made again), opens the new folder's index: the old handles counted
    against the removed one and let the folder grow past its budget."""
    monkeypatch.setenv(decoded_dirs.DECODED_CACHE_DIR_ENV, str(tmp_path))
    folder = decoded_dirs.cache_dir("again")
    pixels = [np.full((8, 8, 3), i, np.uint8) for i in range(10)]
    first = decoded_cache.DecodedCache(folder, 1 << 20, "again")
    first.put(list(range(10)), pixels)
    first._tier.flush(10.0)
    decoded_dirs.release("again")
    decoded_dirs._sweep_node(frozenset(), None, "again")  # the name built again
    os.makedirs(folder)
    second = decoded_cache.DecodedCache(folder, 1 << 20, "again")
    assert second._tier is not first._tier
    assert all(g is None for g in second.get(np.arange(10)))  # nothing of the old one
    second.put(list(range(10)), pixels)
    second._tier.flush(10.0)
    assert sum(second._tier.used_bytes().values()) > 0  # counted in the new index
    got = second.get(np.arange(10))
    assert all(np.array_equal(g, p) for g, p in zip(got, pixels, strict=True))


def test_a_read_opening_the_cache_as_the_pipeline_closes_leaves_no_folder(monkeypatch,
                                                                          tmp_path):
    """A read task past its released-check when the pipeline is closed (a dataset read, or
    one of the window in flight) makes the folder and its index after the release removed
    them: it gets no cache, and what it made is removed."""
    from raying.read.spec import ReadSpec

    monkeypatch.setenv(decoded_dirs.DECODED_CACHE_DIR_ENV, str(tmp_path))
    mark = decoded_cache.mark_owner

    def closed_meanwhile(directory, owner):
        decoded_dirs.release("late")  # the driver's close() runs to its end here
        mark(directory, owner)

    monkeypatch.setattr(decoded_cache, "mark_owner", closed_meanwhile)
    spec = ReadSpec(root="/x", storage=None, fmt="images", files=(), image_column=None,
                    decoded=None, transform=None, seed=0, decoded_cache_bytes=1 << 20,
                    decoded_cache_name="late", decoded_cache_owner="h 1")
    assert decoded_cache.DecodedCache.of(spec) is None
    assert not os.path.exists(decoded_dirs.cache_dir("late"))


# -- the fill budget: what filling may add to a read process's time ----------------------------
def _epoch_zero(budget, parts, *, rows=16, region_s=300e-6, fill_s=500e-6, crop_s=40e-6,
                lookup_s=5e-6):
    """Parts of an epoch where every lookup misses, timed as ``CachedPixels.part`` times them:
    ``(time without the cache, time with it, time spent filling)``."""
    off = on = filling = 0.0
    for _ in range(parts):
        base = rows * region_s  # the cache-off part: a region decode per row
        miss_s = rows * lookup_s
        n = budget.allow(rows)
        fills = n * fill_s
        if n:
            budget.spend(n, fills)
        # filled rows are cropped from their cached pixels instead of decoded again
        elapsed = miss_s + fills + base - n * region_s + n * crop_s
        budget.earn(elapsed - fills - miss_s, overhead=miss_s)
        off, on, filling = off + base, on + elapsed, filling + fills
    return off, on, filling


@pytest.mark.parametrize("share", [0.04, 0.05, 0.1])  # lookups (5 us of 300) under half of it
def test_fills_and_missed_lookups_together_stay_within_the_share_of_the_uncached_time(share):
    off, on, filling = _epoch_zero(decoded_cache.FillBudget(share), 2_000)
    assert on - off <= share * off + 500e-6  # at most one fill over (the first, unmeasured)
    # ... and the budget is used, not starved: the lookups (5 us of 300) leave the fills the
    # rest of it (credit is earned on the part's time without its fills, whose rows are only
    # cropped: a little less than the cache-off time)
    assert filling >= (share - 5 / 300) * off * 0.8


def test_missed_lookups_take_at_most_half_the_credit():
    """Lookups dearer than the share (small images): the fills still get half of it."""
    off, on, filling = _epoch_zero(decoded_cache.FillBudget(0.02), 2_000, region_s=30e-6,
                                   fill_s=60e-6, crop_s=10e-6, lookup_s=5e-6)
    assert 0.01 * off * 0.8 <= filling <= 0.01 * off + 60e-6


def test_hits_earn_what_they_saved():
    b = decoded_cache.FillBudget(0.04)
    b.note(16, 16 * 300e-6, 0, 0.0)  # a decode and crop: 300 us a row
    b.note(0, 0.0, 16, 16 * 50e-6)  # a hit's lookup and crop: 50 us
    before = b.credit
    b.earn(0.0, hits=10)
    assert b.credit - before == pytest.approx(10 * 250e-6)


def test_a_partial_cache_decodes_the_ids_it_never_holds_as_without_it(tmp_path):
    """A cache smaller than the decoded set admits a fixed subset: those ids decode at full
    scale (a hit and a miss of one look the same), the others as with the cache off
    (DCT-scaled where the crop shrinks enough)."""
    import raying
    from raying.read.task import iter_unit
    from raying.tools.datagen import make_image_folder

    root = make_image_folder(tmp_path / "imgs", n=24, classes=2, size=(480, 640), seed=3)
    m = raying.Manifest.scan(str(root))
    tf = raying.ImageTransform(size=48, scale=(0.5, 1.0))  # every crop shrinks 4x or more

    def epoch0(p):
        spec, out = p._ready_spec(), {}
        for unit in p.plan(0).units:
            u, paths = p._fill(unit)
            for block, _ in iter_unit(spec, u, paths, block_rows=8):
                out.update(zip(block["id"].tolist(), block["image"], strict=True))
        return spec, out

    off = raying.Pipeline(m, transform=tf, config=raying.PipelineConfig(decoded_cache="off"))
    part = raying.Pipeline(m, transform=tf, config=raying.PipelineConfig(
        decoded_cache=8 << 20, decoded_cache_fill=None))  # ~22 MB decoded
    try:
        _, plain = epoch0(off)
        spec, cached = epoch0(part)
        assert 0 < spec.decoded_cache_admit < 1
        ids = np.array(sorted(plain))
        held = decoded_cache.admitted(ids, spec.decoded_cache_admit)
        assert 0 < held.sum() < len(ids)
        for i, h in zip(ids.tolist(), held.tolist(), strict=True):
            if not h:
                np.testing.assert_array_equal(cached[i], plain[i])
        # the admitted ones decode at full scale, which differs from the DCT-scaled decode
        assert any(not np.array_equal(cached[i], plain[i])
                   for i, h in zip(ids.tolist(), held.tolist(), strict=True) if h)
    finally:
        off.close()
        part.close()
