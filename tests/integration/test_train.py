"""raying.train with Ray Train: exactly-once shards, loss feedback, resume after a failure."""

from __future__ import annotations

import json
import os
import pickle

import numpy as np
import pytest

import raying
import raying.train

pytestmark = pytest.mark.timeout(600)


def _trainer(loop, pipe, tmp_path, *, epochs, config=None, failures=0, workers=2):
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    return TorchTrainer(
        loop, train_loop_config={"out": str(tmp_path), **(config or {})},
        # Half a CPU each: on the 2-CPU test cluster the read tasks need the rest.
        scaling_config=ScalingConfig(num_workers=workers, resources_per_worker={"CPU": 0.5}),
        run_config=RunConfig(storage_path=str(tmp_path / "results"), name="run",
                             failure_config=FailureConfig(max_failures=failures)),
        **raying.train.datasets(pipe, epochs=epochs))


def _log(config, name, ids):
    with open(os.path.join(config["out"], name), "a") as fh:
        fh.write(json.dumps([int(i) for i in ids]) + "\n")


def _read(tmp_path, name):
    path = tmp_path / name
    if not path.exists():
        return []
    return [i for line in path.read_text().splitlines() for i in json.loads(line)]


def _double_id(batch):
    return {**batch, "twice": batch["id"] * 2}


def _uniform_loop(config):
    import ray.train
    import torch

    loader = raying.train.loader()
    rank = ray.train.get_context().get_world_rank()
    model = torch.nn.Linear(3 * 16 * 16, 3)
    for epoch in loader.epochs():
        for batch in loader.iter_torch_batches(batch_size=16):
            assert batch["image"].dtype == torch.float32 and batch["image"].shape[1:] == (3, 16, 16)
            model(batch["image"].flatten(1))
            assert torch.equal(batch["twice"], batch["id"] * 2)  # the pipeline's own stage ran
            _log(config, f"r{rank}-e{epoch}", batch["id"].tolist())
        ray.train.report({"epoch": epoch}, checkpoint=loader.checkpoint(model=model.state_dict()))


def test_uniform_epochs_reach_every_id_exactly_once_across_the_workers(image_folder, ray_local,
                                                                       tmp_path):
    m = raying.Manifest.scan(str(image_folder))
    pipe = raying.Pipeline(m, transform=raying.ImageTransform(size=16),
                           sampler=raying.UniformSampler(seed=3),
                           config=raying.PipelineConfig(block_rows=8)).map_batches(_double_id)
    result = _trainer(_uniform_loop, pipe, tmp_path, epochs=2).fit()
    for epoch in range(2):
        a, b = _read(tmp_path, f"r0-e{epoch}"), _read(tmp_path, f"r1-e{epoch}")
        assert a and b and not set(a) & set(b)
        assert sorted(a + b) == list(range(len(m)))  # every id once: none dropped, none twice
    assert _read(tmp_path, "r0-e0") != _read(tmp_path, "r0-e1")  # a new order every epoch
    files = sorted(os.listdir(result.checkpoint.path))
    assert files == ["raying-position-rank0.pkl", "raying-position-rank1.pkl",
                     "raying-state.pkl"]
    with open(os.path.join(result.checkpoint.path, "raying-state.pkl"), "rb") as fh:
        assert set(pickle.load(fh)) == {"model"}
    pipe.close()


def _prioritized_loop(config):
    import ray.train
    import torch

    loader = raying.train.loader()
    rank = ray.train.get_context().get_world_rank()
    hard = set(config["hard"])
    for epoch in loader.epochs():
        for batch in loader.iter_torch_batches(batch_size=16, normalize=False):
            ids = batch["id"].tolist()
            loss = torch.tensor([100.0 if i in hard else 1e-3 for i in ids])
            loader.report(batch["id"], loss)
            _log(config, f"r{rank}-e{epoch}", ids)
        ray.train.report({"epoch": epoch}, checkpoint=loader.checkpoint())


def test_prioritized_losses_from_both_workers_shift_the_next_epoch(image_folder, ray_local,
                                                                    tmp_path):
    m = raying.Manifest.scan(str(image_folder))
    hard = [i for i in range(len(m)) if m.labels[i] == 0]
    pipe = raying.Pipeline(m, transform=raying.ImageTransform(size=16),
                           sampler=raying.PrioritizedSampler(alpha=1.0, uniform_mix=0.1, seed=3),
                           config=raying.PipelineConfig(block_rows=8))
    _trainer(_prioritized_loop, pipe, tmp_path, epochs=3, config={"hard": hard}).fit()
    reported = sum(len(_read(tmp_path, f"r{r}-e{e}")) for r in range(2) for e in range(3))
    stats = pipe.sampler.stats()
    assert stats["updates_received"] == reported  # every report of both workers arrived
    assert all(_read(tmp_path, f"r{r}-e0") for r in range(2))  # both workers read and reported

    def share(epoch):
        ids = _read(tmp_path, f"r0-e{epoch}") + _read(tmp_path, f"r1-e{epoch}")
        return np.isin(ids, hard).mean()

    base = len(hard) / len(m)
    # Prioritized units are drawn when read, so epoch 0 already shifts as losses arrive; by
    # epoch 2 the hard class's priority mass (100 vs 0.001) takes ~90 % of the draws plus its
    # share of the floor, against its base share of a third.
    assert share(2) > 0.8 > base + 0.25 and share(2) > share(0)
    pipe.close()


