"""The ledger: one JSON line per step an iterator yields, with the digests of its host slice.

``pipe.iterator(..., ledger=PATH)`` appends, for every step it yields, the line

.. code-block:: json

    {"step": 12, "fingerprint": "...", "process_index": 0, "process_count": 2, "digest_format": 2,
     "rows": [0, 128], "row_digests": ["..."], "leaf_digests": {"batch['tokens']": "..."}}

The first line a writer writes under a fingerprint also holds ``"description"``: the
leaves of the description behind it (:func:`quern.pipeline.identity.changes.leaves`),
so a check against another definition names the first part that differs.
``fingerprint`` is :meth:`~quern.pipeline.definition.dataset.Pipeline.fingerprint_at` of the step
(the definition as it applies to the steps up to that one, so a ledger still
checks the steps before a later edit); ``rows`` are this host's rows of the
global batch, ``row_digests`` and ``leaf_digests`` those of
:mod:`quern.pipeline.integrity.batch_digest`, whose canonical form is version ``digest_format``
(:data:`~quern.pipeline.integrity.batch_digest.FORMAT`: a line of another is refused when read).
With workers, the digests are computed in the
worker processes and travel with the batch; with 0 workers the prefetch thread that
made a chunk of batches digests them together once it has made them
(:func:`quern.pipeline.integrity.digesting.made_of`, while they are in the CPU's cache),
and the iterator keeps each batch's line as it yields it (:meth:`LedgerWriter.add_made`).
The batches of chunks of fewer steps (an iterator's first chunks, the last one of a stream,
one step at a time after a failed chunk) and a batch whose digests raised are hashed as they
are yielded (:meth:`LedgerWriter.add_batch`; the error then names the step), and the lines
of those steps are made together when they are written. ``PATH`` may hold
``{process_index}``. Lines are kept in memory and written every
:data:`FLUSH_LINES` steps or :data:`FLUSH_SECONDS` seconds, at ``state()``,
``close()``, the end of the stream and an error, each write whole lines in one
call (``writev`` of the lines' pieces: the row digests' text is not copied into
one string), so a crash tears at most the last line; a write cut short (a full
disk) raises, and only what it did not write is written with the next; a ledger
opened again for appending (a resumed run) first drops such a torn tail.

Reading and checking ledgers: :mod:`quern.pipeline.integrity.ledger_read`.
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any, Protocol

from ..core.errors import StepError
from ..order.index import host_rows
from .batch_digest import FORMAT
from .digesting import Digesting, Made

__all__ = [
    "FLUSH_LINES",
    "FLUSH_SECONDS",
    "DIGEST",
    "LedgerWriter",
    "first_row",
    "StepFields",
    "step_fields",
]

FLUSH_LINES = 16
"""Lines kept in memory before they are written."""
FLUSH_SECONDS = 2.0
"""Seconds after which kept lines are written at the next step, however few."""
_IOV_MAX = 1024  # pieces one writev takes (POSIX's IOV_MAX on Linux)
DIGEST = "digest"
"""The stage name of the time spent digesting batches for the ledger (in ``it.stats()["stages"]``)."""


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

    def leaves_at(self, step: int) -> dict[str, Any]:
        """The leaves of the description behind :meth:`fingerprint_at`."""


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

    With 0 workers the ledger adds the batches hashed as they are yielded (those whose digests
    were not made with their chunk: :meth:`LedgerWriter.add_batch`) and finishes the fields of the
    steps added together when it writes their lines
    (:class:`quern.pipeline.integrity.digesting.Digesting`).

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
        return [
            f'"rows": [{first}, {first + n}], "row_digests": [{bytes(items).decode()}], "leaf_digests": {leaves}'
            for _, first, n, items, leaves in self.finish_views()
        ]

    def finish_views(self) -> list[tuple[int, int, int, memoryview, str]]:
        """Per step added, in order: ``(step, first row, rows, row digests, leaf digests)``.

        The row digests are the items of their JSON array as ASCII bytes, valid until the next call
        (:meth:`~quern.pipeline.integrity.digesting.Digesting.finish_views`).
        """
        out = []
        for step, (n, items, leaves) in zip(self._steps, self._digesting.finish_views()):
            out.append((step, first_row(self._pipe, step, self._index, self._hosts, n), n, items, leaves))
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
        self._described: str | None = None  # the fingerprint whose description the last line written carried
        hosts = f'"process_index": {int(process_index)}, "process_count": {int(process_count)}'
        self._head = f', {hosts}, "digest_format": {FORMAT}, '
        if pipe.num_steps is None or start_step < pipe.num_steps:
            pipe.fingerprint_at(start_step)
        folder = os.path.dirname(self.path)
        if folder:
            os.makedirs(folder, exist_ok=True)
        self._fd: int | None = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
        self._lock = threading.Lock()
        self._lines: list[bytes | memoryview] = []  # the lines to write, as pieces
        self._views = False  # whether pieces of _lines are views of StepFields' buffer
        self._kept = 0  # the lines in _lines
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
        with self._lock:
            self._make_lines()  # the lines of earlier batches first (their descriptions too)
            self._lines.append(self._line(step, fields))
            self._kept += 1
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

    def add_made(self, step: int, made: Made) -> None:
        """Keep the line of ``step``, whose batch's digests were made where it was made (:func:`~quern.pipeline.integrity.digesting.made_of`).

        Args:
            step: the step about to be yielded.
            made: the digests of this host's batch at ``step``.

        Raises:
            FingerprintError: the pipeline cannot be fingerprinted at ``step``.
            OSError: the lines kept could not be written.
        """
        with self._lock:
            self._make_lines()  # the lines of earlier batches first
            first = first_row(self.pipe, step, *self._hosts, made.rows)
            self._lines += self._pieces(self._start(step), first, *made)
            self._kept += 1
            self._write_if_due()

    def _start(self, step: int) -> str:
        """A line's text before its fields: the step, its fingerprint (and description) and the hosts."""
        fp = self.pipe.fingerprint_at(step)
        described = ""
        if fp != self._described:  # a fingerprint's first line says what it describes
            described = f', "description": {json.dumps(self.pipe.leaves_at(step), sort_keys=False)}'
            self._described = fp
        return f'{{"step": {step}, "fingerprint": "{fp}"{described}{self._head}'

    def _line(self, step: int, fields: str) -> bytes:
        return f"{self._start(step)}{fields}}}\n".encode()

    def _make_lines(self) -> None:
        """The lines of the batches hashed by :meth:`add_batch`, made (all of them together) and kept.

        A line is kept as three pieces, the middle one the row digests' text in the buffer of
        :meth:`StepFields.finish_views` (written as it is: no copy of it, no joined text); pieces of
        that buffer still kept from before are copied first, as the buffer is written again.
        """
        if not self._hashed:
            return
        described = self._described
        try:  # the lines' starts first: an error here (a fingerprint) leaves every step kept
            starts = [self._start(step) for step in self._hashed]
        except BaseException:
            self._described = described
            raise
        if self._views:
            self._lines = [bytes(p) for p in self._lines]
        self._views, self._hashed = True, []
        for start, (_, first, n, items, leaves) in zip(starts, self._fields.finish_views()):
            self._lines += self._pieces(start, first, n, items, leaves)
            self._kept += 1

    @staticmethod
    def _pieces(start: str, first: int, n: int, items: memoryview, leaves: str) -> list[bytes | memoryview]:
        """A line as three pieces, the middle one its row digests' text as it is (no copy)."""
        head = f'{start}"rows": [{first}, {first + n}], "row_digests": ['
        return [head.encode(), items, f'], "leaf_digests": {leaves}}}\n'.encode()]

    def _write_if_due(self) -> None:
        if self._kept + len(self._hashed) >= FLUSH_LINES or time.monotonic() - self._since >= FLUSH_SECONDS:
            self._write()

    def flush(self) -> None:
        """Write the lines kept (no ``fsync``: the page cache survives a crash of the process).

        Raises:
            OSError: they could not be written.
        """
        with self._lock:
            self._write()

    def _write(self) -> None:
        """Write the pieces kept, a call (``writev``) per up to 1,024, each taking what the last left.

        What a failed call did not write stays kept (as copies), and is written with the next.
        """
        self._make_lines()
        self._since = time.monotonic()
        if not self._lines or self._fd is None:
            return
        pieces: list[Any] = self._lines
        try:
            while pieces:
                done = os.writev(self._fd, pieces[:_IOV_MAX])
                k = 0
                while k < len(pieces) and done >= len(pieces[k]):
                    done -= len(pieces[k])
                    k += 1
                pieces = pieces[k:]
                if done:
                    pieces[0] = memoryview(pieces[0])[done:]
        except BaseException:
            self._lines = [bytes(p) for p in pieces]
            self._views = False
            raise
        self._lines, self._views, self._kept = [], False, 0

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
            self._lines, self._views, self._kept = [], False, 0
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
