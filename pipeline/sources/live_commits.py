"""What a live stream's commit record means in entries, and which commits may change it.

The record of a commit group is a Redis hash beside the stream (``KEY:quern:commit:GROUP``):

- ``steps``: the *step map*, ``"B W S"``: step ``s`` is the entries at positions
  ``[s*B, (s+1)*B)``, permuted within windows of ``W`` whole steps with seed ``S``
  (``W = 0``: log order, and ``S = 0``). With it a committed step names entries: every entry
  before :meth:`StepMap.position` of the step was trained (:class:`StepMap`);
- ``count`` and ``run``: the hosts of the run the record belongs to, and that run's number;
- ``base``: the step that run took the record over at (a host not heard from yet counts as
  having committed it, and no host counts below it);
- ``h0``, ``h1``, ...: the step each host committed (the step after the last one it trained).

The committed step is the smallest host's (:attr:`CommitRecord.done`). A run takes the record
over (a new ``run`` number, ``base`` its start step) only with its first commit, and only when
it resumed where the record stands (:func:`continues`): a commit of a run on another host count,
step map or run number is ignored (:class:`~quern.pipeline.sources.RedisStreamSource` warns), so
the committed position never goes back. A resume whose step map differs from the record's must
start at the step that begins exactly at the first untrained entry (:func:`resume_step`), or it
is refused (:func:`refusal`).

A committed position names entries only in the same stream: :func:`entry_digest` and
:func:`parse_id` are what :class:`~quern.pipeline.sources.RedisStreamSource` identifies
entries (its origin and anchors) by.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import warnings
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

from ..core.errors import SourceError

__all__ = [
    "COMMIT",
    "TAKE",
    "CommitRecord",
    "RecordHolder",
    "Run",
    "StepMap",
    "anchor_member",
    "begin",
    "commit",
    "committed",
    "continues",
    "entry_digest",
    "parse_id",
    "read",
    "refusal",
    "resume_step",
]

_T = TypeVar("_T")

COMMIT = """
local r = redis.call('HMGET', KEYS[1], 'count', 'steps', 'run', 'base')
if not r[1] then return {'none'} end
if not r[3] then
  redis.call('HSET', KEYS[1], 'run', '0', 'steps', '')
  redis.call('HINCRBY', KEYS[1], 'ver', 1)
  r[2], r[3] = '', '0'
end
if tonumber(r[1]) ~= tonumber(ARGV[2]) or (ARGV[3] ~= '' and r[2] ~= '' and r[2] ~= ARGV[3])
    or (ARGV[4] ~= '' and r[3] ~= ARGV[4])
    or (ARGV[4] == '' and ARGV[6] ~= '' and tonumber(ARGV[6]) < tonumber(r[4] or '0')) then
  return {'other'}
end
if r[2] == '' and ARGV[3] ~= '' then redis.call('HSET', KEYS[1], 'steps', ARGV[3]) end
local field = 'h' .. ARGV[1]
local old = tonumber(redis.call('HGET', KEYS[1], field) or '-1')
if tonumber(ARGV[5]) > old then
  redis.call('HSET', KEYS[1], field, ARGV[5])
  redis.call('HINCRBY', KEYS[1], 'ver', 1)
end
return {'ok', r[3]}
"""
"""Host ``ARGV[1]`` of ``ARGV[2]`` (step map ``ARGV[3]``, run ``ARGV[4]``; ``''``: any) committed step
``ARGV[5]`` (atomic): ``{'ok', run}``; ``{'none'}`` without a record; ``{'other'}`` when the record
belongs to another host count, step map or run, or when a host's first commit (no run yet) comes
from an iterator that started (``ARGV[6]``) before the record's ``base``: it joins a run only if
it started where that run did or later. Every change adds 1 to the record's ``ver``. A record of
an older quern (no ``run``) becomes run 0 of an unknown step map, which the next commit's map fills in."""

