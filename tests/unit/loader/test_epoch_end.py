"""When a cursor's epoch is delivered to its end though the iterator was never asked past its
last batch (a loop of steps_per_epoch steps), so that state_dict() moves to the next epoch."""

from __future__ import annotations

from raying.loader.pipeline import _delivered_to_end


def _cursor(units, *, delivered, tail=0, base=0):
    # 1030 rows: a unit of 1024 rows and one of 6; batches of 32.
    return {"epoch": 0, "delivered": delivered, "base": base, "start": (0, base),
            "tail": tail, "last_unit": 1, "planned": {0: 1024 - base, 1: 6}, "units": units}


def test_every_row_delivered_ends_the_epoch():
    both = [(0, 0, 1024, True), (1, 0, 6, True)]
    assert _delivered_to_end(_cursor(both, delivered=1030))
    assert not _delivered_to_end(_cursor(both, delivered=1024))
    assert not _delivered_to_end(_cursor([(0, 0, 1024, True)], delivered=1024))


def test_drop_last_ends_the_epoch_once_no_full_batch_can_come():
    # The 6-row tail is dropped: after 32 full batches the epoch is done, whether or not the
    # last block was pulled yet (prefetch_batches=0 leaves it unread).
    both = [(0, 0, 1024, True), (1, 0, 6, True)]
    assert _delivered_to_end(_cursor(both, delivered=1024, tail=32))
    assert _delivered_to_end(_cursor([(0, 0, 1024, True)], delivered=1024, tail=32))
    # One full batch short: a batch is still to come.
    assert not _delivered_to_end(_cursor([(0, 0, 1024, True)], delivered=992, tail=32))
    # Part of the first unit only: 26 rows received past the delivered ones, more planned.
    assert not _delivered_to_end(_cursor([(0, 0, 512, False)], delivered=480, tail=32))
    # Resumed at row 512: the same rule from there.
    assert _delivered_to_end(_cursor([(0, 512, 1024, True)], delivered=1024, tail=32,
                                     base=512))
