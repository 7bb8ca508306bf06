"""PriorityTable: exact distributions, systematic bounds, weights, tree accuracy, state."""

from __future__ import annotations

import math

import numpy as np
import pytest

from raying.errors import ConfigError
from raying.sampling import PriorityTable
from tests.helpers_state import run_state_roundtrip

# --- a chi-square test without scipy ---------------------------------------------------------


def chi2_sf(stat: float, df: int) -> float:
    """Upper tail ``P(X >= stat)`` of a chi-square with ``df`` degrees of freedom.

    The regularized upper incomplete gamma ``Q(df/2, stat/2)``: a power series below the mean,
    Lentz's continued fraction above it (Numerical Recipes, gammq).
    """
    a, x = df / 2.0, stat / 2.0
    if x <= 0.0:
        return 1.0
    log_front = -x + a * math.log(x) - math.lgamma(a)
    if x < a + 1.0:
        term = total = 1.0 / a
        for i in range(1, 10_000):
            term *= x / (a + i)
            total += term
            if abs(term) < abs(total) * 1e-16:
                break
        return max(0.0, 1.0 - total * math.exp(log_front))
    tiny = 1e-300
    b = x + 1.0 - a
    c = 1.0 / tiny
    d = 1.0 / b
    h = d
    for i in range(1, 10_000):
        an = -i * (i - a)
        b += 2.0
        d = an * d + b
        d = tiny if abs(d) < tiny else d
        c = b + an / c
        c = tiny if abs(c) < tiny else c
        d = 1.0 / d
        delta = d * c
        h *= delta
        if abs(delta - 1.0) < 1e-16:
            break
    return math.exp(log_front) * h


def chi2_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    """Pearson's chi-square p-value of observed counts against probabilities (all > 0)."""
    counts = np.asarray(counts, dtype=np.float64)
    expected = counts.sum() * np.asarray(probs, dtype=np.float64)
    stat = float(np.sum((counts - expected) ** 2 / expected))
    return chi2_sf(stat, counts.size - 1)


def test_chi2_sf_matches_closed_forms():
    # df = 1: erfc(sqrt(x/2)); df = 2: exp(-x/2); even df: Poisson sum.
    for x in (0.1, 1.0, 3.841458820694124, 12.0, 40.0):
        assert chi2_sf(x, 1) == pytest.approx(math.erfc(math.sqrt(x / 2)), rel=1e-10)
        assert chi2_sf(x, 2) == pytest.approx(math.exp(-x / 2), rel=1e-10)
    for x in (30.0, 64.0, 90.0, 150.0):
        poisson = math.exp(-x / 2) * math.fsum((x / 2) ** i / math.factorial(i) for i in range(32))
        assert chi2_sf(x, 64) == pytest.approx(poisson, rel=1e-9)


@pytest.fixture(params=["shortcut", "tree", "mixed"])
def descent(request, monkeypatch):
    """Sample through each path: a CDF search over the top levels, the pure tree, or both."""
    import raying.sampling.sumtree as sumtree

    nodes = {"shortcut": sumtree._SHORTCUT_NODES, "tree": 1, "mixed": 16}[request.param]
    monkeypatch.setattr(sumtree, "_SHORTCUT_NODES", nodes)
    return request.param


def spanning_priorities(n: int = 64, seed: int = 1) -> np.ndarray:
    """Priorities over two decades (1 to 100) in shuffled order; the last row carries 100."""
    p = np.logspace(0.0, 2.0, n)
    rng = np.random.default_rng(seed)
    p[:-1] = rng.permutation(p[:-1])
    return p


def draw_counts(table: PriorityTable, total: int, batch: int = 4096,
                systematic: bool = False) -> np.ndarray:
    counts = np.zeros(len(table), dtype=np.int64)
    left = total
    while left:
        ids, probs = table.sample(min(batch, left), systematic=systematic)
        np.testing.assert_array_equal(probs, table.probabilities(ids))
        counts += np.bincount(ids, minlength=len(table))
        left -= ids.size
    return counts


