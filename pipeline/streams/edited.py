"""Edits that keep the past: :meth:`Pipeline.skip_steps` and :meth:`Pipeline.exclude`.

An :class:`EditedStream` holds the stream as it was before any edit (the
*original*, which the description and the config are made of), the edits in the
order they were made, and the *inner* stream, the original with the exclusions
applied (an :class:`~quern.pipeline.streams.excluded.ExcludedStream`, a mixture
whose component excludes records, a packed stream that pads them). Training step
``t`` is step ``M(t)`` of the inner stream, ``M`` being the skips composed:
``skip_steps(start, stop)`` maps the steps from ``start`` on to ``stop``, ``stop
+ 1``, ... An edit's steps are those of the pipeline it was made on, so edits
compose in order, and ``M(t) = t`` before the first edit: the steps before an
edit are the steps of the pipeline without it, byte for byte. Every output
depends only on the original stream, the edits and the batch size.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple

import numpy as np

from ..core.steps import StepRequest, StepResult
from ..identity.fingerprint import fingerprint_of
from ..identity.hashing import digest
from ..sources import Source
from .capabilities import BucketOfStep, Configurable, Editable, Invertible, report, require
from .forwarding import ForwardingStream
from .protocol import Explanation, Stream

if TYPE_CHECKING:
    from ..definition.dataset import Pipeline

__all__ = ["Edit", "EditedStream", "SKIP", "EXCLUDE"]

SKIP = "skip_steps"
EXCLUDE = "exclude"


class Edit(NamedTuple):
    """One edit, in the steps of the pipeline it was made on.

    Attributes:
        kind: :data:`SKIP` or :data:`EXCLUDE`.
        start: the first step it changes (``skip_steps``' ``start``, ``exclude``'s ``from_step``).
        stop: ``skip_steps``' ``stop`` (``None`` for ``exclude``).
        ids: ``exclude``'s sorted, distinct record ids (``None`` for ``skip_steps``).
        component: ``exclude``'s mixture component (``None``: not a mixture).
    """

    kind: str
    start: int
    stop: int | None = None
    ids: np.ndarray | None = None
    component: str | None = None

    def describe(self) -> list[Any]:
        """What the fingerprint sees of it."""
        if self.kind == SKIP:
            return [SKIP, self.start, self.stop]
        assert self.ids is not None
        return [EXCLUDE, self.start, self.component, len(self.ids), digest(self.ids)]

    def text(self) -> str:
        """The call that makes it (``.skip_steps(3, 5)``), the records counted."""
        if self.kind == SKIP:
            return f".skip_steps({self.start}, {self.stop})"
        assert self.ids is not None
        comp = "" if self.component is None else f", component={self.component!r}"
        shown = self.ids.tolist() if len(self.ids) <= 8 else f"<{len(self.ids)} records>"
        return f".exclude({shown}, from_step={self.start}{comp})"

    def config(self) -> dict[str, Any]:
        """Its entry in the config's ``skip:`` or ``exclude:`` section."""
        if self.kind == SKIP:
            return {"start": self.start, "stop": self.stop}
        assert self.ids is not None
        out: dict[str, Any] = {"from_step": self.start, "ids": self.ids.tolist()}
        if self.component is not None:
            out["component"] = self.component
        return out


def _forward(skips: Sequence[tuple[int, int]], step: int) -> int:
    """``M(step)``: the inner step a training step runs (the last skip applies first)."""
    for start, stop in reversed(skips):
        if step >= start:
            step += stop - start
    return step


def _backward(skips: Sequence[tuple[int, int]], step: int, ceil: bool = False) -> int | None:
    """The training step that runs inner step ``step`` (``None``: skipped; ``ceil``: the first one at or after it)."""
    s: int | None = step
    for start, stop in skips:
        assert s is not None
        if start <= s < stop:
            if not ceil:
                return None
            s = start
        elif s >= stop:
            s -= stop - start
    return s


