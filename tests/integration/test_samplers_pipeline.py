"""InfoBatch and static-weight sampling through the real pipeline, store and feedback."""

from __future__ import annotations

import numpy as np
import pytest

import raying
from raying.sampling import store
from tests.unit.sampling.test_table import chi2_sf


def _folder(root, counts, size=8):
    from raying.tools.datagen import encode

    rng = np.random.default_rng(0)
    for label, count in enumerate(counts):
        d = root / f"class_{label:02d}"
        d.mkdir(parents=True)
        for i in range(count):
            img = rng.integers(0, 255, (size, size, 3), dtype=np.uint8)
            (d / f"{i:05d}.png").write_bytes(encode(img, "png"))
    return root


@pytest.fixture(scope="module")
def manifest(tmp_path_factory):
    return raying.Manifest.scan(str(_folder(tmp_path_factory.mktemp("ib"), [40, 160])))


def _pipe(manifest, sampler, name):
    return raying.Pipeline(manifest, sampler=sampler,
                           transform=raying.ImageTransform(size=8, random_crop=False,
                                                           flip=False),
                           config=raying.PipelineConfig(block_rows=32, keep_warm=False,
                                                        name=name))


def _report_skewed(pipe, manifest):
    # Class 0 (40 ids) is hard, class 1 (160 ids) well learned: the mean is 2.6.
    losses = np.where(manifest.labels == 0, 10.0, 0.5)
    pipe.report(np.arange(len(manifest)), losses)
    pipe.sampler.flush()
    store.flush(pipe.sampler.handle)


def test_infobatch_prunes_the_well_learned_and_reweights_them(manifest, ray_local):
    s = raying.InfoBatchSampler(prune_ratio=0.5, anneal=0.75, epochs=4, seed=1)
    pipe = _pipe(manifest, s, "ib-prune")
    try:
        first = np.concatenate([b["id"] for b in pipe.iter_batches(batch_size=50, epoch=0)])
        assert sorted(first.tolist()) == list(range(200)), "equal scores: epoch 0 reads all"
        _report_skewed(pipe, manifest)
        rows = list(pipe.iter_batches(batch_size=50, epoch=1))
        ids = np.concatenate([b["id"] for b in rows])
        w = np.concatenate([b["weight"] for b in rows])
        prob = np.concatenate([b["prob"] for b in rows])
        hard = manifest.labels[ids] == 0
        assert len(np.unique(ids)) == len(ids)
        assert hard.sum() == 40, "every above-mean sample is read"
        assert np.all(w[hard] == 1.0) and np.all(w[~hard] == 2.0)
        assert np.all(prob[hard] == 1.0) and np.all(prob[~hard] == 0.5)
        # 160 easy ids kept with probability 1/2 each: a binomial count.
        easy = int((~hard).sum())
        assert abs(easy - 80) < 4 * np.sqrt(40), easy
        # Epoch 3 >= ceil(0.75 * 4): annealed, every id once with weight 1.
        rows = list(pipe.iter_batches(batch_size=50, epoch=3))
        ids3 = np.concatenate([b["id"] for b in rows])
        assert sorted(ids3.tolist()) == list(range(200))
        assert all(np.all(b["weight"] == 1.0) for b in rows)
        per_epoch = {e["epoch"]: e for e in pipe.stats()["sampling"]["per_epoch"]}
        assert per_epoch[1]["samples_read"] == len(ids)
        assert per_epoch[1]["pruned_share"] == pytest.approx(1 - len(ids) / 200)
        assert (per_epoch[1]["weight_min"], per_epoch[1]["weight_max"]) == (1.0, 2.0)
        assert per_epoch[3]["annealed"] and per_epoch[3]["pruned_share"] == 0.0
        assert "persistent_top_share" in pipe.stats()["sampling"]["guard"]
        # Its epochs' sizes, not the store table's ESS of a draw it never makes.
        assert "ess" not in pipe.stats()["sampling"]
        assert per_epoch[3]["plan_ess"] == pytest.approx(200.0)
        assert per_epoch[1]["plan_ess"] < len(ids)
    finally:
        pipe.close()


