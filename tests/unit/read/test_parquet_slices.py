"""The slices of one Parquet read unit share its row groups in a worker (no cluster needed)."""

from __future__ import annotations

import numpy as np
import pytest

import raying
from raying.engine.stream import _slice_unit
from raying.options import IOConfig
from raying.read import parquet
from raying.read.task import iter_unit
from tests.unit.read.test_stages import write_parquet_set


@pytest.fixture
def counted(monkeypatch):
    """Count the reads of the image column's row groups, starting with nothing kept."""
    calls: list[tuple[str, tuple[int, ...]]] = []
    real = parquet._read_row_groups

    def counting(fs, path, groups, col, retried, check=None):
        if col == "image":  # (the extra columns are read on their own, not kept)
            calls.append((path, tuple(groups)))
        return real(fs, path, groups, col, retried, check)

    monkeypatch.setattr(parquet, "_read_row_groups", counting)
    monkeypatch.setitem(parquet._UNIT_GROUPS, "unit", None)
    monkeypatch.setitem(parquet._UNIT_GROUPS, "tables", {})
    return calls


def _rows(spec, unit, paths):
    out = [b for b, _ in iter_unit(spec, unit, paths, block_rows=64)]
    return (np.concatenate([b["id"] for b in out]), np.concatenate([b["image"] for b in out]),
            [c for b in out for c in b["caption"]])


@pytest.mark.parametrize("keep", [True, False])
def test_slices_of_a_unit_read_its_row_groups_once_and_give_the_unit_s_rows(
        tmp_path, counted, monkeypatch, keep):
    root = write_parquet_set(tmp_path, files=((0, 40), (40, 64)), row_group_size=4)
    m = raying.Manifest.scan(str(root), format="parquet", label="label", columns=["caption"])
    pipe = raying.Pipeline(m, transform=raying.ImageTransform(size=16),
                           sampler=raying.UniformSampler(seed=2),
                           config=raying.PipelineConfig(block_rows=16, decoded_cache="off"))
    if not keep:  # over the byte bound: every slice reads for itself, as before
        monkeypatch.setattr(parquet, "UNIT_GROUPS_KEEP_BYTES", 1)
    units = pipe.plan(0).units
    unit, paths = pipe._fill(units[0])
    whole = _rows(pipe._spec, unit, paths)
    reads_whole = len(counted)
    assert reads_whole >= 1
    counted.clear()
    monkeypatch.setitem(parquet._UNIT_GROUPS, "unit", None)
    n = len(unit.ids)
    parts = [_rows(pipe._spec, _slice_unit(unit, a, min(a + 4, n)), paths)
             for a in range(0, n, 4)]
    ids = np.concatenate([p[0] for p in parts])
    images = np.concatenate([p[1] for p in parts])
    assert np.array_equal(ids, whole[0]) and np.array_equal(images, whole[1])
    assert [c for p in parts for c in p[2]] == whole[2]
    # Kept: the first slice reads what the whole unit read, the others nothing.
    assert len(counted) == (reads_whole if keep else reads_whole * len(parts))
    counted.clear()
    other, other_paths = pipe._fill(units[1])
    _rows(pipe._spec, other, other_paths)  # another unit: read afresh
    assert len(counted) >= 1
    pipe.close()