TAKE = """
local exists = redis.call('EXISTS', KEYS[1]) == 1
local ver = redis.call('HGET', KEYS[1], 'ver') or '0'
if (ARGV[3] == '' and exists) or (ARGV[3] ~= '' and (not exists or ver ~= ARGV[3])) then return {'moved'} end
local new = tostring((tonumber(redis.call('HGET', KEYS[1], 'run') or '0') or 0) + 1)
redis.call('DEL', KEYS[1])
redis.call('HSET', KEYS[1], 'count', ARGV[1], 'steps', ARGV[2], 'run', new, 'base', ARGV[4],
  'h' .. ARGV[5], ARGV[6], 'ver', tostring(tonumber(ver) + 1))
return {'ok', new}
"""
"""A run on ``ARGV[1]`` hosts with step map ``ARGV[2]`` takes the record over at step ``ARGV[4]``, with
host ``ARGV[5]``'s commit of ``ARGV[6]``, if the record is still at version ``ARGV[3]`` (``''``: none),
the one the decision to take it was made on: ``{'ok', run}``, or ``{'moved'}`` when any commit changed
it meanwhile (read it again)."""


# -- the entries positions name (the source's identity checks, beside the record) --------------------------


def anchor_member(member: bytes) -> tuple[bytes, str | None]:
    """``(ID, digest)`` of a member of the anchors' sorted set (``ID DIGEST``; an older quern's: ``ID``)."""
    entry_id, _, digest = member.partition(b" ")
    return entry_id, (digest.decode() or None)


def parse_id(entry_id: bytes | str) -> tuple[int, int]:
    """A stream entry ID as ``(milliseconds, sequence)``, the order Redis keeps.

    Args:
        entry_id: ``b"1700000000000-3"``.

    Returns:
        The two numbers.

    Example:
        >>> parse_id(b"17-3") < parse_id("17-10")
        True
    """
    text = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    ms, _, seq = text.partition("-")
    return int(ms), int(seq or 0)


def entry_digest(fields: dict) -> str:
    """The content of an entry: BLAKE2b of its field names and values, in the stream's order.

    Args:
        fields: ``{name: value}`` (bytes) as redis-py gives an entry.

    Returns:
        24 hex digits.
    """
    h = hashlib.blake2b(digest_size=12)
    for k, v in fields.items():
        for part in (k, v):
            part = part if isinstance(part, bytes) else str(part).encode()
            h.update(len(part).to_bytes(8, "little"))
            h.update(part)
    return h.hexdigest()


@dataclasses.dataclass(frozen=True)
class StepMap:
    """How a live pipeline maps steps to stream positions.

    Attributes:
        batch: the global batch size ``B``.
        window: ``W`` of ``shuffle("steps", steps=W)``; 0 for log order.
        seed: the window shuffle's seed (0 without a window).
    """

    batch: int
    window: int = 0
    seed: int = 0

    def text(self) -> str:
        """``"B W S"``, as the record keeps it."""
        return f"{self.batch} {self.window} {self.seed}"

    @staticmethod
    def parse(text: str) -> StepMap | None:
        """The map a record keeps (``None`` for ``""``: a record of an older quern)."""
        parts = text.split()
        return StepMap(*map(int, parts)) if len(parts) == 3 else None

    def unit(self) -> int:
        """The positions of one window (of one step in log order): what a resume must start on."""
        return self.batch * max(self.window, 1)

    def whole(self, step: int) -> bool:
        """Whether the steps before ``step`` are exactly the positions before :meth:`position`."""
        return self.window == 0 or step % self.window == 0

    def position(self, step: int) -> int:
        """Every entry before this position is in a step before ``step`` (its window's first position)."""
        return (step - (step % self.window if self.window else 0)) * self.batch

    def __str__(self) -> str:
        """``batch size 4``, and the window (``shuffled within windows of 8 steps, seed 5``)."""
        out = f"batch size {self.batch}"
        return out + (f" shuffled within windows of {self.window} steps (seed {self.seed})" if self.window else "")

    def changes(self, old: StepMap) -> str:
        """What differs from ``old``: ``batch size 8 (was 4), a window of 8 steps (was 4)``."""

        def window(m: StepMap) -> str:
            return f"{m.window}" if m.window else "none"

        out = []
        if self.batch != old.batch:
            out.append(f"batch size {self.batch} (was {old.batch})")
        if self.window != old.window:
            out.append(f"{f'a window of {self.window} steps' if self.window else 'no window'} (was {window(old)})")
        elif self.seed != old.seed:
            out.append(f"window seed {self.seed} (was {old.seed})")
        return ", ".join(out)