def test_infobatch_reads_the_samples_no_loss_was_reported_for(manifest, ray_local):
    # A drop_last epoch reported 168 of 200 losses (all 2.3): the 32 others kept their
    # initial score, below that mean, and were pruned as well learned (45 of 88 in a trial).
    s = raying.InfoBatchSampler(prune_ratio=0.5, epochs=10, seed=2)
    pipe = _pipe(manifest, s, "ib-unseen")
    try:
        seen = []
        for b in pipe.iter_batches(batch_size=56, epoch=0, drop_last=True):
            pipe.report(b["id"], np.full(len(b["id"]), 2.3))
            seen.append(b["id"])
        seen = np.concatenate(seen)
        assert len(seen) == 168
        pipe.sampler.flush()
        store.flush(pipe.sampler.handle)
        rows = list(pipe.iter_batches(batch_size=50, epoch=1))
        ids = np.concatenate([b["id"] for b in rows])
        w = np.concatenate([b["weight"] for b in rows])
        unseen = np.setdiff1d(np.arange(200), seen)
        assert set(unseen.tolist()) <= set(ids.tolist()), "every unscored id is read"
        assert np.all(w[np.isin(ids, unseen)] == 1.0)
        assert len(np.unique(ids)) == len(ids) == 200  # equal losses: nothing below the mean
    finally:
        pipe.close()


def test_infobatch_resume_mid_epoch_repeats_and_skips_nothing(manifest, ray_local):
    a = _pipe(manifest, raying.InfoBatchSampler(prune_ratio=0.5, epochs=6, seed=2), "ib-a")
    try:
        list(a.iter_batches(batch_size=50, epoch=0))
        _report_skewed(a, manifest)
        it = a.iter_batches(batch_size=16, epoch=1, prefetch_batches=0)
        head = [next(it)["id"] for _ in range(4)]
        state = a.state_dict()
        rest_a = np.concatenate([b["id"] for b in it])
        # Losses keep moving after the save: the resumed epoch must still follow its plan.
        a.report(np.arange(200), np.where(manifest.labels == 0, 0.1, 5.0))
    finally:
        a.close(release_store=True)
    b = _pipe(manifest, raying.InfoBatchSampler(prune_ratio=0.5, epochs=6, seed=2), "ib-b")
    try:
        b.load_state_dict(state)
        rest_b = np.concatenate([x["id"] for x in b.iter_batches(batch_size=16, epoch=1)])
    finally:
        b.close()
    assert np.array_equal(rest_a, rest_b)
    delivered = np.concatenate(head + [rest_b])
    assert len(np.unique(delivered)) == len(delivered)
    assert (manifest.labels[delivered] == 0).sum() == 40


def test_class_balanced_weights_draw_classes_equally_through_the_pipeline(tmp_path, ray_local):
    m = raying.Manifest.scan(str(_folder(tmp_path / "imb", [30, 600])))  # 1:20
    pipe = _pipe(m, raying.WeightedSampler(class_balanced=True, seed=4), "wb")
    counts = np.zeros(2)
    try:
        for epoch in range(6):
            for b in pipe.iter_batches(batch_size=100, epoch=epoch):
                counts += np.bincount(b["label"], minlength=2)
                assert np.allclose(b["prob"], np.where(b["label"] == 0, 0.5 / 30, 0.5 / 600))
                assert np.all(b["weight"] == 1.0)
        stats = pipe.stats()["sampling"]
    finally:
        pipe.close()
    shares = counts / counts.sum()
    assert counts.sum() == 6 * 630
    assert np.max(np.abs(shares - 0.5)) < 0.02, shares
    expected = np.full(2, counts.sum() / 2)
    assert chi2_sf(float(np.sum((counts - expected) ** 2 / expected)), 1) > 1e-3
    assert stats["sampler"] == "weighted" and len(stats["per_epoch"]) == 6


