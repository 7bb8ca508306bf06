"""Loss-driven sampling: the priority table (numpy) and the priority store (a Ray actor)."""

from raying.sampling.table import PriorityTable, TableConfig

__all__ = ["PriorityTable", "TableConfig"]

if __all__ != sorted(__all__):  # pragma: no cover - a guard for maintainers
    raise RuntimeError("raying.sampling.__all__ must stay sorted")
