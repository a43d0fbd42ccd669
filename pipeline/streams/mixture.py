"""A mixture stream: positions assigned to named component pipelines by weight (:func:`quern.mix`).

Position ``p`` goes to a component by exact counts per block of positions and a
keyed permutation inside each block (:mod:`quern.pipeline.order.components`); the
``k``-th position drawn from a component is position ``k`` of that component's
own stream, so each component has its own epochs. Every output depends only on
the components' definitions, the schedule of weights, the seed, the block size
and the batch size (a schedule's stages start at steps).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import numpy as np

from ..core.batching import need_batch
from ..identity.fingerprint import fingerprint_of
from ..order import Segments
from ..order import components as _mixture
from ..order import index as _index
from ..sources import Source
from .capabilities import Component, Editable, NeutralReports, RecordPositions, report, require
from .config_form import batch_config, stages_config, weights_config
from .protocol import Explanation
from .segments import SegmentStream

if TYPE_CHECKING:
    from ..definition.dataset import Pipeline

__all__ = ["MixtureStream"]

_REFUSALS = {
    "shuffle": "shuffle() on a mixture: shuffle each component instead (each has its own order and epochs)",
    "filter": "filter() on a mixture: filter its components instead (each keeps its own survivors)",
    "length_index": "length_index() of a mixture: take each component's length_index()",
    "pack": "pack() on a mixture: pack its components, then mix them",
    "bucket": "bucket() needs a single-source pipeline (not a mixture or a packed pipeline)",
    "balance_hosts": "balance_hosts() on a mixture or a packed pipeline is not supported: its rows come from "
    "several records (packed rows hold seq_len tokens each already)",
    "mix": "is itself a mixture; mix its components in one mixture",
}


@dataclasses.dataclass(frozen=True)
class MixtureStream(NeutralReports, SegmentStream):
    """Named component pipelines (without batch), mixed by a schedule of weights.

    Capabilities: inverted (``where``, in a component whose stream has record positions),
    edited (``exclude`` in an editable component), reportable (draws per component),
    written as a config.

    Attributes:
        names: the components' keys, in order.
        components: the component pipelines (endless, without batch).
        stages: the schedule: ``(start_step, quantized weights)`` stages.
        seed: the seed of the assignment (and of the mixture's own random transforms).
        block: positions per block of exact counts (:func:`~quern.pipeline.order.components.block_size`).
        batch_size: the batch size of the pipeline that holds it (a schedule's stages start at steps).
        stop: with finite components, where the mixture ends: ``"first"``, at the first component's end;
            ``"last"``, when every component has ended, each ended one's weight going to the others (``None``:
            the components are endless).
    """

    names: tuple[str, ...]
    components: tuple[Pipeline, ...]
    stages: tuple[_mixture.Stage, ...]
    seed: int
    block: int
    batch_size: int | None = None
    stop: Literal["first", "last"] | None = None

    describes_past: ClassVar[bool] = True

    def leaves(self, pipe: Pipeline) -> tuple[Pipeline, ...]:
        """The components."""
        return self.components

    def leaf_names(self, pipe: Pipeline) -> tuple[str, ...]:
        """The components' keys."""
        return self.names

    def length(self) -> int | None:
        """Positions over all, ``None`` when endless (see :attr:`stop`)."""
        return self.plan()[2]

    def plan(self) -> tuple[tuple[_mixture.Stage, ...], int, int | None]:
        """``(stages, rows_per_step, length)`` the assignment runs on (found once per batch size).

        Endless components: the schedule as it is and no length. ``stop="first"``: the same
        schedule, ending at the first position a component has no record for
        (:func:`~quern.pipeline.order.components.drawn_at` of its length). ``stop="last"``: the
        schedule in positions, with a stage starting where each component ends, in which its
        weight is zero (the others' renormalised), ending where none with a weight is left.
        Each depends only on the schedule, the seed, the block, the batch size and the
        components' lengths.
        """
        cached = self.__dict__.get("_plan")
        if cached is not None and cached[0] == self.batch_size:
            return cached[1]
        rows = self.batch_size or 1
        if self.stop is None:
            got: tuple[tuple[_mixture.Stage, ...], int, int | None] = (self.stages, rows, None)
        else:
            lengths = [c.stream.length() for c in self.components]
            if self.stop == "first":
                ends = [self._end(c, n, self.stages, rows) for c, n in enumerate(lengths) if n is not None]
                reached = [p for p in ends if p >= 0]  # a component never drawn to its end never ends it
                got = (self.stages, rows, min(reached) if reached else None)
            else:
                got = self._until_last(lengths, rows)
        self.__dict__["_plan"] = (self.batch_size, got)
        return got

    def _end(self, c: int, n: int, stages: tuple[_mixture.Stage, ...], rows: int) -> int:
        """The position of component ``c``'s draw ``n`` (one past its last record), ``-1`` if never drawn."""
        return int(_mixture.drawn_at(c, np.asarray([n]), stages, self.seed, rows, self.block)[0])

    def _until_last(self, lengths: list[int | None], rows: int) -> tuple[tuple[_mixture.Stage, ...], int, int]:
        """``stop="last"``: the schedule in positions with a stage at each component's end."""
        stages = [_mixture.Stage(st.start_step * rows, st.weights) for st in self.stages]
        alive = {c for c, n in enumerate(lengths) if n is not None}
        while True:
            ends = {c: self._end(c, lengths[c], tuple(stages), 1) for c in alive}  # type: ignore[arg-type]
            ends = {c: p for c, p in ends.items() if p >= 0}
            if not ends:  # the components left are never drawn to their end: the mixture would not end
                left = sorted(self.names[c] for c in alive)
                raise ValueError(f"mix(stop='last'): components {left} are never drawn to their end")
            c, at = min(ends.items(), key=lambda kv: kv[1])
            alive.discard(c)
            active = [st for st in stages if st.start_step <= at][-1]
            later = [st for st in stages if st.start_step > at]
            rest = [_mixture.Stage(at, active.weights)] + later
            zeroed = []
            for st in rest:
                kept = [w if i != c else 0 for i, w in enumerate(st.weights)]
                if not sum(kept):
                    break  # nothing left to draw from here on
                zeroed.append(_mixture.Stage(st.start_step, _mixture.quantize([w / _mixture.QUANTUM for w in kept])))
            stages = [st for st in stages if st.start_step < at] + zeroed
            if not zeroed or not any(stages[-1].weights):
                return tuple(stages), 1, at

    def refusal(self, stage: str) -> str | None:
        """A mixture may be mapped and batched; shuffles, filters and packing belong to its components."""
        return _REFUSALS.get(stage)

    def batched(self, batch_size: int) -> MixtureStream:
        """This mixture under ``batch_size`` rows per step."""
        return dataclasses.replace(self, batch_size=batch_size)

    def assign(self, positions: np.ndarray) -> _mixture.Assignment:
        """The component of each position and the position in that component's stream.

        Raises:
            ValueError: a schedule of several stages before ``batch()`` (its stages start at steps).
        """
        if self.batch_size is None and len(self.stages) > 1:
            raise ValueError("a schedule's stages start at steps: call batch() before segments()")
        stages, rows, _ = self.plan()
        return _mixture.assign(positions, stages, self.seed, rows, self.block)

    def segments(self, positions: np.ndarray) -> Segments:
        """Per position.

        Its component, the record id in the component's source (``-1`` for a row that is not one record, a packed
        component's) and the position in the component's stream.
        """
        positions = np.asarray(positions, dtype=np.int64)
        comp, cpos = self.assign(positions)
        ids = np.empty(len(positions), dtype=np.int64)
        for c in np.unique(comp).tolist():
            sel = comp == c
            ids[sel] = self.components[c].stream.row_ids(cpos[sel])
        return Segments(comp, ids, cpos)

    def row_ids(self, positions: np.ndarray) -> np.ndarray:
        """The segments' record ids."""
        return self.segments(positions).ids

    def reads(self, positions: np.ndarray) -> list[tuple[Source, np.ndarray, np.ndarray]]:
        """Each component's reads at its rows' positions, their rows mapped back to these positions."""
        seg = self.segments(positions)
        out = []
        for c, part in enumerate(self.components):
            rows = np.flatnonzero(seg.component == c)
            if rows.size:
                out += [(src, ids, rows[at]) for src, ids, at in part.stream.reads(seg.positions[rows])]
        return out

    def explain_rows(self, positions: np.ndarray, names: Sequence[str]) -> Explanation:
        """Per position, the records of its component's row, named by the component's key (``names`` are the keys)."""
        seg = self.segments(positions)
        out: list[list[tuple[str, int | str]]] = [[] for _ in range(len(seg.ids))]
        for c, part in enumerate(self.components):
            rows = np.flatnonzero(seg.component == c)
            if rows.size:
                for r, got in zip(rows.tolist(), part.stream.explain_rows(seg.positions[rows], (self.names[c],))):
                    out[r] = got
        return out

    def where(self, pipe: Pipeline, record: int, component: str | None, epochs: int) -> list[tuple[int, int]]:
        """The ``(step, row)`` pairs whose rows hold record ``record`` of component ``component``.

        The record's positions in the first ``epochs`` epochs of the component's own stream
        (its :meth:`~quern.pipeline.streams.capabilities.RecordPositions.record_positions`: a packed component's
        rows holding a piece of it), each mapped to the mixture position that draws it
        (:func:`~quern.pipeline.order.components.drawn_at`); a position the mixture never draws
        (the component's weight is zero from some stage on) is left out. The work is one
        block's layout per position found, and no record is read.

        Args:
            pipe: the batched pipeline that holds this mixture.
            record: a record id of the component's source (checked by the caller).
            component: the component's key.
            epochs: epochs of the component's stream to look in, at least 1.

        Returns:
            The pairs in increasing order; ``row`` indexes the global batch.

        Raises:
            ValueError: no ``component``, or one that is not a component (the message lists them).
            TypeError: the component's stream cannot say where a record appears.
        """
        if component is None or component not in self.names:
            given = "needs component=NAME" if component is None else f"has no component {component!r}"
            raise ValueError(f"where(): a mixture {given}; its components are {list(self.names)}")
        b = need_batch(pipe, "where")
        c = self.names.index(component)
        own = require(self.components[c].stream, RecordPositions, "where").record_positions(record, epochs)
        stages, rows, end = self.plan()
        pos = _mixture.drawn_at(c, own, stages, self.seed, rows, self.block)
        pos = np.sort(pos[(pos >= 0) & (pos < (end if end is not None else _index.MAX_RECORDS))])
        return [(p // b, p % b) for p in pos.tolist()]

    def excluded(self, pipe: Pipeline, ids: np.ndarray, position: int, component: str | None) -> MixtureStream:
        """This mixture with component ``component`` skipping the records ``ids`` from mixture position ``position`` on.

        The component's own stream excludes them from its position at ``position`` (its draws
        before it); the assignment of positions to components does not change, so the other
        components' rows stay where they were.

        Raises:
            ValueError: no ``component``, or not one of the components (the message lists them);
                the component's stream cannot exclude records.
        """
        if component is None or component not in self.names:
            given = "needs component=NAME" if component is None else f"has no component {component!r}"
            raise ValueError(f"exclude(): a mixture {given}; its components are {list(self.names)}")
        c = self.names.index(component)
        stages, rows, _ = self.plan()
        drawn = _mixture.draws_before(stages, self.seed, rows, self.block, position)[c]
        comp = self.components[c]
        edited = dataclasses.replace(
            comp, stream=require(comp.stream, Editable, "exclude").excluded(comp, ids, drawn, None)
        )
        return dataclasses.replace(self, components=self.components[:c] + (edited,) + self.components[c + 1 :])

    def change_steps(self) -> tuple[int, ...]:
        """The schedule's stage starts after step 0: the past's description changes there."""
        return tuple(st.start_step for st in self.stages if st.start_step > 0)

    def row_noun(self) -> str:
        """``rows`` when a component's rows hold several records (packed), else ``records``."""
        return "rows" if any(report(c.stream).row_noun() == "rows" for c in self.components) else "records"

    def draws(self, pipe: Pipeline, first: int, end: int) -> np.ndarray:
        """Rows per component at the positions ``[first, end)``.

        No record is read, and the cost does not grow with the range.
        """
        stages, rows, _ = dataclasses.replace(self, batch_size=pipe.batch_size).plan()

        def before(position: int) -> np.ndarray:
            counts = _mixture.draws_before(stages, self.seed, rows, self.block, position)
            return np.asarray(counts, dtype=np.int64)

        return before(end) - before(first)

    def describe(self, until_step: int | None = None) -> dict[str, Any]:
        """``{"mixture": ...}``: with ``until_step``, what the steps before it depend on.

        Only the stages that start before ``until_step`` (at least the first), and only
        the components with a weight above zero in one of them, in their order. A
        component zero in all those stages takes no slot of their blocks, and its index
        moves no other component's slots or quantized weight, so the steps before
        ``until_step`` are the same with or without it, as long as the block size is
        the same (it is in the description).
        """
        stages, live = self.stages, list(range(len(self.names)))
        if until_step is not None:
            stages = tuple(st for st in stages if st.start_step < max(1, until_step))
            live = [c for c in live if any(st.weights[c] for st in stages)]
        return {
            "mixture": {
                "names": [self.names[c] for c in live],
                "components": [self.components[c].describe() for c in live],
                "schedule": [[st.start_step, [st.weights[c] for c in live]] for st in stages],
                "seed": self.seed,
                "block": self.block,
                **({} if self.stop is None else {"stop": self.stop}),
            }
        }

    def locate(self, path: tuple) -> tuple[str, Pipeline, tuple] | None:
        """``("mixture", "components", i, ...)`` leads into component ``i``."""
        if len(path) >= 3 and path[0] == "mixture" and path[1] == "components":
            i = path[2]
            return f"component {self.names[i]!r}:", self.components[i], path[3:]
        return None

    def parts(self, description: dict[str, Any]) -> dict[str, str]:
        """One digest per component, per part of the mixture's definition, and per other key."""
        out: dict[str, str] = {}
        for key, value in description.items():
            if key == "mixture":
                for name, comp in zip(value["names"], value["components"]):
                    out[f"component {name!r}"] = fingerprint_of(comp)
                for sub in ("names", "schedule", "seed", "block", "stop"):
                    if sub in value:
                        out[f"mixture {sub}"] = fingerprint_of(value[sub])
            else:
                out[key] = fingerprint_of(value)
        return out

    def to_config(self, pipe: Pipeline) -> dict[str, Any]:
        """A ``mix:`` section (components as a list, seed, block, weights or schedule), ``transforms``, ``batch``."""
        mix: dict[str, Any] = {
            "seed": self.seed,
            "block": self.block,
            "components": [  # a list: the order is the mixture's, whatever a YAML dumper does to keys
                {
                    "name": name,
                    **require(c.stream, Component, f"mix.components.{name}").component_config(
                        c, f"mix.components.{name}."
                    ),
                }
                for name, c in zip(self.names, self.components)
            ],
        }
        if self.stop is not None:
            mix["stop"] = self.stop
        if len(self.stages) == 1:
            mix["weights"] = weights_config(self.names, self.stages[0].weights)
        else:
            mix["schedule"] = [
                {"start_step": st.start_step, "weights": weights_config(self.names, st.weights)} for st in self.stages
            ]
        return {"mix": mix, "transforms": stages_config(pipe.record_ops, "transforms"), **batch_config(pipe)}

    def text(self) -> str:
        """``quern.mix({...}, schedule=[...])``."""
        stop = "" if self.stop is None else f", stop={self.stop!r}"
        return (
            f"quern.mix({dict(zip(self.names, self.components))!r}, schedule={[tuple(st) for st in self.stages]}{stop})"
        )
