"""Which loss-driven policy when: InfoBatch pruning, prioritized sampling under label noise
(guarded and not), and class-balanced static weights, measured through the real pipeline.

Every arm trains a small MLP on generated data written as tiny PNG images (a 48-number vector
per sample, stored exactly as 4x4 RGB pixels) and read through ``raying.Pipeline``: Ray read
tasks, the priority store, and asynchronous feedback (``pipe.report(ids, losses)``). The test
sets are drawn from the same generators and held in memory with their clean labels.

    python -m raying.bench.sampler_study                       # 3 seeds, docs/bench/samplers
    python -m raying.bench.sampler_study --seeds 1 --parts balanced --out /tmp/s

Three parts, each judged against the bounds it is meant to show (``summary.json`` says for
every seed whether each held, and ``samplers.png`` charts them):

* ``pruning``: an easy majority (95 % of samples from well-separated clusters) and a few
  harder ones; uniform vs ``InfoBatchSampler(prune_ratio=0.5)`` over the same epochs.
  Bounds: >= 30 % fewer samples read, final test accuracy within 0.5 points of uniform's.
* ``noise``: a rare hard mode (3 % of samples, each class's rare mode lying next to another
  class's cluster); uniform vs ``PrioritizedSampler(alpha=1, uniform_mix=0.2)`` with and
  without the noisy-label guard, on clean labels and with 20 % of training labels flipped.
  Bounds: the guarded ratio (steps to the clean-test target over uniform's) under noise
  within 0.1 of its clean ratio; every seed no slower than uniform; final clean accuracy no
  lower than uniform's (the mean of the evaluations of the last 100 steps: one checkpoint of
  a constant-rate run moves by +-0.3 points); the guard costing at most 0.05 in the ratio on
  clean labels.
* ``balanced``: a 1:20 imbalanced folder read with ``WeightedSampler(class_balanced=True)``;
  bound: every class's share of the draws within 2 points of equal (and a chi-square test).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

DEFAULT_OUT = "docs/bench/samplers"
# The pixel encoding of a feature vector: uint8 = clip(round(128 + PIXEL_SCALE * x)).
PIXEL_SCALE = 20.0
SIDE = 4  # 4 x 4 RGB = 48 features
DIM = SIDE * SIDE * 3


@dataclasses.dataclass(frozen=True)
class TaskSpec:
    """A generated classification task.

    Args:
        n: training samples.
        classes: number of classes.
        rare: share of samples from the rare modes (one per class, next to the next class).
        rare_offset: distance of a rare mode from the neighbouring class's centre.
        spread: standard deviation of every cluster.
        centre_scale: scale of the class centres (larger is easier).
        hard: share of samples drawn with ``hard_spread`` (near the class boundaries).
        hard_spread: standard deviation of the hard samples.
        noise: share of training labels flipped to another class, uniformly at random.
        test: test samples (clean labels).
        seed: the data's seed (the task, not the run).
    """

    n: int = 6000
    classes: int = 4
    rare: float = 0.03
    rare_offset: float = 3.0
    spread: float = 0.55
    centre_scale: float = 1.2
    hard: float = 0.0
    hard_spread: float = 1.2
    noise: float = 0.0
    test: int = 6000
    seed: int = 0

    def key(self) -> str:
        import hashlib

        blob = json.dumps(dataclasses.asdict(self), sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:10]


def generate(spec: TaskSpec, n: int, stream: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``n`` samples as uint8 pixels ``(n, 4, 4, 3)``, clean labels, and the rare-mode mask."""
    task = np.random.default_rng([spec.seed, 0xC0DE])
    centres = task.normal(0.0, 1.0, (spec.classes, DIM)) * spec.centre_scale
    offsets = task.normal(0.0, 1.0, (spec.classes, DIM))
    offsets /= np.linalg.norm(offsets, axis=1, keepdims=True)
    rng = np.random.default_rng([spec.seed, stream])
    y = rng.integers(0, spec.classes, n)
    rare = rng.random(n) < spec.rare
    neighbour = (y + 1) % spec.classes
    centre = np.where(rare[:, None], centres[neighbour] + spec.rare_offset * offsets[y],
                      centres[y])
    hard = (rng.random(n) < spec.hard) & ~rare
    spread = np.where(hard, spec.hard_spread, spec.spread)[:, None]
    x = centre + rng.normal(0.0, 1.0, (n, DIM)) * spread
    pixels = np.clip(np.round(128.0 + PIXEL_SCALE * x), 0, 255).astype(np.uint8)
    return pixels.reshape(n, SIDE, SIDE, 3), y.astype(np.int64), rare


