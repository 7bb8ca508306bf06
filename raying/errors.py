"""Exceptions raised by raying; each also subclasses the matching builtin."""

from __future__ import annotations

from typing import Any


class RayingError(Exception):
    """Base class of every error raying raises on purpose."""


class ConfigError(RayingError, ValueError):
    """An argument or setting has a value raying cannot use."""


class DependencyError(RayingError, ImportError):
    """An optional package is missing; the message names what to install."""


class StorageError(RayingError, OSError):
    """A URI cannot be resolved, listed or read.

    ``outage`` is True when the storage itself could not be reached (a connection refused or
    timed out, a host that does not resolve, an HDFS NameNode that does not answer): a
    property of the storage at that moment, never of the file.
    """

    outage = False


class CredentialsError(StorageError, PermissionError):
    """The storage refused the request: credentials are missing or wrong."""


class RayConnectionError(RayingError, ConnectionError):
    """The Ray cluster ``RAY_ADDRESS`` names cannot be reached, or refused this driver."""


class SupersededError(RayingError, RuntimeError):
    """An iterator of a Pipeline was used after a newer iteration of it had started."""


class DataError(RayingError, ValueError):
    """The dataset itself is unusable: empty, corrupt, or with a bad column."""


class FileChangedError(DataError):
    """A dataset file is no longer the one the manifest was scanned from (its size or its
    modification time differs): its rows would come under other ids. Scan again."""


class DecodeError(DataError):
    """One sample could not be decoded.

    Attributes:
        reason: a short machine-readable reason, e.g. ``"truncated"`` or ``"not_an_image"``.
        path: where the sample lives, when known.
        sample_id: the manifest id, when known.
    """

    def __init__(self, reason: str, detail: str = "", *, path: str | None = None,
                 sample_id: int | None = None, root: str | None = None,
                 fix: str | None = None) -> None:
        self.reason = reason
        self.detail = detail
        self.path = path
        self.sample_id = sample_id
        self.root = root
        self.fix = fix
        full = f"{root.rstrip('/')}/{path}" if root and path else path
        where = f"{full}: " if full else ""
        ident = f" (id {sample_id})" if sample_id is not None else ""
        text = f"{where}{reason}{ident}"
        if detail:
            text += f": {detail}"
        if fix:
            text += f"; {fix}"
        super().__init__(text)

    def __reduce__(self):
        return (_rebuild_decode_error, (self.reason, self.detail, self.path, self.sample_id,
                                        self.root, self.fix))


def _rebuild_decode_error(reason, detail, path, sample_id, root=None, fix=None):
    return DecodeError(reason, detail, path=path, sample_id=sample_id, root=root, fix=fix)


# Ids a UserFunctionError names at most: a chunk's (see raying.read.stages), so the failing
# sample is among them.
IDS_SHOWN = 16


class UserFunctionError(RayingError, RuntimeError):
    """A function given to ``Pipeline.map_batches`` failed, or returned a batch raying cannot
    carry on.

    A bug in code is not bad data: ``on_error="skip"`` never sets it aside. The message names
    the function, the epoch and the ids of the rows it was called on (up to ``IDS_SHOWN``),
    and ends with the traceback of the
    user's code (kept as text, so it survives the trip from a Ray worker to the driver).

    Attributes:
        function: the function's qualified name.
        epoch: the epoch being read.
        ids: the sample ids of the call's rows (the first ``IDS_SHOWN``).
        rows: how many rows the call (or the block a check refused) had.
        traceback_text: the formatted traceback of the user's code ("" for a bad result).
    """

    def __init__(self, function: str, epoch: int, ids: Any, problem: str,
                 traceback_text: str = "", rows: int | None = None) -> None:
        self.function = function
        self.epoch = epoch
        self.rows = len(ids) if rows is None else int(rows)  # all of them, shown or not
        self.ids = [int(i) for i in ids[:IDS_SHOWN]]
        self.problem = problem
        self.traceback_text = traceback_text
        text = f"map_batches function {function} {problem} (epoch {epoch}, ids {self.ids}"
        text += f"... of {self.rows} rows)" if self.rows > len(self.ids) else ")"
        if traceback_text:
            text += f"\n\nTraceback of {function}:\n{traceback_text.rstrip()}"
        super().__init__(text)

    def __reduce__(self):
        return (UserFunctionError, (self.function, self.epoch, self.ids, self.problem,
                                    self.traceback_text, self.rows))


RAISE_FIX = ("replace or remove the sample (then Manifest.scan again), or build the Pipeline "
             "with on_error='skip' to set bad samples aside (listed in "
             "pipe.stats()['skipped'])")


def require(module: str, *, pip: str | None = None, purpose: str = ""):
    """Import ``module`` or raise a DependencyError that names the package to install."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as exc:
        package = pip or module
        why = f" {purpose}" if purpose else ""
        msg = f"raying needs the package '{package}'{why}; install it with: pip install {package}"
        raise DependencyError(msg) from exc