@dataclasses.dataclass(frozen=True)
class EditedStream(ForwardingStream):
    """A stream with edits that keep the past: the original stream, the edits, and the edited inner stream.

    A wrapper of :attr:`inner` (its :attr:`parent`): it forwards to it every answer about
    positions and every capability, and overrides only what the edits change (its length,
    the steps it runs, ``where``, the reports by step) and what is the original's (its
    description, config and text).

    Attributes:
        original: the stream before any edit.
        edits: the edits, in the order they were made.
        inner: ``original`` with the exclusions applied (its steps are the skips' targets).
        batch_size: the pipeline's batch size.
    """

    original: Stream
    edits: tuple[Edit, ...] = dataclasses.field(compare=False)
    inner: Stream = dataclasses.field(compare=False, repr=False)
    batch_size: int = 1
    edits_key: tuple[Any, ...] = dataclasses.field(default=(), repr=False)
    seed: int = dataclasses.field(init=False)
    num_epochs: int | None = dataclasses.field(init=False)
    source: Source | None = dataclasses.field(init=False, compare=False, repr=False)
    survivors: np.ndarray | None = dataclasses.field(init=False, compare=False, repr=False)

    describes_past: ClassVar[bool] = True

    def __post_init__(self) -> None:
        for name in ("seed", "num_epochs", "source", "survivors"):
            object.__setattr__(self, name, getattr(self.inner, name))
        object.__setattr__(self, "edits_key", tuple(repr(e.describe()) for e in self.edits))

    # ------------------------------------------------------------------ making edits

    @classmethod
    def of(cls, stream: Stream, batch_size: int) -> EditedStream:
        """``stream`` as an edited stream (itself if it is one; else with no edit yet)."""
        if isinstance(stream, EditedStream):
            return stream
        return cls(original=stream, edits=(), inner=stream, batch_size=batch_size)

    @property
    def skips(self) -> list[tuple[int, int]]:
        """The skips' ``(start, stop)``, in the order they were made."""
        return [(e.start, e.stop) for e in self.edits if e.kind == SKIP and e.stop is not None]

    def inner_step(self, step: int) -> int:
        """The step of :attr:`inner` that training step ``step`` runs."""
        return _forward(self.skips, step)

    def training_step(self, step: int) -> int | None:
        """The training step that runs step ``step`` of :attr:`inner` (``None``: a skipped step)."""
        return _backward(self.skips, step)

    def with_skip(self, start: int, stop: int) -> EditedStream:
        """This stream with training steps from ``start`` on given the data of steps ``stop``, ``stop + 1``, ..."""
        return dataclasses.replace(self, edits=self.edits + (Edit(SKIP, start, stop),))

    def with_exclude(self, pipe: Pipeline, ids: np.ndarray, from_step: int, component: str | None) -> EditedStream:
        """This stream with records ``ids`` (of ``component``) never used from training step ``from_step`` on.

        Raises:
            ValueError: the inner stream cannot exclude records, or a bad component.
        """
        position = self.inner_step(from_step) * self.batch_size
        inner = require(self.inner, Editable, "exclude").excluded(self._inner(pipe), ids, position, component)
        return dataclasses.replace(
            self, edits=self.edits + (Edit(EXCLUDE, from_step, None, ids, component),), inner=inner
        )

    @property
    def parent(self) -> Stream:
        """:attr:`inner`: the stream the edited stream forwards to."""
        return self.inner

    def _inner(self, pipe: Pipeline) -> Pipeline:
        return self.parent_pipe(pipe)

    def _original(self, pipe: Pipeline) -> Pipeline:
        return dataclasses.replace(pipe, stream=self.original)

    # ------------------------------------------------------------------ what it is

    def length(self) -> int | None:
        """The inner stream's positions less the skipped steps' (``None``: endless)."""
        total = self.inner.length()
        if total is None:
            return None
        b = self.batch_size
        steps = -(-total // b)  # the inner stream's steps, the last one perhaps partial
        trained = _backward(self.skips, steps, ceil=True)  # the training steps that run one of them
        assert trained is not None
        last = _backward(self.skips, steps - 1)  # the training step of the inner stream's last step
        if total % b and last is not None:  # that partial step is trained: its rows count
            return (trained - 1) * b + total % b
        return trained * b

    def size_text(self) -> str:
        """The inner stream's, with the edits."""
        return f"{self.inner.size_text()}, edited by {''.join(e.text() for e in self.edits).lstrip('.')}"

    def refusal(self, stage: str) -> str | None:
        """Only more edits may follow (and batch stages, which the pipeline checks itself)."""
        if stage in (SKIP, EXCLUDE):
            return None
        if stage == "batch":  # refused by the pipeline itself (a second batch()); as the original says for repr
            return self.original.refusal(stage)
        return f"{stage}() after skip_steps() or exclude(): put it before the edits"

    # ------------------------------------------------------------------ the plan: positions are the inner stream's

    def positions(self, pipe: Pipeline, step: int, process_index: int, process_count: int) -> np.ndarray:
        """The inner stream's positions of the step training step ``step`` runs."""
        return self.inner.positions(self._inner(pipe), self.inner_step(step), process_index, process_count)

    def explain(self, pipe: Pipeline, step: int, process_index: int, process_count: int) -> Explanation:
        """The inner stream's explanation of the step training step ``step`` runs."""
        return self.inner.explain(self._inner(pipe), self.inner_step(step), process_index, process_count)

    def results(self, pipe: Pipeline, request: StepRequest) -> Iterator[StepResult]:
        """The inner stream's results of the steps the training steps run, under the training steps' numbers."""
        inner = [self.inner_step(s) for s in request.steps]
        results = self.inner.results(self._inner(pipe), request.of(inner))
        for step, run, result in zip(request.steps, inner, results):
            if result.error is not None and run != step:
                result.error.add_note(f"training step {step} runs the data of step {run} (skip_steps)")
            yield StepResult(step, result.batch, result.error)

    # ------------------------------------------------------------------ lineage

    def where(self, pipe: Pipeline, record: int, component: str | None, epochs: int) -> list[tuple[int, int]]:
        """The inner stream's ``(step, row)`` pairs under the training steps that run them (skipped ones dropped)."""
        out = []
        for step, row in require(self.inner, Invertible, "where").where(self._inner(pipe), record, component, epochs):
            t = self.training_step(step)
            if t is not None:
                out.append((t, row))
        return out

    def excluded(self, pipe: Pipeline, ids: np.ndarray, position: int, component: str | None) -> Stream:
        """Refused: the edited pipeline's :meth:`with_exclude` makes exclusions, by training step.

        Overridden so that the parent's ``excluded`` is not forwarded: its positions are the
        original stream's, not this stream's training positions.

        Raises:
            ValueError: always.
        """
        raise ValueError("exclude() of an edited stream goes through its pipeline's exclude()")

    # ------------------------------------------------------------------ identity

    def _edit_starts(self) -> list[int]:
        """Each edit's first changed step, in the training steps of this pipeline (the later skips inverted)."""
        out = []
        for i, e in enumerate(self.edits):
            later = [(x.start, x.stop) for x in self.edits[i + 1 :] if x.kind == SKIP and x.stop is not None]
            step = _backward(later, e.start, ceil=True)
            assert step is not None
            out.append(step)
        return out

    def describe(self, until_step: int | None = None) -> dict[str, Any]:
        """The original stream's description of the steps the training steps before ``until_step`` run, and the edits.

        The edits that start at or after ``until_step`` are left out, so that the steps before
        an edit are described as the pipeline without it describes them.
        """
        if until_step is None:
            out = self.original.describe(None)
            live = list(self.edits)
        else:
            out = self.original.describe(self.inner_step(until_step - 1) + 1 if until_step > 0 else until_step)
            live = [e for e, at in zip(self.edits, self._edit_starts()) if at < until_step]
        if live:
            out["edits"] = [e.describe() for e in live]
        return out

    def edits_before(self, step: int) -> list[str]:
        """``skip_steps(3, 5) changes step 3 and later``, for each edit that starts before ``step``."""
        return [
            f"{e.text().lstrip('.')} changes step {at} and later"
            for e, at in zip(self.edits, self._edit_starts())
            if at < step
        ]

    def change_steps(self) -> tuple[int, ...]:
        """The edits' first steps and the original stream's change steps, in training steps."""
        skips = self.skips
        mapped = [_backward(skips, s, ceil=True) for s in self.original.change_steps()]
        return tuple(sorted({s for s in mapped if s is not None} | set(self._edit_starts())))

    def parts(self, description: dict[str, Any]) -> dict[str, str]:
        """The original stream's parts and one per edit, named by the call and the steps it changes."""
        rest = dict(description)
        edits = rest.pop("edits", [])
        out = self.original.parts(rest)
        named = [(e.describe(), e, at) for e, at in zip(self.edits, self._edit_starts())]
        for d in edits:  # the edits this description holds (those before its cut), by what they are
            i = next((k for k, (known, _, _) in enumerate(named) if known == d), None)
            label = (
                "edit"
                if i is None
                else f"edit {named[i][1].text().lstrip('.')}, which changes the steps from {named.pop(i)[2]} on"
            )
            out[label] = fingerprint_of(d)
        return out

    def locate(self, path: tuple) -> tuple[str, Pipeline, tuple] | None:
        """The original stream's."""
        return self.original.locate(path)

    # ------------------------------------------------------------------ figures for reports

    def draws(self, pipe: Pipeline, first: int, end: int) -> np.ndarray | None:
        """Rows per leaf at the training positions ``[first, end)``: the inner stream's, range by range."""
        b = self.batch_size
        cuts = sorted({first, end} | {s * b for s in self._edit_starts() if first < s * b < end})
        total: np.ndarray | None = None
        for lo, hi in zip(cuts, cuts[1:]):
            at = self.inner_step(lo // b) * b + lo % b
            got = report(self.inner).draws(self._inner(pipe), at, at + hi - lo)
            if got is None:
                return None
            total = got if total is None else total + got
        return total if total is not None else report(self.inner).draws(self._inner(pipe), first, first)

    def bucket_of(self, step: int, process_index: int, process_count: int) -> BucketOfStep | None:
        """The inner stream's bucket of the step training step ``step`` runs."""
        return report(self.inner).bucket_of(self.inner_step(step), process_index, process_count)

    # ------------------------------------------------------------------ config and text

    def to_config(self, pipe: Pipeline) -> dict[str, Any]:
        """The original pipeline's config with ``skip:`` and ``exclude:`` sections.

        A config applies its edits in the order of their first steps (a skip before an
        exclusion at the same step); edits made in another order have no config form.

        Raises:
            ValueError: the edits were not made in that order, or the original has no config form.
        """
        order = sorted(range(len(self.edits)), key=lambda i: (self.edits[i].start, self.edits[i].kind != SKIP))
        if order != list(range(len(self.edits))):
            raise ValueError(
                "the edits were not made in step order (a config applies skip: and exclude: in the order of "
                f"their first steps): {''.join(e.text() for e in self.edits).lstrip('.')} has no config form"
            )
        out = require(self.original, Configurable, "to_config").to_config(self._original(pipe))
        skips = [e.config() for e in self.edits if e.kind == SKIP]
        excludes = [e.config() for e in self.edits if e.kind == EXCLUDE]
        if skips:
            out["skip"] = skips
        if excludes:
            out["exclude"] = excludes
        return out

    def text(self) -> str:
        """The original stream's text."""
        return self.original.text()

    def stage_text(self) -> str:
        """The original stream's, then the edits."""
        return self.original.stage_text() + "".join(e.text() for e in self.edits)
