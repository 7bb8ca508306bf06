"""Static weights: per-sample, per-class and class-balanced draws, exact prob and weight."""

from __future__ import annotations

import numpy as np
import pytest

import raying
from raying.sampling.weighted import static_probabilities
from tests.unit.sampling.fakes import FakeManifest
from tests.unit.sampling.test_table import chi2_sf


def _labels(counts) -> np.ndarray:
    return np.repeat(np.arange(len(counts)), counts)


def test_class_balanced_gives_every_class_the_same_mass():
    labels = _labels([5, 100, 20])
    p = static_probabilities(labels, class_balanced=True)
    assert p.sum() == pytest.approx(1.0)
    mass = np.bincount(labels, weights=p)
    assert np.allclose(mass, 1 / 3)


def test_per_class_weights_by_name_or_index_and_per_sample_weights():
    labels = _labels([2, 2, 2])
    by_name = static_probabilities(labels, weights={"class_02": 3.0}, classes=["a", "b",
                                                                              "class_02"])
    by_index = static_probabilities(labels, weights={2: 3.0})
    assert np.allclose(by_name, by_index)
    assert np.allclose(by_index, np.array([1, 1, 1, 1, 3, 3]) / 10)
    with pytest.raises(raying.ConfigError, match=r"names class 2 twice, as 2 and 'class_02'"):
        static_probabilities(labels, weights={2: 1.0, "class_02": 3.0},
                             classes=["a", "b", "class_02"])
    per_sample = static_probabilities(labels, weights=np.arange(6))
    assert np.allclose(per_sample, np.arange(6) / 15)
    both = static_probabilities(_labels([1, 3]), weights=[2, 1, 1, 1], class_balanced=True)
    assert np.allclose(both, np.array([2, 1 / 3, 1 / 3, 1 / 3]) / 3)


def test_a_class_weight_is_taken_for_any_class_this_split_lacks():
    # Classes a, b, c; this split holds rows of a and b only. A weight for c (the last
    # class) is as valid as one for a middle class the split lacks.
    labels = np.array([0, 0, 1, 1])
    for key in ("c", 2):
        p = static_probabilities(labels, weights={key: 5.0, "a": 2.0}, classes=["a", "b", "c"])
        assert np.allclose(p, np.array([2, 2, 1, 1]) / 6)
    with pytest.raises(raying.ConfigError, match=r"has label index 3, expected one in \[0, 3\)"):
        static_probabilities(labels, weights={3: 1.0}, classes=["a", "b", "c"])


@pytest.mark.parametrize(("weights", "match"), [
    ([1.0, 2.0], r"one weight per sample: expected 4, got 2"),
    ([1.0, -1.0, 1.0, 1.0], r"must be finite and >= 0: 1 are not, the first sample 1's "
                            r"\(-1\.0\)"),
    ([1.0, 1.0, np.nan, np.inf], r"2 are not, the first sample 2's \(nan\)"),
    ([0.0, 0.0, 0.0, 0.0], r"weights are all zero"),
    ({"nope": 2.0}, r"names class 'nope', which is not one of"),
    ({5: 2.0}, r"has label index 5, expected one in \[0, 2\)"),
    ({1.7: 3.0}, r"has key 1.7; use class names \(str\) or label indices \(int\)"),
    ({True: 3.0}, r"has key True; use class names"),
    ("abcd", r"must be numbers, one per sample .* got str"),
    ({0: "x"}, r"gives class 0 the weight 'x'; weights must be numbers"),
])
def test_bad_weights_are_refused(weights, match):
    with pytest.raises(raying.ConfigError, match=match):
        static_probabilities(_labels([2, 2]), weights=weights, classes=["a", "b"])


def test_tensor_weights_of_any_float_dtype_are_taken():
    torch = pytest.importorskip("torch")
    for dtype in (torch.bfloat16, torch.float16, torch.float64):
        w = torch.tensor([1.0, 3.0, 1.0, 3.0], dtype=dtype)
        p = static_probabilities(_labels([2, 2]), weights=w)
        assert np.allclose(p, [0.125, 0.375, 0.125, 0.375])


