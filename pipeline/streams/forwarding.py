"""The wrapper base: a stream over another stream (its *parent*) that forwards what it does not change.

A :class:`ForwardingStream` answers every method of the core and of the neutral
defaults of :class:`~quern.pipeline.streams.protocol.Stream` with its parent's
answer (a method that takes the pipeline passes the parent's pipeline: this
pipeline's stages over the parent stream), and every method of every capability
of :data:`~quern.pipeline.streams.capabilities.CAPABILITIES` too, generically: a
capability added there is forwarded by every wrapper without a change to it.
A wrapper has a capability when its parent has it, or when it adds it
(:attr:`ForwardingStream.adds`) (:func:`~quern.pipeline.streams.capabilities.has`). A
subclass overrides only what it changes (grain's ``_parent`` idea):
:class:`~quern.pipeline.streams.edited.EditedStream` its length, steps and
description.
"""

from __future__ import annotations

import abc
import dataclasses
import inspect
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from ..core.steps import StepRequest, StepResult
from ..order import Segments
from ..sources import Source
from .capabilities import CAPABILITIES, NEUTRAL, has, members, require
from .protocol import Explanation, Stream

if TYPE_CHECKING:
    from ..definition.dataset import Pipeline

__all__ = ["ForwardingStream"]


class ForwardingStream(Stream):
    """A stream that wraps :attr:`parent` and forwards to it every method it does not override.

    Not forwarded: :attr:`~Stream.epoch_length` (a wrapper that changes the steps has no
    regular epochs) and :meth:`~Stream.batched` (a wrapper is made after ``batch()``).
    """

    adds: ClassVar[tuple[type, ...]] = ()
    """The capabilities this wrapper has whatever its parent has; it has every other one when its
    parent does (overriding a capability's methods adapts the parent's, as ``where`` of edited
    steps does, and does not add it)."""

    @property
    @abc.abstractmethod
    def parent(self) -> Stream:
        """The stream this one wraps."""

    def parent_pipe(self, pipe: Pipeline) -> Pipeline:
        """``pipe`` (which holds this stream) with its stages kept, over :attr:`parent`.

        Args:
            pipe: the pipeline that holds this stream.

        Returns:
            The pipeline the parent's methods are given.
        """
        return dataclasses.replace(pipe, stream=self.parent)

    # ------------------------------------------------------------------ the core

    def length(self) -> int | None:
        """The parent's."""
        return self.parent.length()

    def leaves(self, pipe: Pipeline) -> tuple[Pipeline, ...]:
        """The parent's."""
        return self.parent.leaves(self.parent_pipe(pipe))

    def segments(self, positions: np.ndarray) -> Segments:
        """The parent's."""
        return self.parent.segments(positions)

    def describe(self, until_step: int | None = None) -> dict[str, Any]:
        """The parent's."""
        return self.parent.describe(until_step)

    def results(self, pipe: Pipeline, request: StepRequest) -> Iterator[StepResult]:
        """The parent's."""
        return self.parent.results(self.parent_pipe(pipe), request)

    def text(self) -> str:
        """The parent's."""
        return self.parent.text()

    # ------------------------------------------------------------------ the neutral defaults

    def leaf_names(self, pipe: Pipeline) -> tuple[str, ...]:
        """The parent's."""
        return self.parent.leaf_names(self.parent_pipe(pipe))

    def read_order(self) -> str | None:
        """The parent's."""
        return self.parent.read_order()

    def stages_before(self) -> list[str]:
        """The parent's."""
        return self.parent.stages_before()

    def size_text(self) -> str:
        """The parent's."""
        return self.parent.size_text()

    def wait_timeout(self) -> float | None:
        """The parent's."""
        return self.parent.wait_timeout()

    def refusal(self, stage: str) -> str | None:
        """The parent's."""
        return self.parent.refusal(stage)

    def check_hosts(self, process_count: int) -> None:
        """The parent's."""
        self.parent.check_hosts(process_count)

    def row_ids(self, positions: np.ndarray) -> np.ndarray:
        """The parent's."""
        return self.parent.row_ids(positions)

    def positions(self, pipe: Pipeline, step: int, process_index: int, process_count: int) -> np.ndarray:
        """The parent's."""
        return self.parent.positions(self.parent_pipe(pipe), step, process_index, process_count)

    def reads(self, positions: np.ndarray) -> list[tuple[Source, np.ndarray, np.ndarray]]:
        """The parent's."""
        return self.parent.reads(positions)

    def explain_rows(self, positions: np.ndarray, names: Sequence[str]) -> Explanation:
        """The parent's."""
        return self.parent.explain_rows(positions, names)

    def explain(self, pipe: Pipeline, step: int, process_index: int, process_count: int) -> Explanation:
        """The parent's."""
        return self.parent.explain(self.parent_pipe(pipe), step, process_index, process_count)

    def edits_before(self, step: int) -> list[str]:
        """The parent's."""
        return self.parent.edits_before(step)

    def change_steps(self) -> tuple[int, ...]:
        """The parent's."""
        return self.parent.change_steps()

    def locate(self, path: tuple) -> tuple[str, Pipeline, tuple] | None:
        """The parent's."""
        return self.parent.locate(path)

    def parts(self, description: dict[str, Any]) -> dict[str, str]:
        """The parent's."""
        return self.parent.parts(description)

    def stage_text(self) -> str:
        """The parent's."""
        return self.parent.stage_text()


def _forwarder(capability: type, name: str) -> Callable[..., Any]:
    """A method of ``ForwardingStream`` that calls method ``name`` of ``capability`` on the parent.

    A first argument named ``pipe`` is given as the parent's pipeline. A parent without
    the capability gives the capability's neutral answer where it has one
    (:data:`~quern.pipeline.streams.capabilities.NEUTRAL`), else the error of
    :func:`~quern.pipeline.streams.capabilities.require`.
    """
    params = list(inspect.signature(getattr(capability, name)).parameters)
    maps_pipe = len(params) > 1 and params[1] == "pipe"

    def forward(self: ForwardingStream, *args: Any, **kwargs: Any) -> Any:
        parent: object = self.parent
        if not has(parent, capability):
            parent = NEUTRAL[capability] if capability in NEUTRAL else require(self.parent, capability, name)
        if maps_pipe and args:
            args = (self.parent_pipe(args[0]), *args[1:])
        return getattr(parent, name)(*args, **kwargs)

    forward.__name__ = forward.__qualname__ = name
    forward.__doc__ = f"The parent's :meth:`~quern.pipeline.streams.capabilities.{capability.__name__}.{name}`."
    return forward


for _capability in CAPABILITIES:
    for _name in members(_capability):
        if _name not in vars(ForwardingStream):
            setattr(ForwardingStream, _name, _forwarder(_capability, _name))
