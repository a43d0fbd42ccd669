"""A ledger against a pipeline: which lines it checks (its own, an earlier version's, bad ones), and recomputing them.

:func:`quern.pipeline.integrity.checks.check_ledger` recomputes each step a ledger logged, and
only a line this pipeline logged can be recomputed. :func:`lines_to_check` sorts every
line the ledger holds, in the order read (the lines a later line of another fingerprint
replaced too, so where a line stands in its file never changes the outcome):

- a line whose fingerprint is this pipeline's ``fingerprint_at`` of its step is checked;
- a line whose fingerprint is ``fingerprint_at`` of an *earlier version* of this pipeline
  (the pipeline without its edits, or with only the first of them in the order they were
  made: a run from before the later edits) is left out, with a note naming the edits;
- a line at a step that neither this pipeline nor an earlier version has (past the end of the
  stream or of its addressable steps), or whose host count cannot split this pipeline's
  batches, is a bad line (an :class:`~quern.pipeline.integrity.ledger_read.Issue` naming the file and line);
- any other line was logged by another pipeline: a ``ValueError`` naming the file and line and
  both fingerprints, whatever this pipeline's edits.

:func:`recompute` then recomputes each host slice to check, by an iterator of that host
slice writing its own ledger; :func:`rows_by_step` is ``batch_at``'s row digests in bulk.
Also the text of step sets (``5 step(s) (0..2, 4..5)``), made from runs of steps, never from
the range they span.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from ..identity.changes import first_change
from ..order.index import host_rows
from ..streams.edited import SKIP, EditedStream
from .batch_digest import row_digests_of
from .ledger_read import Entry, Issue, Ledger, described, find_gaps, read_ledger

if TYPE_CHECKING:
    from ..definition.dataset import Pipeline

__all__ = ["lines_to_check", "missing_runs", "recompute", "rows_by_step", "spans", "steps_text"]

_CHUNK = 16  # steps per bulk computation of batch_at


def spans(steps: Iterable[int]) -> list[tuple[int, int]]:
    """Increasing steps as ``[(first, count)]`` runs of consecutive ones."""
    out: list[tuple[int, int]] = []
    for s in steps:
        if out and out[-1][0] + out[-1][1] == s:
            out[-1] = (out[-1][0], out[-1][1] + 1)
        else:
            out.append((s, 1))
    return out


def missing_runs(steps: Sequence[int], start: int, stop: int) -> list[tuple[int, int]]:
    """The ``[(first, count)]`` runs of ``range(start, stop)`` not in ``steps`` (increasing, inside it).

    From the differences of the steps: the range is never materialised.
    """
    edges = [start - 1, *steps, stop]
    return [(a + 1, b - a - 1) for a, b in zip(edges, edges[1:]) if b - a > 1]


def steps_text(steps: Sequence[int] = (), runs: Sequence[tuple[int, int]] | None = None) -> str:
    """``5 step(s) (0..2, 4..5)``: the steps (any order), or their ``(first, count)`` runs; ``no step``."""
    runs = spans(sorted(steps)) if runs is None else runs
    if not runs:
        return "no step"
    text = ", ".join(f"{a}" if n == 1 else f"{a}..{a + n - 1}" for a, n in runs[:4])
    return f"{sum(n for _, n in runs)} step(s) ({text}{', ...' if len(runs) > 4 else ''})"


def _versions(pipe: Pipeline) -> list[Any]:
    """The earlier versions of ``pipe``: without its edits, then with the first one, two, ... (not all)."""
    stream = pipe.stream
    if not isinstance(stream, EditedStream) or not stream.edits:
        return []
    p: Any = dataclasses.replace(pipe, stream=stream.original)
    out = [p]
    for e in stream.edits[:-1]:
        if e.kind == SKIP:
            p = p.skip_steps(e.start, e.stop)
        else:
            p = p.exclude(e.ids, from_step=e.start, component=e.component)
        out.append(p)
    return out


class _Sorter:
    """The tests of one ledger's lines against one pipeline, with what they compute kept."""

    def __init__(self, pipe: Pipeline) -> None:
        self.pipe: Any = pipe
        self._versions: list[Any] | None = None
        self._hosts: dict[int, str | None] = {}

    @property
    def edited(self) -> bool:
        """Whether the pipeline has edits (and so earlier versions)."""
        return bool(self.versions)

    @property
    def versions(self) -> list[Any]:
        """The earlier versions of the pipeline, made at the first use."""
        if self._versions is None:
            self._versions = _versions(self.pipe)
        return self._versions

    def earlier(self, e: Entry) -> bool:
        """Whether an earlier version of the pipeline logs ``e``'s fingerprint at its step."""
        for v in self.versions:
            try:
                if v.fingerprint_at(e.step) == e.fingerprint:
                    return True
            except IndexError:  # a step this version does not have
                continue
        return False

    def host_problem(self, n: int) -> str | None:
        """Why ``n`` hosts cannot split this pipeline's batches (``None``: they can)."""
        if n not in self._hosts:
            try:
                self.pipe.stream.check_hosts(n)
                if self.pipe.batch_size:
                    host_rows(self.pipe.batch_size, 0, n)
                self._hosts[n] = None
            except ValueError as why:
                self._hosts[n] = str(why)
        return self._hosts[n]

    def mine(self, e: Entry) -> tuple[str | None, str]:
        """This pipeline's fingerprint at ``e``'s step, or ``None`` and why it has no such step."""
        try:
            return self.pipe.fingerprint_at(e.step), ""
        except IndexError as why:
            return None, str(why)