def _wait_registered(run_dir, timeout_s=120.0):
    """Until the Train controller has registered a checkpoint of the run (it writes its
    checkpoint manager's state then): a worker that dies before would lose it."""
    import time

    path = os.path.join(run_dir, "checkpoint_manager_snapshot.json")
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with open(path) as fh:
                if json.load(fh).get("checkpoint_results"):
                    return
        except (OSError, ValueError):
            pass
        time.sleep(0.1)
    raise AssertionError(f"no checkpoint registered in {path} after {timeout_s} s")


def _killed_loop(config):
    import ray.train
    import torch

    loader = raying.train.loader()
    rank = ray.train.get_context().get_world_rank()
    marker = os.path.join(config["out"], "killed")
    attempt = 1 if os.path.exists(marker) else 0
    _log(config, f"restored-a{attempt}-r{rank}", [loader.restored is not None])
    for epoch in loader.epochs():
        for k, batch in enumerate(loader.iter_torch_batches(batch_size=4, normalize=False)):
            ids = batch["id"].tolist()
            loader.report(batch["id"], torch.tensor([float(i + 1) for i in ids]))
            _log(config, f"a{attempt}-r{rank}-e{epoch}", ids)
            if attempt == 0 and epoch == 0 and k == 1:
                ray.train.report({"k": k}, checkpoint=loader.checkpoint(attempt=attempt))
            if attempt == 0 and epoch == 0 and k == 3 and rank == 1:
                open(marker, "w").close()
                _wait_registered(os.path.join(config["out"], "results", "run"))
                os._exit(1)  # the worker dies mid-epoch, after the checkpoint
        ray.train.report({"epoch": epoch}, checkpoint=loader.checkpoint(attempt=attempt))


def test_a_worker_killed_mid_epoch_resumes_from_the_checkpoint(image_folder, ray_local,
                                                               tmp_path):
    m = raying.Manifest.scan(str(image_folder))
    pipe = raying.Pipeline(m, transform=raying.ImageTransform(size=16),
                           sampler=raying.PrioritizedSampler(alpha=1.0, uniform_mix=0.1, seed=5,
                                                             samples_per_epoch=len(m)),
                           config=raying.PipelineConfig(block_rows=8))
    upto = raying.Pipeline(m, transform=raying.ImageTransform(size=16),
                           sampler=raying.UniformSampler(seed=5),
                           config=raying.PipelineConfig(block_rows=8))
    for p, kind in ((upto, "uniform"), (pipe, "prioritized")):
        out = tmp_path / kind
        out.mkdir()
        result = _trainer(_killed_loop, p, out, epochs=2, failures=1).fit()
        assert result.error is None
        # Both workers restarted once, from the mid-epoch checkpoint.
        assert [_read(out, f"restored-a1-r{r}") for r in range(2)] == [[True], [True]]
        for rank in range(2):
            first = _read(out, f"a0-r{rank}-e0")
            after = _read(out, f"a1-r{rank}-e0")
            assert first and after
            # The checkpoint came after batch k=1: 2 batches of 4 delivered before it.
            before, between = first[:8], first[8:]
            if kind == "uniform":
                share = before + after
                assert len(share) == len(set(share))  # nothing delivered twice after resume
                assert set(between) <= set(after)  # only rows read after the checkpoint repeat
                if rank == 1:
                    assert len(between) == 8  # rank 1 read 2 more batches and died
            # The restarted workers ran epoch 1 whole.
            assert _read(out, f"a1-r{rank}-e1")
        if kind == "uniform":
            epoch0 = sum((_read(out, f"a0-r{r}-e0")[:8] + _read(out, f"a1-r{r}-e0")
                          for r in range(2)), [])
            assert sorted(epoch0) == list(range(len(m)))  # the epoch completed exactly once
        else:
            # The mid-epoch checkpoint holds every loss both workers reported before it.
            ckpts = sorted((tmp_path / kind / "results" / "run").glob("checkpoint_*"))
            with open(ckpts[0] / "raying-position-rank0.pkl", "rb") as fh:
                tables = pickle.load(fh)["position"]["sampler"]["tables"]
            prio = np.concatenate([t["priorities"] for t in tables])
            reported = _read(out, "a0-r0-e0")[:8] + _read(out, "a0-r1-e0")[:8]
            assert np.allclose(prio[reported], np.asarray(reported) + 1.0)
        p.close()