# --- distributions -----------------------------------------------------------------------------


def test_iid_draws_follow_the_mixture_chi_square(descent):
    p = spanning_priorities()
    alpha, eps = 0.7, 0.1
    table = PriorityTable(p.size, alpha=alpha, uniform_mix=eps, seed=3)
    table.update(np.arange(p.size), p)
    expected = (1 - eps) * p**alpha / np.sum(p**alpha) + eps / p.size
    np.testing.assert_allclose(table.probabilities(), expected, rtol=1e-13)

    counts = draw_counts(table, 200_000)
    assert counts.sum() == 200_000
    assert chi2_pvalue(counts, expected) > 1e-3
    # The last index carries the largest weight and is drawn as often as it should be.
    assert abs(counts[-1] - 200_000 * expected[-1]) < 5 * math.sqrt(200_000 * expected[-1])

    # The statistic can fail: the same counts against wrong distributions are rejected.
    wrong_alpha = (1 - eps) * p / p.sum() + eps / p.size
    assert chi2_pvalue(counts, wrong_alpha) < 1e-9
    off_by_one = np.roll(expected, 1)
    assert chi2_pvalue(counts, off_by_one) < 1e-9
    no_floor = p**alpha / np.sum(p**alpha)
    assert chi2_pvalue(counts, no_floor) < 1e-9


def test_draws_never_without_last_index_and_reject_a_buggy_sampler():
    # A sampler with the classic off-by-one (never returns the last index) must fail the test.
    p = spanning_priorities()
    probs = p / p.sum()
    rng = np.random.default_rng(0)
    cdf = np.cumsum(probs)
    buggy = np.minimum(np.searchsorted(cdf, rng.random(200_000) * cdf[-1]), p.size - 2)
    assert chi2_pvalue(np.bincount(buggy, minlength=p.size), probs) < 1e-9


def test_zero_weight_rows_are_never_drawn(descent):
    n = 67  # odd: padding leaves sit next to real ones
    p = spanning_priorities(n, seed=5)
    zeros = np.array([0, 1, 31, 32, 33, 63, 64, 65])  # edges of subtrees, next to the last
    p[zeros] = 0.0
    table = PriorityTable(n, seed=11)
    table.update(np.arange(n), p)
    for systematic in (False, True):
        counts = draw_counts(table, 200_000, systematic=systematic)
        assert np.all(counts[zeros] == 0)
        live = p > 0
        assert counts[-1] > 0
        assert chi2_pvalue(counts[live], p[live] / p[live].sum()) > 1e-3


def test_uniform_until_losses_arrive_and_alpha_zero():
    table = PriorityTable(100, seed=0)
    np.testing.assert_array_equal(table.probabilities(), np.full(100, 0.01))
    assert chi2_pvalue(draw_counts(table, 100_000), np.full(100, 0.01)) > 1e-3
    flat = PriorityTable(10, alpha=0.0)
    flat.update(np.arange(10), np.arange(10.0) + 1)
    np.testing.assert_allclose(flat.probabilities(), 0.1, rtol=1e-15)


def test_all_zero_priorities_sample_uniformly(descent):
    table = PriorityTable(10, uniform_mix=0.0, seed=2)
    table.update(np.arange(10), np.zeros(10))
    assert table.total() == 0.0
    np.testing.assert_array_equal(table.probabilities(), np.full(10, 0.1))
    ids, probs = table.sample(1000, systematic=True)
    np.testing.assert_array_equal(np.bincount(ids, minlength=10), np.full(10, 100))
    np.testing.assert_array_equal(probs, 0.1)
    np.testing.assert_array_equal(table.weights(probs, beta=1.0), 1.0)
    counts = draw_counts(table, 50_000)
    assert chi2_pvalue(counts, np.full(10, 0.1)) > 1e-3


