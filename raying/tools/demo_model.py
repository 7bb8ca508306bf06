"""The demo's small CNN and its training loop: real pipeline, store and asynchronous feedback."""

from __future__ import annotations

import dataclasses
import itertools
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from raying.errors import ConfigError

_ARMS = ("uniform", "prioritized")
# log10 priority bins of the priority histograms in the report.
HIST_EDGES = np.linspace(-5.0, 1.5, 27)


@dataclasses.dataclass(frozen=True)
class ArmConfig:
    """One training run.

    Args:
        arm: ``"uniform"`` or ``"prioritized"``.
        seed: seeds the model, the sampler and the augmentation.
        max_steps: optimizer steps at most.
        target: balanced validation accuracy whose first crossing is "steps to target".
        stop_at_target: stop this many steps after the target is reached (None: run on).
        time_limit_s: stop after this much wall time, evaluations included (None: no limit).
        batch_size: images per step.
        lr: Adam's learning rate.
        eval_every: steps between validation passes.
        alpha: priority exponent (prioritized).
        beta: importance-weight exponent (prioritized); 0 trains on the drawn mix as is.
        uniform_mix: uniform share of draws (prioritized).
        guard: the noisy-label guard of the prioritized sampler (``PrioritizedSampler(guard=)``).
        block_rows: images per read task.
        size: image size the transform outputs.
        crop_scale: the training crop's area range (random-resized-crop).
        torch_threads: intra-op threads of the trainer (the rest of the CPUs decode).
        ema: decay of the weight average that is evaluated (None: the raw weights).
        schedule: learning-rate schedule over ``max_steps``: ``"cosine"`` or ``"constant"``.
    """

    arm: str = "uniform"
    seed: int = 0
    max_steps: int = 1500
    target: float = 0.9
    stop_at_target: int | None = None
    time_limit_s: float | None = None
    batch_size: int = 64
    lr: float = 2e-3
    eval_every: int = 25
    alpha: float = 1.0
    beta: float = 0.0
    uniform_mix: float = 0.1
    guard: bool = False
    block_rows: int = 128
    size: int = 32
    crop_scale: tuple[float, float] = (0.6, 1.0)
    torch_threads: int = 1
    ema: float | None = 0.95
    schedule: str = "cosine"

    def __post_init__(self) -> None:
        if self.arm not in _ARMS:
            msg = f"arm must be one of {_ARMS}, got {self.arm!r}"
            raise ConfigError(msg)
        if self.schedule not in ("cosine", "constant"):
            msg = f"schedule must be 'cosine' or 'constant', got {self.schedule!r}"
            raise ConfigError(msg)
        if self.max_steps < 1 or self.eval_every < 1 or self.batch_size < 1:
            msg = (f"max_steps, eval_every and batch_size must be >= 1, got {self.max_steps}, "
                   f"{self.eval_every}, {self.batch_size}")
            raise ConfigError(msg)


def build_model(n_classes: int):
    """A small CNN for 32 px images (~61k parameters; ~30 ms per 64-image step on one core)."""
    from torch import nn

    def block(cin: int, cout: int) -> list[Any]:
        return [nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout),
                nn.ReLU(inplace=True)]

    return nn.Sequential(*block(3, 16), nn.MaxPool2d(2), *block(16, 32), nn.MaxPool2d(2),
                         *block(32, 64), nn.MaxPool2d(2), *block(64, 64),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, n_classes))


def eval_transform(size: int):
    """The evaluation transform: resize the shorter side, centre crop, no flip."""
    import raying

    return raying.ImageTransform(size=size, random_crop=False, flip=False)


def load_eval_set(manifest: Any, *, size: int) -> tuple[Any, Any]:
    """The validation set as in-memory tensors, read once through a uniform, ordered pipeline."""
    import torch

    import raying

    pipe = raying.Pipeline(manifest, transform=eval_transform(size),
                           sampler=raying.UniformSampler(shuffle=False))
    images, labels = [], []
    try:
        for b in pipe.iter_torch_batches(batch_size=256, epoch=0, device="cpu"):
            images.append(b["image"].contiguous())
            labels.append(b["label"])
    finally:
        pipe.close()
    return torch.cat(images), torch.cat(labels)


def per_class_accuracy(model: Any, images: Any, labels: Any, n_classes: int) -> np.ndarray:
    """Accuracy of each class on the given set (eval mode, no gradients)."""
    import torch

    model.eval()
    with torch.no_grad():
        pred = torch.cat([model(images[i:i + 512]).argmax(1) for i in range(0, len(images), 512)])
    model.train()
    y = labels.numpy()
    hit = (pred.numpy() == y).astype(np.float64)
    counts = np.bincount(y, minlength=n_classes)
    return np.bincount(y, weights=hit, minlength=n_classes) / np.maximum(counts, 1)


