"""Streams whose rows are segments: each row is one record of one leaf (a source, a filtered source, a mixture).

Their steps run on the segment runner
(:func:`quern.pipeline.execute.runner.segment_results`): one bulk read per leaf
for all the steps at once, then each step's record transforms, collate and batch
transforms.
"""

from __future__ import annotations

from collections.abc import Iterator

from ..core.steps import LengthCheck, StepResult
from ..execute import runner
from .protocol import Definition, Stream

__all__ = ["SegmentStream"]


class SegmentStream(Stream):
    """A :class:`~quern.pipeline.streams.protocol.Stream` whose :meth:`segments` give each row's leaf and record."""

    def results(
        self,
        pipe: Definition,
        steps: list[int],
        process_index: int,
        process_count: int,
        timings: dict[str, float] | None,
        check: LengthCheck | None,
    ) -> Iterator[StepResult]:
        """The segment runner's results (:func:`quern.pipeline.execute.runner.segment_results`)."""
        return runner.segment_results(pipe, steps, process_index, process_count, timings, check)