def test_draws_follow_the_probabilities_chi_square():
    labels = _labels([10, 200, 40, 750])
    m = FakeManifest(labels)
    s = raying.WeightedSampler(class_balanced=True, seed=3)
    s.bind(m, name="t")
    p = s.probabilities(m)
    counts = np.zeros(len(labels))
    for e in range(40):
        plan = s.plan(m, e, block_rows=128)
        ids = np.concatenate([u.ids for u in plan.units])
        assert len(ids) == len(labels)
        probs = np.concatenate([u.probs for u in plan.units])
        assert np.array_equal(probs, p[ids])
        assert all(np.all(u.weights == 1.0) for u in plan.units)
        counts += np.bincount(ids, minlength=len(labels))
    per_class = np.bincount(labels, weights=counts)
    expected = np.full(4, counts.sum() / 4)
    stat = float(np.sum((per_class - expected) ** 2 / expected))
    assert chi2_sf(stat, 3) > 1e-3
    # The natural (unbalanced) shares would be rejected outright.
    natural = counts.sum() * np.bincount(labels) / len(labels)
    assert chi2_sf(float(np.sum((per_class - natural) ** 2 / natural)), 3) < 1e-12


def test_beta_gives_normalised_importance_weights():
    labels = _labels([10, 90])
    m = FakeManifest(labels)
    s = raying.WeightedSampler(class_balanced=True, beta=1.0, seed=0)
    s.bind(m, name="t")
    plan = s.plan(m, 0, block_rows=64)
    ids = np.concatenate([u.ids for u in plan.units])
    w = np.concatenate([u.weights for u in plan.units])
    p = s.probabilities(m)
    expected = (100 * p[ids]) ** -1.0 / (100 * p.min()) ** -1.0
    assert np.allclose(w, expected, rtol=1e-6) and w.max() <= 1.0


def test_plans_are_reproducible_and_parquet_units_are_local():
    labels = _labels([100, 100, 100])
    m = FakeManifest(labels, fmt="parquet", group_rows=25)
    s = raying.WeightedSampler(seed=5, samples_per_epoch=120)
    s.bind(m, name="t")
    a = s.plan(m, 2, block_rows=30)
    b = s.plan(m, 2, block_rows=30)
    assert [u.ids.tolist() for u in a.units] == [u.ids.tolist() for u in b.units]
    assert sum(u.num_rows for u in a.units) == 120
    for u in a.units:  # a unit spans a short id range (few row groups)
        assert np.ptp(u.ids) < 300 // 2


def test_set_aside_ids_are_not_drawn_again():
    labels = _labels([3, 3])
    m = FakeManifest(labels)
    s = raying.WeightedSampler(class_balanced=True, seed=1)
    s.bind(m, name="t")
    s.set_aside([0, 1, 2])  # all of class 0
    ids = np.concatenate([u.ids for e in range(5) for u in s.plan(m, e, block_rows=8).units])
    assert set(ids.tolist()) <= {3, 4, 5}
    s.set_aside([3, 4, 5])
    with pytest.raises(raying.ConfigError, match="every sample with a positive weight was set"):
        s.plan(m, 9, block_rows=8)


def test_an_epoch_planned_again_keeps_the_samples_it_was_drawn_with():
    """A sample set aside while epoch 1 is read leaves epoch 2's plan, not epoch 1's: epoch 1
    planned again (in this sampler, or in one loaded from a state taken mid-epoch) is the
    same plan, so a resumed epoch continues the one it was cut from."""
    m = FakeManifest(_labels([20, 20]))

    def fresh():
        s = raying.WeightedSampler(class_balanced=True, seed=3)
        s.bind(m, name="t")
        return s

    def ids(s, epoch):
        return np.concatenate([u.ids for u in s.plan(m, epoch, block_rows=8).units])

    s = fresh()
    first = ids(s, 1)
    bad = int(first[5])  # met in epoch 1's reads
    s.set_aside([bad])
    assert np.array_equal(ids(s, 1), first)
    assert bad not in ids(s, 2).tolist()
    for inspected in (3, 4, 5):  # plans asked for besides (pipe.plan(e)) keep epoch 1's
        ids(s, inspected)
    t = fresh()
    t.load_state_dict(s.state_dict())  # a state taken in epoch 1, after the set-aside
    assert np.array_equal(ids(t, 1), first) and bad not in ids(t, 2).tolist()
    import json

    v = fresh()  # the same through JSON (a weighted state is numbers and lists)
    v.load_state_dict(json.loads(json.dumps(s.state_dict())))
    assert np.array_equal(ids(v, 1), first) and bad not in ids(v, 2).tolist()
    import copy
    import pickle

    for copied in (copy.deepcopy(s), pickle.loads(pickle.dumps(s))):  # Ray Data read tasks
        assert np.array_equal(ids(copied, 1), first)
    # Without the per-epoch sets (a state saved before they were kept), every plan leaves
    # the whole set out, as before.
    old = {k: v for k, v in s.state_dict().items() if k != "plan_set_aside"}
    u = fresh()
    u.load_state_dict(old)
    assert bad not in ids(u, 1).tolist()


