"""Padding or truncating variable-length arrays to a fixed length."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from ..pipeline.collate import CollatedRows

__all__ = ["pad"]


@dataclasses.dataclass(frozen=True)
class pad:
    """Pad (with ``pad_value``) or truncate a 1-D (or N-D along axis 0) array to ``length``.

    Input: an array, or a dict whose ``key`` field is the array. Output: a dict
    with ``output`` (the fixed-length array, default ``"tokens"``), ``length_key``
    (``int32`` count of real items kept, default ``"length"``) and, if
    ``mask_key`` is set, a boolean mask of real items. Other dict fields pass
    through. The output depends only on the input array and these settings.
    ``map_many`` handles a list of records with one preallocated block.
    """

    length: int
    key: str | None = None
    pad_value: Any = 0
    output: str = "tokens"
    length_key: str | None = "length"
    mask_key: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.length, bool) or not isinstance(self.length, (int, np.integer)) or self.length < 1:
            raise ValueError(f"pad length must be a positive integer, got {self.length!r}")

    def _source(self, record: Any) -> np.ndarray:
        arr = record[self.key] if self.key is not None else record
        arr = np.asarray(arr)
        if arr.ndim < 1:
            raise ValueError(f"pad expects an array with at least one axis, got shape {arr.shape}")
        return arr

    def _fields(self, record: Any, out: np.ndarray, n: int, mask: np.ndarray | None) -> dict:
        fields = {k: v for k, v in record.items() if k != self.key} if isinstance(record, dict) else {}
        fields[self.output] = out
        if self.length_key is not None:
            fields[self.length_key] = np.int32(n)
        if mask is not None:
            fields[self.mask_key] = mask
        return fields

    def __call__(self, record: Any) -> dict:
        out = self.map_many([record])[0]
        return out

    def map_many(self, records: list) -> list:
        arrays = [self._source(r) for r in records]
        if not arrays:
            return []
        tail = arrays[0].shape[1:]
        dtype = np.result_type(*{a.dtype for a in arrays[:64]}) if len(arrays) > 1 else arrays[0].dtype
        block = np.full((len(arrays), self.length) + tail, self.pad_value, dtype=dtype)
        lengths = np.empty(len(arrays), dtype=np.int32)
        L = self.length
        for i, a in enumerate(arrays):
            if a.shape[1:] != tail:
                raise ValueError(f"pad: record {i} has trailing shape {a.shape[1:]}, record 0 has {tail}")
            n = min(len(a), L)
            block[i, :n] = a[:n]
            lengths[i] = n
        masks = np.arange(L) < lengths[:, None] if self.mask_key is not None else None
        if any(isinstance(r, dict) for r in records):
            return [
                self._fields(r, block[i], int(lengths[i]), None if masks is None else masks[i])
                for i, r in enumerate(records)
            ]
        batch = {self.output: block}
        if self.length_key is not None:
            batch[self.length_key] = lengths
        if masks is not None:
            batch[self.mask_key] = masks
        return CollatedRows(batch, len(records))