def test_a_class_balanced_prior_under_prioritized_sampling(tmp_path, ray_local):
    """Before losses arrive the prior alone draws (classes equal on a 1:20 folder); after,
    losses re-weight within it, and ``prob`` is the exact mixture."""
    m = raying.Manifest.scan(str(_folder(tmp_path / "imbp", [30, 600])))  # 1:20
    eps = 0.2
    sampler = raying.PrioritizedSampler(uniform_mix=eps, seed=2,
                                        prior=raying.WeightedSampler(class_balanced=True))
    pipe = _pipe(m, sampler, "prior")
    prior = np.where(m.labels == 0, 0.5 / 30, 0.5 / 600)
    try:
        counts = np.zeros(2)
        for epoch in range(3):
            for b in pipe.iter_batches(batch_size=90, epoch=epoch):
                counts += np.bincount(b["label"], minlength=2)
                assert np.allclose(b["prob"], prior[b["id"]])
        shares = counts / counts.sum()
        assert np.max(np.abs(shares - 0.5)) < 0.02, shares
        expected = np.full(2, counts.sum() / 2)
        assert chi2_sf(float(np.sum((counts - expected) ** 2 / expected)), 1) > 1e-3
        # Losses: within class 1, ids 0..299 of it are hard (loss 4) and the rest easy (1).
        losses = np.ones(len(m))
        hard = np.flatnonzero(m.labels == 1)[:300]
        losses[hard] = 4.0
        _report(pipe, losses)
        mass = prior * losses
        want = (1 - eps) * mass / mass.sum() + eps * prior
        drawn = np.zeros(len(m))
        for b in pipe.iter_batches(batch_size=90, epoch=3):
            assert np.allclose(b["prob"], want[b["id"]])
            np.add.at(drawn, b["id"], 1)
        for epoch in range(4, 12):
            for b in pipe.iter_batches(batch_size=90, epoch=epoch):
                np.add.at(drawn, b["id"], 1)
        assert pipe.stats()["sampling"]["prior"] is True
    finally:
        pipe.close()
    groups = [m.labels == 0, np.isin(np.arange(len(m)), hard),
              (m.labels == 1) & ~np.isin(np.arange(len(m)), hard)]
    observed = np.array([drawn[g].sum() for g in groups])
    expected = np.array([want[g].sum() for g in groups]) * drawn.sum()
    assert chi2_sf(float(np.sum((observed - expected) ** 2 / expected)), 2) > 1e-3, \
        (observed, expected)


def _report(pipe, losses):
    pipe.report(np.arange(losses.size), losses)
    pipe.sampler.flush()
    store.flush(pipe.sampler.handle)


def test_infobatch_under_a_class_balanced_prior_through_the_pipeline(tmp_path, ray_local):
    """Epoch 0 draws the classes equally (no losses yet: no pruning); after skewed losses,
    each below-mean draw is kept with probability 1 - r and reweighted, and the weighted
    class totals stay balanced."""
    m = raying.Manifest.scan(str(_folder(tmp_path / "imbi", [30, 600])))  # 1:20
    r = 0.5
    sampler = raying.InfoBatchSampler(prune_ratio=r, epochs=None, seed=6,
                                      prior=raying.WeightedSampler(class_balanced=True))
    pipe = _pipe(m, sampler, "ib-prior")
    q = np.where(m.labels == 0, 0.5 / 30, 0.5 / 600)
    try:
        first = [b for b in pipe.iter_batches(batch_size=90, epoch=0)]
        labels = np.concatenate([b["label"] for b in first])
        assert labels.size == len(m)
        counts = np.bincount(labels, minlength=2)
        expected = np.full(2, labels.size / 2)
        assert chi2_sf(float(np.sum((counts - expected) ** 2 / expected)), 1) > 1e-3, counts
        assert all(np.all(b["weight"] == 1.0) and np.allclose(b["prob"], q[b["id"]])
                   for b in first)
        # Class 0 hard (loss 4), class 1 easy (loss 1): the prior-weighted mean is 2.5, so
        # every class-1 draw is pruned with probability r.
        _report(pipe, np.where(m.labels == 0, 4.0, 1.0))
        kept = np.zeros(2)
        weighted = np.zeros(2)
        epochs = 6
        for epoch in range(1, 1 + epochs):
            for b in pipe.iter_batches(batch_size=90, epoch=epoch):
                easy = b["label"] == 1
                assert np.allclose(b["prob"], q[b["id"]] * np.where(easy, 1 - r, 1.0))
                assert np.array_equal(b["weight"], np.where(easy, 1 / (1 - r), 1.0))
                kept += np.bincount(b["label"], minlength=2)
                weighted += np.bincount(b["label"], weights=b["weight"], minlength=2)
        per_epoch = pipe.stats()["sampling"]["per_epoch"]
    finally:
        pipe.close()
    # Per epoch, hard reads ~ Bin(630, 1/2) (all kept) and easy reads ~ Bin(630, (1 - r) / 2)
    # (a draw is easy with probability 1/2, then kept with 1 - r): z-scores over 6 epochs.
    for got, p in ((kept[0], 0.5), (kept[1], 0.5 * (1 - r))):
        mean, var = epochs * len(m) * p, epochs * len(m) * p * (1 - p)
        assert abs(got - mean) < 4 * np.sqrt(var), (kept, mean, var)
    assert abs(weighted[1] / weighted[0] - 1.0) < 0.1, weighted
    assert per_epoch[-1]["candidates"] == len(m) and per_epoch[-1]["pruned_share"] > 0.1