def lines_to_check(pipe: Pipeline, ledger: Ledger) -> Ledger:
    """The ledger as ``pipe`` checks it: its own lines, bad lines as issues, earlier versions' left out.

    Args:
        pipe: the pipeline of the run (its config).
        ledger: the ledger read (:func:`~quern.pipeline.integrity.ledger_read.read_ledger`).

    Returns:
        The ledger with one line of this pipeline per step and host slice; its issues with bad lines
        added and gaps found again without them (the steps an earlier version logged count as
        logged; their own issues are dropped); its notes with one naming the steps left out and
        the edits that change them.

    Raises:
        ValueError: the first line, in the order read, logged by another pipeline: names the file
            and line, the line's fingerprint and this pipeline's at that step.
    """
    sorter = _Sorter(pipe)
    order = {f: i for i, f in enumerate(ledger.files)}
    lines = sorted([*ledger.entries.values(), *ledger.superseded], key=lambda e: (order[e.file], e.line))
    kept: dict[tuple[int, int, int], Entry] = {}
    earlier: dict[tuple[int, int, int], Entry] = {}
    bad: list[Issue] = []
    for e in lines:
        key = (e.step, e.process_count, e.process_index)
        mine, past = sorter.mine(e)
        if e.fingerprint != mine:
            if sorter.earlier(e):
                earlier.setdefault(key, e)
            elif mine is None:
                bad.append(Issue("bad line", None, f"{e.where}: step {e.step} is not a step of this pipeline ({past})"))
            else:
                theirs = described(ledger, e.fingerprint)
                first = None if theirs is None else first_change(theirs, pipe.leaves_at(e.step))
                raise ValueError(
                    f"{e.where}: step {e.step} was logged by another pipeline: the line's fingerprint "
                    f"{e.fingerprint}, this pipeline's {mine} (for step {e.step})"
                    + (", and not this pipeline's before its edits either" if sorter.edited else "")
                    + ("" if first is None else f"; the first difference (logged -> this pipeline): {first}")
                    + "; check a ledger with the config of its own run"
                )
            continue
        problem = sorter.host_problem(e.process_count)
        if problem is not None:
            bad.append(
                Issue("bad line", None, f"{e.where}: step {e.step}, {e.host}: not a host slice here ({problem})")
            )
        else:
            kept.setdefault(key, e)
    left_out = sorted({k[0] for k in earlier if k not in kept})
    edited = set(left_out) - {k[0] for k in kept}  # the steps only an earlier version logged: no issue of theirs
    issues = [i for i in ledger.issues if i.kind != "gap" and (i.step is None or i.step not in edited)]
    gaps = [i for i in find_gaps([*kept, *earlier]) if i.step not in edited] if kept or earlier else []
    notes = list(ledger.notes)
    if left_out:
        notes.append(
            f"{steps_text(left_out)} were logged before this pipeline's edits, which change them "
            f"({'; '.join(pipe.stream.edits_before(left_out[0] + 1))}): not checked"
        )
    out = sorted(bad + issues + gaps, key=lambda i: -1 if i.step is None else i.step)
    return ledger._replace(entries=kept, issues=out, notes=notes, superseded=())


def recompute(
    pipe: Pipeline, ledger: Ledger, wanted: range | None, num_workers: int, work_dir: str | os.PathLike
) -> Iterator[tuple[Entry, Entry]]:
    """Each logged line (of ``wanted`` steps) and its recomputation, by host slice, then step.

    An iterator of each host slice (with ``num_workers``) runs each run of consecutive steps
    logged, writing its own ledger in ``work_dir``, which is read back.

    Raises:
        RuntimeError: the recomputation's own ledger does not read back.
    """
    by_slice: dict[tuple[int, int], list[int]] = {}
    for s, n, h in ledger.entries:
        if wanted is None or s in wanted:
            by_slice.setdefault((n, h), []).append(s)
    p: Any = pipe
    for (n_hosts, h), logged in sorted(by_slice.items()):
        logged.sort()
        fd, path = tempfile.mkstemp(dir=os.fspath(work_dir), prefix=f"recomputed-h{n_hosts}-{h}-", suffix=".jsonl")
        os.close(fd)
        for first, count in spans(logged):
            with p.iterator(first, process_index=h, process_count=n_hosts, num_workers=num_workers, ledger=path) as it:
                for _ in range(count):
                    next(it)
        again = read_ledger(path)
        broken = [i for i in again.issues if i.kind != "gap"]  # gaps: only the logged steps are recomputed
        if broken:
            raise RuntimeError(f"the recomputation's own ledger {path} does not read back: {broken[0].text}")
        for s in logged:
            yield ledger.entries[(s, n_hosts, h)], again.entries[(s, n_hosts, h)]


def rows_by_step(pipe: Pipeline, steps: Sequence[int], h: int, hosts: int) -> dict[int, list[str]]:
    """The row digests of host ``h`` of ``hosts`` at each of ``steps`` (batch_at, read in bulk)."""
    out: dict[int, list[str]] = {}
    for first, count in spans(steps):
        for k in range(0, count, _CHUNK):
            n = min(_CHUNK, count - k)
            for i, batch in enumerate(pipe.batches_at(first + k, n, h, hosts)):
                s = first + k + i
                out[s] = row_digests_of(batch, where=f"step {s} (host {h} of {hosts})")
    return out
