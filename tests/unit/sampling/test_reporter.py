"""The reporter's flushes reach the store in the order their losses were reported."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import raying.sampling.store as store
from raying.errors import ConfigError
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


def _reporter(monkeypatch) -> tuple[Reporter, list]:
    import ray

    sent: list = []
    monkeypatch.setattr(store, "update_async", lambda h, i, v: sent.append((i, v)))
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    return Reporter(handle=None, flush_ids=1, flush_s=60), sent


# (ids, losses) a loop might pass by mistake; every sampler refuses them alike.
_WRONG = [
    ("a reduced loss", np.arange(4), np.float32(0.5)),
    ("per-token losses", np.arange(4), np.ones((4, 7), np.float32)),
    ("a layout that pairs by accident", np.arange(4), np.ones((2, 2), np.float32)),
    ("float losses as strings", np.arange(2), ["0.1", "0.2"]),
    ("boolean ids", np.array([True, False]), np.ones(2)),
    ("complex losses", np.arange(2), np.ones(2, np.complex64)),
]


@pytest.mark.parametrize(("what", "ids", "losses"), _WRONG, ids=[w[0] for w in _WRONG])
def test_samplers_that_drop_losses_refuse_what_a_prioritized_one_refuses(monkeypatch, what,
                                                                          ids, losses):
    from raying import UniformSampler, WeightedSampler

    rep, _ = _reporter(monkeypatch)
    with pytest.raises(ConfigError) as prioritized:
        rep.add(ids, losses)
    for sampler in (UniformSampler(), WeightedSampler(np.ones(4))):
        with pytest.raises(ConfigError) as dropped:
            sampler.report(ids, losses)
        assert str(dropped.value).split(";")[0].split(",")[0] == \
            str(prioritized.value).split(";")[0].split(",")[0], what


def test_samplers_that_drop_losses_check_tensors_without_copying_them(monkeypatch):
    torch = pytest.importorskip("torch")
    from raying import UniformSampler

    def no_copy(*args, **kwargs):
        raise AssertionError("a tensor was copied to check it")

    ids, losses = torch.arange(8), torch.rand(8)
    monkeypatch.setattr(torch.Tensor, "numpy", no_copy)
    monkeypatch.setattr(torch.Tensor, "cpu", no_copy)
    UniformSampler().report(ids, losses)  # right: accepted
    UniformSampler().report(ids, losses.to(torch.bfloat16))
    with pytest.raises(ConfigError, match="reduced"):
        UniformSampler().report(ids, losses.mean())
    with pytest.raises(ConfigError, match="ids must be integers"):
        UniformSampler().report(ids > 3, losses)
    with pytest.raises(ConfigError, match="real numbers"):
        UniformSampler().report(ids, torch.ones(8, dtype=torch.complex64))


def test_a_length_mismatch_is_logged_once_by_samplers_that_drop_losses(caplog, monkeypatch):
    import raying.sampling.feedback as feedback
    from raying import UniformSampler

    monkeypatch.setattr(feedback, "_warned_length", False)
    with caplog.at_level("WARNING", logger="raying.sampling.feedback"):
        UniformSampler().report(np.arange(4), np.ones(3))
        UniformSampler().report(np.arange(4), np.ones(3))
    assert [r.getMessage() for r in caplog.records if "reject" in r.getMessage()] == [
        "raying.report: 4 ids but losses of shape (3,); this sampler does not use losses, but "
        "a prioritized one would reject and count the batch (pass one loss per id)"]
