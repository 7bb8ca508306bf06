"""What one read task reports about one block: rows in and out, skips, bytes, seconds, I/O."""

from __future__ import annotations

import dataclasses

# A sample set aside by a read: (id, path or location, reason, detail).
Skip = tuple[int, str, str, str]


@dataclasses.dataclass
class UnitAccount:
    """The account of one block of a read unit (a unit yields one block per ``block_rows``).

    Attributes:
        epoch: the unit's epoch.
        unit: the unit's index in its epoch's plan.
        rows_in: ids the block was asked to deliver.
        rows_out: rows it delivered (those that decoded, after any resume skip).
        skipped: the samples set aside, with their reasons.
        bytes_read: encoded bytes this block read from storage.
        read_s: seconds spent reading.
        decode_s: seconds spent decoding and augmenting.
        node: the Ray node that ran the read (None outside Ray).
        final: this is the unit's last block.
        io: ``io_*`` and ``cache_*`` counters of the planned reads and caches, summable.
        pid: the process that ran the read (0: not recorded).
        worker_kib: that process's own memory (PSS of its anonymous and file pages, see
            :mod:`raying.read.memory`) when it finished the unit; 0 on earlier blocks.
        frameworks: the heavy frameworks that process had imported by then (a user stage's
            ``import torch``, say; :data:`raying.read.memory.FRAMEWORKS`); () on earlier
            blocks.
    """

    epoch: int
    unit: int
    rows_in: int = 0
    rows_out: int = 0
    skipped: list[Skip] = dataclasses.field(default_factory=list)
    bytes_read: int = 0
    read_s: float = 0.0
    decode_s: float = 0.0
    node: str | None = None
    final: bool = True
    io: dict[str, int] = dataclasses.field(default_factory=dict)
    pid: int = 0
    worker_kib: int = 0
    frameworks: tuple[str, ...] = ()

    def merge(self, later: UnitAccount) -> UnitAccount:
        """One account for this block followed by ``later`` (a later block of the same unit):
        counts and seconds add up, skips concatenate, and ``final`` is the later block's."""
        io = dict(self.io)
        for key, value in later.io.items():
            io[key] = io.get(key, 0) + value
        return dataclasses.replace(
            self, rows_in=self.rows_in + later.rows_in, rows_out=self.rows_out + later.rows_out,
            skipped=[*self.skipped, *later.skipped], bytes_read=self.bytes_read + later.bytes_read,
            read_s=self.read_s + later.read_s, decode_s=self.decode_s + later.decode_s,
            final=later.final, io=io, pid=later.pid or self.pid,
            worker_kib=max(self.worker_kib, later.worker_kib),
            frameworks=tuple(sorted(set(self.frameworks) | set(later.frameworks))))


def add_counters(into: dict[str, int], more: dict[str, int]) -> dict[str, int]:
    """``into`` with ``more``'s counters added (in place; returned for chaining)."""
    for key, value in more.items():
        into[key] = into.get(key, 0) + value
    return into
