"""The ledger: one JSON line per step an iterator yields, with the digests of its host slice.

``pipe.iterator(..., ledger=PATH)`` appends, for every step it yields, the line

.. code-block:: json

    {"step": 12, "fingerprint": "...", "process_index": 0, "process_count": 2, "digest_format": 2,
     "rows": [0, 128], "row_digests": ["..."], "leaf_digests": {"batch['tokens']": "..."}}

``fingerprint`` is :meth:`~quern.pipeline.dataset.Pipeline.fingerprint_at` of the step
(the definition as it applies to the steps up to that one, so a ledger still
checks the steps before a later edit); ``rows`` are this host's rows of the
global batch, ``row_digests`` and ``leaf_digests`` those of
:mod:`quern.pipeline.batch_digest`, whose canonical form is version ``digest_format``
(:data:`~quern.pipeline.batch_digest.FORMAT`: a line of another is refused when read).
With workers, the digests are computed in the
worker processes and travel with the batch; with 0 workers the iterator hashes each
batch's rows as it yields it (:meth:`LedgerWriter.add_batch`: the batch as the user
gets it), and makes the lines of the steps kept together when it writes them. ``PATH`` may hold
``{process_index}``. Lines are kept in memory and written every
:data:`FLUSH_LINES` steps or :data:`FLUSH_SECONDS` seconds, at ``state()``,
``close()``, the end of the stream and an error, each write whole lines in one
call, so a crash tears at most the last line; a ledger opened again for
appending (a resumed run) first drops such a torn tail.

Reading (:func:`read_ledger`) merges the files of all hosts of a run: a torn
last line is ignored and noted; a torn or bad line in the middle (a step that
is not an integer from 0 to :data:`STEP_LIMIT` - 1, say), missing steps or host
slices, and a step and host slice logged twice with different content are
:class:`Issue` s, never skipped silently. Steps logged again identically (after
a resume) are fine. Gaps are found from the sorted steps logged, never from the
range they span, so one line at a huge step costs no memory.
"""

from __future__ import annotations

import glob
import itertools
import json
import os
import threading
import time
from collections.abc import Iterable
from typing import Any, NamedTuple, Protocol

from .batch_digest import FORMAT, Digesting, check_format
from .errors import StepError
from .index import MAX_RECORDS, host_rows

__all__ = [
    "FLUSH_LINES",
    "FLUSH_SECONDS",
    "DIGEST",
    "Entry",
    "Issue",
    "Ledger",
    "LedgerWriter",
    "STEP_LIMIT",
    "expand_paths",
    "find_gaps",
    "first_row",
    "read_ledger",
    "StepFields",
    "step_fields",
]

FLUSH_LINES = 16
"""Lines kept in memory before they are written."""
FLUSH_SECONDS = 2.0
"""Seconds after which kept lines are written at the next step, however few."""
DIGEST = "digest"
"""The stage name of the time spent digesting batches for the ledger (in ``it.stats()["stages"]``)."""
STEP_LIMIT = MAX_RECORDS
"""No pipeline has a step or host count at or past it (``2**62``: stream positions stay below it)."""

_KEYS = ("step", "fingerprint", "process_index", "process_count", "rows", "row_digests", "leaf_digests")


class _Batched(Protocol):
    """What a ledger line's rows need of a pipeline."""

    @property
    def batch_size(self) -> int | None:
        """The global batch size."""

    @property
    def num_steps(self) -> int | None:
        """Steps in the stream (``None``: endless)."""


class _Fingerprinted(_Batched, Protocol):
    """What the ledger writer needs of a pipeline."""

    def fingerprint_at(self, step: int) -> str:
        """The fingerprint of the definition as it applies to the steps up to ``step``."""


# --------------------------------------------------------------------------- writing


def first_row(pipe: _Batched, step: int, process_index: int, process_count: int, rows: int) -> int:
    """The first row of the global batch at ``step`` that host ``process_index`` holds (``rows`` rows).

    Args:
        pipe: the pipeline.
        step: the step.
        process_index: the host.
        process_count: the hosts.
        rows: the rows of this host's slice.

    Returns:
        ``h * B / H`` for a finite stream's batch of ``B``; for an endless stream (whose batch size may
        change by step, as a bucketed one's) ``h * rows``: every host holds as many rows.
    """
    if pipe.num_steps is None or pipe.batch_size is None:
        return process_index * rows
    return host_rows(pipe.batch_size, process_index, process_count)[0]


