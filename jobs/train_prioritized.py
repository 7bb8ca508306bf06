"""Ray job: a small CNN on rare, hard generated images, uniform vs loss-driven prioritized sampling.

Both arms go through the real pipeline (Manifest -> Pipeline -> Ray read tasks ->
iter_torch_batches), the prioritized arm with the priority store and asynchronous feedback
(``pipe.report(ids, per_sample_loss)``). For every seed it prints the steps each arm took to
reach the target balanced validation accuracy and the accuracy on the rare classes, saves
charts and summary.json, and prints the summary last (one ``RAYING_SUMMARY {json}`` line).

    ray job submit --working-dir . -- python jobs/train_prioritized.py --seeds 3
    python jobs/train_prioritized.py --smoke-test          # seconds, on the CPU
    python jobs/train_prioritized.py --config sweep.json   # keys = the long options
    python jobs/train_prioritized.py --arms prioritized --beta 1.0 --seeds 2
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402

# Charts and summary.json of a full run (the demo's report folder, ignored by git).
DEFAULT_OUT = "raying-report/train_prioritized"
# A --smoke-test run: tiny data, a few steps, one seed (seconds on one CPU). Options given in
# --config or on the command line still win.
SMOKE = {"seeds": 1, "max_steps": 30, "eval_every": 10, "common_per_class": 24,
         "rare_per_class": 4, "val_per_class": 6}


def output_dirs(args: argparse.Namespace) -> tuple[Any, Any]:
    """The data and report folders: ``--data`` / ``--out``; a smoke test's scratch folder;
    in a submitted job's copy of the working directory (gone with the cluster) the report
    goes to the temp folder. None: the defaults, in the working directory."""
    import os
    import tempfile

    data_dir = _common.kept_output(args.data, "--data")
    out_dir = _common.kept_output(args.out, "--out")
    if args.smoke_test:  # nothing left behind, and no full run's report replaced
        scratch = Path(tempfile.gettempdir()) / f"raying-train-prioritized-smoke-{os.getuid()}"
        return data_dir or scratch / "data", out_dir or scratch / "out"
    if out_dir is None and _common.in_job_copy():  # not into Ray's copy
        out_dir = Path(tempfile.gettempdir()) / DEFAULT_OUT
    return data_dir, out_dir


def _check_cache_folder(data_dir: str | Path | None) -> None:
    """--data is where this job generates its data: a folder that holds anything else (a
    user's own image folder, passed as the other jobs take --data) is refused, not written
    into."""
    if data_dir is None or not Path(data_dir).expanduser().is_dir():
        return
    other = sorted(p.name for p in Path(data_dir).expanduser().iterdir()
                   if not p.name.startswith(("shapes-", ".")))
    if other:
        msg = (f"--data {data_dir}: this job trains on data it generates (the demo's shapes), "
               f"into the folder --data names, and {data_dir} holds other files ("
               f"{', '.join(other[:3])}{', ...' if len(other) > 3 else ''}): pass a new or "
               f"empty folder; to train on your own dataset, run jobs/train_torch.py --data "
               f"{data_dir} --sampler prioritized")
        raise SystemExit(msg)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n  python jobs/train_prioritized.py --seeds 3 --out results/\n"
               "  python jobs/train_prioritized.py --smoke-test\n"
               "  python jobs/train_prioritized.py --config sweep.json  # keys: option names")
    p.add_argument("--config", metavar="FILE",
                   help="JSON or YAML file of option values (keys as the long options, e.g. "
                        "uniform_mix); options given on the command line win")
    p.add_argument("--smoke-test", action="store_true", help="tiny data and run, seconds on CPU")
    p.add_argument("--seeds", type=_common.positive, default=3, help="seeds per arm: first_seed, +1, ...")
    p.add_argument("--first-seed", type=int, default=0)
    p.add_argument("--max-steps", type=_common.positive, default=1200, help="steps per run")
    p.add_argument("--target", type=float, default=0.9,
                   help="balanced validation accuracy whose first crossing is counted")
    p.add_argument("--eval-every", type=_common.positive, default=20, help="steps between evaluations")
    p.add_argument("--stop-at-target", type=int, default=None,
                   help="stop a run this many steps after it reached the target")
    p.add_argument("--batch-size", type=_common.positive, default=64)
    p.add_argument("--lr", type=float, default=2e-3, help="Adam learning rate")
    p.add_argument("--schedule", default="cosine", choices=["cosine", "constant"],
                   help="learning-rate schedule over --max-steps")
    p.add_argument("--alpha", type=float, default=1.0, help="priority exponent")
    p.add_argument("--beta", type=float, default=0.0, help="importance-weight exponent")
    p.add_argument("--uniform-mix", type=float, default=0.1, help="uniform share of draws")
    p.add_argument("--guard", action="store_true",
                   help="turn on the prioritized sampler's noisy-label guard")
    p.add_argument("--arms", default="uniform,prioritized", help="comma list of arms to run")
    p.add_argument("--common-per-class", type=_common.positive, default=None,
                   help="training images per common class (default: the demo's)")
    p.add_argument("--rare-per-class", type=_common.positive, default=None,
                   help="training images per rare class (default: the demo's)")
    p.add_argument("--val-per-class", type=_common.positive, default=None, help="validation images per class")
    p.add_argument("--data", metavar="DIR",
                   help="cache folder this job generates its data into, not a dataset to train "
                        "on (default ~/.cache/raying/demo-data; a temp folder with "
                        "--smoke-test); your own data: jobs/train_torch.py")
    p.add_argument("--out", metavar="DIR",
                   help=f"folder for the charts and summary.json (default {DEFAULT_OUT}; a "
                        f"temp folder with --smoke-test)")
    p.add_argument("--json", action="store_true", help="print the summary as indented JSON")
    return p


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = build_parser()
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--smoke-test", action="store_true")
    if pre.parse_known_args(argv)[0].smoke_test:
        p.set_defaults(**SMOKE)
    args = _common.parse_args(p, argv)
    args.arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    bad = sorted(set(args.arms) - {"uniform", "prioritized"})
    if bad or not args.arms:
        p.error(f"--arms takes uniform and/or prioritized, got {args.arms!r}")
    if args.seeds < 1:
        p.error(f"--seeds must be >= 1, got {args.seeds}")
    if not 0.0 < args.target <= 1.0:
        p.error(f"--target is a balanced accuracy in (0, 1], got {args.target!r}")
    if "prioritized" in args.arms:  # the sampler's own checks, before the uniform arm trains
        import raying

        try:
            raying.PrioritizedSampler(alpha=args.alpha, beta=args.beta,
                                      uniform_mix=args.uniform_mix, guard=args.guard)
        except raying.ConfigError as exc:
            p.error(str(exc))
    return args


def save_chart(results: dict[str, list[dict[str, Any]]], target: float, path: Path) -> None:
    """Steps to target per seed (bars) and rare-class accuracy per seed."""
    from raying.tools.demo_report import COLOURS, _plt

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
    for ax, where in zip(axes, ("upper right", "lower right"), strict=True):
        ax.set_xticks([k + 0.2 for k in range(len(seeds))], [f"seed {s}" for s in seeds])
        ax.legend(loc=where, framealpha=0.95)
        ax.grid(alpha=0.3, axis="y")
    axes[0].set_title(f"steps to {target:.0%} balanced accuracy (hatched: not reached)")
    axes[1].set_title("final accuracy on the rare classes (%)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    import raying
    from raying.engine.ray_setup import ensure_ray
    from raying.tools import demo_report as report
    from raying.tools.demo_data import DemoDataSpec, ensure_demo_data
    from raying.tools.demo_model import ArmConfig, load_eval_set, train_arm

    t0 = time.perf_counter()
    sizes = {k: getattr(args, k) for k in ("common_per_class", "rare_per_class",
                                            "val_per_class") if getattr(args, k) is not None}
    spec = DemoDataSpec(**sizes)
    data_dir, out_dir = output_dirs(args)
    _check_cache_folder(data_dir)
    data = ensure_demo_data(data_dir, spec)
    out = Path(out_dir or DEFAULT_OUT)
    out.mkdir(parents=True, exist_ok=True)
    ensure_ray()
    train = raying.Manifest.scan(str(data.train))
    val = load_eval_set(raying.Manifest.scan(str(data.val)), size=spec.size)
    results: dict[str, list[dict[str, Any]]] = {arm: [] for arm in args.arms}
    seeds = list(range(args.first_seed, args.first_seed + args.seeds))
    prio = {"alpha": args.alpha, "beta": args.beta, "uniform_mix": args.uniform_mix,
            "guard": args.guard}
    for seed in seeds:
        for arm in args.arms:
            cfg = ArmConfig(arm=arm, seed=seed, max_steps=args.max_steps,
                            target=args.target, eval_every=args.eval_every,
                            batch_size=args.batch_size, lr=args.lr,
                            schedule=args.schedule,
                            stop_at_target=args.stop_at_target,
                            **(prio if arm == "prioritized" else {}))
            run = train_arm(train, val, cfg, rare_classes=data.rare_classes,
                            progress=sys.stderr.isatty(), desc=f"{arm} seed {seed}")
            results[arm].append(run)
            reached = run["steps_to_target"] if run["steps_to_target"] is not None else (
                f"not reached in {run['steps']}")
            print(f"seed {seed} {arm:>11}: steps to {args.target:.0%}: {reached}; "
                  f"rare-class acc {run['final_rare_acc']:.1%} (mean over the run "
                  f"{run['mean_rare_acc']:.1%}); balanced acc "
                  f"{run['final_acc']:.1%}; {run['img_per_s']:,.0f} img/s; stall "
                  f"{run['stall_share']:.1%}", flush=True)
    summary: dict[str, Any] = {
        "job": "train_prioritized", "smoke_test": args.smoke_test, "seeds": seeds,
        "target": args.target, "max_steps": args.max_steps, "prioritized": prio,
        "dataset": {"train_size": len(train), "val_size": int(len(val[1])),
                    "rare_classes": list(data.rare_classes), "spec": dataclasses.asdict(spec),
                    "path": str(data.root)},
        "arms": {arm: report.arm_summary(runs) for arm, runs in results.items()},
        "charts": [],
    }
    if set(results) == {"uniform", "prioritized"}:
        speed = report.speedups(results)
        summary["speedup_per_seed"] = speed
        # The aim: at most half the steps of uniform, and better accuracy on the rare classes.
        summary["aim_met_per_seed"] = [
            bool(s is not None and s >= 2.0 and p["final_rare_acc"] > u["final_rare_acc"])
            for s, u, p in zip(speed, results["uniform"], results["prioritized"], strict=True)]
        save_chart(results, args.target, out / "train_prioritized.png")
        report.chart_accuracy(results, args.target, out / "accuracy.png")
        summary["charts"] = [str(out / "train_prioritized.png"), str(out / "accuracy.png")]
    summary["wall_s"] = round(time.perf_counter() - t0, 1)
    (out / "summary.json").write_text(json.dumps({**summary, "runs": results}, indent=2,
                                                 default=float))
    _common.emit_summary("train_prioritized", summary, as_json=args.json)
    return 0


if __name__ == "__main__":
    sys.exit(_common.run(main, build_parser()))
