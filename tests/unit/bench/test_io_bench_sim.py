"""The I/O bench's cache simulation: it counts as the caches do, and its references bound them."""

from __future__ import annotations

import numpy as np
import pytest

from raying.bench._io_data import TraceUnit, make_trace, simulated_hit_ratio, trace_rates


def _trace(seq: list[list[int]]) -> list[TraceUnit]:
    return [TraceUnit(0, np.array(u), np.full(len(u), 0.1)) for u in seq]


def test_small_traces_by_hand():
    sizes = np.full(4, 84)  # 100 bytes per entry with the header
    # LRU of two entries on 0 1 2 0 1 2: every lookup misses; Belady keeps 0 and hits it.
    trace = _trace([[0, 1, 2], [0, 1, 2]])
    assert simulated_hit_ratio(trace, sizes, 200, "lru") == 0.0
    assert simulated_hit_ratio(trace, sizes, 200, "oracle") == pytest.approx(2 / 6)
    # Repeats inside a unit are one lookup (the fetch reads a file once per unit).
    assert simulated_hit_ratio(_trace([[3, 3, 3], [3]]), sizes, 100, "lru") == 0.5
    # Known rates: only the highest-rate entries that fit are ever admitted.
    rates = np.array([1.0, 5.0, 0.1, 0.1])
    ideal = simulated_hit_ratio(_trace([[0, 1], [0, 1], [1]]), sizes, 100, "ideal", rates)
    assert ideal == pytest.approx(2 / 5)
    # Known rates at every moment: 0 is admitted while the cache has room, then 1 replaces
    # it (higher rate) and stays; 2 never beats 1.
    got = simulated_hit_ratio(_trace([[0], [1], [0], [1], [2], [1]]), sizes, 100, "rates",
                              rates)
    assert got == pytest.approx(2 / 6)
    with pytest.raises(ValueError, match="rates"):
        simulated_hit_ratio(trace, sizes, 100, "rates")


@pytest.mark.parametrize("seed", [0, 1])
def test_references_order_and_the_full_cache_limit(seed):
    n = 600
    sizes = np.random.default_rng(seed).integers(20_000, 90_000, n)
    trace = make_trace(n, epochs=3, sigma=1.0, seed=seed, block_rows=128)
    rates = trace_rates(n, sigma=1.0, seed=seed)
    lookups = sum(len(set(u.ids.tolist())) for u in trace)
    distinct = len({int(i) for u in trace for i in u.ids})
    full = int(sizes.sum()) + 16 * n
    for policy in ("lru", "ideal", "rates", "oracle"):  # room for all: only first touches miss
        got = simulated_hit_ratio(trace, sizes, full, policy, rates)
        assert got == pytest.approx(1 - distinct / lookups)
    for frac in (0.1, 0.2):
        cap = int(frac * sizes.sum())
        lru = simulated_hit_ratio(trace, sizes, cap, "lru")
        ideal = simulated_hit_ratio(trace, sizes, cap, "ideal", rates)
        known = simulated_hit_ratio(trace, sizes, cap, "rates", rates)
        oracle = simulated_hit_ratio(trace, sizes, cap, "oracle")
        assert 0 < lru < ideal < known < oracle < 1 - distinct / lookups


def test_bound_sweep_peaks_between_uniform_and_concentrated():
    """Part 4: ranking by true rate gains most over LRU at a middle spread of difficulty.

    Uniform draws leave nothing to rank (every cache holds its share); very concentrated ones
    let LRU keep the hot set too. The sweep must show both ends below the middle.
    """
    import argparse

    from raying.bench._io_data import bound_study

    sizes = np.random.default_rng(0).integers(1_500, 2_500, 2_000)
    args = argparse.Namespace(sigmas=[0.05, 1.0, 3.0], seeds=1, epochs=3)
    rows = bound_study(sizes, args)
    ratio = {r["sigma"]: r["10%"]["ratio"] for r in rows}
    assert ratio[1.0] > 1.3
    assert ratio[0.05] < ratio[1.0] and ratio[3.0] < ratio[1.0]
    for r in rows:
        for cap in ("10%", "15%", "20%"):
            assert 0 < r[cap]["lru"] <= r[cap]["known_rates"] < 1