def step_fields(pipe: _Batched, batch: Any, step: int, process_index: int, process_count: int) -> str:
    """The ledger line's fields that come from the batch: ``"rows"``, ``"row_digests"``, ``"leaf_digests"``.

    Computed where the batch is made (a worker process, a service actor), as JSON text.

    Args:
        pipe: the pipeline.
        batch: this host's batch at ``step``.
        step: the step.
        process_index: this host.
        process_count: the hosts.

    Returns:
        The fields as JSON text, without the braces.

    Raises:
        StepError: the batch cannot be digested per row (a leaf without a row axis), naming the step,
            host slice and leaf.
    """
    fields = StepFields(pipe, process_index, process_count)
    fields.add(batch, step)
    return fields.finish()[0]


class StepFields:
    """The :func:`step_fields` of consecutive steps of one host slice, with less work per step.

    The iterator adds each batch as it yields it (its rows are hashed then) and finishes the fields
    of the steps added together when it writes their lines
    (:class:`quern.pipeline.batch_digest.Digesting`).

    Args:
        pipe: the pipeline.
        process_index: this host.
        process_count: the hosts.
    """

    def __init__(self, pipe: _Batched, process_index: int, process_count: int) -> None:
        self._pipe, self._index, self._hosts = pipe, process_index, process_count
        self._digesting = Digesting()
        self._steps: list[int] = []

    def add(self, batch: Any, step: int) -> None:
        """Hash the rows of ``batch``, this host's batch at ``step``.

        Raises:
            StepError: the batch cannot be digested per row (a leaf without a row axis), naming the
                step, host slice and leaf.
        """
        where = f"step {step} (host {self._index} of {self._hosts}), stage 'digest' (the ledger)"
        try:
            self._digesting.add(batch, where)
        except (ValueError, TypeError) as e:
            raise StepError(str(e)) from e
        self._steps.append(step)

    def finish(self) -> list[str]:
        """The fields of each step added, in order, as :func:`step_fields` gives them."""
        out = []
        for step, (n, rows, leaves) in zip(self._steps, self._digesting.finish()):
            first = first_row(self._pipe, step, self._index, self._hosts, n)
            out.append(f'"rows": [{first}, {first + n}], "row_digests": {rows}, "leaf_digests": {leaves}')
        self._steps = []
        return out


