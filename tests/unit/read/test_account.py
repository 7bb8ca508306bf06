"""UnitAccount: a unit's block accounts merge into one, and a run adds them up."""

from __future__ import annotations

import functools

from raying.engine.metrics import EpochTally, RunAccount
from raying.read.account import UnitAccount


def _blocks():
    first = UnitAccount(epoch=2, unit=7, rows_in=4, rows_out=3,
                        skipped=[(11, "a.jpg", "truncated", "x")], bytes_read=100, read_s=0.5,
                        decode_s=0.25, node="n1", final=False,
                        io={"io_bytes_fetched": 100, "io_requests": 2})
    second = UnitAccount(epoch=2, unit=7, rows_in=2, rows_out=2, bytes_read=0, read_s=0.0,
                         decode_s=0.125, node="n1", final=True,
                         io={"io_bytes_fetched": 0, "cache_hits_memory": 2})
    return first, second


def test_merge_adds_counts_and_seconds_and_keeps_the_last_final():
    first, second = _blocks()
    merged = first.merge(second)
    assert (merged.epoch, merged.unit, merged.node) == (2, 7, "n1")
    assert (merged.rows_in, merged.rows_out, merged.bytes_read) == (6, 5, 100)
    assert (merged.read_s, merged.decode_s) == (0.5, 0.375)
    assert merged.skipped == [(11, "a.jpg", "truncated", "x")] and merged.final is True
    assert merged.io == {"io_bytes_fetched": 100, "io_requests": 2, "cache_hits_memory": 2}
    # merging leaves both inputs as they were
    assert first.io == {"io_bytes_fetched": 100, "io_requests": 2} and first.final is False


def test_merge_is_associative_over_a_units_blocks():
    first, second = _blocks()
    third = UnitAccount(epoch=2, unit=7, rows_in=1, rows_out=0,
                        skipped=[(12, "b.jpg", "empty", "")], io={"io_requests": 1})
    left = first.merge(second).merge(third)
    right = first.merge(second.merge(third))
    assert left == right == functools.reduce(UnitAccount.merge, [first, second, third])


def test_a_run_account_lists_each_bad_sample_once_and_sums_io():
    first, second = _blocks()
    run = RunAccount()
    assert run.add(first) == [11]
    assert run.add(second) == []
    again = UnitAccount(epoch=3, unit=0, rows_in=1, rows_out=0,
                        skipped=[(11, "a.jpg", "truncated", "x")])
    assert run.add(again) == []  # a bad file is listed once, counted again in skip_events
    out = run.summary()
    # Units, not blocks: unit 7 of epoch 2 (two blocks) and unit 0 of epoch 3.
    assert out["rows_read"] == 7 and out["units"] == 2 and out["skip_events"] == 2
    assert out["skipped_count"] == 1 and out["skipped"][0]["epoch"] == 2
    assert out["rows_by_node"] == {"n1": 5}
    assert out["io"]["io_requests"] == 2 and out["io"]["io_bytes_fetched"] == 100


def test_an_epoch_tally_refuses_an_epoch_where_every_read_was_bad():
    import pytest

    from raying.errors import DataError

    seen = []
    tally = EpochTally(seen.append)
    for k in range(3):
        tally.add(UnitAccount(epoch=0, unit=k, rows_in=4, rows_out=0,
                              skipped=[(4 * k + j, f"{k}{j}.jpg", "not_an_image", "")
                                       for j in range(4)]))
    assert len(seen) == 3
    with pytest.raises(DataError, match=r"every one of the 12 samples read in epoch 0 of /d"):
        tally.refuse_all_bad(12, "/d", 0)
    fine = EpochTally(seen.append)
    fine.add(UnitAccount(epoch=0, unit=0, rows_in=12, rows_out=1,
                         skipped=[(1, "1.jpg", "empty", "")]))
    fine.refuse_all_bad(12, "/d", 0)  # one good row: not refused


def test_a_run_account_keeps_each_workers_largest_memory_and_every_framework_it_loaded():
    run = RunAccount()
    run.add(UnitAccount(epoch=0, unit=0, node="n1", pid=7, worker_kib=100 * 1024))
    run.add(UnitAccount(epoch=0, unit=1, node="n1", pid=7, worker_kib=300 * 1024,
                        frameworks=("torch",)))
    run.add(UnitAccount(epoch=0, unit=2, node="n1", pid=7, worker_kib=200 * 1024,
                        frameworks=("pandas",)))
    run.add(UnitAccount(epoch=0, unit=3, node="n2", pid=7, worker_kib=50 * 1024))
    workers = run.summary()["read_workers"]
    assert workers["by_worker"] == {"n1:7": 300.0, "n2:7": 50.0}
    assert workers["pss_mb_max"] == 300.0 and workers["count"] == 2
    assert workers["frameworks"] == {"n1:7": ["pandas", "torch"]}
    a = UnitAccount(epoch=0, unit=0, final=False, frameworks=())
    b = UnitAccount(epoch=0, unit=0, frameworks=("torch",))
    assert a.merge(b).frameworks == ("torch",)


