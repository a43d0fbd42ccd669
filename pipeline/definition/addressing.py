"""Addressing a pipeline: its steps, a step's stream positions and records, and computing steps.

Pure index arithmetic over the definition: step ``s`` of a global batch of ``B``
covers stream positions ``[s*B, (s+1)*B)``, host ``h`` of ``H`` owns rows
``[h*B/H, (h+1)*B/H)`` of it (:func:`quern.pipeline.order.index.host_rows`), and the
stream says which records a position is (:mod:`quern.pipeline.streams`). Functions
over a :class:`~quern.pipeline.definition.dataset.Pipeline`; its methods of the same
names call them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from .. import execute
from ..core.batching import need_batch
from ..order import Pieces, Segments
from ..order import index as _index
from ..sources import Source
from ..streams.capabilities import Invertible, Packed, SingleSource, require

if TYPE_CHECKING:
    from .dataset import Pipeline

__all__ = [
    "num_steps",
    "leaves",
    "leaf_names",
    "sources",
    "check_step",
    "positions",
    "record_ids",
    "segments",
    "pieces",
    "explain",
    "where",
    "batch_at",
    "batches_at",
]


def leaves(pipe: Pipeline) -> tuple[Pipeline, ...]:
    """The single-source pipelines the rows of ``pipe`` are read from.

    Args:
        pipe: the pipeline.

    Returns:
        ``pipe`` itself for a single source's stream, else a mixture's components in order.
    """
    return pipe.stream.leaves(pipe)


def leaf_names(pipe: Pipeline) -> tuple[str, ...]:
    """The names of :func:`leaves`.

    Args:
        pipe: the pipeline.

    Returns:
        The source's name, or the mixture's component keys, in the order of :func:`leaves`.
    """
    return pipe.stream.leaf_names(pipe)


def sources(pipe: Pipeline) -> tuple[Source, ...]:
    """The source of each of :func:`leaves`.

    Args:
        pipe: the pipeline.

    Returns:
        One source per leaf, in the order of :func:`leaves`.
    """
    out = tuple(leaf.stream.source for leaf in leaves(pipe))
    assert all(src is not None for src in out)
    return out  # type: ignore[return-value]


def num_steps(pipe: Pipeline) -> int | None:
    """The number of steps of ``pipe``'s stream.

    ``total // B`` (``ceil`` with ``drop_remainder=False``), ``total`` being the stream's positions.

    Args:
        pipe: the pipeline.

    Returns:
        The step count, or ``None`` when the stream is endless.

    Raises:
        ValueError: the pipeline has no batch.
    """
    b = need_batch(pipe, "num_steps")
    total = pipe.stream.length()
    if total is None:
        return None
    return total // b if pipe.drop_remainder else -(-total // b)


def check_step(pipe: Pipeline, step: object, *, name: str = "step", end_ok: bool = False) -> int:
    """``step`` as an int, checked: the one end-of-stream check of every entry point.

    Args:
        pipe: the pipeline.
        step: the step.
        name: how messages name it (``start_step``, ``state['step']``).
        end_ok: allow the step just past the last (a start step at the end yields nothing).

    Returns:
        The step.

    Raises:
        TypeError: not an integer.
        ValueError: negative, or the pipeline has no batch.
        IndexError: past the end of the stream or of the addressable positions (``2**62``).
    """
    b = need_batch(pipe, "a step")
    step = _index.check_int(step, name, 0)
    n_steps = num_steps(pipe)
    if n_steps is not None and (step > n_steps or (step == n_steps and not end_ok)):
        raise IndexError(
            f"{name} {step} is past the end of the stream: {n_steps} steps "
            f"({pipe.stream.size_text()} x {pipe.num_epochs} epochs, batch {pipe.batch_size})"
        )
    if (step + 1) * b > _index.MAX_RECORDS:
        raise IndexError(f"{name} {step} is beyond the addressable stream (positions must stay below 2**62)")
    return step


def positions(pipe: Pipeline, step: int, process_index: int = 0, process_count: int = 1) -> np.ndarray:
    """Stream positions of this host's rows at ``step`` (for a bucketed pipeline, in its bucket's stream).

    Args:
        pipe: the pipeline.
        step: the step.
        process_index: this host.
        process_count: the number of hosts.

    Returns:
        An int64 array.
    """
    return pipe.stream.positions(pipe, check_step(pipe, step), process_index, process_count)


def record_ids(pipe: Pipeline, where: np.ndarray) -> np.ndarray:
    """The record id of the source at each stream position of a single-source pipeline.

    Pure index arithmetic (the keyed permutation, a filter's survivors); reads nothing.

    Args:
        pipe: the pipeline.
        where: stream positions (from :func:`positions`).

    Returns:
        An int64 array of record ids, one per position.

    Raises:
        TypeError: the rows come from several sources (use :func:`segments`).
    """
    return require(pipe.stream, SingleSource, "record_ids").record_ids(where)


def segments(pipe: Pipeline, where: np.ndarray) -> Segments:
    """The plan of these stream positions: per row, its leaf, record id and position in the leaf's stream.

    Args:
        pipe: the pipeline.
        where: stream positions (from :func:`positions`).

    Returns:
        The plan (:class:`~quern.pipeline.order.Segments`), row by row.

    Raises:
        TypeError: the rows are not single records (packed: :func:`pieces`; bucketed: :func:`explain`).
    """
    return pipe.stream.segments(np.asarray(where, dtype=np.int64))


def explain(
    pipe: Pipeline, step: int, process_index: int = 0, process_count: int = 1
) -> list[list[tuple[str, int | str]]]:
    """For each row of this host's batch at ``step``: the ``(name, record_index)`` pairs it was made from.

    ``name`` is the source's name or, in a mixture, the component's key; a packed
    row lists every document in it. O(batch) time; reads nothing.

    Args:
        pipe: the pipeline.
        step: the step.
        process_index: this host.
        process_count: the number of hosts.

    Returns:
        One list of pairs per row.
    """
    return pipe.stream.explain(pipe, check_step(pipe, step), process_index, process_count)


def where(pipe: Pipeline, record: int, *, component: str | None = None, epochs: int = 1) -> list[tuple[int, int]]:
    """The ``(step, row)`` pairs where source record ``record`` appears, in increasing order.

    In the first ``epochs`` epochs of the stream (of component ``component``'s own stream
    for a mixture, whose components each have their own epochs; of the bucket's stream
    for a bucketed pipeline); for a packed stream, every row that holds a piece of the
    record; none for a record a filter drops. It inverts the plan (the keyed
    permutation, the filter's survivors, the mixture's blocks, the packing plan)
    instead of scanning steps: O(epochs x log N) for a plain or filtered stream, and
    reads no record. ``row`` indexes the global batch in the stream's order: with
    ``balance_hosts`` a batch's rows are ordered by the host count, and ``row`` is the
    row of one host (``process_count=1``) there. Each pair is a row of
    ``explain(step)`` that names the record; a finite stream's steps past its end
    are left out.

    Args:
        pipe: the pipeline.
        record: a record id of the source (of ``component``'s source for a mixture).
        component: the mixture component's key (required for a mixture, else ``None``).
        epochs: epochs to look in, at least 1 (a finite stream's own epochs at most).

    Returns:
        The ``(step, row)`` pairs.

    Raises:
        TypeError: ``record`` or ``epochs`` is not an integer, or this kind of stream
            cannot answer it (named).
        ValueError: no ``batch()``, ``epochs`` below 1, a negative ``record``, a mixture
            without ``component=`` or with an unknown one (the components are listed),
            or ``component`` given for a pipeline that is not a mixture.
        IndexError: ``record`` is not a record of the source (naming its size).

    Example:
        >>> import numpy as np, quern
        >>> pipe = quern.Pipeline.from_source({"x": np.arange(10)}, seed=0, num_epochs=2).batch(4)
        >>> pipe.where(6, epochs=2)
        [(1, 2), (4, 0)]
        >>> pipe.explain(1)[2], pipe.explain(4)[0]
        ([('arrays', 6)], [('arrays', 6)])
    """
    need_batch(pipe, "where")
    record = _index.check_int(record, "where(): record", 0)
    epochs = _index.check_int(epochs, "where(): epochs", 1)
    src = pipe.stream.source if component is None else None
    if component is not None and component in leaf_names(pipe):
        src = leaves(pipe)[leaf_names(pipe).index(component)].stream.source
    if src is not None and pipe.stream.wait_timeout() is None and record >= len(src):  # live: no length
        of = "" if component is None else f" (component {component!r})"
        raise IndexError(
            f"where(): record {record} is not a record of source {src.name!r}{of}: it has {len(src)} "
            f"records, ids 0..{len(src) - 1}"
        )
    return require(pipe.stream, Invertible, "where").where(pipe, record, component, epochs)


def batch_at(pipe: Pipeline, step: int, process_index: int = 0, process_count: int = 1) -> Any:
    """This host's rows of the global batch at ``step``, collated.

    Depends only on the pipeline definition, ``step`` and the host slice; the slices
    of all hosts concatenated give the global batch.

    Args:
        pipe: the pipeline.
        step: the step.
        process_index: this host.
        process_count: the number of hosts.

    Returns:
        The batch.

    Raises:
        StepError: a stage failed, naming the step, host slice, stage and records.
    """
    return execute.batches_at(pipe, step, 1, process_index, process_count)[0]


def batches_at(pipe: Pipeline, step: int, count: int, process_index: int = 0, process_count: int = 1) -> list[Any]:
    """``[batch_at(s) for s in range(step, step + count)]``, with the records read in one bulk call.

    Args:
        pipe: the pipeline.
        step: the first step.
        count: the number of steps.
        process_index: this host.
        process_count: the number of hosts.

    Returns:
        The batches, each bit-identical to ``batch_at(s)``.

    Raises:
        StepError: the first step that fails.
    """
    return execute.batches_at(pipe, step, count, process_index, process_count)


def pieces(pipe: Pipeline, where: np.ndarray) -> Pieces:
    """The documents in the packed rows at these stream positions (reads nothing).

    Args:
        pipe: the pipeline.
        where: stream positions (from :func:`positions`).

    Returns:
        The pieces, row by row.

    Raises:
        TypeError: the pipeline is not packed.
    """
    return require(pipe.stream, Packed, "pieces").pieces(where)
