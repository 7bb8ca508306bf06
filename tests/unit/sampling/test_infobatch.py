"""InfoBatch plans: exact inclusion probabilities and weights, annealing, resume, Parquet units."""

from __future__ import annotations

import numpy as np
import pytest

import raying
from raying.sampling.infobatch import anneal_start, prune_plan
from tests.unit.sampling.fakes import FakeManifest
from tests.unit.sampling.test_table import chi2_sf


def _scores(n: int = 200, seed: int = 0) -> np.ndarray:
    # A skewed loss distribution: most samples easy, a few hard (mean well above the median).
    rng = np.random.default_rng(seed)
    return rng.exponential(0.2, n) + (rng.random(n) < 0.1) * 3.0


def _plan_ids(plan) -> np.ndarray:
    return np.concatenate([u.ids for u in plan.units]) if plan.units else np.zeros(0, int)


def test_each_below_mean_sample_is_kept_with_probability_one_minus_r():
    scores = _scores()
    low = scores < scores.mean()
    epochs, r = 3000, 0.5
    kept = np.zeros(scores.size)
    for e in range(epochs):
        keep, probs, weights = prune_plan(scores, r, np.random.default_rng([7, e]))
        kept += keep
        assert np.array_equal(probs, np.where(low, 1 - r, 1.0))
        assert np.array_equal(weights, np.where(low, 1 / (1 - r), 1.0))
    assert np.all(kept[~low] == epochs), "every sample at or above the mean is read every epoch"
    # Each below-mean count is Binomial(epochs, 1 - r): the sum of squared z-scores is chi-square
    # with one degree of freedom per sample.
    p = 1 - r
    z2 = (kept[low] - epochs * p) ** 2 / (epochs * p * (1 - p))
    assert chi2_sf(float(z2.sum()), int(low.sum())) > 1e-3
    # A wrong keep probability (0.52 instead of 0.5) is rejected by the same statistic.
    z2_wrong = (kept[low] - epochs * 0.52) ** 2 / (epochs * 0.52 * 0.48)
    assert chi2_sf(float(z2_wrong.sum()), int(low.sum())) < 1e-3


def test_other_prune_ratios_are_exact_too():
    scores = _scores(seed=3)
    low = scores < scores.mean()
    for r in (0.3, 0.7):
        kept = np.zeros(scores.size)
        for e in range(2000):
            keep, _, weights = prune_plan(scores, r, np.random.default_rng([1, e]))
            kept += keep
            assert np.allclose(weights[low], 1 / (1 - r)) and np.all(weights[~low] == 1.0)
        p = 1 - r
        z2 = (kept[low] - 2000 * p) ** 2 / (2000 * p * (1 - p))
        assert chi2_sf(float(z2.sum()), int(low.sum())) > 1e-3


def test_the_weighted_epoch_is_unbiased_for_the_full_sum():
    scores = _scores(seed=5)
    losses = np.random.default_rng(2).random(scores.size)
    totals = []
    for e in range(4000):
        keep, _, weights = prune_plan(scores, 0.5, np.random.default_rng([9, e]))
        totals.append(float(np.sum(weights[keep] * losses[keep])))
    totals = np.asarray(totals)
    se = totals.std() / np.sqrt(totals.size)
    assert abs(totals.mean() - losses.sum()) < 4 * se


