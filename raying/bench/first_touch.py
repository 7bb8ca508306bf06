"""How many of each epoch's draws touch a sample for the first time (decoded-cache misses).

W5's prioritized epochs are slower than W1's uniform ones because a uniform epoch is a
permutation (epoch 0 decodes every sample once, later epochs are all decoded-cache hits)
while prioritized draws repeat some samples and reach others only in later epochs, where
they are decoded inside the bench's steady window. This counts those first touches, per
epoch, for both samplers on the same data, reporting a random loss per sample after every
batch as the bench's W5 consumer does.

Run: ``python -m raying.bench.first_touch DATA_DIR [--epochs 3] [--batch-size 256]``
"""

from __future__ import annotations

import argparse

import numpy as np


def first_touches(pipe, n: int, epochs: int, batch_size: int, report: bool,
                  seed: int = 0) -> list[dict[str, float]]:
    """Per epoch: draws, distinct ids, and draws of ids no earlier epoch delivered."""
    rng = np.random.default_rng(seed)
    seen = np.zeros(n, dtype=bool)
    out = []
    for epoch in range(epochs):
        parts = []
        for batch in pipe.iter_torch_batches(batch_size=batch_size, epoch=epoch,
                                             normalize=False):
            ids = batch["id"].numpy()
            parts.append(ids)
            if report:
                pipe.report(batch["id"], rng.random(len(ids)))
        ids = np.concatenate(parts)
        distinct = np.unique(ids)
        new = int((~seen[distinct]).sum())  # each new id is decoded once, then cached
        out.append({"epoch": epoch, "draws": len(ids), "distinct": len(distinct),
                    "first_touches": new, "share": new / max(len(ids), 1)})
        seen[distinct] = True
    return out


def main(argv: list[str] | None = None) -> None:
    import raying
    from raying.engine.ray_setup import ensure_ray

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("data", help="an image folder, e.g. the bench's W1 data")
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--batch-size", type=int, default=256)
    args = ap.parse_args(argv)
    ensure_ray()  # raying's local Ray (all CPUs, bounded object store), or RAY_ADDRESS's
    manifest = raying.Manifest.scan(args.data)
    for name, sampler in (("uniform", None), ("prioritized", raying.PrioritizedSampler())):
        pipe = raying.Pipeline(manifest, sampler=sampler,
                               transform=raying.ImageTransform(size=224, random_crop=True,
                                                               flip=True),
                               config=raying.PipelineConfig(decoded_cache="off"))
        rows = first_touches(pipe, len(manifest), args.epochs, args.batch_size,
                             report=sampler is not None)
        pipe.close()
        for r in rows:
            print(f"{name:<12} epoch {r['epoch']}: {r['draws']} draws, {r['distinct']} distinct, "
                  f"{r['first_touches']} first touches ({r['share']:.1%})")
        steady = rows[1:]
        if steady:
            share = sum(r["first_touches"] for r in steady) / sum(r["draws"] for r in steady)
            print(f"{name:<12} steady epochs: {share:.1%} of draws are first touches")


if __name__ == "__main__":
    main()
