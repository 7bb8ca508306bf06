"""From raw runs to the bench's figures: per-round metrics, medians over rounds, ratios, targets.

Definitions (the JSON's ``definitions`` repeats them):

- steady img/s: rows of epochs 1..E-1 / (end of epoch E-1 - end of epoch 0); the cold first
  epoch is excluded, the gaps at later epoch boundaries are included.
- cold img/s: rows of epoch 0 / its end, counted from the start of building the loader
  (dataset listing and the loader's own start-up included; Ray's start is ``ray_start_s``,
  followed by ``ray_settle_s`` idle for the node to start its workers).
- job wall (``job_s``): from building the loader to the end of epoch e, for e = 1..E: what a
  1-epoch and an E-epoch job wait (Ray's start excluded, as above).
- GB/s (W4): steady img/s x S*S*3 stored bytes per row / 1e9.
- ttfb cold: from the start of building the loader (dataset listing included) to the first
  batch of epoch 0; ``ttfb_cold_iter_s`` is the part after the iterator was asked for. Every
  cell builds a fresh loader, but only a measurement's first cell (``cell_index`` 0 in
  ``runs``) runs the first tasks on the framework's fresh worker processes (Ray's); Ray's own
  start-up is ``ray_start_s`` (then ``ray_settle_s`` idle, in which the node starts its
  worker processes), outside every ttfb.
- ttfb warm: from asking for epoch e's iterator (right after epoch e-1 ended) to its first
  batch, median over e >= 1.
- CPU-s per 1k images: CPU seconds of the whole process tree (measuring process, its threads,
  workers, Ray's raylet/GCS/agents) over the steady window / steady rows x 1000. In the
  ``compute`` mode it includes the consumer's own work.
- peak memory: the tree's PSS sampled during the cell (see ``raying.bench.measure``);
  ``startup_pss_mb`` is the tree's PSS once the framework has started (Ray's own processes),
  before any loader exists.
- whole memory: ``peak_whole_mb``, the tree's anonymous and file PSS plus /dev/shm's growth
  (object store, cache files, shared tensors: every page once); ``startup_whole_mb`` the same
  once the framework has started (for Ray peers: a local Ray doing nothing, its floor), and
  ``beyond_start_mb`` their difference.
- ratio to L: to the limit of the same workload and batch size (W4: the plain pyarrow read;
  W5: W1's limit). Ratio to the best peer: to the best other loader (not a reference, not a
  labelled cache row) in the same workload, batch size and consumer mode; ``cold_ratio_to_best_peer``
  does the same for cold img/s.
- L-crop: L's loop with raying's crop-window kernel (only the crop's rows and columns of a
  JPEG decoded): the ceiling of a loader that decodes that way on this machine. A target
  asking raying for more img/s than L-crop's steady rate is marked ``reachable: false``
  (printed "ABOVE THE CEILING"): the kernel alone, with no loader around it, is slower.
  ``ratio_to_L_crop``: a row's steady img/s over L-crop's (for raying: what the loader around
  its kernel costs).
- cache rows (``raying-cache``, ``raying-cache-eager``, ``tf-cache``): raying with its
  decoded-pixel cache on from epoch 0 (filling within its budget, or every sample at first
  read), and tf.data with ``.cache()`` after the decode. Their later epochs decode less or
  not at all, so they are never a headline figure nor anyone's best peer.
- Every figure is the median over rounds; ``*_rounds`` lists the values of each round.
"""

from __future__ import annotations

import statistics
from typing import Any

from raying.bench.child import REFERENCE_PEERS, steady

# The speed targets' thresholds, checked in the iterate mode at every batch size.
TARGET_VS_BEST_OF_TORCH_TF = 1.15
TARGET_VS_LIMIT = 0.9
TARGET_COLD_TTFB_S = 1.0
TARGET_CACHE_COLD_VS_OFF = 0.95
# Labelled rows that do less work than the peers in their later epochs (decoded caches).
CACHE_PEERS = ("raying-cache", "raying-cache-eager", "tf-cache")
TARGET_W4_VS_PYARROW = 0.6
TARGET_W5_VS_UNIFORM = 0.95
TARGET_WARM_TTFB_S = 0.25
TARGET_MEMORY_VS_TORCH = 1.5
# The Ray Train path (2 Train workers) against raying's iterator and plain Ray Data through
# Train's own split.
TARGET_TRAIN_VS_ITERATOR = 0.9
TARGET_TRAIN_VS_RAYDATA_TRAIN = 1.5