def flip_labels(y: np.ndarray, share: float, classes: int, seed: int) -> np.ndarray:
    """A copy of ``y`` with ``share`` of the labels moved to another class at random."""
    rng = np.random.default_rng([seed, 0xF11B])
    flipped = rng.random(y.size) < share
    out = y.copy()
    out[flipped] = (y[flipped] + rng.integers(1, classes, int(flipped.sum()))) % classes
    return out


def write_folder(root: Path, pixels: np.ndarray, labels: np.ndarray, classes: int) -> Path:
    """``root/class_XX/NNNNNN.png`` (NNNNNN: the sample's index); reused when complete."""
    from raying.tools.datagen import encode

    done = root / "done.json"
    if done.exists():
        return root
    for c in range(classes):
        (root / f"class_{c:02d}").mkdir(parents=True, exist_ok=True)
    for i, (img, label) in enumerate(zip(pixels, labels, strict=True)):
        (root / f"class_{int(label):02d}" / f"{i:06d}.png").write_bytes(encode(img, "png"))
    done.write_text(json.dumps({"n": int(len(labels))}))
    return root


def index_of(manifest: Any) -> np.ndarray:
    """The generator's sample index of every manifest id (from the file names)."""
    return np.array([int(Path(p).stem) for p in manifest.column("path")], dtype=np.int64)


@dataclasses.dataclass
class Run:
    """What one training run measured."""

    arm: str
    seed: int
    steps: int = 0
    samples_read: int = 0
    steps_to_target: int | None = None
    final_acc: float = 0.0
    # Mean test accuracy of the evaluations in the last ``NOISE_SETTLE_STEPS`` steps (None when
    # the run had no curve): where a constant-rate run settled, not one checkpoint.
    settled_acc: float | None = None
    curve: list[tuple[int, float]] = dataclasses.field(default_factory=list)
    per_epoch: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    wall_s: float = 0.0


def _model(classes: int, hidden: int):
    from torch import nn

    return nn.Sequential(nn.Linear(DIM, hidden), nn.ReLU(), nn.Linear(hidden, classes))


def _features(images: Any):
    return (images.reshape(images.shape[0], -1).float() - 128.0) / PIXEL_SCALE


def _accuracy(model: Any, x: Any, y: Any) -> float:
    import torch

    with torch.no_grad():
        return float((model(x).argmax(1) == y).float().mean())


def settled_accuracy(curve: list[tuple[int, float]], max_steps: int,
                     window: int | None = None) -> float | None:
    """Mean accuracy of the evaluations after step ``max_steps - window`` (None if none);
    ``window`` defaults to ``NOISE_SETTLE_STEPS``."""
    window = NOISE_SETTLE_STEPS if window is None else window
    last = [acc for step, acc in curve if step > max_steps - window]
    return float(np.mean(last)) if last else None


