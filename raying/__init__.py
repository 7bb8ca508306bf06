"""raying: a Ray Data loader for deep-learning training that learns which samples matter."""

from typing import TYPE_CHECKING

# The public names load on first use (PEP 562): a Ray read worker imports ``raying.read.task``,
# which runs this file, and should pay only for the read path, not for the manifest scanner,
# the pipeline and the samplers (about 0.1 s and tens of MB per worker).
_PUBLIC = {
    "ConfigError": "raying.errors", "CredentialsError": "raying.errors",
    "DataError": "raying.errors", "DecodeError": "raying.errors",
    "FileChangedError": "raying.errors",
    "DependencyError": "raying.errors", "RayingError": "raying.errors",
    "StorageError": "raying.errors", "SupersededError": "raying.errors",
    "UserFunctionError": "raying.errors",
    "ImageTransform": "raying.image.transform",
    "InfoBatchSampler": "raying.sampling.infobatch",
    "Manifest": "raying.dataset.manifest",
    "Pipeline": "raying.loader.pipeline", "PipelineConfig": "raying.loader.pipeline",
    "PrioritizedSampler": "raying.sampling.prioritized",
    "PriorityTable": "raying.sampling.table",
    "StorageOptions": "raying.options",
    "UniformSampler": "raying.sampling.uniform",
    "WeightedSampler": "raying.sampling.weighted",
    "pack": "raying.engine.pack",
    "report": "raying.sampling.feedback",
}

if TYPE_CHECKING:  # pragma: no cover - for type checkers and editors
    from raying.dataset.manifest import Manifest
    from raying.engine.pack import pack
    from raying.errors import (
        ConfigError,
        CredentialsError,
        DataError,
        DecodeError,
        DependencyError,
        FileChangedError,
        RayingError,
        StorageError,
        SupersededError,
        UserFunctionError,
    )
    from raying.image.transform import ImageTransform
    from raying.loader.pipeline import Pipeline, PipelineConfig
    from raying.options import StorageOptions
    from raying.sampling.feedback import report
    from raying.sampling.infobatch import InfoBatchSampler
    from raying.sampling.prioritized import PrioritizedSampler
    from raying.sampling.table import PriorityTable
    from raying.sampling.uniform import UniformSampler
    from raying.sampling.weighted import WeightedSampler


def __getattr__(name: str):
    import importlib

    module = _PUBLIC.get(name)
    if module is None:
        try:  # a subpackage used as an attribute (``raying.train`` after ``import raying``)
            return importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"{__name__}.{name}":
                raise
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_PUBLIC))


__version__ = "0.1.0"

__all__ = [
    "ConfigError",
    "CredentialsError",
    "DataError",
    "DecodeError",
    "DependencyError",
    "FileChangedError",
    "ImageTransform",
    "InfoBatchSampler",
    "Manifest",
    "Pipeline",
    "PipelineConfig",
    "PrioritizedSampler",
    "PriorityTable",
    "RayingError",
    "StorageError",
    "StorageOptions",
    "SupersededError",
    "UniformSampler",
    "UserFunctionError",
    "WeightedSampler",
    "pack",
    "report",
]

if __all__ != sorted(__all__) or set(__all__) != set(_PUBLIC):  # pragma: no cover - a guard
    raise RuntimeError("raying.__all__ must stay sorted and name every lazily loaded name")


# Import paths of the flat layout, kept for one release: importing one warns and gives the
# module that now holds its names.
_MOVED = {
    "raying.advise": "raying.tools.advise", "raying.cli": "raying.tools.cli",
    "raying.cluster": "raying.tools.cluster", "raying.config": "raying.options",
    "raying.datagen": "raying.tools.datagen", "raying.datasource": "raying.engine.datasource",
    "raying.decode": "raying.image.decode", "raying.demo": "raying.tools.demo",
    "raying.executor": "raying.engine.stream", "raying.io": "raying.read",
    "raying.io.options": "raying.options", "raying.iterators": "raying.loader.batches",
    "raying.keras": "raying.loader.keras", "raying.manifest": "raying.dataset.manifest",
    "raying.metrics": "raying.engine.metrics", "raying.pipeline": "raying.loader.pipeline",
    "raying.pipeline_config": "raying.options", "raying.plan": "raying.sampling.plan",
    "raying.reader": "raying.read.task", "raying.tf": "raying.loader.tf",
    "raying.transforms": "raying.image.transform",
}


class _MovedModules:
    """Finds the old flat module names and hands out their new modules, with a warning."""

    @staticmethod
    def find_spec(name, path=None, target=None):
        if name not in _MOVED:
            return None
        import importlib.machinery

        return importlib.machinery.ModuleSpec(name, _MovedModules, is_package=name == "raying.io")

    @staticmethod
    def create_module(spec):
        import importlib
        import warnings

        new = _MOVED[spec.name]
        warnings.warn(f"{spec.name} moved to {new}; import it from there (the old path goes "
                      f"in the next release)", DeprecationWarning, stacklevel=3)
        return importlib.import_module(new)

    @staticmethod
    def exec_module(module):
        pass


def _install_moved_modules() -> None:
    import sys

    if not any(f is _MovedModules for f in sys.meta_path):
        sys.meta_path.append(_MovedModules)


_install_moved_modules()
