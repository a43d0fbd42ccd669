"""What a batch is and how it is produced: index math, sources, the Pipeline, the iterator."""

from . import index, sources
from .collate import collate
from .dataset import Op, Pipeline, StepError
from .loader import PipelineIterator

__all__ = ["index", "sources", "collate", "Op", "Pipeline", "StepError", "PipelineIterator"]
