"""Collation: a list of records -> one batch, strictly.

Dicts collate key by key, tuples and lists position by position, arrays and
numbers are stacked along a new first axis, ``bytes`` and ``str`` become an
object array. The result depends only on the records and their order, and
its types never depend on which records a batch happens to hold: the rows of
a batch must agree, or :class:`CollateError` names the first row that does
not (its ``row``) and what it is:

- dicts: the same keys (in any order; the batch has row 0's order);
- tuples and lists: the same type (a namedtuple stays one) and length;
- arrays (NumPy arrays and scalars, and objects with ``__array__`` such as
  ``jax.Array``): the same dtype and shape in every row, never promoted
  (``int32`` and ``int64`` rows are an error, not an ``int64`` batch);
- Python numbers: the same type in every row (``bool``, ``int``, ``float`` or
  ``complex``; a NumPy scalar and a Python number are different), stacked as
  ``bool``, ``int64``, ``float64`` or ``complex128`` (an ``int`` outside the
  ``int64`` range is an error);
- ``bytes`` or ``str`` (NumPy's ``bytes_``/``str_`` too): the same one in
  every row, stacked into an object array of the values;
- anything else (``None``, a set, a generator, a ``bytearray``, any other
  object) is an error.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from .errors import CollateError
from .tree import map_leaves

__all__ = ["collate", "CollateError", "CollatedRows", "take", "describe"]


class CollatedRows(Sequence):
    """Records that are already stacked into one batch.

    A read-only sequence of per-row records (row ``i`` is the batch with every
    array indexed by ``i``, built on access); :func:`collate` returns the batch
    itself, saving a copy. Vectorised transforms (``map_many``) and in-memory
    sources return it.

    Args:
        collated: the batch: nested dicts, tuples and lists of arrays with ``length`` rows.
        length: the number of rows.

    Attributes:
        collated: the batch, as given.

    Example:
        >>> import numpy as np
        >>> rows = CollatedRows({"x": np.arange(3)}, 3)
        >>> len(rows), rows[1]["x"].item(), collate(rows)["x"].tolist()
        (3, 1, [0, 1, 2])
    """

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
    """Index every array of a (nested) batch with ``index``.

    Args:
        batch: nested dicts, tuples and lists of arrays.
        index: a row (an int) or rows (a slice, an index array or a mask).

    Returns:
        The same structure holding ``a[index]`` for every array ``a``.
    """
    return map_leaves(lambda a: a[index], batch)


# Python numbers collate to NumPy's default dtype for their type, whatever their values
_PY_NUMBERS = {
    bool: np.dtype(np.bool_),
    int: np.dtype(np.int64),
    float: np.dtype(np.float64),
    complex: np.dtype(np.complex128),
}


def describe(value: Any) -> str:
    """A short description of ``value``'s kind, for messages.

    Args:
        value: anything.

    Returns:
        A phrase such as ``an int32 array of shape (3,)``, ``a numpy.float32 scalar``,
        ``a float``, ``None``, ``a set`` or ``a generator``.

    Example:
        >>> import numpy as np
        >>> describe(np.zeros(3, np.int32)), describe(1.5), describe(None)
        ('an int32 array of shape (3,)', 'a float', 'None')
    """
    if value is None:
        return "None"
    if isinstance(value, np.ndarray):
        return _a(f"{value.dtype} array of shape {value.shape}")
    if isinstance(value, np.generic):
        return f"a numpy.{type(value).__name__} scalar"
    t = type(value)
    name = t.__qualname__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"
    if hasattr(value, "shape") and hasattr(value, "dtype"):
        return _a(f"{name} of dtype {value.dtype} and shape {tuple(value.shape)}")
    return _a(name)


def _a(noun: str) -> str:
    return f"an {noun}" if noun[:1] in "aeiou" else f"a {noun}"


def _is_array(value: Any) -> bool:
    return isinstance(value, (np.ndarray, np.generic)) or hasattr(type(value), "__array__")


def collate(records: Sequence[Any], path: str = "batch") -> Any:
    """Collate ``records`` (all of one structure and types) into a batch.

    The rules are in the module docstring: the rows must agree with row 0 in
    structure, keys, type, dtype and shape; nothing is promoted.

    Args:
        records: the rows, in batch order; :class:`CollatedRows` give their batch as it is.
        path: the name of the batch in messages (key paths start with it).

    Returns:
        The batch, of row 0's structure, each leaf with a new first axis of
        ``len(records)``; it depends only on the records and their order.

    Raises:
        CollateError: a row disagrees with row 0, or holds a value that cannot be
            collated; the message names the key path and the row (also in ``.row``).
        ValueError: ``records`` is empty.

    Example:
        >>> import numpy as np
        >>> batch = collate([{"x": np.int32(1), "t": "a"}, {"x": np.int32(2), "t": "b"}])
        >>> batch["x"], batch["t"].tolist()
        (array([1, 2], dtype=int32), ['a', 'b'])
    """
    if isinstance(records, CollatedRows):
        return records.collated
    if not len(records):
        raise ValueError(f"{path}: cannot collate an empty list of records")
    first = records[0]
    if isinstance(first, Mapping):
        keys = list(first)
        for i, r in enumerate(records):
            if not isinstance(r, Mapping) or len(r) != len(keys) or any(k not in r for k in keys):
                if not isinstance(r, Mapping):
                    raise CollateError(f"{path}: row {i} is {describe(r)}, row 0 is a dict with keys {keys}", i)
                raise CollateError(f"{path}: row {i} has keys {list(r)}, row 0 has {keys}", i)
        return {k: collate([r[k] for r in records], f"{path}[{k!r}]") for k in keys}
    if isinstance(first, (tuple, list)):
        n, kind = len(first), type(first)
        for i, r in enumerate(records):
            if type(r) is not kind or len(r) != n:
                got = f"{describe(r)} of length {len(r)}" if isinstance(r, (tuple, list)) else describe(r)
                raise CollateError(f"{path}: row {i} is {got}, row 0 is {describe(first)} of length {n}", i)
        out = [collate([r[j] for r in records], f"{path}[{j}]") for j in range(n)]
        if isinstance(first, tuple) and hasattr(first, "_fields"):  # a namedtuple stays one
            return kind(*out)
        return tuple(out) if isinstance(first, tuple) else out
    if isinstance(first, (bytes, str)):
        text = str if isinstance(first, str) else bytes
        if not all(isinstance(r, text) for r in records):
            i = next(i for i, r in enumerate(records) if not isinstance(r, text))
            raise _odd_row(records, path, i)
        arr = np.empty(len(records), dtype=object)
        arr[:] = list(records)
        return arr
    if type(first) in _PY_NUMBERS:
        return _collate_numbers(records, path)
    if _is_array(first):
        return _stack(records, path)
    raise CollateError(f"{path}: row 0 is {describe(first)}, {_CANNOT}", 0)


_CANNOT = (
    "which cannot be collated (a null? rows must be dicts, tuples, lists, arrays, numbers, str or bytes, "
    "the same in every row)"
)


def _odd_row(records: Sequence[Any], path: str, i: int) -> CollateError:
    """The error for row ``i``, which is not of the kind of row 0."""
    r = records[i]
    if r is None or not (_is_array(r) or type(r) in _PY_NUMBERS or isinstance(r, (bytes, str, Mapping, tuple, list))):
        return CollateError(f"{path}: row {i} is {describe(r)}, {_CANNOT}", i)
    return CollateError(f"{path}: row {i} is {describe(r)}, row 0 is {describe(records[0])}", i)


def _collate_numbers(records: Sequence[Any], path: str) -> np.ndarray:
    """Python numbers of one type -> an array of that type's NumPy default dtype."""
    kind = type(records[0])
    for i, r in enumerate(records):
        if type(r) is not kind:
            raise _odd_row(records, path, i)
    try:
        return np.array(records, dtype=_PY_NUMBERS[kind])
    except OverflowError:
        i = next(i for i, r in enumerate(records) if not -(2**63) <= r < 2**63)
        raise CollateError(f"{path}: row {i} is the int {records[i]}, outside the int64 range", i) from None


