"""What the lengths of records make: the length index, packing and length bucketing.

The bodies of :meth:`Pipeline.length_index <quern.pipeline.dataset.Pipeline.length_index>`,
:meth:`~quern.pipeline.dataset.Pipeline.pack` and
:meth:`~quern.pipeline.dataset.Pipeline.bucket` (whose docstrings say what they
do): checks, the index (scanned and cached by :mod:`quern.pipeline.scan`, or
given and checked here), and the definitions they return
(:mod:`quern.pipeline.streams`).
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from ..transforms.pad import pad
from . import scan
from .digest import digest
from .index import check_int
from .ops import OpKind
from .plan import mixture as _mixture
from .plan import packing as _packing
from .streams import Bucketing, Packing

__all__ = ["length_index", "given_lengths", "pack", "bucket"]


def length_index(
    pipe: Any, key: str | None, lengths: Any, cache_dir: str | os.PathLike | None, workers: int | None
) -> np.ndarray:
    """See :meth:`Pipeline.length_index`."""
    if pipe.packing is not None:
        raise ValueError("length_index() after pack(): packed rows all hold seq_len tokens; measure before pack()")
    if pipe.source is None:
        raise ValueError("length_index() of a mixture: take each component's length_index()")
    if pipe.batch_size is not None:
        raise ValueError("length_index() measures records: call it on the pipeline before batch()")
    if any(op.kind is OpKind.RANDOM_MAP for op in pipe.record_ops):
        raise ValueError(
            "length_index() after random_map(): lengths must not depend on the stream position; "
            "measure the pipeline before random_map()"
        )
    n = len(pipe.source)
    if lengths is not None:
        return given_lengths(pipe, lengths, key)
    if getattr(pipe.source, "has_metadata", False) and "length" in pipe.source.metadata:
        try:  # a prepared folder's index, if the transforms keep its lengths (checked on a sample)
            return given_lengths(pipe, pipe.source.metadata["length"], key)
        except ValueError:
            pass  # transforms that change the lengths: scan them
    fp = pipe._records_key(length_key=key)
    return scan.lengths(pipe, fp, pipe.survivors, n, key, cache_dir, workers)


def given_lengths(pipe: Any, lengths: Any, key: str | None) -> np.ndarray:
    """A user's length index, checked (see :meth:`Pipeline.length_index`)."""
    assert pipe.source is not None
    n = len(pipe.source)
    what = f"length index {lengths!r}" if isinstance(lengths, (str, os.PathLike)) else "the length index given"
    arr = np.load(lengths, mmap_mode="r") if isinstance(lengths, (str, os.PathLike)) else np.asarray(lengths)
    if arr.shape != (n,) or not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(
            f"{what} must hold one integer per record of source {pipe.source.name!r} (shape ({n},)); "
            f"it has shape {arr.shape} and dtype {arr.dtype}"
        )
    live = np.arange(n, dtype=np.int64) if pipe.survivors is None else np.asarray(pipe.survivors)
    if arr.size and int(np.asarray(arr)[live].min()) < 0:
        bad = int(live[int(np.argmin(np.asarray(arr)[live]))])
        raise ValueError(f"{what}: record {bad} has length {int(arr[bad])}; lengths must be >= 0")
    sample = live[np.unique(np.linspace(0, len(live) - 1, 5).astype(np.int64))]
    real = scan.record_lengths(pipe, sample, key)
    for rid, want in zip(sample.tolist(), real.tolist()):
        if int(arr[rid]) != want:
            raise ValueError(
                f"{what} does not fit source {pipe.source.name!r} and its transforms: record {rid} has "
                f"{want} tokens, the index says {int(arr[rid])}"
            )
    out = np.asarray(arr, dtype=np.int64).copy()
    if pipe.survivors is not None:
        keep = np.zeros(n, dtype=bool)
        keep[live] = True
        out[~keep] = -1
    out.setflags(write=False)
    return out


