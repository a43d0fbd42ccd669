"""In-memory arrays and any object with ``__len__``/``__getitem__`` (grain's data-source protocol)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ..core.collate import CollatedRows
from ..core.errors import FingerprintError, SourceError
from ..identity.hashing import digest
from .base import (
    Source,
    check_ids,
    sample_ids,
)


class ArraySource(Source):
    """In-memory arrays: record ``i`` is ``x[i]``, or ``{"x": x[i], ...}`` for a dict of arrays.

    ``read_many`` gathers each array once with the whole id array and returns
    the rows already stacked (a :class:`~quern.pipeline.core.collate.CollatedRows`),
    so collation costs no copy. The identity hashes the arrays' contents.

    Args:
        arrays: an array, or a non-empty dict of name -> array; every array's
            first axis is the record axis, of one length.
        name: the source's name.

    Raises:
        TypeError: ``arrays`` is neither an array nor a non-empty dict.
        ValueError: the arrays do not share their first dimension (or one is a scalar).

    Example:
        >>> import numpy as np
        >>> src = ArraySource({"x": np.arange(4), "y": np.ones((4, 2))})
        >>> len(src), src[2]["x"].item(), src.read_many(np.array([0, 3])).collated["y"].shape
        (4, 2, (2, 2))
    """

    def __init__(self, arrays: Mapping[str, np.ndarray] | np.ndarray, name: str = "arrays") -> None:
        self._single = isinstance(arrays, np.ndarray)
        named: Mapping[str, np.ndarray] = {"": arrays} if isinstance(arrays, np.ndarray) else arrays
        if not isinstance(named, Mapping) or not named:
            raise TypeError("ArraySource expects an array or a non-empty dict of name -> array")
        self.arrays = {str(k): np.asarray(v) for k, v in named.items()}
        lengths = {k: (int(v.shape[0]) if v.ndim else None) for k, v in self.arrays.items()}
        first = next(iter(lengths.values()))
        if first is None or len(set(lengths.values())) != 1:
            raise ValueError(f"ArraySource: arrays must share their first dimension, got {lengths}")
        self._len: int = first
        self.name = name

    def __len__(self) -> int:
        return self._len

    def read_many(self, ids: np.ndarray) -> Sequence:
        """The records ``ids``, already stacked.

        Args:
            ids: record ids in ``[0, len(self))``.

        Returns:
            A :class:`~quern.pipeline.core.collate.CollatedRows` of the rows.

        Raises:
            IndexError: an id is out of range.
        """
        ids = check_ids(ids, len(self), f"ArraySource {self.name!r}")
        cols = {k: v[ids] for k, v in self.arrays.items()}
        return CollatedRows(cols[""] if self._single else cols, len(ids))

    def identity(self) -> dict:
        """A description of the data for the pipeline fingerprint.

        Returns:
            The type, name, length and a hash of the contents (computed once: the
            arrays must not change).
        """
        if getattr(self, "_content", None) is None:
            self._content = self._hash_content()
        return {**super().identity(), "content": self._content}

    def _hash_content(self) -> str:
        return digest(self.arrays, f"ArraySource {self.name!r}")


class SequenceSource(Source):
    """Any object with ``__len__`` and ``__getitem__`` (grain's data-source protocol).

    ``read_many`` calls the object's ``__getitems__`` when it has one, else
    ``__getitem__`` per id. See :meth:`identity` for how it is described.

    Args:
        obj: the object.
        name: the source's name (default: ``obj.name`` when a string, else its type's name).

    Raises:
        TypeError: ``obj`` lacks ``__len__`` or ``__getitem__``.

    Example:
        >>> src = SequenceSource(["a", "b", "c"], name="letters")
        >>> src.name, src.read_many(np.array([2, 0]))
        ('letters', ['c', 'a'])
    """

    def __init__(self, obj: Any, name: str | None = None):
        if not (hasattr(obj, "__len__") and hasattr(obj, "__getitem__")):
            raise TypeError(f"a source needs __len__ and __getitem__; {type(obj).__name__} has not both")
        self.obj = obj
        self.name = name or getattr(obj, "name", None) or type(obj).__name__
        if not isinstance(self.name, str):
            self.name = type(obj).__name__

    def __len__(self) -> int:
        return len(self.obj)

    def read_many(self, ids: np.ndarray) -> list:
        """The records ``ids``, in that order.

        Args:
            ids: record ids in ``[0, len(self))``.

        Returns:
            A list of what the object returns for them.

        Raises:
            IndexError: an id is out of range.
            SourceError: ``__getitems__`` returned another number of records.
        """
        ids = check_ids(ids, len(self), f"source {self.name!r}")
        getitems = getattr(self.obj, "__getitems__", None)
        if getitems is not None:
            records = list(getitems(ids.tolist()))
            if len(records) != len(ids):
                raise SourceError(
                    f"source {self.name!r}: __getitems__ returned {len(records)} records for {len(ids)} ids"
                )
            return records
        return [self.obj[i] for i in ids.tolist()]

    def identity(self) -> dict:
        """A description of the data for the pipeline fingerprint.

        Returns:
            The type, name, length, the wrapped object's type (``object``) and either

            - ``identity``: the digest of ``obj.identity()`` when the object has
              that method (a quern source, or any object that describes its data),
            - ``fingerprint``: the string ``obj.fingerprint()`` returns when it has
              that method, or else
            - ``sample``: the digest of the records :func:`sample_ids` picks (first,
              last and five keyed ones, read in one ``read_many``), by content
              (:func:`~quern.pipeline.identity.hashing.digest`), never by ``repr``: the same
              data gives the same identity in every process.

        Raises:
            FingerprintError: a sampled record cannot be described by its content,
                or ``fingerprint()`` returned something else than a string; the
                message names the source and the record.
        """
        obj = self.obj
        out = {**super().identity(), "object": type(obj).__qualname__}  # not its module: __main__ or imported
        if callable(getattr(obj, "identity", None)):
            return {**out, "identity": digest(obj.identity(), f"source {self.name!r}: identity()")}
        if callable(getattr(obj, "fingerprint", None)):
            fp = obj.fingerprint()
            if not isinstance(fp, str):
                raise FingerprintError(
                    f"source {self.name!r}: {type(obj).__qualname__}.fingerprint() returned {type(fp).__name__}, "
                    "not a string"
                )
            return {**out, "fingerprint": fp}
        ids = sample_ids(len(self))
        records = self.read_many(np.asarray(ids, dtype=np.int64))
        for i, rec in zip(ids, records):
            try:
                digest(rec, f"record {i}")
            except FingerprintError as e:
                what = str(e).split("; ", 1)[0]  # digest's own advice is about transforms, not sources
                raise FingerprintError(
                    f"source {self.name!r} ({out['object']}): cannot fingerprint record {i} ({what}); give the "
                    "source object an identity() method returning a description of its data (a dict of numbers "
                    "and strings) or a fingerprint() method returning a string that changes whenever its data does"
                ) from e
        return {**out, "sample": digest(list(zip(ids, records)), f"source {self.name!r}")}


def as_source(obj: Any) -> Source:
    """``obj`` as a :class:`Source`.

    Args:
        obj: a quern source (returned as it is), an array or a dict of arrays
            (an :class:`ArraySource`), or another object with ``__len__`` and
            ``__getitem__`` (a :class:`SequenceSource`).

    Returns:
        The source.

    Raises:
        TypeError: as the constructors.

    Example:
        >>> type(as_source(np.zeros(3))).__name__, type(as_source(range(3))).__name__
        ('ArraySource', 'SequenceSource')
    """
    if isinstance(obj, Source):
        return obj
    if isinstance(obj, (Mapping, np.ndarray)):
        return ArraySource(obj)
    return SequenceSource(obj)
