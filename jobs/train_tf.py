"""Ray job: data-parallel TensorFlow training (TensorflowTrainer) fed by raying, losses fed back.

What runs where::

    driver (this job)   manifest, Pipeline, TensorflowTrainer(**raying.train.datasets(pipe, E))
    Train workers (N)   MultiWorkerMirroredStrategy; loader = raying.train.loader()
                        -> loader.to_tf(...): this worker's share of every epoch, float NHWC
                        -> one step per batch (gradients all-reduced over the workers)
                        -> loader.report(ids, per-sample losses) (never blocks)
    priority store      a named actor owned by the driver; later reads are drawn from it

Every worker runs ``loader.steps_per_epoch(batch)`` steps, the same number (the collectives
need it). The step is written out rather than ``model.fit``: Keras 3's ``fit`` cannot reduce
its logs across workers under the multi-worker strategy.

Examples:
    ray job submit --working-dir . -- python jobs/train_tf.py --smoke-test
    ray job submit --working-dir . -- python jobs/train_tf.py --data s3://bucket/train \\
        --num-workers 4 --epochs 10 --batch-size 256
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import ray.cloudpickle

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402

# Train workers unpickle train_loop and its helpers; they cannot import jobs/ modules by name.
ray.cloudpickle.register_pickle_by_value(_common)
if __name__ != "__main__":  # imported by path (tests): ship this module by value too
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

NORMAL = {"epochs": 3, "batch_size": 128, "size": 128, "block_rows": 128, "lr": 0.05,
          "num_workers": 2, "cpus_per_worker": 1.0}
SMOKE = {"epochs": 2, "batch_size": 16, "size": 32, "block_rows": 16, "lr": 0.05,
         "num_workers": 2, "cpus_per_worker": 0.25}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                epilog=__doc__[__doc__.index("Examples:"):],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    _common.add_common_args(p)
    p.add_argument("--epochs", type=_common.positive)
    p.add_argument("--batch-size", type=_common.positive, help="per worker")
    p.add_argument("--size", type=_common.positive, help="training crop size (pixels)")
    p.add_argument("--block-rows", type=_common.positive, help="images per read task")
    p.add_argument("--lr", type=float)
    p.add_argument("--num-workers", type=_common.positive, help="Train workers")
    p.add_argument("--cpus-per-worker", type=float,
                   help="CPUs each Train worker reserves (default 1; on one node too small to "
                        "leave the read tasks a CPU beside them, what fits)")
    p.add_argument("--sampler", choices=["prioritized", "uniform"], default="prioritized")
    p.add_argument("--beta", type=float, default=0.5, help="importance-weight exponent")
    p.add_argument("--name", help="names the pipeline's actors (priority store)")
    p.add_argument("--snapshot-uri", help="where the priority store writes its snapshots")
    p.add_argument("--storage-path", help="Ray Train run storage (shared on multi-node)")
    return p


def train_loop(config: dict[str, Any]) -> None:
    """One Train worker: its share of every epoch, one all-reduced step per batch."""
    import itertools

    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import keras
    import tensorflow as tf

    import raying.train

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    loader = raying.train.loader()
    batch, ledger = config["batch_size"], config["ledger"]
    keras.utils.set_random_seed(config["seed"])
    with strategy.scope():
        model = keras.Sequential([
            keras.Input((config["size"], config["size"], 3)),
            keras.layers.Conv2D(16, 3, strides=2, padding="same", activation="relu"),
            keras.layers.Conv2D(32, 3, strides=2, padding="same", activation="relu"),
            keras.layers.GlobalAveragePooling2D(), keras.layers.Dense(config["classes"])])
        opt = keras.optimizers.SGD(config["lr"], momentum=0.9)

    @tf.function
    def step(image, label, weight):
        with tf.GradientTape() as tape:
            per = keras.losses.sparse_categorical_crossentropy(label, model(image, training=True),
                                                               from_logits=True)
            loss = tf.reduce_sum(per * weight) / (batch * loader.world_size)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables, strict=True))
        return per

    for epoch in loader.epochs():
        steps = loader.steps_per_epoch(batch)
        rows, loss_sum = 0, 0.0
        for b in itertools.islice(loader.to_tf(batch_size=batch), steps):
            per = strategy.run(step, args=(b["image"], b["label"], b["weight"]))
            per = strategy.experimental_local_results(per)[0].numpy()
            loader.report(b["id"].numpy(), per)
            rows += len(per)
            loss_sum += float(per.sum())
        ledger.add.remote({"rank": loader.rank, "epoch": epoch, "steps": steps, "rows": rows,
                           "loss_sum": loss_sum})
    loader.flush()
    loader.close()


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Train with TensorflowTrainer and return the run's summary."""
    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.tensorflow import TensorflowTrainer

    import raying
    import raying.train
    from raying.engine.ray_setup import ensure_ray
    from raying.sampling import store as st

    if not hasattr(args, "cpus_auto"):  # the workers' CPUs may shrink to fit (room_for_reads)
        args.cpus_auto = args.cpus_per_worker is None
    for key, value in (SMOKE if args.smoke_test else NORMAL).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    ensure_ray()
    _common.room_for_reads(args)
    # Ray Train keeps run state and checkpoints there; shared storage on multi-node.
    storage_path = _common.train_storage(
        args.storage_path, {"CPU": args.cpus_per_worker * args.num_workers})
    t0 = time.perf_counter()
    m = _common.manifest(args)
    store_cfg = {"snapshot_uri": args.snapshot_uri} if args.snapshot_uri else None
    if args.sampler == "prioritized":
        sampler: Any = raying.PrioritizedSampler(beta=args.beta, seed=args.seed, store=store_cfg)
    else:
        sampler = raying.UniformSampler(seed=args.seed)
    pipe = raying.Pipeline(m, transform=raying.ImageTransform(size=args.size), sampler=sampler,
                           config=raying.PipelineConfig(block_rows=args.block_rows,
                                                        spread=True, name=args.name))
    ledger = _common.ledger_actor()
    trainer = TensorflowTrainer(
        train_loop,
        train_loop_config={"epochs": args.epochs, "batch_size": args.batch_size,
                           "size": args.size, "lr": args.lr, "seed": args.seed,
                           "classes": max(len(m.classes or []), 2), "ledger": ledger},
        scaling_config=ScalingConfig(num_workers=args.num_workers,
                                     resources_per_worker={"CPU": args.cpus_per_worker}),
        run_config=RunConfig(name=f"{pipe.name}-tf", storage_path=storage_path),
        **raying.train.datasets(pipe, epochs=args.epochs),
    )
    t_fit = time.perf_counter()
    try:
        trainer.fit()
    finally:
        if not args.storage_path:  # a run under a random name nobody can resume: not kept
            shutil.rmtree(os.path.join(storage_path, f"{pipe.name}-tf"), ignore_errors=True)
            with contextlib.suppress(OSError):  # the shared folder, once no other run is in it
                os.rmdir(storage_path)
    fit_s = time.perf_counter() - t_fit
    records = ray.get(ledger.all.remote())
    epochs: dict[int, dict[str, Any]] = {}
    for r in records:
        e = epochs.setdefault(int(r["epoch"]), {"rows": 0, "loss_sum": 0.0, "steps": {}})
        e["rows"] += r["rows"]
        e["loss_sum"] += r["loss_sum"]
        e["steps"][int(r["rank"])] = r["steps"]
    summary = {
        "job": "train_tf", "samples": len(m), "sampler": args.sampler,
        "workers": args.num_workers,
        "epochs": {k: {"rows": v["rows"], "steps_by_rank": v["steps"],
                       "loss": round(v["loss_sum"] / max(v["rows"], 1), 5)}
                   for k, v in sorted(epochs.items())},
        "credentials": _common.credentials_source(),
        "fit_s": round(fit_s, 2), "wall_s": round(time.perf_counter() - t0, 2),
    }
    if pipe.sampler.handle is not None:
        st.flush(pipe.sampler.handle)
        summary["store"] = _common.store_summary(pipe.sampler.handle)
    pipe.close()
    return summary


def main(argv: Sequence[str] | None = None) -> int:
    args = _common.parse_args(build_parser(), argv)
    summary = run(args)
    _common.emit_summary("raying train_tf: run summary", summary, as_json=args.json)
    return 0


if __name__ == "__main__":
    sys.exit(_common.run(main, build_parser()))
