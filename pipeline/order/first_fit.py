"""grain's first-fit packer, on lengths alone: whole, or window by window.

:class:`FirstFit` places items (documents: their length in each column) in stream
order into batches of ``num_bins`` rows, each into the first row with room; its state
carries from one window of items to the next, so a plan can grow with the documents it
reaches. :func:`first_fit` places a whole list. :class:`GrowingPlan` is an epoch's
plan built window by window (:class:`~quern.pipeline.order.growing.Growing`) from a
callback that measures documents, for packing without a pass over the whole dataset. Every output depends only on the lengths in
stream order, the rooms, ``num_bins`` and ``max_per_bin``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from .growing import EpochIds, Growing, PlanArrays

__all__ = ["FirstFit", "first_fit", "GrowingPlan"]


class FirstFit:
    """First-fit placement whose state carries over from one window of items to the next.

    An item goes into the first row of the current batch where every column has room
    (``fill + length <= room``) and that holds fewer than ``max_per_bin`` items; when none
    has room and the batch has ``num_bins`` rows, the batch is closed and the item opens
    the next one. Items of length 0 in every column are left out.

    Attributes:
        closed: rows of the closed batches (their documents are final).
    """

    def __init__(self, room: int | Sequence[int], num_bins: int, max_per_bin: int | None = None) -> None:
        self.room = np.atleast_1d(np.asarray(room, dtype=np.int64))
        self.num_bins = int(num_bins)
        self.limit = max_per_bin if max_per_bin is not None else None
        self.closed = 0
        self._fill: list[list[int]] = []  # per open row, per column
        self._count: list[int] = []

    @property
    def rows(self) -> int:
        """The rows so far: the closed ones and those of the open batch."""
        return self.closed + len(self._fill)

    def place(self, lengths: np.ndarray) -> np.ndarray:
        """Place the next items; the row of each (``-1``: left out).

        Args:
            lengths: ``(n,)`` or ``(n, c)`` lengths of the next ``n`` items.

        Raises:
            ValueError: an item longer than its room in a column (its index in ``lengths`` named).
        """
        table = np.asarray(lengths, dtype=np.int64).reshape(len(lengths), -1)
        over = table > self.room
        if over.any():
            doc, column = (int(x[0]) for x in np.nonzero(over))
            raise ValueError(
                f"first_fit: item {doc} has length {int(table[doc, column])} in column {column}, more than its room "
                f"{int(self.room[column])}"
            )
        out = np.full(len(table), -1, dtype=np.int64)
        caps = self.room.tolist()
        limit = self.limit if self.limit is not None else len(table) + max(self._count, default=0) + 1
        fills, counts, num_bins = self._fill, self._count, self.num_bins
        if table.shape[1] == 1:  # one column: plain ints (the common case, ~3x faster)
            self._place_one(table[:, 0].tolist(), out, caps[0], limit)
            return out
        for i, item in enumerate(table.tolist()):
            if not any(item):
                continue
            for b, used in enumerate(fills):
                if counts[b] < limit and all(x + y <= c for x, y, c in zip(used, item, caps)):
                    fills[b] = [x + y for x, y in zip(used, item)]
                    counts[b] += 1
                    out[i] = self.closed + b
                    break
            else:
                if len(fills) == num_bins:
                    self.closed += num_bins
                    fills.clear()
                    counts.clear()
                out[i] = self.closed + len(fills)
                fills.append(list(item))
                counts.append(1)
        return out

    def _place_one(self, items: list[int], out: np.ndarray, cap: int, limit: int) -> None:
        """:meth:`place` for one column (``fill`` kept as one-item lists, as for several)."""
        fill = [f[0] for f in self._fill]
        counts, num_bins = self._count, self.num_bins
        for i, n in enumerate(items):
            if not n:
                continue
            for b, f in enumerate(fill):
                if f + n <= cap and counts[b] < limit:
                    fill[b] = f + n
                    counts[b] += 1
                    out[i] = self.closed + b
                    break
            else:
                if len(fill) == num_bins:
                    self.closed += num_bins
                    fill.clear()
                    counts.clear()
                out[i] = self.closed + len(fill)
                fill.append(n)
                counts.append(1)
        self._fill[:] = [[f] for f in fill]

    def finish(self) -> None:
        """Close the open batch (the end of the items)."""
        self.closed += len(self._fill)
        self._fill.clear()
        self._count.clear()


def first_fit(
    lengths: np.ndarray, seq_len: int | Sequence[int], num_bins: int, max_per_bin: int | None = None
) -> tuple[np.ndarray, int]:
    """Place items in order into batches of ``num_bins`` rows, each into the first row with room (:class:`FirstFit`).

    This is grain's ``FirstFitPackIterDataset(num_packing_bins=num_bins,
    max_sequences_per_bin=max_per_bin, shuffle_bins=False)``, row for row.

    Args:
        lengths: ``(n,)`` lengths, or ``(n, c)`` lengths of ``c`` columns.
        seq_len: the room of a row (one value per column for ``(n, c)`` lengths).
        num_bins: rows per batch, at least 1.
        max_per_bin: items per row at most (``None``: no limit).

    Returns:
        ``(row of each item or -1 for an item left out, number of rows)``; rows are
        numbered batch after batch, in the order of the bins. Depends only on the arguments.

    Raises:
        ValueError: an item longer than ``seq_len`` in a column.

    Example:
        >>> rows, n = first_fit(np.array([3, 2, 2, 1, 4]), 4, num_bins=2)
        >>> rows.tolist(), n
        ([0, 1, 1, 0, 2], 3)
    """
    ff = FirstFit(seq_len, num_bins, max_per_bin)
    rows = ff.place(lengths)
    return rows, ff.rows


class GrowingPlan(Growing):
    """An epoch's ``first_fit`` plan, built window by window as rows are asked for (:class:`Growing`).

    The documents are placed by :class:`FirstFit`; a row is closed once its batch of bins
    is (the first document that does not fit has been measured). Pieces are whole
    documents (``start`` 0, ``length`` their first column's).
    """

    def __init__(
        self,
        ids: EpochIds,
        measure: Callable[[np.ndarray], np.ndarray],
        room: int | Sequence[int],
        num_bins: int,
        max_per_bin: int | None = None,
        first_window: int = 64,
        max_window: int = 8192,
    ) -> None:
        super().__init__(ids, measure, first_window, max_window)
        self.ff = FirstFit(room, num_bins, max_per_bin)
        self._rows: list[np.ndarray] = []  # per window, the row of each document
        self._first: list[np.ndarray] = []  # per window, each document's first-column length

    def closed(self) -> int:
        """Rows of the closed batches of bins (all of them once complete)."""
        return self.ff.closed

    def _place(self, lengths: np.ndarray) -> None:
        self._rows.append(self.ff.place(lengths))
        self._first.append(lengths[:, 0])

    def _finish(self) -> None:
        self.ff.finish()

    def _make_plan(self) -> PlanArrays:
        rows = np.concatenate(self._rows) if self._rows else np.zeros(0, dtype=np.int64)
        first = np.concatenate(self._first) if self._first else np.zeros(0, dtype=np.int64)
        closed = self.ff.closed
        doc = np.flatnonzero((rows >= 0) & (rows < closed))
        doc = doc[np.lexsort((doc, rows[doc]))]
        row_ptr = np.searchsorted(rows[doc], np.arange(closed + 1), side="left").astype(np.int64)
        return row_ptr, doc.astype(np.int64), np.zeros(len(doc), dtype=np.int64), first[doc]
