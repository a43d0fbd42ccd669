"""A live stream over Redis Streams: record ``p`` is the entry at stream position ``p``, in ID order.

A position counts the entries added to the stream since it was created (Redis
7's ``entries-added``), so trimming never renumbers an entry: the first entry
the stream still holds is at ``entries-added - length``. Entries deleted from
the middle (``XDEL``) would make positions uncountable: the source refuses to
read past such a hole. Reading positions ``[a, b)`` finds the ID of an entry
at or before ``a`` (an *anchor*: one this process read, one kept beside the stream
every :data:`ANCHOR_EVERY` positions, or the stream's first entry) and reads on
from it with ``XRANGE`` in one transaction with ``XINFO STREAM``; entries that do
not exist yet are waited for with ``XREAD BLOCK``.

Beside the stream ``KEY``, the source keeps (plain Redis keys):

- ``KEY:quern:origin``: the position, ID and content digest (:func:`entry_digest`)
  of the first entry the source ever saw, set once; the source's identity is the
  key and this entry (the ID at position 0 for a stream read from its start);
- ``KEY:quern:anchors``: a sorted set of entries by position, each ``ID DIGEST``: a
  process keeps one in each block of ANCHOR_EVERY positions it reads (one ``ZADD`` a block);
- ``KEY:quern:commit:GROUP``: the commit record (:mod:`.live_commits`).

A stream deleted and recreated under the key is refused when: at open, its origin is not the
first entry at its position (another ID, an entry before it, other fields) or its newest kept
anchor is missing or holds other fields; at a read, the anchor the read starts from is missing
or holds other fields, the entries after it are not as many as the positions say, the origin is
not the first entry at its position, or fewer entries were ever added than before. Entries
between anchors are not compared: one recreated with the same IDs, origin entry and count,
differing only in entries no read starts from, is not detected.

The pipeline side (steps of ``B`` positions, the commit after the step) is
:mod:`quern.pipeline.streams.live`.
"""

from __future__ import annotations

import bisect
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import numpy as np

from ..core.errors import EntriesTimeoutError, SourceError
from . import live_commits, waiting
from .base import Source
from .live_commits import CommitRecord, Run, StepMap, anchor_member, entry_digest, parse_id

__all__ = ["ANCHOR_EVERY", "RedisStreamSource", "entry_digest", "parse_id"]

ANCHOR_EVERY = 1024
"""A source keeps an anchor beside the stream in each block of this many positions it reads."""
_MOST = 16384  # entries one XRANGE asks for
_T = TypeVar("_T")
_Anchor = tuple[int, bytes, str | None]
"""An entry known to be at a position: ``(position, ID, digest)`` (``None``: its fields unknown)."""


def _set_once(key: str, value: str) -> Callable[[Any], Any]:
    """``SET key value NX`` as a call of a client."""
    return lambda c: c.set(key, value, nx=True)


def _field(info: dict, name: str) -> Any:
    """An ``XINFO STREAM`` field, whichever way redis-py gives its names."""
    return info[name] if name in info else info.get(name.encode())


