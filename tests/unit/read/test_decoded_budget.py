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

    fits = decoded_cache.plan_budget("auto", _M(300), size_of=sizes)  # ~9.5 MB
    too_big = decoded_cache.plan_budget("auto", _M(400), size_of=sizes)  # ~12.6 MB
    assert fits == 10_000_000 and too_big == 0
    assert asked == [16, 16]  # headers of a probe, not of every file
    unknown = decoded_cache.plan_budget("auto", _M(10), size_of=lambda ids: [None] * len(ids))
    assert unknown == 0  # no header read: no estimate, no cache


@pytest.mark.parametrize("bad", ["on", -5, 2.5, True])
def test_a_bad_setting_names_the_choices(bad):
    with pytest.raises(ConfigError, match=r"decoded_cache must be 'auto', 'off' or a positive "
                                          r"number of bytes"):
        decoded_cache.plan_budget(bad, _M(10))
