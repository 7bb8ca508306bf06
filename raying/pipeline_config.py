"""Setting up a Pipeline: its configuration, and the local Ray raying starts when none is up."""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any

import numpy as np

from raying.config import (
    DEFAULT_BLOCK_ROWS,
    DEFAULT_MAX_IMAGE_PIXELS,
    DEFAULT_OBJECT_STORE_MB_PER_CPU,
    DEFAULT_OBJECT_STORE_MIN_MB,
)
from raying.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class PipelineConfig:
    """Knobs of the read path; the defaults are what `raying bench` measures.

    Args:
        block_rows: images per read task (~100 ms of decode work at 256 px).
        window: read tasks in flight; None = ``DEFAULT_INFLIGHT_TASKS_PER_CPU`` x cluster CPUs.
        keep_warm: start the next epoch's reads while the current one drains.
        task_num_cpus: CPUs each read task reserves.
        spread: spread read tasks over nodes (``SPREAD``) instead of packing them.
        name: names the pipeline's actors (priority store); default a fresh id.
        max_image_pixels: images claiming more pixels are set aside as decompression bombs.
        decoded_cache: keep decoded pixels in the node's memory tier across epochs:
            ``"auto"`` (on when the decoded dataset fits in a quarter of free memory),
            ``"off"``, or a budget in bytes. See :mod:`raying.io.decoded`.
        ray_remote_args: extra Ray options of the read tasks, fast path and ``dataset()``
            alike, e.g. ``{"resources": {"ingest": 0.01}}`` to keep decode on ingest nodes.
        io: read planning and the tiered cache (issue 5): a ``raying.io.options.IOConfig`` or
            a dict of its fields; None reads every file directly (see docs/io.md).
    """

    block_rows: int = DEFAULT_BLOCK_ROWS
    window: int | None = None
    keep_warm: bool = True
    task_num_cpus: float = 1.0
    spread: bool = False
    name: str | None = None
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS
    ray_remote_args: dict[str, Any] | None = None
    decoded_cache: Any = "auto"
    io: Any = None  # issue 5: IOConfig | dict | None, passed to ReadSpec

    def __post_init__(self) -> None:
        def whole(v: Any) -> bool:
            return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))

        if not whole(self.block_rows) or self.block_rows < 1:
            msg = f"PipelineConfig(block_rows=...) must be an integer >= 1, got {self.block_rows!r}"
            raise ConfigError(msg)
        if self.window is not None and (not whole(self.window) or self.window < 1):
            msg = f"PipelineConfig(window=...) must be an integer >= 1 or None, got {self.window!r}"
            raise ConfigError(msg)
        for name in ("keep_warm", "spread"):
            if not isinstance(getattr(self, name), (bool, np.bool_)):
                msg = f"PipelineConfig({name}=...) must be True or False, got {getattr(self, name)!r}"
                raise ConfigError(msg)
        cpus = self.task_num_cpus
        if isinstance(cpus, bool) or not isinstance(cpus, (int, float)) or not cpus > 0:
            msg = f"PipelineConfig(task_num_cpus=...) must be a number > 0, got {cpus!r}"
            raise ConfigError(msg)


def default_object_store_bytes(num_cpus: int | None = None) -> int | None:
    """Object store size raying gives a local Ray it starts (None: Ray's own default).

    ``RAYING_OBJECT_STORE_MB`` sets it (0: Ray's default); otherwise
    ``DEFAULT_OBJECT_STORE_MB_PER_CPU`` per CPU, at least ``DEFAULT_OBJECT_STORE_MIN_MB``, at
    most 30% of the node's memory (Ray's default). Read tasks keep about
    ``2 x CPUs`` blocks of ~40 MB in flight, so this leaves them several times what they use.
    """
    raw = os.environ.get("RAYING_OBJECT_STORE_MB")
    if raw is not None and raw.strip():
        try:
            mb = int(raw)
        except ValueError:
            msg = f"RAYING_OBJECT_STORE_MB must be a whole number of MB (0: Ray's default), got {raw!r}"
            raise ConfigError(msg) from None
        return mb * 2**20 if mb > 0 else None
    cpus = num_cpus or len(os.sched_getaffinity(0))
    want = max(DEFAULT_OBJECT_STORE_MIN_MB, DEFAULT_OBJECT_STORE_MB_PER_CPU * cpus) * 2**20
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
