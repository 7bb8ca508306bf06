"""The Sampler protocol: what the Pipeline and the read tasks need of a sampler."""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from raying.sampling.plan import EpochPlan, ReadUnit


@runtime_checkable
class Sampler(Protocol):
    """Decides which ids every epoch reads, and in which order; learns from reported losses.

    A sampler makes an explicit plan per epoch: read units of ids grouped by where they live.
    A *lazy* sampler (prioritized) leaves each unit's ids undrawn until the unit is read, so
    losses reported earlier in the epoch shape its later reads; ``fill`` draws them, on the
    driver or inside a read task. Every unit carries each id's sampling probability and
    importance weight, which the batches pass on.

    Attributes:
        name: a short name (``"uniform"``, ``"prioritized"``), saved in states and stats.
        seed: the seed plans are derived from.
        lazy: units are drawn when read (the store must be up before the first read).
        uses_store: ``bind`` creates or finds a priority store (Ray must be up first).
        samples_per_epoch: draws per epoch, or None for one per id.
        handle: the priority store this sampler reads, or None.
        store_name: the store's actor name (``raying.report(..., store=...)``), or None.
    """

    @property
    def name(self) -> str: ...

    @property
    def seed(self) -> int: ...

    @property
    def lazy(self) -> bool: ...

    @property
    def uses_store(self) -> bool: ...

    @property
    def samples_per_epoch(self) -> int | None: ...

    @property
    def handle(self) -> Any: ...

    @property
    def store_name(self) -> str | None: ...

    def bind(self, manifest: Any, *, name: str) -> None:
        """Set up what the plans need (a priority store named after the pipeline)."""

    def plan(self, manifest: Any, epoch: int, *, block_rows: int) -> EpochPlan:
        """The read units of ``epoch``, about ``block_rows`` ids each."""

    def fill(self, unit: ReadUnit) -> ReadUnit:
        """The unit with its ids, probabilities and weights (drawn now for a lazy plan)."""

    def report(self, ids: Any, losses: Any) -> None:
        """Per-sample losses; never blocks the training step."""

    def set_aside(self, ids: Any) -> None:
        """Samples that could not be read: keep them from drawing further reads."""

    def flush(self) -> None:
        """Send buffered reports now."""

    def stats(self) -> dict[str, Any]:
        """Sampling health for ``pipe.stats()["sampling"]``; a ``per_epoch`` list of dicts
        with an ``epoch`` key is merged with the pipeline's own per-epoch figures."""

    def state_dict(self) -> dict[str, Any]:
        """What a resumed run needs to continue (priorities included)."""

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from :meth:`state_dict`."""

    def close(self, *, release_store: bool = True) -> None:
        """Flush; with ``release_store``, stop the store this sampler created."""