def test_kept_row_groups_are_dropped_when_the_worker_reads_nothing_for_a_while(
        tmp_path, counted, monkeypatch):
    import time

    monkeypatch.setattr(parquet, "UNIT_GROUPS_KEEP_S", 0.2)
    root = write_parquet_set(tmp_path, files=((0, 16),), row_group_size=4)
    m = raying.Manifest.scan(str(root), format="parquet", label="label")
    pipe = raying.Pipeline(m, transform=raying.ImageTransform(size=16),
                           config=raying.PipelineConfig(block_rows=16, decoded_cache="off"))
    unit, paths = pipe._fill(pipe.plan(0).units[0])
    list(iter_unit(pipe._spec, unit, paths, block_rows=64))
    assert parquet._UNIT_GROUPS["tables"]
    deadline = time.monotonic() + 10
    while parquet._UNIT_GROUPS["tables"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not parquet._UNIT_GROUPS["tables"] and parquet._UNIT_GROUPS["unit"] is None
    pipe.close()


@pytest.mark.parametrize("planned", [False, True])
def test_the_parts_of_a_large_row_group_are_read_once_by_a_worker(tmp_path, counted,
                                                                  monkeypatch, planned):
    """A uniform plan deals a file of one row group (pyarrow's and pandas' default) into
    parts, each a unit reading the group: a worker keeps the group for the parts that follow
    it instead of reading it once per part, on the plain path and on the planned one
    (IOConfig: 8x a one-group file's size from S3 without the keep)."""
    fetched = []
    real = parquet.read_unit_groups

    def counting(*args, **kwargs):
        fetched.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(parquet, "read_unit_groups", counting)
    root = write_parquet_set(tmp_path, files=((0, 96),), row_group_size=96)
    m = raying.Manifest.scan(str(root), format="parquet", label="label", columns=["caption"])
    pipe = raying.Pipeline(m, transform=raying.ImageTransform(size=16),
                           sampler=raying.UniformSampler(seed=2),
                           config=raying.PipelineConfig(
                               block_rows=8, decoded_cache="off",
                               io=IOConfig() if planned else None))
    units = pipe.plan(0).units
    assert len(units) == 8 and all(len(u.row_groups) == 1 for u in units)
    assert all(u.num_rows % 8 == 0 for u in units)  # parts of whole blocks of 8
    got = []
    for u in units:
        unit, paths = pipe._fill(u)
        ids, _, captions = _rows(pipe._spec, unit, paths)
        assert captions == [f"sample {i}" for i in ids]
        got.append(ids)
    assert sorted(np.concatenate(got).tolist()) == list(range(96))
    assert len(fetched if planned else counted) == 1
    pipe.close()


def test_a_storage_error_in_a_read_keeps_its_fix():
    """raying's storage messages end with the fix (the endpoint, the credentials to set); a
    read of row groups cut them to their first 200 characters ("...: AWS")."""
    from raying.errors import CredentialsError, StorageError
    from raying.read.spec import ReadSpec

    spec = ReadSpec(root="s3://b/p", storage=None, fmt="parquet", files=("a.parquet",),
                    image_column=None, decoded=None, transform=None, seed=0)
    cause = "x" * 300
    for kind, fix in ((StorageError, "check that the server is up"),
                      (CredentialsError, "fix: set AWS_ACCESS_KEY_ID")):
        exc = kind(f"cannot reach the endpoint: {cause}. {fix}")
        exc.outage = True
        err = parquet._parquet_error(spec, "a.parquet", [0], exc)
        assert type(err) is kind and str(err).endswith(fix) and err.outage
        assert str(err).startswith("s3://b/p/a.parquet: cannot read row groups [0]: ")


def test_kept_row_groups_stay_while_parts_keep_taking_them(tmp_path, counted, monkeypatch):
    """Idle is counted from the last read that took the kept groups: counted from the read
    that stored them, a worker whose parts came 0.3 s apart lost them once the keep time
    was up and read the group again."""
    import time

    # Kept 1 s from the last take: parts 0.3 s apart (and a decode) keep them, while the 8
    # parts' 2.4 s outlast a keep counted from the read that stored them.
    monkeypatch.setattr(parquet, "UNIT_GROUPS_KEEP_S", 1.0)
    root = write_parquet_set(tmp_path, files=((0, 64),), row_group_size=64)
    m = raying.Manifest.scan(str(root), format="parquet", label="label")
    pipe = raying.Pipeline(m, transform=raying.ImageTransform(size=16),
                           sampler=raying.UniformSampler(seed=2),
                           config=raying.PipelineConfig(block_rows=8, decoded_cache="off"))
    units = pipe.plan(0).units
    assert len(units) == 8
    for u in units:
        unit, paths = pipe._fill(u)
        list(iter_unit(pipe._spec, unit, paths, block_rows=8))
        time.sleep(0.3)
    assert len(counted) == 1
    pipe.close()


def test_a_worker_keeps_the_footers_it_used_last_within_its_byte_budget(tmp_path, monkeypatch):
    """Parsed footers stay for the next reads of their files, the least recently used
    dropped past FOOTERS_KEEP_BYTES (a dataset of many files would otherwise leave every
    footer in every read worker); the one just read always stays."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from pyarrow import fs as pafs

    paths = []
    for k in range(4):
        path = str(tmp_path / f"part-{k}.parquet")
        pq.write_table(pa.table({"x": np.arange(100 * (k + 1))}), path, row_group_size=10)
        paths.append(path)
    local = pafs.LocalFileSystem()
    one = pq.read_metadata(paths[0]).serialized_size
    monkeypatch.setattr(parquet, "_FOOTERS", parquet.OrderedDict())
    monkeypatch.setattr(parquet, "_FOOTERS_HELD", [0])
    monkeypatch.setattr(parquet, "FOOTERS_KEEP_BYTES", 3 * one)  # room for about two
    stats = parquet.OpStats()
    md0, _ = parquet.footer(local, paths[0], stats, namespace="d")
    assert parquet.footer(local, paths[0], stats, namespace="d")[0] is md0  # kept
    assert stats.requests == 1
    for path in paths[1:]:
        parquet.footer(local, path, stats, namespace="d")
    kept = [key[2] for key in parquet._FOOTERS]
    assert kept[-1] == paths[-1] and paths[0] not in kept
    assert parquet._FOOTERS_HELD[0] == sum(md.serialized_size
                                           for md, _ in parquet._FOOTERS.values())
    assert parquet._FOOTERS_HELD[0] <= 3 * one or len(kept) == 1
    parquet.footer(local, paths[0], stats, namespace="d")  # read again once dropped
    assert stats.requests == 5
