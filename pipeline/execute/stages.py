"""The generic stages of a step: read, the record transforms, collate, the batch transforms.

Each function here runs one stage of one (step, host slice) and names the step,
host slice, stage and records when it fails
(:class:`~quern.pipeline.core.errors.StepError`, the original exception as
``__cause__``). Every output depends only on the definition, the step and the
host slice: never on which process or thread runs it, or on what ran before.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from ..core.collate import collate, describe
from ..core.errors import CollateError, EntriesTimeoutError, StepError, StreamTimeoutError
from ..core.ops import DEVICE_KINDS, OpKind
from ..core.steps import LengthCheck, StepRequest, StepResult, Where
from ..core.timing import Clock
from ..order import Segments
from ..order import index as _index
from ..sources import Source

if TYPE_CHECKING:
    from ..definition.dataset import Pipeline

__all__ = [
    "Where",
    "StepRequest",
    "RowNames",
    "StepResult",
    "LengthCheck",
    "READ",
    "COLLATE",
    "read",
    "apply_record_op",
    "collate_rows",
    "apply_batch_op",
    "record_keys",
    "device_keys",
    "batch_keys",
    "batch_stages",
    "steps_per_read",
    "check_lengths",
]

READ = "read"
COLLATE = "collate"
_RECORD_SALT, _BATCH_SALT, _DEVICE_SALT = 1, 2, 3  # part of the published order: keys of random_map,
# random_map_batch and random_map_device


class RowNames(NamedTuple):
    """How messages name the rows of a step: ``row i = record <id> of <label of its component>``."""

    labels: tuple[str, ...]  # per component: "source 'x'" or "component 'web' (source 'x')"
    tags: tuple[str, ...]  # per component, for lists of ids: "x" or "web"
    component: np.ndarray
    ids: np.ndarray
    rows: np.ndarray | None = None  # the rows of the step these are (None: 0, 1, 2, ...)

    @classmethod
    def of(
        cls, pipe: Pipeline, ids: np.ndarray, component: np.ndarray | None = None, rows: np.ndarray | None = None
    ) -> RowNames:
        """Names for rows ``ids`` of a single-source definition (``component=None``) or of the leaves of a mixture.

        ``rows``: their row numbers in the step, when they are some of its rows (a mixture's component).
        """
        sources = pipe.sources
        if component is None or pipe.stream.source is not None:
            src = sources[0]
            return cls((f"source {src.name!r}",), (src.name,), np.zeros(len(ids), dtype=np.int64), ids, rows)
        names = pipe.leaf_names
        labels = tuple(f"component {n!r} (source {src.name!r})" for n, src in zip(names, sources))
        return cls(labels, tuple(names), component, ids, rows)

    def step_row(self, i: int) -> int:
        """The step's row number of row ``i`` of these."""
        return int(self.rows[i]) if self.rows is not None else int(i)

    def row(self, i: int) -> str:
        """``record <id> of <label>`` for row ``i`` of these."""
        return f"record {int(self.ids[i])} of {self.labels[int(self.component[i])]}"

    def summary(self) -> str:
        """The first 8 rows' records, for messages (``x [3, 9, 1]...``)."""
        if len(self.tags) == 1:
            shown = self.ids[:8].tolist()
            return f"{self.tags[0]} {shown}{'...' if len(self.ids) > 8 else ''}"
        parts = [f"{self.tags[int(c)]} {int(i)}" for c, i in zip(self.component[:8], self.ids[:8])]
        return ", ".join(parts) + ("..." if len(self.ids) > 8 else "")


def _token_count(record: Any, key: str | None) -> int | None:
    """The tokens of a record as the length index counts them.

    ``None`` when the record has no 1-D tokens there (the next transform then says what is wrong).
    """
    value = record if key is None else record.get(key) if isinstance(record, Mapping) else None
    if isinstance(value, np.ndarray):
        return int(value.shape[0]) if value.ndim else None
    if value is None or isinstance(value, (str, bytes, Mapping)):
        return None
    try:
        return len(value)
    except TypeError:
        return None


def check_lengths(
    pipe: Pipeline, check: LengthCheck, records: Sequence[Any], ids: np.ndarray, where: object, names: RowNames
) -> None:
    """``StepError`` naming the first record whose tokens differ from the length index (:class:`LengthCheck`).

    The step, the stage it came to, the record and both lengths.
    """
    want = np.asarray(check.lengths)[ids]
    for i, rec in enumerate(records):
        n = _token_count(rec, check.key)
        if n is not None and n != int(want[i]):
            raise StepError(
                f"{where}, stage {pipe.record_ops[check.at].label(check.at)}, row {names.step_row(i)} = "
                f"{names.row(i)}: it has {n} tokens but the length index says {int(want[i])}: the index was "
                "made for other data or transforms: rebuild it, or pass the right lengths="
            )


def steps_per_read(rows_per_step: int, target_records: int, max_steps: int) -> int:
    """How many consecutive steps to read in one bulk call.

    About ``target_records`` records, at least 1 step and at most ``max_steps``. The one chunk-size policy of the
    threads and the worker processes alike; never changes a byte.
    """
    return max(1, min(max_steps, target_records // max(1, rows_per_step)))


def _ids_text(source: Source, ids: np.ndarray) -> str:
    shown = ids[:8].tolist()
    return f"{source.name} {shown}{'...' if len(ids) > 8 else ''}"


def record_keys(seed: int, positions: np.ndarray, k: int) -> np.ndarray:
    """``uint64`` key per row for record stage ``k`` (``random_map``).

    A hash of (seed, record level, k, stream position). Part of the published order.
    """
    return _index.derive_key(seed, _RECORD_SALT, k, positions)


def batch_keys(seed: int, positions: np.ndarray, k: int) -> np.ndarray:
    """``uint64`` key per row for batch stage ``k`` (``random_map_batch``).

    A hash of (seed, batch level, k, stream position). Part of the published order.
    """
    return _index.derive_key(seed, _BATCH_SALT, k, positions)


def device_keys(seed: int, positions: np.ndarray, k: int) -> np.ndarray:
    """``uint64`` key per row for batch stage ``k`` when it is a ``random_map_device`` stage.

    A hash of (seed, device level, k, stream position). Part of the published order.
    """
    return _index.derive_key(seed, _DEVICE_SALT, k, positions)


@Clock.stage("read")
def read(pipe: Pipeline, ids: np.ndarray, where: object) -> Sequence[Any]:
    """Stage ``read``: the records ``ids`` of the source, in one bulk call."""
    src = pipe.stream.source
    assert src is not None, "read() takes a pipeline whose rows are records of one source (a leaf)"
    try:
        return src.read_many(ids)
    except EntriesTimeoutError as e:  # a live source's entries did not come in time: still a TimeoutError
        raise StreamTimeoutError(
            f"{where}, stage 'read' of source {src.name!r} (records {_ids_text(src, ids)}): {type(e).__name__}: {e}"
        ) from e
    except Exception as e:
        raise StepError(
            f"{where}, stage 'read' of source {src.name!r} (records {_ids_text(src, ids)}): {type(e).__name__}: {e}"
        ) from e


@Clock.stage("record")
def apply_record_op(
    pipe: Pipeline,
    k: int,
    records: Sequence[Any],
    positions: np.ndarray,
    ids: np.ndarray,
    where: object,
    names: RowNames | None = None,
) -> Sequence[Any]:
    """Record stage ``k`` on one step's records.

    ``fn.map_many(records)`` when a ``map`` transform has it, else ``fn(record)`` (``fn(record, rng)`` for
    ``random_map``, the Generator keyed by :func:`record_keys`) per record. A ``filter`` stage passes the records
    through: the plan holds only the records it keeps.
    """
    op = pipe.record_ops[k]
    if op.kind is OpKind.FILTER:
        return records
    names = names if names is not None else RowNames.of(pipe, ids)
    stage = op.label(k)
    many = getattr(op.fn, "map_many", None) if op.kind is OpKind.MAP else None
    if many is not None:
        try:
            outs: Sequence[Any] = many(records)
        except Exception as e:
            row = e.row if isinstance(e, CollateError) else None
            blame = (
                f", row {names.step_row(row)} = {names.row(row)} (position {int(positions[row])})"
                if row is not None and 0 <= row < len(ids)
                else f" (records {names.summary()})"
            )
            raise StepError(f"{where}, stage {stage}{blame}: {type(e).__name__}: {e}") from e
        if (
            not isinstance(outs, (Sequence, np.ndarray))
            or isinstance(outs, (str, bytes))
            or (isinstance(outs, np.ndarray) and not outs.ndim)
        ):
            raise StepError(
                f"{where}, stage {stage} (records {names.summary()}): map_many returned "
                f"{describe(outs)}, not a sequence of {len(records)} records"
            )
        if len(outs) != len(records):
            raise StepError(
                f"{where}, stage {stage} (records {names.summary()}): map_many returned "
                f"{len(outs)} records for {len(records)}"
            )
        return outs
    out: list[Any] = [None] * len(records)
    fn = op.fn
    if op.kind is OpKind.RANDOM_MAP:
        keys = record_keys(pipe.seed, positions, k)
        bitgen = np.random.Philox(key=0)
        rng = np.random.Generator(bitgen)
        state = bitgen.state
        state["state"]["counter"][:] = 0
    for i, rec in enumerate(records):
        try:
            if op.kind is OpKind.RANDOM_MAP:
                state["state"]["key"][:] = (keys[i], k)
                bitgen.state = state
                out[i] = fn(rec, rng)
            else:
                out[i] = fn(rec)
        except Exception as e:
            raise StepError(
                f"{where}, stage {stage}, row {names.step_row(i)} = {names.row(i)} "
                f"(position {int(positions[i])}): {type(e).__name__}: {e}"
            ) from e
    return out


@Clock.stage("collate")
def collate_rows(
    pipe: Pipeline, records: Sequence[Any], ids: np.ndarray, where: object, names: RowNames | None = None
) -> Any:
    """Stage ``collate``: one step's transformed records -> a batch."""
    try:
        return collate(records)
    except Exception as e:
        names = names if names is not None else RowNames.of(pipe, ids)
        row = e.row if isinstance(e, CollateError) else None
        blame = (
            f" row {names.step_row(row)} = {names.row(row)}"
            if row is not None and row < len(ids)
            else f" (records {names.summary()})"
        )
        raise StepError(f"{where}, stage 'collate'{blame}: {e}") from e


@Clock.stage("batch")
def apply_batch_op(
    pipe: Pipeline,
    k: int,
    batch: Any,
    positions: np.ndarray,
    ids: np.ndarray,
    where: object,
    names: RowNames | None = None,
) -> Any:
    """Batch stage ``k``.

    ``fn(batch)``, or ``fn(batch, keys)`` for ``random_map_batch`` with one key per row from :func:`batch_keys`.
    """
    op = pipe.batch_ops[k]
    names = names if names is not None else RowNames.of(pipe, ids)
    try:
        if op.kind is OpKind.RANDOM_MAP_BATCH:
            out = op.fn(batch, batch_keys(pipe.seed, positions, k))
        else:
            out = op.fn(batch)
    except Exception as e:
        raise StepError(f"{where}, stage {op.label(k)} (records {names.summary()}): {type(e).__name__}: {e}") from e
    kind = _batch_kind(batch)
    if kind is not None and not isinstance(out, kind) and not (kind is np.ndarray and hasattr(type(out), "__array__")):
        raise StepError(
            f"{where}, stage {op.label(k)} (records {names.summary()}): returned {describe(out)}; "
            f"a batch transform must return a batch of the kind it was given ({describe(batch)})"
        )
    return out


def _batch_kind(batch: Any) -> type | None:
    """What a batch transform given ``batch`` must return.

    A dict for a dict (any mapping), a tuple for a tuple (a namedtuple too), a list for a list, an array for an array
    (or an object with ``__array__``, such as a ``jax.Array``); ``None`` (anything) for other batches. Only the top
    level is checked: the leaves of a dict or tuple are the transform's business.
    """
    for kind in (Mapping, tuple, list, np.ndarray):
        if isinstance(batch, kind):
            return kind
    return None


def batch_stages(
    pipe: Pipeline,
    batch: Any,
    positions: np.ndarray,
    seg: Segments,
    where: object,
    timings: dict[str, float] | None = None,
) -> Any:
    """The batch transforms of one step, in order."""
    clock = Clock(timings)
    names = RowNames.of(pipe, seg.ids, seg.component)
    for k, op in enumerate(pipe.batch_ops):
        if op.kind in DEVICE_KINDS:  # the device stages run after the transfer (quern.sharding)
            break
        batch = apply_batch_op(pipe, k, batch, positions, seg.ids, where, names)
        clock.lap(op.label(k))
    return batch
