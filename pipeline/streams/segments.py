"""Streams whose rows are segments: each row is one record of one leaf (a source, a filtered source, a mixture).

Their steps run on the segment runner
(:func:`quern.pipeline.execute.runner.segment_results`): one bulk read per leaf
for all the steps at once, then each step's record transforms, collate and batch
transforms.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from ..core.steps import StepRequest, StepResult
from ..execute import runner
from .protocol import Stream

if TYPE_CHECKING:
    from ..definition.dataset import Pipeline

__all__ = ["SegmentStream"]


class SegmentStream(Stream):
    """A :class:`~quern.pipeline.streams.protocol.Stream` whose :meth:`segments` give each row's leaf and record.

    Its step runner is the segment runner: a kind implements the rest of the core
    (:meth:`length`, :meth:`leaves`, :meth:`segments`, :meth:`describe`, :meth:`text`).
    """

    def results(self, pipe: Pipeline, request: StepRequest) -> Iterator[StepResult]:
        """The segment runner's results (:func:`quern.pipeline.execute.runner.segment_results`)."""
        return runner.segment_results(pipe, request)
