"""The demo's report: console table, PNG charts, summary.json and an index.html that shows them."""

from __future__ import annotations

import html
import json
import math
import statistics
from pathlib import Path
from typing import Any

import numpy as np

from raying.tools.demo_model import HIST_EDGES

ARMS = ("uniform", "prioritized")
COLOURS = {"uniform": "#4c72b0", "prioritized": "#dd8452"}


def _plt():
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def _median(values: list[float]) -> float | None:
    values = [v for v in values if v is not None]
    return float(statistics.median(values)) if values else None


def _censored_median(values: list[float | None]) -> float | None:
    """The median of steps to the target over every seed, a seed that never reached it
    counting as more than any that did: None when at least half of them never reached it
    (dropping the misses would credit an arm that failed most seeds with its one success)."""
    if not values:
        return None
    m = statistics.median([math.inf if v is None else float(v) for v in values])
    return None if math.isinf(m) else float(m)


def _fmt_steps(runs: list[dict[str, Any]]) -> str:
    return ", ".join(str(r["steps_to_target"]) if r["steps_to_target"] is not None
                     else f">{r['steps']}" for r in runs)


def arm_summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per-arm figures over seeds: medians, and the per-seed steps to target."""
    return {
        "seeds": [r["config"]["seed"] for r in runs],
        "steps_to_target": [r["steps_to_target"] for r in runs],
        "steps_to_target_median": _censored_median([r["steps_to_target"] for r in runs]),
        "reached_target": sum(r["steps_to_target"] is not None for r in runs),
        "final_acc": _median([r["final_acc"] for r in runs]),
        "rare_acc": _median([r["final_rare_acc"] for r in runs]),
        "rare_acc_per_seed": [round(r["final_rare_acc"], 4) for r in runs],
        "mean_rare_acc": _median([r["mean_rare_acc"] for r in runs]),
        "mean_rare_acc_per_seed": [round(r["mean_rare_acc"], 4) for r in runs],
        "common_acc": _median([r["final_common_acc"] for r in runs]),
        "img_per_s": _median([r["img_per_s"] for r in runs]),
        "pipeline_img_per_s": _median([r["pipeline_img_per_s"] for r in runs]),
        "stall_share": _median([r["stall_share"] for r in runs]),
        "rare_draw_share": _median([r["rare_draw_share"] for r in runs]),
        "skipped_count": sum(r["skipped_count"] for r in runs),
        "skipped_ids": sorted({i for r in runs for i in r["skipped_ids"]}),
        "steps": [r["steps"] for r in runs],
        "train_s": [r["train_s"] for r in runs],
    }


def speedups(results: dict[str, list[dict[str, Any]]]) -> list[float | None]:
    """Per seed: uniform's steps to target / prioritized's (None where either missed it)."""
    out: list[float | None] = []
    for u, p in zip(results["uniform"], results["prioritized"], strict=True):
        su, sp = u["steps_to_target"], p["steps_to_target"]
        out.append(round(su / sp, 3) if su and sp else None)
    return out


def console_table(summary: dict[str, Any]) -> str:
    """The closing table of ``raying demo`` (plain text)."""
    rows: list[tuple[str, ...]] = [("", "uniform", "prioritized")]

    def row(label: str, key: str, fmt: str) -> None:
        vals = []
        for arm in ARMS:
            v = summary["arms"][arm].get(key)
            vals.append("-" if v is None else fmt.format(v))
        rows.append((label, *vals))

    row("trainer img/s", "img_per_s", "{:,.0f}")
    row("data-stall share", "stall_share", "{:.1%}")
    rows.append((f"steps to {summary['target']:.0%} acc",
                 *(summary["arms"][a]["steps_to_target_text"] for a in ARMS)))
    row("rare-class accuracy", "rare_acc", "{:.1%}")
    row("  mean over the run", "mean_rare_acc", "{:.1%}")
    row("balanced accuracy", "final_acc", "{:.1%}")
    row("rare share of draws", "rare_draw_share", "{:.1%}")
    row("skipped samples", "skipped_count", "{:d}")
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    lines = ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in
                       enumerate(zip(r, widths, strict=True))) for r in rows]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


# -- charts ------------------------------------------------------------------------------------
def chart_accuracy(results: dict[str, list[dict[str, Any]]], target: float, path: Path) -> None:
    """Balanced and rare-class validation accuracy against steps, every seed."""
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for arm in ARMS:
        for k, run in enumerate(results[arm]):
            steps = [r["step"] for r in run["curve"]]
            label = arm if k == 0 else None
            axes[0].plot(steps, [r["acc"] for r in run["curve"]], color=COLOURS[arm],
                         alpha=1.0 if k == 0 else 0.5, label=label)
            axes[1].plot(steps, [r["rare_acc"] for r in run["curve"]], color=COLOURS[arm],
                         alpha=1.0 if k == 0 else 0.5, label=label)
            if run["steps_to_target"] is not None:
                axes[0].axvline(run["steps_to_target"], color=COLOURS[arm], ls=":", lw=1)
    axes[0].axhline(target, color="grey", ls="--", lw=1, label=f"target {target:.0%}")
    axes[0].set_title("balanced validation accuracy")
    axes[1].set_title("accuracy on the rare classes")
    for ax in axes:
        ax.set_xlabel("training step")
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right")
    axes[0].set_ylim(0, 1.02)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def chart_throughput(results: dict[str, list[dict[str, Any]]], path: Path) -> None:
    """Images per second the trainer consumed, per evaluation interval."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for arm in ARMS:
        for k, run in enumerate(results[arm]):
            pts = run["curve"][1:]
            ax.plot([r["time_s"] for r in pts], [r["img_per_s"] for r in pts],
                    color=COLOURS[arm], alpha=1.0 if k == 0 else 0.5,
                    label=f"{arm} (mean {run['img_per_s']:,.0f} img/s)" if k == 0 else None)
    ax.set_xlabel("training time (s, evaluation excluded)")
    ax.set_ylabel("images / s")
    ax.set_title("throughput: images trained on per second")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def chart_stall(results: dict[str, list[dict[str, Any]]], path: Path) -> None:
    """Share of the run the trainer spent waiting for data, as it evolved."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for arm in ARMS:
        for k, run in enumerate(results[arm]):
            pts = run["curve"][1:]
            ax.plot([r["step"] for r in pts], [100 * r["stall_share"] for r in pts],
                    color=COLOURS[arm], alpha=1.0 if k == 0 else 0.5,
                    label=f"{arm} (final {run['stall_share']:.1%})" if k == 0 else None)
    ax.set_xlabel("training step")
    ax.set_ylabel("% of wall time waiting for data")
    ax.set_title("data stall: time spent waiting for a batch")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def chart_priorities(results: dict[str, list[dict[str, Any]]], rare_share: float,
                     path: Path) -> None:
    """Where the sampling probability went (rare classes) and how priorities spread out."""
    plt = _plt()
    run = results["prioritized"][0]
    curve = [r for r in run["curve"] if "rare_prob_mass" in r]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    ax = axes[0]
    ax.plot([r["step"] for r in curve], [100 * r["rare_prob_mass"] for r in curve],
            color=COLOURS["prioritized"], label="prioritized: probability mass on rare ids")
    ax.plot([r["step"] for r in curve[1:]], [100 * r["rare_draw_share"] for r in curve[1:]],
            color=COLOURS["prioritized"], ls=":", label="prioritized: rare share of draws")
    u = results["uniform"][0]["curve"][1:]
    ax.plot([r["step"] for r in u], [100 * r["rare_draw_share"] for r in u],
            color=COLOURS["uniform"], ls=":", label="uniform: rare share of draws")
    ax.axhline(100 * rare_share, color="grey", ls="--", lw=1,
               label=f"rare share of the dataset ({rare_share:.1%})")
    ax.set_xlabel("training step")
    ax.set_ylabel("%")
    ax.set_title("sampling probability on the rare classes")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")
    ax = axes[1]
    picks = sorted({0, len(curve) // 4, len(curve) // 2, len(curve) - 1})
    centres = (HIST_EDGES[:-1] + HIST_EDGES[1:]) / 2
    cmap = plt.get_cmap("viridis")
    for j, k in enumerate(picks):
        rec = curve[k]
        counts = np.asarray(rec["hist_common"]) + np.asarray(rec["hist_rare"])
        ax.plot(centres, counts, color=cmap(j / max(len(picks) - 1, 1)),
                label=f"step {rec['step']}")
        ax.plot(centres, np.asarray(rec["hist_rare"]) * 10, ls=":",
                color=cmap(j / max(len(picks) - 1, 1)))
    ax.set_yscale("symlog", linthresh=1)
    ax.set_xlabel("log10 priority (latest loss)")
    ax.set_ylabel("samples (dotted: rare x10)")
    ax.set_title("priority distribution over time")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


CHARTS = {
    "accuracy.png": ("Accuracy", "Balanced validation accuracy (left) and accuracy on the three "
                     "rare, hard classes (right) against training steps. Dotted vertical lines "
                     "mark the step each run first reached the target. Uniform sampling sees a "
                     "rare class in about one draw in a hundred, so it learns the common "
                     "classes and then waits; loss-driven sampling moves draws to the samples "
                     "the model still gets wrong."),
    "priorities.png": ("Priority distribution over time", "Left: the share of the sampling "
                       "probability held by the rare classes in the priority store, and the "
                       "share of rare samples actually drawn, against their share of the "
                       "dataset. Right: histograms of the stored priorities (each sample's "
                       "latest loss) at four points of the prioritized run; easy samples fall "
                       "to low losses while the rare ones keep high priority until learned."),
    "throughput.png": ("Throughput", "Images per second the trainer consumed, per evaluation "
                       "interval. The CNN step on the CPU is the bottleneck here (see the stall "
                       "share): read tasks decode and augment on the other core. Prioritized "
                       "sampling adds work on this small machine (plan draws from the store, "
                       "loss reports, the store actor), and on 2 shared cores both rates also "
                       "move with the machine's load."),
    "stall.png": ("Data stall", "Share of wall time the training loop waited for its next "
                  "batch (pipe.stats()['stall_share']). Near zero means the loader is not the "
                  "bottleneck; prioritized reads draw their ids from the priority store when "
                  "each read task starts, without slowing the loop."),
}


HALF_WIDTH = ("throughput.png", "stall.png")


def write_charts(out: Path, results: dict[str, list[dict[str, Any]]], *, target: float,
                 rare_share: float) -> list[str]:
    """Draw every chart into ``out``; returns their file names."""
    chart_accuracy(results, target, out / "accuracy.png")
    chart_priorities(results, rare_share, out / "priorities.png")
    chart_throughput(results, out / "throughput.png")
    chart_stall(results, out / "stall.png")
    return list(CHARTS)


def write_html(out: Path, summary: dict[str, Any], table: str) -> Path:
    """index.html: the table, every chart with a few lines of explanation, the skipped files."""
    e = html.escape
    sections = []
    for name, (title, text) in CHARTS.items():
        cls = ' class="half"' if name in HALF_WIDTH else ""
        sections.append(f'<section{cls}><h2>{e(title)}</h2><p>{e(text)}</p>'
                        f'<img src="{e(name)}" alt="{e(title)}"></section>')
    skipped = summary.get("skipped_files", [])
    bad = "".join(f"<li><code>{e(s['path'])}</code>: {e(s['reason'])}</li>" for s in skipped)
    data = summary["dataset"]
    verdict = e(summary["verdict"])
    page = f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>raying demo report</title>
<style>
body {{ font-family: system-ui, sans-serif; max-width: 1150px; margin: 24px auto;
       color: #222; background: #fff; }}
pre {{ background: #f4f4f4; padding: 12px; font-size: 14px; }}
img {{ width: 100%; border: 1px solid #ddd; }}
section {{ margin-bottom: 28px; }}
section.half {{ display: inline-block; width: 49%; vertical-align: top; }}
h2 {{ margin-bottom: 4px; }}
</style></head><body>
<h1>raying demo: uniform vs loss-driven prioritized sampling</h1>
<p>A small CNN trained on the CPU twice through the same raying pipeline (Manifest &rarr;
Pipeline &rarr; Ray read tasks &rarr; iter_torch_batches), once with
<code>UniformSampler</code>, once with <code>PrioritizedSampler(alpha={summary['alpha']},
beta={summary['beta']}, uniform_mix={summary['uniform_mix']})</code> fed by
<code>pipe.report(ids, per_sample_loss)</code>. The data: {data['train_size']} generated
{data['size']}px images of 10 shape classes, of which classes {data['rare_classes']} are rare
({data['rare_share']:.1%} of the training set together) and look like a common class;
validation is balanced ({data['val_size']} images). Target: {summary['target']:.0%} balanced
accuracy. Wall time {summary['wall_s']:.0f} s.</p>
<p><b>{verdict}</b></p>
<pre>{e(table)}</pre>
{''.join(sections)}
<section><h2>Skipped samples</h2>
<p>The training folder holds {len(data['bad_files'])} bad files on purpose (a truncated JPEG,
a zero-byte file and a text file named .jpg). With <code>on_error="skip"</code> the pipeline
sets them aside, delivers every good sample and reports each bad one with its id, path and
reason (<code>pipe.stats()["skipped"]</code>); the count in the table is per epoch read.</p>
<ul>{bad}</ul></section>
<p>Raw figures: <a href="summary.json">summary.json</a>.</p>
</body></html>
"""
    path = out / "index.html"
    path.write_text(page, encoding="utf-8")
    return path


def write_summary(out: Path, summary: dict[str, Any]) -> Path:
    path = out / "summary.json"
    path.write_text(json.dumps(summary, indent=2, default=float), encoding="utf-8")
    return path
