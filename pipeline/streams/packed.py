"""A packed stream: the records of a pipeline packed into rows of ``seq_len`` tokens (:meth:`Pipeline.pack`).

The plan of an epoch (:mod:`quern.pipeline.order.packing`) is computed from the
length index alone, so any row's pieces are found from its position without
reading a record; a step reads its documents in one bulk call, runs the packed
pipeline's record transforms on them, lays them into rows (stage ``pack``), then
runs the transforms after ``pack``, collate and the batch transforms. Every
output depends only on the packed pipeline's definition, the length index,
``seq_len``, the mode and the key.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, Literal, cast

import numpy as np

from ..core.timing import Clock
from ..execute.stages import (
    StepRequest,
    StepResult,
    read,
)
from ..identity.fingerprint import fingerprint_of
from ..order import Pieces, Segments, indexfile
from ..order import index as _index
from ..order import packing as _packing
from ..order.first_fit import GrowingPlan
from ..order.growing import Growing, serialized
from ..sources import Source
from .capabilities import (
    Component,
    InvertedByPositions,
    NeutralReports,
    PackedRows,
    RecordPositions,
    SingleSource,
    require,
)
from .config_form import batch_config, stages_config
from .packed_rows import PACK, packed_results, rows_of
from .protocol import Explanation, Stream, locate_inner

if TYPE_CHECKING:
    from ..definition.dataset import Pipeline
    from .source import SourceStream

__all__ = ["PackedStream", "PackMode", "PACK"]

_INVERSES = 4  # epochs whose inverted plan (document -> rows) a packed stream keeps, for where()
PackMode = Literal["best_fit", "concat", "first_fit"]

_REFUSALS = {
    "shuffle": "shuffle() after pack(): shuffle the records before pack() (best_fit rows come shuffled)",
    "filter": "filter() after pack(): filter the records before pack()",
    "length_index": "length_index() after pack(): packed rows all hold seq_len tokens; measure before pack()",
    "pack": "pack() on a packed pipeline: it is packed already",
    "bucket": "bucket() needs a single-source pipeline (not a mixture or a packed pipeline)",
    "balance_hosts": "balance_hosts() on a mixture or a packed pipeline is not supported: its rows come from "
    "several records (packed rows hold seq_len tokens each already)",
    "segments": "a packed row holds several documents: use pieces(positions)",
}


@dataclasses.dataclass(frozen=True)
class PackedStream(InvertedByPositions, NeutralReports, Stream):
    """The records of ``inner`` packed into rows of ``seq_len`` tokens.

    Capabilities: packed (``pieces``), row-making, inverted (``where``), edited (``exclude``
    pads), reportable (its packed rows), written as a config and as a mixture's component.

    Attributes:
        inner: the single-source pipeline (without batch) whose records are packed.
        seq_len: tokens per row.
        mode: ``"best_fit"`` (whole documents placed into rows, shuffled), ``"first_fit"`` (whole documents in
            stream order) or ``"concat"`` (concatenated and cut).
        key: the field of a dict record that holds its tokens (``None``: the record is the tokens).
        lengths: the length index, one value per record of the source.
        lengths_digest: what the fingerprint sees of the lengths: ``best_fit``, the index's digest (its plan
            needs them all); ``first_fit`` and ``concat``, the key of the records measured, however the lengths
            were found.
        cache_dir: where the rows per epoch are cached (``None``: the default cache).
        lengths_file: the ``.npy`` file the index was read from, if any (for the config).
        seed: the inner pipeline's seed (keys the transforms after ``pack``).
        num_epochs: the inner pipeline's epochs.
        source: the inner pipeline's source.
        columns: several columns packed together, ``(key, seq_len)`` each (empty: the one column ``key``).
        column_lengths: with ``columns``, the length index of each, ``(records, columns)``.
        num_bins: ``first_fit``'s rows per packing batch.
        max_per_bin: documents per row at most (``None``: no limit).
        pad_values: ``(output key, value)`` of the padding of each padded column that is not padded with 0.
        lazy: ``first_fit`` or ``concat`` without a length index: the lengths measured as the plan reaches
            documents (:class:`~quern.pipeline.definition.lazy_lengths.LazyLengths`, called with record ids),
            each epoch's plan growing window by window (:class:`~quern.pipeline.order.growing.Growing`).
    """

    inner: Pipeline
    seq_len: int
    mode: PackMode
    key: str | None
    lengths: np.ndarray = dataclasses.field(compare=False, repr=False)
    lengths_digest: str = ""
    cache_dir: str | None = dataclasses.field(default=None, compare=False, repr=False)
    lengths_file: str | None = dataclasses.field(default=None, compare=False, repr=False)
    seed: int = 0
    num_epochs: int | None = None
    source: Source | None = dataclasses.field(default=None, compare=False, repr=False)
    exclusions: tuple[tuple[int, np.ndarray], ...] = dataclasses.field(default=(), compare=False, repr=False)
    exclusions_key: tuple[tuple[int, bytes], ...] = ()
    columns: tuple[tuple[str, int], ...] = ()
    column_lengths: np.ndarray | None = dataclasses.field(default=None, compare=False, repr=False)
    num_bins: int | None = None
    max_per_bin: int | None = None
    pad_values: tuple[tuple[str, int | float], ...] = ()
    lazy: Any = dataclasses.field(default=None, compare=False, repr=False)

    reads_records = False

    def __getstate__(self) -> dict:
        """The state without the cached epoch plans and their inverses (recomputed where needed)."""
        return {
            k: v for k, v in self.__dict__.items() if k not in ("_plans", "_inverse", "_epoch_rows", "_growing_plans")
        }

    def __setstate__(self, state: dict) -> None:
        """Restore :meth:`__getstate__`'s state."""
        self.__dict__.update(state)

    def leaves(self, pipe: Pipeline) -> tuple[Pipeline, ...]:
        """``(inner,)``."""
        return (self.inner,)

    def segments(self, positions: np.ndarray) -> Segments:
        """Refused (a ``TypeError`` naming :meth:`pieces`): a packed row is not one record."""
        raise TypeError(_REFUSALS["segments"])

    def length(self) -> int | None:
        """Rows over all epochs, ``None`` when endless."""
        return None if self.num_epochs is None else self.rows_before(self.num_epochs)

    def read_order(self) -> str | None:
        """The inner pipeline's shuffle."""
        return self.inner.stream.read_order()

    def stages_before(self) -> list[str]:
        """The inner pipeline's record transforms, then ``pack``."""
        return [op.label(k) for k, op in enumerate(self.inner.record_ops)] + [PACK]

    def size_text(self) -> str:
        """``the packed stream (R rows of S tokens in its first epoch)``."""
        return f"the packed stream ({self.rows_before(1)} rows of {self.seq_len} tokens in its first epoch)"

    def refusal(self, stage: str) -> str | None:
        """Packed rows may be mapped, batched and mixed; the rest belongs before ``pack()``."""
        return _REFUSALS.get(stage)

    def describe(self, until_step: int | None = None) -> dict[str, Any]:
        """``{"packing": ...}``: the inner pipeline's description, ``seq_len``, mode, key and lengths."""
        out: dict[str, Any] = {
            "inner": self.inner.describe(),
            "seq_len": self.seq_len,
            "mode": self.mode,
            "key": self.key,
            "lengths": self.lengths_digest,
        }
        for name, value in self.settings().items():  # only where set: the fingerprints of the others stay
            if value is not None and value != []:
                out[name] = value
        return {"packing": out}

    def settings(self) -> dict[str, Any]:
        """The settings beyond ``seq_len``, ``mode`` and ``key``, JSON-able (``None`` or ``[]`` where not set)."""
        return {
            "columns": [list(c) for c in self.columns],
            "num_bins": self.num_bins,
            "max_sequences_per_bin": self.max_per_bin,
            "pad_value": [list(p) for p in self.pad_values],
        }

    def room(self) -> int | list[int]:
        """The room of a row: ``seq_len``, or one value per column."""
        return [n for _, n in self.columns] if self.columns else self.seq_len

    def length_table(self) -> np.ndarray:
        """The lengths of the records in each packed column, ``(records, columns)`` (``-1``: not known yet)."""
        if self.lazy is not None:
            return np.asarray(self.lazy.values)
        if self.column_lengths is not None:
            return self.column_lengths
        return np.asarray(self.lengths).reshape(-1, 1)

    def doc_lengths(self) -> np.ndarray:
        """The lengths of the records in the first packed column (``-1``: not known yet)."""
        return self.length_table()[:, 0]

    def _epoch_ids(self, e: int) -> tuple[Callable[[int, int], np.ndarray], int]:
        """``(ids_of, n)``: ``ids_of(lo, hi)`` the record ids of documents ``lo`` to ``hi`` of epoch ``e``'s ``n``."""
        n = self.inner.stream.epoch_length
        assert n is not None
        inner = require(self.inner.stream, SingleSource, "pack")
        return (lambda lo, hi: inner.record_ids(np.arange(e * n + lo, e * n + hi, dtype=np.int64))), n

    def _growing(self, e: int) -> Growing:
        """Epoch ``e``'s growing plan (``lazy``), kept for the last four epochs asked for."""
        plans = self.__dict__.setdefault("_growing_plans", {})
        hit = plans.get(e)
        if hit is None:
            ids = self._epoch_ids(e)
            names = [k for k, _ in self.columns] or [self.key or "tokens"]
            room = np.atleast_1d(np.asarray(self.room()))
            source = self.inner.leaf_names[0]

            def measure(window: np.ndarray) -> np.ndarray:
                table = self.lazy(window)
                if self.mode == "first_fit":
                    _packing.check_fit(table, window, names, room.tolist(), source)
                else:
                    _packing.check_agree(table, window, names, source)
                return table

            if self.mode == "first_fit":
                hit = GrowingPlan(ids, measure, self.room(), self.num_bins or 1, self.max_per_bin)
            else:
                hit = _packing.GrowingConcat(ids, measure, self.seq_len)
            plans[e] = hit
            while len(plans) > 4:
                plans.pop(next(iter(plans)))
        return hit

    def _grown(self, e: int, rows: int | None) -> tuple[_packing.EpochPlan, np.ndarray]:
        """Epoch ``e``'s growing plan, grown to ``rows`` closed rows (``None``: complete)."""
        growing = self._growing(e)
        growing.extend_to(rows if rows is not None else 1 << 62)
        if growing.complete and not growing.closed():
            raise ValueError(f"pack(): the records of source {self.inner.leaf_names[0]!r} hold no token")
        return _packing.EpochPlan(*growing.plan()), growing.ids

    @serialized
    def epoch(self, e: int, rows: int | None = None) -> tuple[_packing.EpochPlan, np.ndarray]:
        """Epoch ``e``'s plan and the record ids of its documents in stream order (cached, two epochs).

        ``rows``: with ``lazy``, the plan need only hold that many rows (``None``: the whole epoch).
        """
        if self.lazy is not None:
            return self._grown(e, rows)
        plans = self.__dict__.setdefault("_plans", {})
        hit = plans.get(e)
        if hit is None:
            n = self.inner.stream.epoch_length
            assert n is not None
            ids = require(self.inner.stream, SingleSource, "pack").record_ids(
                np.arange(e * n, (e + 1) * n, dtype=np.int64)
            )
            by_column = self.column_lengths is not None and self.mode == "first_fit"  # others: the columns agree
            lengths = self.column_lengths[ids] if by_column else self.lengths[ids]  # type: ignore[index]
            plan = _packing.plan_epoch(
                lengths, self.room(), self.mode, self.inner.stream.seed, e, self.num_bins, self.max_per_bin
            )
            hit = (plan, ids)
            if self.mode != "first_fit" and hit[0].rows != self.rows_before(1):
                raise RuntimeError(
                    f"packing: epoch {e} has {hit[0].rows} rows where every epoch has {self.rows_before(1)}; the "
                    f"cached count {self._rows_path()} is wrong: delete it"
                )
            plans[e] = hit
            while len(plans) > 2:
                plans.pop(next(iter(plans)))
        return hit

    def _doc_rows(self, e: int) -> tuple[np.ndarray, np.ndarray]:
        """Epoch ``e``'s plan inverted: ``(first, rows)``, document ``j``'s rows being ``rows[first[j]:first[j + 1]]``.

        The rows of the plan's pieces grouped by document (a stable sort of the pieces by
        document), built once from the epoch's plan and kept for the last
        ``_INVERSES`` epochs asked for.
        """
        inverse = self.__dict__.setdefault("_inverse", {})
        hit = inverse.get(e)
        if hit is None:
            plan, ids = self.epoch(e)
            row = np.repeat(np.arange(plan.rows, dtype=np.int64), np.diff(plan.row_ptr))
            order = np.argsort(plan.doc, kind="stable")
            first = np.searchsorted(plan.doc[order], np.arange(len(ids) + 1), side="left").astype(np.int64)
            hit = inverse[e] = (first, row[order])
            while len(inverse) > _INVERSES:
                inverse.pop(next(iter(inverse)))
        return hit

    def record_positions(self, record: int, epochs: int) -> np.ndarray:
        """The rows holding a piece of record ``record`` in the first ``epochs`` epochs (at most the stream's).

        The record's offset in each epoch of the inner stream (its
        :meth:`~quern.pipeline.streams.capabilities.RecordPositions.record_positions`), then that document's
        rows in the epoch's plan, through an inverse of the plan built once per cached
        plan: O(log N) per epoch beyond the plan (a record of 0 tokens is in no row).

        Args:
            record: a record id of the source.
            epochs: epochs to look in, at least 1.

        Returns:
            Sorted, distinct int64 row positions.
        """
        if self.num_epochs is not None:
            epochs = min(epochs, self.num_epochs)
        n = self.inner.stream.epoch_length
        assert n is not None
        out = []
        for p in require(self.inner.stream, RecordPositions, "where").record_positions(record, epochs).tolist():
            e, j = divmod(p, n)
            first, rows = self._doc_rows(e)
            out.append(self.rows_before(e) + rows[first[j] : first[j + 1]])
        got = np.unique(np.concatenate(out) if out else np.zeros(0, dtype=np.int64))
        return got[~self._excluded(got, np.full(len(got), record, dtype=np.int64))]

    @serialized
    def rows_before(self, e: int) -> int:
        """Rows in the epochs before ``e``.

        ``e`` times the rows of one epoch, which are the same in every epoch (``concat``: ``ceil(tokens / seq_len)``;
        ``best_fit``: best-fit decreasing depends only on the lengths, not on their order). For ``best_fit`` that count
        is computed once from the lengths and kept in memory and on disk (under ``cache_dir/packing/``, keyed by the
        fingerprint of this definition), so a cold resume in any epoch plans only that epoch.
        """
        if self.mode == "first_fit" or self.lazy is not None:
            return self._counted_rows_before(e)
        per = self.__dict__.get("_rows_per_epoch")
        if per is None:
            live = np.asarray(self.lengths)
            live = live[live > 0]
            if self.mode == "concat":
                per = -(-int(live.sum()) // self.seq_len)
            else:
                per = self._load_rows()
                if per is None:
                    whole = live // self.seq_len
                    rem = live - whole * self.seq_len
                    small = rem[rem > 0]
                    if self.max_per_bin is None:
                        per = int(whole.sum()) + _packing.best_fit_decreasing(small, self.seq_len)[1]
                    else:
                        per = int(whole.sum()) + _packing.best_fit_capped(small, self.seq_len, self.max_per_bin)[1]
                    self._store_rows(per)
            self.__dict__["_rows_per_epoch"] = per
        return e * per

    def _counted_rows_before(self, e: int) -> int:
        """``first_fit``'s (or a lazy plan's) rows before epoch ``e``.

        Each epoch's plan's rows, found once (the first epoch's for all when every epoch has
        as many: the inner stream reads in the same order every epoch, or ``concat``).
        """
        if e <= 0:
            return 0
        counts = self.__dict__.setdefault("_epoch_rows", [])
        if self._same_rows():
            if not counts:
                counts.append(self.epoch(0)[0].rows)
            return e * counts[0]
        while len(counts) < e:
            counts.append(self.epoch(len(counts))[0].rows)
        return int(sum(counts[:e]))

    def _same_rows(self) -> bool:
        """Whether every epoch has as many rows: ``concat`` (its tokens), or an unshuffled stream."""
        return self.mode == "concat" or self.inner.stream.read_order() is None

    def _known_rows(self, e: int) -> int | None:
        """Epoch ``e``'s rows if already counted (every epoch's are the first's when :meth:`_same_rows`)."""
        counts = self.__dict__.get("_epoch_rows", [])
        if counts and self._same_rows():
            return counts[0]
        return counts[e] if e < len(counts) else None

    def _rows_path(self) -> str:
        key = fingerprint_of({"index_format": _index.INDEX_FORMAT_VERSION, **self.describe()})
        return os.path.join(indexfile.cache_dir(self.cache_dir), "packing", f"{key}.rows.json")

    def _load_rows(self) -> int | None:
        """The rows per epoch cached on disk, or ``None``.

        Used only if the file is ``{"rows_per_epoch": n, "check": ...}`` with a positive ``n`` whose check (a hash of
        the file's key and ``n``) matches; every epoch planned later is compared with it.
        """
        try:
            with open(self._rows_path()) as f:
                got = json.load(f)
        except (OSError, ValueError):
            return None
        rows = got.get("rows_per_epoch") if isinstance(got, dict) else None
        if not isinstance(rows, int) or isinstance(rows, bool) or rows < 1 or got.get("check") != self._check(rows):
            return None
        return rows

    def _check(self, rows: int) -> str:
        return fingerprint_of({"file": os.path.basename(self._rows_path()), "rows_per_epoch": rows})

    def _store_rows(self, rows: int) -> None:
        """Write the count atomically (a temporary file renamed).

        A cache that cannot be written (read-only, full) is skipped, and the temporary file removed.
        """
        path = self._rows_path()
        tmp = None
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=os.path.basename(path) + ".", suffix=".tmp")
            with os.fdopen(fd, "w") as f:
                json.dump({"rows_per_epoch": rows, "check": self._check(rows)}, f)
            os.replace(tmp, path)
        except OSError:
            if tmp is not None:
                try:
                    os.unlink(tmp)
                except OSError:
                    pass

    def epoch_rows(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The epoch of each row position and the row's index within its epoch."""
        rows = np.asarray(rows, dtype=np.int64)
        if not rows.size:
            return rows.copy(), rows.copy()
        top, e = int(rows.max()), 0
        if self.lazy is not None:  # grow each epoch's plan only as far as the rows asked for
            base = 0
            while (known := self._known_rows(e)) is not None and top >= base + known:
                base, e = base + known, e + 1  # an epoch whose rows are counted: skipped
            while True:
                growing = self._growing(e)
                growing.extend_to(top - base + 1)
                if not growing.complete or growing.closed() > top - base:
                    break
                if not growing.closed():
                    self._grown(e, None)  # no token at all: the error
                counts = self.__dict__.setdefault("_epoch_rows", [])
                if len(counts) == e:
                    counts.append(growing.closed())
                base += growing.closed()
                e += 1
            cum = np.asarray([self.rows_before(k) for k in range(e + 1)] + [1 << 62], dtype=np.int64)
        else:
            while self.rows_before(e + 1) <= top:
                e += 1
            cum = np.asarray([self.rows_before(k) for k in range(e + 2)], dtype=np.int64)
        epochs = np.searchsorted(cum, rows, side="right") - 1
        return epochs, rows - cum[epochs]

    @serialized
    def pieces(self, positions: np.ndarray) -> Pieces:
        """The documents in the packed rows at these positions (reads nothing)."""
        positions = np.asarray(positions, dtype=np.int64)
        epochs, within = self.epoch_rows(positions)
        parts = []
        for e in np.unique(epochs).tolist():
            sel = np.flatnonzero(epochs == e)
            k = within[sel]
            plan, ids = self.epoch(e, int(k.max()) + 1)
            first, last = plan.row_ptr[k], plan.row_ptr[k + 1]
            n = last - first
            idx = np.repeat(first, n) + (np.arange(n.sum()) - np.repeat(np.cumsum(n) - n, n))
            rows = np.repeat(sel, n)
            parts.append((rows, ids[plan.doc[idx]], plan.start[idx], plan.length[idx]))
        if not parts:
            z = np.zeros(0, dtype=np.int64)
            return Pieces(z, z, z, z)
        row, ids, start, length = (np.concatenate(x) for x in zip(*parts))
        order = np.argsort(row, kind="stable")
        keep = order[~self._excluded(positions[row[order]], ids[order])]
        return Pieces(row[keep], ids[keep], start[keep], length[keep])

    def _excluded(self, positions: np.ndarray, ids: np.ndarray) -> np.ndarray:
        """Whether each piece (of record ``ids[i]``, in the row at ``positions[i]``) is excluded there."""
        out = np.zeros(len(ids), dtype=bool)
        if not self.exclusions or not len(ids):
            return out
        starts = np.asarray([at for at, _ in self.exclusions], dtype=np.int64)
        which = np.searchsorted(starts, positions, side="right") - 1
        for i in np.unique(which[which >= 0]).tolist():
            sel = which == i
            out[sel] = np.isin(ids[sel], self.exclusions[i][1])
        return out

    def excluded(self, pipe: Pipeline, ids: np.ndarray, position: int, component: str | None) -> PackedStream:
        """This stream with the pieces of documents ``ids`` made padding in the rows from ``position`` on.

        The plan is not redone, so no row moves (a row may be left with padding only).

        Raises:
            ValueError: ``component`` given, or an exclusion before an earlier one.
        """
        if component is not None:
            raise ValueError(f"exclude(component={component!r}): the pipeline is not a mixture")
        if self.exclusions and position < self.exclusions[-1][0]:
            raise ValueError(
                f"exclude() from row {position}, before an earlier exclusion's ({self.exclusions[-1][0]}): "
                "make the exclusions in step order"
            )
        union = np.union1d(self.exclusions[-1][1], ids) if self.exclusions else np.asarray(ids, dtype=np.int64)
        inner = cast("SourceStream", self.inner.stream)  # pack() needs a source stream
        if inner.epoch_length is not None and inner.epoch_length <= np.count_nonzero(
            inner.epoch_positions(union, 0) >= 0
        ):
            raise ValueError(f"exclude() would leave no document of {inner.size_text()}: it excludes every record")
        kept = [x for x in self.exclusions if x[0] != position] + [(position, union)]
        return dataclasses.replace(
            self, exclusions=tuple(kept), exclusions_key=tuple((at, x.tobytes()) for at, x in kept)
        )

    def row_ids(self, positions: np.ndarray) -> np.ndarray:
        """``-1`` for every row: a packed row holds several documents."""
        return np.full(len(positions), -1, dtype=np.int64)

    def reads(self, positions: np.ndarray) -> list[tuple[Source, np.ndarray, np.ndarray]]:
        """The documents of the rows."""
        pieces = self.pieces(positions)
        return [] if self.source is None else [(self.source, pieces.ids, pieces.row)]

    def explain_rows(self, positions: np.ndarray, names: Sequence[str]) -> Explanation:
        """Every document in every row, named ``names[0]`` (the inner pipeline's source, or a component's key)."""
        label = names[0]
        pieces = self.pieces(positions)
        out: list[list[tuple[str, int | str]]] = [[] for _ in range(len(positions))]
        for r, i in zip(pieces.row.tolist(), pieces.ids.tolist()):
            out[r].append((label, i))
        return out

    def row_noun(self) -> str:
        """``rows``: a packed row holds several records."""
        return "rows"

    def packed_rows(self, positions: np.ndarray) -> PackedRows:
        """The pieces of the rows at ``positions``."""
        return PackedRows(self.seq_len, self.pieces(positions), self.doc_lengths())

    def results(self, pipe: Pipeline, request: StepRequest) -> Iterator[StepResult]:
        """The packed runner: :func:`~quern.pipeline.streams.packed_rows.packed_results`."""
        return packed_results(pipe, self, request)

    def rows(
        self, pipe: Pipeline, positions: np.ndarray, where: object, clock: Clock | None = None, prefix: str = ""
    ) -> Sequence[Any]:
        """The packed rows at ``positions``, after the transforms after ``pack`` (stage ``{prefix}pack``)."""
        pieces = self.pieces(positions)
        docs = np.unique(pieces.ids)
        rows = rows_of(pipe, self, pieces, docs, read(self.inner, docs, where), positions, where)[0]
        if clock is not None:
            clock.lap(f"{prefix}{PACK}")
        return rows

    def locate(self, path: tuple) -> tuple[str, Pipeline, tuple] | None:
        """``("packing", "inner", ...)`` leads into the inner pipeline."""
        return locate_inner(path, "packing", "the packed pipeline's", self.inner)

    def to_config(self, pipe: Pipeline) -> dict[str, Any]:
        """The single-source config with ``num_epochs``, a ``pack:`` section, ``row_transforms`` and ``batch``."""
        packed = self.component_config(pipe, "")
        head = {
            "source": packed["source"],
            "seed": packed["seed"],
            "num_epochs": self.num_epochs,
            **{k: packed[k] for k in ("shuffle", "transforms", "pack", "row_transforms")},
        }
        return {**head, **batch_config(pipe)}

    def component_config(self, pipe: Pipeline, where: str) -> dict[str, Any]:
        """The inner pipeline's config, ``pack`` (``seq_len``, ``mode``, ``key``, ``lengths``) and ``row_transforms``."""
        return {
            **require(self.inner.stream, Component, "to_config").component_config(self.inner, where),
            "pack": {
                "seq_len": dict(self.columns) if self.columns else self.seq_len,
                "mode": self.mode,
                "key": self.key,
                "lengths": self.lengths_file,
                **self._set_args(),
            },
            "row_transforms": stages_config(pipe.record_ops, f"{where}row_transforms"),
        }

    def _set_args(self) -> dict[str, Any]:
        """The arguments of ``pack()`` beyond ``seq_len``, ``mode`` and ``key`` that are set."""
        out: dict[str, Any] = {}
        if self.num_bins is not None:
            out["num_bins"] = self.num_bins
        if self.max_per_bin is not None:
            out["max_sequences_per_bin"] = self.max_per_bin
        if self.pad_values:
            out["pad_value"] = dict(self.pad_values)
        return out

    def text(self) -> str:
        """``INNER.pack(seq_len, mode=..., key=..., ...)``."""
        size = dict(self.columns) if self.columns else self.seq_len
        more = "".join(f", {k}={v!r}" for k, v in self._set_args().items())
        return f"{self.inner!r}.pack({size}, mode={self.mode!r}, key={self.key!r}{more})"
