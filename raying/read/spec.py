"""ReadSpec: what every read task of a pipeline needs besides its unit; small and picklable."""

from __future__ import annotations

import dataclasses
from typing import Any

from raying.options import (
    DEFAULT_DECODED_CACHE_FILL_SHARE,
    DEFAULT_MAX_IMAGE_PIXELS,
    IOConfig,
    Settings,
    StorageOptions,
)
from raying.read.stages import StageChain


@dataclasses.dataclass(frozen=True)
class ReadSpec:
    """What every read task of a pipeline needs besides its unit; small and picklable."""

    root: str
    storage: StorageOptions
    fmt: str
    files: tuple[str, ...]
    image_column: str | None
    decoded: tuple[int, int, int] | None
    transform: Any
    seed: int
    on_error: str = "skip"
    max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS
    io: Any = None  # a raying.options.IOConfig; None reads every file directly
    # Bytes of the node's memory tier for decoded pixels (0 = off; see raying.read.decoded_cache).
    decoded_cache_bytes: int = 0
    # The pipeline's directory name under each node's decoded-cache root, whether the budget
    # was "auto" (each node then caps it at its own share), and the owner its nodes record.
    decoded_cache_name: str = ""
    decoded_cache_auto: bool = False
    decoded_cache_owner: str = ""
    # Share of the ids the cache admits (a fixed subset when the decoded set exceeds it).
    decoded_cache_admit: float = 1.0
    # Share of a read process's time that filling the cache may add (None: no bound).
    decoded_cache_fill: float | None = DEFAULT_DECODED_CACHE_FILL_SHARE
    cache_namespace: str = ""
    # The driver's settings (the RAYING_* environment as the Pipeline read it); read tasks
    # make them theirs before they read.
    settings: Settings = dataclasses.field(default_factory=Settings)
    # Extra Parquet columns carried into every block: (name, description) pairs as
    # raying.dataset.columns.describe gives them (recorded by Manifest.scan(columns=...)).
    columns: tuple[tuple[str, Any], ...] = ()
    # Parquet: each file's size and modification time (whole seconds, -1 unknown) when it
    # was scanned (empty: not known), which a read checks.
    file_sizes: tuple[int, ...] = ()
    file_mtimes: tuple[int, ...] = ()
    # The machine that scanned a local dataset (its files' times are that machine's copy's).
    scanned_on: str = ""
    # User stages (raying.read.stages.UserStage), run in order after the transform.
    stages: tuple[Any, ...] = ()

    @property
    def dataset_key(self) -> str:
        """The dataset's identity in cache keys: the manifest's fingerprint (its URI, format and
        every file's path and size, so a dataset rewritten in place is another dataset) when a
        Pipeline set ``cache_namespace``, else its URI; with the S3 endpoint, if any (the same
        bucket and prefix on two endpoints are two datasets)."""
        return self.cache_namespace or dataset_key(self.root, self.storage)

    @classmethod
    def of(cls, manifest: Any, transform: Any, seed: int, on_error: str, *,
           max_pixels: int | None = None, io: Any = None,
           settings: Settings | None = None, stages: tuple[Any, ...] = ()) -> ReadSpec:
        """The spec of ``manifest`` read through ``transform`` then ``stages``; ``settings``
        default to the process's, and ``max_pixels`` to theirs. The manifest's extra columns
        (``Manifest.scan(columns=...)``) are read too."""
        from raying.options import settings as current

        settings = settings if settings is not None else current()
        if max_pixels is None:
            max_pixels = settings.max_image_pixels
        from raying.storage.spec import travelling_options

        decoded = manifest.meta.get("decoded")
        storage = travelling_options(manifest.root, manifest.storage)
        return cls(root=manifest.root, storage=storage, fmt=manifest.format,
                   files=tuple(manifest.files), image_column=manifest.meta.get("image_column"),
                   decoded=tuple(decoded) if decoded else None, transform=transform,
                   seed=int(seed), on_error=on_error, max_pixels=int(max_pixels),
                   io=IOConfig.coerce(io), settings=settings,
                   columns=tuple((name, dict(desc)) for name, desc in
                                 (manifest.meta.get("columns") or {}).items()),
                   file_sizes=tuple(int(x) for x in manifest.meta.get("file_sizes") or ()),
                   file_mtimes=tuple(int(x) for x in manifest.meta.get("file_mtimes") or ()),
                   scanned_on=str(manifest.meta.get("scanned_on") or ""),
                   stages=StageChain(stages))


def dataset_key(root: str, storage: StorageOptions | None) -> str:
    """See :attr:`ReadSpec.dataset_key`."""
    endpoint = storage.endpoint_url if storage is not None else None
    return f"{root}@{endpoint}" if endpoint else root