def pack(
    pipe: Any,
    seq_len: int,
    mode: str,
    key: str | None,
    lengths: Any,
    cache_dir: str | os.PathLike | None,
    workers: int | None,
) -> Any:
    """See :meth:`Pipeline.pack`."""
    seq_len = check_int(seq_len, "seq_len", 1)
    if mode not in _packing.MODES:
        raise ValueError(f"pack(): mode must be one of {_packing.MODES}, got {mode!r}")
    if pipe.packing is not None:
        raise ValueError("pack() on a packed pipeline: it is packed already")
    if pipe.source is None:
        raise ValueError("pack() on a mixture: pack its components, then mix them")
    pipe._need_no_batch("pack", "a pipeline before batch()")
    lens = pipe.length_index(key, lengths, cache_dir, workers)
    live = lens[np.asarray(pipe.survivors)] if pipe.survivors is not None else lens
    if not int(np.asarray(live).sum()):
        raise ValueError(f"pack(): the records of source {pipe.source.name!r} hold no token")
    file = os.path.abspath(os.fspath(lengths)) if isinstance(lengths, (str, os.PathLike)) else None
    p = Packing(
        pipe,
        seq_len,
        mode,
        key,
        lens,
        digest(np.asarray(lens)),
        None if cache_dir is None else os.fspath(cache_dir),
        file,
    )
    return type(pipe)(source=None, seed=pipe.seed, num_epochs=pipe.num_epochs, packing=p)


def bucket(
    pipe: Any,
    boundaries: Any,
    batch_sizes: Any,
    key: str | None,
    pad_value: Any,
    lengths: Any,
    cache_dir: str | os.PathLike | None,
    workers: int | None,
    block: int,
) -> Any:
    """See :meth:`Pipeline.bucket`."""
    if pipe.source is None:
        raise ValueError("bucket() needs a single-source pipeline (not a mixture or a packed pipeline)")
    pipe._need_no_batch("bucket", "bucket() instead of batch(): it makes the batches")
    if pipe.num_epochs is not None:
        raise ValueError("bucket(): the pipeline must be endless (num_epochs=None); each bucket has its own epochs")
    bounds = [check_int(b, "boundaries", 1) for b in boundaries]
    sizes = [check_int(b, "batch_sizes", 1) for b in batch_sizes]
    if not bounds or any(b2 <= b1 for b1, b2 in zip(bounds, bounds[1:])):
        raise ValueError(f"bucket(): boundaries must be increasing positive lengths, got {bounds}")
    if len(sizes) != len(bounds):
        raise ValueError(f"bucket(): {len(sizes)} batch sizes for {len(bounds)} buckets; give one per bucket")
    if isinstance(pad_value, np.generic):
        pad_value = pad_value.item()  # the same value, the same fingerprint
    lens = np.asarray(pipe.length_index(key, lengths, cache_dir, workers))
    live = np.arange(len(lens)) if pipe.survivors is None else np.asarray(pipe.survivors)
    which = np.minimum(np.searchsorted(np.asarray(bounds), lens[live], side="left"), len(bounds) - 1)
    buckets, comps, weights = [], [], []
    for b, (upper, size) in enumerate(zip(bounds, sizes)):
        ids = live[which == b]
        if not ids.size:
            continue
        part = pipe._replace(survivors=ids).map(pad(upper, key=key, pad_value=pad_value)).batch(size)
        buckets.append(b)
        comps.append(part)
        weights.append(len(ids) / size)
    if not comps:
        raise ValueError("bucket(): no record in any bucket")
    stages = (_mixture.Stage(0, _mixture.quantize(weights)),)
    k = _mixture.block_size(len(comps), check_int(block, "block", 1))
    file = os.path.abspath(os.fspath(lengths)) if isinstance(lengths, (str, os.PathLike)) else None
    bk = Bucketing(
        pipe,
        tuple(bounds),
        tuple(sizes),
        key,
        pad_value,
        tuple(buckets),
        tuple(comps),
        stages,
        k,
        digest(lens),
        lens,
        file,
    )
    return type(pipe)(source=None, seed=pipe.seed, batch_size=max(sizes), bucketing=bk)