def test_plans_follow_the_scores_weights_and_probabilities():
    scores = _scores()
    m = FakeManifest(np.zeros(scores.size, int))
    s = raying.InfoBatchSampler(prune_ratio=0.5, anneal=0.875, epochs=8, seed=4)
    plan = s.plan_from_scores(m, 2, scores, block_rows=32)
    ids = _plan_ids(plan)
    assert len(np.unique(ids)) == len(ids), "a pruning plan reads each kept id once"
    low = scores < scores.mean()
    assert set(np.flatnonzero(~low)) <= set(ids.tolist())
    probs = np.concatenate([u.probs for u in plan.units])
    weights = np.concatenate([u.weights for u in plan.units])
    assert np.array_equal(probs, np.where(low[ids], 0.5, 1.0))
    assert np.array_equal(weights, np.where(low[ids], 2.0, 1.0).astype(np.float32))
    assert weights.dtype == np.float32 and all(u.num_rows <= 32 for u in plan.units)
    # Same seed, epoch and scores: the same plan; another epoch: another one.
    again = s.plan_from_scores(m, 2, scores, block_rows=32)
    assert np.array_equal(_plan_ids(again), ids)
    assert not np.array_equal(_plan_ids(s.plan_from_scores(m, 3, scores, block_rows=32)), ids)
    stats = s.stats()["per_epoch"]
    assert stats[-1]["epoch"] == 3 and stats[-1]["annealed"] is False
    assert stats[0]["planned"] == len(ids)
    assert stats[0]["pruned_share"] == pytest.approx(1 - len(ids) / scores.size)
    # The plan's effective size: kept ids weigh 1 (above the mean) or 2 (below it).
    n1, n2 = int((~low[ids]).sum()), int(low[ids].sum())
    assert stats[0]["plan_ess"] == pytest.approx((n1 + 2 * n2) ** 2 / (n1 + 4 * n2))
    assert stats[0]["plan_ess"] < len(ids)


def test_annealed_epochs_and_equal_scores_read_every_id_once_with_weight_one():
    scores = _scores()
    m = FakeManifest(np.zeros(scores.size, int))
    s = raying.InfoBatchSampler(prune_ratio=0.5, anneal=0.875, epochs=8, seed=0)
    assert anneal_start(8, 0.875) == 7 and anneal_start(20, 0.875) == 18
    # A short run still ends on the full data; anneal=1 never anneals.
    assert [anneal_start(e, 0.875) for e in (1, 2, 4, 7)] == [0, 1, 3, 6]
    assert anneal_start(4, 1.0) == 4 and anneal_start(10, 0.5) == 5
    assert anneal_start(None, 0.875) is None
    for epoch, scored in ((7, scores), (9, scores), (0, np.ones(scores.size))):
        plan = s.plan_from_scores(m, epoch, scored, block_rows=50)
        ids = _plan_ids(plan)
        assert sorted(ids.tolist()) == list(range(scores.size))
        assert all(np.all(u.weights == 1.0) and np.all(u.probs == 1.0) for u in plan.units)
    assert len(_plan_ids(s.plan_from_scores(m, 6, scores, block_rows=50))) < scores.size
    # Without epochs there is no annealing: pruning goes on.
    s2 = raying.InfoBatchSampler(epochs=None)
    assert len(_plan_ids(s2.plan_from_scores(m, 100, scores, block_rows=50))) < scores.size


def test_resume_mid_epoch_repeats_and_skips_nothing():
    n = 300
    m = FakeManifest(np.zeros(n, int))
    first, later = _scores(n, seed=1), _scores(n, seed=2)
    a = raying.InfoBatchSampler(prune_ratio=0.5, epochs=10, seed=3)
    a.scores = lambda: first  # the store's losses when epoch 4 starts
    plan = a.plan(m, 4, block_rows=40)
    ids = _plan_ids(plan)
    state = a.state_dict()
    b = raying.InfoBatchSampler(prune_ratio=0.5, epochs=10, seed=3)
    b.scores = lambda: later  # losses moved on since: the resumed epoch must not see them
    b.load_state_dict(state)
    resumed = _plan_ids(b.plan(m, 4, block_rows=40))
    cut = 137  # delivered before the restart
    delivered = np.concatenate([ids[:cut], resumed[cut:]])
    assert np.array_equal(np.sort(delivered), np.sort(ids))
    assert len(np.unique(delivered)) == len(delivered)
    # The next epoch is planned from the new losses.
    assert not np.array_equal(_plan_ids(b.plan(m, 5, block_rows=40)),
                              _plan_ids(a.plan_from_scores(m, 5, first, block_rows=40)))


