"""Data of the I/O benchmark: the generated images, their Parquet copy, the sampled trace."""

from __future__ import annotations

import argparse
import dataclasses
import statistics
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from raying.options import DEFAULT_PLAN_CHUNK_IDS

BLOCK_ROWS = 256
ROW_GROUP_ROWS = 256
ROWS_PER_GROUP = 16


@dataclasses.dataclass
class TraceUnit:
    """One read unit of the trace: its epoch, drawn ids and their probabilities at draw time."""

    epoch: int
    ids: np.ndarray
    probs: np.ndarray


def make_trace(n: int, *, epochs: int, sigma: float, seed: int, block_rows: int = BLOCK_ROWS,
               starts: np.ndarray | None = None) -> list[TraceUnit]:
    """Prioritized read units with simulated loss feedback (see raying/bench/io_bench.py).

    With ``starts`` (first id of each Parquet row group) units are two-stage plans:
    ``ROWS_PER_GROUP`` rows from each row group drawn by its mass.
    """
    from raying.sampling.table import PriorityTable

    rng = np.random.default_rng(seed)
    difficulty = rng.lognormal(0.0, sigma, n)
    table = PriorityTable(n, alpha=1.0, uniform_mix=0.1, seed=seed)
    units = []
    for epoch in range(epochs):
        left = n
        while left > 0:
            k = min(block_rows, left)
            left -= k
            if starts is None:
                ids, probs = table.sample(DEFAULT_PLAN_CHUNK_IDS, systematic=True)
                pick = rng.permutation(len(ids))[:k]
                ids, probs = ids[pick], probs[pick]
            else:
                ids, probs = table.sample_in_groups(k, starts, ROWS_PER_GROUP)
                order = np.argsort(ids, kind="stable")
                ids, probs = ids[order], probs[order]
            units.append(TraceUnit(epoch, ids, probs))
            table.update(ids, difficulty[ids] * rng.lognormal(0.0, 0.2, k))
    return units


def write_parquet(paths: np.ndarray, labels: np.ndarray, dst: Path) -> Path:
    """The images as Parquet (raying pack's layout: id, label, image, path; 256-row groups)."""
    if (dst / ".complete").exists():
        return dst
    dst.mkdir(parents=True, exist_ok=True)
    shard = 1024
    for k, start in enumerate(range(0, len(paths), shard)):
        ids = np.arange(start, min(start + shard, len(paths)))
        table = pa.table({"id": pa.array(ids, pa.int64()),
                          "label": pa.array(labels[ids], pa.int64()),
                          "image": pa.array([Path(p).read_bytes() for p in paths[ids]],
                                            pa.binary()),
                          "path": pa.array([str(p) for p in paths[ids]])})
        pq.write_table(table, dst / f"part-{k:05d}.parquet", row_group_size=ROW_GROUP_ROWS,
                       compression="none", use_dictionary=["label"])
    (dst / ".complete").write_text("ok")
    return dst


def dataset(args: argparse.Namespace) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The generated image folder (cached): paths, sizes, labels in id order."""
    from raying.tools.datagen import make_image_folder

    root = Path(args.data) / f"images-{args.images}-{args.side}"
    if not (root / ".complete").exists():
        print(f"generating {args.images} images of {args.side}px in {root} ...")
        make_image_folder(root, n=args.images, classes=10, size=(args.side, args.side), seed=0)
        (root / ".complete").write_text("ok")
    files = sorted(p for p in root.rglob("*.jpg"))
    paths = np.array([str(p) for p in files], dtype=object)
    sizes = np.array([p.stat().st_size for p in files], dtype=np.int64)
    labels = np.array([int(p.parent.name.split("_")[1]) for p in files], dtype=np.int64)
    return paths, sizes, labels


def trace_rates(n: int, *, sigma: float, seed: int) -> np.ndarray:
    """The long-run draw rates of :func:`make_trace`'s samples: their fixed difficulty."""
    return np.random.default_rng(seed).lognormal(0.0, sigma, n)


