"""I/O scheduling benchmark: read planner and tiered cache vs direct reads, slow tier.

All in this process, on a simulated tier (``raying.storage.slow``; default 5 ms per request and
50 MB/s, shared by every thread):

1. **Images, prioritized, 3 epochs.** One trace of read units drawn from a ``PriorityTable``
   (alpha 1, uniform_mix 0.1, systematic plans of 4,096, as ``PrioritizedSampler``) while a
   simulated trainer reports each drawn sample's loss (a fixed difficulty, lognormal with
   ``--sigma``, times 20% noise): the first epoch starts uniform, later ones concentrate.
   Every configuration replays it with 2 units in flight (the read tasks a 2-CPU machine
   runs): ``direct`` is raying's read path without ``io`` (``storage.read_many``); the others
   go through ``raying.read.fetch.fetch_files`` with no cache, LRU or priority memory tiers,
   and memory + disk tiers (cold, then warm as a restarted job finds them). Figures: the
   read stage's samples/s (decode is the same work for all), requests, read amplification,
   hit ratios, and the floor a cold cache cannot beat (first touches / draws).
2. **Hit ratio, priority vs LRU,** at 10/15/20% capacity, ``--seeds`` traces, one unit at a
   time with synchronous admission (deterministic).
3. **Parquet read amplification** (bytes read / bytes delivered) of a uniform epoch and of
   prioritized two-stage plans, the reader's path against the planned one.
4. **Bound** (``--parts bound``, simulated only): over a sweep of difficulty spreads
   (``--sigmas``), the hit ratio of a cache told every sample's true draw rate (the best a
   policy that ranks by rate can do: with independent draws, keeping the highest rates is
   the optimal online rule) against LRU at 10/15/20%, on the same traces and sizes.

Example:
    python -m raying.bench.io_bench                 # ~10 minutes on 2 busy cores
    python -m raying.bench.io_bench --quick --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.fs as pafs

from raying.bench._io_data import (
    BLOCK_ROWS,
    TraceUnit,
    bound_study,
    dataset,
    make_trace,
    simulated_hit_ratio,
    trace_rates,
    write_parquet,
)
from raying.options import CacheConfig, IOConfig
from raying.read.cache.tiered import open_cache
from raying.read.fetch import fetch_files, summarize
from raying.read.planner import OpStats, Prefetcher, read_amplification
from raying.storage import files as _storage
from raying.storage import slow

# ImageNet-like files (~85 KB at 512 px): the slow tier, not this process's CPU, is the limit.
DEFAULT_IMAGES = 2000
DEFAULT_SIDE = 512
DEFAULT_EPOCHS = 3
DEFAULT_LATENCY_MS = 5.0
DEFAULT_BANDWIDTH_MB_S = 50.0
DEFAULT_CAPACITY = 0.15
DEFAULT_DISK_CAPACITY = (0.5, 1.0)
DEFAULT_ROUNDS = 3
DEFAULT_SIGMA = 1.0
DEFAULT_SEEDS = 5
INFLIGHT_UNITS = 2


def _drive(trace: list[Any], fetch: Callable[[Any], Any]) -> dict[str, Any]:
    """Replay ``trace`` with ``INFLIGHT_UNITS`` units in flight; samples/s overall and per epoch."""
    t0 = time.perf_counter()
    ends: dict[int, float] = {}
    with Prefetcher(trace, fetch, depth=INFLIGHT_UNITS - 1) as it:
        for unit, _ in it:
            ends[unit.epoch] = time.perf_counter()
    wall = time.perf_counter() - t0
    per_epoch, prev = [], t0
    for e in sorted(ends):
        rows = sum(len(u.ids) for u in trace if u.epoch == e)
        per_epoch.append(round(rows / (ends[e] - prev), 1))
        prev = ends[e]
    rows = sum(len(u.ids) for u in trace)
    return {"wall_s": round(wall, 3), "samples_per_s": round(rows / wall, 1),
            "samples_per_s_by_epoch": per_epoch}


def _image_run(name: str, paths: np.ndarray, sizes: np.ndarray, trace: list[TraceUnit],
               tier: tuple[float, float], io: IOConfig | None) -> dict[str, Any]:
    fs = slow.slow_filesystem(pafs.LocalFileSystem(), tier)
    totals: dict[str, int] = {}

    def fetch(unit: TraceUnit) -> None:
        wanted = [str(p) for p in paths[unit.ids]]
        if io is None:
            datas = _storage.read_many(fs, wanted)
        else:
            datas, account = fetch_files(fs, wanted, io=io, scores=unit.probs,
                                         namespace="bench")
            for k, v in account.items():
                totals[k] = totals.get(k, 0) + v
        bad = [d for d in datas if isinstance(d, BaseException)]
        if bad:
            raise bad[0]

    row = {"config": name, **_drive(trace, fetch)}
    counters = _counters(fs)
    delivered = int(sum(int(sizes[u.ids].sum()) for u in trace))
    row.update(requests=counters["requests"], bytes_read=counters["bytes_read"],
               read_amplification=round(read_amplification(counters["bytes_read"], delivered), 3))
    if io is not None and io.cache is not None:
        s = summarize(totals)
        row.update({k: round(s[k], 3) for k in ("cache_hit_ratio", "cache_hit_ratio_memory",
                                                 "cache_hit_ratio_disk")})
    return row


def _cache(policy: str, total: int, memory: float, disk: float, where: Path, tag: str, *,
           background: bool = True) -> CacheConfig:
    """Tiers of ``memory`` and ``disk`` shares of ``total`` bytes, in fresh folders."""
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    return CacheConfig(memory_bytes=int(memory * total), disk_bytes=int(disk * total),
                       memory_dir=f"{shm}/raying-io-bench-{os.getpid()}-{tag}",
                       disk_dir=str(where / f"disk-{tag}") if disk else None, policy=policy,
                       background_writes=background)


def images_study(paths: np.ndarray, sizes: np.ndarray, args: argparse.Namespace,
                 work: Path) -> list[dict[str, Any]]:
    """Part 1: every configuration on the same prioritized trace, rounds interleaved."""
    trace = make_trace(len(paths), epochs=args.epochs, sigma=args.sigma, seed=args.seed)
    tier = (args.latency_ms / 1000, args.bandwidth_mb_s * 1e6)
    total = int(sizes.sum())
    cap = f"{args.capacity:.0%}"
    configs: list[tuple[str, Callable[[str], IOConfig | None]]] = [
        ("direct (no io)", lambda tag: None),
        ("planner, no cache", lambda tag: IOConfig()),
        (f"planner + LRU {cap} mem",
         lambda tag: IOConfig(cache=_cache("lru", total, args.capacity, 0, work, tag))),
        (f"planner + priority {cap} mem",
         lambda tag: IOConfig(cache=_cache("priority", total, args.capacity, 0, work, tag))),
    ]
    def tiered(disk: float) -> Callable[[str], IOConfig | None]:
        return lambda tag: IOConfig(cache=_cache("priority", total, args.capacity, disk, work,
                                                 tag))

    for disk in args.disk:
        configs.append((f"planner + priority {cap} mem + {disk:.0%} disk", tiered(disk)))
    # A restarted job on the same node: the tiers of the run before are still there.
    warm = f"{configs[-1][0]}, warm (tiers of the run before)"
    configs.append((warm, tiered(args.disk[-1])))
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name, _ in configs}
    for r in range(args.rounds):
        print(f"  round {r + 1}/{args.rounds}")
        for k, (name, make) in enumerate(configs):
            warm_next = k + 1 < len(configs) and configs[k + 1][0] == warm
            io = make(f"r{r}c{k - 1}" if name == warm else f"r{r}c{k}")
            runs[name].append(_image_run(name, paths, sizes, trace, tier, io))
            _print_row(runs[name][-1])
            if io is not None and io.cache is not None:
                open_cache(io.cache, namespace="bench").flush()
                if not warm_next:
                    shutil.rmtree(io.cache.memory_dir, ignore_errors=True)
                    if io.cache.disk_dir:
                        shutil.rmtree(io.cache.disk_dir, ignore_errors=True)
    rows = [_median_row(runs[name]) for name, _ in configs]
    base = rows[0]["samples_per_s"]
    for row in rows:
        row["speedup_vs_direct"] = round(row["samples_per_s"] / base, 2)
    first = np.unique(np.concatenate([u.ids for u in trace]), return_index=False)
    floor = float(sizes[first].sum()) / float(sum(int(sizes[u.ids].sum()) for u in trace))
    rows.append({"config": "floor of a cold cache (first touches / draws, in bytes)",
                 "read_amplification": round(floor, 3)})
    print(f"  a cold cache cannot read less than the first touches: amplification >= "
          f"{floor:.2f}, speedup <= {1 / floor:.2f}x when bandwidth-bound")
    return rows


def _median_row(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Median of the timed figures over rounds; counts and ratios of the median round."""
    runs = sorted(runs, key=lambda r: r["samples_per_s"])
    row = dict(runs[len(runs) // 2])
    row["rounds_samples_per_s"] = [r["samples_per_s"] for r in runs]
    epochs = len(row["samples_per_s_by_epoch"])
    row["samples_per_s_by_epoch"] = [
        round(statistics.median(r["samples_per_s_by_epoch"][e] for r in runs), 1)
        for e in range(epochs)]
    return row


def hit_ratio_study(paths: np.ndarray, sizes: np.ndarray, args: argparse.Namespace,
                    work: Path) -> list[dict[str, Any]]:
    """Part 2: priority vs LRU hit ratio over seeded traces, one unit at a time."""
    fs = pafs.LocalFileSystem()
    total = int(sizes.sum())
    out = []
    for capacity in (0.10, 0.15, 0.20):
        ratios: dict[str, list[float]] = {"lru": [], "priority": []}
        for seed in range(args.seeds):
            trace = make_trace(len(paths), epochs=args.epochs, sigma=args.sigma, seed=seed)
            for policy in ("lru", "priority"):
                io = IOConfig(cache=_cache(policy, total, capacity, 0, work,
                                           f"hr-{policy}-{capacity}-{seed}", background=False))
                totals: dict[str, int] = {}
                for unit in trace:
                    _, account = fetch_files(fs, [str(p) for p in paths[unit.ids]], io=io,
                                             scores=unit.probs, namespace="hit-ratio")
                    for k, v in account.items():
                        totals[k] = totals.get(k, 0) + v
                ratios[policy].append(summarize(totals)["cache_hit_ratio"])
                shutil.rmtree(io.cache.memory_dir if io.cache else "", ignore_errors=True)
        row: dict[str, Any] = {"capacity": capacity, "seeds": args.seeds, "sigma": args.sigma}
        for policy in ("lru", "ideal", "rates", "oracle"):  # the same traces, simulated
            ratios[f"sim_{policy}"] = [
                simulated_hit_ratio(make_trace(len(paths), epochs=args.epochs, sigma=args.sigma,
                                               seed=seed), sizes, int(capacity * total), policy,
                                    trace_rates(len(paths), sigma=args.sigma, seed=seed))
                for seed in range(args.seeds)]
        for policy, values in ratios.items():
            row[f"{policy}_mean"] = round(statistics.mean(values), 4)
            row[policy] = [round(x, 4) for x in values]
        row["ratio"] = round(row["priority_mean"] / row["lru_mean"], 2)
        row["ratio_min_over_seeds"] = round(min(
            p / max(q, 1e-9) for p, q in zip(ratios["priority"], ratios["lru"], strict=True)), 2)
        out.append(row)
        print(f"  capacity {capacity:.0%}: hit ratio LRU {row['lru_mean']:.3f}, priority "
              f"{row['priority_mean']:.3f} -> x{row['ratio']} (worst seed x"
              f"{row['ratio_min_over_seeds']}); simulated: LRU {row['sim_lru_mean']:.3f}, "
              f"known-rates ideal {row['sim_ideal_mean']:.3f}, known rates at every moment "
              f"{row['sim_rates_mean']:.3f}, offline (Belady) "
              f"{row['sim_oracle_mean']:.3f}")
    return out


def parquet_study(root: Path, args: argparse.Namespace, work: Path) -> list[dict[str, Any]]:
    """Part 3: read amplification of uniform and prioritized Parquet epochs."""
    from raying.dataset.manifest import Manifest
    from raying.read.parquet import read_chunks, read_rows
    from raying.read.spec import ReadSpec
    from raying.sampling.uniform import UniformSampler

    m = Manifest.scan(str(root), format="parquet", label="label")
    spec = ReadSpec.of(m, None, 0, "skip")
    sizes = m.sizes
    f, g, starts, _ = m.row_group_table()
    tier = (args.latency_ms / 1000, args.bandwidth_mb_s * 1e6)
    files = [f"{str(root).rstrip('/')}/{rel}" for rel in m.files]
    uniform = UniformSampler(seed=args.seed).plan(m, 0, block_rows=BLOCK_ROWS).units
    prio = make_trace(len(m), epochs=1, sigma=args.sigma, seed=args.seed, starts=starts)
    rows = []
    cache = _cache("priority", int(sizes.sum()), args.capacity, 0, work, "pq",
                   background=False)
    for mode, units in (("uniform", uniform), ("prioritized", prio)):
        for path_name in ("reader (direct)", "planned") + (
                (f"planned + priority {args.capacity:.0%}",) if mode == "prioritized" else ()):
            fs = slow.slow_filesystem(pafs.LocalFileSystem(), tier)
            io = IOConfig(cache=cache if "priority" in path_name else None)

            def fetch(unit, fs=fs, path_name=path_name, io=io) -> None:
                ids = np.asarray(unit.ids)
                pos = np.searchsorted(starts, ids, side="right") - 1
                if path_name.startswith("reader"):
                    from raying.sampling.plan import ReadUnit

                    groups = np.unique(pos)
                    ru = ReadUnit(epoch=0, index=0, draw=len(ids), ids=ids,
                                  row_groups=np.stack([f[groups], g[groups], starts[groups]], 1))
                    read_rows(spec, fs, m.root, ru, ids)
                    return
                mass: dict[int, float] = {}
                for p, pr in zip(pos.tolist(), np.asarray(unit.probs).tolist(), strict=True):
                    mass[p] = mass.get(p, 0.0) + pr
                read_chunks(fs, [(files[f[p]], int(g[p])) for p in mass], "image", io=io,
                            scores=list(mass.values()), namespace="pq", stats=OpStats())

            res = _drive(units, fetch)
            c = _counters(fs)
            delivered = int(sum(int(sizes[np.asarray(u.ids)].sum()) for u in units))
            row = {"mode": mode, "path": path_name, **res, "requests": c["requests"],
                   "bytes_read": c["bytes_read"], "bytes_delivered": delivered,
                   "read_amplification": round(read_amplification(c["bytes_read"],
                                                                  delivered), 3)}
            rows.append(row)
            print(f"  {mode:<12} {path_name:<26} {row['samples_per_s']:>9,.0f} samples/s  "
                  f"{row['requests']:>6} requests  amplification {row['read_amplification']}")
    shutil.rmtree(cache.memory_dir, ignore_errors=True)
    return rows



def _counters(fs: pafs.FileSystem) -> dict[str, int]:
    counters = slow.io_counters(fs)
    return counters.snapshot() if counters is not None else {"requests": 0, "bytes_read": 0}


def _print_row(r: dict[str, Any]) -> None:
    hits = ""
    if "cache_hit_ratio" in r:
        hits = (f"  hits {r['cache_hit_ratio']:.2f} (mem {r['cache_hit_ratio_memory']:.2f}, "
                f"disk {r['cache_hit_ratio_disk']:.2f})")
    print(f"  {r['config']:<40} {r['samples_per_s']:>8,.0f} samples/s  by epoch "
          f"{r['samples_per_s_by_epoch']}  {r['requests']:>6} requests  "
          f"amplification {r['read_amplification']:.2f}{hits}")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the three parts and print (and optionally save) the figures."""
    p = argparse.ArgumentParser(prog="python -m raying.bench.io_bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    for flag, typ, default, help_ in (
            ("--images", int, DEFAULT_IMAGES, "images generated"),
            ("--side", int, DEFAULT_SIDE, "image side in pixels"),
            ("--epochs", int, DEFAULT_EPOCHS, "epochs of the trace"),
            ("--latency-ms", float, DEFAULT_LATENCY_MS, "slow tier: wait per request"),
            ("--bandwidth-mb-s", float, DEFAULT_BANDWIDTH_MB_S, "slow tier: bandwidth"),
            ("--capacity", float, DEFAULT_CAPACITY, "memory tier, share of the dataset"),
            ("--rounds", int, DEFAULT_ROUNDS, "interleaved rounds of part 1 (median)"),
            ("--sigma", float, DEFAULT_SIGMA, "spread (lognormal sigma) of difficulty"),
            ("--seed", int, 0, "seed of the part 1 and 3 traces"),
            ("--seeds", int, DEFAULT_SEEDS, "traces for the hit ratio (part 2)")):
        p.add_argument(flag, type=typ, default=default, help=help_)
    p.add_argument("--disk", type=float, nargs="+", default=list(DEFAULT_DISK_CAPACITY),
                   help="disk tier sizes as shares of the dataset (tiered configurations)")
    p.add_argument("--sigmas", type=float, nargs="+", default=[0.5, 0.75, 1.0, 1.5, 2.0, 2.5],
                   help="difficulty spreads of the bound sweep (part 4)")
    p.add_argument("--parts", default="images,hits,parquet",
                   help="comma-separated: images, hits, parquet, bound")
    p.add_argument("--data", default=os.path.join(tempfile.gettempdir(), "raying-io-bench"))
    p.add_argument("--quick", action="store_true", help="small sizes, checks that it runs")
    p.add_argument("--json", default=None, help="also write the figures to this file")
    args = p.parse_args(argv)
    if args.quick:
        args.images, args.side, args.seeds, args.rounds = 400, 64, 2, 1
    parts = set(args.parts.split(","))
    paths, sizes, labels = dataset(args)
    work = Path(tempfile.mkdtemp(prefix="raying-io-bench-"))
    result: dict[str, Any] = {
        "setup": {"images": len(paths), "mean_file_bytes": int(sizes.mean()),
                  "dataset_bytes": int(sizes.sum()), "epochs": args.epochs,
                  "tier": {"latency_ms": args.latency_ms, "bandwidth_mb_s": args.bandwidth_mb_s},
                  "sampler": "PriorityTable alpha=1 uniform_mix=0.1 systematic",
                  "difficulty": f"lognormal(0, {args.sigma})", "seed": args.seed,
                  "units_in_flight": INFLIGHT_UNITS, "block_rows": BLOCK_ROWS}}
    print(f"{len(paths)} images, mean {sizes.mean() / 1024:.1f} KiB, tier "
          f"{args.latency_ms:g} ms + {args.bandwidth_mb_s:g} MB/s, {args.epochs} epochs")
    try:
        if "images" in parts:
            print("1. images, prioritized sampling, read stage:")
            result["images"] = images_study(paths, sizes, args, work)
        if "hits" in parts:
            print(f"2. hit ratio, priority vs LRU ({args.seeds} seeds):")
            result["hit_ratio"] = hit_ratio_study(paths, sizes, args, work)
        if "parquet" in parts:
            print("3. Parquet read amplification (bytes read / bytes delivered):")
            root = write_parquet(paths, labels, Path(args.data) / f"parquet-{args.images}-"
                                 f"{args.side}")
            result["parquet"] = parquet_study(root, args, work)
        if "bound" in parts:
            print(f"4. bound: a cache told the true rates vs LRU ({args.seeds} seeds):")
            result["bound"] = bound_study(sizes, args)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":  # pragma: no cover
    main()