def test_infobatch_plans_an_epoch_when_it_starts_even_with_keep_warm(manifest, ray_local):
    """keep_warm (the default) starts the next epoch's reads early; an InfoBatch epoch is
    planned from the losses reported until it starts, so it is not planned early: every
    hard sample reported during epoch 0, the last batches' too, is read in epoch 1."""
    s = raying.InfoBatchSampler(prune_ratio=0.5, seed=2)
    pipe = raying.Pipeline(manifest, sampler=s,
                           transform=raying.ImageTransform(size=8, random_crop=False,
                                                           flip=False),
                           config=raying.PipelineConfig(block_rows=32, name="ib-warm"))
    assert pipe.config.keep_warm
    try:
        for b in pipe.iter_batches(batch_size=25, epoch=0):
            pipe.report(b["id"], np.where(manifest.labels[b["id"]] == 0, 10.0, 0.5))
        pipe.sampler.flush()
        store.flush(pipe.sampler.handle)
        ids = np.concatenate([b["id"] for b in pipe.iter_batches(batch_size=50, epoch=1)])
        assert (manifest.labels[ids] == 0).sum() == 40, "every hard sample is read"
        assert len(ids) < 200  # and the well learned are pruned
    finally:
        pipe.close()


@pytest.mark.parametrize("kind", ["weighted", "prioritized", "infobatch"])
def test_a_stateful_sampler_belongs_to_one_open_pipeline(manifest, ray_local, kind):
    """A second pipeline given a sampler bound to an open one is refused (it would rebind the
    sampler's weights or store under the first); once the first is closed it may have it.
    A pipeline's map_batches copies share it (one name), and a UniformSampler is shared."""
    make = {"weighted": lambda: raying.WeightedSampler(class_balanced=True, seed=1),
            "prioritized": lambda: raying.PrioritizedSampler(seed=1),
            "infobatch": lambda: raying.InfoBatchSampler(seed=1)}[kind]
    sampler = make()
    first = _pipe(manifest, sampler, f"owner-{kind}").map_batches(lambda b: b)
    rows = sum(len(b["id"]) for b in first.iter_batches(batch_size=16, epoch=0))
    assert rows > 0
    with pytest.raises(raying.ConfigError, match=rf"belongs to Pipeline 'owner-{kind}', which "
                                                 r"is open.*a sampler of its own"):
        _pipe(manifest, sampler, f"second-{kind}")
    first.close()
    second = _pipe(manifest, sampler, f"second-{kind}")
    assert sum(len(b["id"]) for b in second.iter_batches(batch_size=16, epoch=0)) > 0
    second.close()
    uniform = raying.UniformSampler(seed=0)
    a, b = _pipe(manifest, uniform, "u-a"), _pipe(manifest, uniform, "u-b")
    assert sum(len(x["id"]) for x in a.iter_batches(batch_size=16)) == len(manifest)
    assert sum(len(x["id"]) for x in b.iter_batches(batch_size=16)) == len(manifest)
    a.close()
    b.close()