def test_a_look_at_later_plans_keeps_the_scores_of_the_epoch_being_read():
    """Epoch 4 is read while the next epoch's reads start (plan 5) and the user looks at
    plan 6: a state saved then still holds epoch 4's scores, and the resumed epoch 4 is the
    same plan, whatever the losses did since."""
    n = 300
    m = FakeManifest(np.zeros(n, int))
    first, later = _scores(n, seed=1), _scores(n, seed=2)
    a = raying.InfoBatchSampler(prune_ratio=0.5, epochs=10, seed=3)
    a.scores = lambda: first
    ids = _plan_ids(a.plan(m, 4, block_rows=40))
    a.plan(m, 5, block_rows=40)
    a.plan(m, 6, block_rows=40)
    b = raying.InfoBatchSampler(prune_ratio=0.5, epochs=10, seed=3)
    b.scores = lambda: later
    b.load_state_dict(a.state_dict())
    assert np.array_equal(_plan_ids(b.plan(m, 4, block_rows=40)), ids)


def test_parquet_plans_keep_rows_of_a_unit_in_its_row_groups():
    n = 500
    m = FakeManifest(np.zeros(n, int), fmt="parquet", group_rows=20)
    scores = _scores(n, seed=4)
    s = raying.InfoBatchSampler(prune_ratio=0.5, epochs=10, seed=1, window_row_groups=2)
    plan = s.plan_from_scores(m, 1, scores, block_rows=64)
    ids = _plan_ids(plan)
    assert len(np.unique(ids)) == len(ids)
    low = scores < scores.mean()
    assert set(np.flatnonzero(~low)) <= set(ids.tolist())
    for u in plan.units:
        assert set((u.ids // 20 * 20).tolist()) == set(u.row_groups[:, 2].tolist())
    assert [u.index for u in plan.units] == list(range(len(plan.units)))


def test_set_aside_ids_leave_later_plans():
    scores = np.ones(50)
    m = FakeManifest(np.zeros(50, int))
    s = raying.InfoBatchSampler(epochs=4)
    s.set_aside([3, 7])
    ids = _plan_ids(s.plan_from_scores(m, 0, scores, block_rows=16))
    assert sorted(ids.tolist()) == [i for i in range(50) if i not in (3, 7)]


def test_an_epoch_planned_again_keeps_its_set_aside():
    scores = np.ones(50)
    m = FakeManifest(np.zeros(50, int))
    s = raying.InfoBatchSampler(epochs=4)
    first = _plan_ids(s.plan_from_scores(m, 1, scores, block_rows=16))
    s.set_aside([3])  # met while epoch 1 is read
    assert np.array_equal(_plan_ids(s.plan_from_scores(m, 1, scores, block_rows=16)), first)
    assert 3 not in _plan_ids(s.plan_from_scores(m, 2, scores, block_rows=16)).tolist()


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"prune_ratio": 1.0}, r"prune_ratio=...\) must be in \[0, 1\), got 1.0"),
    ({"anneal": 0.0}, r"anneal=...\) must be in \(0, 1\], got 0.0"),
    ({"epochs": 0}, r"epochs=...\) must be an integer >= 1 or None, got 0"),
    ({"seed": -1}, r"seed=...\) must be a non-negative int, got -1"),
    ({"samples_per_epoch": 100}, r"samples_per_epoch=100\) needs a prior"),
    ({"samples_per_epoch": 0, "prior": {0: 2.0}}, r"samples_per_epoch=0\) needs a prior and"),
])
def test_bad_settings_are_refused(kwargs, match):
    with pytest.raises(raying.ConfigError, match=match):
        raying.InfoBatchSampler(**kwargs)


def test_a_state_of_other_settings_is_refused():
    state = raying.InfoBatchSampler(epochs=10, seed=1).state_dict()
    with pytest.raises(raying.ConfigError, match=r"saved with InfoBatchSampler.*'seed': 1.*"
                                                 r"this pipeline has .*'seed': 2"):
        raying.InfoBatchSampler(epochs=10, seed=2).load_state_dict(state)


