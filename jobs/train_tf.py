"""Ray job: Keras ``model.fit`` on ``pipe.to_tf``, per-sample losses fed back to the store.

What runs where::

    driver (this job)   Keras model.fit on a tf.data.Dataset from pipe.to_tf(...)
    Ray tasks           read + decode + augment, spread over the CPU nodes, uint8 blocks
    FeedbackModel       Keras' own train_step + the unreduced loss of the same forward pass
                        -> LossReporter -> pipe.report (fire-and-forget) -> priority store
    PrioritizedSampler  later reads drawn from the store the losses keep up to date

The driver trains, so give it the accelerator: ``ray job submit --entrypoint-num-gpus 1``.

Examples:
    ray job submit --working-dir . -- python jobs/train_tf.py --smoke-test
    ray job submit --entrypoint-num-gpus 1 --working-dir . -- python jobs/train_tf.py \\
        --data s3://bucket/train --epochs 10 --batch-size 256
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402

NORMAL = {"epochs": 3, "batch_size": 128, "size": 128, "block_rows": 128, "lr": 1e-3}
SMOKE = {"epochs": 2, "batch_size": 16, "size": 32, "block_rows": 32, "lr": 1e-3}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                epilog=__doc__[__doc__.index("Examples:"):],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    _common.add_common_args(p)
    p.add_argument("--epochs", type=_common.positive)
    p.add_argument("--batch-size", type=_common.positive)
    p.add_argument("--size", type=_common.positive, help="training crop size (pixels)")
    p.add_argument("--block-rows", type=_common.positive, help="images per read task")
    p.add_argument("--lr", type=float)
    p.add_argument("--sampler", choices=["prioritized", "uniform"], default="prioritized")
    p.add_argument("--beta", type=float, default=0.5, help="importance-weight exponent")
    p.add_argument("--samples-per-epoch", type=_common.positive, help="draws per epoch (prioritized)")
    p.add_argument("--name", help="names the pipeline's actors (priority store)")
    p.add_argument("--snapshot-uri", help="where the priority store writes its snapshots")
    return p


def _model(keras: Any, classes: int, size: int):
    return keras.Sequential([
        keras.Input((size, size, 3)),
        keras.layers.Conv2D(16, 3, strides=2, padding="same", activation="relu"),
        keras.layers.Conv2D(32, 3, strides=2, padding="same", activation="relu"),
        keras.layers.GlobalAveragePooling2D(),
        keras.layers.Dense(classes)])


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Train with Keras and return the run's summary."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import keras

    import raying
    import raying.loader.keras as rk
    from raying.engine.ray_setup import ensure_ray
    from raying.sampling import store as st

    for key, value in (SMOKE if args.smoke_test else NORMAL).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    ensure_ray()
    t0 = time.perf_counter()
    m = _common.manifest(args)
    store_cfg = {"snapshot_uri": args.snapshot_uri} if args.snapshot_uri else None
    if args.sampler == "prioritized":
        sampler: Any = raying.PrioritizedSampler(beta=args.beta, seed=args.seed,
                                                 samples_per_epoch=args.samples_per_epoch,
                                                 store=store_cfg)
    else:
        sampler = raying.UniformSampler(seed=args.seed)
    pipe = raying.Pipeline(m, transform=raying.ImageTransform(size=args.size), sampler=sampler,
                           config=raying.PipelineConfig(block_rows=args.block_rows,
                                                        spread=True, name=args.name))
    if pipe.store_name is not None:
        handle, target = st.get_store(pipe.store_name), pipe
    else:  # uniform reads; the losses still go to a store, for a later prioritized run
        handle = st.create_store(f"{pipe.name}-priorities", len(m), config=store_cfg)
        target = handle.name
    keras.utils.set_random_seed(args.seed)
    model = rk.FeedbackModel(_model(keras, max(len(m.classes or []), 2), args.size), target)
    model.compile(optimizer=keras.optimizers.Adam(args.lr),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    t_fit = time.perf_counter()
    history = model.fit(pipe.to_tf(batch_size=args.batch_size, normalize=True),
                        epochs=args.epochs, verbose=2)
    fit_s = time.perf_counter() - t_fit
    st.flush(handle)
    stats = pipe.stats()
    summary = {
        "job": "train_tf", "samples": len(m), "sampler": args.sampler,
        "epochs": {e: {"loss": round(float(loss), 5),
                       "accuracy": round(float(history.history["accuracy"][e]), 4)}
                   for e, loss in enumerate(history.history["loss"])},
        "rows_delivered": stats["rows_delivered"],
        "rows_per_epoch": stats["rows_delivered"] // max(args.epochs, 1),
        "losses_reported": model.reporter.reported,
        "skipped": stats["skipped_count"],
        "store": _common.store_summary(handle),
        "credentials": _common.credentials_source(),
        "fit_s": round(fit_s, 2), "wall_s": round(time.perf_counter() - t0, 2),
    }
    pipe.close()
    return summary


def main(argv: Sequence[str] | None = None) -> int:
    args = _common.parse_args(build_parser(), argv)
    summary = run(args)
    _common.emit_summary("raying train_tf: run summary", summary, as_json=args.json)
    return 0


if __name__ == "__main__":
    sys.exit(_common.run(main))
