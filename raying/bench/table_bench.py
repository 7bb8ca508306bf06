"""Throughput of the priority table and the priority store: `python -m raying.bench.table_bench`."""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from raying.sampling.table import PriorityTable

DEFAULT_BENCH_ROWS = 1_000_000
DEFAULT_BENCH_BATCHES = (4096, 16384, 65536)
DEFAULT_BENCH_SECONDS = 1.0


def _rate(step: Callable[[], int], seconds: float) -> float:
    """Items per second of ``step`` (which returns its item count), run for ``seconds``."""
    step()  # warm up: first-touch page faults, lazily built caches
    done, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        done += step()
    return done / (time.perf_counter() - start)


def bench_table(n: int = DEFAULT_BENCH_ROWS, batches: tuple[int, ...] = DEFAULT_BENCH_BATCHES,
                seconds: float = DEFAULT_BENCH_SECONDS, seed: int = 0) -> list[dict[str, Any]]:
    """Updates/s and samples/s (i.i.d. and systematic) of one table at ``n`` rows.

    The table uses ``alpha=0.6`` and ``uniform_mix=0.1`` (the mixture descent, the slower path),
    updates are random ids with log-normal priorities, pre-generated so the rates measure the
    table alone.

    Returns:
        One row per batch size: ``batch``, ``updates_per_s``, ``iid_samples_per_s``,
        ``systematic_samples_per_s``.
    """
    rng = np.random.default_rng(seed)
    rows = []
    for batch in batches:
        table = PriorityTable(n, alpha=0.6, uniform_mix=0.1, seed=seed)
        ids = rng.integers(0, n, (16, batch))
        values = rng.lognormal(0.0, 2.0, (16, batch))
        counter = iter(range(1 << 62))

        def update(batch=batch, table=table, ids=ids, values=values, counter=counter) -> int:
            i = next(counter) % 16
            table.update(ids[i], values[i])
            return batch

        def iid(table=table, batch=batch) -> int:
            return table.sample(batch)[0].size

        def systematic(table=table, batch=batch) -> int:
            return table.sample(batch, systematic=True)[0].size

        row = {"batch": batch, "updates_per_s": _rate(update, seconds),
               "iid_samples_per_s": _rate(iid, seconds),
               "systematic_samples_per_s": _rate(systematic, seconds)}
        rows.append(row)
    return rows


def bench_store(n: int = DEFAULT_BENCH_ROWS, batches: tuple[int, ...] = DEFAULT_BENCH_BATCHES,
                seconds: float = DEFAULT_BENCH_SECONDS, shard_rows: int | None = None,
                ) -> list[dict[str, Any]]:
    """Planned ids/s from the store actor, alone and while a reporter streams updates.

    Starts a local Ray (2 CPUs) unless one is running. The "with updates" figure sends one
    ``update_async`` of 4096 ids before each plan, so the actor applies updates between plans.
    """
    import ray

    from raying.sampling import store

    started = not ray.is_initialized()
    if started:
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    config = {} if shard_rows is None else {"shard_rows": shard_rows}
    handle = store.create_store(f"bench-{time.time_ns()}", n, table={"alpha": 0.6,
                                "uniform_mix": 0.1}, config=config)
    rng = np.random.default_rng(1)
    upd_ids = rng.integers(0, n, (16, 4096))
    upd_values = rng.lognormal(0.0, 2.0, (16, 4096))
    rows = []
    try:
        for batch in batches:
            row: dict[str, Any] = {"batch": batch, "shards": len(handle.actors)}
            for systematic in (False, True):
                def plan(batch=batch, systematic=systematic) -> int:
                    return store.sample_plan(handle, batch, systematic=systematic).ids.size

                key = "systematic" if systematic else "iid"
                row[f"{key}_planned_ids_per_s"] = _rate(plan, seconds)
            counter = iter(range(1 << 62))

            def plan_with_update(b=batch, counter=counter) -> int:
                i = next(counter) % 16
                store.update_async(handle, upd_ids[i], upd_values[i])
                return store.sample_plan(handle, b).ids.size

            row["iid_planned_ids_per_s_with_updates"] = _rate(plan_with_update, seconds)
            rows.append(row)
        store.flush(handle)
        stats = store.stats(handle)
        rows.append({"updates_applied": stats["updates_applied"],
                     "coalesced": stats["coalesced"]})
    finally:
        store.kill_store(handle, snapshot=False)
        if started:
            ray.shutdown()
    return rows


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the benchmark and print its figures.

    Example:
        python -m raying.bench.table_bench --rows 1000000 --seconds 2 --json table_bench.json
    """
    parser = argparse.ArgumentParser(
        prog="python -m raying.bench.table_bench",
        description="Priority table and store throughput (updates/s, samples/s, planned ids/s).",
        epilog="example: python -m raying.bench.table_bench --rows 1000000 --seconds 2")
    parser.add_argument("--rows", type=int, default=DEFAULT_BENCH_ROWS)
    parser.add_argument("--batches", type=int, nargs="+", default=list(DEFAULT_BENCH_BATCHES))
    parser.add_argument("--seconds", type=float, default=DEFAULT_BENCH_SECONDS,
                        help="time per measurement")
    parser.add_argument("--no-store", action="store_true", help="skip the Ray actor figures")
    parser.add_argument("--shard-rows", type=int, default=None,
                        help="shard the store at this many rows (default: one actor)")
    parser.add_argument("--json", default=None, help="also write the figures to this file")
    args = parser.parse_args(argv)
    batches = tuple(args.batches)
    result: dict[str, Any] = {"rows": args.rows,
                              "table": bench_table(args.rows, batches, args.seconds)}
    print(f"PriorityTable, {args.rows:,} rows, alpha=0.6, uniform_mix=0.1")
    print(f"{'batch':>8} {'updates/s':>14} {'iid samples/s':>15} {'systematic/s':>14}")
    for row in result["table"]:
        print(f"{row['batch']:>8} {row['updates_per_s']:>14,.0f} "
              f"{row['iid_samples_per_s']:>15,.0f} {row['systematic_samples_per_s']:>14,.0f}")
    if not args.no_store:
        result["store"] = bench_store(args.rows, batches, args.seconds, args.shard_rows)
        print(f"\nPriority store actor, {args.rows:,} rows, "
              f"{result['store'][0]['shards']} shard(s): planned ids/s")
        print(f"{'batch':>8} {'iid':>14} {'systematic':>14} {'iid + updates':>15}")
        for row in result["store"][:-1]:
            print(f"{row['batch']:>8} {row['iid_planned_ids_per_s']:>14,.0f} "
                  f"{row['systematic_planned_ids_per_s']:>14,.0f} "
                  f"{row['iid_planned_ids_per_s_with_updates']:>15,.0f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()
