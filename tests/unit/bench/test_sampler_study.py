"""The sampler study's settled accuracy: the mean of the evaluations of the last steps."""

import pytest

from raying.bench.sampler_study import NOISE_SETTLE_STEPS, settled_accuracy


def test_settled_accuracy_averages_the_evaluations_of_the_last_window_only():
    curve = [(s, 0.5) for s in range(5, 501, 5)] + [(s, 0.9 + (s % 10) / 100)
                                                    for s in range(505, 601, 5)]
    # Steps 505..600: 20 evaluations alternating 0.95 and 0.90; step 500 is outside.
    assert NOISE_SETTLE_STEPS == 100
    assert settled_accuracy(curve, 600) == pytest.approx(0.925)
    assert settled_accuracy(curve, 600, window=10) == pytest.approx((0.95 + 0.9) / 2)


def test_settled_accuracy_is_none_without_evaluations_in_the_window():
    assert settled_accuracy([], 600) is None
    assert settled_accuracy([(100, 0.8)], 600) is None
