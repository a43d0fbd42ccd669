"""What a batch is and how it is produced: index math, sources, the definition, the step runner, the iterator."""

from . import execute, sources
from .core.collate import collate
from .core.errors import CollateError, ConfigError, FingerprintError, SourceError, StepError, WorkerError
from .definition.dataset import Op, OpKind, Pipeline
from .iterate.iterator import PipelineIterator
from .order import index

__all__ = [
    "index",
    "sources",
    "execute",
    "collate",
    "Op",
    "OpKind",
    "Pipeline",
    "PipelineIterator",
    "StepError",
    "SourceError",
    "WorkerError",
    "CollateError",
    "ConfigError",
    "FingerprintError",
]