def _tf_loop(config):
    import itertools
    import os

    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import keras
    import tensorflow as tf

    # A custom step: Keras 3's fit() cannot reduce its scalar logs across workers under the
    # multi-worker strategy (its "mean" reduction takes axis 0 of a scalar).
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    loader = raying.train.loader()
    batch_size = 8
    with strategy.scope():
        model = keras.Sequential([keras.Input((16, 16, 3)), keras.layers.Flatten(),
                                  keras.layers.Dense(3)])
        opt = keras.optimizers.SGD(0.05)

    @tf.function
    def step(image, label):
        with tf.GradientTape() as tape:
            per = keras.losses.sparse_categorical_crossentropy(label, model(image),
                                                               from_logits=True)
            loss = tf.reduce_sum(per) / (batch_size * loader.world_size)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables, strict=True))
        return per

    for _ in loader.epochs():
        steps = loader.steps_per_epoch(batch_size)  # the same on every worker
        for batch in itertools.islice(loader.to_tf(batch_size=batch_size), steps):
            per = strategy.run(step, args=(batch["image"], batch["label"]))
            loader.report(batch["id"].numpy(), strategy.experimental_local_results(per)[0])
        _log(config, f"tf-r{loader.rank}", [steps, int(opt.iterations.numpy())])
    loader.flush()


def test_tensorflow_trainer_trains_an_epoch_from_to_tf_and_feeds_the_losses_back(
        image_folder, ray_local, tmp_path):
    from ray.train import RunConfig, ScalingConfig
    from ray.train.tensorflow import TensorflowTrainer

    m = raying.Manifest.scan(str(image_folder))
    pipe = raying.Pipeline(m, transform=raying.ImageTransform(size=16),
                           sampler=raying.PrioritizedSampler(seed=2),
                           config=raying.PipelineConfig(block_rows=8))
    trainer = TensorflowTrainer(
        _tf_loop, train_loop_config={"out": str(tmp_path)},
        scaling_config=ScalingConfig(num_workers=2, resources_per_worker={"CPU": 0.5}),
        run_config=RunConfig(storage_path=str(tmp_path / "results"), name="tf"),
        **raying.train.datasets(pipe, epochs=1))
    trainer.fit()
    runs = [_read(tmp_path, f"tf-r{r}") for r in range(2)]
    steps = runs[0][0]
    assert steps > 0 and runs == [[steps, steps], [steps, steps]]  # same steps on both
    from raying.sampling import store as st

    st.flush(pipe.sampler.handle)
    # Both workers' per-sample losses reached the store: 2 workers x steps x 8 samples.
    assert pipe.sampler.stats()["updates_received"] == 2 * steps * 8
    pipe.close()


def test_a_new_driver_resuming_a_prioritized_run_gets_the_checkpoint_s_priorities(
        image_folder, ray_local, tmp_path):
    """A run resumed by another driver (Ray Train's restore by name and storage) has a fresh
    store at the initial priority: the Loader puts rank 0's snapshot of the priorities into
    it. A store that holds reports of its own (a worker restarted within the run) keeps them."""
    from ray.train import Checkpoint

    from raying.train.feed import Feed
    from raying.train.loader import _POSITION, Loader

    m = raying.Manifest.scan(str(image_folder))
    first = raying.Pipeline(m, sampler=raying.PrioritizedSampler(seed=0),
                            transform=raying.ImageTransform(size=16))
    ids = np.arange(len(m))
    first.report(ids, np.where(ids % 10 == 0, 10.0, 0.01))
    first.sampler.flush()
    from raying.sampling import store

    store.flush(first.sampler.handle)
    wanted = first.priorities()
    folder = tmp_path / "ckpt"
    folder.mkdir()
    with open(folder / _POSITION.format(0), "wb") as fh:
        pickle.dump({"epoch": 1, "complete": True, "world_size": 1,
                     "position": first.state_dict()}, fh)
    first.close()

    def resumed(report_first: bool):
        pipe = raying.Pipeline(m, sampler=raying.PrioritizedSampler(seed=0),
                               transform=raying.ImageTransform(size=16))
        pipe.priorities()  # its store, fresh
        if report_first:  # the store has reports of its own: they stay
            pipe.report(ids[:5], np.ones(5))
            pipe.sampler.flush()
            store.flush(pipe.sampler.handle)
        loader = Loader(Feed.of(pipe, 3), rank=0, world_size=1,
                        checkpoint=Checkpoint.from_directory(str(folder)))
        return pipe, loader

    pipe, loader = resumed(report_first=False)
    assert loader.priorities_restored and list(loader.epochs()) == [2]
    np.testing.assert_allclose(pipe.priorities(), wanted)
    assert pipe.priorities()[ids % 10 == 0].min() > 10 * pipe.priorities()[ids % 10 != 0].max()
    loader.close()
    pipe.close()

    pipe, loader = resumed(report_first=True)
    assert not loader.priorities_restored
    assert np.ptp(pipe.priorities()[ids % 10 != 0]) == 0  # nothing loaded over its own
    loader.close()
    pipe.close()


