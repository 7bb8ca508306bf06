"""The bench's outputs: ``bench.json``, a console table and ``bench.png`` (matplotlib, Agg)."""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np

from raying.bench.child import REFERENCE_PEERS

PEER_COLOURS = {"L": "#444444", "L-crop": "#888888", "pyarrow": "#444444", "torch": "#ee4c2c", "tf": "#ff9f00",
                "raydata": "#028cf0", "raying": "#2ca02c", "raying-train": "#17becf",
                "raydata-train": "#8c564b",
                "raying-cache": "#bcbd22", "raying-cache-eager": "#dbdb8d",
                "tf-cache": "#ffbb78", "W1 uniform": "#98df8a"}
_WORKLOAD_TITLES = {"W1": "W1 JPEG folder", "W2": "W2 JPEG 500x375", "W3": "W3 Parquet of JPEG",
                    "W4": "W4 pre-decoded Parquet", "W5": "W5 W1 prioritized + live updates",
                    "W6": "W6 ImageNet-like JPEG folder", "W7": "W7 W1 + colour jitter (user stage)"}


def json_default(x: Any) -> Any:
    if isinstance(x, np.generic):
        return x.item()
    if isinstance(x, np.ndarray):
        return x.tolist()
    return str(x)


def write_json(doc: dict[str, Any], path: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as fh:
        json.dump(doc, fh, indent=1, default=json_default)
    os.replace(tmp, path)


def _f(v: float | None, fmt: str, width: int) -> str:
    return (format(v, fmt) if v is not None else "-").rjust(width)


def table(rows: list[dict[str, Any]], workloads: dict[str, dict[str, Any]]) -> str:
    """A plain-text table, one block per workload."""
    lines = []
    head = (f"{'batch':>5} {'mode':<8} {'peer':<12} {'cold/s':>7} {'xbest':>5} {'img/s':>7} "
            f"{'GB/s':>6} {'xL':>5} {'xbest':>5} {'best':<7} {'ttfb cold':>9} {'warm':>6} "
            f"{'cpu-s/1k':>8} {'wholeMB':>7} {'floor':>6} {'1ep s':>6} {'all s':>6} "
            f"{'ray up':>6} rows")
    for wl in sorted({r["workload"] for r in rows}):
        w = workloads[wl]
        h, wd = w["shape"]
        what = (f"{w['rows']} rows, {'pre-decoded ' + str(w['decoded']) + 'px ' if w['decoded'] else ''}"
                f"{w['kind']}, {wd}x{h} source")
        ref = "pyarrow read" if wl == "W4" else ("W1's L" if wl == "W5" else "L")
        lines.append(f"\n{_WORKLOAD_TITLES.get(wl, wl)}: {what}; xL is against {ref}")
        lines.append(head)
        for r in (x for x in rows if x["workload"] == wl):
            rows_txt = "ok" if r["rows_ok"] else f"BAD {r['rows_per_epoch']} != {r['expected_rows']}"
            if r["problems"] and r["rows_ok"]:
                rows_txt += " !"
            extra = ""
            if wl == "W5" and r.get("ratio_to_uniform") is not None:
                extra = f"  x{r['ratio_to_uniform']:.2f} of W1 uniform"
            lines.append(
                f"{r['batch_size']:>5} {r['mode']:<8} {r['peer']:<12} "
                f"{_f(r.get('cold_img_s'), ',.0f', 7)} "
                f"{_f(r.get('cold_ratio_to_best_peer'), '.2f', 5)} "
                f"{_f(r['steady_img_s'], ',.0f', 7)} {_f(r['gb_s'], '.2f', 6)} "
                f"{_f(r['ratio_to_L'], '.2f', 5)} {_f(r['ratio_to_best_peer'], '.2f', 5)} "
                f"{(r['best_peer'] or '-'):<7} {_f(r['ttfb_cold_s'], '.2f', 9)} "
                f"{_f(r['ttfb_warm_s'], '.3f', 6)} {_f(r['cpu_s_per_1k'], '.2f', 8)} "
                f"{_f(r.get('peak_whole_mb'), ',.0f', 7)} "
                f"{_f(r.get('startup_whole_mb'), ',.0f', 6)} "
                f"{_f(r.get('job_1_s'), '.1f', 6)} {_f(r.get('job_last_s'), '.1f', 6)} "
                f"{_f(r['ray_start_s'], '.1f', 6)} "
                f"{rows_txt}{extra}")
    return "\n".join(lines)


def targets_table(checks: list[dict[str, Any]]) -> str:
    if not checks:
        return ""
    lines = ["\nspeed targets (iterate mode; median of rounds):"]
    for c in checks:
        verdict = {True: "PASS", False: "MISS", None: "n/a "}[c["pass"]]
        value = "-" if c["value"] is None else f"{c['value']:.3f}"
        above = " ABOVE THE CEILING" if c.get("reachable") is False else ""
        lines.append(f"  {verdict} {c['target']:<44} {value:>7} ({c['kind']} "
                     f"{c['threshold']}){' ' + c['detail'] if c['detail'] else ''}{above}")
    return "\n".join(lines)


def chart(rows: list[dict[str, Any]], path: str, title: str) -> None:
    """Grouped bars: one row of panels per workload (throughput, warm ttfb, CPU, memory)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    wls = sorted({r["workload"] for r in rows})
    metrics = [("cold_img_s", "cold epoch 0 img/s"),
               ("steady_img_s", "steady img/s (W4: GB/s)"), ("ttfb_warm_s", "warm ttfb (s)"),
               ("cpu_s_per_1k", "CPU-s / 1k img"), ("peak_whole_mb", "whole memory (MB)")]
    fig, axes = plt.subplots(len(wls), len(metrics), figsize=(5.2 * len(metrics),
                                                                 2.9 * len(wls)), squeeze=False)
    for i, wl in enumerate(wls):
        mine = [r for r in rows if r["workload"] == wl]
        if wl == "W5":  # its reference: the same reads, uniform (W1)
            mine += [dict(r, peer="W1 uniform") for r in rows
                     if r["workload"] == "W1" and r["peer"] == "raying"]
        configs = sorted({(r["batch_size"], r["mode"]) for r in mine},
                         key=lambda c: (c[0], ("iterate", "sleep", "compute").index(c[1])
                                        if c[1] in ("iterate", "sleep", "compute") else 9))
        peers = [p for p in PEER_COLOURS if any(r["peer"] == p for r in mine)]
        width = 0.8 / max(1, len(peers))
        for j, (key, label) in enumerate(metrics):
            ax = axes[i][j]
            use = "gb_s" if (wl == "W4" and key == "steady_img_s") else key
            for k, peer in enumerate(peers):
                xs, ys, lo, hi = [], [], [], []
                for c, (b, mode) in enumerate(configs):
                    r = next((x for x in mine if x["peer"] == peer and x["batch_size"] == b
                              and x["mode"] == mode), None)
                    if r is None or r.get(use) is None:
                        continue
                    vals = [v for v in r.get(use + "_rounds", []) if v is not None] or [r[use]]
                    xs.append(c + (k - (len(peers) - 1) / 2) * width)
                    ys.append(r[use])
                    lo.append(r[use] - min(vals))
                    hi.append(max(vals) - r[use])
                if xs:
                    ax.bar(xs, ys, width, yerr=[lo, hi], label=peer,
                           color=PEER_COLOURS.get(peer, "#999999"),
                           hatch="//" if peer in REFERENCE_PEERS else None,
                           edgecolor="white" if peer in REFERENCE_PEERS else None)
            if key == "ttfb_warm_s":  # from milliseconds to seconds across peers
                ax.set_yscale("log")
            ax.set_xticks(range(len(configs)))
            ax.set_xticklabels([f"b{b}\n{m}" for b, m in configs], fontsize=8)
            ax.set_title(f"{_WORKLOAD_TITLES.get(wl, wl)}: {label}", fontsize=9)
            ax.tick_params(axis="y", labelsize=8)
            if j == 0:
                ax.legend(fontsize=7, ncol=2)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
