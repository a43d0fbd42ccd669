"""Filters that read a prepared source's metadata index instead of its records."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, ClassVar

import numpy as np

from ..pipeline.core.registry import register

__all__ = ["MetadataRange", "metadata_range"]


@register("metadata_range")
@dataclasses.dataclass(frozen=True)
class MetadataRange:
    """The filter predicate :func:`metadata_range` makes (its fields are its arguments).

    It keeps the records whose ``field`` (``length``, or a field given to
    ``quern prepare --fields``) lies in ``[min, max]`` (either bound may be
    ``None``). ``Pipeline.filter(metadata_range(...))`` on a source with a metadata index (an
    ``ArrayRecordSource`` of a prepared folder) finds the survivors from the index
    alone, vectorised, without reading a record. The result depends only on the
    metadata and the bounds.
    """

    VERSION: ClassVar[int] = 1  # in the fingerprint: bump it when what it computes changes

    field: str = "length"
    min: int | float | None = None
    max: int | float | None = None

    def __post_init__(self) -> None:
        for name in ("min", "max"):
            v = getattr(self, name)
            if isinstance(v, np.generic):
                object.__setattr__(self, name, v.item())
                v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))):
                raise TypeError(f"metadata_range {name} must be a number or None, got {v!r}")
        if self.min is not None and self.max is not None and self.min > self.max:
            raise ValueError(f"metadata_range: min {self.min} > max {self.max}")

    def keep_metadata(self, metadata: Mapping[str, np.ndarray]) -> np.ndarray:
        """One boolean per record: whether its ``field`` lies in ``[min, max]``.

        Args:
            metadata: the source's metadata index, one array per field.

        Returns:
            A boolean array of ``metadata[field]``'s shape.

        Raises:
            KeyError: ``metadata`` has no ``field``.
        """
        if self.field not in metadata:
            raise KeyError(f"metadata_range: no metadata field {self.field!r} (the source has {sorted(metadata)})")
        values = np.asarray(metadata[self.field])
        keep = np.ones(values.shape, dtype=np.bool_)
        if self.min is not None:
            keep &= values >= self.min
        if self.max is not None:
            keep &= values <= self.max
        return keep

    def __call__(self, record: Any) -> bool:
        """Refuse to judge a record: this predicate reads the metadata index only.

        Raises:
            TypeError: always.
        """
        raise TypeError(
            "metadata_range filters by a source's metadata index (a folder written by quern prepare); "
            "it cannot judge a record"
        )


def metadata_range(
    field: str = "length", *, min: int | float | None = None, max: int | float | None = None
) -> MetadataRange:
    """A filter predicate keeping the records whose metadata ``field`` lies in ``[min, max]``.

    Args:
        field: ``length``, or a field given to ``quern prepare --fields``.
        min: the lower bound, inclusive; ``None``: none.
        max: the upper bound, inclusive; ``None``: none.

    Returns:
        A :class:`MetadataRange` predicate for ``Pipeline.filter``, judged on the
        source's metadata index (no record read).

    Raises:
        TypeError: a bound is not a number.
        ValueError: ``min > max``.

    Example:
        >>> import numpy as np
        >>> metadata_range("length", min=2, max=3).keep_metadata({"length": np.array([1, 2, 3, 4])}).tolist()
        [False, True, True, False]
    """
    return MetadataRange(field, min, max)