def _median(values: list[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return statistics.median(vals) if vals else None


def cell_metrics(cell: dict[str, Any], wl: dict[str, Any], epochs: int) -> dict[str, Any]:
    """The figures of one cell of one round (raw timings + the watcher's readings)."""
    ep = cell.get("epochs", [])
    rows_ok = (len(ep) == epochs and not cell.get("errors")
               and all(e["rows"] == wl["rows"] and not e["problems"] for e in ep))
    rate = steady(ep)
    steady_rows = sum(e["rows"] for e in ep[1:])
    cold = ep[0]["rows"] / ep[0]["end_s"] if ep and ep[0]["end_s"] > 0 else None
    cpu = cell.get("cpu_steady_s")
    out = {
        "rows_ok": rows_ok,
        "rows_per_epoch": [e["rows"] for e in ep],
        "expected_rows": wl["rows"],
        "problems": [p for e in ep for p in e["problems"]][:5] + list(cell.get("errors", [])),
        "steady_img_s": rate,
        "cold_img_s": cold,
        "job_s": [round(e["end_s"], 3) for e in ep],
        "gb_s": rate * wl["decoded"] ** 2 * 3 / 1e9 if rate and wl.get("decoded") else None,
        "setup_s": cell.get("setup_s"),
        "ttfb_cold_s": ep[0]["first_s"] if ep else None,
        "ttfb_cold_iter_s": ep[0]["ttfb_s"] if ep else None,
        "ttfb_warm_s": _median([e["ttfb_s"] for e in ep[1:]]),
        "cpu_s_per_1k": cpu / steady_rows * 1000 if cpu is not None and steady_rows else None,
        "peak_pss_mb": cell.get("peak_pss_mb"),
        "peak_whole_mb": cell.get("peak_whole_mb"),
        # raying's own account (pipe.stats()["memory"]): its read workers' largest own memory
        "read_worker_mb_max": ((cell.get("extra") or {}).get("memory") or {}).get(
            "read_worker_mb_max"),
        "epoch_s": [round(e["end_s"] - e["request_s"], 4) for e in ep],
    }
    return out


_MEDIAN_KEYS = ("steady_img_s", "cold_img_s", "gb_s", "setup_s", "ttfb_cold_s",
                "ttfb_cold_iter_s", "ttfb_warm_s", "cpu_s_per_1k", "peak_pss_mb", "ray_start_s",
                "startup_pss_mb", "peak_whole_mb", "startup_whole_mb", "beyond_start_mb",
                "job_1_s", "job_last_s", "read_worker_mb_max")


def combine(runs: list[dict[str, Any]], workloads: dict[str, dict[str, Any]],
            epochs: int) -> list[dict[str, Any]]:
    """One row per (workload, peer, batch size, mode): medians over rounds, then ratios."""
    groups: dict[tuple[str, str, int, str], list[dict[str, Any]]] = {}
    for run in runs:
        for cell in run["cells"]:
            key = (cell["workload"], run["peer"], int(cell["batch_size"]), cell["mode"])
            m = cell_metrics(cell, workloads[cell["workload"]], epochs)
            m["ray_start_s"] = run.get("start", {}).get("ray_start_s")
            m["startup_pss_mb"] = run.get("startup_pss_mb")
            m["startup_whole_mb"] = run.get("startup_whole_mb")
            m["beyond_start_mb"] = (m["peak_whole_mb"] - m["startup_whole_mb"]
                                    if m["peak_whole_mb"] is not None
                                    and m["startup_whole_mb"] is not None else None)
            m["job_1_s"] = m["job_s"][0] if m["job_s"] else None
            m["job_last_s"] = m["job_s"][-1] if m["job_s"] else None
            m["round"] = run["round"]
            groups.setdefault(key, []).append(m)
    rows = []
    for (wl, peer, batch, mode), ms in groups.items():
        row: dict[str, Any] = {"workload": wl, "peer": peer, "batch_size": batch, "mode": mode,
                               "rounds": len(ms), "rows_ok": all(m["rows_ok"] for m in ms),
                               "rows_per_epoch": [m["rows_per_epoch"] for m in ms],
                               "expected_rows": ms[0]["expected_rows"],
                               "problems": [p for m in ms for p in m["problems"]][:5],
                               "round_ids": [m["round"] for m in ms]}
        for k in _MEDIAN_KEYS:
            row[k] = _median([m[k] for m in ms])
            row[k + "_rounds"] = [m[k] for m in ms]
        walls = [m["job_s"] for m in ms if m["job_s"]]
        row["job_s"] = [_median([w[e] for w in walls if len(w) > e])
                        for e in range(max((len(w) for w in walls), default=0))]
        rows.append(row)
    _ratios(rows)
    order = {w: i for i, w in enumerate(sorted(workloads))}
    peers = ("L", "L-crop", "pyarrow", "torch", "tf", "tf-cache", "raydata", "raying", "raying-cache",
             "raying-cache-eager", "raying-train", "raydata-train")
    modes = ("iterate", "sleep", "compute")
    rows.sort(key=lambda r: (order.get(r["workload"], 99), r["batch_size"],
                             modes.index(r["mode"]) if r["mode"] in modes else 9,
                             peers.index(r["peer"]) if r["peer"] in peers else 9))
    return rows


def _find(rows: list[dict[str, Any]], wl: str, peer: str, batch: int, mode: str):
    for r in rows:
        if (r["workload"], r["peer"], r["batch_size"], r["mode"]) == (wl, peer, batch, mode):
            return r
    return None


RAYING_PATHS = ("raying", "raying-train")


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _paired_ratio(row: dict[str, Any], base: dict[str, Any], key: str = "steady_img_s"
                  ) -> float | None:
    """Median over rounds of row's ``key`` over base's in the same round: W5 and W1 run back
    to back in one process, a peer's cells and its cache row's back to back in one round, so
    each round's pair shares the machine's state of the moment, which the ratio of the two
    medians (rounds apart) does not."""
    ratios = _round_ratios(row, base, key)
    return _median(ratios) if ratios else _ratio(row.get(key), base.get(key))


def _round_ratios(row: dict[str, Any], base: dict[str, Any], key: str) -> list[float]:
    """Row's ``key`` over base's, for each round both measured."""
    mine = dict(zip(row.get("round_ids", []), row.get(f"{key}_rounds", []), strict=True))
    theirs = dict(zip(base.get("round_ids", []), base.get(f"{key}_rounds", []), strict=True))
    return [mine[k] / theirs[k] for k in mine if mine[k] and theirs.get(k)]


def _paired_detail(row: dict[str, Any], base: dict[str, Any], key: str) -> str:
    """How a paired target was taken: the rounds paired, and the ratio of the medians."""
    n = len(_round_ratios(row, base, key))
    medians = _ratio(row.get(key), base.get(key))
    parts = [f"{n} round{'s' if n != 1 else ''} paired" if n else "no round paired"]
    if medians is not None:
        parts.append(f"ratio of medians {medians:.3f}")
    return "; ".join(parts)


def _ratios(rows: list[dict[str, Any]]) -> None:
    for r in rows:
        wl, batch, mode = r["workload"], r["batch_size"], r["mode"]
        ref_wl, ref_peer = ("W1", "L") if wl == "W5" else (wl, "pyarrow" if wl == "W4" else "L")
        ref = _find(rows, ref_wl, ref_peer, batch, "iterate")
        key = "gb_s" if wl == "W4" else "steady_img_s"
        r["reference"] = f"{ref_wl}/{ref_peer}" if ref else None
        r["ratio_to_L"] = _ratio(r[key], ref[key]) if ref else None
        crop = _find(rows, ref_wl, "L-crop", batch, "iterate")
        r["ratio_to_L_crop"] = _ratio(r["steady_img_s"], crop["steady_img_s"]) if crop else None
        # raying's two paths are one loader: each is held against the other peers only; a
        # cache row does less work and is nobody's best peer.
        own = RAYING_PATHS if r["peer"] in RAYING_PATHS else (r["peer"],)
        others = [o for o in rows if o["workload"] == wl and o["batch_size"] == batch
                  and o["mode"] == mode and o["peer"] not in REFERENCE_PEERS
                  and o["peer"] not in CACHE_PEERS and o["peer"] not in own
                  and o["steady_img_s"]]
        best = max(others, key=lambda o: o["steady_img_s"], default=None)
        r["best_peer"] = best["peer"] if best else None
        r["ratio_to_best_peer"] = _ratio(r["steady_img_s"], best["steady_img_s"]) if best else None
        cold = [o for o in others if o.get("cold_img_s")]
        best_cold = max(cold, key=lambda o: o["cold_img_s"], default=None)
        r["best_cold_peer"] = best_cold["peer"] if best_cold else None
        r["cold_ratio_to_best_peer"] = (_ratio(r.get("cold_img_s"), best_cold["cold_img_s"])
                                        if best_cold else None)
        if wl == "W5":
            uni = _find(rows, "W1", r["peer"], batch, mode)
            r["ratio_to_uniform"] = _paired_ratio(r, uni) if uni else None
            r["ratio_of_medians_to_uniform"] = (_ratio(r["steady_img_s"], uni["steady_img_s"])
                                                if uni else None)


def targets(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The speed targets for raying, in the iterate mode at every batch size."""
    out = []

    def add(name: str, value: float | None, limit: float | None, *, most: bool = False,
            detail: str = "", reachable: bool | None = None) -> None:
        ok = None
        if value is not None and limit is not None:
            ok = value <= limit if most else value >= limit
        out.append({"target": name, "value": value, "threshold": limit,
                    "kind": "at most" if most else "at least", "pass": ok, "detail": detail,
                    "reachable": reachable})

    def ceiling(wl: str, b: int, base_rate: float) -> tuple[str, bool | None]:
        """What a ratio target against ``base_rate`` asks in img/s, beside L-crop's steady
        rate (the crop-window kernel alone on every core: no loader reaches above it)."""
        lc = _find(rows, wl, "L-crop", b, "iterate")
        need = TARGET_VS_BEST_OF_TORCH_TF * base_rate
        if lc is None or not lc["steady_img_s"]:
            return "", None
        return (f"; needs {need:,.0f} img/s, L-crop {lc['steady_img_s']:,.0f}",
                need <= lc["steady_img_s"])

    batches = sorted({r["batch_size"] for r in rows})
    for b in batches:
        for wl in ("W1", "W2", "W3", "W6", "W7"):
            me = _find(rows, wl, "raying", b, "iterate")
            if me is None:
                continue
            base = [_find(rows, wl, p, b, "iterate") for p in ("torch", "tf")]
            base = [x for x in base if x and x["steady_img_s"]]
            if base:
                best = max(base, key=lambda x: x["steady_img_s"])
                note, reach = ceiling(wl, b, best["steady_img_s"])
                add(f"{wl} b{b}: raying steady / best of torch, tf",
                    _ratio(me["steady_img_s"], best["steady_img_s"]),
                    TARGET_VS_BEST_OF_TORCH_TF, detail=f"best = {best['peer']}{note}",
                    reachable=reach)
                cold = [x for x in base if x.get("cold_img_s")]
                if cold and me.get("cold_img_s"):
                    bc = max(cold, key=lambda x: x["cold_img_s"])
                    note, reach = ceiling(wl, b, bc["cold_img_s"])
                    add(f"{wl} b{b}: raying cold epoch 0 / best of torch, tf",
                        _ratio(me["cold_img_s"], bc["cold_img_s"]), TARGET_VS_BEST_OF_TORCH_TF,
                        detail=f"best = {bc['peer']}{note}", reachable=reach)
            add(f"{wl} b{b}: raying steady / L", me.get("ratio_to_L"), TARGET_VS_LIMIT)
            add(f"{wl} b{b}: raying cold ttfb (s)", me.get("ttfb_cold_s"), TARGET_COLD_TTFB_S,
                most=True)
            train = _find(rows, wl, "raying-train", b, "iterate")
            if train is not None:
                # Paired by round: raying's two paths run back to back in every round.
                add(f"{wl} b{b}: Ray Train path steady / raying iterator (paired by round)",
                    _paired_ratio(train, me), TARGET_TRAIN_VS_ITERATOR,
                    detail=_paired_detail(train, me, "steady_img_s"))
                rd = _find(rows, wl, "raydata-train", b, "iterate")
                if rd is not None:
                    add(f"{wl} b{b}: Ray Train path steady / Ray Data through Train",
                        _ratio(train["steady_img_s"], rd["steady_img_s"]),
                        TARGET_TRAIN_VS_RAYDATA_TRAIN)
            cache = _find(rows, wl, "raying-cache", b, "iterate")
            if cache is not None:
                # Paired by round: the two cells run back to back, and the machine's
                # speed moves between rounds by more than the 5 % this measures.
                add(f"{wl} b{b}: epoch 0 with the decoded cache / without (paired by round)",
                    _paired_ratio(cache, me, "cold_img_s"), TARGET_CACHE_COLD_VS_OFF,
                    detail=_paired_detail(cache, me, "cold_img_s"))
        me = _find(rows, "W4", "raying", b, "iterate")
        if me is not None:
            add(f"W4 b{b}: raying GB/s / pyarrow GB/s", me.get("ratio_to_L"),
                TARGET_W4_VS_PYARROW)
        me = _find(rows, "W5", "raying", b, "iterate")
        if me is not None:
            add(f"W5 b{b}: prioritized / uniform", me.get("ratio_to_uniform"),
                TARGET_W5_VS_UNIFORM)
        for wl in ("W1", "W2", "W3", "W4", "W5", "W6", "W7"):
            me = _find(rows, wl, "raying", b, "iterate")
            if me is None:
                continue
            add(f"{wl} b{b}: raying warm ttfb (s)", me["ttfb_warm_s"], TARGET_WARM_TTFB_S,
                most=True)
            torch = _find(rows, wl, "torch", b, "iterate")
            if torch is not None:
                add(f"{wl} b{b}: raying CPU-s/1k / torch", _ratio(me["cpu_s_per_1k"],
                    torch["cpu_s_per_1k"]), 1.0, most=True)
                add(f"{wl} b{b}: raying whole memory beyond Ray's floor / torch whole",
                    _ratio(me.get("beyond_start_mb"), torch.get("peak_whole_mb")),
                    TARGET_MEMORY_VS_TORCH, most=True,
                    detail="tree PSS (anon+file) + /dev/shm growth")
    return out
