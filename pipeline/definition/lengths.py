"""The length index: tokens per record after the record transforms.

The body of :meth:`Pipeline.length_index <quern.pipeline.definition.dataset.Pipeline.length_index>`
(whose docstring says what it does): the checks, and the index, scanned and cached
by :mod:`quern.pipeline.definition.scan` or given and checked here. Packing and bucketing
(:mod:`quern.pipeline.streams`) are planned from it.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import numpy as np

from ..core.ops import OpKind
from ..streams.capabilities import SingleSource, require
from . import scan

if TYPE_CHECKING:
    from ..definition.dataset import Pipeline

__all__ = ["length_index", "given_lengths"]


def length_index(
    pipe: Pipeline, key: str | None, lengths: Any, cache_dir: str | os.PathLike | None, num_workers: int | None
) -> np.ndarray:
    """See :meth:`Pipeline.length_index <quern.pipeline.definition.dataset.Pipeline.length_index>`.

    Raises:
        ValueError: a stream without records of its own, a batch, a ``random_map`` before it, or
            lengths that do not fit.
    """
    pipe.stream.check("length_index")
    require(pipe.stream, SingleSource, "length_index")
    if pipe.batch_size is not None:
        raise ValueError("length_index() measures records: call it on the pipeline before batch()")
    if any(op.kind is OpKind.RANDOM_MAP for op in pipe.record_ops):
        raise ValueError(
            "length_index() after random_map(): lengths must not depend on the stream position; "
            "measure the pipeline before random_map()"
        )
    src = pipe.stream.source
    assert src is not None  # a stream of one source's records (check above)
    if lengths is not None:
        return given_lengths(pipe, lengths, key)
    metadata = getattr(src, "metadata", None) if getattr(src, "has_metadata", False) else None
    if metadata is not None and "length" in metadata:
        try:  # a prepared folder's index, if the transforms keep its lengths (checked on a sample)
            return given_lengths(pipe, metadata["length"], key)
        except ValueError:
            pass  # transforms that change the lengths: scan them
    fp = pipe.records_key(length_key=key)
    return scan.lengths(
        pipe,
        fp,
        candidates=pipe.stream.survivors,
        n=len(src),
        length_key=key,
        cache_dir=cache_dir,
        num_workers=num_workers,
    )


def given_lengths(pipe: Pipeline, lengths: Any, key: str | None) -> np.ndarray:
    """A user's length index, checked (see :meth:`Pipeline.length_index <quern.pipeline.definition.dataset.Pipeline.length_index>`).

    Raises:
        ValueError: the array does not hold one length ``>= 0`` per record, or a sampled record's differs.
    """
    src = pipe.stream.source
    assert src is not None
    n = len(src)
    survivors = pipe.stream.survivors
    what = f"length index {lengths!r}" if isinstance(lengths, (str, os.PathLike)) else "the length index given"
    arr = np.load(lengths, mmap_mode="r") if isinstance(lengths, (str, os.PathLike)) else np.asarray(lengths)
    if arr.shape != (n,) or not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(
            f"{what} must hold one integer per record of source {src.name!r} (shape ({n},)); "
            f"it has shape {arr.shape} and dtype {arr.dtype}"
        )
    live = np.arange(n, dtype=np.int64) if survivors is None else np.asarray(survivors)
    if arr.size and int(np.asarray(arr)[live].min()) < 0:
        bad = int(live[int(np.argmin(np.asarray(arr)[live]))])
        raise ValueError(f"{what}: record {bad} has length {int(arr[bad])}; lengths must be >= 0")
    sample = live[np.unique(np.linspace(0, len(live) - 1, 5).astype(np.int64))]
    real = scan.record_lengths(pipe, sample, key=key)
    for rid, want in zip(sample.tolist(), real.tolist()):
        if int(arr[rid]) != want:
            raise ValueError(
                f"{what} does not fit source {src.name!r} and its transforms: record {rid} has "
                f"{want} tokens, the index says {int(arr[rid])}"
            )
    out = np.asarray(arr, dtype=np.int64).copy()
    if survivors is not None:
        keep = np.zeros(n, dtype=bool)
        keep[live] = True
        out[~keep] = -1
    out.setflags(write=False)
    return out