def train(manifest: Any, sampler: Any, test: tuple[Any, Any], *, arm: str, seed: int,
          classes: int, epochs: int | None = None, max_steps: int | None = None,
          target: float | None = None, eval_every: int = 5, lr: float = 2e-3,
          batch_size: int = 64, hidden: int = 64, name: str) -> Run:
    """Train the MLP through a Pipeline with ``sampler``; report every step's losses.

    With ``epochs`` the learning rate follows a cosine over epoch progress (the same schedule
    whatever an epoch's length); with ``max_steps`` it is constant for ``max_steps`` steps,
    and the first evaluation reaching ``target`` is the run's steps to target.
    """
    import torch
    import torch.nn.functional as F

    import raying

    torch.manual_seed(seed)
    torch.set_num_threads(1)
    model = _model(classes, hidden)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    x_test, y_test = test
    pipe = raying.Pipeline(manifest, sampler=sampler,
                           transform=raying.ImageTransform(size=SIDE, random_crop=False,
                                                           flip=False),
                           config=raying.PipelineConfig(block_rows=512, name=name))
    run = Run(arm=arm, seed=seed)
    t0 = time.perf_counter()
    try:
        epoch = 0
        while True:
            if epochs is not None and epoch >= epochs:
                break
            batches = pipe.iter_torch_batches(batch_size=batch_size, epoch=epoch, device="cpu",
                                              normalize=False, drop_last=False)
            planned = len(manifest) if sampler.samples_per_epoch is None else \
                sampler.samples_per_epoch
            seen = 0
            for batch in batches:
                if epochs is not None:  # cosine over (fractional) epochs
                    progress = (epoch + min(seen / max(planned, 1), 1.0)) / epochs
                    for group in opt.param_groups:
                        group["lr"] = lr * 0.5 * (1.0 + math.cos(math.pi * progress))
                logits = model(_features(batch["image"]))
                loss = F.cross_entropy(logits, batch["label"], reduction="none")
                objective = (batch["weight"] * loss).mean()
                opt.zero_grad(set_to_none=True)
                objective.backward()
                opt.step()
                pipe.report(batch["id"], loss.detach())
                n = int(batch["id"].shape[0])
                seen += n
                run.steps += 1
                run.samples_read += n
                if target is not None and run.steps % eval_every == 0:
                    acc = _accuracy(model, x_test, y_test)
                    run.curve.append((run.steps, acc))
                    if acc >= target and run.steps_to_target is None:
                        run.steps_to_target = run.steps
                if max_steps is not None and run.steps >= max_steps:
                    break
            if max_steps is not None and run.steps >= max_steps:
                break
            epoch += 1
        run.final_acc = _accuracy(model, x_test, y_test)
        if max_steps is not None:
            run.settled_acc = settled_accuracy(run.curve, max_steps)
        run.per_epoch = pipe.stats()["sampling"]["per_epoch"]
    finally:
        pipe.close()
    run.wall_s = round(time.perf_counter() - t0, 2)
    return run


# --- the parts --------------------------------------------------------------------------------

PRUNING_TASK = TaskSpec(n=4000, classes=4, rare=0.0, hard=0.08, hard_spread=2.5,
                        centre_scale=1.2, test=8000)
PRUNING_EPOCHS = 16
NOISE_TASK = TaskSpec(n=6000, classes=4, rare=0.03, rare_offset=3.0, test=6000)
NOISE_TARGET = 0.985
NOISE_MAX_STEPS = 600
# Final clean accuracy under noise is judged on the mean of the evaluations (every 5 steps) of
# the last 100 steps. The learning rate is constant, so with 20 % of the labels flipped one
# checkpoint's accuracy moves by +-0.3 points from one evaluation to the next, more than the
# gaps between arms being judged; the 20 evaluations average that out.
NOISE_SETTLE_STEPS = 100
PRIORITIZED: dict[str, Any] = {"alpha": 1.0, "beta": 0.0, "uniform_mix": 0.2}
BALANCED_COUNTS = (50, 250, 500, 1000)  # 1:20
BALANCED_EPOCHS = 8


def _test_set(spec: TaskSpec):
    import torch

    pixels, y, rare = generate(spec, spec.test, stream=2)
    return _features(torch.from_numpy(pixels)), torch.from_numpy(y), rare


