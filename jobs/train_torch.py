"""Ray job: data-parallel torch training (Ray Train) fed by raying, losses fed back.

What runs where::

    driver (this job)   manifest, Pipeline, TorchTrainer(**raying.train.datasets(pipe, E))
    Train workers (N)   on trainer nodes (GPU, or a custom resource standing in for one):
                        loader = raying.train.loader(): this worker's share of every epoch
                        -> read tasks (read + decode + augment, uint8) on the CPU nodes
                        -> float, normalized on the device -> DDP step
                        -> loader.report(ids, per-sample losses) (never blocks)
                        -> ray.train.report(..., checkpoint=loader.checkpoint(model=...))
    priority store      a named actor (0 CPU, restarts on failure), owned by the driver

Each epoch is planned when it starts; every worker reads the units r, r + N, ... of it, so
with the uniform sampler every id reaches exactly one worker once per epoch; DDP's join()
absorbs the uneven number of batches per worker. A worker that fails is restarted by Ray
Train (--max-failures) and resumes from its position in the last checkpoint.

Examples:
    ray job submit --working-dir . -- python jobs/train_torch.py --smoke-test
    ray job submit --working-dir . -- python jobs/train_torch.py --data s3://bucket/train \\
        --num-workers 8 --use-gpu --epochs 10 --sampler prioritized
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

NORMAL = {"epochs": 2, "batch_size": 64, "size": 128, "block_rows": 128, "num_workers": 2,
          "cpus_per_worker": 1.0, "lr": 0.05}
SMOKE = {"epochs": 2, "batch_size": 16, "size": 32, "block_rows": 16, "num_workers": 2,
         "cpus_per_worker": 0.25, "lr": 0.05}


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
    p.add_argument("--num-workers", type=_common.positive, help="Train workers (one per GPU)")
    p.add_argument("--use-gpu", action="store_true", help="one GPU per worker")
    p.add_argument("--cpus-per-worker", type=float,
                   help="CPUs each Train worker reserves (default 1; on one node too small to "
                        "leave the read tasks a CPU beside them, what fits)")
    p.add_argument("--trainer-resource", metavar="NAME",
                   help="a custom resource each worker needs one of (places workers on the "
                        "nodes that have it, e.g. 'trainer' where no GPU exists)")
    p.add_argument("--sampler", choices=["uniform", "prioritized"], default="uniform",
                   help="uniform: every id once per epoch (losses still recorded in the "
                        "store); prioritized: reads drawn from the store")
    p.add_argument("--no-spread", dest="spread", action="store_false",
                   help="let Ray pack read tasks instead of spreading them over nodes")
    p.add_argument("--name", help="names the pipeline's actors (priority store)")
    p.add_argument("--snapshot-uri", help="where the priority store writes its snapshots")
    p.add_argument("--storage-path", help="Ray Train run storage (shared on multi-node); "
                   "by default a temporary folder, removed when the run ends")
    p.add_argument("--max-failures", type=int, default=0,
                   help="worker failures Ray Train recovers from (resuming from a checkpoint)")
    return p


def resolve(args: argparse.Namespace) -> argparse.Namespace:
    """Fill the options left unset from the smoke-test or normal defaults."""
    if not hasattr(args, "cpus_auto"):  # the workers' CPUs may shrink to fit (room_for_reads)
        args.cpus_auto = args.cpus_per_worker is None
    for key, value in (SMOKE if args.smoke_test else NORMAL).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


def _model(classes: int):
    import torch

    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 16, 3, stride=2, padding=1), torch.nn.ReLU(),
        torch.nn.Conv2d(16, 32, 3, stride=2, padding=1), torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(32, classes))


def train_loop(config: dict[str, Any]) -> None:
    """One Train worker: its share of every epoch, a DDP step per batch, losses reported."""
    import numpy as np
    import ray
    import ray.train
    import ray.train.torch
    import torch
    import torch.nn.functional as F

    import raying
    import raying.train

    loader = raying.train.loader()
    rank = ray.train.get_context().get_world_rank()
    node = ray.get_runtime_context().get_node_id()
    # This worker process's run of the loop: a worker group that Ray Train restarts runs in
    # new processes, whose records then replace this one's in the coverage.
    attempt = f"{node}:{os.getpid()}:{time.time_ns()}"
    torch.manual_seed(config["seed"])
    model = _model(config["classes"])
    if loader.restored is not None:
        model.load_state_dict(loader.restored["model"])
    model = ray.train.torch.prepare_model(model)
    device = ray.train.torch.get_device()
    opt = torch.optim.SGD(model.parameters(), lr=config["lr"], momentum=0.9)
    store, ledger = config["store"], config["ledger"]
    for epoch in loader.epochs():
        rows, loss_sum, seen = 0, 0.0, []
        # Shares differ by up to a unit: join() lets a finished worker shadow the others'
        # gradient all-reduces instead of hanging them.
        with model.join() if hasattr(model, "join") else contextlib.nullcontext():
            for batch in loader.iter_torch_batches(batch_size=config["batch_size"],
                                                   device=device):
                # float32 NCHW, normalized on the device (uint8 until there)
                per_sample = F.cross_entropy(model(batch["image"]), batch["label"],
                                             reduction="none")
                loss = (per_sample * batch["weight"]).mean()
                per_sample = per_sample.detach()
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                if store is None:
                    loader.report(batch["id"], per_sample)  # the pipeline's own store
                else:  # uniform reads; the losses are kept for a later prioritized run
                    raying.report(batch["id"], per_sample, store=store)
                rows += int(batch["id"].shape[0])
                loss_sum += float(per_sample.sum())
                if config["keep_ids"]:
                    seen.append(batch["id"].cpu().numpy())
        raying.sampling.feedback.flush_all()
        ids = np.concatenate(seen) if seen else np.zeros(0, np.int64)
        reads = loader.stats()
        ledger.add.remote({"rank": rank, "epoch": epoch, "node": node, "attempt": attempt,
                           "rows": rows,
                           "loss_sum": loss_sum, "ids": ids if config["keep_ids"] else None,
                           "rows_by_node": reads["rows_by_node"],
                           "skipped": reads["skipped"], "read_retries": reads["read_retries"]})
        state = {"model": getattr(model, "module", model).state_dict()}
        ray.train.report({"epoch": epoch, "rows": rows, "loss": loss_sum / max(rows, 1)},
                         checkpoint=loader.checkpoint(**state))
    # Training is over: now waiting is fine. Every report of this worker is in the store.
    if store is not None:
        from raying.sampling import store as st

        st.flush(st.get_store(store))
    loader.close()


def fit(args: argparse.Namespace) -> dict[str, Any]:
    """Build the pipeline and the trainer and train; returns the summary and the run's parts.

    Returns:
        ``summary`` (printed by the job), ``records`` (per worker and epoch: rank, node,
        rows, loss sum, ids), ``store`` (the priority store's handle) and ``pipe``.
    """
    import ray
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    import raying
    import raying.train
    from raying.engine.ray_setup import ensure_ray
    from raying.sampling import store as st

    args = resolve(args)
    ensure_ray(dashboard=True)  # Ray Train reads its controller's state through the State API
    _common.room_for_reads(args)
    # Ray Train keeps run state and checkpoints there; shared storage on multi-node.
    per_worker = {"CPU": args.cpus_per_worker, "GPU": 1.0 if args.use_gpu else 0.0}
    if args.trainer_resource:
        per_worker[args.trainer_resource] = 1.0
    storage_path = _common.train_storage(
        args.storage_path, {k: v * args.num_workers for k, v in per_worker.items() if v})
    t0 = time.perf_counter()
    m = _common.manifest(args)
    store_cfg = {"snapshot_uri": args.snapshot_uri} if args.snapshot_uri else None
    if args.sampler == "prioritized":
        sampler: Any = raying.PrioritizedSampler(alpha=1.0, beta=0.5, uniform_mix=0.1,
                                                 seed=args.seed, store=store_cfg)
    else:
        sampler = raying.UniformSampler(seed=args.seed)
    pipe = raying.Pipeline(m, transform=raying.ImageTransform(size=args.size), sampler=sampler,
                           config=raying.PipelineConfig(block_rows=args.block_rows,
                                                        spread=args.spread, name=args.name))
    if pipe.store_name is not None:
        handle, own_store = st.get_store(pipe.store_name), None
    else:  # uniform reads, but the losses are kept: a later prioritized run uses them
        handle = st.create_store(f"{pipe.name}-priorities", len(m), config=store_cfg)
        own_store = handle.name
    ledger = _common.ledger_actor()
    resources: dict[str, float] = {"CPU": args.cpus_per_worker}
    if args.trainer_resource:
        resources[args.trainer_resource] = 1
    if args.use_gpu:
        resources["GPU"] = 1
    trainer = TorchTrainer(
        train_loop,
        train_loop_config={"epochs": args.epochs, "batch_size": args.batch_size,
                           "lr": args.lr, "seed": args.seed,
                           "classes": max(len(m.classes or []), 2), "store": own_store,
                           "ledger": ledger, "keep_ids": len(m) <= _common.MAX_LEDGER_IDS},
        scaling_config=ScalingConfig(num_workers=args.num_workers, use_gpu=args.use_gpu,
                                     resources_per_worker=resources),
        run_config=RunConfig(name=f"{pipe.name}-torch", storage_path=storage_path,
                             failure_config=FailureConfig(max_failures=args.max_failures)),
        **raying.train.datasets(pipe, epochs=args.epochs),
    )
    t_fit = time.perf_counter()
    try:
        trainer.fit()
    finally:
        if not args.storage_path:  # a run under a random name nobody can resume: not kept
            shutil.rmtree(os.path.join(storage_path, f"{pipe.name}-torch"), ignore_errors=True)
            with contextlib.suppress(OSError):  # the shared folder, once no other run is in it
                os.rmdir(storage_path)
    fit_s = time.perf_counter() - t_fit
    records = ray.get(ledger.all.remote())
    coverage = _common.epoch_coverage(records, len(m))
    reads = _common.worker_reads(records)
    summary = {
        "job": "train_torch", "samples": len(m), "sampler": args.sampler,
        "workers": args.num_workers,
        "worker_nodes": {int(r["rank"]): r["node"] for r in records},
        "epochs": coverage,
        "final_loss": coverage[max(coverage)]["loss"] if coverage else None,
        "store": _common.store_summary(handle),
        "decode_rows_by_node": reads.get("rows_by_node", {}),
        "skipped": reads.get("skipped_count", 0),
        "skipped_by_reason": reads.get("skipped_by_reason", {}),
        "read_retries": reads.get("read_retries", 0),
        "credentials": _common.credentials_source(),
        "fit_s": round(fit_s, 2), "wall_s": round(time.perf_counter() - t0, 2),
    }
    return {"summary": summary, "records": records, "store": handle, "pipe": pipe}


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Train and return the run's summary."""
    out = fit(args)
    out["pipe"].close()
    return out["summary"]


def main(argv: Sequence[str] | None = None) -> int:
    args = _common.parse_args(build_parser(), argv)
    summary = run(args)
    _common.emit_summary("raying train_torch: run summary", summary, as_json=args.json)
    bad = [e for e, c in summary["epochs"].items() if c.get("exactly_once") is False]
    if args.sampler == "uniform" and bad:
        print(f"error: epochs {bad} did not deliver every id exactly once", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(_common.run(main, build_parser()))
