"""The step runner: compute one (step, host slice) of a pipeline.

:func:`step_results` hands a list of steps to the pipeline's stream
(:meth:`~quern.pipeline.streams.Stream.results`), which plans the rows and runs
the generic stages of :mod:`.stages` on them: ``read`` (one bulk ``read_many``
call per leaf for all the steps at once), the record transforms, ``collate`` and
the batch transforms. :mod:`.runner` is the runner of streams whose rows are
segments (a source, a filtered source, a mixture). ``timings``, a dict, gathers
the seconds spent per stage (:mod:`quern.pipeline.core.timing`). Every output depends
only on (the definition, the step, the host slice): never on which process or
thread runs it, or on what ran before.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

from ..order import index as _index
from .padding import padded
from .stages import COLLATE, READ, LengthCheck, StepRequest, StepResult, Where, read, steps_per_read

if TYPE_CHECKING:
    from ..definition.dataset import Pipeline

__all__ = [
    "Where",
    "StepRequest",
    "StepResult",
    "LengthCheck",
    "READ",
    "COLLATE",
    "read",
    "step_results",
    "run",
    "batches_at",
    "steps_per_read",
    "check_hosts",
]


def step_results(
    pipe: Pipeline,
    steps: Iterable[int],
    process_index: int = 0,
    process_count: int = 1,
    timings: dict[str, float] | None = None,
    check: LengthCheck | None = None,
) -> Iterator[StepResult]:
    """A :class:`~.stages.StepResult` for each of ``steps``, in order.

    Each holds the step's batch, bit-identical to ``pipe.batch_at(step)``, or the
    error that stopped it; a failing step does not stop the later ones.

    Args:
        pipe: the pipeline.
        steps: step numbers (any, not necessarily consecutive).
        process_index: this host.
        process_count: the number of hosts.
        timings: seconds per stage are added to it.
        check: the records are checked against a length index (a bucket's).

    Yields:
        One :class:`~.stages.StepResult` per step.

    Raises:
        TypeError: a step is not an integer.
        ValueError: a step is negative.
    """
    todo = tuple(_index.check_int(s, "step", 0) for s in steps)
    if todo:
        yield from run(pipe, StepRequest(todo, process_index, process_count, timings, check))


def run(pipe: Pipeline, request: StepRequest) -> Iterator[StepResult]:
    """The stream's step runner for ``request`` (:meth:`~quern.pipeline.streams.protocol.Stream.results`).

    Args:
        pipe: the pipeline.
        request: the steps (checked), the host slice, the timings and the length check.

    Yields:
        One :class:`~.stages.StepResult` per requested step, in order; each batch bit-identical
        to ``pipe.batch_at(step)`` (padded to whole batches with ``batch(pad_remainder=True)``:
        :mod:`.padding`).
    """
    results = pipe.stream.results(pipe, request)
    return results if pipe.pad_remainder is None else padded(pipe, request, results)


def batches_at(
    pipe: Pipeline,
    step: int,
    count: int,
    process_index: int = 0,
    process_count: int = 1,
    timings: dict[str, float] | None = None,
) -> list[Any]:
    """``[pipe.batch_at(s) for s in range(step, step + count)]`` with one bulk read.

    Args:
        pipe: the pipeline.
        step: the first step.
        count: the number of steps.
        process_index: this host.
        process_count: the number of hosts.
        timings: seconds per stage are added to it.

    Returns:
        The batches, in step order.

    Raises:
        StepError: the first step that fails.
    """
    count = _index.check_int(count, "count", 1)
    step = _index.check_int(step, "step", 0)
    out = []
    for result in step_results(pipe, range(step, step + count), process_index, process_count, timings):
        if result.error is not None:
            raise result.error
        out.append(result.batch)
    return out


def check_hosts(pipe: Pipeline, process_count: int) -> None:
    """Check, before the first step, that every batch of ``pipe`` splits over ``process_count`` hosts.

    Args:
        pipe: the pipeline.
        process_count: the number of hosts.

    Raises:
        ValueError: a batch of the stream (a bucket's, say) does not split over that many hosts.
    """
    pipe.stream.check_hosts(process_count)
