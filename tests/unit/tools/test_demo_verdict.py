"""The demo's headline: a seed that never reached the target is not dropped from it."""

from __future__ import annotations

from raying.tools.demo import verdict
from raying.tools.demo_report import _censored_median


def test_misses_count_as_more_steps_than_any_success():
    assert _censored_median([300, 320, 500]) == 320
    assert _censored_median([None, None, 400]) is None  # two of three seeds never got there
    assert _censored_median([None, 300, 400]) == 400
    assert _censored_median([]) is None


def _arm(steps, budget=1200):
    return {"steps_to_target": steps, "steps_to_target_median": _censored_median(steps),
            "reached_target": sum(s is not None for s in steps), "rare_acc": 0.5,
            "steps": [budget] * len(steps)}


def test_the_verdict_says_how_many_seeds_reached_the_target():
    summary = {"target": 0.9, "arms": {"uniform": _arm([None, None, 400]),
                                       "prioritized": _arm([300, 320, 500])}}
    text = verdict(summary)
    assert text.startswith("Prioritized reached 90% in 320 steps; uniform did not within 1200")
    assert "reached in 3 of 3 seeds prioritized, 1 of 3 uniform" in text