def test_skips_are_logged_under_the_epoch_they_were_read_in(caplog):
    """An epoch that raised never reached its end: its skips are logged at the next epoch's
    end, under their own epoch's number."""
    import logging

    run = RunAccount()
    run.add(UnitAccount(epoch=0, unit=0, rows_in=2, rows_out=1,
                        skipped=[(3, "a/3.jpg", "read_error", "x")]))
    run.add(UnitAccount(epoch=1, unit=0, rows_in=2, rows_out=1,
                        skipped=[(5, "a/5.jpg", "decode_error", "y")]))
    with caplog.at_level(logging.WARNING, logger="raying"):
        run.end_epoch(1)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2
    assert lines[0].startswith("raying skipped 1 bad samples in epoch 0 ({'read_error': 1}): "
                               "id 3 a/3.jpg")
    assert lines[1].startswith("raying skipped 1 bad samples in epoch 1 ({'decode_error': 1})")


def test_skips_beyond_the_listed_ones_are_logged_with_their_true_count(caplog, monkeypatch):
    """Only the first MAX_SKIPPED_LISTED skips keep their details; the log said that many
    (10,000 of 12,000), and skips first found in a later epoch were never logged."""
    import logging

    from raying.engine import metrics

    monkeypatch.setattr(metrics, "MAX_SKIPPED_LISTED", 3)
    run = RunAccount()
    run.add(UnitAccount(epoch=0, unit=0, rows_in=5, rows_out=0, skipped=[
        (i, f"a/{i}.jpg", "decode_error" if i % 2 else "read_error", "x") for i in range(5)]))
    with caplog.at_level(logging.WARNING, logger="raying"):
        run.end_epoch(0)
        run.add(UnitAccount(epoch=1, unit=0, rows_in=2, rows_out=0, skipped=[
            (10, "a/10.jpg", "decode_error", "x"), (11, "a/11.jpg", "decode_error", "x")]))
        run.end_epoch(1)
        run.end_epoch(2)  # nothing new: no line
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2
    assert lines[0].startswith("raying skipped 5 bad samples in epoch 0 ({'read_error': 3, "
                               "'decode_error': 2}): id 0 a/0.jpg")
    assert "(+2 more)" in lines[0] and "the first 3 of the run are listed" in lines[0]
    assert lines[1].startswith("raying skipped 2 bad samples in epoch 1 ({'decode_error': 2})"
                               ": none listed (+2 more)")
    assert run.summary()["skipped_count"] == 7 and len(run.skipped) == 3


def test_draws_of_samples_set_aside_before_are_logged_by_epoch(caplog):
    """A bad sample drawn again (the next epoch was planned before it was found, or a sampler
    drew it twice) shortens its epoch: that is said, once as a warning, then at INFO."""
    import logging

    def skip(epoch, *ids):
        return UnitAccount(epoch=epoch, unit=0, rows_in=len(ids), rows_out=0,
                           skipped=[(i, f"a/{i}.jpg", "empty", "") for i in ids])

    run = RunAccount()
    with caplog.at_level(logging.INFO, logger="raying"):
        run.add(skip(0, 3, 3, 4))  # drawn twice in its own epoch: INFO
        run.end_epoch(0)
        run.add(skip(1, 3, 3, 4, 9))  # planned before they were found: a warning
        run.end_epoch(1)
        run.add(skip(2, 4))  # again (a Train worker's share): INFO from now on
        run.end_epoch(2)
        run.end_epoch(3)  # nothing skipped: no line
    lines = [(r.levelno, r.getMessage()) for r in caplog.records]
    assert [lvl for lvl, _ in lines] == [logging.WARNING, logging.INFO, logging.WARNING,
                                         logging.WARNING, logging.INFO]
    assert lines[0][1].startswith("raying skipped 2 bad samples in epoch 0")
    assert lines[1][1].startswith("raying skipped 1 more draws of 1 bad samples in epoch 0 "
                                  "(ids 3)")
    assert lines[2][1].startswith("raying skipped 1 bad samples in epoch 1 ({'empty': 1}): id 9")
    assert lines[3][1].startswith("raying skipped 3 draws of 2 samples set aside in an earlier "
                                  "epoch again in epoch 1 (ids 3, 4), which delivers that many "
                                  "fewer rows than it drew")
    assert lines[4][1].startswith("raying skipped 1 draws of 1 samples set aside in an earlier "
                                  "epoch again in epoch 2 (ids 4)")
    assert run.summary()["skip_events"] == 8 and run.summary()["skipped_count"] == 3
