"""Edits that keep the past: skipping the data of some steps, excluding records from a step on.

The bodies of :meth:`Pipeline.skip_steps <quern.pipeline.definition.dataset.Pipeline.skip_steps>`
and :meth:`Pipeline.exclude <quern.pipeline.definition.dataset.Pipeline.exclude>` (whose
docstrings say what they do): the checks, then the edit on the pipeline's
:class:`~quern.pipeline.streams.edited.EditedStream` (how edits compose and
describe themselves: ``docs/design/edits.md``).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import numpy as np

from ..core.batching import need_batch
from ..order import index as _index
from ..streams.capabilities import Editable, require
from ..streams.edited import EXCLUDE, SKIP, EditedStream
from . import addressing

if TYPE_CHECKING:
    from .dataset import Pipeline

__all__ = ["skip_steps", "exclude"]


def skip_steps(pipe: Pipeline, start: int, stop: int) -> Pipeline:
    """Skip the data of steps ``[start, stop)``: training steps from ``start`` on get that of ``stop``, ``stop + 1``, ...

    For a loss spike: the batches of the steps before ``start`` are unchanged, and the
    data of ``[start, stop)`` is never used. ``start`` and ``stop`` are steps of this
    pipeline, so edits compose in the order they are made. A state saved at step ``k``
    resumes on the edited pipeline when ``start >= k`` (:func:`~quern.pipeline.definition.identify.check_state`).

    Args:
        pipe: the pipeline to edit.
        start: the first training step that gets other data.
        stop: the step whose data training step ``start`` gets.

    Returns:
        The edited pipeline.

    Raises:
        ValueError: before ``batch()``, ``stop <= start``, or ``stop`` past the end of a finite stream.
        TypeError: a step that is not an integer.

    Example:
        >>> import numpy as np, quern
        >>> pipe = quern.Pipeline.from_source({"x": np.arange(100)}).batch(2)
        >>> [pipe.skip_steps(1, 3).batch_at(s)["x"].tolist() for s in range(3)]
        [[0, 1], [6, 7], [8, 9]]
    """
    b = need_batch(pipe, SKIP)
    pipe.stream.check(SKIP)
    start = _index.check_int(start, "skip_steps start", 0)
    stop = _index.check_int(stop, "skip_steps stop", 0)
    if stop <= start:
        raise ValueError(f"skip_steps(start={start}, stop={stop}): stop must be greater than start")
    n_steps = addressing.num_steps(pipe)
    if n_steps is not None and stop > n_steps:
        raise ValueError(
            f"skip_steps(start={start}, stop={stop}): stop is past the end of the stream ({n_steps} steps)"
        )
    return dataclasses.replace(pipe, stream=EditedStream.of(pipe.stream, b).with_skip(start, stop))


def exclude(pipe: Pipeline, records: Any, from_step: int, component: str | None) -> Pipeline:
    """Never use the records ``records`` from step ``from_step`` on (a takedown).

    The stream continues with the remaining records (their positions shift); every step
    before ``from_step`` is unchanged. In a packed stream an excluded document's pieces
    become padding in the rows that hold them (the plan is not redone, so no row moves).
    A state saved at step ``k`` resumes on the edited pipeline when ``from_step >= k``.

    Args:
        pipe: the pipeline to edit.
        records: record ids of the source (of ``component``'s source): integers, any order.
        from_step: the first step without them.
        component: the mixture component the ids are of (required for a mixture).

    Returns:
        The edited pipeline.

    Raises:
        ValueError: before ``batch()``, no id, an id out of range, every record excluded, a
            mixture without ``component`` (the message lists the components), or a stream
            kind that cannot exclude records (named).
        TypeError: ids or a step that are not integers.

    Example:
        >>> import numpy as np, quern
        >>> pipe = quern.Pipeline.from_source({"x": np.arange(6)}, num_epochs=1).batch(2)
        >>> edited = pipe.exclude([3, 4], from_step=1)
        >>> [edited.batch_at(s)["x"].tolist() for s in range(edited.num_steps)]
        [[0, 1], [2, 5]]
    """
    b = need_batch(pipe, EXCLUDE)
    pipe.stream.check(EXCLUDE)
    require(pipe.stream, Editable, EXCLUDE)
    from_step = addressing.check_step(pipe, from_step, name="exclude from_step", end_ok=True)
    names = addressing.leaf_names(pipe)
    src = None  # the source the ids are of; a mixture without a valid component: its refusal names them
    if component is not None and component in names:
        src = addressing.sources(pipe)[names.index(component)]
    elif len(names) == 1:
        src = addressing.sources(pipe)[0]
    ids = np.asarray(records)
    if ids.dtype == object or ids.ndim != 1 or (ids.size and not np.issubdtype(ids.dtype, np.integer)):
        raise TypeError(f"exclude() needs a 1-D sequence of integer record ids, got {records!r:.200}")
    if not ids.size:
        raise ValueError("exclude() needs at least one record id")
    bad = ids[(ids < 0) | (ids >= len(src))] if src is not None else ids[:0]
    if bad.size and src is not None:
        raise ValueError(
            f"exclude(): record id {int(bad[0])} is out of range: source {src.name!r} has {len(src)} records "
            f"(ids 0..{len(src) - 1})"
        )
    ids = np.unique(ids.astype(np.int64))
    edited = EditedStream.of(pipe.stream, b).with_exclude(pipe, ids, from_step, component)
    return dataclasses.replace(pipe, stream=edited)