def test_state_roundtrip_and_protocol():
    from raying.sampling.protocol import Sampler

    s = raying.WeightedSampler(seed=2)
    assert isinstance(s, Sampler) and (s.lazy, s.uses_store, s.handle) == (False, False, None)
    s.set_aside([4])
    t = raying.WeightedSampler(seed=2)
    t.load_state_dict(s.state_dict())
    assert t.state_dict()["set_aside"] == [4]
    with pytest.raises(raying.ConfigError, match=r"this pipeline has WeightedSampler\(seed=3\)"):
        raying.WeightedSampler(seed=3).load_state_dict(s.state_dict())


def test_huge_finite_weights_keep_their_ratios():
    p = static_probabilities(_labels([2, 2]), weights=[1e308, 1e308, 5e307, 0.0])
    assert np.all(np.isfinite(p)) and p.sum() == pytest.approx(1.0)
    assert np.allclose(p, np.array([2, 2, 1, 0]) / 5)


@pytest.mark.parametrize("cls", [raying.WeightedSampler, raying.PrioritizedSampler])
@pytest.mark.parametrize("bad", [2.5, 0, True, "10"])
def test_samples_per_epoch_must_be_a_positive_int(cls, bad):
    with pytest.raises(raying.ConfigError, match=r"samples_per_epoch=...\) must be an int >= 1"):
        cls(samples_per_epoch=bad)


def test_a_state_of_other_weights_or_draw_count_is_refused():
    """Other probabilities or another samples_per_epoch make another plan: a saved position
    in it would repeat or skip draws. A state saved before these were recorded loads."""
    import json

    m = FakeManifest(_labels([30, 10]))

    def bound(**kw):
        s = raying.WeightedSampler(seed=1, **kw)
        s.bind(m, name="t")
        return s

    saved = json.loads(json.dumps(bound(class_balanced=True).state_dict()))
    bound(class_balanced=True).load_state_dict(saved)
    with pytest.raises(raying.ConfigError, match=r"draw probabilities differ"):
        bound().load_state_dict(saved)
    with pytest.raises(raying.ConfigError, match=r"draw probabilities differ"):
        bound(weights=np.arange(40) + 1.0).load_state_dict(saved)
    with pytest.raises(raying.ConfigError, match=r"samples_per_epoch=None\) but this "
                                                 r"pipeline has samples_per_epoch=100"):
        bound(class_balanced=True, samples_per_epoch=100).load_state_dict(saved)
    older = {k: v for k, v in saved.items() if k not in ("probs_digest", "samples_per_epoch")}
    bound().load_state_dict(older)


def test_class_balanced_draws_stay_equal_per_class_once_samples_are_set_aside():
    """Class-balanced means equal draws per class: a class whose samples are set aside as
    unreadable keeps its share on its other samples (renormalizing over all samples gave the
    rare class 15/35 of the draws here). Chi-square against equal shares, fixed seed."""
    labels = _labels([20, 200])
    m = FakeManifest(labels)
    s = raying.WeightedSampler(class_balanced=True, seed=7, samples_per_epoch=20_000)
    s.bind(m, name="t")
    s.set_aside([0, 1, 2, 3, 4])
    ids = np.concatenate([u.ids for u in s.plan(m, 1, block_rows=512).units])
    assert not np.isin(ids, [0, 1, 2, 3, 4]).any()
    counts = np.bincount(labels[ids], minlength=2)
    expected = np.full(2, len(ids) / 2)
    stat = float(((counts - expected) ** 2 / expected).sum())
    assert chi2_sf(stat, 1) > 0.01, counts
    rare = np.bincount(ids[labels[ids] == 0], minlength=20)[5:]  # equal within the class
    stat = float(((rare - rare.mean()) ** 2 / rare.mean()).sum())
    assert chi2_sf(stat, len(rare) - 1) > 0.01


def test_a_weighted_state_is_plain_json_with_numpy_settings():
    import json

    s = raying.WeightedSampler(seed=1, samples_per_epoch=np.int64(10))
    s.bind(FakeManifest(_labels([3, 3])), name="t")
    assert json.loads(json.dumps(s.state_dict()))["samples_per_epoch"] == 10
