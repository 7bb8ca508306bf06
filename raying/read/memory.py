"""Memory counted whole: the private and file-backed pages of processes, plus tmpfs.

A read worker's or a trainer's memory is more than its heap. Ray's object store and the
decoded-sample cache live in tmpfs (``/dev/shm``): their pages are memory, but a process only
holds the part it has mapped, and PSS splits that part between the processes mapping it. To
count every page once:

- per process, ``Pss_Anon + Pss_File`` from ``/proc/<pid>/smaps_rollup`` (its heap, stacks,
  code and mapped libraries, shared pages split between their users);
- plus the growth of the tmpfs's used bytes since a baseline (object store, cache files,
  torch's shared-memory tensors: mapped or not, each page once).

``Pss_Shmem`` (the mapped tmpfs pages) is left out of the per-process part, since the tmpfs
term counts those pages already. Linux only: elsewhere every reading is 0.
"""

from __future__ import annotations

import os

DEFAULT_TMPFS = "/dev/shm"
_FIELDS = (b"Pss_Anon:", b"Pss_File:", b"Pss_Shmem:")


def process_kib(pid: int | None = None) -> dict[str, int]:
    """``{"anon": KiB, "file": KiB, "shmem": KiB}`` of one process's PSS (0s if it is gone)."""
    out = {"anon": 0, "file": 0, "shmem": 0}
    try:
        with open(f"/proc/{pid or os.getpid()}/smaps_rollup", "rb") as fh:
            for line in fh:
                for key in _FIELDS:
                    if line.startswith(key):
                        out[key[4:-1].decode().lower()] = int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return out


def own_kib(pid: int | None = None) -> int:
    """A process's own memory in KiB: ``Pss_Anon + Pss_File`` (tmpfs pages excluded)."""
    k = process_kib(pid)
    return k["anon"] + k["file"]


# Frameworks that cost a read worker tens to hundreds of MB each. raying's read path imports
# none of them; a user stage may (``pipe.stats()["memory"]`` names them per worker).
FRAMEWORKS = ("torch", "torchvision", "tensorflow", "keras", "jax", "pandas", "matplotlib")


def loaded_frameworks() -> tuple[str, ...]:
    """The :data:`FRAMEWORKS` this process has imported."""
    import sys

    return tuple(name for name in FRAMEWORKS if name in sys.modules)


def tmpfs_used_bytes(path: str = DEFAULT_TMPFS) -> int:
    """Bytes in use in the tmpfs at ``path`` (0 if there is none)."""
    try:
        st = os.statvfs(path)
    except OSError:
        return 0
    return (st.f_blocks - st.f_bfree) * st.f_frsize


def dir_bytes(path: str) -> int:
    """Bytes of the files under ``path`` (0 if it is gone)."""
    total = 0
    for root, _, names in os.walk(path):
        for name in names:
            try:
                total += os.lstat(os.path.join(root, name)).st_blocks * 512
            except OSError:
                pass
    return total


class Footprint:
    """The whole memory of a set of processes against a tmpfs baseline taken at creation."""

    def __init__(self, tmpfs: str = DEFAULT_TMPFS) -> None:
        self.tmpfs = tmpfs
        self.tmpfs_base = tmpfs_used_bytes(tmpfs)

    def sample(self, pids: list[int]) -> dict[str, float]:
        """``own_mb`` (the processes' anon + file PSS), ``tmpfs_mb`` (growth since the
        baseline, never negative) and ``whole_mb``, their sum."""
        own = sum(own_kib(p) for p in pids) / 1024.0
        grown = max(0, tmpfs_used_bytes(self.tmpfs) - self.tmpfs_base) / (1024.0 * 1024.0)
        return {"own_mb": own, "tmpfs_mb": grown, "whole_mb": own + grown}
