"""Packing plan: an epoch's documents -> rows of ``seq_len`` tokens, from their lengths only.

Pure index arithmetic over the lengths of an epoch's documents in stream order;
never reads a record. A row is a list of *pieces* ``(document, start, count)``:
tokens ``[start, start + count)`` of that document. Two modes (:data:`PackMode`):
``concat`` cuts the concatenated documents into rows, ``best_fit`` places whole
documents by best-fit decreasing and shuffles the rows, ``first_fit`` places whole
documents in stream order into the first of ``num_bins`` rows that has room and
emits the rows when one does not fit (grain's ``FirstFitPackIterDataset`` without
its bin shuffle). The plan depends only on (the lengths in stream order,
``seq_len``, the mode and its settings, the seed, the epoch).
The algorithms and their costs are described in ``docs/design/packing.md``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Literal, NamedTuple, get_args

import numpy as np

from . import index as _index
from .first_fit import first_fit
from .growing import EpochIds, Growing, PlanArrays

__all__ = [
    "PACK_SALT",
    "MODES",
    "PackMode",
    "EpochPlan",
    "plan_epoch",
    "best_fit_decreasing",
    "first_fit",
    "best_fit_capped",
    "GrowingConcat",
    "check_fit",
    "check_agree",
]

PACK_SALT = 4  # part of the published order: the key of a packed epoch's row order
PackMode = Literal["best_fit", "concat", "first_fit"]
"""The packing modes (see the module docstring)."""
MODES: tuple[str, ...] = get_args(PackMode)


class EpochPlan(NamedTuple):
    """The rows of one epoch, as pieces of documents.

    Row ``r`` holds pieces ``[row_ptr[r], row_ptr[r + 1])``; piece ``i`` is tokens
    ``[start[i], start[i] + length[i])`` of the document at index ``doc[i]`` of
    the epoch's stream order. Every array is ``int64``.

    Attributes:
        row_ptr: the first piece of each row, and the number of pieces (rows + 1 values).
        doc: the document of each piece.
        start: the first token of each piece in its document.
        length: the tokens of each piece.
    """

    row_ptr: np.ndarray  # int64, rows + 1
    doc: np.ndarray  # int64
    start: np.ndarray  # int64
    length: np.ndarray  # int64

    @property
    def rows(self) -> int:
        """The number of rows."""
        return len(self.row_ptr) - 1


def best_fit_decreasing(lengths: np.ndarray, seq_len: int) -> tuple[np.ndarray, int]:
    """Place items into rows of ``seq_len`` by best-fit decreasing.

    Longest first (ties by index), each item goes into the row with the least
    room that still fits it (among equal room, the row opened first), a new row
    when none does.

    Args:
        lengths: the items' lengths, each in ``1..seq_len``.
        seq_len: the room of a row.

    Returns:
        ``(row of each item, number of rows)``; rows are numbered in the order they
        are opened. Depends only on the arguments.

    Example:
        >>> rows, n = best_fit_decreasing(np.array([3, 2, 2, 1]), 4)
        >>> rows.tolist(), n
        ([0, 1, 1, 0], 2)
    """
    seq_len = int(seq_len)
    n = len(lengths)
    out = np.empty(n, dtype=np.int64)
    if not n:
        return out, 0
    lengths = np.asarray(lengths, dtype=np.int64)
    room = (seq_len - lengths).astype(np.uint16 if seq_len < 1 << 16 else np.uint32)  # small ints: a radix sort
    order = np.argsort(room, kind="stable")  # longest first, ties by index
    sl = lengths[order]
    cuts = np.flatnonzero(np.diff(sl)) + 1
    starts = np.concatenate([[0], cuts]).tolist()
    ends = np.concatenate([cuts, [n]]).tolist()
    counts = np.zeros(seq_len + 1, dtype=np.int64)  # rows by the room they have left
    members: list[list[np.ndarray]] = [[] for _ in range(seq_len + 1)]  # their ids, in the order they got there
    placed = np.empty(n, dtype=np.int64)  # row of each item, in sorted order
    rows = 0

    def put(ids: np.ndarray, room: int) -> None:
        if ids.size and room > 0:
            members[room].append(ids)
            counts[room] += ids.size

    for a, b in zip(starts, ends):
        ell, todo, pos = int(sl[a]), b - a, a
        while todo:
            feasible = np.flatnonzero(counts[ell:])
            if not feasible.size:
                break
            c = ell + int(feasible[0])  # the least room that fits: every row there takes c // ell items
            group = np.sort(np.concatenate(members[c]))  # equal room: the row opened first first
            members[c], counts[c] = [], 0
            q = c // ell
            take = min(todo, group.size * q)
            full, rest = divmod(take, q)
            placed[pos : pos + full * q] = np.repeat(group[:full], q)
            if rest:
                placed[pos + full * q : pos + take] = group[full]
            pos, todo = pos + take, todo - take
            put(group[:full], c - q * ell)
            if rest:
                put(group[full : full + 1], c - rest * ell)
            put(group[full + (1 if rest else 0) :], c)
        if todo:  # new rows, each filled with this length while it fits
            q = seq_len // ell
            k = -(-todo // q)
            new = np.arange(rows, rows + k, dtype=np.int64)
            rows += k
            placed[pos : pos + todo] = np.repeat(new, q)[:todo]
            full, rest = divmod(todo, q)
            put(new[:full], seq_len - q * ell)
            if rest:
                put(new[full : full + 1], seq_len - rest * ell)
    out[order] = placed
    return out, rows


def _first_fit(lengths: np.ndarray, seq_len: int | Sequence[int], num_bins: int, max_per_bin: int | None) -> EpochPlan:
    row, rows = first_fit(lengths, seq_len, num_bins, max_per_bin)
    doc = np.flatnonzero(row >= 0)
    order = np.lexsort((doc, row[doc]))  # by row, then stream order inside a row
    doc = doc[order].astype(np.int64)
    row_ptr = np.searchsorted(row[doc], np.arange(rows + 1), side="left").astype(np.int64)
    first = np.asarray(lengths, dtype=np.int64).reshape(len(lengths), -1)[:, 0]
    return EpochPlan(row_ptr, doc, np.zeros(len(doc), dtype=np.int64), first[doc])


def best_fit_capped(lengths: np.ndarray, seq_len: int, max_per_bin: int) -> tuple[np.ndarray, int]:
    """:func:`best_fit_decreasing` with at most ``max_per_bin`` items per row.

    The same order (longest first, ties by index) and choice (the row with the least
    room that fits the item, among equal room the row opened first), among the rows
    that hold fewer than ``max_per_bin`` items. One step per item (a search of the
    rooms with a free row), so slower than the uncapped form: about 1 s per 10**5 items.

    Args:
        lengths: the items' lengths, each in ``1..seq_len``.
        seq_len: the room of a row.
        max_per_bin: items per row at most, at least 1.

    Returns:
        ``(row of each item, number of rows)``, rows numbered in the order they are opened.

    Example:
        >>> rows, n = best_fit_capped(np.array([3, 1, 1, 1]), 4, 2)
        >>> rows.tolist(), n
        ([0, 0, 1, 1], 2)
    """
    import heapq

    seq_len, lengths = int(seq_len), np.asarray(lengths, dtype=np.int64)
    out = np.empty(len(lengths), dtype=np.int64)
    counts = np.zeros(seq_len + 1, dtype=np.int64)  # open rows (below the cap) by the room they have left
    rows_at: list[list[int]] = [[] for _ in range(seq_len + 1)]  # their ids, a heap: the first opened first
    held: list[int] = []  # items per row
    for i in np.argsort(seq_len - lengths, kind="stable").tolist():
        n = int(lengths[i])
        free = np.flatnonzero(counts[n:])
        if free.size:
            room = n + int(free[0])
            row = heapq.heappop(rows_at[room])
            counts[room] -= 1
        else:
            row, room = len(held), seq_len
            held.append(0)
        out[i] = row
        held[row] += 1
        left = room - n
        if left > 0 and held[row] < max_per_bin:
            heapq.heappush(rows_at[left], row)
            counts[left] += 1
    return out, len(held)


def _concat(lengths: np.ndarray, seq_len: int) -> EpochPlan:
    ends = np.cumsum(lengths)
    begins = ends - lengths
    total = int(ends[-1]) if len(ends) else 0
    rows = -(-total // seq_len)
    live = np.flatnonzero(lengths > 0)
    first = begins[live] // seq_len
    last = (ends[live] - 1) // seq_len
    n_pieces = last - first + 1
    doc = np.repeat(live, n_pieces)
    k = np.arange(n_pieces.sum()) - np.repeat(np.cumsum(n_pieces) - n_pieces, n_pieces)
    row = np.repeat(first, n_pieces) + k
    lo = np.maximum(row * seq_len, begins[doc])
    hi = np.minimum((row + 1) * seq_len, ends[doc])
    row_ptr = np.searchsorted(row, np.arange(rows + 1), side="left").astype(np.int64)
    return EpochPlan(row_ptr, doc.astype(np.int64), (lo - begins[doc]).astype(np.int64), (hi - lo).astype(np.int64))


class GrowingConcat(Growing):
    """An epoch's ``concat`` plan, built window by window as rows are asked for (:class:`Growing`).

    Row ``r`` is closed once the documents measured hold ``(r + 1) * seq_len`` tokens, or
    the epoch is complete (its last row may be short). The closed rows are those of
    ``plan_epoch(lengths, seq_len, "concat", ...)`` over the whole epoch.

    Example:
        >>> g = GrowingConcat(np.arange(4), lambda ids: np.array([3, 2, 2, 1])[ids], 4, first_window=2)
        >>> g.extend_to(1); g.closed(), g.done
        (1, 2)
        >>> g.extend_to(9); g.closed(), g.plan()[1].tolist()
        (2, [0, 1, 1, 2, 3])
    """

    def __init__(
        self,
        ids: EpochIds,
        measure: Callable[[np.ndarray], np.ndarray],
        seq_len: int,
        first_window: int = 64,
        max_window: int = 8192,
    ) -> None:
        super().__init__(ids, measure, first_window, max_window)
        self.seq_len = int(seq_len)
        self.tokens = 0
        self._lengths: list[np.ndarray] = []  # per window, the documents' (first-column) lengths

    def closed(self) -> int:
        """Full rows so far; once complete, every row (the last one may be short)."""
        return -(-self.tokens // self.seq_len) if self.complete else self.tokens // self.seq_len

    def _place(self, lengths: np.ndarray) -> None:
        self._lengths.append(lengths[:, 0])
        self.tokens += int(lengths[:, 0].sum())

    def _finish(self) -> None:
        pass  # closed() counts the short last row once complete

    def _make_plan(self) -> PlanArrays:
        lengths = np.concatenate(self._lengths) if self._lengths else np.zeros(0, dtype=np.int64)
        plan = _concat(lengths, self.seq_len)
        rows = self.closed()
        cut = int(plan.row_ptr[rows])
        return plan.row_ptr[: rows + 1], plan.doc[:cut], plan.start[:cut], plan.length[:cut]


def _best_fit(lengths: np.ndarray, seq_len: int, key: np.ndarray, max_per_bin: int | None = None) -> EpochPlan:
    whole = lengths // seq_len  # full pieces of long documents: a row each
    rem = lengths - whole * seq_len
    long_docs = np.flatnonzero(whole > 0)
    n_full = int(whole.sum())
    full_doc = np.repeat(long_docs, whole[long_docs])
    full_k = np.arange(n_full) - np.repeat(np.cumsum(whole[long_docs]) - whole[long_docs], whole[long_docs])
    small = np.flatnonzero(rem > 0)
    if max_per_bin is None:
        bins, n_bins = best_fit_decreasing(rem[small], seq_len)
    else:
        bins, n_bins = best_fit_capped(rem[small], seq_len, max_per_bin)
    rows = n_full + n_bins
    # pieces: the full ones (row i of the first n_full), then the remainders (rows n_full + bin)
    doc = np.concatenate([full_doc, small]).astype(np.int64)
    start = np.concatenate([full_k * seq_len, whole[small] * seq_len]).astype(np.int64)
    count = np.concatenate([np.full(n_full, seq_len, dtype=np.int64), rem[small]]).astype(np.int64)
    row = np.concatenate([np.arange(n_full, dtype=np.int64), n_full + bins])
    if rows:
        row = _index.permute(np.arange(rows, dtype=np.int64), rows, key)[row]  # a keyed random order of the rows
    order = np.lexsort((doc, row))  # by row, then stream order inside a row
    row_ptr = np.searchsorted(row[order], np.arange(rows + 1), side="left").astype(np.int64)
    return EpochPlan(row_ptr, doc[order], start[order], count[order])


def plan_epoch(
    lengths: np.ndarray,
    seq_len: int | Sequence[int],
    mode: PackMode,
    seed: int,
    epoch: int,
    num_bins: int | None = None,
    max_per_bin: int | None = None,
) -> EpochPlan:
    """The rows of an epoch whose documents, in stream order, have ``lengths`` tokens.

    Documents of 0 tokens are left out.

    Args:
        lengths: the tokens of each document of the epoch, in stream order (``first_fit``:
            ``(n, c)`` for ``c`` columns, ``seq_len`` then one room per column).
        seq_len: the tokens per row.
        mode: ``"best_fit"``, ``"concat"`` or ``"first_fit"`` (see the module docstring).
        seed: the pipeline's seed (keys the row order of ``best_fit``).
        epoch: the epoch (keys the row order of ``best_fit``).
        num_bins: ``first_fit``'s rows per batch.
        max_per_bin: documents per row at most (``first_fit`` and ``best_fit``; ``None``: no limit).

    Returns:
        The epoch's rows, depending only on the arguments. ``first_fit``'s pieces are
        whole documents (``start`` 0, ``length`` their first column's).

    Raises:
        ValueError: an unknown ``mode``.
        ValueError: a document longer than its row with ``first_fit``.

    Example:
        >>> plan = plan_epoch(np.array([3, 2, 2]), 4, "concat", 0, 0)
        >>> plan.rows, plan.doc.tolist(), plan.length.tolist()
        (2, [0, 1, 1, 2], [3, 1, 1, 2])
    """
    if mode == "first_fit":
        return _first_fit(lengths, seq_len, num_bins or 1, max_per_bin)
    lengths = np.asarray(lengths, dtype=np.int64)
    room = int(np.max(seq_len))  # one room: the modes that cut documents cut all columns alike
    if mode == "concat":
        return _concat(lengths, room)
    if mode == "best_fit":
        return _best_fit(lengths, room, _index.derive_key(seed, PACK_SALT, epoch), max_per_bin)
    raise ValueError(f"packing mode must be one of {MODES}, got {mode!r}")


def check_fit(table: np.ndarray, ids: np.ndarray, names: Sequence[str], rooms: Sequence[int], source: str) -> None:
    """``first_fit`` never cuts a document: a ``ValueError`` naming the first of records ``ids`` longer than its row.

    ``table`` holds their lengths, one column per packed column (named ``names``, rows of ``rooms`` tokens).
    """
    over = table > np.asarray(rooms)
    if over.any():
        i, c = (int(x[0]) for x in np.nonzero(over))
        raise ValueError(
            f"pack(mode='first_fit'): record {int(ids[i])} of source {source!r} has {int(table[i, c])} tokens in "
            f"{names[c]!r}, more than its row of {int(rooms[c])}; first_fit places whole documents: truncate them "
            f"first (quern.transforms.pad({int(rooms[c])}) truncates) or cut them with flat_map()"
        )


def check_agree(table: np.ndarray, ids: np.ndarray, names: Sequence[str], source: str) -> None:
    """Columns cut together need one length per record: a ``ValueError`` naming the first of records ``ids`` that has two.

    ``table`` holds their lengths, ``(len(ids), len(names))``.
    """
    bad = np.flatnonzero((table != table[:, :1]).any(axis=1))
    if bad.size:
        r = int(bad[0])
        c = int(np.flatnonzero(table[r] != table[r, 0])[0])
        raise ValueError(
            f"pack(): record {int(ids[r])} of source {source!r} has {int(table[r, c])} tokens in column {names[c]!r} "
            f"and {int(table[r, 0])} in {names[0]!r}; best_fit and concat cut the columns together, so they must "
            "agree (first_fit packs columns of different lengths)"
        )
