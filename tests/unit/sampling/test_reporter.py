"""The reporter's flushes reach the store in the order their losses were reported."""

from __future__ import annotations

import threading

import numpy as np

import raying.sampling.store as store
from raying.sampling.feedback import Reporter


def test_a_flush_waits_for_the_one_sending_before_it(monkeypatch):
    import ray

    received: list[tuple[list[int], list[float]]] = []
    first_in, go = threading.Event(), threading.Event()

    def update_async(handle, ids, values):
        if not first_in.is_set():  # the older report's send is slow (pickling, a busy driver)
            first_in.set()
            go.wait(10)
        received.append((ids.tolist(), values.tolist()))

    monkeypatch.setattr(store, "update_async", update_async)
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    rep = Reporter(handle=None, flush_ids=1_000, flush_s=60)
    rep.add(np.array([7]), np.array([1.0]))
    older = threading.Thread(target=rep.flush)  # as the reporter's timer does
    older.start()
    assert first_in.wait(10)
    rep.add(np.array([7, 8]), np.array([2.0, 2.0]))  # a newer loss of id 7
    newer = threading.Thread(target=rep.flush)
    newer.start()
    newer.join(0.2)
    go.set()
    older.join(10)
    newer.join(10)
    # "last wins" at the store: the newer loss must arrive last.
    assert received == [([7], [1.0]), ([7, 8], [2.0, 2.0])]
    assert (rep.sends, rep.sent) == (2, 3)