def test_a_tf_loop_of_steps_checkpointed_at_its_epoch_end_resumes_at_the_next_epoch(
        image_folder, ray_local, tmp_path, caplog):
    """The TF loop of the guide (islice over loader.to_tf, steps_per_epoch steps) never ends
    the dataset's generator: its epoch-end checkpoint still counts the epoch done, and a
    worker whose own share was not read to its end follows the others to the next epoch."""
    pytest.importorskip("tensorflow")
    import itertools
    import logging
    import shutil

    from ray.train import Checkpoint

    from raying.train.feed import Feed
    from raying.train.loader import _POSITION, Loader

    m = raying.Manifest.scan(str(image_folder))  # 60 samples: 8 batches of 8, the last of 4
    pipe = raying.Pipeline(m, transform=raying.ImageTransform(size=16))
    loader = Loader(Feed.of(pipe, 3), rank=0, world_size=1)
    for _ in loader.epochs():
        rows = sum(int(b["id"].shape[0])
                   for b in itertools.islice(loader.to_tf(batch_size=8), 8))
        assert rows == 60
        ck = loader.checkpoint(model="m")
        break
    resumed = Loader(Feed.of(pipe, 3), rank=0, world_size=1, checkpoint=ck)
    assert resumed.restored == {"model": "m"} and list(resumed.epochs()) == [1, 2]
    # A run of one epoch given that checkpoint (Ray Train restores a finished run of the same
    # name) has nothing to read: it says so rather than end in silence.
    with caplog.at_level(logging.WARNING, logger="raying"):
        done = Loader(Feed.of(pipe, 1), rank=0, world_size=1, checkpoint=ck)
    assert list(done.epochs()) == []
    assert "at the end of all 1 epochs, so no epoch is left to read" in caplog.text
    assert "give the run a new name" in caplog.text
    # Two workers: rank 1 stopped two batches short of its share's end (steps_per_epoch is
    # the smallest share's), rank 0 read its share through. Both resume at epoch 1.
    both = tmp_path / "both"
    with ck.as_directory() as folder:
        shutil.copytree(folder, both)
    with open(both / _POSITION.format(0), "rb") as fh:
        saved = pickle.load(fh)
    saved["world_size"] = 2
    with open(both / _POSITION.format(0), "wb") as fh:
        pickle.dump(saved, fh)
    short = dict(saved, complete=False,
                 position={**saved["position"], "epoch": 0, "unit": 1, "row": 0})
    with open(both / _POSITION.format(1), "wb") as fh:
        pickle.dump(short, fh)
    for rank in (0, 1):
        worker = Loader(Feed.of(pipe, 3), rank=rank, world_size=2,
                        checkpoint=Checkpoint.from_directory(str(both)))
        assert list(worker.epochs()) == [1, 2], rank
        worker.close()
    # Rank 0's position alone (only rank 0 reported its checkpoint): rank 1 would start the
    # epochs over while rank 0 went on (it did, silently); refused, saying what to report.
    (both / _POSITION.format(1)).unlink()
    with pytest.raises(raying.ConfigError, match=r"holds the positions \['raying-position-"
                                                 r"rank0.pkl'\] but not rank 1's: every Train "
                                                 r"worker must pass its own"):
        Loader(Feed.of(pipe, 3), rank=1, world_size=2,
               checkpoint=Checkpoint.from_directory(str(both)))
    resumed.close()
    loader.close()
    pipe.close()


def test_a_train_job_whose_workers_cannot_fit_this_node_asks_for_storage_path(ray_local):
    # An autoscaling cluster whose trainer nodes are not up yet looks like one node: the
    # workers will run elsewhere, and a local run folder would fail at the first checkpoint.
    from tests.integration.test_multinode import _load_job

    job = _load_job("train_torch")
    args = job.build_parser().parse_args(["--smoke-test", "--num-workers", "16",
                                          "--cpus-per-worker", "1"])
    with pytest.raises(SystemExit, match=r"need CPU 16 \(this node has 2\).*--storage-path"):
        job.fit(args)