def part_pruning(data: Path, seeds: list[int], say: Any) -> dict[str, Any]:
    import raying

    spec = PRUNING_TASK
    pixels, y, _ = generate(spec, spec.n, stream=1)
    folder = write_folder(data / f"pruning-{spec.key()}", pixels, y, spec.classes)
    manifest = raying.Manifest.scan(str(folder))
    x_test, y_test, _ = _test_set(spec)
    rows = []
    for seed in seeds:
        out = {}
        for arm in ("uniform", "infobatch"):
            sampler = raying.UniformSampler(seed=seed) if arm == "uniform" else \
                raying.InfoBatchSampler(prune_ratio=0.5, anneal=0.875,
                                        epochs=PRUNING_EPOCHS, seed=seed)
            run = train(manifest, sampler, (x_test, y_test), arm=arm, seed=seed,
                        classes=spec.classes, epochs=PRUNING_EPOCHS,
                        name=f"study-prune-{arm}-{seed}")
            out[arm] = run
            say(f"pruning seed {seed} {arm:>9}: read {run.samples_read} samples, "
                f"test acc {run.final_acc:.4f} ({run.wall_s:.0f} s)")
        u, p = out["uniform"], out["infobatch"]
        saved = 1.0 - p.samples_read / u.samples_read
        gap = 100.0 * (p.final_acc - u.final_acc)
        rows.append({"seed": seed, "uniform_read": u.samples_read,
                     "infobatch_read": p.samples_read, "read_saved": saved,
                     "uniform_acc": u.final_acc, "infobatch_acc": p.final_acc,
                     "acc_gap_points": gap,
                     "held": {"read_saved>=0.30": saved >= 0.30,
                              "abs(acc_gap)<=0.5pt": abs(gap) <= 0.5},
                     "infobatch_per_epoch": p.per_epoch})
    return {"task": dataclasses.asdict(spec), "epochs": PRUNING_EPOCHS,
            "sampler": {"prune_ratio": 0.5, "anneal": 0.875}, "per_seed": rows}


