"""Ray set-up: the local Ray raying starts when none is up, with a bounded object store."""

from __future__ import annotations

import logging
import os

from raying.options import settings


def default_object_store_bytes(num_cpus: int | None = None) -> int | None:
    """Object store size raying gives a local Ray it starts (None: Ray's own default).

    ``Settings.object_store_mb`` (RAYING_OBJECT_STORE_MB) sets it (0: Ray's default);
    otherwise ``object_store_mb_per_cpu`` per CPU, at least ``object_store_min_mb``, at most
    30% of the node's memory (Ray's default). Read tasks keep about ``2 x CPUs`` blocks of
    ~40 MB in flight, so this leaves them several times what they use.
    """
    s = settings()
    if s.object_store_mb is not None:
        return s.object_store_mb * 2**20 if s.object_store_mb > 0 else None
    cpus = num_cpus or len(os.sched_getaffinity(0))
    want = max(s.object_store_min_mb, s.object_store_mb_per_cpu * cpus) * 2**20
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return int(min(want, 0.3 * total))


def ensure_ray() -> None:
    """Start a local Ray (or attach to RAY_ADDRESS) if this process has none yet.

    A local Ray started here gets :func:`default_object_store_bytes` of object store.
    """
    import ray

    if ray.is_initialized():
        return
    if os.environ.get("RAY_ADDRESS"):
        ray.init(logging_level=logging.WARNING)
    else:
        ray.init(address="local", include_dashboard=False, log_to_driver=True,
                 logging_level=logging.WARNING,
                 object_store_memory=default_object_store_bytes())