def test_a_train_job_leaves_the_reads_a_cpu_on_one_node(ray_local, capsys):
    # On the 2-CPU node, 2 workers of 1 CPU each (the jobs' default) would leave the read
    # tasks none and the run waiting for ever: a default shrinks, a given value is refused.
    from tests.integration.test_multinode import _load_job

    job = _load_job("train_torch")
    args = job.resolve(job.build_parser().parse_args(["--data", "unused"]))
    assert (args.cpus_per_worker, args.cpus_auto) == (1.0, True)
    job._common.room_for_reads(args)
    assert args.cpus_per_worker == 0.5
    assert "each of the 2 Train workers takes 0.5 (not 1), leaving 1 for the read tasks" in (
        capsys.readouterr().err)
    given = job.resolve(job.build_parser().parse_args(
        ["--data", "unused", "--num-workers", "3", "--cpus-per-worker", "0.5"]))
    with pytest.raises(SystemExit, match=r"the 3 Train workers take 1.5 of this node's 2 free CPUs, "
                                         r"leaving 0.5 .*pass --cpus-per-worker 0.3 or less"):
        job._common.room_for_reads(given)
    two = job.resolve(job.build_parser().parse_args(
        ["--data", "unused", "--num-workers", "2", "--cpus-per-worker", "1"]))
    with pytest.raises(SystemExit, match=r"pass --cpus-per-worker 0.5 or less"):
        job._common.room_for_reads(two)
    # Other nodes may come (shared storage given), or the workers fit elsewhere only: left
    # to raying.train's warning and train_storage.
    two.storage_path = "s3://bucket/runs"
    job._common.room_for_reads(two)
    big = job.resolve(job.build_parser().parse_args(
        ["--data", "unused", "--num-workers", "16", "--cpus-per-worker", "1"]))
    job._common.room_for_reads(big)
    assert (two.cpus_per_worker, big.cpus_per_worker) == (1, 1)
    smoke = job.resolve(job.build_parser().parse_args(["--smoke-test"]))
    job._common.room_for_reads(smoke)
    assert smoke.cpus_per_worker == 0.25
    # Another run's Train workers hold CPUs in a placement group: what they hold is taken.
    from ray.util.placement_group import placement_group, remove_placement_group

    for held, want in ((0.5, 0.25), (1.0, None)):
        pg = placement_group([{"CPU": held}])
        try:
            ray_local.get(pg.ready(), timeout=60)
            args = job.resolve(job.build_parser().parse_args(["--data", "unused"]))
            if want is not None:
                job._common.room_for_reads(args)
                assert args.cpus_per_worker == want
                assert f"({held:g} of its 2 held by other runs)" in capsys.readouterr().err
            else:  # two runs whose workers leave each other's reads nothing: refused
                with pytest.raises(SystemExit, match=r"\(1 of its 2 held by other runs\).*"
                                                     r"wait for the other runs to end"):
                    job._common.room_for_reads(args)
                smoke = job.resolve(job.build_parser().parse_args(["--smoke-test"]))
                with pytest.raises(SystemExit, match=r"wait for the other runs to end"):
                    job._common.room_for_reads(smoke)
        finally:
            remove_placement_group(pg)


def test_the_room_for_reads_counts_what_placement_groups_reserve_not_what_runs_now(
        ray_local, caplog):
    # Train workers of half a CPU each leave a CPU for the reads even while a read task
    # (here a sleeping task of one CPU) holds it; workers of one CPU each leave none.
    import logging
    import time

    from ray.util.placement_group import placement_group, remove_placement_group

    from raying.train.loader import _check_room_for_reads

    @ray_local.remote(num_cpus=1)
    def busy(seconds):
        time.sleep(seconds)

    for cpus, warned in ((0.5, False), (1.0, True)):
        pg = placement_group([{"CPU": cpus}, {"CPU": cpus}])
        try:
            ray_local.get(pg.ready(), timeout=60)
            running = busy.remote(3.0) if not warned else None
            if running is not None:  # the busy task holds the CPU left over: none is free
                deadline = time.monotonic() + 30
                while ray_local.available_resources().get("CPU", 0.0) >= 1.0:
                    assert time.monotonic() < deadline
                    time.sleep(0.05)
            caplog.clear()
            with caplog.at_level(logging.WARNING, logger="raying"):
                _check_room_for_reads(1.0)
            assert any("reads then wait" in r.getMessage() for r in caplog.records) is warned
            if running is not None:
                ray_local.get(running)
        finally:
            remove_placement_group(pg)


