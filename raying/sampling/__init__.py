"""Sampling: the plan of every epoch (read units of ids), the samplers that make it (uniform,
prioritized), the priority table (numpy sum tree) and its store (a Ray actor), and loss
feedback. Imports ``dataset``-free numpy code, ``storage`` (snapshots), ``errors`` and
``options``; Ray only in the store."""

from raying.sampling.table import PriorityTable, TableConfig

__all__ = ["PriorityTable", "TableConfig"]

if __all__ != sorted(__all__):  # pragma: no cover - a guard for maintainers
    raise RuntimeError("raying.sampling.__all__ must stay sorted")
