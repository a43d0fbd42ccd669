"""Packing plan: an epoch's documents -> rows of ``seq_len`` tokens, from their lengths only.

Pure index arithmetic over the lengths of an epoch's documents in stream order
(the length index read at the epoch's record ids); never reads a record. A
row is a list of *pieces* ``(document, start, count)``: tokens
``[start, start + count)`` of that document.

- ``concat``: the epoch's documents are concatenated in stream order and cut
  into rows of ``seq_len`` tokens; a document may continue in the next row.
  The epoch has ``ceil(T / seq_len)`` rows for ``T`` tokens (the same in every
  epoch: a closed form); its last row is padded.
- ``best_fit``: whole documents are placed into rows. A document longer than
  ``seq_len`` is first cut into ``seq_len`` pieces, each a row of its own, and
  its remainder is a document like the others. The documents are placed by
  *best-fit decreasing*: longest first (ties by stream order), each into the
  row with the least room that still fits it, a new row when none does. This
  is computed vectorised over runs of equal lengths and classes of equal room
  (no loop per document): O(N log N + L x S) for N documents, L distinct
  lengths and ``S = seq_len``; among rows with equal room, the one opened first
  takes the document. The rows are then put in a keyed random order
  (``derive_key(seed, PACK_SALT, epoch)``), so long and short documents are
  spread over the epoch; inside a row the pieces keep stream order. The number
  of rows is the same in every epoch: best-fit decreasing depends only on the
  lengths, not on their order (ties between equal lengths move documents
  between rows, never the count).

Everything depends only on (the lengths in stream order, ``seq_len``, the
mode, the seed, the epoch).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from .. import index as _index

__all__ = ["PACK_SALT", "MODES", "EpochPlan", "plan_epoch", "best_fit_decreasing"]

PACK_SALT = 4  # part of the published order: the key of a packed epoch's row order
MODES = ("best_fit", "concat")


class EpochPlan(NamedTuple):
    """The rows of one epoch: row ``r`` holds pieces ``[row_ptr[r], row_ptr[r + 1])``;
    piece ``i`` is tokens ``[start[i], start[i] + length[i])`` of the document at index
    ``doc[i]`` of the epoch's stream order."""

    row_ptr: np.ndarray  # int64, rows + 1
    doc: np.ndarray  # int64
    start: np.ndarray  # int64
    length: np.ndarray  # int64

    @property
    def rows(self) -> int:
        return len(self.row_ptr) - 1


def best_fit_decreasing(lengths: np.ndarray, seq_len: int) -> tuple[np.ndarray, int]:
    """The row of each item (lengths in ``1..seq_len``) under best-fit decreasing, and
    the number of rows. Rows are numbered in the order they are opened."""
    S = int(seq_len)
    n = len(lengths)
    out = np.empty(n, dtype=np.int64)
    if not n:
        return out, 0
    lengths = np.asarray(lengths, dtype=np.int64)
    room = (S - lengths).astype(np.uint16 if S < 1 << 16 else np.uint32)  # small ints: a radix sort
    order = np.argsort(room, kind="stable")  # longest first, ties by index
    sl = lengths[order]
    cuts = np.flatnonzero(np.diff(sl)) + 1
    starts = np.concatenate([[0], cuts]).tolist()
    ends = np.concatenate([cuts, [n]]).tolist()
    counts = np.zeros(S + 1, dtype=np.int64)  # rows by the room they have left
    members: list[list[np.ndarray]] = [[] for _ in range(S + 1)]  # their ids, in the order they got there
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
            q = S // ell
            k = -(-todo // q)
            new = np.arange(rows, rows + k, dtype=np.int64)
            rows += k
            placed[pos : pos + todo] = np.repeat(new, q)[:todo]
            full, rest = divmod(todo, q)
            put(new[:full], S - q * ell)
            if rest:
                put(new[full : full + 1], S - rest * ell)
    out[order] = placed
    return out, rows


def _concat(lengths: np.ndarray, S: int) -> EpochPlan:
    ends = np.cumsum(lengths)
    begins = ends - lengths
    total = int(ends[-1]) if len(ends) else 0
    rows = -(-total // S)
    live = np.flatnonzero(lengths > 0)
    first = begins[live] // S
    last = (ends[live] - 1) // S
    n_pieces = last - first + 1
    doc = np.repeat(live, n_pieces)
    k = np.arange(n_pieces.sum()) - np.repeat(np.cumsum(n_pieces) - n_pieces, n_pieces)
    row = np.repeat(first, n_pieces) + k
    lo = np.maximum(row * S, begins[doc])
    hi = np.minimum((row + 1) * S, ends[doc])
    row_ptr = np.searchsorted(row, np.arange(rows + 1), side="left").astype(np.int64)
    return EpochPlan(row_ptr, doc.astype(np.int64), (lo - begins[doc]).astype(np.int64), (hi - lo).astype(np.int64))


def _best_fit(lengths: np.ndarray, S: int, key: np.ndarray) -> EpochPlan:
    whole = lengths // S  # full pieces of long documents: a row each
    rem = lengths - whole * S
    long_docs = np.flatnonzero(whole > 0)
    n_full = int(whole.sum())
    full_doc = np.repeat(long_docs, whole[long_docs])
    full_k = np.arange(n_full) - np.repeat(np.cumsum(whole[long_docs]) - whole[long_docs], whole[long_docs])
    small = np.flatnonzero(rem > 0)
    bins, n_bins = best_fit_decreasing(rem[small], S)
    rows = n_full + n_bins
    # pieces: the full ones (row i of the first n_full), then the remainders (rows n_full + bin)
    doc = np.concatenate([full_doc, small]).astype(np.int64)
    start = np.concatenate([full_k * S, whole[small] * S]).astype(np.int64)
    count = np.concatenate([np.full(n_full, S, dtype=np.int64), rem[small]]).astype(np.int64)
    row = np.concatenate([np.arange(n_full, dtype=np.int64), n_full + bins])
    if rows:
        row = _index.permute(np.arange(rows, dtype=np.int64), rows, key)[row]  # a keyed random order of the rows
    order = np.lexsort((doc, row))  # by row, then stream order inside a row
    row_ptr = np.searchsorted(row[order], np.arange(rows + 1), side="left").astype(np.int64)
    return EpochPlan(row_ptr, doc[order], start[order], count[order])


def plan_epoch(lengths: np.ndarray, seq_len: int, mode: str, seed: int, epoch: int) -> EpochPlan:
    """The rows of an epoch whose documents, in stream order, have ``lengths`` tokens
    (see the module docstring). Documents of 0 tokens are left out."""
    lengths = np.asarray(lengths, dtype=np.int64)
    if mode == "concat":
        return _concat(lengths, int(seq_len))
    if mode == "best_fit":
        return _best_fit(lengths, int(seq_len), _index.derive_key(seed, PACK_SALT, epoch))
    raise ValueError(f"packing mode must be one of {MODES}, got {mode!r}")