def test_a_read_that_waits_for_a_cpu_the_placement_groups_hold_says_so(
        image_folder, ray_local, caplog, monkeypatch):
    # Train workers that hold every CPU leave the reads queued: the stall warning names that
    # cause and the fix, not a hung storage read; the epoch completes once a CPU is free.
    import logging
    import threading

    from ray.util.placement_group import placement_group, remove_placement_group

    import raying.engine.stream as stream

    monkeypatch.setattr(stream, "STALL_WARN_S", 0.3)
    m = raying.Manifest.scan(str(image_folder))
    pipe = raying.Pipeline(m, transform=raying.ImageTransform(size=16),
                           config=raying.PipelineConfig(block_rows=32))
    pg = placement_group([{"CPU": 1.0}, {"CPU": 1.0}])
    ray_local.get(pg.ready(), timeout=60)
    freed = threading.Timer(2.0, remove_placement_group, args=(pg,))
    try:
        with caplog.at_level(logging.WARNING, logger="raying"):
            freed.start()
            ids = np.concatenate([b["id"] for b in pipe.iter_batches(batch_size=16, epoch=0)])
        assert sorted(ids.tolist()) == list(range(len(m)))
        said = [r.getMessage() for r in caplog.records if "has waited" in r.getMessage()]
        assert said and "may never start: the cluster has 0.00 CPU beside what its " \
            "placement groups reserve" in said[0] and "resources_per_worker" in said[0], said
        assert "HDFS" not in said[0], said  # (once the group is gone, a later one may be)
    finally:
        freed.join()
        pipe.close()


def _feed_and_val_loop(config):
    import ray
    import ray.train

    rank = ray.train.get_context().get_world_rank()
    shard = ray.train.get_dataset_shard(raying.train.FEED_DATASET)
    _log(config, f"feed-by-ref-r{rank}", [int(isinstance(shard, ray.ObjectRef))])
    loader = raying.train.loader()
    early = dict(loader.pipe._stream._inflight)  # the first reads started with the loader
    _log(config, f"early-r{rank}", [k[1] for k in early if k[0] == 0 and k[2] == 0])
    stream, taken = loader.pipe._stream, []
    orig = stream._take
    stream._take = lambda key: taken.append(stream._inflight.get(key)) or orig(key)
    for epoch in loader.epochs():
        for batch in loader.iter_batches(batch_size=16):
            _log(config, f"r{rank}-e{epoch}", batch["id"].tolist())
    stream._take = orig
    _log(config, f"early-taken-r{rank}", [int(any(t is ref for t in taken))
                                          for ref in early.values()])
    for name in ("val", "whole"):
        shard = ray.train.get_dataset_shard(name)
        _log(config, f"{name}-r{rank}", [row["v"] for row in shard.iter_rows()])
    loader.close()


def test_the_feed_reaches_workers_by_reference_beside_datasets_of_the_trainer(
        image_folder, ray_local, tmp_path):
    """The feed's DataConfig hands the workers the description, not a Ray Data iterator (no
    Ray Data runs for it); the trainer's own datasets are read whole by every worker, or
    split over them when FeedConfig names them."""
    import ray.data

    from raying.train.config import FeedConfig

    m = raying.Manifest.scan(str(image_folder))
    pipe = raying.Pipeline(m, transform=raying.ImageTransform(size=16),
                           config=raying.PipelineConfig(block_rows=8))
    kw = raying.train.datasets(pipe, epochs=1)
    kw["datasets"]["val"] = ray.data.from_items([{"v": i} for i in range(40)])
    kw["datasets"]["whole"] = ray.data.from_items([{"v": i} for i in range(10)])
    kw["dataset_config"] = FeedConfig(datasets_to_split=["val"])
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    TorchTrainer(_feed_and_val_loop, train_loop_config={"out": str(tmp_path)},
                 scaling_config=ScalingConfig(num_workers=2, resources_per_worker={"CPU": 0.5}),
                 run_config=RunConfig(storage_path=str(tmp_path / "results"), name="run"),
                 **kw).fit()
    assert _read(tmp_path, "feed-by-ref-r0") == _read(tmp_path, "feed-by-ref-r1") == [1]
    for rank in (0, 1):  # the loader's early reads are the ones the first epoch takes
        assert _read(tmp_path, f"early-r{rank}")[:1] == [0]
        taken = _read(tmp_path, f"early-taken-r{rank}")
        assert taken and all(taken)
    a, b = _read(tmp_path, "r0-e0"), _read(tmp_path, "r1-e0")
    assert sorted(a + b) == list(range(len(m)))
    va, vb = _read(tmp_path, "val-r0"), _read(tmp_path, "val-r1")
    assert va and vb and sorted(va + vb) == list(range(40))  # named: split
    assert sorted(_read(tmp_path, "whole-r0")) == sorted(_read(tmp_path, "whole-r1")) == list(
        range(10))  # not named: every worker reads it whole
    pipe.close()


def _plain_config_loop(config):
    import ray.train

    rank = ray.train.get_context().get_world_rank()
    loader = raying.train.loader()
    for epoch in loader.epochs():
        for batch in loader.iter_batches(batch_size=16):
            _log(config, f"r{rank}-e{epoch}", batch["id"].tolist())
    loader.close()


