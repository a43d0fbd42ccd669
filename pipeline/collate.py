"""Collation: a list of records -> one batch.

Dicts collate key by key, tuples and lists position by position, arrays and
numbers are stacked along a new first axis, ``bytes`` and ``str`` become an
object array. The result depends only on the records and their order.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from .errors import CollateError
from .tree import map_leaves

__all__ = ["collate", "CollateError", "CollatedRows", "take"]


class CollatedRows(Sequence):
    """Records that are already stacked into one batch (``collated``).

    Behaves as a read-only sequence of per-row records (row ``i`` is the batch
    with every array indexed by ``i``, built on access), and :func:`collate`
    returns ``collated`` itself, saving a copy. Vectorised transforms
    (``map_many``) return it."""

    def __init__(self, collated: Any, length: int) -> None:
        self.collated = collated
        self._len = int(length)

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return [self[k] for k in range(*i.indices(self._len))]
        if not -self._len <= i < self._len:
            raise IndexError(i)
        return take(self.collated, i)


def take(batch: Any, index: Any) -> Any:
    """Index every array of a (nested) batch with ``index``: a row (int) or rows (slice, array)."""
    return map_leaves(lambda a: a[index], batch)


def collate(records: Sequence[Any], path: str = "batch") -> Any:
    """Collate ``records`` (all of the same structure) into a batch.

    Raises ``ValueError`` naming the key path when records disagree in
    structure, keys or array shapes."""
    if isinstance(records, CollatedRows):
        return records.collated
    if not len(records):
        raise ValueError(f"{path}: cannot collate an empty list of records")
    first = records[0]
    if isinstance(first, Mapping):
        keys = list(first)
        for i, r in enumerate(records):
            if not isinstance(r, Mapping) or len(r) != len(keys) or any(k not in r for k in keys):
                got = list(r) if isinstance(r, Mapping) else type(r).__name__
                raise CollateError(f"{path}: row {i} has keys {got}, row 0 has {keys}", i)
        return {k: collate([r[k] for r in records], f"{path}[{k!r}]") for k in keys}
    if isinstance(first, (tuple, list)) and not isinstance(first, np.ndarray):
        n = len(first)
        for i, r in enumerate(records):
            if not isinstance(r, (tuple, list)) or len(r) != n:
                size = len(r) if hasattr(r, "__len__") else "?"
                raise CollateError(f"{path}: row {i} is {type(r).__name__} of length {size}, row 0 has {n} fields", i)
        out = [collate([r[j] for r in records], f"{path}[{j}]") for j in range(n)]
        if isinstance(first, tuple) and hasattr(first, "_fields"):  # a namedtuple stays one
            return type(first)(*out)
        return tuple(out) if isinstance(first, tuple) else out
    if isinstance(first, (bytes, str)):
        arr = np.empty(len(records), dtype=object)
        arr[:] = list(records)
        return arr
    nulls = [i for i, r in enumerate(records) if r is None]
    if nulls:
        raise CollateError(f"{path}: row {nulls[0]} is None (a null?), which cannot be collated", nulls[0])
    arrays = [np.asarray(r) for r in records]
    shape = arrays[0].shape
    odd = next((i for i, a in enumerate(arrays) if a.shape != shape), None)
    if odd is not None:
        raise CollateError(
            f"{path}: row {odd} has shape {arrays[odd].shape}, row 0 has {shape}: arrays of different shapes "
            f"cannot be stacked; pad or truncate them first (e.g. quern.transforms.pad)",
            odd,
        )
    return np.stack(arrays)