class LedgerWriter:
    """Appends an iterator's ledger lines to one file (one per host with ``{process_index}``).

    Args:
        path: the file; ``{process_index}`` in it is replaced by this host's index. Its folder
            is created if missing.
        pipe: the pipeline (its :meth:`~quern.Pipeline.fingerprint_at` is in every line).
        process_index: this host.
        process_count: the hosts.
        start_step: the first step the iterator yields (its fingerprint is computed now, so a
            pipeline that cannot be described fails here, not at a later step).

    Raises:
        OSError: the file cannot be opened for appending.
        FingerprintError: the pipeline cannot be fingerprinted.

    Attributes:
        path: the file written.
    """

    def __init__(
        self, path: str | os.PathLike, pipe: _Fingerprinted, process_index: int, process_count: int, start_step: int
    ) -> None:
        self.path = os.fspath(path).replace("{process_index}", str(process_index))
        self.pipe = pipe
        self._hosts = (int(process_index), int(process_count))
        self._fields = StepFields(pipe, *self._hosts)
        self._hashed: list[int] = []  # the steps of add_batch whose lines are not made yet
        hosts = f'"process_index": {int(process_index)}, "process_count": {int(process_count)}'
        self._head = f', {hosts}, "digest_format": {FORMAT}, '
        if pipe.num_steps is None or start_step < pipe.num_steps:
            pipe.fingerprint_at(start_step)
        folder = os.path.dirname(self.path)
        if folder:
            os.makedirs(folder, exist_ok=True)
        self._fd: int | None = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
        self._lock = threading.Lock()
        self._lines: list[str] = []
        self._since = time.monotonic()
        try:
            _drop_torn_tail(self._fd)
        except BaseException:
            self.forget()
            raise

    def add(self, step: int, fields: str) -> None:
        """Keep the line of ``step`` (written with the next flush).

        Args:
            step: the step yielded.
            fields: its :func:`step_fields`.

        Raises:
            OSError: the lines kept could not be written.
        """
        line = self._line(step, fields)
        with self._lock:
            self._make_lines()  # the lines of earlier batches first
            self._lines.append(line)
            self._write_if_due()

    def add_batch(self, step: int, batch: Any) -> None:
        """Hash the rows of ``batch``, the batch of ``step`` about to be yielded; its line is made with the next flush.

        What the line needs of the batch is kept (:meth:`StepFields.add`), so the batch may be written to
        once this returns.

        Args:
            step: the step.
            batch: this host's batch at ``step``.

        Raises:
            StepError: the batch cannot be digested per row (a leaf without a row axis), naming the
                step, host slice and leaf.
            OSError: the lines kept could not be written.
        """
        with self._lock:
            self._fields.add(batch, step)
            self._hashed.append(step)
            self._write_if_due()

    def _line(self, step: int, fields: str) -> str:
        return f'{{"step": {step}, "fingerprint": "{self.pipe.fingerprint_at(step)}"{self._head}{fields}}}\n'

    def _make_lines(self) -> None:
        """The lines of the batches hashed by :meth:`add_batch`, made (all of them together) and kept."""
        if self._hashed:
            steps, self._hashed = self._hashed, []
            self._lines += [self._line(s, f) for s, f in zip(steps, self._fields.finish())]

    def _write_if_due(self) -> None:
        if len(self._lines) + len(self._hashed) >= FLUSH_LINES or time.monotonic() - self._since >= FLUSH_SECONDS:
            self._write()

    def flush(self) -> None:
        """Write the lines kept (no ``fsync``: the page cache survives a crash of the process).

        Raises:
            OSError: they could not be written.
        """
        with self._lock:
            self._write()

    def _write(self) -> None:
        self._make_lines()
        self._since = time.monotonic()
        if not self._lines or self._fd is None:
            return
        data = memoryview("".join(self._lines).encode())
        while data:  # one call, unless the file system takes less
            data = data[os.write(self._fd, data) :]
        self._lines.clear()  # kept if the write failed: written with the next

    def close(self) -> None:
        """Write the lines kept and close the file; idempotent.

        Raises:
            OSError: they could not be written.
        """
        try:
            self.flush()
        finally:
            self.forget()

    def forget(self) -> None:
        """Close the file without writing (a forked copy of the iterator: the lines are its parent's)."""
        with self._lock:
            self._lines.clear()
            self._hashed, self._fields = [], StepFields(self.pipe, *self._hosts)
            fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)


def _drop_torn_tail(fd: int) -> None:
    """Cut a file that does not end with a newline back to its last newline: a crash's torn line goes."""
    size = os.fstat(fd).st_size
    if not size or os.pread(fd, 1, size - 1) == b"\n":
        return
    end = size
    while end > 0:
        start = max(0, end - (1 << 16))
        cut = os.pread(fd, end - start, start).rfind(b"\n")
        if cut >= 0:
            os.ftruncate(fd, start + cut + 1)
            return
        end = start
    os.ftruncate(fd, 0)


# --------------------------------------------------------------------------- reading


class Entry(NamedTuple):
    """One ledger line: a step's host slice."""

    step: int
    fingerprint: str
    process_index: int
    process_count: int
    first: int
    """The slice's first row in the global batch."""
    stop: int
    """One past its last row."""
    rows: bytes
    """The row digests, 16 bytes each."""
    leaves: dict[str, str]
    """The leaf digests, by key path."""
    file: str
    line: int

    @property
    def where(self) -> str:
        """``FILE:LINE``."""
        return f"{self.file}:{self.line}"

    @property
    def host(self) -> str:
        """``host H of N``."""
        return f"host {self.process_index} of {self.process_count}"

    def row_digests(self) -> list[str]:
        """The row digests as hex, in row order."""
        hx = self.rows.hex()
        return [hx[i : i + 32] for i in range(0, len(hx), 32)]

    def same(self, other: Entry) -> bool:
        """Whether two lines log the same content (a step logged again after a resume)."""
        return (self.fingerprint, self.first, self.stop, self.rows, self.leaves) == (
            other.fingerprint,
            other.first,
            other.stop,
            other.rows,
            other.leaves,
        )


class Issue(NamedTuple):
    """What keeps a ledger from checking: a torn or bad line, a gap, a differing duplicate."""

    kind: str
    """``"torn"``, ``"bad line"``, ``"gap"`` or ``"duplicate"``."""
    step: int | None
    """The step it concerns (``None``: a line that says no step)."""
    text: str
    """One sentence naming the file and line, or the step and host slice."""


