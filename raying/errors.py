"""Exceptions raised by raying; each also subclasses the matching builtin."""

from __future__ import annotations


class RayingError(Exception):
    """Base class of every error raying raises on purpose."""


class ConfigError(RayingError, ValueError):
    """An argument or setting has a value raying cannot use."""


class DependencyError(RayingError, ImportError):
    """An optional package is missing; the message names what to install."""


class StorageError(RayingError, OSError):
    """A URI cannot be resolved, listed or read."""


class CredentialsError(StorageError, PermissionError):
    """The storage refused the request: credentials are missing or wrong."""


class SupersededError(RayingError, RuntimeError):
    """An iterator of a Pipeline was used after a newer iteration of it had started."""


class DataError(RayingError, ValueError):
    """The dataset itself is unusable: empty, corrupt, or with a bad column."""


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
