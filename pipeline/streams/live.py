"""A live stream: position ``p`` is entry ``p`` of a log that grows (:class:`LiveStream`).

Step ``s`` of a batch size ``B`` is the entries at positions ``[s*B, (s+1)*B)``
(host ``h`` of ``H``: its rows of them), so a step is a function of the log and
of nothing else; ``shuffle("steps", steps=W)`` permutes the positions within
each group of ``W`` whole steps, keyed by the seed and the group. The stream is
endless, and nothing that needs all its records (a global shuffle, a filter, a
length index, packing, buckets, mixing) applies. The source is a live source
(:class:`~quern.pipeline.sources.RedisStreamSource`): it reads positions, waits
for entries that do not exist yet and keeps the commits (:meth:`LiveStream.commit`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from ..core.batching import need_batch
from ..core.errors import StreamTimeoutError
from ..identity import samedef
from ..order import Segments
from ..order import index as _index
from ..sources import Source
from ..sources.live_commits import Run, StepMap
from .protocol import Explanation, contiguous_positions
from .segments import SegmentStream

if TYPE_CHECKING:
    from ..definition.dataset import Pipeline

__all__ = ["LiveStream"]

_ALLOWED = ("batch", "shuffle", "segments")


@dataclasses.dataclass(frozen=True)
class LiveStream(SegmentStream):
    """The entries of a live source in log order, or shuffled within groups of whole steps.

    Capabilities: live (waited for, committed), shuffled (``"steps"``), single-source,
    inverted (``where``). It has no config form.

    Attributes:
        source: the live source (its ``read_many`` takes stream positions).
        seed: a 64-bit seed (the shuffle's and the random transforms').
        shuffle_steps: ``W`` of ``shuffle("steps", steps=W)``, or ``None`` (log order).
    """

    source: Source
    seed: int = 0
    shuffle_steps: int | None = None

    def leaves(self, pipe: Pipeline) -> tuple[Pipeline, ...]:
        """``(pipe,)``: the pipeline reads its own source."""
        return (pipe,)

    def leaf_names(self, pipe: Pipeline) -> tuple[str, ...]:
        """The source's name."""
        return (self.source.name,)

    def length(self) -> None:
        """``None``: a live stream is endless."""
        return None

    def read_order(self) -> str | None:
        """``"steps"`` when shuffled within groups of steps."""
        return None if self.shuffle_steps is None else "steps"

    def size_text(self) -> str:
        """``live stream 'events'``."""
        return f"live stream {self.source.name!r}"

    def refusal(self, stage: str) -> str | None:
        """Only ``batch`` and ``shuffle("steps")`` may follow a live stream; the edits are refused too."""
        if stage in _ALLOWED:
            return None
        if stage in ("skip_steps", "exclude"):
            return (
                f"{stage}() does not apply to a live stream ({self.source!r}): its steps are the log's positions, "
                "which its commit record counts in entries; to leave steps out, start the iterator at a later "
                "step (pipe.iterator(start_step=...)) with the same batch size"
            )
        return (
            f"{stage}() does not apply to a live stream ({self.source!r}): it is endless and read in log order, "
            "so nothing that needs all its records applies (batch() and shuffle('steps', steps=W) do)"
        )

    def shuffled(self, mode: str, block_size: int | None, window: int, steps: int | None = None) -> LiveStream:
        """This stream permuted within groups of ``steps`` whole steps.

        Raises:
            ValueError: a mode other than ``"steps"``, or ``steps`` missing or below 1.
        """
        if mode != "steps":
            raise ValueError(
                f"a live stream cannot be shuffled with mode {mode!r} (its later entries do not exist yet): "
                "shuffle('steps', steps=W) permutes each group of W whole steps"
            )
        if steps is None:
            raise ValueError("shuffle('steps') needs steps=W, the steps of each group permuted together")
        return dataclasses.replace(self, shuffle_steps=_index.check_int(steps, "steps", 1))

    def record_ids(self, positions: np.ndarray) -> np.ndarray:
        """The record id of a position: the position itself (its entry)."""
        return np.asarray(positions, dtype=np.int64)

    def where(self, pipe: Pipeline, record: int, component: str | None, epochs: int) -> list[tuple[int, int]]:
        """The step and row of the entry at position ``record`` (its record id); one pass, whatever ``epochs``.

        Raises:
            ValueError: ``component`` given (a live stream is not a mixture).
        """
        if component is not None:
            raise ValueError(f"component={component!r}: the pipeline is not a mixture (it has no components)")
        b = need_batch(pipe, "where")
        k = record  # the natural position whose row holds the entry
        if self.shuffle_steps is not None:
            n = self.shuffle_steps * b
            g = record // n
            k = g * n + int(_index.epoch_positions(np.array([record % n]), n, self.seed, "global", epoch=g)[0])
        return [(k // b, k % b)]

    def segments(self, positions: np.ndarray) -> Segments:
        """Per position: leaf 0, the entry at that position and the position."""
        positions = np.asarray(positions, dtype=np.int64)
        return Segments(np.zeros(len(positions), dtype=np.int64), positions, positions)

    def positions(self, pipe: Pipeline, step: int, process_index: int, process_count: int) -> np.ndarray:
        """This host's rows of the step's positions ``[s*B, (s+1)*B)``, permuted within its group of steps."""
        rows = contiguous_positions(pipe, step, process_index, process_count, None)
        if self.shuffle_steps is None:
            return rows
        n = self.shuffle_steps * need_batch(pipe, "positions")  # positions of one group
        within = _index.epoch_record_ids(rows, n, self.seed, "global", 1, 1)  # group g's permutation of [0, n)
        return (rows // n) * n + within

    def explain_rows(self, positions: np.ndarray, names: Sequence[str]) -> Explanation:
        """Per position, ``(name, entry ID)``: the entry's ID in place of a record index (read from the log)."""
        label = names[0]
        ids = cast(Any, self.source).entry_ids(self.record_ids(positions))
        return [[(label, entry)] for entry in ids]

    def describe(self, until_step: int | None = None) -> dict[str, Any]:
        """The source's identity (its key and origin entry), the seed and the shuffle."""
        return {
            "live": samedef.IDENTITY if samedef.active() else self.source.identity(),
            "seed": self.seed,
            "shuffle_steps": self.shuffle_steps,
        }

    def text(self) -> str:
        """``Pipeline.from_source(...)`` and the shuffle."""
        out = f"Pipeline.from_source({self.source!r}, seed={self.seed})"
        if self.shuffle_steps is not None:
            out += f".shuffle('steps', steps={self.shuffle_steps})"
        return out

    # ------------------------------------------------------------------ what only a live stream does

    def wait_timeout(self) -> float | None:
        """The seconds a consumer waits for a step's entries (the source's ``timeout``)."""
        return float(cast(Any, self.source).timeout)

    def step_map(self, pipe: Pipeline) -> StepMap:
        """How ``pipe`` maps steps to positions: its batch size, window and the window's seed."""
        window = self.shuffle_steps or 0
        return StepMap(need_batch(pipe, "commit"), window, self.seed if window else 0)

    def start(self, pipe: Pipeline, step: int, process_index: int, process_count: int) -> Run:
        """Check a resume at ``step`` against the commit record; the iterator's run, which its commits carry (one per iterator).

        Raises:
            ValueError: the resume would lose or repeat entries.
        """
        return cast(Any, self.source).resuming(self.step_map(pipe), step, process_index, process_count)

    def commit(self, pipe: Pipeline, step: int, process_index: int, process_count: int, run: Run | None = None) -> None:
        """Record, beside the log, that this host trained every step before ``step`` (with ``run``'s step map)."""
        cast(Any, self.source).commit(step, process_index, process_count, run=run)

    def late(self, pipe: Pipeline, step: int, process_index: int, process_count: int, waited: float) -> Exception:
        """The error of a consumer that waited ``waited`` seconds for ``step`` in vain."""
        rows = self.positions(pipe, step, process_index, process_count)
        span = f"[{int(rows.min())}, {int(rows.max()) + 1})" if rows.size else "[]"
        return StreamTimeoutError(
            f"step {step} (host {process_index} of {process_count}): no batch within timeout={waited:g} s: the live "
            f"stream {self.source!r} does not hold the entries at positions {span} yet (the iterator goes on "
            "waiting if next() is called again)"
        )
