"""What a step is computed for and what it gives: :class:`StepRequest`, :class:`Where`, :class:`StepResult`, :class:`LengthCheck`."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, NamedTuple

import numpy as np

__all__ = ["StepRequest", "Where", "StepResult", "LengthCheck"]


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


class LengthCheck(NamedTuple):
    """A bucket's check of its records against the length index it was bucketed by.

    Before record transform ``at`` (the bucket's ``pad``), every record's tokens (``len(record[key])``) must be what
    ``lengths`` (one value per source record) says, else the record could be cut to the bucket's bound or be in another
    bucket.
    """

    lengths: np.ndarray
    key: str | None
    at: int


class StepRequest(NamedTuple):
    """What a stream's step runner is asked for: which steps, for which host slice, timed and checked how.

    The one argument of :meth:`~quern.pipeline.streams.protocol.Stream.results`. The
    batches it gives depend only on the pipeline, :attr:`steps` and the host slice;
    :attr:`timings` and :attr:`check` change what is measured and refused, never a batch.

    Attributes:
        steps: checked step numbers, any order.
        process_index: this host.
        process_count: the number of hosts.
        timings: seconds per stage are added to it (``None``: not timed).
        check: the records are checked against a length index (a bucket's; ``None``: not checked).
    """

    steps: tuple[int, ...]
    process_index: int = 0
    process_count: int = 1
    timings: dict[str, float] | None = None
    check: LengthCheck | None = None

    def of(self, steps: Iterable[int]) -> StepRequest:
        """This request for other steps (the same host slice, timings and check).

        Args:
            steps: the steps.

        Returns:
            The request.
        """
        return self._replace(steps=tuple(steps))

    def where(self, step: int) -> Where:
        """Step ``step`` of this host slice, as messages name it.

        Args:
            step: the step.

        Returns:
            The step and the host slice.
        """
        return Where(step, self.process_index, self.process_count)
