"""What a batch is and how it is produced: index math, sources, the definition, the step runner, the iterator."""

from . import execute, index, sources
from .collate import collate
from .dataset import Op, OpKind, Pipeline
from .errors import CollateError, ConfigError, FingerprintError, SourceError, StepError, WorkerError
from .loader import PipelineIterator

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