def test_scores_of_the_wrong_length_are_refused():
    s = raying.InfoBatchSampler(epochs=2)
    with pytest.raises(raying.ConfigError, match="expected 10, got shape"):
        s.plan_from_scores(FakeManifest(np.zeros(10, int)), 1, np.ones(9), block_rows=4)


def test_the_sampler_implements_the_protocol():
    from raying.sampling.protocol import Sampler

    s = raying.InfoBatchSampler(epochs=3)
    assert isinstance(s, Sampler)
    assert (s.lazy, s.uses_store, s.samples_per_epoch) == (False, True, None)


# -- a static prior under the pruning --------------------------------------------------------

def _imbalanced(seed: int = 0):
    """1:20 classes (10 / 50 / 200 samples) and skewed scores."""
    labels = np.repeat([0, 1, 2], [10, 50, 200])
    return FakeManifest(labels), _scores(labels.size, seed)


@pytest.mark.parametrize("prior", [None, "balanced"])
@pytest.mark.parametrize(("n", "value"), [(600, 1.0), (1000, 0.1), (777, 0.7)])
def test_equal_scores_are_at_their_mean_and_nothing_is_pruned(n, value, prior):
    """All scores equal (a first epoch, flat losses): their mean, off by a rounding error
    (1.0000000000000004 for all ones under a class-balanced prior of 5 classes), must not
    put every sample below it."""
    labels = np.repeat(np.arange(5), [n - 4 * (n // 8)] + [n // 8] * 4)
    m = FakeManifest(labels)
    kw = {"prior": raying.WeightedSampler(class_balanced=True),
          "samples_per_epoch": 3 * n} if prior else {}
    s = raying.InfoBatchSampler(prune_ratio=0.5, epochs=None, seed=0, **kw)
    plan = s.plan_from_scores(m, 1, np.full(n, value), block_rows=64)
    assert _plan_ids(plan).size == (3 * n if prior else n)
    assert all(np.all(u.weights == 1.0) for u in plan.units)
    assert s.stats()["per_epoch"][-1]["below_mean_share"] == 0.0


def test_a_prior_draws_in_proportion_and_prunes_each_below_mean_draw():
    m, scores = _imbalanced()
    n, r, k = len(m), 0.5, 300
    s = raying.InfoBatchSampler(prune_ratio=r, epochs=None, seed=3, samples_per_epoch=k,
                                prior=raying.WeightedSampler(class_balanced=True))
    q = np.repeat([1 / 30, 1 / 150, 1 / 600], [10, 50, 200])
    assert np.allclose(s.prior_probabilities(m), q)
    mean = float(q @ scores)  # the expected score of one draw, the prior's mean
    low = scores < mean
    epochs = 400
    counts = np.zeros(n)
    kept_total = 0
    for e in range(epochs):
        plan = s.plan_from_scores(m, e, scores, block_rows=64)
        ids = _plan_ids(plan)
        counts += np.bincount(ids, minlength=n)
        kept_total += ids.size
        probs = np.concatenate([u.probs for u in plan.units])
        weights = np.concatenate([u.weights for u in plan.units])
        assert np.allclose(probs, q[ids] * np.where(low[ids], 1 - r, 1.0))
        assert np.array_equal(weights, np.where(low[ids], 1 / (1 - r), 1.0).astype(np.float32))
        assert all(u.num_rows <= 64 for u in plan.units)
    # Each id's reads per epoch follow k * q_i * keep_i: chi-square over the ids.
    expected = epochs * k * q * np.where(low, 1 - r, 1.0)
    chi2 = float(np.sum((counts - expected) ** 2 / expected))
    assert chi2_sf(chi2, n - 1) > 1e-3, chi2
    # Classes are drawn equally before pruning: the weighted counts per class are equal.
    weighted = counts * np.where(low, 1 / (1 - r), 1.0)
    per_class = np.bincount(m.labels, weights=weighted) / (epochs * k)
    assert np.allclose(per_class, 1 / 3, atol=0.02), per_class
    stats = s.stats()["per_epoch"][-1]
    assert stats["candidates"] == k and stats["planned"] == ids.size
    assert low.any() and kept_total < epochs * k


def test_a_priors_epoch_is_unbiased_for_the_priors_full_epoch():
    m, scores = _imbalanced(seed=1)
    losses = np.random.default_rng(4).random(len(m))
    s = raying.InfoBatchSampler(prune_ratio=0.7, epochs=None, seed=8,
                                prior={"class_00": 20.0, "class_01": 4.0})
    w = np.repeat([20.0, 4.0, 1.0], [10, 50, 200])
    q = w / w.sum()
    k = len(m)
    totals = []
    for e in range(3000):
        plan = s.plan_from_scores(m, e, scores, block_rows=64)
        totals.append(sum(float(np.sum(u.weights * losses[u.ids])) for u in plan.units))
    totals = np.asarray(totals)
    se = totals.std() / np.sqrt(totals.size)
    assert abs(totals.mean() - k * float(q @ losses)) < 4 * se, (totals.mean(), k * q @ losses)


def test_with_a_prior_the_first_and_annealed_epochs_keep_every_draw():
    m, scores = _imbalanced()
    s = raying.InfoBatchSampler(prune_ratio=0.5, anneal=0.5, epochs=4, seed=0,
                                prior=[1.0] * len(m))
    for epoch, scored in ((2, scores), (3, scores), (0, np.ones(len(m)))):
        plan = s.plan_from_scores(m, epoch, scored, block_rows=50)
        assert _plan_ids(plan).size == len(m)
        assert all(np.all(u.weights == 1.0) for u in plan.units)
    assert _plan_ids(s.plan_from_scores(m, 1, scores, block_rows=50)).size < len(m)
    # Parquet: units of neighbouring ids, every draw present.
    pm = FakeManifest(m.labels, fmt="parquet", group_rows=16)
    plan = s.plan_from_scores(pm, 3, scores, block_rows=32)
    assert _plan_ids(plan).size == len(m)
    assert all(np.ptp(u.ids) < 64 for u in plan.units)


def test_a_prior_that_names_an_unknown_class_or_has_the_wrong_length_is_refused():
    m, scores = _imbalanced()
    with pytest.raises(raying.ConfigError, match="names class 'cat'"):
        raying.InfoBatchSampler(prior={"cat": 2.0}).plan_from_scores(m, 1, scores,
                                                                     block_rows=8)
    with pytest.raises(raying.ConfigError):
        raying.InfoBatchSampler(prior=[1.0, 2.0]).plan_from_scores(m, 1, scores, block_rows=8)


def test_a_state_saved_with_a_prior_is_refused_without_one():
    state = raying.InfoBatchSampler(epochs=4, prior={0: 2.0}).state_dict()
    assert state["prior"] is True
    with pytest.raises(raying.ConfigError, match="'prior': True"):
        raying.InfoBatchSampler(epochs=4).load_state_dict(state)
    raying.InfoBatchSampler(epochs=4, prior={0: 3.0}).load_state_dict(state)


def test_a_copy_leaves_the_priors_probabilities_behind_and_recomputes_them():
    import pickle

    m, scores = _imbalanced()
    s = raying.InfoBatchSampler(epochs=None, seed=2, prior={0: 5.0})
    plan = s.plan_from_scores(m, 1, scores, block_rows=64)
    copy = pickle.loads(pickle.dumps(s))
    assert copy._prior_q is None and copy.prior == {0: 5.0}
    again = copy.plan_from_scores(m, 1, scores, block_rows=64)
    assert np.array_equal(_plan_ids(again), _plan_ids(plan))


def test_samples_never_scored_are_kept_with_weight_one_and_left_out_of_the_mean():
    # A drop_last batch, a steps_per_epoch loop or a break leaves ids without a loss: they
    # were pruned like well-learned ones (their initial score sat below the losses' mean).
    scores = _scores()
    unseen = np.zeros(scores.size, bool)
    unseen[::7] = True
    with_nan = np.where(unseen, np.nan, scores)
    seen_mean = scores[~unseen].mean()
    kept = np.zeros(scores.size)
    for e in range(400):
        keep, probs, weights = prune_plan(with_nan, 0.5, np.random.default_rng([3, e]))
        kept += keep
        assert np.all(probs[unseen] == 1.0) and np.all(weights[unseen] == 1.0)
        low = scores < seen_mean
        assert np.array_equal(weights[~unseen], np.where(low[~unseen], 2.0, 1.0))
    assert np.all(kept[unseen] == 400)
    # No score at all (before the first report): everything, weight 1.
    keep, probs, weights = prune_plan(np.full(50, np.nan), 0.5, np.random.default_rng(0))
    assert keep.all() and (probs == 1).all() and (weights == 1).all()
    # Through a plan, with and without a prior (whose i.i.d. draws keep every draw of one).
    m = FakeManifest(np.arange(scores.size) % 2)
    for prior in (None, raying.WeightedSampler(class_balanced=True)):
        s = raying.InfoBatchSampler(prune_ratio=0.5, epochs=10, seed=1, prior=prior,
                                    samples_per_epoch=3 * scores.size if prior else None)
        plan = s.plan_from_scores(m, 2, with_nan, block_rows=50)
        ids = _plan_ids(plan)
        w = np.concatenate([u.weights for u in plan.units])
        if prior is None:
            assert set(np.flatnonzero(unseen).tolist()) <= set(ids.tolist())
        assert unseen[ids].any() and np.all(w[unseen[ids]] == 1.0)
        assert np.all(w[~unseen[ids] & (scores[ids] < seen_mean - 0.05)] == 2.0)


def test_losses_near_the_top_of_float64_still_prune_the_smaller_ones():
    scores = np.concatenate([np.full(50, 1.0), np.full(50, 1e307)])
    keep, probs, weights = prune_plan(scores, 0.5, np.random.default_rng(0))
    assert np.all(probs[:50] == 0.5) and np.all(probs[50:] == 1.0)
    assert np.all(weights[:50] == 2.0) and keep[50:].all()


def test_a_class_balanced_prior_keeps_equal_class_shares_once_samples_are_set_aside():
    """Under a class-balanced prior a class keeps its share of the draws when some of its
    samples are set aside as unreadable (chi-square against equal shares, fixed seed)."""
    from tests.unit.sampling.test_table import chi2_sf

    labels = np.repeat([0, 1], [20, 200])
    m = FakeManifest(labels)
    s = raying.InfoBatchSampler(prune_ratio=0.5, epochs=None, seed=2, samples_per_epoch=20_000,
                                prior=raying.WeightedSampler(class_balanced=True))
    s.set_aside([0, 1, 2, 3, 4])
    ids = _plan_ids(s.plan_from_scores(m, 1, np.ones(labels.size), block_rows=512))
    assert ids.size == 20_000 and not np.isin(ids, [0, 1, 2, 3, 4]).any()
    counts = np.bincount(labels[ids], minlength=2)
    stat = float(((counts - ids.size / 2) ** 2 / (ids.size / 2)).sum())
    assert chi2_sf(stat, 1) > 0.01, counts


def test_numpy_numbers_are_settings_as_python_numbers_are():
    s = raying.InfoBatchSampler(prune_ratio=np.float32(0.5), anneal=np.float64(0.75))
    assert (s.prune_ratio, s.anneal) == (0.5, 0.75)


@pytest.mark.parametrize(("make", "match"), [
    (lambda: raying.UniformSampler(seed=True), r"UniformSampler\(seed=...\) must be a "
                                               r"non-negative int, got True"),
    (lambda: raying.PrioritizedSampler(table={"nope": 1}),
     r"PrioritizedSampler\(table=...\): .*'nope'.*; its keys are \[.*'cap_quantile'"),
])
def test_other_samplers_refuse_bad_settings_by_name(make, match):
    with pytest.raises(raying.ConfigError, match=match):
        make()
