"""quern: a step-addressable input pipeline for JAX.

Every batch is a pure function of (pipeline definition, step, host slice)::

    import quern
    src = quern.sources.ArrayRecordSource("data/train-*.array_record")
    pipe = (quern.Pipeline.from_source(src, seed=0).shuffle()
            .map(quern.transforms.decode(np.int32)).map(quern.transforms.pad(512))
            .batch(256))
    batch = pipe.batch_at(step)          # or: for batch in pipe.iterator(start_step=step)
"""

# Absolute imports: pytest imports a repository root's __init__.py as a plain module
# (the root is the package here), where relative imports would fail.
from quern import sharding, transforms

from .pipeline import sources
from .pipeline.core.collate import collate
from .pipeline.core.errors import (
    CapabilityError,
    CollateError,
    ConfigError,
    FingerprintError,
    PrepareError,
    ScanError,
    ServiceError,
    SourceError,
    StepError,
    StepTimeoutError,
    StreamTimeoutError,
    WorkerError,
)
from .pipeline.core.version import __version__
from .pipeline.definition.dataset import Pipeline
from .pipeline.definition.mix import mix
from .pipeline.iterate.iterator import PipelineIterator
from .pipeline.iterate.service import RayService
from .pipeline.order import index


def __getattr__(name: str) -> object:
    """``load_config``, ``prepare``, ``verify`` and ``plan_io``, imported on first use.

    pydantic and yaml stay out of ``import quern``, and so out of every worker's start-up.
    """
    if name in ("plan_io", "IOPlan"):
        from quern.pipeline.definition import io_plan

        return getattr(io_plan, name)
    if name == "load_config":
        from quern.pipeline import config

        return getattr(config, name)
    if name in ("prepare", "verify"):  # quern.prepare (prepare, verify) and quern.verify, imported on first use too
        import importlib

        return importlib.import_module(f"quern.{name}")
    raise AttributeError(f"module 'quern' has no attribute {name!r}")


__all__ = [
    "Pipeline",
    "PipelineIterator",
    "RayService",
    "ServiceError",
    "mix",
    "plan_io",
    "IOPlan",
    "ScanError",
    "StepError",
    "StepTimeoutError",
    "StreamTimeoutError",
    "SourceError",
    "WorkerError",
    "CollateError",
    "CapabilityError",
    "FingerprintError",
    "PrepareError",
    "collate",
    "ConfigError",
    "load_config",
    "index",
    "sharding",
    "sources",
    "transforms",
    "__version__",
]
