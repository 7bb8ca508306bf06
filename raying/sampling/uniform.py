"""The uniform sampler: a new locality-aware permutation of every id each epoch."""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import numpy as np

from raying.errors import ConfigError
from raying.options import settings
from raying.sampling.plan import (
    EpochPlan,
    ReadUnit,
    chunk_units,
    row_group_units,
    unit_rows_cap,
)


@dataclasses.dataclass(frozen=True)
class UniformSampler:
    """Every id exactly once per epoch, in a new order each epoch, reproducible from the seed.

    Image folders are read in a shuffled file order. Parquet keeps locality: row groups are
    shuffled, then rows are shuffled inside a window of ``window_row_groups`` row groups, so
    each row group is read once per epoch (read amplification 1.0), unless a window holds
    more than ~1/8 of the epoch (``plan.unit_rows_cap``; pyarrow and pandas write a file as
    one group of up to ~1 M rows): it is then dealt into parts of its shuffled rows, each a
    read unit, so that the epoch spreads over the cores and the Train shares.

    Args:
        seed: the seed; the order of epoch ``e`` depends only on (seed, e).
        shuffle: False reads in id order (evaluation).
        window_row_groups: Parquet row groups shuffled together in one read task.
    """

    seed: int = 0
    shuffle: bool = True
    window_row_groups: int = dataclasses.field(
        default_factory=lambda: settings().parquet_window_row_groups)

    name: ClassVar[str] = "uniform"
    lazy: ClassVar[bool] = False
    uses_store: ClassVar[bool] = False
    samples_per_epoch: ClassVar[int | None] = None  # one read of every id per epoch
    handle: ClassVar[Any] = None  # no priority store
    store_name: ClassVar[str | None] = None

    def __post_init__(self) -> None:
        if (isinstance(self.seed, bool) or not isinstance(self.seed, (int, np.integer))
                or self.seed < 0):
            msg = f"UniformSampler(seed=...) must be a non-negative int, got {self.seed!r}"
            raise ConfigError(msg)
        if self.window_row_groups < 1:
            msg = (f"UniformSampler(window_row_groups=...) must be >= 1, got "
                   f"{self.window_row_groups!r}")
            raise ConfigError(msg)

    def bind(self, manifest: Any, *, name: str) -> None:
        """Nothing to set up: a uniform plan needs no store."""

    def plan(self, manifest: Any, epoch: int, *, block_rows: int) -> EpochPlan:
        """The plan of ``epoch``: units of about ``block_rows`` ids each."""
        rng = np.random.default_rng([int(self.seed), int(epoch), 0x52415949])
        n = len(manifest)
        if manifest.format == "parquet":
            f, g, start, rows = manifest.row_group_table()
            order = rng.permutation(len(start)) if self.shuffle else np.arange(len(start))
            window = max(self.window_row_groups, _groups_for(rows, block_rows))
            units = row_group_units(epoch, f, g, start, rows, order, window,
                                    rng if self.shuffle else None,
                                    max_rows=unit_rows_cap(n, block_rows),
                                    block_rows=block_rows)
        else:
            ids = rng.permutation(n) if self.shuffle else np.arange(n, dtype=np.int64)
            units = chunk_units(epoch, ids.astype(np.int64), block_rows)
        for u in units:
            u.probs = np.full(u.num_rows, 1.0 / n)
            u.weights = np.ones(u.num_rows, dtype=np.float32)
        return EpochPlan(epoch=epoch, units=units, sampler=self.name)

    def fill(self, unit: ReadUnit) -> ReadUnit:
        """Uniform units are complete when planned."""
        return unit

    def report(self, ids: Any, losses: Any) -> None:
        """Losses do not change a uniform plan; they are checked as a prioritized
        sampler checks them (from their metadata: nothing is copied off a device) and dropped."""
        from raying.sampling.feedback import check_report

        check_report(ids, losses)

    def set_aside(self, ids: Any) -> None:
        """A uniform epoch reads every id once, bad ones included; they are reported."""

    def flush(self) -> None:
        """Nothing is buffered."""

    def close(self, *, release_store: bool = True) -> None:
        """Nothing to release."""

    def stats(self) -> dict[str, Any]:
        return {"sampler": self.name, "seed": self.seed}

    def state_dict(self) -> dict[str, Any]:
        return {"sampler": self.name, "seed": int(self.seed), "shuffle": bool(self.shuffle),
                "window_row_groups": int(self.window_row_groups)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("sampler") != self.name:
            msg = (f"state was saved by a {state.get('sampler')!r} sampler; this pipeline "
                   f"has UniformSampler(seed={self.seed}): its plan is another one, so the "
                   f"saved position would repeat or skip rows; build the pipeline with the "
                   f"saved sampler")
            raise ConfigError(msg)
        if state.get("seed") != self.seed:
            msg = (f"state was saved with UniformSampler(seed={state.get('seed')}) but this "
                   f"pipeline has seed={self.seed}; build the pipeline with the saved seed")
            raise ConfigError(msg)
        # Either setting makes another plan (a state saved by an older raying has neither;
        # a Pipeline of an image folder, whose plans do not depend on the window, leaves
        # the window out).
        saved = {"shuffle": state.get("shuffle", self.shuffle),
                 "window_row_groups": state.get("window_row_groups", self.window_row_groups)}
        for key, value in saved.items():
            if value != getattr(self, key):
                hint = (" (its default comes from RAYING_PARQUET_WINDOW_ROW_GROUPS)"
                        if key == "window_row_groups" else "")
                msg = (f"state was saved with UniformSampler({key}={value!r}) but this "
                       f"pipeline has {key}={getattr(self, key)!r}{hint}: its plan is another "
                       f"one, so the saved position would repeat or skip rows; build the "
                       f"pipeline with the saved {key}")
                raise ConfigError(msg)


def _groups_for(rows: np.ndarray, block_rows: int) -> int:
    """Row groups per window so a window holds at least ``block_rows`` rows."""
    typical = max(1, int(np.median(rows))) if len(rows) else 1
    return max(1, -(-block_rows // typical))
