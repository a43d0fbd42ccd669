"""Decoding raw record bytes into arrays."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from ..pipeline.registry import register

__all__ = ["decode"]


@register("decode")
@dataclasses.dataclass(frozen=True)
class decode:
    """``bytes -> np.ndarray`` of ``dtype`` (reshaped to ``shape`` if given, one ``-1`` allowed).

    With ``key``, the record is a dict and only ``record[key]`` is decoded (a new
    dict is returned). The output is a read-only view of the input bytes and
    depends only on them. ``map_many`` decodes a list of records.
    """

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
        if self.key is None:
            return self._one(record)
        return {**record, self.key: self._one(record[self.key])}

    def map_many(self, records: list) -> list:
        if self.key is None and self.shape is None:
            try:  # fast path; on any problem redo record by record for a precise error
                if all(type(r) is bytes for r in records):
                    frombuffer, dtype = np.frombuffer, np.dtype(self.dtype)
                    return [frombuffer(r, dtype) for r in records]
            except ValueError:
                pass
        return [self(r) for r in records]
