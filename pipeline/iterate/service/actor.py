"""What one service actor runs: it loads the pipeline once, then computes (step, host slice) units.

An actor holds no state that changes a batch: a unit's batches are
``pipe.batch_at(step, process_index, process_count)`` for each of its steps,
whichever actor, node or attempt computes them. The actor class is plain
Python; :mod:`quern.pipeline.iterate.service.ray_service` makes it a Ray actor.
"""

from __future__ import annotations

import os
import pickle
import time
import traceback
from typing import Any, NamedTuple

from ... import execute
from ...core.version import __version__
from ...identity.fingerprint import fingerprint_of
from ...integrity.ledger import step_fields
from ...order import index as _index
from ..workers.messages import ErrorReport

__all__ = ["Expect", "Hello", "UnitActor", "UnitResult", "expect_of"]


class Expect(NamedTuple):
    """What an actor must agree on with the trainer before it computes a unit."""

    quern: str
    """The quern version (``quern.__version__``)."""
    index_format: int
    """The index-format version (``quern.index.INDEX_FORMAT_VERSION``)."""
    fingerprint: str | None
    """The pipeline's fingerprint (``None``: the pipeline cannot be described, not checked)."""


class Hello(NamedTuple):
    """An actor's answer once it has loaded the pipeline."""

    pid: int
    node: str
    problem: str | None
    """Why it cannot serve (the pipeline does not load, or a version differs), or ``None``."""


class UnitResult(NamedTuple):
    """The batches of one unit (consecutive steps of one host slice), as an actor sends them back."""

    batches: list[Any]
    """One batch per step (``None`` where the step failed)."""
    errors: list[ErrorReport | None]
    """Per step, what stopped it (``None``: it succeeded)."""
    fields: list[str]
    """Per step, its ledger fields (``""`` without a ledger)."""
    timings: dict[str, float]
    """Seconds per stage over the unit (empty when not timed)."""
    seconds: float
    """Wall seconds the actor spent on the unit."""
    pid: int
    """The actor's process."""


def expect_of(pipe: Any) -> Expect:
    """What every actor of ``pipe`` must agree on: this process's versions and the pipeline's fingerprint.

    Args:
        pipe: the pipeline.

    Returns:
        The versions and the fingerprint (``None`` when the pipeline cannot be described).
    """
    try:
        fingerprint: str | None = pipe.fingerprint()
    except Exception:  # a pipeline with an undeclared callable: nothing to compare
        fingerprint = None
    return Expect(__version__, _index.INDEX_FORMAT_VERSION, fingerprint)


def _node() -> str:
    try:
        import ray

        return str(ray.get_runtime_context().get_node_id())
    except Exception:
        return "?"


class UnitActor:
    """Loads a pipeline once (from its pickled bytes) and computes units of its steps.

    Args:
        blob: the pipeline, pickled with cloudpickle.
        expect: what the trainer has; an actor that differs says why in :meth:`hello`
            and computes nothing.
    """

    def __init__(self, blob: bytes, expect: Expect) -> None:
        self.pid = os.getpid()
        self.problem: str | None = None
        self.pipe: Any = None
        try:
            self.pipe = pickle.loads(blob)
        except Exception as e:
            self.problem = f"the pipeline cannot be loaded in the actor: {type(e).__name__}: {e}"
            return
        fingerprint: str | None = None
        if expect.fingerprint is not None:  # computed afresh here (not the copy the trainer's pickle holds)
            try:
                fingerprint = fingerprint_of(self.pipe.describe_until(None))
            except Exception as e:
                fingerprint = f"none ({type(e).__name__}: {e})"
        mine = Expect(__version__, _index.INDEX_FORMAT_VERSION, fingerprint)
        differ = [
            f"{name} {got!r} in the actor, {want!r} in the trainer"
            for name, got, want in zip(Expect._fields, mine, expect)
            if got != want
        ]
        if differ:
            self.problem = "; ".join(differ)

    def hello(self) -> Hello:
        """The actor's process, node and problem (``None``: it can serve)."""
        return Hello(self.pid, _node(), self.problem)

    def compute(
        self, steps: list[int], process_index: int, process_count: int, digests: bool, timed: bool
    ) -> UnitResult:
        """The batches of ``steps`` for one host slice (each ``pipe.batch_at(step, ...)``).

        Args:
            steps: consecutive steps.
            process_index: the host.
            process_count: the hosts.
            digests: also compute each batch's ledger fields.
            timed: measure the seconds per stage.

        Returns:
            The unit's batches, errors, ledger fields and figures; a failing step does not stop the others.
        """
        if self.problem is not None:
            raise RuntimeError(self.problem)
        t0 = time.perf_counter()
        timings: dict[str, float] | None = {} if timed else None
        batches: list[Any] = []
        errors: list[ErrorReport | None] = []
        fields: list[str] = []
        for step, batch, error in execute.step_results(self.pipe, steps, process_index, process_count, timings=timings):
            text = ""
            if error is None and digests:
                try:
                    text = step_fields(self.pipe, batch, step, process_index, process_count)
                except Exception as e:
                    error = e
            batches.append(None if error is not None else batch)
            errors.append(None if error is None else _report(error))
            fields.append(text)
        return UnitResult(batches, errors, fields, timings or {}, time.perf_counter() - t0, self.pid)

    def pid_of(self) -> int:
        """This actor's process id."""
        return self.pid


def _report(error: BaseException) -> ErrorReport:
    """(message, traceback text, pickled original exception or None) of a failed step."""
    tb = "".join(traceback.format_exception(error))
    try:
        cause = pickle.dumps(error.__cause__ or error)
    except Exception:
        cause = None
    return ErrorReport(str(error), tb, cause)