def part_noise(data: Path, seeds: list[int], say: Any,
               guard_table: dict[str, Any] | None = None) -> dict[str, Any]:
    import raying

    spec = NOISE_TASK
    pixels, y, rare = generate(spec, spec.n, stream=1)
    x_test, y_test, _ = _test_set(spec)
    arms = {"uniform": None, "unguarded": False, "guarded": True}
    results: dict[str, dict[str, list[Run]]] = {}
    for labels in ("clean", "noisy"):
        yy = y if labels == "clean" else flip_labels(y, 0.2, spec.classes, spec.seed)
        folder = write_folder(data / f"noise-{labels}-{spec.key()}", pixels, yy, spec.classes)
        manifest = raying.Manifest.scan(str(folder))
        results[labels] = {arm: [] for arm in arms}
        for seed in seeds:
            for arm, guard in arms.items():
                sampler = raying.UniformSampler(seed=seed) if guard is None else \
                    raying.PrioritizedSampler(**PRIORITIZED, seed=seed, guard=guard,
                                              table=guard_table if guard else None)
                run = train(manifest, sampler, (x_test, y_test), arm=arm, seed=seed,
                            classes=spec.classes, max_steps=NOISE_MAX_STEPS,
                            target=NOISE_TARGET, name=f"study-noise-{labels}-{arm}-{seed}")
                results[labels][arm].append(run)
                say(f"noise {labels} seed {seed} {arm:>9}: steps to {NOISE_TARGET:.1%}: "
                    f"{run.steps_to_target}; final clean acc {run.final_acc:.4f}, settled "
                    f"{run.settled_acc:.4f} "
                    f"({run.wall_s:.0f} s)")

    def ratio(labels: str, arm: str, k: int) -> float | None:
        a = results[labels][arm][k].steps_to_target
        u = results[labels]["uniform"][k].steps_to_target
        return None if a is None or u is None else a / u

    rows: list[dict[str, Any]] = []
    for k, seed in enumerate(seeds):
        r = {f"{arm}_{labels}": ratio(labels, arm, k) for labels in results
             for arm in ("unguarded", "guarded")}
        steps = {f"{arm}_{labels}": results[labels][arm][k].steps_to_target
                 for labels in results for arm in arms}
        acc = {f"{arm}_{labels}": results[labels][arm][k].final_acc
               for labels in results for arm in arms}
        settled = {f"{arm}_{labels}": results[labels][arm][k].settled_acc
                   for labels in results for arm in arms}
        gn = r["guarded_noisy"]
        rows.append({"seed": seed, "ratio": r, "steps_to_target": steps,
                     "final_acc": acc, "settled_acc": settled,
                     "held": {
                         "guarded_noisy_no_slower_than_uniform": gn is not None and gn <= 1.0,
                         "guarded_noisy_settled_acc>=uniform_noisy":
                             settled["guarded_noisy"] >= settled["uniform_noisy"]}})

    def mean(key: str) -> float | None:
        vals = [row["ratio"][key] for row in rows]
        return None if any(v is None for v in vals) else float(np.mean(vals))

    means = {key: mean(key) for key in rows[0]["ratio"]}
    settled_means = {key: float(np.mean([row["settled_acc"][key] for row in rows]))
                     for key in rows[0]["settled_acc"]}
    gn, gc, uc = means["guarded_noisy"], means["guarded_clean"], means["unguarded_clean"]
    overall = {
        "mean_ratio": means,
        "mean_settled_acc": settled_means,
        "held": {
            "guarded_noisy_settled_acc>=uniform_noisy (mean)":
                settled_means["guarded_noisy"] >= settled_means["uniform_noisy"],
            "abs(guarded_noisy-guarded_clean)<=0.1 (mean ratio)":
                gn is not None and gc is not None and abs(gn - gc) <= 0.1,
            "guard_cost_on_clean<=0.05 (mean ratio)":
                gc is not None and uc is not None and gc - uc <= 0.05}}
    per_seed_gap = [None if row["ratio"]["guarded_noisy"] is None
                    or row["ratio"]["guarded_clean"] is None
                    else row["ratio"]["guarded_noisy"] - row["ratio"]["guarded_clean"]
                    for row in rows]
    per_seed_cost = [None if row["ratio"]["guarded_clean"] is None
                     or row["ratio"]["unguarded_clean"] is None
                     else row["ratio"]["guarded_clean"] - row["ratio"]["unguarded_clean"]
                     for row in rows]
    for row, gap, cost in zip(rows, per_seed_gap, per_seed_cost, strict=True):
        row["held"]["abs(guarded_noisy-guarded_clean)<=0.1"] = gap is not None and abs(gap) <= 0.1
        row["held"]["guard_cost_on_clean<=0.05"] = cost is not None and cost <= 0.05
    curves = {labels: {arm: [r.curve for r in runs] for arm, runs in by.items()}
              for labels, by in results.items()}
    return {"task": dataclasses.asdict(spec), "target": NOISE_TARGET,
            "max_steps": NOISE_MAX_STEPS, "settle_steps": NOISE_SETTLE_STEPS,
            "prioritized": PRIORITIZED,
            "rare_share": float(rare.mean()), "per_seed": rows, "overall": overall,
            "curves": curves}


