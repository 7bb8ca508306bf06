"""Ray job: a small CNN on rare, hard generated images, uniform vs loss-driven prioritized sampling.

Both arms go through the real pipeline (Manifest -> Pipeline -> Ray read tasks ->
iter_torch_batches), the prioritized arm with the priority store and asynchronous feedback
(``pipe.report(ids, per_sample_loss)``). For every seed it prints the steps each arm took to
reach the target balanced validation accuracy and the accuracy on the rare classes, saves
charts, and prints one JSON summary line last.

    ray job submit --working-dir . -- python jobs/train_prioritized.py --seeds 3
    python jobs/train_prioritized.py --smoke-test          # seconds, on the CPU
    python jobs/train_prioritized.py --config sweep.json   # keys = the options below
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any

# Defaults of a full run; --config file.json and the flags override them.
DEFAULTS: dict[str, Any] = {
    "seeds": 3, "first_seed": 0, "max_steps": 1200, "target": 0.9, "eval_every": 25,
    "batch_size": 64, "lr": 2e-3, "alpha": 1.0, "beta": 0.0, "uniform_mix": 0.1,
    "stop_at_target": None, "arms": ["uniform", "prioritized"], "data": None, "out": None,
    "spec": {},
}
SMOKE: dict[str, Any] = {
    "seeds": 1, "max_steps": 30, "eval_every": 10, "stop_at_target": None, "out": None,
    "spec": {"common_per_class": 24, "rare_per_class": 4, "val_per_class": 6},
}


def parse_args(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="example:\n  python jobs/train_prioritized.py --seeds 3 --out results/\n"
               "  python jobs/train_prioritized.py --smoke-test")
    p.add_argument("--config", help="JSON file of options (keys as in DEFAULTS)")
    p.add_argument("--smoke-test", action="store_true", help="tiny data and run, seconds on CPU")
    p.add_argument("--seeds", type=int, help="seeds per arm (0, 1, ...)")
    p.add_argument("--first-seed", type=int, help="first seed")
    p.add_argument("--max-steps", type=int, help="steps per run at most")
    p.add_argument("--target", type=float, help="balanced validation accuracy to reach")
    p.add_argument("--alpha", type=float, help="priority exponent")
    p.add_argument("--beta", type=float, help="importance-weight exponent")
    p.add_argument("--uniform-mix", type=float, help="uniform share of draws")
    p.add_argument("--lr", type=float, help="Adam learning rate")
    p.add_argument("--arms", help="comma list: uniform,prioritized")
    p.add_argument("--data", help="dataset cache folder (default ~/.cache/raying/demo-data)")
    p.add_argument("--out", help="folder for the charts and summary.json")
    ns = p.parse_args(argv)
    opts = dict(DEFAULTS)
    if ns.smoke_test:
        opts.update(SMOKE)
    if ns.config:
        try:
            extra = json.loads(Path(ns.config).read_text())
        except (OSError, json.JSONDecodeError) as exc:
            p.error(f"--config {ns.config}: {exc}")
        unknown = set(extra) - set(DEFAULTS)
        if unknown:
            p.error(f"--config {ns.config}: unknown keys {sorted(unknown)}; known: "
                    f"{sorted(DEFAULTS)}")
        opts.update(extra)
    for key in ("seeds", "first_seed", "max_steps", "target", "alpha", "beta", "uniform_mix",
                "lr", "data", "out"):
        if getattr(ns, key) is not None:
            opts[key] = getattr(ns, key)
    if ns.arms:
        opts["arms"] = ns.arms.split(",")
    opts["smoke_test"] = ns.smoke_test
    return opts


def save_chart(results: dict[str, list[dict[str, Any]]], target: float, path: Path) -> None:
    """Steps to target per seed (bars) and rare-class accuracy per seed."""
    from raying._demo_report import COLOURS, _plt

    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for j, (arm, runs) in enumerate(results.items()):
        xs = [k + 0.4 * j for k in range(len(runs))]
        steps = [r["steps_to_target"] or r["steps"] for r in runs]
        bars = axes[0].bar(xs, steps, width=0.4, color=COLOURS.get(arm), label=arm)
        for b, r in zip(bars, runs, strict=True):
            if r["steps_to_target"] is None:
                b.set_hatch("//")
                b.set_alpha(0.5)
        axes[1].bar(xs, [100 * r["final_rare_acc"] for r in runs], width=0.4,
                    color=COLOURS.get(arm), label=arm)
    seeds = [r["config"]["seed"] for r in next(iter(results.values()))]
    for ax in axes:
        ax.set_xticks([k + 0.2 for k in range(len(seeds))], [f"seed {s}" for s in seeds])
        ax.legend()
        ax.grid(alpha=0.3, axis="y")
    axes[0].set_title(f"steps to {target:.0%} balanced accuracy (hatched: not reached)")
    axes[1].set_title("final accuracy on the rare classes (%)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    opts = parse_args(argv)
    import raying
    from raying import _demo_report as report
    from raying._demo_model import ArmConfig, load_eval_set, train_arm
    from raying.demo_data import DemoDataSpec, ensure_demo_data
    from raying.pipeline import ensure_ray

    t0 = time.perf_counter()
    spec = DemoDataSpec(**opts["spec"])
    data_dir = opts["data"]
    if data_dir is None and opts["smoke_test"]:
        import tempfile

        data_dir = Path(tempfile.gettempdir()) / "raying-smoke-data"
    data = ensure_demo_data(data_dir, spec)
    out = Path(opts["out"] or ("train_prioritized-smoke" if opts["smoke_test"]
                               else "train_prioritized-results"))
    out.mkdir(parents=True, exist_ok=True)
    ensure_ray()
    train = raying.Manifest.scan(str(data.train))
    val = load_eval_set(raying.Manifest.scan(str(data.val)), size=spec.size)
    results: dict[str, list[dict[str, Any]]] = {arm: [] for arm in opts["arms"]}
    seeds = list(range(opts["first_seed"], opts["first_seed"] + opts["seeds"]))
    for seed in seeds:
        for arm in opts["arms"]:
            extra = ({k: opts[k] for k in ("alpha", "beta", "uniform_mix")}
                     if arm == "prioritized" else {})
            cfg = ArmConfig(arm=arm, seed=seed, max_steps=opts["max_steps"],
                            target=opts["target"], eval_every=opts["eval_every"],
                            batch_size=opts["batch_size"], lr=opts["lr"],
                            stop_at_target=opts["stop_at_target"], **extra)
            run = train_arm(train, val, cfg, rare_classes=data.rare_classes,
                            progress=sys.stderr.isatty(), desc=f"{arm} seed {seed}")
            results[arm].append(run)
            reached = run["steps_to_target"] if run["steps_to_target"] is not None else (
                f"not reached in {run['steps']}")
            print(f"seed {seed} {arm:>11}: steps to {opts['target']:.0%}: {reached}; "
                  f"rare-class acc {run['final_rare_acc']:.1%}; balanced acc "
                  f"{run['final_acc']:.1%}; {run['img_per_s']:,.0f} img/s; stall "
                  f"{run['stall_share']:.1%}", flush=True)
    arms = {arm: report.arm_summary(runs) for arm, runs in results.items()}
    summary: dict[str, Any] = {
        "job": "train_prioritized", "smoke_test": opts["smoke_test"], "seeds": seeds,
        "target": opts["target"], "max_steps": opts["max_steps"],
        "prioritized": {k: opts[k] for k in ("alpha", "beta", "uniform_mix")},
        "dataset": {"train_size": len(train), "val_size": int(len(val[1])),
                    "rare_classes": list(data.rare_classes), "spec": dataclasses.asdict(spec),
                    "path": str(data.root)},
        "arms": arms, "wall_s": None, "charts": [],
    }
    if set(results) == {"uniform", "prioritized"}:
        speed = report.speedups(results)
        summary["speedup_per_seed"] = speed
        summary["aim_met_per_seed"] = [
            bool(s is not None and s >= 2.0 and p["final_rare_acc"] > u["final_rare_acc"])
            for s, u, p in zip(speed, results["uniform"], results["prioritized"], strict=True)]
        save_chart(results, opts["target"], out / "train_prioritized.png")
        report.chart_accuracy(results, opts["target"], out / "accuracy.png")
        summary["charts"] = [str(out / "train_prioritized.png"), str(out / "accuracy.png")]
    summary["wall_s"] = round(time.perf_counter() - t0, 1)
    (out / "summary.json").write_text(json.dumps({**summary, "runs": results}, indent=2,
                                                 default=float))
    print(json.dumps(summary, default=float), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
