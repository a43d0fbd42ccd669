"""The step runner of streams whose rows are segments (a source, a filtered source, a mixture).

:func:`segment_results` computes a list of steps: the plan gives each row's
segment (leaf, record id, position in the leaf's stream); the records of all the
steps are read with one bulk ``read_many`` call per leaf; then, step by step,
the record transforms (each leaf's own, then the pipeline's), ``collate`` and
the batch transforms. Streams of other kinds use the same stages
(:mod:`quern.pipeline.execute.stages`) in their own ``results``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from ..core.collate import CollatedRows, take
from ..core.errors import StepError
from ..core.ops import OpKind
from ..core.timing import Clock
from ..core.tree import leaves as tree_leaves
from ..core.tree import map_leaves
from ..order import Segments
from .stages import (
    COLLATE,
    READ,
    LengthCheck,
    RowNames,
    StepRequest,
    StepResult,
    Where,
    apply_record_op,
    batch_stages,
    check_lengths,
    collate_rows,
    read,
)

if TYPE_CHECKING:
    from ..definition.dataset import Pipeline

__all__ = ["segment_results", "step_positions", "bulk", "read_segments", "record_stages"]


def read_segments(pipe: Pipeline, seg: Segments, where: object, clock: Clock | None = None) -> list[Any]:
    """Stage ``read`` for rows from any leaves.

    One bulk call per leaf, rows in order. The rows of a leaf whose rows are not records (a packed component) are left
    ``None``: it makes them itself. ``clock`` laps ``read`` (a mixture: ``read: NAME`` per component).
    """
    leaves = pipe.leaves
    clock = clock or Clock(None)
    if len(leaves) == 1:
        records = list(read(leaves[0], seg.ids, where))
        clock.lap(READ)
        return records
    out: list[Any] = [None] * len(seg.ids)
    for c in np.unique(seg.component).tolist():
        if not leaves[c].stream.reads_records:
            continue
        rows = np.flatnonzero(seg.component == c)
        got = read(leaves[c], seg.ids[rows], f"{where}, component {pipe.leaf_names[c]!r}")
        for r, rec in zip(rows.tolist(), got):
            out[r] = rec
        clock.lap(f"{READ}: {pipe.leaf_names[c]}")
    return out


def record_stages(
    pipe: Pipeline,
    records: Sequence[Any],
    positions: np.ndarray,
    seg: Segments,
    where: object,
    timings: dict[str, float] | None = None,
    check: LengthCheck | None = None,
) -> Any:
    """The record transforms and ``collate`` of one step's records.

    Its batch before the batch transforms. For a mixture: each component's own transforms on its rows (at the rows'
    positions in the component's stream), the check that the components agree, then the mixture's transforms (at the
    mixture's positions). ``check``: a single source's records are checked against a length index first (a bucket's,
    :class:`LengthCheck`).
    """
    clock = Clock(timings)
    leaves = pipe.leaves
    if pipe.stream.source is not None:  # a single source: its transforms are the definition's own
        for k, op in enumerate(pipe.record_ops):
            if check is not None and k == check.at:
                check_lengths(pipe, check, records, seg.ids, where, RowNames.of(pipe, seg.ids))
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
        if not leaf.stream.reads_records:  # it makes its rows at its own positions, its transforms included
            sub = leaf.stream.rows(leaf, seg.positions[rows], cwhere, clock, f"{pipe.leaf_names[c]}: ")
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


def _shared_record_ops(pipe: Pipeline) -> bool:
    """Whether every leaf has the same record transforms, none of them random.

    Random ones take their keys from each component's seed. Then a mixture's rows can go
    through them together, in row order, at each row's position in its component's stream.
    """
    ops = pipe.leaves[0].record_ops
    if any(op.kind is OpKind.RANDOM_MAP for op in ops) or not all(leaf.stream.reads_records for leaf in pipe.leaves):
        return False
    return all(leaf.record_ops == ops for leaf in pipe.leaves[1:])


def _structure(x: Any, shapes: bool = True) -> Any:
    """What must agree between the rows of two components.

    Containers, keys, leaf types, dtypes and shapes (``shapes=False``: numbers of dimensions only).
    """
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
    """A record's structure for messages.

    ``{'x': int64 array of shape (3,), 'y': float}`` (``batch=True``: a batch's, by the shape of its rows), cut to
    ``limit`` characters.
    """

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
    pipe: Pipeline, records: Sequence[Any], seg: Segments, where: object, cause: BaseException | None = None
) -> None:
    """Check that the first rows of the step's components have the same structure.

    Dict keys, types, dtypes and shapes, else a ``StepError`` naming both components, before
    any collate error (collate checks the other rows). ``cause``: a transform failed on
    these records (raw ones, whose shapes may differ), and this is why if they differ.
    """
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


@Clock.stage("collate")
def _merge(pipe: Pipeline, groups: list[tuple[np.ndarray, Any, int]], seg: Segments, where: object) -> Any:
    """One batch from the batches of a step's components (each of some of its rows).

    Every array is concatenated and put back in row order by one gather. The components must agree in structure, dtype
    and row shape, else a ``StepError`` naming both (what ``collate`` of all the rows would refuse).
    """
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


def step_positions(pipe: Pipeline, request: StepRequest) -> tuple[list[np.ndarray], list[Where], list[bool]]:
    """Each requested step's positions for this host, its :class:`Where`, and whether it has no rows.

    A host with no rows in a partial last batch gets the position of the step's row 0
    instead (flagged empty), so that its empty batch still has the batch's structure.
    """
    positions = [pipe.positions(s, request.process_index, request.process_count) for s in request.steps]
    wheres = [request.where(s) for s in request.steps]
    empty = [not p.size for p in positions]
    for i, s in enumerate(request.steps):
        if empty[i]:
            positions[i] = np.asarray([s * (pipe.batch_size or 0)], dtype=np.int64)
    return positions, wheres, empty


def segment_results(pipe: Pipeline, request: StepRequest) -> Iterator[StepResult]:
    """A :class:`StepResult` per step, in order.

    Its batch, bit-identical to ``pipe.batch_at(step)``, or the error that stopped it.

    The plan gives each row's segment (leaf, record id); the records of all the
    steps are read with one bulk ``read_many`` call per leaf; if that read fails,
    each step is read on its own, so that a read error is reported at its own step
    and the other steps still succeed. A failing step does not stop the later ones.

    Args:
        pipe: a pipeline whose stream has segments.
        request: the steps (checked, any order), the host slice, the timings (seconds per stage
            are added to them) and the length check (a bucket's, :class:`LengthCheck`).

    Yields:
        One :class:`StepResult` per step.
    """
    steps, timings, check = list(request.steps), request.timings, request.check
    if not steps:
        return
    positions, wheres, empty = step_positions(pipe, request)
    seg = pipe.stream.segments(np.concatenate(positions))
    clock = Clock(timings)
    all_records, failed = bulk(lambda where: read_segments(pipe, seg, where, clock), pipe, request, wheres)
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


def bulk(
    read_all: Callable[[object], Any], pipe: Pipeline, request: StepRequest, wheres: list[Where]
) -> tuple[Any, list[StepResult] | None]:
    """The records of all the requested steps in one bulk read (``read_all(where)``), or the results step by step.

    If the bulk read fails, the steps' results are computed one step at a time (the
    request for each one step), so that a read error is reported at its own step and the
    other steps still succeed.
    """
    steps = request.steps
    try:
        return read_all(wheres[0] if len(steps) == 1 else f"steps {steps[0]}..{steps[-1]}"), None
    except StepError as e:
        if len(steps) > 1:
            return None, [r for s in steps for r in pipe.stream.results(pipe, request.of([s]))]
        return None, [StepResult(steps[0], None, e)]
