"""Determinism you can check: step digests under many topologies, a ledger against a recomputation, two runs.

A batch is a pure function of (definition, step, host slice), so any step can
be recomputed anywhere and compared, digest by digest
(:mod:`quern.pipeline.integrity.batch_digest`):

- :func:`compare_topologies`: the step digests of iterators over every host
  count x worker count (and resuming at given steps) against the reference,
  ``batch_at`` on one host.
- :func:`check_ledger`: each step a training run logged
  (:mod:`quern.pipeline.integrity.ledger`) against a recomputation of that host slice.
- :func:`compare_ledgers`: two runs' ledgers (two machines, two library
  versions), without the data.

Each returns a :class:`VerifyResult`: ``ok``, one summary line per topology or
ledger, and the first :class:`Difference` (its step, host slice and row; with a
recomputation also the records of that row, from ``explain``, and the leaf that
differs). A pipeline whose rows are ordered by the host count (``balance_hosts``:
found from the plan, as the hosts' positions concatenated differing from the
global batch's) is compared only with the same host count. ``quern verify`` is
the command line of these functions.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from ..identity.changes import first_change
from .batch_digest import digests_of, leaf_row_digests, step_digest_of
from .ledger_check import lines_to_check, missing_runs, recompute, rows_by_step, steps_text
from .ledger_read import Entry, Issue, Ledger, described, read_ledger

if TYPE_CHECKING:
    from ..definition.dataset import Pipeline

__all__ = ["Difference", "VerifyResult", "check_ledger", "compare_ledgers", "compare_topologies"]


@dataclasses.dataclass
class Difference:
    """One thing that does not agree: a step, host slice and row whose digests differ, or a ledger's flaw.

    Attributes:
        kind: ``digest`` (row digests differ), ``rows`` (another host slice or row count),
            ``fingerprint`` (two runs of different definitions), ``missing`` (a step not computed
            or not logged), or a ledger's :class:`~quern.pipeline.integrity.ledger_read.Issue` kind
            (``gap``, ``duplicate``, ``torn``, ``bad line``).
        step: the step (``None``: a ledger line that names none).
        text: one sentence saying what differs, and where (file and line for a ledger).
        process_index: the host slice's host.
        process_count: the host slice's host count.
        row: the row of the global batch (of that host count).
        records: the ``(name, record id)`` pairs of that row (``explain``; ``None`` without the data).
        leaf: the key path of the leaf that differs (``None``: not known).
        topology: what computed it (``hosts 2, workers 0``; a ledger; ``None``).
    """

    kind: str
    step: int | None
    text: str
    process_index: int | None = None
    process_count: int | None = None
    row: int | None = None
    records: list[tuple[str, int]] | None = None
    leaf: str | None = None
    topology: str | None = None

    def lines(self) -> list[str]:
        """The difference as text: what, then the step, host slice, row, records and leaf known."""
        where = [f"step {self.step}"] if self.step is not None else []
        if self.process_index is not None:
            where.append(f"host {self.process_index} of {self.process_count}")
        if self.row is not None:
            where.append(f"row {self.row}")
        out = [f"first difference: {self.text}"]
        if where:
            out.append("  at " + ", ".join(where) + (f" ({self.topology})" if self.topology else ""))
        if self.records is not None:
            out.append("  records: " + (", ".join(f"{name}[{i}]" for name, i in self.records) or "none (padding)"))
        if self.leaf is not None:
            out.append(f"  leaf: {self.leaf}")
        return out


@dataclasses.dataclass
class VerifyResult:
    """What a check found.

    Attributes:
        ok: whether everything agrees (no difference, no gap, no differing duplicate, no torn line
            in the middle of a ledger).
        summary_lines: one line per topology or ledger compared.
        differences: every difference found (for a topology, the first of each), in step order.
        notes: what was ignored and why (a torn last line, steps logged again identically, rows
            compared only with the same host count).
        steps: the steps checked.
    """

    ok: bool
    summary_lines: list[str]
    differences: list[Difference]
    notes: list[str]
    steps: int

    @property
    def first(self) -> Difference | None:
        """The first difference: at the lowest step (a ledger line that names no step first)."""
        if not self.differences:
            return None
        return min(self.differences, key=lambda d: -1 if d.step is None else d.step)

    def lines(self) -> list[str]:
        """The report: the summary lines, the notes, then the first difference and how many there are."""
        out = list(self.summary_lines) + [f"note: {n}" for n in self.notes]
        first = self.first
        if first is not None:
            out += first.lines()
            if len(self.differences) > 1:
                out.append(f"{len(self.differences)} differences in all")
        return out


def _result(summary: list[str], differences: list[Difference], notes: list[str], steps: int) -> VerifyResult:
    differences.sort(key=lambda d: -1 if d.step is None else d.step)
    return VerifyResult(not differences, summary, differences, notes, steps)


# --------------------------------------------------------------------------- helpers


def _check_steps(pipe: Pipeline, steps: range | int) -> range:
    """``steps`` (a range, or ``N``: the first ``N``) checked against the stream.

    Raises:
        ValueError: an empty range, a step other than 1, a start past the end.
        IndexError: a step past the end of the stream.
    """
    if isinstance(steps, int) and not isinstance(steps, bool):
        steps = range(steps)
    if not isinstance(steps, range) or steps.step != 1 or len(steps) == 0:
        raise ValueError(f"steps must be a non-empty range of consecutive steps (or a count), got {steps!r}")
    pipe.check_step(steps.start, name="the first step")
    pipe.check_step(steps.stop - 1, name="the last step")
    return steps


def _label(process_count: int, num_workers: int, resume: int | None) -> str:
    return f"hosts {process_count}, workers {num_workers}" + (f", resumed at {resume}" if resume is not None else "")


def _orders_by_hosts(pipe: Pipeline, steps: range, hosts: int) -> bool:
    """Whether the hosts' positions, concatenated in host order, differ from the global batch's at a step."""
    if hosts == 1:
        return False
    for s in steps:
        glob = pipe.positions(s)
        mine = np.concatenate([pipe.positions(s, h, hosts) for h in range(hosts)])
        if not np.array_equal(glob, mine):
            return True
    return False


def _first_differing(a: Sequence[str], b: Sequence[str]) -> int:
    """The first index where two lists differ (the shorter one's length when one is a prefix)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))


def _differing_leaf(a: dict[str, str], b: dict[str, str]) -> str | None:
    """The first key path whose digest differs between two leaf-digest maps (or that one lacks)."""
    for path in sorted(set(a) | set(b)):
        if a.get(path) != b.get(path):
            return path
    return None


def _records(pipe: Pipeline | None, step: int, h: int, hosts: int, i: int) -> list[tuple[str, int]] | None:
    """The records of row ``i`` of host ``h``'s slice at ``step`` (``None`` without a pipeline)."""
    if pipe is None:
        return None
    rows = pipe.explain(step, h, hosts)
    return [(str(name), int(r)) for name, r in rows[i]] if 0 <= i < len(rows) else None


def _entry_at(entries: Sequence[Entry], row: int) -> Entry:
    """The host slice holding global row ``row`` (the last when past them all)."""
    for e in entries:
        if e.first <= row < e.stop:
            return e
    return entries[-1]


def _issue_difference(issue: Issue, run: str = "") -> Difference:
    return Difference(issue.kind, issue.step, f"{run}{issue.text}", topology=None)


# --------------------------------------------------------------------------- topologies


def compare_topologies(
    pipe: Pipeline,
    steps: range | int,
    *,
    hosts: Iterable[int] = (1, 2, 4),
    workers: Iterable[int] = (0, 2),
    resume_at: Iterable[int] = (),
    work_dir: str | os.PathLike | None = None,
) -> VerifyResult:
    """The step digests of iterators under every topology, against ``batch_at`` on one host.

    For each host count ``H`` and worker count ``W`` (and, for each ``K`` of
    ``resume_at``, an iterator resumed from ``pipe.state_at(K)``), every host's
    iterator ``pipe.iterator(process_index=h, process_count=H, num_workers=W)``
    runs the steps with a ledger (the digests computed where the batches are made),
    and the hosts' row digests concatenated in host order must equal the reference's:
    the global batch ``batch_at(step)``. A pipeline whose rows are ordered by the
    host count (``balance_hosts``) is compared with ``batch_at`` over the same host
    count instead (a note says so).

    Args:
        pipe: the batched pipeline.
        steps: the steps (a range of consecutive steps, or ``N``: the first ``N``).
        hosts: the host counts (each must divide the batch).
        workers: the worker counts (0: threads).
        resume_at: steps to resume at (each inside ``steps``): the steps from there are run again
            by a resumed iterator of every topology.
        work_dir: where the ledgers go (default: a temporary folder, removed after).

    Returns:
        The result: one summary line per topology; the first difference of each.

    Raises:
        ValueError: bad steps, host or worker counts, or a resume step outside ``steps``.
        IndexError: a step past the end of the stream.
        StepError: a step failed.
    """
    steps = _check_steps(pipe, steps)
    host_counts = [int(h) for h in hosts]
    worker_counts = [int(w) for w in workers]
    resumes = [int(k) for k in resume_at]
    if not host_counts or any(h < 1 for h in host_counts):
        raise ValueError(f"hosts must be host counts >= 1, got {host_counts}")
    if not worker_counts or any(w < 0 for w in worker_counts):
        raise ValueError(f"workers must be worker counts >= 0, got {worker_counts}")
    bad = [k for k in resumes if k not in steps]
    if bad:
        raise ValueError(
            f"resume_at {bad}: a resume step must be one of the steps checked ({steps.start}..{steps.stop - 1})"
        )
    if work_dir is None:
        with tempfile.TemporaryDirectory(prefix="quern-verify-") as tmp:
            return compare_topologies(
                pipe, steps, hosts=host_counts, workers=worker_counts, resume_at=resumes, work_dir=tmp
            )
    reference = rows_by_step(pipe, list(steps), 0, 1)
    summary, differences, notes = [], [], []
    run_digest = step_digest_of([step_digest_of(reference[s]) for s in steps])
    summary.append(f"reference (batch_at, 1 host): {steps_text(list(steps))}, digest {run_digest}")
    for n_hosts in host_counts:
        ref = reference
        if _orders_by_hosts(pipe, steps, n_hosts):
            notes.append(
                f"hosts {n_hosts}: a batch's rows are ordered by the host count (balance_hosts, by design): "
                f"compared with batch_at over {n_hosts} hosts, not with 1 host"
            )
            per_host = [rows_by_step(pipe, list(steps), h, n_hosts) for h in range(n_hosts)]
            ref = {s: [d for h in range(n_hosts) for d in per_host[h][s]] for s in steps}
        for n_workers in worker_counts:
            for resume in [None, *resumes]:
                line, found = _run_topology(pipe, steps, n_hosts, n_workers, resume, ref, work_dir, ref is reference)
                summary.append(line)
                differences += found
    return _result(summary, differences, notes, len(steps))


def _run_topology(
    pipe: Pipeline,
    steps: range,
    n_hosts: int,
    n_workers: int,
    resume: int | None,
    ref: dict[int, list[str]],
    work_dir: str | os.PathLike,
    global_ref: bool,
) -> tuple[str, list[Difference]]:
    """Run one topology's iterators with ledgers; its summary line and its first difference."""
    label = _label(n_hosts, n_workers, resume)
    start = steps.start if resume is None else resume
    path = os.path.join(os.fspath(work_dir), f"h{n_hosts}-w{n_workers}-k{resume}-{{process_index}}.jsonl")
    for h in range(n_hosts):
        options: dict[str, Any] = dict(process_index=h, process_count=n_hosts, num_workers=n_workers, ledger=path)
        p: Any = pipe
        it = p.iterator(start, **options) if resume is None else p.resume(pipe.state_at(resume), **options)
        with it:
            for _ in range(steps.stop - start):
                next(it)
    ledger = read_ledger(path)
    checked = list(range(start, steps.stop))
    wrong: list[int] = []
    first: Difference | None = None
    digests = []
    for s in checked:
        entries = ledger.slices(s).get(n_hosts)
        if entries is None:
            wrong.append(s)
            first = first or Difference("missing", s, f"{label}: step {s} was not logged by every host", topology=label)
            continue
        rows = [d for e in entries for d in e.row_digests()]
        digests.append(step_digest_of(rows))
        if rows != ref[s]:
            wrong.append(s)
            if first is None:
                first = _topology_difference(pipe, s, entries, rows, ref[s], label, global_ref)
    what = "batch_at, 1 host" if global_ref else f"batch_at, {n_hosts} hosts"
    if not wrong:
        line = f"{label}: {steps_text(checked)} agree with the reference ({what}), digest {step_digest_of(digests)}"
        return line, []
    line = f"{label}: {len(wrong)} of {len(checked)} step(s) differ from the reference ({what}), the first {wrong[0]}"
    return line, [first] if first is not None else []


def _topology_difference(
    pipe: Pipeline,
    step: int,
    entries: list[Entry],
    rows: list[str],
    ref: list[str],
    label: str,
    global_ref: bool,
) -> Difference:
    """The first differing row of a step under a topology, with its records and leaf."""
    i = _first_differing(rows, ref)
    n_hosts = entries[0].process_count
    if len(rows) != len(ref) and i == min(len(rows), len(ref)):
        return Difference(
            "rows", step, f"{label}: step {step} has {len(rows)} rows, the reference {len(ref)}", topology=label
        )
    e = _entry_at(entries, i)
    h = e.process_index
    mine = pipe.batch_at(step, h, n_hosts)
    where = f"step {step} (host {h} of {n_hosts})"
    leaf = _differing_leaf(e.leaves, digests_of(mine, where).leaves)  # the iterator vs batch_at of the slice
    if leaf is None and global_ref:  # the slice is batch_at's: it differs from the global batch's rows
        glob = leaf_row_digests(pipe.batch_at(step), f"step {step}")
        part = leaf_row_digests(mine, where)
        leaf = next((p for p in sorted(set(glob) | set(part)) if p not in glob or p not in part), None)
        if leaf is None:
            leaf = next((p for p in sorted(glob) if part[p][i - e.first] != glob[p][i]), None)
    return Difference(
        "digest",
        step,
        f"{label}: step {step}, row {i} differs from the reference",
        process_index=h,
        process_count=n_hosts,
        row=i,
        records=_records(pipe, step, h, n_hosts, i - e.first),
        leaf=leaf,
        topology=label,
    )


# --------------------------------------------------------------------------- a ledger against the data


def check_ledger(
    pipe: Pipeline,
    paths: str | os.PathLike | Iterable[str | os.PathLike],
    *,
    steps: range | int | None = None,
    num_workers: int = 0,
    work_dir: str | os.PathLike | None = None,
) -> VerifyResult:
    """Each step a ledger logged, against a recomputation of its host slice.

    The ledgers of all hosts of a run are merged (:func:`quern.pipeline.integrity.ledger_read.read_ledger`):
    its gaps, torn or bad lines in the middle and differing duplicates are differences too; a
    torn last line is a note. Every line, whatever ``steps``, is sorted by its fingerprint
    (:func:`quern.pipeline.integrity.ledger_check.lines_to_check`): this pipeline's are checked, those of
    an earlier version of it (before its edits) are left out with a note, one at a step or host
    count this pipeline cannot have is a bad line, any other is refused. Each host slice checked
    is recomputed by an iterator of that host slice (with ``num_workers``) and its row and leaf
    digests compared.

    Args:
        pipe: the pipeline of the run (its config).
        paths: the ledger files: paths, globs, comma-separated lists.
        steps: check only these steps (a range or ``N``; default: every step logged).
        num_workers: worker processes recomputing the steps.
        work_dir: where the recomputation's ledgers go (default: a temporary folder).

    Returns:
        The result: a summary line, the differences (the first one with its records and leaf).

    Raises:
        ValueError: no such file, no ledger line, or a line logged by another pipeline, wherever
            it is and whatever this pipeline's edits (naming both fingerprints, the file and the line).
    """
    read = read_ledger(paths)
    wanted = None if steps is None else _check_steps(pipe, steps)
    ledger = lines_to_check(pipe, read)
    logged = f"of the {steps_text(read.steps())} logged by {'/'.join(map(str, _counts(read)))} host(s)"
    if work_dir is None:
        with tempfile.TemporaryDirectory(prefix="quern-verify-") as tmp:
            return _check_ledger(pipe, ledger, wanted, num_workers, tmp, logged)
    return _check_ledger(pipe, ledger, wanted, num_workers, work_dir, logged)


def _counts(ledger: Ledger) -> list[int]:
    """The host counts of a ledger's lines."""
    return sorted({n for _, n, _ in ledger.entries})


def _check_ledger(
    pipe: Pipeline, ledger: Ledger, wanted: range | None, num_workers: int, work_dir: str | os.PathLike, logged: str
) -> VerifyResult:
    """:func:`check_ledger` of the lines to check; ``logged`` (what was read) ends the summary when none is."""
    differences = [_issue_difference(i) for i in ledger.issues if wanted is None or i.step is None or i.step in wanted]
    checked: set[int] = set()
    for line, again in recompute(pipe, ledger, wanted, num_workers, work_dir):
        checked.add(line.step)
        d = _entry_difference(pipe, line, again, "its recomputation")
        if d is not None:
            differences.append(d)
    if wanted is not None:
        runs = missing_runs([s for s in ledger.steps() if s in wanted], wanted.start, wanted.stop)
        if runs:
            text = f"{steps_text(runs=runs)} asked for are missing from the ledger"
            differences.append(Difference("missing", runs[0][0], text))
    files = ", ".join(ledger.files)
    if not checked:
        differences.append(Difference("missing", None, "no logged step could be checked against this pipeline"))
        return _result([f"ledger {files}: no step checked {logged}"], differences, list(ledger.notes), 0)
    bad = sorted({d.step for d in differences if d.step is not None})
    summary = [
        f"ledger {files}: {steps_text(sorted(checked))} logged by {'/'.join(map(str, _counts(ledger)))} host(s), "
        + ("every host slice agrees with a recomputation" if not differences else f"{len(bad)} step(s) do not check")
    ]
    return _result(summary, differences, list(ledger.notes), len(checked))


def _entry_difference(pipe: Pipeline | None, logged: Entry, other: Entry, against: str) -> Difference | None:
    """What differs between a logged host slice and another (recomputed, or another run's), or ``None``.

    ``against`` names the other in messages (``its recomputation``, ``run B (FILE:LINE)``).
    """
    s, h, n = logged.step, logged.process_index, logged.process_count
    base = dict(process_index=h, process_count=n)
    if (logged.first, logged.stop) != (other.first, other.stop):
        return Difference(
            "rows",
            s,
            f"step {s}, host {h} of {n}: {logged.where} logs rows [{logged.first}, {logged.stop}), "
            f"{against} [{other.first}, {other.stop})",
            **base,  # type: ignore[arg-type]
        )
    if logged.rows == other.rows and logged.leaves == other.leaves:
        return None
    a, b = logged.row_digests(), other.row_digests()
    i = _first_differing(a, b)
    leaf = _differing_leaf(logged.leaves, other.leaves)
    if i == len(a):
        return Difference(
            "digest",
            s,
            f"step {s}, host {h} of {n}: the leaf digests of {logged.where} differ from {against}'s",
            leaf=leaf,
            **base,  # type: ignore[arg-type]
        )
    return Difference(
        "digest",
        s,
        f"step {s}, row {logged.first + i} ({logged.where}) differs from {against}",
        row=logged.first + i,
        records=_records(pipe, s, h, n, i),
        leaf=leaf,
        **base,  # type: ignore[arg-type]
    )


# --------------------------------------------------------------------------- two runs


def compare_ledgers(
    a_paths: str | os.PathLike | Iterable[str | os.PathLike],
    b_paths: str | os.PathLike | Iterable[str | os.PathLike],
    *,
    pipe: Pipeline | None = None,
) -> VerifyResult:
    """Two runs' ledgers compared step by step, without the data.

    The steps both logged are compared: their fingerprints, and their row and leaf
    digests (host slice by host slice when both ran on the same host count, else
    the global batches' rows). Each ledger's own gaps, torn lines in the middle and
    differing duplicates are differences too; the steps only one logged are a note.
    Rows in another order under another host count, as ``balance_hosts`` orders them,
    are a note, not a difference.

    Args:
        a_paths: run A's ledger files (paths, globs, comma-separated lists).
        b_paths: run B's.
        pipe: the pipeline, to name the records of a differing row (optional).

    Returns:
        The result.

    Raises:
        ValueError: no such file, or no ledger line.
    """
    runs = [read_ledger(a_paths), read_ledger(b_paths)]
    differences = [_issue_difference(i, f"run {x}: ") for x, led in zip("AB", runs) for i in led.issues]
    notes = [f"run {x}: {n}" for x, led in zip("AB", runs) for n in led.notes]
    a, b = runs
    common = sorted(set(a.steps()) & set(b.steps()))
    for x, led, other in (("A", a, b), ("B", b, a)):
        only = sorted(set(led.steps()) - set(other.steps()))
        if only:
            notes.append(f"run {x} logs {steps_text(only)} that the other does not: not compared")
    reordered = []
    for s in common:
        sa, sb = a.slices(s), b.slices(s)
        if not sa or not sb:
            continue  # a gap: reported
        shared = sorted(set(sa) & set(sb))
        ea, eb = (sa[shared[0]], sb[shared[0]]) if shared else (sa[min(sa)], sb[min(sb)])
        if ea[0].fingerprint != eb[0].fingerprint:
            da, db = described(a, ea[0].fingerprint), described(b, eb[0].fingerprint)
            first = None if da is None or db is None else first_change(da, db)
            differences.append(
                Difference(
                    "fingerprint",
                    s,
                    f"step {s}: run A was logged by pipeline {ea[0].fingerprint} ({ea[0].where}), run B by "
                    f"{eb[0].fingerprint} ({eb[0].where})"
                    + ("" if first is None else f"; the first difference (A -> B): {first}"),
                )
            )
            continue
        if shared:
            for mine, theirs in zip(ea, eb):
                d = _entry_difference(pipe, mine, theirs, f"run B ({theirs.where})")
                if d is not None:
                    differences.append(d)
                    break
            continue
        rows_a = [d for e in ea for d in e.row_digests()]
        rows_b = [d for e in eb for d in e.row_digests()]
        if rows_a == rows_b:
            continue
        if sorted(rows_a) == sorted(rows_b):
            reordered.append(s)
            continue
        i = _first_differing(rows_a, rows_b)
        e = _entry_at(ea, i)
        differences.append(
            Difference(
                "digest",
                s,
                f"step {s}, row {i} differs: run A ({e.where}, {e.process_count} hosts), run B "
                f"({_entry_at(eb, i).where}, {eb[0].process_count} hosts)",
                process_index=e.process_index,
                process_count=e.process_count,
                row=i,
                records=_records(pipe, s, e.process_index, e.process_count, i - e.first),
            )
        )
    if reordered:
        notes.append(
            f"{steps_text(reordered)} hold the same rows in another order under another host count (as "
            "balance_hosts orders them, by design): compared as sets only"
        )
    if not common:
        differences.append(Difference("missing", None, "the two ledgers have no step in common: nothing compared"))
    bad = sorted({d.step for d in differences if d.step is not None})
    summary = [
        f"run {x}: {', '.join(led.files)}: {steps_text(led.steps())}, host count(s) "
        + "/".join(str(n) for n in sorted({n for _, n, _ in led.entries}))
        for x, led in zip("AB", runs)
    ]
    summary.append(
        f"compared {steps_text(common)}: "
        + ("they agree" if not differences else f"{len(bad)} step(s) differ or do not check")
    )
    return _result(summary, differences, notes, len(common))
