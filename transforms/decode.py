"""Decoding raw record bytes into arrays."""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import numpy as np

from ..pipeline.core.registry import register

__all__ = ["Decode", "decode"]


@register("decode")
@dataclasses.dataclass(frozen=True)
class Decode:
    """The transform :func:`decode` makes: ``bytes -> np.ndarray`` of ``dtype``.

    Attributes:
        dtype: the dtype of the items (stored as its ``numpy`` string, e.g. ``"<i4"``).
        shape: the shape to reshape to, one ``-1`` allowed; ``None`` keeps it 1-D.
        key: with a key, the record is a dict and only ``record[key]`` is decoded.
    """

    VERSION: ClassVar[int] = 1  # in the fingerprint: bump it when what it computes changes

    dtype: Any = np.uint8
    shape: tuple[int, ...] | None = None
    key: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", np.dtype(self.dtype).str)
        if self.shape is not None:
            object.__setattr__(self, "shape", tuple(int(s) for s in self.shape))

    def _one(self, data: Any) -> np.ndarray:
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise TypeError(f"decode expects bytes, got {type(data).__name__}")
        itemsize = np.dtype(self.dtype).itemsize
        if len(data) % itemsize:
            raise ValueError(f"record of {len(data)} bytes is not a whole number of {np.dtype(self.dtype)} items")
        arr = np.frombuffer(data, dtype=self.dtype)
        return arr.reshape(self.shape) if self.shape is not None else arr

    def __call__(self, record: Any) -> Any:
        """Decode one record (a new dict with ``key`` decoded when ``key`` is set)."""
        if self.key is None:
            return self._one(record)
        return {**record, self.key: self._one(record[self.key])}

    def map_many(self, records: list) -> list:
        """Decode a list of records (one ``frombuffer`` each on the fast path).

        Args:
            records: the records, as :meth:`__call__` takes them.

        Returns:
            The decoded records, in order.
        """
        if self.key is None and self.shape is None:
            try:  # fast path; on any problem redo record by record for a precise error
                if all(type(r) is bytes for r in records):
                    frombuffer, dtype = np.frombuffer, np.dtype(self.dtype)
                    return [frombuffer(r, dtype) for r in records]
            except ValueError:
                pass
        return [self(r) for r in records]


def decode(dtype: Any = np.uint8, shape: tuple[int, ...] | None = None, *, key: str | None = None) -> Decode:
    """A record transform ``bytes -> np.ndarray`` of ``dtype``, reshaped to ``shape`` if given.

    The output is a read-only view of the input bytes and depends only on them.

    Args:
        dtype: the item dtype (anything ``np.dtype`` takes).
        shape: the shape to reshape to, one ``-1`` allowed; ``None`` keeps it 1-D.
        key: the record is a dict and only ``record[key]`` is decoded (a new dict is returned).

    Returns:
        A :class:`Decode` transform, for ``Pipeline.map``.

    Example:
        >>> import numpy as np
        >>> decode(np.int32)(np.arange(3, dtype=np.int32).tobytes()).tolist()
        [0, 1, 2]
    """
    return Decode(dtype=dtype, shape=shape, key=key)
