"""A pipeline's sampling health figures: what its own iterations read, or nothing."""

from __future__ import annotations

import numpy as np

from raying.engine.metrics import RunAccount


class _Manifest:
    def __len__(self) -> int:
        return 4


def test_a_process_that_read_nothing_tells_no_coverage():
    # A Ray Train driver: its workers read, the store counts their draws; 0 coverage and a
    # never-drawn share of 1 beside those counts would say nothing was drawn.
    account = RunAccount(_Manifest())
    health = account.health()
    assert (health["coverage_epoch"], health["never_drawn_share"], health["per_epoch"]) == (
        None, None, [])
    account.observe_block(0, {"id": np.array([0, 2]), "weight": np.ones(2, np.float32)})
    health = account.health()
    assert (health["coverage_epoch"], health["never_drawn_share"]) == (0.5, 0.5)
