"""The pieces of a pipeline's config form that every kind of stream shares.

``to_config(pipe)`` is written by the pipeline's stream
(:meth:`~quern.pipeline.streams.capabilities.Configurable.to_config`) from these pieces: a file
source's config, transforms as registered names or importable functions, a
mixture's weights as the shortest decimals that quantize back to the same
integers, the batch. ``quern.load_config(to_config(pipe))`` gives a pipeline with
the same fingerprint and batches. The forms of each kind: ``docs/design/config-form.md``.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .. import sources
from ..core.ops import stage_name
from ..core.registry import REGISTRY
from ..core.tree import to_plain
from ..order.components import QUANTUM, quantize
from .capabilities import Configurable, require

if TYPE_CHECKING:
    from ..definition.dataset import Pipeline

__all__ = ["to_config", "weights_config", "batch_config", "source_config", "stages_config", "transform_config"]


def transform_config(fn: Callable[..., Any], kind: str, where: str) -> dict[str, Any]:
    """The config entry of transform ``fn``: ``{name, kind, kwargs}`` or ``{fn: "module:qualname", kind, kwargs}``.

    Raises:
        ValueError: ``fn`` is neither registered nor an importable module-level function (``where`` names it).
    """
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
            f"{where}: {stage_name(fn)} is not a registered transform or an importable module-level function, "
            "so it cannot be written as a config"
        )
    return {"fn": f"{module}:{qualname}", "kind": kind, "kwargs": to_plain(kwargs)}


def source_config(src: Any, where: str) -> dict[str, Any]:
    """The config of a file-based source (``where``: its key path, for messages)."""
    if isinstance(src, sources.ArrayRecordSource):
        # a prepared folder (or its URL): by its manifest; files read by URL: their URLs, not the cached copies
        paths = [src.folder] if src.folder is not None else list(src._file_urls or src.paths)
        out = {"type": "array_record", "paths": paths, "name": src.name}
        return {**out, "fields": list(src.fields)} if src.fields else out
    if isinstance(src, sources.ParquetSource):
        return {
            "type": "parquet",
            "paths": list(src.urls or src.paths),
            "columns": src.columns,
            "name": src.name,
            "cache_bytes": src.cache_bytes,
            "cache_row_groups": src.cache_row_groups,
            "unify_schemas": src.unify_schemas,
        }
    config = getattr(src, "config", None)
    if isinstance(src, sources.IndexedSource) and callable(config):
        return config()
    if isinstance(src, sources.TensorStoreSource) and src._single:
        return {"type": "tensorstore", "spec": src.specs[""], "name": src.name}
    name = getattr(src, "name", None)
    raise ValueError(f"{where} {name!r} ({type(src).__name__}) has no config form: use a file-based source")


def stages_config(ops: Any, where: str) -> list[dict[str, Any]]:
    """The config entries of transforms ``ops`` (``where``: their key path)."""
    return [transform_config(op.fn, op.kind.value, f"{where}.{i}") for i, op in enumerate(ops)]


def weights_config(names: tuple[str, ...], weights: tuple[int, ...]) -> dict[str, float]:
    """Quantized ``weights`` (integers summing to ``2**32``) by component name, as short decimals.

    The shortest decimals (the fewest significant digits, the same for all) whose
    :func:`~quern.pipeline.order.components.quantize` gives ``weights`` back: ``0.7, 0.3``
    for the weights of ``0.7, 0.3`` (or of ``7, 3``). At worst ``w / 2**32`` exactly,
    which always gives them back (a power of two: exact in a double).
    """
    exact = [w / QUANTUM for w in weights]
    for digits in range(1, 18):
        short = [float(f"{x:.{digits}g}") for x in exact]
        if sum(short) > 0 and quantize(short) == tuple(weights):
            return dict(zip(names, short))
    return dict(zip(names, exact))


def batch_config(pipe: Pipeline) -> dict[str, Any]:
    """``batch`` and ``batch_transforms`` of a batched pipeline's config."""
    return {
        "batch": {
            "size": pipe.batch_size,
            "drop_remainder": pipe.drop_remainder,
            **({} if pipe.pad_remainder is None else {"pad_remainder": True, "pad_value": pipe.pad_remainder}),
        },
        "batch_transforms": stages_config(pipe.batch_ops, "batch_transforms"),
    }


def to_config(pipe: Pipeline) -> dict[str, Any]:
    """The config of ``pipe`` (a dict; ``load_config`` of it gives the same fingerprint).

    Args:
        pipe: a pipeline.

    Returns:
        Its config, written by its stream (:meth:`~quern.pipeline.streams.capabilities.Configurable.to_config`).

    Raises:
        ValueError: a part of the pipeline has no config form (an in-memory source, a lambda), naming its key path.
    """
    return require(pipe.stream, Configurable, "to_config").to_config(pipe)