def test_every_draw_a_weighted_epoch_does_not_deliver_is_said(tmp_path, ray_local, caplog):
    """Draws with replacement of a class of bad files: the next epoch is planned while this
    one's last reads run, so it may draw samples found bad after it was planned. Each epoch's
    delivered rows and the skips its log lines count add up to its draws."""
    import logging
    import re

    root = _folder(tmp_path / "late", [20, 4])
    for f in (root / "class_01").iterdir():
        f.write_bytes(b"")
    m = raying.Manifest.scan(str(root))
    pipe = raying.Pipeline(m, sampler=raying.WeightedSampler(class_balanced=True, seed=0),
                           transform=raying.ImageTransform(size=8),
                           config=raying.PipelineConfig(block_rows=8, name="late"))
    try:
        with caplog.at_level(logging.INFO, logger="raying"):
            rows = [sum(len(b["id"]) for b in pipe.iter_batches(batch_size=8, epoch=e))
                    for e in range(3)]
    finally:
        pipe.close()
    said = [r.getMessage() for r in caplog.records]
    for e, n in enumerate(rows):
        told = sum(int(k) for line in said for k in re.findall(
            rf"^raying skipped (\d+) (?:bad samples|more draws|draws) .*in epoch {e}\b", line))
        assert n + told == len(m), (e, rows, said)
    assert sum(rows) < 3 * len(m)  # class 1 (half the weight) was drawn


def test_weighted_shares_keep_cutting_one_plan_after_a_skip(tmp_path, ray_local):
    # Train workers each hold a copy of the sampler: a share that left its own skipped files
    # out of later plans cut another plan than the others (ids read twice, others never).
    root = _folder(tmp_path / "sh", [30, 30])
    (root / "class_00" / "00003.png").write_bytes(b"")  # bad, in some share's units
    (root / "class_01" / "00007.png").write_bytes(b"not a png")
    m = raying.Manifest.scan(str(root))
    cfg = dict(block_rows=8, keep_warm=False)
    shares = [raying.Pipeline(m, sampler=raying.WeightedSampler(class_balanced=True, seed=2),
                              transform=raying.ImageTransform(size=8),
                              config=raying.PipelineConfig(**cfg, shard=(i, 2), name="wsh"))
              for i in range(2)]
    try:
        skipped = 0
        for epoch in range(3):
            got = [np.concatenate([b["id"] for b in p.iter_batches(batch_size=8, epoch=epoch)])
                   for p in shares]
            plans = [[u.ids.tolist() for u in p.plan(epoch + 1).units] for p in shares]
            whole = raying.Pipeline(m, sampler=raying.WeightedSampler(class_balanced=True,
                                                                      seed=2),
                                    config=raying.PipelineConfig(block_rows=8))
            units = [u.ids.tolist() for u in whole.plan(epoch + 1).units]
            whole.close()
            # The shares' next plans are the units r, r + 2, ... of one plan.
            assert plans[0] == units[0::2] and plans[1] == units[1::2]
            skipped = sum(len(p.stats()["skipped"]) for p in shares)
            assert len(np.concatenate(got)) <= 60
        assert skipped >= 1  # a bad file was drawn (each epoch draws ~60 of 60 ids i.i.d.)
    finally:
        for p in shares:
            p.close()


