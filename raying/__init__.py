"""raying: a Ray Data loader for deep-learning training that learns which samples matter."""

from raying.dataset.manifest import Manifest
from raying.engine.pack import pack
from raying.errors import (
    ConfigError,
    CredentialsError,
    DataError,
    DecodeError,
    DependencyError,
    RayingError,
    StorageError,
    SupersededError,
)
from raying.image.transform import ImageTransform
from raying.loader.pipeline import Pipeline, PipelineConfig
from raying.options import StorageOptions
from raying.sampling.feedback import report
from raying.sampling.prioritized import PrioritizedSampler
from raying.sampling.table import PriorityTable
from raying.sampling.uniform import UniformSampler

__version__ = "0.1.0"

__all__ = [
    "ConfigError",
    "CredentialsError",
    "DataError",
    "DecodeError",
    "DependencyError",
    "ImageTransform",
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
    "pack",
    "report",
]

if __all__ != sorted(__all__):  # pragma: no cover - a guard for maintainers, as torchdata does
    raise RuntimeError("raying.__all__ must stay sorted")