def simulated_hit_ratio(trace: list[TraceUnit], sizes: np.ndarray, capacity: int,
                        policy: str, rates: np.ndarray | None = None) -> float:
    """Hit ratio of a byte-bounded cache replaying ``trace`` (distinct ids per unit, in order).

    ``policy="lru"`` mirrors the real LRU tier (admit every miss that fits, evict the least
    recently used), a check that the simulation counts as the cache does. ``policy="oracle"``
    is Belady's offline rule with bypass: it knows every future access, keeps what is used
    soonest and admits a miss only where it would evict nothing used sooner. With entries of
    different sizes this is the classic reference, not a proven optimum; no online policy
    (which cannot see the future) is expected to beat it. ``policy="ideal"`` is the best an
    online cache can do when it knows every sample's long-run draw rate (``rates``) from the
    start, as no real cache does: it admits a sample at its first read if it belongs to the
    set of highest rate per byte that fills the capacity, and never evicts.
    """
    import heapq
    from collections import OrderedDict

    seq = [int(i) for u in trace for i in dict.fromkeys(u.ids.tolist())]
    size = sizes.astype(np.int64) + 16  # the entry header, as the tiers count
    hits, used = 0, 0
    if policy == "lru":
        lru: OrderedDict[int, None] = OrderedDict()
        for i in seq:
            if i in lru:
                hits += 1
                lru.move_to_end(i)
            elif size[i] <= capacity:
                while used + size[i] > capacity:
                    used -= int(size[lru.popitem(last=False)[0]])
                lru[i] = None
                used += int(size[i])
        return hits / max(len(seq), 1)
    if policy == "ideal":
        if rates is None:
            msg = "policy='ideal' needs the samples' rates"
            raise ValueError(msg)
        keep = np.zeros(len(size), dtype=bool)
        room = capacity
        for i in np.argsort(-(rates / size), kind="stable"):
            if size[i] <= room:
                keep[i] = True
                room -= int(size[i])
        held_ids: set[int] = set()
        for i in seq:
            if i in held_ids:
                hits += 1
            elif keep[i]:
                held_ids.add(i)
        return hits / max(len(seq), 1)
    if policy == "rates":
        if rates is None:
            msg = "policy='rates' needs the samples' rates"
            raise ValueError(msg)
        value = rates / size
        kept: list[tuple[float, int]] = []  # heap of (value, id): the lowest on top
        inside: set[int] = set()
        for i in seq:
            if i in inside:
                hits += 1
                continue
            if size[i] > capacity:
                continue
            out: list[tuple[float, int]] = []
            freed = capacity - used
            while freed < size[i] and kept and kept[0][0] < value[i]:
                v = heapq.heappop(kept)
                out.append(v)
                freed += int(size[v[1]])
            if freed < size[i]:  # not worth its room: put the candidates back
                for v in out:
                    heapq.heappush(kept, v)
                continue
            for _, j in out:
                inside.discard(j)
                used -= int(size[j])
            heapq.heappush(kept, (float(value[i]), i))
            inside.add(i)
            used += int(size[i])
        return hits / max(len(seq), 1)
    if policy != "oracle":
        msg = f"policy must be 'lru', 'ideal', 'rates' or 'oracle', got {policy!r}"
        raise ValueError(msg)
    never = len(seq) + 1
    nxt = [never] * len(seq)
    last: dict[int, int] = {}
    for pos in range(len(seq) - 1, -1, -1):
        nxt[pos] = last.get(seq[pos], never)
        last[seq[pos]] = pos
    held: dict[int, int] = {}  # id -> its next use
    heap: list[tuple[int, int]] = []  # (-next use, id), stale entries skipped
    for pos, i in enumerate(seq):
        if i in held:
            hits += 1
        elif nxt[pos] == never or size[i] > capacity:
            continue
        else:
            need = used + int(size[i]) - capacity
            victims: list[int] = []
            freed = 0
            while freed < need and heap:
                neg, j = heapq.heappop(heap)
                if held.get(j) != -neg:
                    continue
                if -neg <= nxt[pos]:  # everything left is used before i: bypass i
                    heapq.heappush(heap, (neg, j))
                    break
                victims.append(j)
                freed += int(size[j])
            if freed < need:
                for j in victims:
                    heapq.heappush(heap, (-held[j], j))
                continue
            for j in victims:
                del held[j]
                used -= int(size[j])
            used += int(size[i])
        held[i] = nxt[pos]
        if nxt[pos] == never:
            del held[i]
            used -= int(size[i])
        else:
            heapq.heappush(heap, (-nxt[pos], i))
    return hits / max(len(seq), 1)


def bound_study(sizes: np.ndarray, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Part 4: what ranking by rate can reach over LRU, across difficulty spreads (simulated)."""
    total = int(sizes.sum())
    n = len(sizes)
    out = []
    for sigma in args.sigmas:
        hits: dict[tuple[float, str], list[float]] = {}
        for seed in range(args.seeds):
            trace = make_trace(n, epochs=args.epochs, sigma=sigma, seed=seed)
            rates = trace_rates(n, sigma=sigma, seed=seed)
            for capacity in (0.10, 0.15, 0.20):
                for policy in ("lru", "rates"):
                    hits.setdefault((capacity, policy), []).append(simulated_hit_ratio(
                        trace, sizes, int(capacity * total), policy, rates))
        row: dict[str, Any] = {"sigma": sigma, "seeds": args.seeds}
        for capacity in (0.10, 0.15, 0.20):
            lru = statistics.mean(hits[capacity, "lru"])
            best = statistics.mean(hits[capacity, "rates"])
            row[f"{capacity:.0%}"] = {"lru": round(lru, 4), "known_rates": round(best, 4),
                                      "ratio": round(best / lru, 2)}
        out.append(row)
        print(f"  sigma {sigma:g}: known rates / LRU at 10% x{row['10%']['ratio']}, "
              f"15% x{row['15%']['ratio']}, 20% x{row['20%']['ratio']}")
    return out