@pytest.mark.parametrize("split", [False, True])
def test_under_a_plain_data_config_the_feed_is_read_through_ray_data_or_refused_if_split(
        image_folder, ray_local, tmp_path, split):
    from ray.train import DataConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    m = raying.Manifest.scan(str(image_folder))
    pipe = raying.Pipeline(m, transform=raying.ImageTransform(size=16),
                           config=raying.PipelineConfig(block_rows=8))
    kw = raying.train.datasets(pipe, epochs=1)
    kw["dataset_config"] = DataConfig() if split else DataConfig(datasets_to_split=[])
    trainer = TorchTrainer(
        _plain_config_loop, train_loop_config={"out": str(tmp_path)},
        scaling_config=ScalingConfig(num_workers=2, resources_per_worker={"CPU": 0.5}),
        run_config=RunConfig(storage_path=str(tmp_path / "results"), name="run"), **kw)
    if split:  # one row over two workers: one gets none, and says what to pass instead
        with pytest.raises(Exception, match=r"trainer's dataset_config split it"):
            trainer.fit()
    else:
        trainer.fit()
        a, b = _read(tmp_path, "r0-e0"), _read(tmp_path, "r1-e0")
        assert sorted(a + b) == list(range(len(m)))
    pipe.close()


def test_a_dataset_that_replaced_the_feed_or_split_it_is_named_for_what_it_is(ray_local):
    # A user's dataset given the feed's name replaces it in the trainer's datasets: the loader
    # says so (not that a split cut it), after reading two rows of it, not all of it.
    import ray

    from raying.train.loader import _feed_bytes

    images = ray.data.from_items([{"image": b"x", "label": i} for i in range(150)])
    with pytest.raises(raying.ConfigError, match=r"dataset 'val' is not the pipeline's "
                       r"description .*\['image', 'label'\].*same name replaced it"):
        _feed_bytes(images.iterator(), "val")
    feed = ray.data.from_items([{"feed": b"a"}, {"feed": b"b"}])  # two rows: a split's input
    with pytest.raises(raying.ConfigError, match=r"got more than one row .*split it"):
        _feed_bytes(feed.iterator(), "val")
    with pytest.raises(raying.ConfigError, match=r"got no row .*split it"):
        _feed_bytes(feed.filter(lambda r: False).iterator(), "val")
    assert _feed_bytes(ray.data.from_items([{"feed": b"a"}]).iterator(), "val") == b"a"


def test_steps_per_epoch_refuses_a_batch_over_a_share_and_warns_when_steps_leave_rows_out(
        image_folder, ray_local, caplog):
    # The TF loop takes steps_per_epoch steps on every worker: a batch over the smallest
    # share would train on nothing, and a batch near it on a part of the epoch, silently.
    import logging

    from raying.train.feed import Feed
    from raying.train.loader import Loader

    m = raying.Manifest.scan(str(image_folder))  # 60 images: shares of 30 on 2 workers
    pipe = raying.Pipeline(m, transform=raying.ImageTransform(size=16),
                           config=raying.PipelineConfig(block_rows=10))
    loaders = [Loader(Feed.of(pipe, 1), rank=r, world_size=2) for r in range(2)]
    try:
        with caplog.at_level(logging.WARNING, logger="raying"):
            assert [ld.steps_per_epoch(10) for ld in loaders] == [3, 3]  # all 60 in a step
            assert not [r for r in caplog.records if "read by no step" in r.getMessage()]
            assert [ld.steps_per_epoch(16) for ld in loaders] == [1, 1]  # 32 of 60
            said = [r.getMessage() for r in caplog.records if "read by no step" in r.getMessage()]
            assert len(said) == 1 and "train on 32 of epoch 0's 60 rows; 28 are" in said[0]
            loaders[0].steps_per_epoch(16)  # said once per loader
            assert len([r for r in caplog.records if "read by no step" in r.getMessage()]) == 1
        for ld in loaders:
            with pytest.raises(raying.ConfigError, match=r"holds 30 rows, under one batch.*"
                                                         r"batch size of at most 30"):
                ld.steps_per_epoch(31)
        for bad in (0, -16, 2.5, True, "16"):  # not a batch size: no division by 0, no truncation
            with pytest.raises(raying.ConfigError, match=r"must be a positive int"):
                loaders[0].steps_per_epoch(bad)
        # More workers than read units: two of four shares are empty.
        wide = [Loader(Feed.of(pipe, 1), rank=r, world_size=8) for r in range(2)]
        loaders += wide
        with pytest.raises(raying.ConfigError, match=r"6 read units for 8 workers.*empty"):
            wide[0].steps_per_epoch(1)
    finally:
        for ld in loaders:
            ld.pipe.close()
        pipe.close()


