"""Reading ledgers (:mod:`quern.pipeline.integrity.ledger` writes them): the lines of all hosts of a run, merged.

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
from collections.abc import Iterable
from typing import Any, NamedTuple

from ..order.index import MAX_RECORDS
from .batch_digest import check_format

__all__ = ["Entry", "Issue", "Ledger", "STEP_LIMIT", "expand_paths", "find_gaps", "read_ledger"]

STEP_LIMIT = MAX_RECORDS
"""No pipeline has a step or host count at or past it (``2**62``: stream positions stay below it)."""

_KEYS = ("step", "fingerprint", "process_index", "process_count", "rows", "row_digests", "leaf_digests")


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
    description: dict[str, Any] | None = None
    """The leaves of the description behind the fingerprint, on the first line of a fingerprint."""

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
    described = obj.get("description")
    return Entry(
        step, fp, h, n, rows[0], rows[1], raw, leaves, file, line, described if isinstance(described, dict) else None
    )


def described(ledger: Ledger, fingerprint: str) -> dict[str, Any] | None:
    """The description leaves a ledger holds for ``fingerprint`` (on the first line a writer wrote under it)."""
    for e in [*ledger.entries.values(), *ledger.superseded]:
        if e.fingerprint == fingerprint and e.description is not None:
            return e.description
    return None


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
