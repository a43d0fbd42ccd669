"""The length index: tokens per record after the record transforms, and host slices balanced by it.

:func:`length_index` (``Pipeline.length_index`` calls it) and the body of
:meth:`Pipeline.balance_hosts <quern.pipeline.definition.dataset.Pipeline.balance_hosts>`
(whose docstring says what it does): the checks, and the index, scanned and cached
by :mod:`quern.pipeline.definition.scan` or given and checked here. Packing and bucketing
(:mod:`quern.pipeline.streams`) are planned from it.
"""

from __future__ import annotations

import dataclasses
import os
from typing import TYPE_CHECKING, Any

import numpy as np

from ..core.ops import OpKind
from ..identity.hashing import digest
from ..streams.capabilities import Balanceable, SingleSource, require
from . import scan
from .identify import records_key

if TYPE_CHECKING:
    from ..definition.dataset import Pipeline

__all__ = ["length_index", "given_lengths", "balanced"]


def length_index(
    pipe: Pipeline, key: str | None, lengths: Any, cache_dir: str | os.PathLike | None, num_workers: int | None
) -> np.ndarray:
    """Tokens per record of the source after the record transforms.

    ``len(record)``, or ``len(record[key])``, which must be 1-D. ``lengths`` is
    taken instead of a scan after checks (its size, values ``>= 0``, and the
    lengths of 5 records computed here, so an index made for other data or other
    transforms is refused, naming the record). Without it, a prepared folder's
    ``length`` metadata is taken after the same checks; otherwise the index is
    found once by a scan (:mod:`quern.pipeline.definition.scan`) and cached under
    ``cache_dir`` (folder ``lengths/``), keyed by the fingerprint of the source,
    the record transforms and ``key``.

    Args:
        pipe: the pipeline (before ``batch()``).
        key: the field of a dict record holding its tokens (``None``: the record).
        lengths: an integer array or the path of a ``.npy`` file, one value per record.
        cache_dir: the cache folder (default ``$QUERN_CACHE_DIR`` or ``~/.cache/quern``).
        num_workers: scan processes (default: the CPU count; ``workers=`` is deprecated).

    Returns:
        A read-only int64 array, one value per record of the source, ``-1`` for the
        records a filter drops.

    Raises:
        ValueError: a stream without records of its own, after ``batch()`` or
            ``random_map()``, or lengths that do not fit.
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
    fp = records_key(pipe, length_key=key)
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


def balanced(pipe: Pipeline, lengths: Any, key: str | None) -> Pipeline:
    """See :meth:`Pipeline.balance_hosts <quern.pipeline.definition.dataset.Pipeline.balance_hosts>`.

    Args:
        pipe: the pipeline to balance.
        lengths: one integer length per record of the source (``None``: its :func:`length_index`).
        key: the field of a dict record holding its tokens (for the default).

    Returns:
        The balanced pipeline.

    Raises:
        ValueError: a stream that cannot be balanced, or lengths of the wrong shape or sign.
    """
    pipe.stream.check("balance_hosts")
    balanceable = require(pipe.stream, Balanceable, "balance_hosts")
    src = pipe.stream.source
    assert src is not None
    if lengths is None:
        lengths = length_index(pipe, key, None, None, None)
    lengths = np.asarray(lengths)
    if lengths.shape != (len(src),) or not np.issubdtype(lengths.dtype, np.integer):
        raise ValueError(
            f"balance_hosts needs one integer length per record of source {src.name!r} "
            f"(shape ({len(src)},)), got an array of shape {lengths.shape} and dtype {lengths.dtype}"
        )
    if lengths.size and lengths.dtype.kind == "u" and lengths.max() > np.iinfo(np.int64).max:
        raise ValueError(f"balance_hosts: record {int(lengths.argmax())} has a length beyond 2**63")
    survivors = pipe.stream.survivors
    live = lengths if survivors is None else lengths[np.asarray(survivors)]  # a filter's drops: any
    if live.size and live.min() < 0:
        bad = int(live.argmin()) if survivors is None else int(survivors[int(live.argmin())])
        raise ValueError(f"balance_hosts: lengths must be >= 0, record {bad} has {int(lengths[bad])}")
    lengths = lengths.astype(np.int64)
    lengths.setflags(write=False)
    return dataclasses.replace(pipe, stream=balanceable.balanced(lengths, digest(lengths)))
