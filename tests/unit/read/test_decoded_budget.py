"""The decoded cache's budget: on only where the decoded dataset fits, never for pixels."""

from __future__ import annotations

import pytest

from raying.errors import ConfigError
from raying.read import decoded_cache


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