def _priority_view(handle: Any, labels: np.ndarray, rare: np.ndarray, cfg: ArmConfig,
                   ok: np.ndarray) -> dict[str, Any]:
    """Share of the sampling probability on rare classes, and log-priority histograms."""
    from raying.sampling import store

    p = store.priorities(handle)
    pa = np.power(p, cfg.alpha)
    n = len(p)
    total = pa.sum()
    share = pa / total if total > 0 else np.zeros(n)
    prob = (1 - cfg.uniform_mix) * share + cfg.uniform_mix / n
    is_rare = np.isin(labels, rare)
    logp = np.log10(np.maximum(p, 1e-5))
    return {"rare_prob_mass": float(np.sum(prob[is_rare])),
            "hist_rare": np.histogram(logp[is_rare & ok], HIST_EDGES)[0].tolist(),
            "hist_common": np.histogram(logp[~is_rare & ok], HIST_EDGES)[0].tolist()}


def train_arm(train_manifest: Any, val: tuple[Any, Any], cfg: ArmConfig, *,
              rare_classes: Sequence[int], progress: bool = True,
              desc: str | None = None,
              on_eval: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Train the small CNN once through a raying Pipeline and record what happened.

    The loop is what a user writes: per-sample cross-entropy (``reduction="none"``), the
    batch's importance ``weight`` applied when ``beta > 0``, ``pipe.report(ids, loss)`` after
    each step (buffered, fire-and-forget). Every ``eval_every`` steps the model is scored on
    the balanced validation set and the pipeline's stats and (prioritized) the store's
    priorities are recorded.

    Args:
        train_manifest: the training set.
        val: ``(images, labels)`` from :func:`load_eval_set`.
        cfg: the run.
        rare_classes: labels whose accuracy is reported separately.
        progress: show a progress bar.
        desc: the progress bar's label.
        on_eval: called with each evaluation record.

    Returns:
        A JSON-able dict: config, steps to target, final accuracies, curves, pipeline stats.
    """
    import torch
    import torch.nn.functional as F

    import raying
    from raying.engine.progress import progress_bar

    torch.manual_seed(cfg.seed)
    torch.set_num_threads(max(1, cfg.torch_threads))
    n_classes = len(train_manifest.classes)
    labels_all = np.asarray(train_manifest.labels)
    rare = np.asarray(rare_classes, dtype=np.int64)
    model = build_model(n_classes).to(memory_format=torch.channels_last)
    opt = torch.optim.Adam(model.parameters(), lr=cfg.lr)
    # Cosine decay to zero at max_steps: the final accuracies are then those of a settled model,
    # not a snapshot of Adam's swings between look-alike classes at a constant rate.
    sched = (torch.optim.lr_scheduler.LambdaLR(
        opt, lambda t: 0.5 * (1.0 + math.cos(math.pi * min(t, cfg.max_steps) / cfg.max_steps)))
        if cfg.schedule == "cosine" else None)
    # Scored with an exponential moving average of the weights: Adam at a constant rate swings
    # between look-alike classes from step to step, and the average makes the curves readable.
    scored = (torch.optim.swa_utils.AveragedModel(
        model, multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(cfg.ema), use_buffers=True)
        if cfg.ema else model)
    transform = raying.ImageTransform(size=cfg.size, random_crop=True, flip=True,
                                      scale=cfg.crop_scale)
    if cfg.arm == "prioritized":
        sampler: Any = raying.PrioritizedSampler(alpha=cfg.alpha, beta=cfg.beta,
                                                 uniform_mix=cfg.uniform_mix, seed=cfg.seed,
                                                 guard=cfg.guard)
    else:
        sampler = raying.UniformSampler(seed=cfg.seed)
    pipe = raying.Pipeline(train_manifest, transform=transform, sampler=sampler,
                           on_error="skip",
                           config=raying.PipelineConfig(block_rows=cfg.block_rows))
    store_name = pipe.store_name  # binds the sampler now: a prioritized one starts its store
    val_x, val_y = val
    curve: list[dict[str, Any]] = []
    hits: dict[str, Any] = {"steps_to_target": None, "images_to_target": None,
                            "time_to_target_s": None}
    step, images, rare_drawn, window_images, window_rare = 0, 0, 0, 0, 0
    ok = np.ones(len(labels_all), dtype=bool)  # False for ids the pipeline skipped
    train_s, eval_s = 0.0, 0.0
    t_window = time.perf_counter()

    def evaluate() -> dict[str, Any]:
        nonlocal t_window, window_images, window_rare, eval_s
        t_eval = time.perf_counter()
        acc = per_class_accuracy(scored, val_x, val_y, n_classes)
        st = pipe.stats()
        common = np.setdiff1d(np.arange(n_classes), rare)
        rec: dict[str, Any] = {
            "step": step, "images": images, "time_s": round(train_s, 3),
            "acc": float(acc.mean()), "rare_acc": float(acc[rare].mean()),
            "common_acc": float(acc[common].mean()),
            "class_acc": [round(float(a), 4) for a in acc],
            "img_per_s": window_images / max(t_eval - t_window, 1e-9),
            "stall_share": float(st["stall_share"]),
            "rare_draw_share": window_rare / max(window_images, 1),
            "skipped_count": int(st["skipped_count"])}
        for s in st["skipped"]:
            ok[s["id"]] = False
        if cfg.arm == "prioritized":  # (skipped ids get priority 0 from the pipeline itself)
            rec.update(_priority_view(sampler.handle, labels_all, rare, cfg, ok))
        t_window, window_images, window_rare = time.perf_counter(), 0, 0
        eval_s += t_window - t_eval
        if hits["steps_to_target"] is None and rec["acc"] >= cfg.target:
            hits.update(steps_to_target=step, images_to_target=images,
                        time_to_target_s=round(train_s, 3))
        curve.append(rec)
        if on_eval is not None:
            on_eval(rec)
        return rec

    t0 = time.perf_counter()
    try:
        with progress_bar(total=cfg.max_steps, desc=desc or cfg.arm, unit="step",
                          enabled=progress) as bar:
            evaluate()
            done = False
            for epoch in itertools.count():
                for batch in pipe.iter_torch_batches(batch_size=cfg.batch_size, epoch=epoch,
                                                     device="cpu", drop_last=True):
                    logits = model(batch["image"])
                    loss = F.cross_entropy(logits, batch["label"], reduction="none")
                    if cfg.beta > 0:
                        objective = (batch["weight"] * loss).sum() / batch["weight"].sum()
                    else:
                        objective = loss.mean()
                    opt.zero_grad(set_to_none=True)
                    objective.backward()
                    opt.step()
                    if sched is not None:
                        sched.step()
                    if scored is not model:
                        scored.update_parameters(model)
                    pipe.report(batch["id"], loss.detach())  # buffered; never blocks the step
                    step += 1
                    n = int(batch["id"].shape[0])
                    images += n
                    window_images += n
                    window_rare += int(np.isin(batch["label"].numpy(), rare).sum())
                    rare_drawn += int(np.isin(batch["label"].numpy(), rare).sum())
                    bar.update(1)
                    train_s = time.perf_counter() - t0 - eval_s
                    if step % cfg.eval_every == 0:
                        rec = evaluate()
                        bar.set_postfix_str(f"acc {rec['acc']:.2f} rare {rec['rare_acc']:.2f}")
                    after = hits["steps_to_target"]
                    done = (step >= cfg.max_steps
                            or (cfg.stop_at_target is not None and after is not None
                                and step >= after + cfg.stop_at_target)
                            or (cfg.time_limit_s is not None
                                and time.perf_counter() - t0 >= cfg.time_limit_s))
                    if done:
                        break
                if done:
                    break
            if curve[-1]["step"] != step:
                evaluate()
        stats = pipe.stats()
    finally:
        pipe.close()  # also stops the priority store it created
    final = curve[-1]
    sampling = stats.get("sampling", {})
    return {
        "config": dataclasses.asdict(cfg), "store": store_name, **hits, "steps": step, "images": images,
        "train_s": round(train_s, 2), "final_acc": final["acc"],
        "final_rare_acc": final["rare_acc"], "final_common_acc": final["common_acc"],
        "best_rare_acc": max(r["rare_acc"] for r in curve),
        # Mean over the evaluations after step 0: how early and how well the rare classes
        # were learned, less sensitive to one evaluation than the final figure.
        "mean_rare_acc": float(np.mean([r["rare_acc"] for r in curve[1:]] or [0.0])),
        "rare_draw_share": rare_drawn / max(images, 1),
        "img_per_s": images / max(train_s, 1e-9),
        "pipeline_img_per_s": float(stats["throughput_rows_per_s"]),
        "stall_share": float(stats["stall_share"]), "stall_s": float(stats["stall_s"]),
        "skipped_count": int(stats["skipped_count"]),
        "skipped_ids": sorted({int(s["id"]) for s in stats["skipped"]}),
        "skipped": [{k: s[k] for k in ("id", "path", "reason")} for s in stats["skipped"][:10]],
        "ess_fraction": sampling.get("ess_fraction"), "curve": curve,
    }