@dataclasses.dataclass(frozen=True)
class CommitRecord:
    """A commit group's record, as read (see the module's text).

    Attributes:
        count: the hosts of the run it belongs to.
        steps: its step map (``None``: kept by an older quern, unknown).
        run: the run's number.
        base: the step the run took it over at.
        hosts: the step each host committed (those heard from).
        version: how many times it changed (``ver``): a take-over is made on the version it read.
    """

    count: int
    steps: StepMap | None
    run: int
    base: int
    hosts: dict[int, int]
    version: int = 0

    @staticmethod
    def parse(fields: dict) -> CommitRecord | None:
        """The record of ``HGETALL`` (``None`` when empty)."""
        if not fields:
            return None
        got = {
            (k.decode() if isinstance(k, bytes) else k): (v.decode() if isinstance(v, bytes) else v)
            for k, v in fields.items()
        }
        hosts = {int(k[1:]): int(v) for k, v in got.items() if k[:1] == "h" and k[1:].isdigit()}
        steps = StepMap.parse(got.get("steps", ""))
        number, base, version = (int(got.get(k, 0)) for k in ("run", "base", "ver"))
        return CommitRecord(int(got.get("count", 0)), steps, number, base, hosts, version)

    @property
    def done(self) -> int:
        """The committed step: the smallest step of every host (one not heard from: ``base``)."""
        return min((max(self.hosts.get(i, self.base), self.base) for i in range(self.count)), default=self.base)

    @property
    def position(self) -> int | None:
        """Every entry before this position was trained (``None``: an older record, its map unknown)."""
        return None if self.steps is None else self.steps.position(self.done)

    def trained(self) -> str:
        """What the committed step means in entries, for messages."""
        done, steps = self.done, self.steps
        if steps is None:
            return f"step {done} was trained (by a run whose batch size is not recorded)"
        out = f"step {done} of {steps} was trained: every entry before position {steps.position(done)}"
        if not steps.whole(done):
            first = done - done % steps.window
            span = steps.unit()
            at = steps.position(done)
            out += (
                f", and {(done - first) * steps.batch} of the {span} entries at positions [{at}, {at + span}) "
                f"(steps {first}-{done - 1} of the window of steps {first}-{first + steps.window - 1})"
            )
        return out


def resume_step(record: CommitRecord | None, steps: StepMap) -> int | None:
    """The step of ``steps`` that begins exactly at the record's first untrained entry.

    Args:
        record: the record (``None``: no commit yet).
        steps: the resuming pipeline's step map.

    Returns:
        The record's step when the maps agree (or the record's is unknown), 0 before any commit,
        ``None`` when no step of ``steps`` begins there (its trained entries are not a prefix of
        the stream, or their end is not a step, or window, boundary of ``steps``).
    """
    if record is None or record.steps is None or record.steps == steps:
        return 0 if record is None else record.done
    done = record.done
    if done == 0:
        return 0
    if not record.steps.whole(done) or record.steps.position(done) % steps.unit():
        return None
    return record.steps.position(done) // steps.batch


