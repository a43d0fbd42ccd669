"""The transform stages of a pipeline definition: their kinds and the ``Op`` record."""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable
from typing import Any

__all__ = ["OpKind", "Op", "RECORD_KINDS", "BATCH_KINDS"]


class OpKind(enum.StrEnum):
    """What a stage applies to and what it is given.

    ``MAP``: ``fn(record)``; ``RANDOM_MAP``: ``fn(record, rng)`` with a numpy
    Generator keyed by (seed, stream position, stage); ``MAP_BATCH``:
    ``fn(batch)``; ``RANDOM_MAP_BATCH``: ``fn(batch, keys)`` with one ``uint64``
    key per row; ``FILTER``: ``fn(record) -> bool``, evaluated once per record by a
    scan (never while a step is computed: the plan holds only the records it
    keeps). The values are the names used in configs and messages."""

    MAP = "map"
    RANDOM_MAP = "random_map"
    MAP_BATCH = "map_batch"
    RANDOM_MAP_BATCH = "random_map_batch"
    FILTER = "filter"


RECORD_KINDS = (OpKind.MAP, OpKind.RANDOM_MAP, OpKind.FILTER)
BATCH_KINDS = (OpKind.MAP_BATCH, OpKind.RANDOM_MAP_BATCH)


@dataclasses.dataclass(frozen=True)
class Op:
    """One transform stage of a pipeline: its kind and the user's callable."""

    kind: OpKind
    fn: Callable[..., Any]

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", OpKind(self.kind))

    @property
    def name(self) -> str:
        """The callable's qualified name, for messages."""
        n = getattr(self.fn, "__qualname__", None) or getattr(self.fn, "__name__", None)
        if isinstance(n, str):
            return n
        text = repr(self.fn)
        return text if len(text) <= 200 else text[:197] + "..."

    def label(self, k: int) -> str:
        """``"map[0] decode"``: the stage's kind, index among its level's stages, and name."""
        return f"{self.kind.value}[{k}] {self.name}"