def _stack(records: Sequence[Any], path: str) -> np.ndarray:
    """Arrays of one dtype and shape -> one array with a new first axis (no promotion)."""
    first = records[0]
    kind = type(first)
    if kind is np.ndarray:
        dtype, shape = first.dtype, first.shape
        for r in records:  # the fast check: one loop of attribute compares, no conversion
            if type(r) is not np.ndarray or r.shape != shape or (r.dtype is not dtype and r.dtype != dtype):
                break
        else:  # np.array copies equal arrays faster than np.stack, to the same bytes
            return np.stack(records) if dtype.hasobject else np.array(records, dtype=dtype)
    elif isinstance(first, np.generic):
        dtype, shape = first.dtype, ()
        if issubclass(kind, (np.number, np.bool_)):  # the type is the dtype
            same = all(type(r) is kind for r in records)
        else:  # datetime64 units, structured fields: the dtype says more than the type
            same = all(type(r) is kind and r.dtype == dtype for r in records)
        if same:
            return np.array(records, dtype=dtype)
    else:
        first = np.asarray(first)
        dtype, shape = first.dtype, first.shape
    arrays = []
    for i, r in enumerate(records):
        if not _is_array(r):
            raise _odd_row(records, path, i)
        a = r if type(r) is np.ndarray or isinstance(r, np.generic) else np.asarray(r)
        if a.shape != shape:
            raise CollateError(
                f"{path}: row {i} has shape {a.shape}, row 0 has {shape}: arrays of different shapes "
                f"cannot be stacked; pad or truncate them first (e.g. quern.transforms.pad)",
                i,
            )
        if a.dtype != dtype:
            null = " (an object array: a list holding a null?)" if dtype.hasobject or a.dtype.hasobject else ""
            to = f"np.{dtype.name}" if isinstance(getattr(np, dtype.name, None), type) else f"np.dtype({dtype.str!r})"
            example = "" if dtype.fields else f" (e.g. np.asarray(x, {to}))"
            raise CollateError(
                f"{path}: row {i} has dtype {a.dtype}, row 0 has {dtype}{null}: rows of different dtypes are not "
                f"promoted; convert them to one dtype in a transform{example}",
                i,
            )
        arrays.append(a)
    return np.stack(arrays)