class RedisStreamSource(Source):
    """A live stream of Redis Streams entries; record ``p`` is the entry at position ``p``, as ``{field: bytes}``.

    ``Pipeline.from_source(RedisStreamSource(...)).batch(B)`` makes a live pipeline:
    step ``s`` is the entries at positions ``[s*B, (s+1)*B)`` of the stream in ID order,
    so a step is a function of the log, and a restarted trainer resumes with
    ``pipe.iterator(start_step=src.committed(pipe))``. Entries that do not exist yet are
    waited for, at most ``timeout`` seconds from when the consumer asks for the step
    (``batch_at``, ``next``): prefetching never times out by itself. Positions count
    entries since the stream was created, so trimming never renumbers them; a step
    whose entries were trimmed away is an error naming its first missing position.

    **Delivery.** ``it.commit(step)`` records in Redis that every step before ``step``
    was trained by this host, with the batch size and window that map steps to entries
    (:meth:`committed` is the smallest step all hosts of the run committed, and never
    goes back), and a restart at :meth:`committed` gets exactly the steps after it
    again, with the same bytes; a restart with another batch size or window continues
    at the first untrained entry, or is refused. Training is exactly-once when
    ``commit`` follows a *durable checkpoint* that includes the step: a process killed between reading and
    committing replays those steps, none is lost or seen twice by the model that is
    restored. Committing after the optimizer step alone loses the steps between the
    last checkpoint and the commit if the model is restored from that checkpoint.

    A Redis server that goes away (killed, restarted) is retried with backoff for
    ``retry_seconds``; then the read fails naming the URL. One that cannot be reached
    when the source opens is an error at once (a wrong URL). A stream deleted and
    created again under the same key is refused, at open and at a read, when its origin
    entry is not the first at its position, or an anchor (one kept every 1,024 positions read)
    has another ID or other fields (the module's text says exactly what is compared).

    Args:
        url: the Redis server, ``redis://HOST:PORT/DB`` (what ``redis.Redis.from_url`` takes).
        key: the stream's key.
        group: the name of the commit record (not a Redis consumer group: every host reads
            the same entries, and nothing is acknowledged).
        timeout: seconds a consumer waits for a step's entries (and the source, at open, for
            a stream that does not exist yet).
        name: the source's name (default: ``key``).
        retry_seconds: how long a server that cannot be reached (once the source is open) is retried.

    Raises:
        SourceError: the server cannot be reached, ``key`` holds something other than a
            stream, or entries were deleted from the middle of the stream.
        TimeoutError: no stream ``key`` exists after ``timeout`` seconds.
        ImportError: redis-py is missing (``pip install 'quern[redis]'``).

    Attributes:
        url: the server.
        key: the stream.
        group: the commit record's name.
        timeout: the consumer's wait.
        origin: ``(position, ID)`` of the first entry the source ever saw.
        origin_digest: that entry's content digest (``entry_digest``; ``""``: kept by an older quern).
    """

    STREAM = "live"
    """The kind of stream ``Pipeline.from_source`` makes of this source."""
    BLOCK_SECONDS = 1.0
    """How long one ``XREAD BLOCK`` waits before the waiting read looks at its deadline again."""

    def __init__(
        self,
        url: str,
        key: str,
        *,
        group: str = "quern",
        timeout: float = 60.0,
        name: str | None = None,
        retry_seconds: float = 30.0,
    ) -> None:
        import redis  # noqa: F401 (a clear ImportError at construction)

        if not isinstance(key, str) or not key:
            raise ValueError(f"RedisStreamSource: key must be a non-empty str, got {key!r}")
        if not isinstance(group, str) or not group:
            raise ValueError(f"RedisStreamSource: group must be a non-empty str, got {group!r}")
        if not timeout > 0:
            raise ValueError(f"RedisStreamSource: timeout must be > 0 seconds, got {timeout!r}")
        self.url, self.key, self.group = url, key, group
        self.timeout, self.retry_seconds = float(timeout), float(retry_seconds)
        self.name = name or key
        self._state()
        self.origin, self.origin_digest = self._find_origin()

    # -- connection ----------------------------------------------------------------------------------------

    def _state(self) -> None:
        self._client: Any = None
        self._lock = threading.Lock()
        self._anchors: list[_Anchor] = []  # (position, ID, digest), sorted: entries this process saw
        self._added = 0  # the most entries-added seen: it never goes down in the same stream
        self._kept: set[int] = set()  # blocks of ANCHOR_EVERY positions this process kept an anchor of
        origin = getattr(self, "origin", None)
        if origin is not None:
            self._anchors.append((origin[0], origin[1].encode(), self.origin_digest or None))

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        for k in ("_client", "_lock", "_anchors", "_added", "_kept"):
            state.pop(k, None)
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._state()

    def _redis(self) -> Any:
        with self._lock:
            return self._client or self._connect()

    def _connect(self) -> Any:
        if self._client is None:
            import redis
            from redis.backoff import NoBackoff
            from redis.retry import Retry

            try:  # no retries of its own (they would hide a restart): ours, with backoff (_call)
                self._client = redis.Redis.from_url(
                    self.url,
                    protocol=2,
                    decode_responses=False,
                    socket_timeout=self.BLOCK_SECONDS + 10,
                    socket_connect_timeout=5,
                    retry=Retry(NoBackoff(), 0),
                )
            except ValueError as e:
                raise SourceError(f"RedisStreamSource: bad Redis URL {self.url!r}: {e}") from e
        return self._client

    def _call(self, what: str, fn: Callable[[Any], _T], *, retry: bool = True) -> _T:
        """``fn(client)``, retried with backoff while the server cannot be reached (``retry_seconds``).

        Without ``retry`` (opening the source), a server that cannot be reached fails at once: a
        wrong URL is an error now, not after ``retry_seconds``.
        """
        import redis

        until, delay = time.monotonic() + self.retry_seconds, 0.05
        while True:
            try:
                return fn(self._redis())
            except redis.ResponseError as e:
                if str(e).startswith("WRONGTYPE"):
                    raise SourceError(
                        f"RedisStreamSource: key {self.key!r} at {self.url} does not hold a stream: {e}"
                    ) from e
                raise SourceError(f"RedisStreamSource: {what} on {self.key!r} at {self.url} failed: {e}") from e
            except (redis.ConnectionError, redis.TimeoutError) as e:
                left = until - time.monotonic()
                if not retry or left <= 0:
                    tried = f"for {self.retry_seconds:g} s" if retry else "when the source opened"
                    raise SourceError(
                        f"RedisStreamSource: cannot reach Redis at {self.url} ({what} on {self.key!r}) {tried}: "
                        f"{type(e).__name__}: {e}"
                    ) from e
                if waiting.gave_up():
                    raise RuntimeError("the iterator reading ahead was closed") from e
                time.sleep(min(delay, left))  # and one more try at the deadline
                delay = min(2 * delay, 2.0)

    def _keys(self) -> tuple[str, str, str]:
        k = self.key
        return f"{k}:quern:origin", f"{k}:quern:anchors", f"{k}:quern:commit:{self.group}"

    # -- where positions are ---------------------------------------------------------------------------------

    def _info(self, client: Any) -> dict | None:
        import redis

        try:
            return client.xinfo_stream(self.key)
        except redis.ResponseError as e:
            if "no such key" in str(e):
                return None
            raise

    def _head(self, info: dict) -> tuple[int, bytes | None, int]:
        """``(position of the first entry held, its ID, entries added)``, refusing a stream with a hole."""
        length, added = int(_field(info, "length")), int(_field(info, "entries-added"))
        first = _field(info, "first-entry")
        deleted = _field(info, "max-deleted-entry-id") or b"0-0"
        held = _field(info, "recorded-first-entry-id") or b"0-0"
        if length and parse_id(deleted) != (0, 0) and parse_id(deleted) >= parse_id(held):
            raise SourceError(
                f"RedisStreamSource: entries of {self.key!r} at {self.url} were deleted from the middle of the stream "
                f"(XDEL of {deleted!r}): stream positions can no longer be counted; trim the stream from its start "
                "(XTRIM) instead"
            )
        return added - length, (first[0] if first else None), added

    def _find_origin(self) -> tuple[tuple[int, str], str]:
        """The first entry the source ever saw and its digest, as kept beside the stream (set now if missing)."""
        origin_key, anchors_key, _ = self._keys()
        deadline = time.monotonic() + self.timeout
        first_contact: bool | None = None  # the first command: a server that cannot be reached fails at once
        while True:
            kept = self._call("GET origin", lambda c: c.get(origin_key), retry=first_contact is not None)
            first_contact = False
            if kept is not None:
                pos_text, id_text, digest = (kept.decode().split(" ") + [""])[:3]
                origin = (int(pos_text), id_text)
                self._check_origin((*origin, digest))
                self._anchors = [(origin[0], origin[1].encode(), digest or None)]
                return origin, digest
            info = self._call("XINFO STREAM", self._info)
            if info is not None:
                pos, first, _ = self._head(info)
                if first is not None:
                    digest = entry_digest(_field(info, "first-entry")[1])
                    self._call("SET origin", _set_once(origin_key, f"{pos} {first.decode()} {digest}"))
                    continue  # read back what was kept (another process may have been first)
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"RedisStreamSource: no entries in stream {self.key!r} at {self.url} after {self.timeout:g} s "
                    "(it does not exist yet, or is empty): check the key, or start the producer first"
                )
            self._call("XREAD", lambda c: c.xread({self.key: b"0-0"}, count=1, block=int(self.BLOCK_SECONDS * 1000)))

    def _check_origin(self, origin: tuple[int, str, str]) -> None:
        """Refuse a stream recreated under the same key.

        Its origin entry, or the newest anchor kept beside it, is not where it was, or holds other fields.
        """
        info = self._call("XINFO STREAM", self._info)
        if info is None:
            raise SourceError(
                f"RedisStreamSource: stream {self.key!r} at {self.url} no longer exists, but its origin "
                f"{origin[1]!r} (position {origin[0]}) is kept beside it: it was deleted; delete {self._keys()[0]!r} "
                "too to start a new stream"
            )
        pos, first, added = self._head(info)
        why = f"it has added {added} entries" if added <= origin[0] else None
        if why is None and pos <= origin[0] and (pos, first) != (origin[0], origin[1].encode()):
            why = f"its first entry is {first!r} at position {pos}"  # entries before the origin: shifted
        _, anchors_key, _ = self._keys()
        newest = self._call("ZREVRANGE", lambda c: c.zrevrange(anchors_key, 0, 0, withscores=True))
        kept = [(origin[0], origin[1].encode(), origin[2] or None)]
        kept += [(int(score), *anchor_member(member)) for member, score in newest]
        for at, entry_id, digest in kept:
            if why is None and pos <= at < added:  # still held: the entry must be there, with its fields
                got = self._call("XRANGE", self._one(entry_id))
                if not got:
                    why = f"no entry {entry_id.decode()!r} at position {at}"
                elif digest is not None and entry_digest(got[0][1]) != digest:
                    why = f"entry {entry_id.decode()!r} at position {at} holds other fields"
        if why is not None:
            raise SourceError(
                f"RedisStreamSource: stream {self.key!r} at {self.url} is not the stream whose position "
                f"{origin[0]} was entry {origin[1]!r} ({why}: recreated?); delete its {self.key}:quern:* keys to "
                "start anew"
            )

    def _one(self, entry_id: bytes) -> Callable[[Any], list]:
        """``XRANGE`` of the one entry ``entry_id`` (``[]``: none), as a call of a client."""
        return lambda c: c.xrange(self.key, entry_id, entry_id, count=1)

    def _anchor_before(self, position: int) -> _Anchor | None:
        """The nearest known entry at or before ``position``: this process's, else one kept beside the stream."""
        with self._lock:
            k = bisect.bisect_left(self._anchors, (position + 1,))
            local = self._anchors[k - 1] if k else None
        if local is not None and position - local[0] <= ANCHOR_EVERY:
            return local
        _, anchors_key, _ = self._keys()
        got = self._call(
            "ZREVRANGEBYSCORE",
            lambda c: c.zrevrangebyscore(anchors_key, position, "-inf", start=0, num=1, withscores=True),
        )
        if got and (local is None or int(got[0][1]) > local[0]):
            return (int(got[0][1]), *anchor_member(got[0][0]))
        return local

    def _learn(self, position: int, entry_id: bytes, fields: dict) -> None:
        """Remember entry ``entry_id`` at ``position`` and its digest.

        Here, and beside the stream every ANCHOR_EVERY positions.
        """
        with self._lock:
            k = bisect.bisect_left(self._anchors, (position,))
            if k < len(self._anchors) and self._anchors[k][0] == position:
                return
            digest = entry_digest(fields)
            self._anchors.insert(k, (position, entry_id, digest))
            if len(self._anchors) > 4096:
                del self._anchors[1:2048]  # keep the origin and the newest
            keep = position // ANCHOR_EVERY not in self._kept  # one ZADD per block of positions read
            self._kept.add(position // ANCHOR_EVERY)
        if keep:
            _, anchors_key, _ = self._keys()
            self._call("ZADD", lambda c: c.zadd(anchors_key, {entry_id + b" " + digest.encode(): position}))

    # -- reading ---------------------------------------------------------------------------------------------

    def __len__(self) -> int:
        raise TypeError(f"RedisStreamSource {self.name!r} is a live stream: it has no length")

    def __repr__(self) -> str:
        return f"RedisStreamSource(url={self.url!r}, key={self.key!r}, group={self.group!r})"

    def entries(self, first: int, stop: int) -> list[tuple[bytes, dict]]:
        """The entries at positions ``[first, stop)``, waiting for those that do not exist yet.

        Args:
            first: the first position.
            stop: the position after the last.

        Returns:
            ``[(ID, {field: value}), ...]`` in position order, as redis-py gives them.

        Raises:
            SourceError: a position was trimmed from the stream (naming the first missing one),
                entries were deleted from its middle, or the server cannot be reached.
            EntriesTimeoutError: (a ``TimeoutError``) the entries did not all exist ``timeout`` seconds after the call (on a
                thread that reads ahead of the consumer, the wait has no deadline:
                :func:`quern.pipeline.sources.waiting.patient`).
        """
        out: list[tuple[bytes, dict]] = []
        until = waiting.deadline(self.timeout)
        pos = first
        while pos < stop:
            anchor = self._anchor_before(pos)
            # from the anchor itself (inclusive: it must still be there), at most _MOST entries a call
            start = b"-" if anchor is None else anchor[1]
            count = min(_MOST, (stop - pos) + (0 if anchor is None else pos - anchor[0]))

            def both(c: Any, start: bytes = start, count: int = count) -> list:
                p = c.pipeline(transaction=True)
                p.xinfo_stream(self.key)
                p.xrange(self.key, start, b"+", count=count)
                return p.execute()

            info, got = self._call("XRANGE", both)
            head, head_id, added = self._head(info)
            self._check_same_stream(anchor, head, head_id, added, got)
            if pos < head:
                raise SourceError(
                    f"RedisStreamSource: position {pos} of stream {self.key!r} at {self.url} was trimmed away: the "
                    f"stream now starts at position {head} (entry {head_id!r}); a step needing it cannot be made"
                )
            if anchor is not None and anchor[0] >= head:
                base = anchor[0]  # the anchor came back first (checked): the rest follows it
            else:
                base = head  # from the stream's first entry held (the anchor was trimmed away)
            if len(got) < count and base + len(got) != added:  # the XRANGE reached the stream's end
                self._not_same(f"{len(got)} entries follow position {base}, but it has added {added}")
            for k, (entry_id, fields) in enumerate(got):
                if pos <= base + k < stop:
                    out.append((entry_id, fields))
            if got:
                self._learn(base + len(got) - 1, got[-1][0], got[-1][1])
            pos, was = max(pos, base + len(got)), pos
            if pos < stop and (base + len(got) >= added or pos == was):  # the log ends before `stop`: wait
                last = got[-1][0] if got else (anchor[1] if anchor is not None else b"0-0")
                self._wait(last, pos, first, stop, added, until)  # wakes up; the transaction reads them
        return out

    def _check_same_stream(
        self, anchor: _Anchor | None, head: int, head_id: bytes | None, added: int, got: list
    ) -> None:
        """Refuse a stream that is not the one this source read: recreated, or with entries lost and re-added."""
        with self._lock:
            seen, self._added = self._added, max(self._added, added)
        why = None
        if added < seen:
            why = f"it has added {added} entries, fewer than the {seen} it had (entries lost in a restart?)"
        elif added <= self.origin[0]:
            why = f"it has added {added} entries, and its origin entry {self.origin[1]!r} was at position {self.origin[0]}"
        elif head <= self.origin[0] and (head, head_id) != (self.origin[0], self.origin[1].encode()):
            why = f"its first entry is {head_id!r} at position {head}, where its origin {self.origin[1]!r} was"
        elif anchor is not None and anchor[0] >= head and (not got or got[0][0] != anchor[1]):
            why = f"entry {anchor[1]!r}, which was at position {anchor[0]}, is no longer there"
        elif (
            anchor is not None and anchor[0] >= head and anchor[2] is not None and entry_digest(got[0][1]) != anchor[2]
        ):
            why = f"entry {anchor[1]!r} at position {anchor[0]} holds other fields than it did (recreated?)"
        if why is not None:
            self._not_same(why)

    def _not_same(self, why: str) -> None:
        """Refuse a stream that is not the one this source read, saying ``why``."""
        raise SourceError(
            f"RedisStreamSource: stream {self.key!r} at {self.url} is not the stream this source read ({why}): "
            "its positions no longer name the same entries; open a new source (and delete its "
            f"{self.key}:quern:* keys to start anew)"
        )

    def _wait(self, last: bytes, pos: int, first: int, stop: int, added: int, until: float | None) -> None:
        """Block until entries after ``last`` exist (one ``XREAD BLOCK``), or give up at ``until``.

        What it returns is not used: positions are counted only from a transaction of ``XINFO STREAM``
        and ``XRANGE``, where a trim or a lost entry cannot come between.
        """
        if until is not None and time.monotonic() >= until:
            raise EntriesTimeoutError(
                f"RedisStreamSource: stream {self.key!r} at {self.url} holds {added} entries (positions up to "
                f"{added - 1}), and positions [{first}, {stop}) did not all come within timeout={self.timeout:g} s"
            )
        if waiting.gave_up():
            raise RuntimeError("the iterator reading ahead was closed")
        block = self.BLOCK_SECONDS if until is None else max(0.001, min(self.BLOCK_SECONDS, until - time.monotonic()))
        self._call("XREAD", lambda c: c.xread({self.key: last}, count=1, block=max(1, int(block * 1000))))

    def read_many(self, ids: np.ndarray) -> list:
        """The entries at positions ``ids`` (in that order) as ``{field: bytes}`` dicts, field names as str.

        Args:
            ids: stream positions ``>= 0``; they may repeat.

        Returns:
            One dict per position.

        Raises:
            IndexError: a negative position.
            SourceError: as :meth:`entries`.
            TimeoutError: as :meth:`entries`.
        """
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        if not ids.size:
            return []
        if ids.min() < 0:
            raise IndexError(f"RedisStreamSource {self.name!r}: position {int(ids.min())} is negative")
        lo, hi = int(ids.min()), int(ids.max()) + 1
        got = self.entries(lo, hi)
        rows = [{k.decode("utf-8", "surrogateescape"): v for k, v in fields.items()} for _, fields in got]
        return [rows[i - lo] for i in ids.tolist()]

    def entry_ids(self, positions: Sequence[int] | np.ndarray) -> list[str]:
        """The IDs of the entries at ``positions`` (what ``explain`` names each row by).

        Args:
            positions: stream positions.

        Returns:
            One ID per position, as ``"1700000000000-0"``.
        """
        ids = np.asarray(positions, dtype=np.int64).reshape(-1)
        if not ids.size:
            return []
        lo, hi = int(ids.min()), int(ids.max()) + 1
        got = self.entries(lo, hi)
        return [got[i - lo][0].decode() for i in ids.tolist()]

    # -- commits (what they mean, and who may change the record: .live_commits) ------------------------------------

    def resuming(self, steps: StepMap, start: int, process_index: int, process_count: int) -> Run:
        """An iterator of host ``process_index`` of ``process_count`` starts at ``start`` (the iterator calls it).

        Returns:
            The iterator's run, which its commits carry (``commit(..., run=)``).

        Raises:
            ValueError: ``steps`` differs from the commit record's and ``start`` is not the step that
                begins at its first untrained entry (naming what changed and the committed position).
        """
        return live_commits.begin(self, steps, int(start))

    def commit(self, step: int, process_index: int = 0, process_count: int = 1, *, run: Run | None = None) -> bool:
        """Record that host ``process_index`` of ``process_count`` trained every step before ``step``.

        Called by ``it.commit(step)``, with the batch size and window of the iterator's pipeline;
        a host's commits only move forward. A commit of a run the record does not belong to
        (another host count, batch size or window, or a run a later one took it over from) is
        ignored with a warning, so :meth:`committed` never goes back; an iterator's first commit
        takes the record over when its run resumed where the record stands and no later run took
        it over since the iterator started. Called directly (no ``run``), ``step`` is a step of the
        record's own batch size and window: such a commit joins the record's run on
        ``process_count`` hosts, never takes a record over, and before any record exists makes one
        whose step map the first iterator's commit fills in.

        Args:
            step: the step after the last one trained.
            process_index: this host.
            process_count: the hosts of the run.
            run: the committing iterator's run (what :meth:`resuming` returned).

        Returns:
            Whether the record took it (``False``: ignored, with a ``UserWarning`` saying why).

        Raises:
            SourceError: the server cannot be reached.
        """
        i, n = int(process_index), int(process_count)
        return live_commits.commit(self, run, int(step), i, n)

    def committed(self, pipe: Any = None) -> int:
        """The step to resume at: the smallest step every host of the run committed (0 before any commit).

        Args:
            pipe: the pipeline that resumes: the step of *its* batch size and window that begins
                at the first untrained entry (``None``: the step of the record's).

        Returns:
            ``pipe.iterator(start_step=src.committed(pipe))`` trains exactly the entries not yet
            trained. Never less than before, for one batch size and window.

        Raises:
            ValueError: no step of ``pipe`` begins at the first untrained entry (naming what changed
                and the committed position), or ``pipe`` reads another stream.
            SourceError: the server cannot be reached.
        """
        return live_commits.committed(self, pipe)

    def commit_record(self) -> CommitRecord | None:
        """The commit record of ``group`` as it is now (``None`` before any commit); see :mod:`.live_commits`."""
        return live_commits.read(self)

    def identity(self) -> dict:
        """A description of the data for the pipeline fingerprint.

        Returns:
            The type, name, key, origin entry and its digest (the server's URL is not part of
            it: a copy of the stream elsewhere is the same data).
        """
        return {
            "type": type(self).__name__,
            "name": self.name,
            "key": self.key,
            "origin": list(self.origin),
            "origin_digest": self.origin_digest,
        }
