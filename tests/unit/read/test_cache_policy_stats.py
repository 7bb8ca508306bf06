"""The priority tier's advantage over LRU, as a statistical claim (docs/io.md).

Seeded prioritized traces (raying.bench._io_data.make_trace: the sampler of the benchmark,
with simulated loss feedback) replayed through the real tiers at 10% capacity. For every
seed, a two-proportion z-test on hits / lookups must reject "priority is no better than
LRU" at z > 3, and the pooled ratio must exceed 1.3 (the benchmark measures 1.53-1.64x).
"""

from __future__ import annotations

import math

import numpy as np
import pyarrow.fs as pafs
import pytest

from raying.bench._io_data import make_trace
from raying.options import CacheConfig, IOConfig
from raying.read import fetch

N = 2000
SEEDS = (0, 1, 2)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("policy-files")
    rng = np.random.default_rng(7)
    paths, sizes = [], []
    for i in range(N):
        size = int(rng.integers(900, 1100))
        (root / f"{i:05d}.bin").write_bytes(rng.bytes(size))
        paths.append(str(root / f"{i:05d}.bin"))
        sizes.append(size)
    return np.array(paths, dtype=object), np.array(sizes)


def _hits(paths, sizes, seed: int, policy: str, where) -> tuple[int, int]:
    trace = make_trace(N, epochs=3, sigma=1.0, seed=seed, block_rows=64)
    io = IOConfig(cache=CacheConfig(memory_bytes=int(0.10 * sizes.sum()),
                                    memory_dir=str(where / f"{policy}-{seed}"), policy=policy,
                                    background_writes=False))
    hits = lookups = 0
    for unit in trace:
        _, account = fetch.fetch_files(pafs.LocalFileSystem(), list(paths[unit.ids]), io=io,
                                       scores=unit.probs, namespace="policy")
        hits += account["cache_hits_memory"]
        lookups += account["cache_lookups"]
    return hits, lookups


def test_priority_tier_beats_lru_with_a_significant_margin(files, tmp_path):
    paths, sizes = files
    pooled = {"priority": [0, 0], "lru": [0, 0]}
    for seed in SEEDS:
        (hp, np_), (hl, nl) = (_hits(paths, sizes, seed, "priority", tmp_path),
                               _hits(paths, sizes, seed, "lru", tmp_path))
        p1, p2 = hp / np_, hl / nl
        pool = (hp + hl) / (np_ + nl)
        z = (p1 - p2) / math.sqrt(pool * (1 - pool) * (1 / np_ + 1 / nl))
        assert z > 3, f"seed {seed}: priority {p1:.3f} vs LRU {p2:.3f}, z = {z:.2f}"
        pooled["priority"][0] += hp
        pooled["priority"][1] += np_
        pooled["lru"][0] += hl
        pooled["lru"][1] += nl
    ratio = (pooled["priority"][0] / pooled["priority"][1]) / (pooled["lru"][0]
                                                                / pooled["lru"][1])
    assert ratio > 1.3, ratio