def part_balanced(data: Path, seeds: list[int], say: Any) -> dict[str, Any]:
    import raying

    counts = BALANCED_COUNTS
    classes = len(counts)
    spec = TaskSpec(n=sum(counts), classes=classes, rare=0.0)
    pixels, _, _ = generate(spec, spec.n, stream=1)
    labels = np.repeat(np.arange(classes), counts)
    folder = write_folder(data / f"balanced-{spec.key()}", pixels, labels, classes)
    manifest = raying.Manifest.scan(str(folder))
    rows = []
    for seed in seeds:
        sampler = raying.WeightedSampler(class_balanced=True, seed=seed)
        pipe = raying.Pipeline(manifest, sampler=sampler,
                               transform=raying.ImageTransform(size=SIDE, random_crop=False,
                                                               flip=False),
                               config=raying.PipelineConfig(block_rows=512,
                                                            name=f"study-balanced-{seed}"))
        drawn = np.zeros(classes, dtype=np.int64)
        try:
            for epoch in range(BALANCED_EPOCHS):
                for b in pipe.iter_batches(batch_size=256, epoch=epoch):
                    drawn += np.bincount(b["label"], minlength=classes)
        finally:
            pipe.close()
        shares = drawn / drawn.sum()
        expected = np.full(classes, drawn.sum() / classes)
        stat = float(np.sum((drawn - expected) ** 2 / expected))
        p = chi2_sf(stat, classes - 1)
        dev = float(np.max(np.abs(shares - 1.0 / classes)))
        say(f"balanced seed {seed}: shares {np.round(shares, 4).tolist()}, chi-square p {p:.3f}")
        rows.append({"seed": seed, "drawn": drawn.tolist(), "shares": shares.tolist(),
                     "max_abs_deviation_points": 100 * dev,
                     "max_rel_deviation": float(np.max(np.abs(shares * classes - 1.0))),
                     "chi2": stat, "chi2_p": p,
                     "held": {"max_abs_deviation<=2pt": 100 * dev <= 2.0,
                              "chi2_p>=0.01": p >= 0.01}})
    return {"counts": list(counts), "epochs": BALANCED_EPOCHS, "per_seed": rows}


def chi2_sf(x: float, df: int) -> float:
    """Upper tail of the chi-square distribution (regularized incomplete gamma, series)."""
    a, z = df / 2.0, x / 2.0
    if z <= 0:
        return 1.0
    if z < a + 1:  # series for the lower tail
        term = total = 1.0 / a
        k = a
        while term > total * 1e-15:
            k += 1
            term *= z / k
            total += term
        return max(0.0, 1.0 - total * math.exp(-z + a * math.log(z) - math.lgamma(a)))
    # continued fraction for the upper tail (Lentz)
    b, c, d = z + 1.0 - a, 1.0 / 1e-300, 1.0 / (z + 1.0 - a)
    h = d
    for i in range(1, 500):
        an = -i * (i - a)
        b += 2.0
        d = an * d + b
        d = 1.0 / (d if abs(d) > 1e-300 else 1e-300)
        c = b + an / c
        c = c if abs(c) > 1e-300 else 1e-300
        h *= d * c
        if abs(d * c - 1.0) < 1e-15:
            break
    return math.exp(-z + a * math.log(z) - math.lgamma(a)) * h


# --- report -----------------------------------------------------------------------------------