class Ledger(NamedTuple):
    """The merged ledger of a run: every host's lines, keyed by step and host slice."""

    files: list[str]
    entries: dict[tuple[int, int, int], Entry]
    """``(step, process_count, process_index)`` -> its line (the first, when logged again)."""
    issues: list[Issue]
    """What keeps it from checking, in step order (lines that say no step first)."""
    notes: list[str]
    """What was ignored and why: a torn last line, steps logged again identically."""
    superseded: tuple[Entry, ...] = ()
    """The lines that a later line of their step and host slice under another fingerprint replaced."""

    def steps(self) -> list[int]:
        """The steps logged, increasing."""
        return sorted({s for s, _, _ in self.entries})

    def slices(self, step: int) -> dict[int, list[Entry]]:
        """The host slices of ``step`` logged whole: ``{process_count: its entries in host order}``."""
        out: dict[int, list[Entry]] = {}
        counts = sorted({n for s, n, _ in self.entries if s == step})
        for n in counts:
            got = [self.entries.get((step, n, h)) for h in range(n)]
            if all(e is not None for e in got):
                out[n] = got  # type: ignore[assignment]
        return out


def expand_paths(specs: str | os.PathLike | Iterable[str | os.PathLike]) -> list[str]:
    """The ledger files named by ``specs``: paths, globs or comma-separated lists of them.

    ``{process_index}`` in a path matches any host's file.

    Args:
        specs: one spec or several.

    Returns:
        The files, in the order named (a glob's sorted), each once.

    Raises:
        ValueError: a path that does not exist, or a glob that matches nothing.
    """
    if isinstance(specs, (str, os.PathLike)):
        specs = [specs]
    out: list[str] = []
    for spec in specs:
        for part in os.fspath(spec).split(","):
            part = part.strip().replace("{process_index}", "*")
            if not part:
                continue
            if glob.has_magic(part):
                found = sorted(glob.glob(part))
                if not found:
                    raise ValueError(f"ledger {part!r} matches no file")
            elif os.path.isfile(part):
                found = [part]
            else:
                raise ValueError(f"ledger {part!r}: no such file")
            out += [f for f in found if f not in out]
    if not out:
        raise ValueError("no ledger file given")
    return out


def _entry(obj: Any, file: str, line: int) -> Entry:
    """A parsed line as an :class:`Entry`, checked.

    Raises:
        ValueError: it is not a ledger line (says why).
    """
    if not isinstance(obj, dict) or any(k not in obj for k in _KEYS):
        missing = [k for k in _KEYS if not isinstance(obj, dict) or k not in obj]
        raise ValueError(f"not a ledger line (no {', '.join(missing)})")
    step, fp, h, n, rows, digests, leaves = (obj[k] for k in _KEYS)

    def is_int(x: Any) -> bool:
        return isinstance(x, int) and not isinstance(x, bool)

    if not (is_int(step) and 0 <= step < STEP_LIMIT):
        raise ValueError(f"step {step!r} is not a step (an integer from 0 to 2**62 - 1)")
    if not (is_int(n) and 1 <= n < STEP_LIMIT and is_int(h) and 0 <= h < n):
        raise ValueError(f"process_index {h!r}, process_count {n!r}: not a host slice of step {step}")
    if not isinstance(fp, str):
        raise ValueError(f"fingerprint {fp!r} is not a string")
    if not (isinstance(rows, list) and len(rows) == 2 and all(is_int(r) for r in rows) and 0 <= rows[0] <= rows[1]):
        raise ValueError(f"rows {rows!r} is not [first, stop]")
    if not isinstance(digests, list) or len(digests) != rows[1] - rows[0]:
        raise ValueError(f"row_digests does not hold one digest per row of rows {rows}")
    try:
        raw = bytes.fromhex("".join(digests))
    except (TypeError, ValueError):
        raw = b""
    if len(raw) != 16 * len(digests) or any(not isinstance(d, str) or len(d) != 32 for d in digests):
        raise ValueError("row_digests holds a value that is not 32 hex digits")
    if not isinstance(leaves, dict) or not all(isinstance(v, str) for v in leaves.values()):
        raise ValueError("leaf_digests is not an object of digests")
    return Entry(step, fp, h, n, rows[0], rows[1], raw, leaves, file, line)


