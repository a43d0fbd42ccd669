"""A :class:`~quern.pipeline.dataset.Pipeline` written back as a config dict.

``quern.load_config(to_config(pipe))`` gives a pipeline with the same
fingerprint and batches. Only pipelines made of file sources, registered
transforms and importable module-level functions have a config form.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

from . import sources
from .registry import REGISTRY
from .tree import to_plain

__all__ = ["to_config"]


def _transform_config(fn: Callable[..., Any], kind: str, where: str) -> dict[str, Any]:
    for name, factory in REGISTRY.items():
        if isinstance(factory, type) and type(fn) is factory and dataclasses.is_dataclass(fn):
            fields = {f.name: getattr(fn, f.name) for f in dataclasses.fields(fn)}
            return {"name": name, "kind": kind, "kwargs": to_plain(fields)}
    kwargs: dict[str, Any] = {}
    if isinstance(fn, functools.partial) and not fn.args:
        kwargs = dict(fn.keywords)
        fn = fn.func
    module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
    if not module or not qualname or module == "__main__" or "<" in qualname:
        raise ValueError(
            f"{where}: {fn!r} is not a registered transform or an importable module-level function, "
            "so it cannot be written as a config"
        )
    return {"fn": f"{module}:{qualname}", "kind": kind, "kwargs": to_plain(kwargs)}


def to_config(pipe: Any) -> dict[str, Any]:
    """The config of ``pipe`` (a dict; ``load_config`` of it gives the same fingerprint).

    Raises ``ValueError`` when a part of the pipeline has no config form (an
    in-memory source, a lambda)."""
    if pipe.host_lengths is not None:
        raise ValueError("a pipeline with balance_hosts(lengths) has no config form (the lengths are data)")
    src = pipe.source
    source: dict[str, Any]
    if isinstance(src, sources.ArrayRecordSource):
        source = {"type": "array_record", "paths": list(src.paths), "name": src.name}
    elif isinstance(src, sources.ParquetSource):
        source = {
            "type": "parquet",
            "paths": list(src.paths),
            "columns": src.columns,
            "name": src.name,
            "cache_bytes": src.cache_bytes,
            "cache_row_groups": src.cache_row_groups,
            "unify_schemas": src.unify_schemas,
        }
    elif isinstance(src, sources.TensorStoreSource) and src._single:
        source = {"type": "tensorstore", "spec": src.specs[""], "name": src.name}
    else:
        raise ValueError(f"source {src.name!r} ({type(src).__name__}) has no config form: use a file-based source")
    shuffle: str | dict[str, Any] | None = None
    if pipe.shuffle_mode == "global":
        shuffle = "global"
    elif pipe.shuffle_mode == "block":
        shuffle = {"mode": "block", "block": pipe.block, "window": pipe.window}
    return {
        "source": source,
        "seed": pipe.seed,
        "num_epochs": pipe.num_epochs,
        "shuffle": shuffle,
        "transforms": [_transform_config(op.fn, op.kind, f"transforms.{i}") for i, op in enumerate(pipe.record_ops)],
        "batch": {"size": pipe.batch_size, "drop_remainder": pipe.drop_remainder},
        "batch_transforms": [
            _transform_config(op.fn, op.kind, f"batch_transforms.{i}") for i, op in enumerate(pipe.batch_ops)
        ],
    }
