"""The text reports of ``quern run``, ``explain`` and ``inspect``: what the rows are made of.

Every figure comes from the plan (pure index arithmetic: no record is read for
it) unless said otherwise. By kind of stream:

- a mixture: the proportions of rows each component gave over the step(s) shown
  or run, ``components drawn: web 0.897, code 0.103 (steps 0-99, 6,400 rows)``;
  ``explain`` names each row's component (``web[123]``).
- packed rows: the fill (real tokens / (rows x ``seq_len``)) and padding
  (``1 - fill``), ``packing: fill 0.981, padding 0.019, 212 documents (step 3, 64
  rows of 2048 tokens)``, for ``run`` also the lowest and highest fill of one
  step; ``explain`` lists every document of each row with its tokens (a piece of
  a document cut over rows with its token range: ``toks[12][2048:3000]``). A
  document cut over several rows counts once in each.
- length buckets: a step's bucket, rows and padding (padded slots / (rows x the
  bucket's bound)), ``bucket len<=512: 32 rows, padding 0.231 (step 3)``; for
  ``run`` one line per bucket the steps went to and one for all of them, with the
  lowest and highest padding of one step. The real tokens of a step come from the
  bucketing's length index when it keeps one, otherwise from the ``length``
  values of the batch just made (so no record is read twice); without either
  (a batch transform that drops ``length``) the padding is left out.

The figures come from the stream protocol
(:meth:`~quern.pipeline.streams.capabilities.Reportable.draws`,
:meth:`~quern.pipeline.streams.capabilities.Reportable.packed_rows`,
:meth:`~quern.pipeline.streams.capabilities.Reportable.bucket_of`): a stream that has none of
them gets no such line, and no function here asks which kind a stream is.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from ..core.tree import leaves
from ..definition.dataset import Pipeline
from ..streams.capabilities import BucketOfStep, PackedRows, report

__all__ = [
    "PACK_CHUNK",
    "RunReport",
    "batch_lines",
    "explain_json",
    "explain_lines",
    "inspect_lines",
    "row_noun",
]


# --------------------------------------------------------------------------- mixtures


def _drawn(pipe: Pipeline, counts: np.ndarray, what: str) -> str:
    """``components drawn: web 0.897, code 0.103 (what, 6,400 rows)``: each component's share of ``counts``.

    ``counts``: rows per component, in the mixture's order.
    """
    total = int(counts.sum())
    shares = ", ".join(f"{name} {c / max(total, 1):.3f}" for name, c in zip(pipe.leaf_names, counts.tolist()))
    return f"components drawn: {shares} ({what}, {total:,} rows)"


def _count(pipe: Pipeline, first: int, end: int) -> np.ndarray | None:
    """Rows per leaf at the stream positions ``[first, end)`` (the plan; ``None``: one leaf)."""
    return report(pipe.stream).draws(pipe, first, end)


# --------------------------------------------------------------------------- packed rows


def _packing(seq_len: int, tokens: int, rows: int, documents: int, what: str) -> str:
    """``packing: fill 0.981, padding 0.019, 212 documents (what, 64 rows of 2048 tokens)``."""
    fill = tokens / max(rows * seq_len, 1)
    return (
        f"packing: fill {fill:.3f}, padding {1 - fill:.3f}, {documents:,} documents "
        f"({what}, {rows:,} rows of {seq_len} tokens)"
    )


PACK_CHUNK = 1 << 16
"""Rows of a packed stream planned at once by :func:`_per_step` (bounds its memory)."""


def _per_step(pipe: Pipeline, start: int, steps: int) -> tuple[int, np.ndarray, np.ndarray, np.ndarray] | None:
    """``seq_len``, and the tokens, rows and documents (pieces) of each of ``steps`` packed steps from ``start``.

    From the plan (host 0 of 1), in chunks of whole steps; ``None`` when the rows are not packed.
    """
    b = pipe.batch_size or 1
    tokens, rows, docs = (np.zeros(steps, dtype=np.int64) for _ in range(3))
    chunk = max(1, PACK_CHUNK // b)
    seq_len = 0
    for lo in range(start, start + steps, chunk):
        hi = min(lo + chunk, start + steps)
        first, end = int(pipe.positions(lo)[0]), int(pipe.positions(hi - 1)[-1]) + 1  # host 0 of 1: one range
        positions = np.arange(first, end, dtype=np.int64)
        packed = report(pipe.stream).packed_rows(positions)
        if packed is None:
            return None
        seq_len, pieces = packed.seq_len, packed.pieces
        step_of_row = positions // b - start
        step_of_piece = step_of_row[pieces.row]
        tokens += np.bincount(step_of_piece, weights=pieces.length, minlength=steps).astype(np.int64)
        docs += np.bincount(step_of_piece, minlength=steps)
        rows += np.bincount(step_of_row, minlength=steps)
    return seq_len, tokens, rows, docs


def _pieces_text(whole: np.ndarray, name: str, ids: list[int], starts: list[int], lengths: list[int]) -> str:
    """``toks[5], toks[12][2048:3000]``: the documents of one packed row.

    A piece that is not the whole document (``whole``: the tokens of each) is shown with its token range.
    """
    return ", ".join(
        f"{name}[{i}]" if s == 0 and n == int(whole[i]) else f"{name}[{i}][{s}:{s + n}]"
        for i, s, n in zip(ids, starts, lengths)
    )


# --------------------------------------------------------------------------- length buckets


def _real_tokens(bucket: BucketOfStep, batch: Any) -> int | None:
    """The real (unpadded) tokens of a bucketed step's rows.

    From the length index when the bucketing keeps one (index arithmetic), else
    from the ``length`` values of ``batch`` (the step's batch, already made);
    ``None`` when neither is there.
    """
    if bucket.real_tokens is not None:
        return bucket.real_tokens
    if isinstance(batch, dict) and "length" in batch:
        values = np.asarray(batch["length"])
        if values.dtype.kind in "iu":
            return int(values.sum())
    return None


def _padding(real: int | None, rows: int, bound: int) -> str:
    return "" if real is None else f", padding {1 - real / max(rows * bound, 1):.3f}"


def _bucket_line(bucket: BucketOfStep, rows: int, real: int | None, what: str) -> str:
    """``bucket len<=512: 32 rows, padding 0.231 (what)``: one step's bucket."""
    return f"bucket {bucket.name}: {rows:,} rows{_padding(real, rows, bucket.bound)} ({what})"


def _bucket_lines(start: int, of_steps: list[BucketOfStep], rows: list[int], reals: list[int | None]) -> list[str]:
    """The lines ``run`` prints for the bucketed steps from ``start``: one per bucket, then one for all.

    ``of_steps``, ``rows``, ``reals``: each step's bucket, rows and real tokens.
    """
    steps = len(rows)
    buckets = np.asarray([b.bucket for b in of_steps], dtype=np.int64)
    bounds = np.asarray([b.bound for b in of_steps], dtype=np.int64)
    names = {b.bucket: (b.name, b.bound) for b in of_steps}
    n = np.asarray(rows, dtype=np.int64)
    known = all(r is not None for r in reals)
    real = np.asarray([r or 0 for r in reals], dtype=np.int64)
    lines = []
    for b in np.unique(buckets).tolist():
        sel = buckets == b
        got = int(real[sel].sum()) if known else None
        lines.append(
            f"bucket {names[b][0]}: {int(sel.sum()):,} steps, {int(n[sel].sum()):,} rows"
            + _padding(got, int(n[sel].sum()), names[b][1])
        )
    total = f"({_steps(start, steps)}, {int(n.sum()):,} rows)"
    if not known:
        lines.append(f"bucketing: {total}; padding unknown (the batches have no 'length')")
        return lines
    slots = n * bounds
    lines.append(f"bucketing: padding {1 - int(real.sum()) / max(int(slots.sum()), 1):.3f} {total}")
    if steps > 1:
        pads = 1 - real / np.maximum(slots, 1)
        lines[-1] += (
            f"; padding per step: min {pads.min():.3f} (step {start + int(pads.argmin())}), "
            f"max {pads.max():.3f} (step {start + int(pads.argmax())})"
        )
    return lines


# --------------------------------------------------------------------------- the reports of the commands


def _steps(start: int, steps: int) -> str:
    return f"step {start}" if steps == 1 else f"steps {start}-{start + steps - 1}"


def _summary(path: str, leaf: Any) -> str:
    """One line about one array of a batch: dtype, shape, and min/max/mean (and zeros) of numbers."""
    x = np.asarray(leaf)
    line = f"{path}: {x.dtype} {x.shape}"
    if x.dtype.kind in "biuf" and x.size:
        line += f"  min {x.min()}  max {x.max()}  mean {x.astype(np.float64).mean():.4g}"
        if x.ndim >= 2:
            line += f"  zeros {np.mean(x == 0):.1%}"
    elif x.dtype == object and x.size:
        line += f"  e.g. {x.flat[0]!r}"[:120]
    return line


def row_noun(pipe: Pipeline) -> str:
    """What a row of ``pipe`` is called in reports.

    Args:
        pipe: The pipeline.

    Returns:
        ``rows`` when they are packed rows (a packed row holds several records), else ``records``.
    """
    return report(pipe.stream).row_noun()


class RunReport:
    """The lines ``quern run`` prints after its steps, for the kind of stream it ran.

    Feed it each step run (:meth:`add`), then ask for its :meth:`lines`.

    Args:
        pipe: The pipeline run.
        start: The first step run.
    """

    def __init__(self, pipe: Pipeline, start: int) -> None:
        self.pipe, self.start = pipe, start
        self.buckets: list[BucketOfStep] = []  # of each step of a bucketed pipeline, its rows and real tokens
        self.rows: list[int] = []
        self.reals: list[int | None] = []

    def add(self, step: int, batch: Any, *, rows: int) -> None:
        """Keep what the report needs of one step run (host 0 of 1).

        Args:
            step: The step.
            batch: Its batch, just made (a bucketed step's real tokens may come from its ``length``).
            rows: Its rows.
        """
        bucket = report(self.pipe.stream).bucket_of(step, 0, 1)
        if bucket is not None:
            self.buckets.append(bucket)
            self.rows.append(rows)
            self.reals.append(_real_tokens(bucket, batch))

    def lines(self, steps: int) -> list[str]:
        """The report of the ``steps`` steps run from ``start`` (host 0 of 1).

        Args:
            steps: How many steps were run.

        Returns:
            A mixture's components drawn, a packed stream's fill, a bucketed stream's
            buckets and padding; none for a plain stream or no step.
        """
        pipe, start = self.pipe, self.start
        lines: list[str] = []
        if steps <= 0:
            return lines
        if not self.buckets:  # host 0 of 1: the steps' positions are one range
            first, end = int(pipe.positions(start)[0]), int(pipe.positions(start + steps - 1)[-1]) + 1
            counts = _count(pipe, first, end)
            if counts is not None:
                lines.append(_drawn(pipe, counts, _steps(start, steps)))
            packed = _per_step(pipe, start, steps)
        else:
            packed = None
        if packed is not None:
            seq_len, tokens, rows, docs = packed
            line = _packing(seq_len, int(tokens.sum()), int(rows.sum()), int(docs.sum()), _steps(start, steps))
            if steps > 1:
                fills = tokens / np.maximum(rows * seq_len, 1)
                line += (
                    f"; fill per step: min {fills.min():.3f} (step {start + int(fills.argmin())}), "
                    f"max {fills.max():.3f}"
                )
            lines.append(line)
        if self.buckets:
            lines += _bucket_lines(start, self.buckets, self.rows, self.reals)
        return lines


class _Pieces(NamedTuple):
    """The documents of the rows of one packed step, for ``explain``."""

    documents: int  # pieces of documents in the step
    spans: list[tuple[list[int], list[int]]]  # of each row: its pieces' starts and lengths
    tokens: list[int]  # of each row
    summary: str  # the packing line
    seq_len: int
    lengths: np.ndarray  # the tokens of each record of the source


def _explained_components(pipe: Pipeline, first: np.ndarray) -> np.ndarray | None:
    """Rows per leaf at the positions ``first`` (a packed row names several records).

    ``None`` for a stream of one leaf.
    """
    if report(pipe.stream).draws(pipe, 0, 0) is None:
        return None
    return np.bincount(pipe.segments(first).component, minlength=len(pipe.leaf_names))


def _explained_bucket(pipe: Pipeline, step: int, process_index: int, process_count: int) -> BucketOfStep | None:
    """The step's bucket (with its real tokens when the bucketing keeps its index).

    ``None`` for a stream that is not bucketed.
    """
    return report(pipe.stream).bucket_of(step, process_index, process_count)


def _explained_pieces(pipe: Pipeline, step: int, first: np.ndarray) -> _Pieces | None:
    """The documents of each packed row at the positions ``first``, with where each piece is.

    ``None`` for a stream that is not packed.
    """
    packed: PackedRows | None = report(pipe.stream).packed_rows(first)
    if packed is None:
        return None
    pieces = packed.pieces
    cut = np.searchsorted(pieces.row, np.arange(len(first) + 1), side="left").tolist()
    spans = [(pieces.start[a:b].tolist(), pieces.length[a:b].tolist()) for a, b in zip(cut, cut[1:])]
    tokens = [int(sum(n)) for _, n in spans]
    summary = _packing(packed.seq_len, sum(tokens), len(first), len(pieces.row), _steps(step, 1))
    return _Pieces(len(pieces.row), spans, tokens, summary, packed.seq_len, packed.lengths)


def explain_json(
    pipe: Pipeline, step: int, process_index: int, process_count: int, *, first: np.ndarray, rows: list
) -> dict[str, Any]:
    """What ``quern explain --json`` prints of one step's host slice.

    Every figure comes from the plan: no record is read.

    Args:
        pipe: The pipeline.
        step: The step.
        process_index: The host.
        process_count: The number of hosts.
        first: The stream positions of the slice's rows (:meth:`Pipeline.positions`).
        rows: The records of each row (:meth:`Pipeline.explain`).

    Returns:
        The step, host and rows (position, records), the edits that change the step, with a mixture's rows per
        component, a bucketed step's bucket and a packed step's pieces and fill.
    """
    counts = _explained_components(pipe, first)
    bucket = _explained_bucket(pipe, step, process_index, process_count)
    packed = _explained_pieces(pipe, step, first)
    out: dict[str, Any] = {
        "step": step,
        "process_index": process_index,
        "process_count": process_count,
        "rows": [
            {"row": i, "position": int(p), "records": [[n, r] for n, r in recs]}
            for i, (p, recs) in enumerate(zip(first.tolist(), rows))
        ],
    }
    edits = pipe.stream.edits_before(step + 1)
    if edits:
        out["edits"] = edits
    if counts is not None:
        out["components"] = dict(zip(pipe.leaf_names, counts.tolist()))
    if bucket is not None:
        real, bound = bucket.real_tokens, bucket.bound
        out["bucket"] = {"name": bucket.name, "bound": bound, "rows": len(first)}
        if real is not None:
            out["bucket"]["padding"] = 1 - real / max(len(first) * bound, 1)
    if packed is not None:
        seq_len = packed.seq_len
        for row, n, (starts, lengths) in zip(out["rows"], packed.tokens, packed.spans):
            row["tokens"], row["pieces"] = n, [[s, s + k] for s, k in zip(starts, lengths)]
        fill = sum(packed.tokens) / max(len(first) * seq_len, 1)
        out["packing"] = {
            "seq_len": seq_len,
            "rows": len(first),
            "tokens": sum(packed.tokens),
            "documents": packed.documents,
            "fill": fill,
            "padding": 1 - fill,
        }
    return out


def explain_lines(
    pipe: Pipeline, step: int, process_index: int, process_count: int, *, first: np.ndarray, rows: list
) -> list[str]:
    """What ``quern explain`` prints of one step's host slice.

    Every figure comes from the plan: no record is read.

    Args:
        pipe: The pipeline.
        step: The step.
        process_index: The host.
        process_count: The number of hosts.
        first: The stream positions of the slice's rows (:meth:`Pipeline.positions`).
        rows: The records of each row (:meth:`Pipeline.explain`).

    Returns:
        A header line, the edits that change the step, a mixture's components drawn, a bucketed step's bucket, a packed
        step's fill, then one line per row: its position and records (``web[123]``),
        a packed row's tokens and documents.
    """
    counts = _explained_components(pipe, first)
    bucket = _explained_bucket(pipe, step, process_index, process_count)
    packed = _explained_pieces(pipe, step, first)
    lines = [f"step {step}, host {process_index} of {process_count}: {len(rows)} rows"]
    edits = pipe.stream.edits_before(step + 1)
    if edits:
        lines.append("  edits that change this step: " + "; ".join(edits))
    if counts is not None:
        lines.append("  " + _drawn(pipe, counts, _steps(step, 1)))
    if bucket is not None:
        lines.append("  " + _bucket_line(bucket, len(first), bucket.real_tokens, _steps(step, 1)))
    if packed is not None:
        lines.append("  " + packed.summary)
        for i, (p, recs) in enumerate(zip(first.tolist(), rows)):
            starts, lengths = packed.spans[i]
            text = _pieces_text(packed.lengths, pipe.leaf_names[0], [r for _, r in recs], starts, lengths)
            lines.append(f"  row {i:4d}  position {p}  {packed.tokens[i]} tokens  {text}")
        return lines
    for i, (p, recs) in enumerate(zip(first.tolist(), rows)):
        lines.append(f"  row {i:4d}  position {p}  " + ", ".join(f"{n}[{r}]" for n, r in recs))
    return lines


def inspect_lines(pipe: Pipeline, step: int, process_index: int, process_count: int, *, batch: Any) -> list[str]:
    """What ``quern inspect`` prints of the stream at one step's host slice, before the batch.

    Args:
        pipe: The pipeline.
        step: The step.
        process_index: The host.
        process_count: The number of hosts.
        batch: The slice's batch, just made.

    Returns:
        A mixture's components drawn, a packed step's fill, a bucketed step's bucket and
        padding (the plan of the rows just made: index arithmetic, no second read).
    """
    lines = []
    positions = pipe.positions(step, process_index, process_count)
    counts = _explained_components(pipe, positions)
    if counts is not None:
        lines.append(_drawn(pipe, counts, _steps(step, 1)))
    packed = report(pipe.stream).packed_rows(positions)
    if packed is not None:
        pieces = packed.pieces
        lines.append(
            _packing(packed.seq_len, int(pieces.length.sum()), len(positions), len(pieces.row), _steps(step, 1))
        )
    bucket = report(pipe.stream).bucket_of(step, process_index, process_count)
    if bucket is not None:  # the plan's bucket; the real tokens of the batch just made (or the index)
        lines.append(_bucket_line(bucket, len(positions), _real_tokens(bucket, batch), _steps(step, 1)))
    return lines


def batch_lines(batch: Any) -> list[str]:
    """What ``quern inspect`` prints of a batch: one line per array, and the padding of its tokens.

    Args:
        batch: The batch (a pytree of arrays).

    Returns:
        One line per array (its path, dtype, shape and a value summary), and the
        padding of ``tokens`` when the batch is a dict with ``tokens`` and ``length``.

    Example:
        >>> batch_lines({"tokens": np.array([[1, 2, 0, 0]]), "length": np.array([2])})[-1]
        'padding: 50.0% of 1 x 4 token slots'
    """
    lines = [_summary(path, leaf) for path, leaf in leaves(batch)]
    if isinstance(batch, dict) and "length" in batch and "tokens" in batch:
        tokens, lengths = np.asarray(batch["tokens"]), np.asarray(batch["length"])
        pad = 1 - lengths.sum() / max(tokens.shape[0] * tokens.shape[1], 1)
        lines.append(f"padding: {pad:.1%} of {tokens.shape[0]} x {tokens.shape[1]} token slots")
    return lines