@pytest.mark.parametrize(("n", "eps"), [(64, 0.0), (1000, 0.0), (1000, 0.25), (4097, 0.05)])
def test_systematic_plans_respect_floor_and_ceil(n, eps, descent):
    rng = np.random.default_rng(n)
    table = PriorityTable(n, alpha=0.8, uniform_mix=eps, seed=n)
    batch = 4096
    for round_ in range(40):
        p = 10.0 ** rng.uniform(-2, 2, n)
        p[rng.random(n) < 0.1] = 0.0
        p[-1] = 50.0 if round_ % 2 else p[-1]
        table.update(np.arange(n), p)
        expected = table.probabilities() * batch
        ids, _ = table.sample(batch, systematic=True)
        assert np.all(np.diff(ids) >= 0)  # plans come out in id order
        counts = np.bincount(ids, minlength=n)
        # 1e-6 absorbs the float rounding of the tree's partial sums (about 1e-12 here).
        assert np.all(counts >= np.floor(expected - 1e-6)), round_
        assert np.all(counts <= np.ceil(expected + 1e-6)), round_
        if eps == 0.0:
            assert np.all(counts[p == 0] == 0)


# --- importance weights ------------------------------------------------------------------------


def test_a_weight_never_underflows_to_zero_in_float32():
    """No uniform floor and one extreme loss: the likeliest row's weight (~1e-60) would be 0
    as the float32 batches carry it; it stays positive, as (0, 1] promises."""
    from raying.sampling.weights import importance_weights

    probs = np.array([1.0 - 1e-58, 1e-60])
    w = importance_weights(probs, size=2, min_prob=1e-60, beta=1.0).astype(np.float32)
    assert np.all(w > 0) and w[1] == 1.0


@pytest.mark.parametrize("eps", [0.0, 0.2])
@pytest.mark.parametrize("beta", [0.0, 0.4, 1.0])
def test_importance_weights_equal_the_formula(eps, beta):
    p = spanning_priorities(100, seed=9)
    p[[3, 50]] = 0.0
    table = PriorityTable(100, alpha=0.6, uniform_mix=eps, beta=beta, seed=1)
    table.update(np.arange(100), p)
    ids, probs = table.sample(4096)
    all_p = table.probabilities()
    possible = all_p[all_p > 0]
    expected = (100 * probs) ** -beta / np.max((100 * possible) ** -beta)
    np.testing.assert_allclose(table.weights(probs), expected, rtol=1e-12, atol=0)
    np.testing.assert_allclose(table.importance_weights(ids, beta), expected, rtol=1e-12, atol=0)
    assert np.all(table.weights(probs) <= 1.0 + 1e-15)
    assert table.min_probability() == possible.min()


def test_min_probability_stays_exact_through_updates():
    # The weight normaliser is tracked incrementally; check it against a rescan after each step.
    rng = np.random.default_rng(8)
    for eps in (0.0, 0.3):
        table = PriorityTable(500, uniform_mix=eps, alpha=0.9)
        for _ in range(300):
            ids = rng.integers(0, 500, rng.integers(1, 60))
            values = rng.choice([0.0, 0.5, 1.0, 2.0, 3.0], ids.size) * rng.integers(1, 3)
            table.update(ids, values)
            probs = table.probabilities()
            positive = probs[probs > 0]
            assert table.min_probability() == (positive.min() if positive.size else 1 / 500)


# --- the tree stays exact ----------------------------------------------------------------------


