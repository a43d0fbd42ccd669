"""The step runner: compute one (step, host slice) of a pipeline definition.

For each step: the host's stream positions and record ids come from the
definition (index arithmetic); then the stages run in order, each one a
function here that names the step, host slice, stage and records when it
fails (:class:`~quern.pipeline.errors.StepError`, the original exception as
``__cause__``):

1. ``read``: one bulk ``read_many`` call for the records of all the steps asked
   for at once (:func:`read`);
2. the record transforms, in order (:func:`apply_record_op`);
3. ``collate`` (:func:`collate_rows`);
4. the batch transforms, in order (:func:`apply_batch_op`).

:func:`step_results` runs them for a list of steps; ``timings``, a dict, gathers
the seconds spent per stage (:mod:`quern.pipeline.timing`; the iterators and
``quern bench`` use it). Every output depends
only on (the definition, the step, the host slice): never on which process or
thread runs it, or on what ran before.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple, Protocol

import numpy as np

from . import index as _index
from .collate import CollatedRows, collate, describe, take
from .errors import CollateError, StepError
from .ops import Op, OpKind
from .plan import Pieces, Segments
from .sources import Source
from .timing import Clock
from .tree import leaves as tree_leaves
from .tree import map_leaves

__all__ = [
    "Definition",
    "Where",
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
    "batch_keys",
    "read_segments",
    "record_stages",
    "batch_stages",
    "step_results",
    "batches_at",
    "steps_per_read",
    "check_hosts",
]

READ = "read"
COLLATE = "collate"
_RECORD_SALT, _BATCH_SALT = 1, 2  # part of the published order: keys of random_map / random_map_batch


class Definition(Protocol):
    """What the execution layer (step runner, iterator, workers) needs of a pipeline
    definition: :class:`~quern.pipeline.dataset.Pipeline` is one."""

    @property
    def source(self) -> Source | None: ...

    @property
    def leaves(self) -> tuple[Any, ...]: ...

    @property
    def leaf_names(self) -> tuple[str, ...]: ...

    @property
    def seed(self) -> int: ...

    @property
    def batch_size(self) -> int | None: ...

    @property
    def record_ops(self) -> tuple[Op, ...]: ...

    @property
    def batch_ops(self) -> tuple[Op, ...]: ...

    @property
    def num_steps(self) -> int | None: ...

    def check_step(self, step: object, name: str = "step", end_ok: bool = False) -> int: ...

    def fingerprint(self) -> str: ...

    def state_at(self, step: int) -> dict[str, Any]: ...

    def positions(self, step: int, process_index: int = 0, process_count: int = 1) -> np.ndarray: ...

    def segments(self, positions: np.ndarray) -> Segments: ...


class Where(NamedTuple):
    """The step and host slice being computed, as messages name them."""

    step: int
    process_index: int = 0
    process_count: int = 1

    def __str__(self) -> str:
        return f"step {self.step} (host {self.process_index} of {self.process_count})"


class StepResult(NamedTuple):
    """The outcome of one step: its batch, or the error that stopped it."""

    step: int
    batch: Any
    error: BaseException | None


class RowNames(NamedTuple):
    """How messages name the rows of a step: ``row i = record <id> of <label of its component>``."""

    labels: tuple[str, ...]  # per component: "source 'x'" or "component 'web' (source 'x')"
    tags: tuple[str, ...]  # per component, for lists of ids: "x" or "web"
    component: np.ndarray
    ids: np.ndarray
    rows: np.ndarray | None = None  # the rows of the step these are (None: 0, 1, 2, ...)

    @classmethod
    def of(
        cls, pipe: Any, ids: np.ndarray, component: np.ndarray | None = None, rows: np.ndarray | None = None
    ) -> RowNames:
        """Names for rows ``ids`` of a single-source definition (``component=None``) or of
        the leaves of a mixture; ``rows``: their row numbers in the step, when they are
        some of its rows (a mixture's component)."""
        if component is None or pipe.source is not None:
            src = pipe.source if pipe.source is not None else pipe.leaves[0].source
            return cls((f"source {src.name!r}",), (src.name,), np.zeros(len(ids), dtype=np.int64), ids, rows)
        names = pipe.leaf_names
        labels = tuple(f"component {n!r} (source {_source_of(leaf).name!r})" for n, leaf in zip(names, pipe.leaves))
        return cls(labels, tuple(names), component, ids, rows)

    def step_row(self, i: int) -> int:
        """The step's row number of row ``i`` of these."""
        return int(self.rows[i]) if self.rows is not None else int(i)

    def row(self, i: int) -> str:
        return f"record {int(self.ids[i])} of {self.labels[int(self.component[i])]}"

    def summary(self) -> str:
        if len(self.tags) == 1:
            shown = self.ids[:8].tolist()
            return f"{self.tags[0]} {shown}{'...' if len(self.ids) > 8 else ''}"
        parts = [f"{self.tags[int(c)]} {int(i)}" for c, i in zip(self.component[:8], self.ids[:8])]
        return ", ".join(parts) + ("..." if len(self.ids) > 8 else "")


class LengthCheck(NamedTuple):
    """A bucket's check of its records against the length index it was bucketed by:
    before record transform ``at`` (the bucket's ``pad``), every record's tokens
    (``len(record[key])``) must be what ``lengths`` (one value per source record) says,
    else the record could be cut to the bucket's bound or be in another bucket."""

    lengths: np.ndarray
    key: str | None
    at: int


def _token_count(record: Any, key: str | None) -> int | None:
    """The tokens of a record as the length index counts them, or ``None`` when the record
    has no 1-D tokens there (the next transform then says what is wrong)."""
    value = record if key is None else record.get(key) if isinstance(record, Mapping) else None
    if isinstance(value, np.ndarray):
        return int(value.shape[0]) if value.ndim else None
    if value is None or isinstance(value, (str, bytes, Mapping)):
        return None
    try:
        return len(value)
    except TypeError:
        return None


def _check_lengths(
    pipe: Definition, check: LengthCheck, records: Sequence[Any], ids: np.ndarray, where: object, names: RowNames
) -> None:
    """``StepError`` naming the first record whose tokens differ from the length index
    (:class:`LengthCheck`): the step, the stage it came to, the record and both lengths."""
    want = np.asarray(check.lengths)[ids]
    for i, rec in enumerate(records):
        n = _token_count(rec, check.key)
        if n is not None and n != int(want[i]):
            raise StepError(
                f"{where}, stage {pipe.record_ops[check.at].label(check.at)}, row {names.step_row(i)} = "
                f"{names.row(i)}: it has {n} tokens but the length index says {int(want[i])}: the index was "
                "made for other data or transforms: rebuild it, or pass the right lengths="
            )


def check_hosts(pipe: Any, process_count: int) -> None:
    """That every batch of ``pipe`` splits over ``process_count`` hosts: for a bucketed
    pipeline, every bucket's batch size (:meth:`~quern.pipeline.streams.Bucketing.check_hosts`,
    once per host count), so a bad host count is refused before the first step rather than
    at the first step of the bucket it does not fit. Other pipelines have one batch size,
    checked with the host slice."""
    bk = getattr(pipe, "bucketing", None)
    if bk is not None:
        bk.check_hosts(process_count)


def steps_per_read(rows_per_step: int, target_records: int, max_steps: int) -> int:
    """How many consecutive steps to read in one bulk call: about ``target_records``
    records, at least 1 step and at most ``max_steps``. The one chunk-size policy
    of the threads and the worker processes alike; never changes a byte."""
    return max(1, min(max_steps, target_records // max(1, rows_per_step)))


def _ids_text(source: Source, ids: np.ndarray) -> str:
    shown = ids[:8].tolist()
    return f"{source.name} {shown}{'...' if len(ids) > 8 else ''}"


def record_keys(seed: int, positions: np.ndarray, k: int) -> np.ndarray:
    """``uint64`` key per row for record stage ``k`` (``random_map``): a hash of
    (seed, record level, k, stream position). Part of the published order."""
    return _index.derive_key(seed, _RECORD_SALT, k, positions)


def batch_keys(seed: int, positions: np.ndarray, k: int) -> np.ndarray:
    """``uint64`` key per row for batch stage ``k`` (``random_map_batch``): a hash of
    (seed, batch level, k, stream position). Part of the published order."""
    return _index.derive_key(seed, _BATCH_SALT, k, positions)


def read(pipe: Definition, ids: np.ndarray, where: object) -> Sequence[Any]:
    """Stage ``read``: the records ``ids`` of the source, in one bulk call."""
    src = pipe.source
    assert src is not None, "read() takes a definition with a source (a leaf of a mixture)"
    try:
        return src.read_many(ids)
    except Exception as e:
        raise StepError(
            f"{where}, stage 'read' of source {src.name!r} (records {_ids_text(src, ids)}): {type(e).__name__}: {e}"
        ) from e


def apply_record_op(
    pipe: Definition,
    k: int,
    records: Sequence[Any],
    positions: np.ndarray,
    ids: np.ndarray,
    where: object,
    names: RowNames | None = None,
) -> Sequence[Any]:
    """Record stage ``k`` on one step's records: ``fn.map_many(records)`` when a
    ``map`` transform has it, else ``fn(record)`` (``fn(record, rng)`` for
    ``random_map``, the Generator keyed by :func:`record_keys`) per record. A
    ``filter`` stage passes the records through: the plan holds only the records
    it keeps."""
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


def collate_rows(
    pipe: Definition, records: Sequence[Any], ids: np.ndarray, where: object, names: RowNames | None = None
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


def apply_batch_op(
    pipe: Definition,
    k: int,
    batch: Any,
    positions: np.ndarray,
    ids: np.ndarray,
    where: object,
    names: RowNames | None = None,
) -> Any:
    """Batch stage ``k``: ``fn(batch)``, or ``fn(batch, keys)`` for
    ``random_map_batch`` with one key per row from :func:`batch_keys`."""
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
    """What a batch transform given ``batch`` must return: a dict for a dict (any
    mapping), a tuple for a tuple (a namedtuple too), a list for a list, an array
    for an array (or an object with ``__array__``, such as a ``jax.Array``);
    ``None`` (anything) for other batches. Only the top level is checked: the
    leaves of a dict or tuple are the transform's business."""
    for kind in (Mapping, tuple, list, np.ndarray):
        if isinstance(batch, kind):
            return kind
    return None


def _source_of(leaf: Any) -> Source:
    """The source a leaf reads: its own, or the packed pipeline's."""
    return leaf.source if leaf.source is not None else leaf.packing.inner.source


def read_segments(pipe: Definition, seg: Segments, where: object, clock: Clock | None = None) -> list[Any]:
    """Stage ``read`` for rows from any leaves: one bulk call per leaf, rows in order. The
    rows of a packed component are left ``None``: it reads its documents itself.
    ``clock`` laps ``read`` (a mixture: ``read: NAME`` per component)."""
    leaves = pipe.leaves
    clock = clock or Clock(None)
    if len(leaves) == 1:
        records = list(read(leaves[0], seg.ids, where))
        clock.lap(READ)
        return records
    out: list[Any] = [None] * len(seg.ids)
    for c in np.unique(seg.component).tolist():
        if leaves[c].packing is not None:
            continue
        rows = np.flatnonzero(seg.component == c)
        got = read(leaves[c], seg.ids[rows], f"{where}, component {pipe.leaf_names[c]!r}")
        for r, rec in zip(rows.tolist(), got):
            out[r] = rec
        clock.lap(f"{READ}: {pipe.leaf_names[c]}")
    return out


def record_stages(
    pipe: Definition,
    records: Sequence[Any],
    positions: np.ndarray,
    seg: Segments,
    where: object,
    timings: dict[str, float] | None = None,
    check: LengthCheck | None = None,
) -> Any:
    """The record transforms and ``collate`` of one step's records: its batch before
    the batch transforms. For a mixture: each component's own transforms on its
    rows (at the rows' positions in the component's stream), the check that the
    components agree, then the mixture's transforms (at the mixture's positions).
    ``check``: a single source's records are checked against a length index first
    (a bucket's, :class:`LengthCheck`)."""
    clock = Clock(timings)
    leaves = pipe.leaves
    if pipe.source is not None:  # a single source: its transforms are the definition's own
        for k, op in enumerate(pipe.record_ops):
            if check is not None and k == check.at:
                _check_lengths(pipe, check, records, seg.ids, where, RowNames.of(pipe, seg.ids))
            records = apply_record_op(pipe, k, records, positions, seg.ids, where)
            clock.lap(op.label(k))
        batch = collate_rows(pipe, records, seg.ids, where)
        clock.lap(COLLATE)
        return batch
    if _shared_record_ops(pipe):  # one pass over all the rows in order, as for a single source
        lead = leaves[0]
        names = RowNames.of(pipe, seg.ids, seg.component)
        raw = records
        try:
            for k, op in enumerate(lead.record_ops):
                records = apply_record_op(lead, k, records, seg.positions, seg.ids, where, names)
                clock.lap(op.label(k))
        except StepError as e:  # records of different structures may be why: then that is the error
            _check_components_agree(pipe, raw, seg, where, cause=e)
            raise
        _check_components_agree(pipe, records, seg, where)
        for k, op in enumerate(pipe.record_ops):
            records = apply_record_op(pipe, k, records, positions, seg.ids, where, names)
            clock.lap(op.label(k))
        batch = collate_rows(pipe, records, seg.ids, where, names)
        clock.lap(COLLATE)
        return batch
    groups: list[tuple[np.ndarray, Any, int]] = []
    for c in np.unique(seg.component).tolist():
        rows = np.flatnonzero(seg.component == c)
        leaf = leaves[c]
        cwhere = f"{where}, component {pipe.leaf_names[c]!r}"
        sub: Sequence[Any]
        if leaf.packing is not None:  # its rows at its own positions, its row transforms included
            sub = _packed_rows(leaf, seg.positions[rows], cwhere)
            clock.lap(f"{pipe.leaf_names[c]}: {PACK}")
        else:
            sub = [records[r] for r in rows.tolist()]
            leaf_names = RowNames.of(leaf, seg.ids[rows], rows=rows)
            for k, op in enumerate(leaf.record_ops):
                sub = apply_record_op(leaf, k, sub, seg.positions[rows], seg.ids[rows], cwhere, leaf_names)
                clock.lap(f"{pipe.leaf_names[c]}: {op.label(k)}")
        names = RowNames.of(pipe, seg.ids[rows], seg.component[rows], rows)
        for k, op in enumerate(pipe.record_ops):  # the mixture's transforms, on this component's rows
            sub = apply_record_op(pipe, k, sub, positions[rows], seg.ids[rows], where, names)
            clock.lap(op.label(k))
        groups.append((rows, collate_rows(pipe, sub, seg.ids[rows], where, names), c))
        clock.lap(COLLATE)
    batch = _merge(pipe, groups, seg, where)
    clock.lap(COLLATE)
    return batch


def _shared_record_ops(pipe: Definition) -> bool:
    """Whether every leaf has the same record transforms, none of them random (whose
    keys come from each component's seed): then a mixture's rows can go through them
    together, in row order, at each row's position in its component's stream."""
    ops = pipe.leaves[0].record_ops
    if any(op.kind is OpKind.RANDOM_MAP for op in ops) or any(leaf.packing is not None for leaf in pipe.leaves):
        return False
    return all(leaf.record_ops == ops for leaf in pipe.leaves[1:])


def _structure(x: Any, shapes: bool = True) -> Any:
    """What must agree between the rows of two components: containers, keys, leaf types,
    dtypes and shapes (``shapes=False``: numbers of dimensions only)."""
    if isinstance(x, Mapping):
        return ("dict", tuple(sorted((str(k), _structure(v, shapes)) for k, v in x.items())))
    if isinstance(x, (tuple, list)):
        return (type(x).__name__, tuple(_structure(v, shapes) for v in x))
    if isinstance(x, np.ndarray):
        return ("array", x.dtype.str, x.shape if shapes else x.ndim)
    if isinstance(x, np.generic):
        return ("scalar", x.dtype.str)
    return (type(x).__name__,)


def _structure_text(x: Any, limit: int = 300, batch: bool = False) -> str:
    """A record's structure for messages: ``{'x': int64 array of shape (3,), 'y': float}``
    (``batch=True``: a batch's, by the shape of its rows), cut to ``limit`` characters."""

    def text(v: Any) -> str:
        if isinstance(v, Mapping):
            return "{" + ", ".join(f"{k!r}: {text(w)}" for k, w in v.items()) + "}"
        if isinstance(v, (tuple, list)):
            inner = ", ".join(text(w) for w in v)
            return f"({inner})" if isinstance(v, tuple) else f"[{inner}]"
        if isinstance(v, np.ndarray):
            return f"{v.dtype} array of row shape {v.shape[1:]}" if batch else f"{v.dtype} array of shape {v.shape}"
        if isinstance(v, np.generic):
            return f"{v.dtype} scalar"
        return type(v).__name__

    out = text(x)
    return out if len(out) <= limit else out[: limit - 3] + "..."


def _check_components_agree(
    pipe: Definition, records: Sequence[Any], seg: Segments, where: object, cause: BaseException | None = None
) -> None:
    """The first rows of the components in a step must have the same structure (dict
    keys, types, dtypes and shapes), else a ``StepError`` naming both components, before
    any collate error (collate checks the other rows). ``cause``: a transform failed on
    these records (raw ones, whose shapes may differ), and this is why if they differ."""
    if isinstance(records, CollatedRows):  # stacked already (a vectorised transform): one structure
        return
    first: dict[Any, int] = {}
    for c in np.unique(seg.component).tolist():
        i = int(np.argmax(seg.component == c))
        first.setdefault(_structure(records[i], shapes=cause is None), i)
    if len(first) < 2:
        return
    a, b = sorted(first.values())[:2]
    names = pipe.leaf_names
    ca, cb = int(seg.component[a]), int(seg.component[b])
    raise StepError(
        f"{where}: components {names[ca]!r} and {names[cb]!r} give records of different structures, which "
        f"cannot be batched together: row {a} (record {int(seg.ids[a])} of {names[ca]!r}) is "
        f"{_structure_text(records[a])}, row {b} (record {int(seg.ids[b])} of {names[cb]!r}) is "
        f"{_structure_text(records[b])}; make the components' transforms give the same keys, types, dtypes "
        "and shapes"
    ) from cause


def _merge(pipe: Definition, groups: list[tuple[np.ndarray, Any, int]], seg: Segments, where: object) -> Any:
    """One batch from the batches of a step's components (each of some of its rows):
    every array is concatenated and put back in row order by one gather. The
    components must agree in structure, dtype and row shape, else a ``StepError``
    naming both (what ``collate`` of all the rows would refuse)."""
    if len(groups) == 1:
        return groups[0][1]
    ref_rows, ref, ref_c = groups[0]
    ref_leaves = tree_leaves(ref)
    ref_shape = [(path, a.dtype, a.shape[1:]) for path, a in ref_leaves]
    skeleton = map_leaves(lambda a: None, ref)
    names = pipe.leaf_names
    columns: list[list[np.ndarray]] = [[a] for _, a in ref_leaves]
    for rows, batch, c in groups[1:]:
        got = dict(tree_leaves(batch))
        shape = [
            (path, got[path].dtype, got[path].shape[1:]) if path in got else (path, None, None)
            for path, _ in ref_leaves
        ]
        if shape != ref_shape or len(got) != len(ref_leaves) or map_leaves(lambda a: None, batch) != skeleton:
            a, b = int(ref_rows[0]), int(rows[0])
            raise StepError(
                f"{where}: components {names[ref_c]!r} and {names[c]!r} give records of different structures, "
                f"which cannot be batched together: row {a} (record {int(seg.ids[a])} of {names[ref_c]!r}) is "
                f"{_structure_text(ref, batch=True)}, row {b} (record {int(seg.ids[b])} of {names[c]!r}) is {_structure_text(batch, batch=True)}; "
                "make the components' transforms give the same keys, types, dtypes and shapes"
            )
        for col, (path, _) in zip(columns, ref_leaves):
            col.append(got[path])
    n = sum(len(rows) for rows, _, _ in groups)
    out = []
    for col, (_, dtype, row_shape) in zip(columns, ref_shape):
        arr = np.empty((n, *row_shape), dtype=dtype)
        for (rows, _, _), part in zip(groups, col):
            arr[rows] = part  # one copy per array: each component's rows into their places
        out.append(arr)
    merged = iter(out)
    return map_leaves(lambda _: next(merged), ref)


def batch_stages(
    pipe: Definition,
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
        batch = apply_batch_op(pipe, k, batch, positions, seg.ids, where, names)
        clock.lap(op.label(k))
    return batch


def step_results(
    pipe: Definition,
    steps: Iterable[int],
    process_index: int = 0,
    process_count: int = 1,
    timings: dict[str, float] | None = None,
    check: LengthCheck | None = None,
) -> Iterator[StepResult]:
    """Yield a :class:`StepResult` for each of ``steps`` in order (any steps, not
    necessarily consecutive): its batch, bit-identical to ``pipe.batch_at(step)``,
    or the error that stopped it.

    The plan gives each row's segment (component, record id); the records of all
    the steps are read with one bulk ``read_many`` call per leaf; if that read
    fails, each step is read on its own, so that a read error is reported at its
    own step and the other steps still succeed. A failing step does not stop the
    later ones. ``timings``: seconds per stage are added to it. ``check``: the records
    are checked against a length index (a bucket's, :class:`LengthCheck`)."""
    steps = [_index.check_int(s, "step", 0) for s in steps]
    if not steps:
        return
    if getattr(pipe, "bucketing", None) is not None:
        yield from _bucketed_results(pipe, steps, process_index, process_count, timings)
        return
    positions = [pipe.positions(s, process_index, process_count) for s in steps]
    wheres = [Where(s, process_index, process_count) for s in steps]
    empty = [not p.size for p in positions]
    for i, s in enumerate(steps):  # a host with no rows in a partial last batch: probe row 0 for the structure
        if empty[i]:
            positions[i] = np.asarray([s * (pipe.batch_size or 0)], dtype=np.int64)
    if getattr(pipe, "packing", None) is not None:
        yield from _packed_results(pipe, steps, positions, wheres, empty, process_index, process_count, timings)
        return
    seg = pipe.segments(np.concatenate(positions))
    clock = Clock(timings)
    all_records, failed = _bulk(
        lambda where: read_segments(pipe, seg, where, clock),
        pipe,
        steps,
        wheres,
        process_index,
        process_count,
        timings,
        check,
    )
    if failed is not None:
        yield from failed
        return
    lo = 0
    for s, pos, where, is_empty in zip(steps, positions, wheres, empty):
        hi = lo + len(pos)
        rows, records = seg.take(slice(lo, hi)), all_records[lo:hi]
        lo = hi
        try:
            if is_empty:  # the structure of the probed row, with no rows
                batch = take(record_stages(pipe, records, pos, rows, f"step {s}", timings, check), slice(0, 0))
                batch = batch_stages(pipe, batch, pos[:0], rows.take(slice(0, 0)), f"step {s}", timings)
            else:
                batch = record_stages(pipe, records, pos, rows, where, timings, check)
                batch = batch_stages(pipe, batch, pos, rows, where, timings)
        except Exception as e:
            yield StepResult(s, None, e)
            continue
        yield StepResult(s, batch, None)


def _bucketed_results(
    pipe: Any, steps: list[int], process_index: int, process_count: int, timings: dict[str, float] | None
) -> Iterator[StepResult]:
    """:func:`step_results` of a bucketed pipeline: each step is step ``k`` of one bucket's
    batched pipeline (the plan's assignment), then the bucketed pipeline's own batch
    transforms (keys from the step and row). Steps of one bucket are computed together.
    Every bucket's batch must split over the hosts (checked once per host count), and
    every record must have the tokens the length index says (:class:`LengthCheck`)."""
    bk = pipe.bucketing
    bk.check_hosts(process_count)
    for s in steps:
        pipe.check_step(s)
    comp, within = bk.assign(np.asarray(steps, dtype=np.int64))
    done: dict[int, StepResult] = {}
    for c in np.unique(comp).tolist():
        sel = np.flatnonzero(comp == c)
        part = bk.components[c]
        check = None if bk.lengths is None else LengthCheck(bk.lengths, bk.key, len(part.record_ops) - 1)  # its pad
        results = step_results(part, within[sel].tolist(), process_index, process_count, timings, check)
        for i, r in zip(sel.tolist(), results):
            s = steps[i]
            if r.error is not None:
                error = StepError(f"step {s}, bucket {bk.names[c]!r} (its step {int(within[i])}): {r.error}")
                error.__cause__ = r.error
                done[s] = StepResult(s, None, error)
                continue
            try:
                pos = part.positions(int(within[i]), process_index, process_count)
                rows = s * (pipe.batch_size or 1) + np.arange(len(pos), dtype=np.int64)  # keys: the step and row
                seg = Segments(np.zeros(len(pos), dtype=np.int64), part.record_ids(pos), rows)
                batch = batch_stages(pipe, r.batch, rows, seg, Where(s, process_index, process_count), timings)
            except Exception as e:
                done[s] = StepResult(s, None, e)
                continue
            done[s] = StepResult(s, batch, None)
    for s in steps:
        yield done[s]


PACK = "pack"


def _packed_results(
    pipe: Any,
    steps: list[int],
    positions: list[np.ndarray],
    wheres: list[Where],
    empty: list[bool],
    process_index: int,
    process_count: int,
    timings: dict[str, float] | None,
) -> Iterator[StepResult]:
    """:func:`step_results` of a packed pipeline: the plan gives each row's pieces; the
    documents of all the steps are read in one bulk call, then per step they go
    through the packed pipeline's record transforms, are cut and laid into rows
    (stage ``pack``), and the rows through the transforms after ``pack``, collate
    and the batch transforms."""
    inner = pipe.packing.inner
    pieces = pipe.pieces(np.concatenate(positions))
    uniq = np.unique(pieces.ids)
    clock = Clock(timings)
    got, failed = _bulk(
        lambda where: read(inner, uniq, where), pipe, steps, wheres, process_index, process_count, timings
    )
    if failed is not None:
        yield from failed
        return
    clock.lap(READ)
    lo = 0
    for s, pos, where, is_empty in zip(steps, positions, wheres, empty):
        hi = lo + len(pos)
        a, b = np.searchsorted(pieces.row, [lo, hi], side="left")
        mine = Pieces(pieces.row[a:b] - lo, pieces.ids[a:b], pieces.start[a:b], pieces.length[a:b])
        lo = hi
        clock = Clock(timings)  # each step's own: the previous step's batch stages and send are not in it
        try:
            docs = np.unique(mine.ids)
            records = [got[i] for i in np.searchsorted(uniq, docs).tolist()]
            rows, first = _rows_of(pipe, mine, docs, records, pos, where, clock)
            seg = Segments(np.zeros(len(pos), dtype=np.int64), first, pos)
            batch = collate_rows(pipe, rows, first, where, RowNames.of(inner, first))
            clock.lap(COLLATE)
            if is_empty:
                batch = take(batch, slice(0, 0))
                batch = batch_stages(pipe, batch, pos[:0], seg.take(slice(0, 0)), f"step {s}", timings)
            else:
                batch = batch_stages(pipe, batch, pos, seg, where, timings)
        except Exception as e:
            yield StepResult(s, None, e)
            continue
        yield StepResult(s, batch, None)


def _packed_rows(leaf: Any, positions: np.ndarray, where: object) -> Sequence[Any]:
    """The rows of a packed pipeline at these positions of its stream (a mixture's
    component): its documents read and transformed, laid into rows, then its row
    transforms."""
    pieces = leaf.pieces(positions)
    docs = np.unique(pieces.ids)
    return _rows_of(leaf, pieces, docs, read(leaf.packing.inner, docs, where), positions, where)[0]


def _rows_of(
    leaf: Any,
    pieces: Pieces,
    docs: np.ndarray,
    records: Sequence[Any],
    positions: np.ndarray,
    where: object,
    clock: Clock | None = None,
) -> tuple[Sequence[Any], np.ndarray]:
    """Packed rows at ``positions`` of ``leaf``'s stream from the records of its documents
    ``docs``: the transforms before ``pack`` on the records, the rows laid (stage
    ``pack``), then the transforms after it. Also each row's first document, which
    names the row in messages."""
    clock = clock or Clock(None)
    inner = leaf.packing.inner
    for k, op in enumerate(inner.record_ops):
        records = apply_record_op(inner, k, records, docs, docs, where)
        clock.lap(op.label(k))
    rows: Sequence[Any] = _lay_rows(leaf.packing, dict(zip(docs.tolist(), records)), pieces, len(positions), where)
    clock.lap(PACK)
    first = np.full(len(positions), -1, dtype=np.int64)
    first[pieces.row[::-1]] = pieces.ids[::-1]
    for k, op in enumerate(leaf.record_ops):
        rows = apply_record_op(leaf, k, rows, positions, first, where, RowNames.of(inner, first))
        clock.lap(op.label(k))
    return rows, first


def _lay_rows(packing: Any, docs: dict[int, Any], pieces: Pieces, n_rows: int, where: object) -> CollatedRows:
    """Stage ``pack``: the rows ``{"tokens", "segment_ids", "positions", other per-token
    arrays}`` (``n_rows`` x ``seq_len``) made of ``pieces`` of the transformed ``docs``.
    Each document is checked once; each piece is one slice copy per array (a contiguous
    copy: faster here than one scatter of every token of the step, measured on the
    stdlib corpus, 0.3-0.5 vs 0.9 ms per step of 8 rows)."""
    S, key, concat = packing.seq_len, packing.key, packing.mode == "concat"
    source = packing.inner.source.name

    seen: dict[int, tuple[np.ndarray, dict[str, np.ndarray]]] = {}

    def tokens_of(rid: int) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        hit = seen.get(rid)
        if hit is None:
            hit = seen[rid] = _tokens_of(rid)
        return hit

    def _tokens_of(rid: int) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        rec = docs[rid]
        value = rec[key] if key is not None and isinstance(rec, Mapping) and key in rec else rec
        arr = np.asarray(value) if not isinstance(value, (bytes, str, Mapping)) else None
        if arr is None or arr.ndim != 1:
            raise StepError(
                f"{where}, stage '{PACK}', record {rid} of source {source!r}: expected a 1-D array of tokens"
                f"{'' if key is None else f' under key {key!r}'}, got {describe(value)}"
            )
        if int(packing.lengths[rid]) != arr.shape[0]:
            raise StepError(
                f"{where}, stage '{PACK}', record {rid} of source {source!r}: it has {arr.shape[0]} tokens but the "
                f"length index says {int(packing.lengths[rid])}: the index was made for other data or transforms"
            )
        extra = {}
        if isinstance(rec, Mapping):
            extra = {
                str(k): np.asarray(v)
                for k, v in rec.items()
                if k != key and isinstance(v, np.ndarray) and v.ndim == 1 and v.shape[0] == arr.shape[0]
            }
        return arr, extra

    first_tokens, first_extra = tokens_of(int(pieces.ids[0])) if len(pieces.ids) else (np.zeros(0, np.int32), {})
    out = {"tokens": np.zeros((n_rows, S), dtype=first_tokens.dtype)}
    out["segment_ids"] = np.zeros((n_rows, S), dtype=np.int32)
    out["positions"] = np.zeros((n_rows, S), dtype=np.int32)
    for name, v in first_extra.items():
        out[name] = np.zeros((n_rows, S), dtype=v.dtype)
    fill = np.zeros(n_rows, dtype=np.int64)
    segment = np.zeros(n_rows, dtype=np.int32)
    for r, rid, start, n in zip(
        pieces.row.tolist(), pieces.ids.tolist(), pieces.start.tolist(), pieces.length.tolist()
    ):
        arr, extra = tokens_of(rid)
        if arr.dtype != first_tokens.dtype or set(extra) != set(first_extra):
            raise StepError(
                f"{where}, stage '{PACK}', record {rid} of source {source!r}: its tokens are {arr.dtype} with "
                f"per-token arrays {sorted(extra)}, the step's first record's are {first_tokens.dtype} with "
                f"{sorted(first_extra)}: documents packed together must agree"
            )
        o = int(fill[r])
        segment[r] += 1
        out["tokens"][r, o : o + n] = arr[start : start + n]
        out["segment_ids"][r, o : o + n] = segment[r]
        out["positions"][r, o : o + n] = np.arange(start, start + n) if concat else np.arange(n)
        for name, v in extra.items():
            out[name][r, o : o + n] = v[start : start + n]
        fill[r] = o + n
    return CollatedRows(out, n_rows)


def _bulk(
    read_all: Callable[[object], Any],
    pipe: Any,
    steps: list[int],
    wheres: list[Where],
    process_index: int,
    process_count: int,
    timings: dict[str, float] | None,
    check: LengthCheck | None = None,
) -> tuple[Any, list[StepResult] | None]:
    """The records of all ``steps`` in one bulk read (``read_all(where)``), or, if it
    fails, the steps' results computed one step at a time, so that a read error is
    reported at its own step and the other steps still succeed (``check`` as there)."""
    try:
        return read_all(wheres[0] if len(steps) == 1 else f"steps {steps[0]}..{steps[-1]}"), None
    except StepError as e:
        if len(steps) > 1:
            return None, [
                r for s in steps for r in step_results(pipe, [s], process_index, process_count, timings, check)
            ]
        return None, [StepResult(steps[0], None, e)]


def batches_at(
    pipe: Definition,
    step: int,
    count: int,
    process_index: int = 0,
    process_count: int = 1,
    timings: dict[str, float] | None = None,
) -> list[Any]:
    """``[pipe.batch_at(s) for s in range(step, step + count)]`` with one bulk read;
    raises the error of the first step that fails. ``timings``: seconds per stage are added to it."""
    count = _index.check_int(count, "count", 1)
    step = _index.check_int(step, "step", 0)
    out = []
    for result in step_results(pipe, range(step, step + count), process_index, process_count, timings):
        if result.error is not None:
            raise result.error
        out.append(result.batch)
    return out