def test_a_torch_loop_of_steps_checkpointed_at_its_epoch_end_resumes_at_the_next_epoch(
        image_folder, ray_local):
    """islice over iter_batches for steps_per_epoch steps never asks past its last step: the
    epoch-end checkpoint counts the epoch done (it resumed the rest of it as another epoch,
    with other step counts on each worker)."""
    import itertools

    from raying.train.feed import Feed
    from raying.train.loader import Loader

    m = raying.Manifest.scan(str(image_folder))  # 60 samples: 7 whole batches of 8
    pipe = raying.Pipeline(m, transform=raying.ImageTransform(size=16))
    loader = Loader(Feed.of(pipe, 3), rank=0, world_size=1)
    for _ in loader.epochs():
        steps = loader.steps_per_epoch(8)
        rows = sum(len(b["id"]) for b in itertools.islice(loader.iter_batches(batch_size=8),
                                                          steps))
        assert (steps, rows) == (7, 56)
        ck = loader.checkpoint(model="m")
        break
    resumed = Loader(Feed.of(pipe, 3), rank=0, world_size=1, checkpoint=ck)
    assert list(resumed.epochs()) == [1, 2]
    resumed.close()
    loader.close()
    pipe.close()


def test_each_feed_restores_its_own_position_from_a_checkpoint(image_folder, tmp_path,
                                                               ray_local):
    """A validation feed beside the training one (datasets(val, name="val")) given the
    training loader's checkpoint starts afresh: it loaded the training feed's position
    (another manifest: refused, and the restarted run failed)."""
    import itertools

    from raying.tools.datagen import make_image_folder
    from raying.train.feed import Feed
    from raying.train.loader import Loader

    train = raying.Pipeline(raying.Manifest.scan(str(image_folder)),
                            transform=raying.ImageTransform(size=16))
    other = make_image_folder(tmp_path / "val", n=20, classes=2, size=(24, 24), seed=4)
    val = raying.Pipeline(raying.Manifest.scan(str(other)),
                          transform=raying.ImageTransform(size=16))
    loader = Loader(Feed.of(train, 2), rank=0, world_size=1)
    for _ in loader.epochs():
        list(itertools.islice(loader.iter_batches(batch_size=8), 3))  # mid-epoch
        ck = loader.checkpoint(model="m")
        break
    checker = Loader(Feed.of(val, 1), rank=0, world_size=1, checkpoint=ck, dataset="val")
    assert checker.restored is None and list(checker.epochs()) == [0]
    ids = np.concatenate([b["id"] for b in checker.iter_batches(batch_size=8)])
    assert sorted(ids.tolist()) == list(range(20))  # its whole epoch, not the train's rest
    own = checker.checkpoint(step=1)
    again = Loader(Feed.of(val, 2), rank=0, world_size=1, checkpoint=own, dataset="val")
    assert again.restored == {"step": 1} and list(again.epochs()) == [1]
    resumed = Loader(Feed.of(train, 2), rank=0, world_size=1, checkpoint=ck)
    assert resumed.restored == {"model": "m"} and list(resumed.epochs()) == [0, 1]
    for x in (loader, checker, again, resumed):
        x.close()
    train.close()
    val.close()


def test_steps_per_epoch_of_an_epoch_resumed_mid_way_counts_the_rows_left(image_folder,
                                                                         ray_local):
    """After a checkpoint 24 rows into a 60-row epoch, a loop of steps_per_epoch steps takes
    the 36 rows left (4 steps of 8), not the whole epoch's 7 steps, and its checkpoint then
    resumes at the next epoch."""
    import itertools

    from raying.train.feed import Feed
    from raying.train.loader import Loader

    m = raying.Manifest.scan(str(image_folder))
    pipe = raying.Pipeline(m, transform=raying.ImageTransform(size=16))
    loader = Loader(Feed.of(pipe, 3), rank=0, world_size=1)
    for _ in loader.epochs():
        seen = [b["id"] for b in itertools.islice(loader.iter_batches(batch_size=8), 3)]
        ck = loader.checkpoint()
        break
    resumed = Loader(Feed.of(pipe, 3), rank=0, world_size=1, checkpoint=ck)
    epochs = resumed.epochs()
    assert next(epochs) == 0
    steps = resumed.steps_per_epoch(8)
    assert steps == 4
    rest = [b["id"] for b in itertools.islice(resumed.iter_batches(batch_size=8), steps)]
    got = np.concatenate(seen + rest)
    assert len(got) == 56 and len(set(got.tolist())) == 56
    again = Loader(Feed.of(pipe, 3), rank=0, world_size=1, checkpoint=resumed.checkpoint())
    assert list(again.epochs()) == [1, 2]
    for x in (loader, resumed, again):
        x.close()
    pipe.close()
