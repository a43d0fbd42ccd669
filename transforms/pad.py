"""Padding or truncating variable-length arrays to a fixed length."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, ClassVar

import numpy as np

from ..pipeline.core.collate import CollatedRows, collate
from ..pipeline.core.errors import CollateError
from ..pipeline.core.registry import register

__all__ = ["Pad", "pad"]


@register("pad")
@dataclasses.dataclass(frozen=True)
class Pad:
    """The transform :func:`pad` makes (its fields are :func:`pad`'s arguments)."""

    VERSION: ClassVar[int] = 1  # in the fingerprint: bump it when what it computes changes

    length: int
    key: str | None = None
    pad_value: Any = 0
    output: str = "tokens"
    length_key: str | None = "length"
    mask_key: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.length, bool) or not isinstance(self.length, (int, np.integer)) or self.length < 1:
            raise ValueError(f"pad length must be a positive integer, got {self.length!r}")
        object.__setattr__(self, "length", int(self.length))  # numpy scalars: same value, same fingerprint
        if isinstance(self.pad_value, np.generic):
            object.__setattr__(self, "pad_value", self.pad_value.item())

    def _fields(self, record: Any, out: np.ndarray, n: int, mask: np.ndarray | None) -> dict:
        fields = {k: v for k, v in record.items() if k != self.key} if isinstance(record, dict) else {}
        fields[self.output] = out
        if self.length_key is not None:
            fields[self.length_key] = np.int32(n)
        if mask is not None:
            fields[self.mask_key] = mask
        return fields

    def __call__(self, record: Any) -> dict:
        """Pad one record (see :meth:`map_many`)."""
        return self.map_many([record])[0]

    def map_many(self, records: Sequence[Any]) -> Sequence[Any]:
        """Pad a list of records into one preallocated block.

        Args:
            records: the records (arrays, or dicts holding the array under ``key``).

        Returns:
            Collated rows when the records' other fields collate, else one dict per record.

        Raises:
            ValueError: an array has no axis.
            CollateError: the records disagree in dtype or trailing shape (its ``row``
                is the index in ``records``).
        """
        if not len(records):
            return []
        arrays = [r[self.key] for r in records] if self.key is not None else list(records)
        if not all(type(a) is np.ndarray for a in arrays):
            arrays = [np.asarray(a) for a in arrays]
        first = arrays[0]
        if first.ndim < 1:
            raise ValueError(f"pad expects an array with at least one axis, got shape {first.shape}")
        tail, dtype = first.shape[1:], first.dtype
        if not all(a.ndim == first.ndim for a in arrays) or (tail and not all(a.shape[1:] == tail for a in arrays)):
            i = next(i for i, a in enumerate(arrays) if a.ndim != first.ndim or a.shape[1:] != tail)
            raise CollateError(f"pad: row {i} has shape {arrays[i].shape}, row 0 has {first.shape}", i)
        if not all(a.dtype is dtype or a.dtype == dtype for a in arrays):  # like collate: never promoted
            i = next(i for i, a in enumerate(arrays) if a.dtype != dtype)
            raise CollateError(
                f"pad: row {i} has dtype {arrays[i].dtype}, row 0 has {dtype}: rows of different dtypes are not "
                f"promoted; convert them to one dtype first (e.g. decode(np.{dtype.name}))",
                i,
            )
        L = self.length  # noqa: N806 - the padded length, as in the shapes (B, L)
        shape = (len(arrays), L) + tail
        block = np.zeros(shape, dtype) if self.pad_value == 0 else np.full(shape, self.pad_value, dtype)
        lengths = np.fromiter(map(len, arrays), dtype=np.int64, count=len(arrays))
        np.minimum(lengths, L, out=lengths)
        for i, (a, n) in enumerate(zip(arrays, lengths.tolist())):
            block[i, :n] = a[:n]
        lengths = lengths.astype(np.int32)
        masks = np.arange(L) < lengths[:, None] if self.mask_key is not None else None
        batch: dict = {}
        if any(isinstance(r, dict) for r in records):
            rest = _collate_other_fields(records, self.key)
            if rest is None:  # records disagree in their fields: let the collate stage report it
                return [
                    self._fields(r, block[i], int(lengths[i]), None if masks is None else masks[i])
                    for i, r in enumerate(records)
                ]
            batch.update(rest)
        batch[self.output] = block
        if self.length_key is not None:
            batch[self.length_key] = lengths
        if masks is not None:
            batch[self.mask_key] = masks
        return CollatedRows(batch, len(records))


def pad(
    length: int,
    *,
    key: str | None = None,
    pad_value: Any = 0,
    output: str = "tokens",
    length_key: str | None = "length",
    mask_key: str | None = None,
) -> Pad:
    """A record transform padding (with ``pad_value``) or truncating an array to ``length`` along axis 0.

    The output depends only on the input array and these settings. Records passed
    together to ``map_many`` must agree in dtype and trailing shape, as collation
    requires (dtypes are never promoted).

    Args:
        length: the fixed length, a positive integer.
        key: the record is a dict whose ``key`` field is the array; ``None``: the record is the array.
        pad_value: the value of the padding items.
        output: the output field holding the fixed-length array.
        length_key: the output field holding the ``int32`` count of real items kept (``None``: none).
        mask_key: the output field holding a boolean mask of real items (``None``: none).

    Returns:
        A :class:`Pad` transform: records become dicts with ``output``,
        ``length_key`` and ``mask_key``; other dict fields pass through.

    Raises:
        ValueError: ``length`` is not a positive integer.

    Example:
        >>> import numpy as np
        >>> pad(4, mask_key="mask")(np.array([7, 8]))["tokens"].tolist()
        [7, 8, 0, 0]
    """
    return Pad(length, key, pad_value, output, length_key, mask_key)


def _collate_other_fields(records: Sequence[Any], key: str | None) -> dict | None:
    """The records' fields other than ``key``, collated; ``None`` if they cannot be."""
    first = records[0]
    if not all(isinstance(r, dict) for r in records):
        return None
    keys = [k for k in first if k != key]
    if not all(len(r) == len(first) and all(k in r for k in keys) for r in records):
        return None
    try:
        return {k: collate([r[k] for r in records]) for k in keys}
    except ValueError:
        return None
