"""The plan: from a step to its rows, and from each row to its segment ``(component, record id)``.

Pure index arithmetic over the definition and precomputed metadata (a filter's
survivors); everything downstream (read, transform, collate, host slice) only
executes it. :mod:`.mixture` maps positions to components; :mod:`.survivors`
keeps the records a filter keeps.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from . import components as mixture
from . import indexfile, packing, survivors

__all__ = ["Segments", "Pieces", "indexfile", "mixture", "packing", "survivors"]


class Segments(NamedTuple):
    """Where each row of a step comes from.

    Attributes:
        component: per row, an index into the definition's leaves (0 for a single
            source), ``int64``.
        ids: per row, the record id in that component's source, ``int64``.
        positions: per row, its position in that component's own stream (which keys
            its random transforms), ``int64``.
    """

    component: np.ndarray  # int64
    ids: np.ndarray  # int64
    positions: np.ndarray  # int64

    def take(self, sel: slice | np.ndarray) -> Segments:
        """The rows ``sel`` of these segments.

        Args:
            sel: a slice, a mask or indices.

        Returns:
            The selected rows, in the order ``sel`` gives.
        """
        return Segments(self.component[sel], self.ids[sel], self.positions[sel])


class Pieces(NamedTuple):
    """The documents in packed rows.

    Piece ``i`` is tokens ``[start[i], start[i] + length[i])`` of record
    ``ids[i]``, in row ``row[i]``; a row's pieces are consecutive, in the row's
    order. Every array is ``int64``.

    Attributes:
        row: the row of each piece (an index into the rows asked for).
        ids: the record of each piece.
        start: its first token in the record.
        length: its tokens.
    """

    row: np.ndarray  # int64
    ids: np.ndarray  # int64
    start: np.ndarray  # int64
    length: np.ndarray  # int64