def chart(summary: dict[str, Any], path: Path) -> None:
    """Three panels: pruning (reads, accuracy), noise (step ratios), balanced (class shares)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.4))
    parts = summary["parts"]
    if "pruning" in parts:
        ax = axes[0]
        rows = parts["pruning"]["per_seed"]
        xs = np.arange(len(rows))
        ax.bar(xs - 0.2, [r["uniform_read"] for r in rows], 0.4, label="uniform", color="#888")
        ax.bar(xs + 0.2, [r["infobatch_read"] for r in rows], 0.4, label="InfoBatch r=0.5",
               color="#2a7")
        for x, r in zip(xs, rows, strict=True):
            ax.text(x, r["uniform_read"] * 1.01,
                    f"-{r['read_saved']:.0%} reads\nacc {100 * r['uniform_acc']:.2f} / "
                    f"{100 * r['infobatch_acc']:.2f}", ha="center", va="bottom", fontsize=8)
        ax.set_xticks(xs, [f"seed {r['seed']}" for r in rows])
        ax.set_ylim(0, max(r["uniform_read"] for r in rows) * 1.25)
        ax.set_title(f"pruning: samples read in {parts['pruning']['epochs']} epochs")
        ax.legend(loc="lower right")
    if "noise" in parts:
        ax = axes[1]
        rows = parts["noise"]["per_seed"]
        keys = [("unguarded_clean", "unguarded, clean", "#9bd"),
                ("guarded_clean", "guarded, clean", "#27a"),
                ("unguarded_noisy", "unguarded, 20% flipped", "#e97"),
                ("guarded_noisy", "guarded, 20% flipped", "#c31")]
        xs = np.arange(len(rows))
        for j, (key, label, colour) in enumerate(keys):
            vals = [r["ratio"][key] if r["ratio"][key] is not None else np.nan for r in rows]
            ax.bar(xs + (j - 1.5) * 0.2, vals, 0.2, label=label, color=colour)
        ax.axhline(1.0, color="k", lw=0.8, ls="--")
        ax.set_xticks(xs, [f"seed {r['seed']}" for r in rows])
        ax.set_title(f"prioritized: steps to {parts['noise']['target']:.1%} / uniform's")
        ax.legend(fontsize=8, loc="upper left")
    if "balanced" in parts:
        ax = axes[2]
        rows = parts["balanced"]["per_seed"]
        counts = parts["balanced"]["counts"]
        xs = np.arange(len(counts))
        natural = np.asarray(counts) / sum(counts)
        ax.bar(xs - 0.3, natural, 0.2, label="in the folder", color="#888")
        for j, r in enumerate(rows):
            ax.bar(xs - 0.1 + 0.2 * j, r["shares"], 0.2, label=f"drawn, seed {r['seed']}")
        ax.axhline(1 / len(counts), color="k", lw=0.8, ls="--")
        ax.set_xticks(xs, [f"class {k}\n({c})" for k, c in enumerate(counts)])
        ax.set_title("WeightedSampler(class_balanced=True)")
        ax.legend(fontsize=8)
    for ax in axes:
        ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--first-seed", type=int, default=0)
    p.add_argument("--parts", default="pruning,noise,balanced")
    p.add_argument("--out", default=DEFAULT_OUT, help="folder for summary.json and samplers.png")
    p.add_argument("--data", default=None, help="cache folder of the generated images")
    p.add_argument("--guard-after", type=int, default=None,
                   help="the guarded arm's guard_after (default: the sampler's)")
    p.add_argument("--guard-quantile", type=float, default=None,
                   help="the guarded arm's guard_quantile (default: the sampler's)")
    args = p.parse_args(argv)
    from raying.engine.ray_setup import ensure_ray

    parts = [s.strip() for s in args.parts.split(",") if s.strip()]
    seeds = list(range(args.first_seed, args.first_seed + args.seeds))
    data = Path(args.data or Path(tempfile.gettempdir()) / "raying-sampler-study")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    def say(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    t0 = time.perf_counter()
    ensure_ray()
    guard_table = {k: v for k, v in (("guard_after", args.guard_after),
                                     ("guard_quantile", args.guard_quantile)) if v is not None}
    funcs = {"pruning": part_pruning,
             "noise": functools.partial(part_noise, guard_table=guard_table or None),
             "balanced": part_balanced}
    summary: dict[str, Any] = {"seeds": seeds, "parts": {}}
    for part in parts:
        summary["parts"][part] = funcs[part](data, seeds, say)
    summary["wall_s"] = round(time.perf_counter() - t0, 1)
    summary["command"] = "python -m raying.bench.sampler_study " + " ".join(argv or sys.argv[1:])
    (out / "summary.json").write_text(json.dumps(summary, indent=1, default=float))
    chart(summary, out / "samplers.png")
    for part, res in summary["parts"].items():
        for row in res["per_seed"]:
            say(f"{part} seed {row['seed']}: " + ", ".join(
                f"{k} {'held' if v else 'NOT held'}" for k, v in row["held"].items()))
        for k, v in res.get("overall", {}).get("held", {}).items():
            say(f"{part} overall: {k} {'held' if v else 'NOT held'}")
    say(f"wrote {out / 'summary.json'} and {out / 'samplers.png'} ({summary['wall_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