def read_ledger(specs: str | os.PathLike | Iterable[str | os.PathLike]) -> Ledger:
    """Read and merge the ledger files of a run (all its hosts, all its resumes).

    Args:
        specs: the files (see :func:`expand_paths`).

    Returns:
        The merged ledger, with its issues (torn or bad lines in the middle, missing steps or host
        slices between its first and last step, a step and host slice logged twice with different
        content under the same fingerprint) and notes (a torn last line, ignored; steps logged again
        identically; steps logged again under another fingerprint, a resume on an edited pipeline,
        whose later line is kept and the earlier one is in ``superseded``).

    Raises:
        ValueError: a file is missing or unreadable, no file holds a ledger line, or a line's digests
            are of another ``digest_format`` than this quern's (naming the file and line).
    """
    files = expand_paths(specs)
    entries: dict[tuple[int, int, int], Entry] = {}
    issues: list[Issue] = []
    notes: list[str] = []
    superseded: list[Entry] = []
    again = 0
    for file in files:
        try:
            with open(file, "rb") as f:
                lines = list(f)
        except OSError as why:
            raise ValueError(f"ledger {file}: {why}") from why
        for k, raw in enumerate(lines, 1):
            if not raw.strip():
                continue
            last = k == len(lines) and not raw.endswith(b"\n")
            try:
                obj = json.loads(raw)
            except ValueError:
                if last:
                    notes.append(f"{file}:{k}: the last line is torn (a crash while it was written): ignored")
                else:
                    issues.append(Issue("torn", None, f"{file}:{k}: a torn line in the middle of the ledger"))
                continue
            if last:
                notes.append(f"{file}:{k}: the last line has no newline (a crash while it was written): ignored")
                continue
            try:
                e = _entry(obj, file, k)
            except ValueError as why:
                issues.append(Issue("bad line", None, f"{file}:{k}: {why}"))
                continue
            check_format(obj.get("digest_format"), f"{file}:{k}")  # digests of another format: refused
            key = (e.step, e.process_count, e.process_index)
            seen = entries.get(key)
            if seen is None:
                entries[key] = e
            elif seen.same(e):
                again += 1
            elif seen.fingerprint != e.fingerprint:  # a resume on an edited definition: the later line counts
                entries[key] = e
                superseded.append(seen)
            else:
                issues.append(
                    Issue(
                        "duplicate",
                        e.step,
                        f"step {e.step}, {e.host} is logged twice with different content: {seen.where} and {e.where}",
                    )
                )
    if not entries:
        raise ValueError(f"no ledger line in {', '.join(files)}")
    if again:
        notes.append(f"{again} line(s) log a step and host slice again identically (a resumed run): fine")
    if superseded:
        notes.append(
            f"{len(superseded)} line(s) log a step and host slice again under another definition (a resume on an "
            "edited pipeline): the later line is the one checked"
        )
    issues += find_gaps(entries)
    issues.sort(key=lambda i: -1 if i.step is None else i.step)
    return Ledger(files, entries, issues, notes, tuple(superseded))


def find_gaps(entries: Iterable[tuple[int, int, int]]) -> list[Issue]:
    """The steps between the first and the last logged that are missing, or miss a host slice.

    From the sorted steps' differences, never a range materialised: memory in lines, not in steps or hosts.

    Args:
        entries: the ``(step, process_count, process_index)`` of each line.
    """
    by_step: dict[int, dict[int, set[int]]] = {}
    for step, n, h in entries:
        by_step.setdefault(step, {}).setdefault(n, set()).add(h)
    steps = sorted(by_step)
    runs = [(a + 1, b - 1) for a, b in zip(steps, steps[1:]) if b - a > 1]  # the missing steps, first and last
    out: list[Issue] = []
    if runs:
        text = ", ".join(str(a) if a == b else f"{a}..{b}" for a, b in runs)
        what = f"step {text} is" if runs[0][0] == runs[-1][1] else f"steps {text} are"
        out.append(Issue("gap", runs[0][0], f"{what} missing from the ledger"))
    for step in steps:
        counts = by_step[step]
        if any(len(hosts) == n for n, hosts in counts.items()):
            continue
        lacking = "; ".join(f"host slice(s) {_lacking(hosts, n)} of {n}" for n, hosts in sorted(counts.items()))
        out.append(Issue("gap", step, f"step {step}: {lacking} missing from the ledger"))
    return out


def _lacking(hosts: set[int], n: int, shown: int = 8) -> str:
    """The first ``shown`` hosts below ``n`` not in ``hosts`` (each below ``n``), and how many lack."""
    first = itertools.islice((h for h in itertools.count() if h not in hosts), min(shown, n - len(hosts)))
    text = ", ".join(map(str, first))
    return text if n - len(hosts) <= shown else f"{text}, ... ({n - len(hosts)} in all)"