def test_samples_the_dataset_path_sets_aside_leave_later_weighted_plans(tmp_path, ray_local):
    """pipe.dataset(e)'s reads run in Ray Data, out of the driver's sampler's sight: the
    next dataset's plan leaves the bad samples out, as the iterator path's does."""
    root = _folder(tmp_path / "ds", [30, 30])
    (root / "class_00" / "00003.png").write_bytes(b"")
    (root / "class_01" / "00007.png").write_bytes(b"not a png")
    m = raying.Manifest.scan(str(root))
    bad = {i for i, p in enumerate(m.path_of(np.arange(len(m))))
           if p.endswith(("00/00003.png", "01/00007.png"))}
    assert len(bad) == 2
    pipe = raying.Pipeline(m, sampler=raying.WeightedSampler(seed=2, samples_per_epoch=600),
                           transform=raying.ImageTransform(size=8),
                           config=raying.PipelineConfig(block_rows=64, keep_warm=False))
    try:
        rows = sum(len(b["id"]) for b in pipe.dataset(0).iter_batches(batch_size=None))
        assert 550 < rows < 600  # ~20 draws of the bad ones set aside
        pipe.dataset(1)
        later = np.concatenate([u.ids for u in pipe.plan(1).units])
        assert later.size == 600 and not bad & set(later.tolist())
        assert {s["id"] for s in pipe.stats(sampling=False)["skipped"]} == bad
    finally:
        pipe.close()
    # ... and so does the iterator path's next epoch, planned after them.
    pipe = raying.Pipeline(m, sampler=raying.WeightedSampler(seed=2, samples_per_epoch=600),
                           transform=raying.ImageTransform(size=8),
                           config=raying.PipelineConfig(block_rows=64, keep_warm=False))
    try:
        assert pipe.dataset(0).count() < 600
        ids = np.concatenate([b["id"] for b in pipe.iter_batches(batch_size=64, epoch=1)])
        assert ids.size == 600 and not bad & set(ids.tolist())
    finally:
        pipe.close()


def test_infobatch_scores_keep_no_loss_for_samples_the_dataset_path_sets_aside(tmp_path,
                                                                              ray_local):
    """InfoBatch's store holds losses: a bad sample read by pipe.dataset(e) leaves the next
    plans (the sampler's own set-aside), and is not written into it as a loss of 0 (which
    pulls the mean down and keeps it a candidate)."""
    root = _folder(tmp_path / "ib", [20, 20])
    (root / "class_00" / "00003.png").write_bytes(b"")
    m = raying.Manifest.scan(str(root))
    bad = next(i for i, p in enumerate(m.path_of(np.arange(len(m))))
               if p.endswith("00/00003.png"))
    pipe = _pipe(m, raying.InfoBatchSampler(prune_ratio=0.5, epochs=4, seed=0), "ibds")
    try:
        assert sum(len(b["id"]) for b in pipe.dataset(0).iter_batches(batch_size=None)) == 39
        pipe.dataset(1)
        assert np.isnan(pipe.sampler.scores()[bad])
        assert bad not in np.concatenate([u.ids for u in pipe.plan(1).units]).tolist()
    finally:
        pipe.close()


def test_shares_reading_datasets_keep_cutting_one_weighted_plan(tmp_path, ray_local):
    """A share of a sharded pipeline leaves the samples its own dataset reads set aside in
    its plans, as its iterator path does: every share must cut the same plan."""
    root = _folder(tmp_path / "sh", [20, 20])
    (root / "class_00" / "00005.png").write_bytes(b"")
    m = raying.Manifest.scan(str(root))
    shares = [raying.Pipeline(m, sampler=raying.WeightedSampler(seed=3, samples_per_epoch=200),
                              transform=raying.ImageTransform(size=8),
                              config=raying.PipelineConfig(block_rows=16, keep_warm=False,
                                                           shard=(i, 2)))
              for i in range(2)]
    try:
        for p in shares:
            assert sum(len(b["id"]) for b in p.dataset(0).iter_batches(batch_size=None)) > 0
        for p in shares:
            p.dataset(1)
        plans = [[u.ids.tolist() for u in p.plan(1).units] for p in shares]
        whole = raying.Pipeline(m, sampler=raying.WeightedSampler(seed=3, samples_per_epoch=200),
                                config=raying.PipelineConfig(block_rows=16))
        units = [u.ids.tolist() for u in whole.plan(1).units]
        whole.close()
        assert plans[0] == units[0::2] and plans[1] == units[1::2]
    finally:
        for p in shares:
            p.close()
