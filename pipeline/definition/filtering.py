"""A filter: the survivors of a predicate, found once, and its description frozen with them.

The body of :meth:`Pipeline.filter <quern.pipeline.definition.dataset.Pipeline.filter>`
(whose docstring says what it does): the checks, the survivors (from the source's
metadata index, or scanned and cached by :mod:`quern.pipeline.definition.scan`), and
the filter's description as it was when they were found
(the pipeline's ``filter_descriptions``).
"""

from __future__ import annotations

import dataclasses
import os
from typing import TYPE_CHECKING, Any

from ..core.batching import need_no_batch
from ..core.errors import FingerprintError
from ..core.ops import Op, OpKind
from ..identity.fingerprint import describe_callable
from ..streams.capabilities import Filterable, require
from . import scan
from .identify import record_ops_description, records_key

if TYPE_CHECKING:
    from .dataset import Pipeline

__all__ = ["filtered"]


def filtered(pipe: Pipeline, pred: Any, cache_dir: str | os.PathLike | None, num_workers: int | None) -> Pipeline:
    """See :meth:`Pipeline.filter <quern.pipeline.definition.dataset.Pipeline.filter>`.

    Args:
        pipe: the pipeline to filter.
        pred: the predicate.
        cache_dir: where the survivors are cached (``None``: the default folder).
        num_workers: scan processes (``None``: the CPU count).

    Returns:
        The filtered pipeline.

    Raises:
        TypeError: ``pred`` is not callable.
        ValueError: after ``batch()`` or ``random_map()``, on a stream that cannot be
            filtered, a metadata predicate on a source without an index, or a filter that keeps nothing.
    """
    if not callable(pred):
        raise TypeError(f"filter() needs a callable, got {pred!r}")
    need_no_batch(pipe, "filter", "map_batch(fn) to drop rows yourself")
    pipe.stream.check("filter")
    filterable = require(pipe.stream, Filterable, "filter")
    if any(op.kind is OpKind.RANDOM_MAP for op in pipe.record_ops):
        raise ValueError(
            "filter() after random_map(): the records a filter keeps must not depend on the stream position; "
            "put the filter before random_map()"
        )
    src = pipe.stream.source
    assert src is not None  # a stream of one source's records (the check above)
    prefix = dataclasses.replace(pipe, record_ops=pipe.record_ops + (Op(OpKind.FILTER, pred),))
    k = len(pipe.record_ops)
    if hasattr(pred, "keep_metadata"):  # e.g. transforms.metadata_range: from the index, no record read
        label = prefix.record_ops[-1].label(k)
        kept = scan.metadata_survivors(src, pred, candidates=pipe.stream.survivors, label=label)
        try:
            frozen = _frozen_with(prefix, k, describe_callable(pred, label))
        except FingerprintError:  # described (and refused) when a fingerprint is asked for, as before
            frozen = pipe.filter_descriptions
        return dataclasses.replace(prefix, stream=filterable.filtered(kept), filter_descriptions=frozen)
    ops = record_ops_description(prefix)
    key = records_key(prefix, ops=ops)
    kept = scan.survivors(
        prefix, key, candidates=pipe.stream.survivors, n=len(src), cache_dir=cache_dir, num_workers=num_workers
    )
    return dataclasses.replace(
        prefix, stream=filterable.filtered(kept), filter_descriptions=_frozen_with(prefix, k, ops[k][1])
    )


def _frozen_with(pipe: Pipeline, k: int, description: Any) -> tuple[Any, ...]:
    """``pipe.filter_descriptions`` with record op ``k``'s set to ``description``."""
    done = pipe.filter_descriptions
    frozen = list(done) + [None] * (len(pipe.record_ops) - len(done))
    frozen[k] = description
    return tuple(frozen)