def refusal(record: CommitRecord | None, steps: StepMap, start: int | None, what: str) -> str | None:
    """Why a pipeline of ``steps`` may not resume the record at ``start`` (``None``: it may).

    A pipeline with the record's step map may start anywhere (an older checkpoint, say), and so
    may any before a commit; one with another map only at :func:`resume_step`.

    Args:
        record: the record (``None``: no commit yet).
        steps: the resuming pipeline's step map.
        start: its start step (``None``: asked for the step to resume at, by ``committed(pipe)``).
        what: the record's name, for the message.

    Returns:
        The message, naming what changed, the committed position and the step that continues.
    """
    if record is None or record.steps is None or record.steps == steps or record.done == 0:
        return None  # the same map, or nothing committed: any start
    step = resume_step(record, steps)
    if step is not None and step == start:
        return None
    old = record.steps
    out = f"{what} says {record.trained()}; this pipeline has {steps.changes(old)}"
    if step is not None:
        if start is None:
            return None
        at = old.position(record.done)
        there = steps.position(start)
        if steps.whole(start):
            where = f"its step {start} begins at position {there}, not at {at}"
        else:  # the window's positions are shuffled together: a step inside it begins nowhere
            first = start - start % steps.window
            where = (
                f"its step {start} is not the first of its window of steps {first}-{first + steps.window - 1} "
                f"(positions [{there}, {there + steps.unit()}) shuffled together)"
            )
        return (
            f"{out}, so {where}: entries would be {'repeated' if there < at else 'lost'}. Resume at its "
            f"step {step} (start_step=src.committed(pipe)), which begins at position {at}"
        )
    if not old.whole(record.done):
        reason = f"the trained entries end inside a window of {old.window} steps"
    else:
        reason = f"position {old.position(record.done)} is not a multiple of its {steps.unit()} entries per window"
        if not steps.window:
            reason = f"position {old.position(record.done)} is not a multiple of its batch size {steps.batch}"
    common = math.lcm(old.unit(), steps.unit())
    until = -(-record.done * old.batch // common) * common // old.batch  # the first step of both maps' boundaries
    return (
        f"{out}: no step of it begins exactly after the trained entries ({reason}). Resume with the record's "
        f"{old} until step {until} (position {until * old.batch}) and commit there before changing it, or use "
        "another commit group (group=) for a new record"
    )


def continues(record: CommitRecord, steps: StepMap | None, start: int) -> bool:
    """Whether a run that started at ``start`` (map ``steps``) resumed where ``record`` stands.

    Only such a run's first commit takes the record over: a late commit of an older run (which
    started before the record's committed step) does not.
    """
    if steps is None or record.steps is None or record.steps == steps or record.done == 0:
        return start >= record.done
    return resume_step(record, steps) == start


@dataclasses.dataclass
class Run:
    """An iterator's commits (each iterator has its own).

    Attributes:
        start: the step it started at.
        steps: its step map.
        seen: the record's run number when it started (0: no record): it may take over only that
            run's record, never one a later run took over meanwhile (it is older than that run).
        number: the record's run it joined or took over with its first commit (``None``: none yet).
    """

    start: int
    steps: StepMap
    seen: int = 0
    number: int | None = None


class RecordHolder(Protocol):
    """What the functions below need of a source that keeps its commit record in Redis."""

    name: str
    url: str

    def _call(self, what: str, fn: Callable[[Any], _T], *, retry: bool = True) -> _T: ...

    def _keys(self) -> tuple[str, str, str]: ...


def _eval(src: RecordHolder, what: str, script: str, *args: int | str) -> list:
    """``EVAL script 1 RECORD *args`` (retried as every call of the source)."""
    key = src._keys()[2]
    return src._call(what, lambda c: c.eval(script, 1, key, *args))


def _what(src: RecordHolder) -> str:
    return f"the commit record {src._keys()[2]!r}"


def read(src: RecordHolder) -> CommitRecord | None:
    """The source's commit record as it is now (``None`` before any commit)."""
    key = src._keys()[2]
    return CommitRecord.parse(src._call("HGETALL", lambda c: c.hgetall(key)))


def begin(src: RecordHolder, steps: StepMap, start: int) -> Run:
    """The run of an iterator that starts at ``start`` with ``steps``, checked against the record.

    Raises:
        ValueError: the start would lose or repeat entries (:func:`refusal`).
    """
    record = read(src)
    why = refusal(record, steps, start, _what(src))
    if why is not None:
        raise ValueError(f"RedisStreamSource {src.name!r}: resuming at step {start} refused: {why}")
    return Run(start, steps, 0 if record is None else record.run)


def commit(src: RecordHolder, run: Run | None, step: int, i: int, n: int) -> bool:
    """Host ``i`` of ``n`` (of ``run``; ``None``: a commit outside an iterator) committed ``step``.

    The commit joins the record when it belongs to this host count and step map (and to the run
    this iterator joined, or, before its first commit, to a run that started where this iterator
    did or before). Otherwise this iterator's first commit takes the record over, atomically with
    the record it decided on (its version), and only when the record is still the run this
    iterator saw when it started and it resumed where that run stands (:func:`continues`). A
    record a peer of the same run took over meanwhile is joined, never taken over again.

    Returns:
        Whether the record took it; ``False`` (with a ``UserWarning``) when it belongs to another
        host count, step map or run, or this run did not resume where it stands.
    """
    steps = "" if run is None else run.steps.text()
    for _ in range(16):  # a record that changes under each try: other runs commit at once
        number = "" if run is None or run.number is None else str(run.number)
        start = "" if run is None else run.start
        got = _eval(src, "EVAL commit", COMMIT, i, n, steps, number, step, start)
        if got[0] == b"ok":
            if run is not None:
                run.number = int(got[1])
            return True
        record = read(src) if got[0] == b"other" else None
        if record is not None and _joins(record, run, n):
            continue  # changed since the COMMIT (a peer of this run took it over): join it
        if got[0] == b"other" and record is None:
            continue  # deleted since the COMMIT
        if record is not None and (
            run is None
            or run.number is not None
            or record.run != run.seen
            or not continues(record, run.steps, run.start)
        ):
            warnings.warn(_ignored(src, step, i, n, run, record), stacklevel=5)  # it.commit's caller
            return False
        expect = "" if record is None else str(record.version)  # none yet, or the record decided on
        base = 0 if record is None or run is None else resume_step(record, run.steps) or 0
        took = _eval(src, "EVAL take", TAKE, n, steps, expect, base, i, step)
        if took[0] == b"ok":
            if run is not None:
                run.number = int(took[1])
            return True
    raise SourceError(f"RedisStreamSource: {_what(src)} at {src.url} changed under each of 16 commits")


def _joins(record: CommitRecord, run: Run | None, n: int) -> bool:
    """Whether COMMIT would now take a commit of ``run`` on ``n`` hosts (as its script decides)."""
    if record.count != n or (run is not None and record.steps not in (None, run.steps)):
        return False
    return run is None or (record.run == run.number if run.number is not None else run.start >= record.base)


def _ignored(src: RecordHolder, step: int, i: int, n: int, run: Run | None, record: CommitRecord) -> str:
    """Why a commit was ignored."""
    if record.count != n or (run is not None and record.steps not in (None, run.steps)):
        hosts = f"{record.count} host{'s' if record.count != 1 else ''}"
        why = f"{_what(src)} belongs to a run on {hosts} with {record.steps or 'its own batch size'}"
    else:
        why = f"a later run took {_what(src)} over (its run {record.run})"
    if run is None:
        why += "; a commit made outside an iterator never takes a record over"
    elif run.number is None and record.run != run.seen:
        why += f", which is later than this iterator (it started when the record was run {run.seen})"
    elif run.number is None:
        why += f", and this iterator started at step {run.start}, not where the record stands"
    return f"RedisStreamSource {src.name!r}: commit({step}) of host {i} of {n} ignored: {why}: committed() stays {record.done}"


def committed(src: RecordHolder, pipe: Any) -> int:
    """The step to resume at: of the record's step map (``pipe`` ``None``), or of ``pipe``'s.

    Raises:
        ValueError: no step of ``pipe`` begins at the first untrained entry, or ``pipe`` reads
            another stream.
    """
    record = read(src)
    if pipe is None:
        return 0 if record is None else record.done
    key = src._keys()[2].rsplit(":quern:", 1)[0]
    if not hasattr(pipe.stream, "step_map") or getattr(pipe.stream.source, "key", None) != key:
        raise ValueError(f"committed(pipe): the pipeline does not read the live stream {key!r}")
    steps = pipe.stream.step_map(pipe)
    step = resume_step(record, steps)
    if step is None:
        raise ValueError(f"RedisStreamSource {src.name!r}: {refusal(record, steps, None, _what(src))}")
    return step
