"""The noisy-label guard of the priority table: persistently high-loss rows drawn at the mean."""

from __future__ import annotations

import numpy as np
import pytest

from raying.errors import ConfigError
from raying.sampling import PriorityTable
from tests.helpers_state import run_state_roundtrip


def _table(**kw) -> PriorityTable:
    t = PriorityTable(10, alpha=1.0, uniform_mix=0.0, guard_after=3, guard_quantile=0.8, **kw)
    t.update(np.arange(10), np.array([1.0] * 8 + [10.0, 10.0]))
    t.refresh_guard()  # threshold: the 0.8 quantile (2.8); level: the mean (2.8)
    return t


def test_rows_high_for_k_reports_are_drawn_at_the_mean_priority():
    t = _table()
    assert t.guard_summary()["threshold"] == pytest.approx(np.quantile(
        [1.0] * 8 + [10.0] * 2, 0.8))
    level = t.guard_summary()["level"]
    for k in range(3):
        assert not t.guarded()[8]
        t.update([8, 9], [10.0, 10.0])
        t.update([9], [1.0]) if k == 1 else None  # row 9 drops below: its count restarts
    assert t.guarded()[8] and not t.guarded()[9]
    p = t.probabilities()
    # Row 8 counts as ``level`` now; its raw priority is kept (InfoBatch and stats read it).
    # (row 9 went back to 10.0 after its drop: high again, but only once in a row.)
    assert p[8] == pytest.approx(level / (8 * 1.0 + level + 10.0))
    assert t.priorities([8])[0] == 10.0
    summary = t.guard_summary()
    assert summary["guarded"] == 1 and summary["top_rows"] == 2 and summary["persistent_top"] == 1
    # One report below the threshold releases it.
    t.update([8], [0.5])
    assert not t.guarded()[8] and t.probabilities()[8] == pytest.approx(0.5 / 18.5)


def test_a_high_loss_that_keeps_falling_is_progress_not_a_streak():
    from raying.options import DEFAULT_GUARD_DECLINE

    t = _table()
    # Row 8: a hard sample being learned, each report well below its streak's first loss
    # (yet still above the threshold); row 9: a mislabelled one, its loss flat or rising.
    falling = [20.0]
    for _ in range(4):
        falling.append(falling[-1] * (1.0 - DEFAULT_GUARD_DECLINE) * 0.95)
    assert falling[-1] > t.guard_summary()["threshold"]
    for k, loss in enumerate(falling):
        t.update([8, 9], [loss, 20.0 + k])
    assert not t.guarded()[8] and t.guarded()[9]
    # A loss that falls, but by less than the decline, does not count as progress.
    u = _table()
    for k in range(3):
        u.update([8], [10.0 * (1.0 - DEFAULT_GUARD_DECLINE / 2) ** k])
    assert u.guarded()[8]


def test_a_held_row_stays_held_while_high_even_as_its_loss_falls():
    """Progress keeps a row from being held, not a held row from staying held: a flipped
    label being memorised shows falling losses too. Only a report below the threshold
    releases it."""
    from raying.options import DEFAULT_GUARD_DECLINE

    t = _table()
    for _ in range(3):
        t.update([8], [20.0])
    assert t.guarded()[8]
    loss = 20.0
    for _ in range(3):
        loss *= (1.0 - DEFAULT_GUARD_DECLINE) * 0.9  # progress, still above the threshold
        assert loss > t.guard_summary()["threshold"]
        t.update([8], [loss])
        assert t.guarded()[8]
    t.update([8], [1.0])
    assert not t.guarded()[8]


def test_the_guard_changes_nothing_before_its_first_refresh_or_when_off():
    t = PriorityTable(4, guard_after=1)
    t.update([0], [5.0])
    t.update([0], [5.0])
    assert not t.guarded().any()  # threshold inf until refresh_guard
    off = PriorityTable(4)
    off.update([0], [5.0])
    assert off.refresh_guard() == float("inf") and off.guard_summary()["guarded"] == 0


def test_guard_state_roundtrip():
    def make():
        return _table(seed=1)

    def advance(t):
        for _ in range(3):
            t.update([8], [10.0])

    def observe(t):
        ids, probs = t.sample(64)
        return {"ids": ids, "probs": probs, "guarded": t.guarded()}

    run_state_roundtrip(make, advance, observe)


def test_states_saved_without_the_guard_load():
    t = _table()
    state = t.state_dict()
    for key in ("streak", "guard_threshold", "guard_level"):
        del state[key]
    u = _table()
    u.load_state_dict(state)
    assert not u.guarded().any() and u.guard_summary()["threshold"] is None


@pytest.mark.parametrize(("kw", "match"), [
    ({"guard_after": 0}, r"guard_after must be an integer >= 1 .* got 0; pass e.g. guard_after=6"),
    ({"guard_quantile": 1.5}, r"guard_quantile must be a finite number > 0.0 and <= 1.0"),
])
def test_bad_guard_settings_are_refused(kw, match):
    with pytest.raises(ConfigError, match=match):
        PriorityTable(4, **kw)