def test_root_equals_fsum_after_a_million_updates():
    n = 100_003
    table = PriorityTable(n, alpha=1.0, seed=0)
    rng = np.random.default_rng(42)
    for _ in range(100):
        ids = rng.integers(0, n, 10_000)
        table.update(ids, rng.lognormal(0.0, 3.0, ids.size))  # values over ~8 decades
    assert table.counters["update_calls"] == 100
    leaves = table._tree.leaves
    exact = math.fsum(leaves.tolist())
    assert abs(table.total() - exact) <= 1e-9 * exact
    # Every parent equals the float sum of its two children: nothing drifted.
    for lower, upper in zip(table._tree.levels, table._tree.levels[1:], strict=False):
        np.testing.assert_array_equal(upper[: lower.size // 2], lower[0::2] + lower[1::2])


def test_duplicate_ids_last_one_wins():
    table = PriorityTable(5)
    table.update([3, 1, 3, 3, 1], [1.0, 2.0, 3.0, 4.0, 5.0])
    np.testing.assert_array_equal(table.priorities(), [1.0, 5.0, 1.0, 4.0, 1.0])
    assert table.total() == 12.0


# --- rejection ---------------------------------------------------------------------------------


def test_bad_updates_are_rejected_counted_and_leave_the_table_unchanged():
    table = PriorityTable(8, uniform_mix=0.1)
    table.update(np.arange(8), np.arange(8.0) + 1)
    before = table.state_dict()
    applied = table.update([0, 1, 2, 8, -1, 5.5, 3],
                           [np.nan, np.inf, -1.0, 1.0, 1.0, 1.0, -np.inf])
    assert applied == 0
    table.update([0, 1], [1.0])  # length mismatch: the whole call is refused
    assert table.rejected == {"length_mismatch": 2, "not_integer": 1, "out_of_range": 2,
                              "nan": 1, "inf": 2, "negative": 1}
    np.testing.assert_array_equal(table.priorities(), before["priorities"])
    assert table.total() == 36.0
    # Valid entries of a mixed call still apply.
    assert table.update([0, 9, 1], [10.0, 10.0, np.nan]) == 1
    assert table.priorities([0, 1]).tolist() == [10.0, 2.0]
    assert table.rejected["out_of_range"] == 3 and table.rejected["nan"] == 2


def test_non_numeric_updates_raise_with_a_fix():
    table = PriorityTable(4)
    with pytest.raises(ConfigError, match=r"ids must be integers, got dtype <U1; pass the int64"):
        table.update(["a"], [1.0])
    with pytest.raises(ConfigError, match="priorities must be real numbers, got list"):
        table.update([0], [["x"]])


def test_tensor_updates_of_any_float_dtype_and_with_gradients_are_taken():
    torch = pytest.importorskip("torch")
    table = PriorityTable(10)
    assert table.update(torch.tensor([4, 5]), torch.tensor([1.5, 2.5], dtype=torch.bfloat16)) == 2
    assert table.update(torch.tensor([6]), torch.tensor([2.0], requires_grad=True)) == 1
    assert table.update(np.array([7]), torch.tensor([0.5], dtype=torch.float16)) == 1
    p = table.probabilities()
    assert p[5] / p[4] == pytest.approx(2.5 / 1.5) and p[6] / p[4] == pytest.approx(2.0 / 1.5)
    assert p[7] / p[4] == pytest.approx(0.5 / 1.5)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"alpha": -1}, r"alpha must be a finite number >= 0.0, got -1.0; pass e.g. alpha=0.6"),
    ({"uniform_mix": 1.5}, r"uniform_mix must be a finite number >= 0.0 and <= 1.0, got 1.5"),
    ({"beta": float("nan")}, r"beta must be a finite number >= 0.0, got nan"),
    ({"cap_quantile": 0}, r"cap_quantile must be a finite number > 0.0 and <= 1.0, got 0.0"),
    ({"age_after": 0}, r"age_after must be an integer >= 1 \(update calls\) or None, got 0"),
    ({"age_rate": 0.0}, r"age_rate must be a finite number > 0.0 and <= 1.0, got 0.0"),
    ({"seed": -3}, r"seed must be an integer >= 0, got -3"),
])
def test_constructor_echoes_bad_values(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        PriorityTable(10, **kwargs)
    with pytest.raises(ValueError):  # ConfigError is a ValueError
        PriorityTable(10, **kwargs)


def test_bad_sizes_are_refused():
    with pytest.raises(ConfigError, match=r"n must be an integer >= 1 \(the number of samples\), got 0"):
        PriorityTable(0)
    with pytest.raises(ConfigError, match="k must be an integer >= 0"):
        PriorityTable(3).sample(-1)


# --- cap and aging -----------------------------------------------------------------------------


def test_cap_clips_at_the_quantile_after_refresh():
    table = PriorityTable(100, cap_quantile=0.9)
    table.update(np.arange(100), np.arange(100.0))
    assert table.total() == sum(range(100))  # no threshold before the first refresh
    threshold = table.refresh_cap()
    assert threshold == np.quantile(np.arange(100.0), 0.9)
    np.testing.assert_allclose(table.total(), np.minimum(np.arange(100.0), threshold).sum())
    table.update([0], [1e6])  # clipped at the threshold in force
    np.testing.assert_allclose(table.probabilities([0]), table.probabilities([99]))
    assert table.priorities([0])[0] == 1e6  # the stored priority is kept, only sampling clips


def test_aging_moves_stale_rows_toward_the_mean():
    table = PriorityTable(4, age_after=2, age_rate=0.5)
    table.update([0, 1, 2, 3], [8.0, 0.0, 4.0, 4.0])  # clock 1
    table.update([2], [4.0])  # clock 2
    table.update([2], [4.0])  # clock 3: rows 0, 1 and 3 went unrefreshed for 2 calls: stale
    table.update([3], [4.0])  # clock 4: rows 0 and 1 age by one call, row 3 is fresh again
    moved = table.age()
    assert moved == 2
    mean = 4.0
    np.testing.assert_allclose(table.priorities(), [mean + 4 * 0.5, mean - 4 * 0.5, 4.0, 4.0])
    table.update([3], [4.0])  # clock 5
    table.update([3], [4.0])  # clock 6: two more calls, compounded: gap * 0.5**2
    assert table.age() == 3  # row 2 went stale at clock 5
    np.testing.assert_allclose(table.priorities()[:2], [mean + 2 * 0.25, mean - 2 * 0.25])
    assert table.age() == 0  # nothing new since the last pass
    summary = table.age_summary()
    assert summary["max"] == 5 and summary["clock"] == 6
    assert summary["stale_share"] == 0.75


# --- state -------------------------------------------------------------------------------------


@pytest.mark.parametrize("systematic", [False, True])
def test_state_round_trip_continues_identically(systematic):
    def make():
        return PriorityTable(1000, alpha=0.7, uniform_mix=0.05, cap_quantile=0.95,
                             age_after=3, age_rate=0.2, seed=7)

    def advance(t):
        rng = np.random.default_rng(0)
        for _ in range(5):
            t.update(rng.integers(0, 1000, 300), rng.exponential(1.0, 300))
            t.sample(512, systematic=systematic)
        t.update([1, 2], [np.nan, -1.0])
        t.refresh_cap()
        t.age()

    def observe(t):
        seen = []
        for _ in range(3):
            seen.append(t.sample(4096, systematic=systematic))
            t.update(seen[-1][0][:10], np.ones(10))
            t.age()
        return {"draws": seen, "probs": t.probabilities(), "rejected": t.rejected,
                "counters": t.counters}

    run_state_roundtrip(make, advance, observe)


def test_load_refuses_a_state_with_other_settings():
    state = PriorityTable(10, alpha=0.5).state_dict()
    with pytest.raises(ConfigError, match=r"saved with \{'alpha': 0.5\}, this table has"):
        PriorityTable(10).load_state_dict(state)
    loose = PriorityTable(10)
    loose.load_state_dict(state, strict=False)
    assert loose.config.alpha == 1.0
    with pytest.raises(ConfigError, match="table state holds 10 rows, this table has 11"):
        PriorityTable(11).load_state_dict(state)


def test_a_state_loads_under_another_beta():
    # beta shapes only the weights of later draws; a schedule anneals it between checkpoints.
    saved = PriorityTable(10, beta=0.4)
    saved.update(np.arange(4), np.array([0.5, 1.0, 2.0, 4.0]))
    later = PriorityTable(10, beta=0.6)
    later.load_state_dict(saved.state_dict())
    assert np.allclose(later.probabilities(np.arange(10)), saved.probabilities(np.arange(10)))
    assert later.config.beta == 0.6


def test_grouped_draws_count_every_id_drawn():
    t = PriorityTable(1000, alpha=1.0, uniform_mix=0.1)
    ids, _ = t.sample_in_groups(4096, np.arange(0, 1000, 100), 16)
    assert ids.size == t.counters["samples"] == 4096


# --- the store's pure-numpy parts: coalescing and the snapshot format ---------------------------


def test_coalesce_last_max_and_ema():
    from raying.sampling.store_actor import coalesce

    ids = np.array([5, 2, 5, 5, 2, 9])
    values = np.array([1.0, 8.0, 3.0, 2.0, 4.0, 6.0])
    stored = {2: 10.0, 5: 0.0, 9: 2.0}

    def current(u):
        return np.array([stored[i] for i in u])

    got_ids, got = coalesce(ids, values, "last", 0.5, current)
    assert got_ids.tolist() == [2, 5, 9] and got.tolist() == [4.0, 2.0, 6.0]
    _, got = coalesce(ids, values, "max", 0.5, current)
    assert got.tolist() == [8.0, 3.0, 6.0]
    _, got = coalesce(ids, values, "ema", 0.5, current)

    def ema(p, reports):
        for v in reports:
            p = 0.5 * p + 0.5 * v
        return p

    np.testing.assert_allclose(got, [ema(10.0, [8.0, 4.0]), ema(0.0, [1.0, 3.0, 2.0]),
                                     ema(2.0, [6.0])], rtol=1e-15)


def test_snapshot_format_round_trips_the_table_state():
    from raying.sampling.store_actor import decode_snapshot, encode_snapshot

    def make():
        return PriorityTable(300, alpha=0.5, uniform_mix=0.1, cap_quantile=0.9, seed=4)

    def advance(t):
        t.update(np.arange(300), np.random.default_rng(1).exponential(size=300))
        t.refresh_cap()
        t.update([7], [np.inf])
        t.sample(100)

    def observe(t):
        return [t.sample(4096), t.sample(4096, systematic=True), t.rejected, t.counters]

    def through(state):
        table_state, counters = decode_snapshot(encode_snapshot(state, {"snapshots": 3}))
        assert counters == {"snapshots": 3}
        return table_state

    run_state_roundtrip(make, advance, observe, through=through)


@pytest.mark.parametrize(("alpha", "losses"), [(2.0, [1e200]), (1.0, [1e308, 1e308]),
                                               (8.0, [3e38, 3e38, 3e38])])
def test_diverging_losses_keep_the_distribution_finite(alpha, losses):
    n = 256
    table = PriorityTable(n, alpha=alpha, uniform_mix=0.1, seed=0)
    table.update(np.arange(n), np.ones(n))
    hot = np.arange(len(losses))
    table.update(hot, np.array(losses))
    assert np.isfinite(table.total()) and np.isfinite(table.ess())
    probs = table.probabilities()
    assert np.all(np.isfinite(probs)) and abs(probs.sum() - 1.0) < 1e-9
    ids, p = table.sample(4096)
    assert ids.min() >= 0 and ids.max() < n and np.all(np.isfinite(p))
    # the diverging rows hold (nearly) all the priority mass: 1 - uniform_mix of the draws
    share = np.isin(ids, hot).mean()
    assert abs(share - (0.9 + 0.1 * len(hot) / n)) < 0.03
    assert np.all(np.isfinite(table.importance_weights(ids, 0.5)))


# -- a prior under the losses ---------------------------------------------------------------------
def _mixture(prior, losses, eps, alpha=1.0):
    w = np.asarray(prior, dtype=float) / np.sum(prior)
    mass = w * np.asarray(losses, dtype=float) ** alpha
    return (1 - eps) * mass / mass.sum() + eps * w


@pytest.mark.parametrize("n", [7, 1000, 9000])  # 9000 crosses the descent's shortcut level
def test_a_prior_reweights_both_parts_of_the_mixture_exactly(n):
    rng = np.random.default_rng(5)
    prior = rng.uniform(0.0, 3.0, n)
    prior[rng.choice(n, n // 7 + 1, replace=False)] = 0.0  # never drawn
    t = PriorityTable(n, alpha=0.7, uniform_mix=0.3, seed=1, prior=prior)
    assert np.allclose(t.probabilities(), _mixture(prior, np.ones(n), 0.3, 0.7))
    losses = rng.exponential(2.0, n)
    t.update(np.arange(n), losses)
    want = _mixture(prior, losses, 0.3, 0.7)
    assert np.allclose(t.probabilities(), want) and t.probabilities().sum() == pytest.approx(1)
    assert t.min_probability() == pytest.approx(want[want > 0].min())
    k = 400_000
    ids, probs = t.sample(k)
    assert np.allclose(probs, want[ids])
    assert not np.any(prior[ids] == 0.0)
    # Chi-square over bins of about equal expected mass.
    order = np.argsort(want)
    live = order[want[order] > 0]
    bins = np.array_split(live, min(20, live.size))
    counts = np.bincount(ids, minlength=n)
    observed = np.array([counts[b].sum() for b in bins])
    expected = np.array([want[b].sum() for b in bins]) * k
    stat = float(np.sum((observed - expected) ** 2 / expected))
    assert chi2_sf(stat, len(bins) - 1) > 1e-3, (observed, expected)
    # Systematic plans and grouped draws keep the same marginals.
    ids_s, probs_s = t.sample(k, systematic=True)
    assert np.allclose(probs_s, want[ids_s])
    assert np.abs(np.bincount(ids_s, minlength=n) - k * want).max() <= 1.0 + 1e-9
    starts = np.arange(0, n, max(1, n // 13))
    ids_g, probs_g = t.sample_in_groups(k, starts, 4)
    assert np.allclose(probs_g, want[ids_g]) and not np.any(prior[ids_g] == 0.0)
    counts_g = np.bincount(ids_g, minlength=n)
    observed = np.array([counts_g[b].sum() for b in bins])
    stat = float(np.sum((observed - expected) ** 2 / expected))
    assert chi2_sf(stat, len(bins) - 1) > 1e-4, (observed, expected)


def test_a_prior_alone_draws_when_every_priority_is_zero():
    prior = np.array([1.0, 0.0, 3.0, 4.0])
    t = PriorityTable(4, uniform_mix=0.0, prior=prior)
    t.update(np.arange(4), np.zeros(4))
    assert np.allclose(t.probabilities(), prior / prior.sum())
    ids, probs = t.sample(80_000)
    assert np.allclose(probs, (prior / prior.sum())[ids])
    assert np.allclose(np.bincount(ids, minlength=4) / 80_000, prior / prior.sum(), atol=0.01)


def test_a_prior_survives_state_round_trips_and_is_validated():
    prior = np.arange(1.0, 6.0)
    t = PriorityTable(5, uniform_mix=0.1, prior=prior)
    t.update([0, 4], [5.0, 0.5])
    u = PriorityTable(5, uniform_mix=0.1, prior=prior)
    u.load_state_dict(t.state_dict())
    assert np.allclose(u.probabilities(), t.probabilities())
    assert np.allclose(t.prior, prior * 5 / prior.sum())
    for bad in ([1.0, 2.0], [1, 2, 3, 4, -1], [0, 0, 0, 0, 0], [1, 2, np.nan, 4, 5]):
        with pytest.raises(ConfigError, match="prior"):
            PriorityTable(5, prior=bad)


def test_the_leaf_summary_gives_the_exact_ess_and_least_probability_with_a_prior():
    import math

    from raying.sampling.store import _global_mixture

    rng = np.random.default_rng(8)
    for prior in (None, rng.uniform(0.0, 2.0, 500)):
        t = PriorityTable(500, alpha=0.8, uniform_mix=0.2, prior=prior)
        t.update(np.arange(500), rng.exponential(1.0, 500))
        info = t.leaf_summary()
        a, b, min_prob = _global_mixture([info], 500, 0.2)
        sum_p2 = a * a * info["sum_sq"] + 2 * a * b * info["cross"] + b * b * info["floor_sq"]
        assert 1.0 / sum_p2 == pytest.approx(t.ess(), rel=1e-9)
        assert min_prob == pytest.approx(t.min_probability(), rel=1e-12)
        assert math.isfinite(min_prob) and min_prob > 0


def test_a_prefix_of_grouped_draws_in_group_order_is_spread_over_the_ids():
    """Units take a buffer of grouped draws front to back: in ``group_order`` each stage-one
    pick's draws stay together and ascending, and the buffer's first quarter holds as many
    draws of the upper half of the ids as of the lower (sorted by id it held none) from as
    many row groups as picks."""
    from raying.sampling.prioritized import group_order

    n, k, per = 960, 4096, 16
    starts = np.arange(0, n, 64)
    upper_share = []
    for seed in range(200):
        t = PriorityTable(n, seed=seed)
        ids, _ = t.sample_in_groups(k, starts, per)
        got = ids[group_order(ids, per, np.random.default_rng(seed))]
        runs = got.reshape(-1, per)
        assert np.all(np.diff(runs, axis=1) >= 0)  # ascending inside a pick
        group = np.searchsorted(starts, runs, side="right") - 1
        assert np.all(group == group[:, :1])  # one row group per pick
        assert sorted(map(tuple, runs)) == sorted(map(tuple, np.sort(ids.reshape(-1, per))))
        first = got[:k // 4]
        upper_share.append(float(np.mean(first >= n // 2)))
        # A quarter of the picks: about as many distinct row groups as a random quarter has.
        assert len(np.unique(group[:len(runs) // 4])) >= 10
    share = np.asarray(upper_share)
    z = (share.mean() - 0.5) / (share.std(ddof=1) / math.sqrt(len(share)))
    assert abs(z) < 3.3, (share.mean(), z)  # two-sided p ~ 0.001


def test_grouped_draws_take_at_most_a_quarter_of_a_typical_row_group():
    """Draws inside a row group are with replacement: 16 per pick of a 4-row group repeated
    each image ~4 times in a batch (an epoch of 2,048 draws over 2,048 ids saw 435)."""
    from raying.sampling.prioritized import group_rows

    assert group_rows(16, np.full(100, 64)) == 16
    assert group_rows(16, np.full(100, 32)) == 8
    assert group_rows(16, np.full(100, 4)) == 1  # flat draws
    assert group_rows(4, np.full(100, 1000)) == 4  # never more than asked
    assert group_rows(16, np.zeros(0, dtype=np.int64)) == 1
    n = 2048
    starts = np.arange(0, n, 4)
    for per, low, high in ((16, 0.15, 0.3), (group_rows(16, np.full(n // 4, 4)), 0.6, 0.66)):
        t = PriorityTable(n, seed=3)
        ids, _ = t.sample_in_groups(n, starts, per)
        distinct = len(np.unique(ids)) / n  # i.i.d. flat draws: 1 - 1/e = 0.632
        assert low < distinct < high, (per, distinct)
