"""Redis Streams: entries/s through a live pipeline, the cost of a commit, and live-tail latency.

Starts a private ``redis-server`` on 127.0.0.1 (``tests/redisserver.py``: a free port, its
own temporary folder, ``--appendonly yes --appendfsync always --save ""``), fills two
streams of ``--entries`` entries (3 small fields; 2 small fields and a 1,000-byte
``blob``) and measures, on each:

1. Entries/s of ``Pipeline.from_source(RedisStreamSource(url, key)).map(fields).batch(256)``
   with 0 and 2 workers, against redis-py's own ``XRANGE key (last + COUNT 1000`` loop over
   the same entries (decoding nothing) and against ``src.read_many`` in step-sized blocks:
   ``--read`` entries a run, ``--runs`` interleaved rounds (every second one in reverse
   order). With ``--hiredis DIR`` (a folder holding the ``hiredis`` package, such as
   ``pip install --target DIR hiredis``), two rows more, each run in a child process with
   ``DIR`` on ``PYTHONPATH``: redis-py parses replies with hiredis where it can import it.
2. The cost of ``it.commit(step)``: the time of each call (the Lua script's round trip, and
   the server's fsync of its append-only file) over ``--commits`` commits after steps of 64
   entries, beside a PING, an ``EVAL`` and an ``EVALSHA`` of the same script made with
   redis-py and ``src.commit`` alone (no iterator, so no read-ahead thread beside it); the
   same with the server set to ``appendfsync everysec``; and the time per step committing after
   every step against never (small entries; one iterator, blocks of ``COMMIT_BLOCK`` steps
   taking turns, so that a slow spell of the machine hits both).
3. Live-tail latency: a producer thread ``XADD``s entries at a fixed rate, each carrying the
   time it was sent, while ``next(it)`` returns batches of ``--live-batch``: the delay from an
   entry's ``XADD`` to the return of its batch, for every entry (it includes the wait for
   the batch to fill) and for the last entry of each batch (what the pipeline adds), beside a
   plain redis-py ``XREAD BLOCK`` loop.
4. The checks of issue 36, each timed alone (``--commits`` calls): opening a source (its origin and
   the newest anchor kept beside the stream checked by ID and field digest), that anchor check
   alone, ``src.commit_record()`` (the ``HGETALL`` an iterator's open adds to check its start),
   an iterator's open and close for scale, and ``entry_digest`` of one entry (a read computes two
   per ``XRANGE`` call: the anchor it starts from, and the last entry it learns).

Every redis-server started is stopped at the end (and on an error).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

import quern
from quern.pipeline.sources import RedisStreamSource
from quern.pipeline.sources.live_commits import COMMIT as _COMMIT
from quern.pipeline.sources.redis_stream import entry_digest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(1, os.path.join(os.path.dirname(HERE), "tests"))  # redisserver.py and its helpers
import common  # noqa: E402

BATCH = 256  # rows of a step in sections 1 and 2
XRANGE_COUNT = 1000  # entries of one XRANGE call of the redis-py loop
FILL_CHUNK = 1000  # XADDs of one pipelined round trip while filling a stream
BLOB = 1000  # bytes of the large entries' payload
COMMIT_BLOCK = 8  # steps of one block of the commit-or-not figure
SETTLE = 0.5  # seconds after the first live batch before the delays count


# --------------------------------------------------------------------------- the entries and the per-entry work


def fields(entry: dict) -> dict[str, np.ndarray]:
    """An entry's ``{field: bytes}`` as fixed-size NumPy fields (the map of every pipeline here).

    Args:
        entry: ``{"id": b"17", "label": b"7", "score": b"0.017"}``, or with ``"blob"``
            (``BLOB`` bytes) in place of ``"score"``.

    Returns:
        ``id`` int64, ``label`` int32, and ``score`` float32 or ``blob`` (``BLOB``,) uint8.
    """
    out = {"id": np.int64(int(entry["id"])), "label": np.int32(int(entry["label"]))}
    if "blob" in entry:
        out["blob"] = np.frombuffer(entry["blob"], dtype=np.uint8)
    else:
        out["score"] = np.float32(float(entry["score"]))
    return out


def stamped(entry: dict) -> dict[str, np.ndarray]:
    """A live entry's send time (``t``, seconds since the epoch) and number."""
    return {"t": np.float64(float(entry["t"])), "id": np.int64(int(entry["id"]))}


def fill(client: Any, key: str, n: int, big: bool) -> float:
    """Add ``n`` entries to stream ``key`` in pipelined round trips of FILL_CHUNK; the seconds taken."""
    blob = np.random.default_rng(0).integers(0, 256, BLOB, dtype=np.uint8).tobytes()
    t0 = time.perf_counter()
    for first in range(0, n, FILL_CHUNK):
        p = client.pipeline(transaction=False)
        for i in range(first, min(n, first + FILL_CHUNK)):
            entry = {"id": str(i), "label": str(i % 10)}
            entry.update({"blob": blob} if big else {"score": f"{i * 0.001:.3f}"})
            p.xadd(key, entry)
        p.execute()
    return time.perf_counter() - t0


# --------------------------------------------------------------------------- 1. entries/s


def xrange_loop(client: Any, key: str, n: int) -> float:
    """Entries/s of redis-py's ``XRANGE key (last + COUNT XRANGE_COUNT`` over the first ``n`` entries."""
    start, got_n = b"-", 0
    t0 = time.perf_counter()
    while got_n < n:
        got = client.xrange(key, start, b"+", count=min(XRANGE_COUNT, n - got_n))
        if not got:
            raise RuntimeError(f"stream {key!r} ended after {got_n} entries")
        got_n += len(got)
        start = b"(" + got[-1][0]
    return got_n / (time.perf_counter() - t0)


def read_many_loop(url: str, key: str, n: int) -> float:
    """Entries/s of ``src.read_many`` of positions ``[s*BATCH, (s+1)*BATCH)``, a fresh source."""
    src = RedisStreamSource(url, key)
    steps = n // BATCH
    t0 = time.perf_counter()
    for s in range(steps):
        src.read_many(np.arange(s * BATCH, (s + 1) * BATCH))
    return steps * BATCH / (time.perf_counter() - t0)


def pipeline_run(url: str, key: str, n: int, workers: int) -> float:
    """Entries/s of ``next(it)`` over ``n // BATCH`` steps after the first (workers started before)."""
    pipe = quern.Pipeline.from_source(RedisStreamSource(url, key)).map(fields).batch(BATCH)
    steps = n // BATCH
    it = common.started(pipe.iterator(num_workers=workers))
    try:
        next(it)  # the first batch: the workers' start-up and the source's first read
        t0 = time.perf_counter()
        for _ in range(1, steps):
            next(it)
        seconds = time.perf_counter() - t0
    finally:
        it.close()
    return (steps - 1) * BATCH / seconds


def child(what: str, url: str, key: str, n: int) -> float:
    """One hiredis row's run, in a process that has hiredis on its path (``--child``)."""
    import redis
    from redis.utils import HIREDIS_AVAILABLE

    if not HIREDIS_AVAILABLE:
        raise RuntimeError(
            f"redis-py {redis.__version__} does not see hiredis (PYTHONPATH={os.environ.get('PYTHONPATH')})"
        )
    if what == "xrange":
        return xrange_loop(redis.Redis.from_url(url, protocol=2), key, n)
    return pipeline_run(url, key, n, 0)


def in_child(hiredis: str, what: str, url: str, key: str, n: int) -> float:
    """:func:`child` in a fresh Python with ``hiredis`` on ``PYTHONPATH``."""
    before = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = hiredis + (os.pathsep + before if before else "")
    try:
        return float(common.run_child(__file__, [what, url, key, n], timeout=300))
    finally:
        if before is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = before


def throughput(
    client: Any, url: str, streams: dict[str, str], args: argparse.Namespace
) -> dict[str, dict[str, list[float]]]:
    """Section 1: each stream's entries/s, read the ways being compared, the runs taking turns."""
    print(f"\n## 1. Entries/s ({args.read:,} entries a run, batches of {BATCH}, {args.runs} interleaved rounds)\n")
    out: dict[str, dict[str, list[float]]] = {}
    for label, key in streams.items():
        cases: list[tuple[str, Callable[[], float]]] = [
            ("xrange", lambda key=key: xrange_loop(client, key, args.read)),
            ("read_many", lambda key=key: read_many_loop(url, key, args.read)),
            ("w0", lambda key=key: pipeline_run(url, key, args.read, 0)),
            ("w2", lambda key=key: pipeline_run(url, key, args.read, 2)),
        ]
        if args.hiredis:
            cases += [
                ("xrange-hiredis", lambda key=key: in_child(args.hiredis, "xrange", url, key, args.read)),
                ("w0-hiredis", lambda key=key: in_child(args.hiredis, "w0", url, key, args.read)),
            ]
        print(f"running: {label} ...", flush=True)
        out[label] = common.interleaved(cases, args.runs, alternate=True)
    names = {
        "xrange": f"redis-py `XRANGE` loop, COUNT {XRANGE_COUNT} (decodes nothing)",
        "read_many": f"`src.read_many`, {BATCH} positions a call",
        "w0": "pipeline, `num_workers=0`",
        "w2": "pipeline, `num_workers=2`",
        "xrange-hiredis": "redis-py `XRANGE` loop, with hiredis",
        "w0-hiredis": "pipeline, `num_workers=0`, with hiredis",
    }
    for label in streams:
        print(f"\n### {label}\n")
        print(common.markdown_header(["read", "entries/s (median)", "runs", "vs XRANGE", "µs/entry"]))
        xr = statistics.median(out[label]["xrange"])
        for case, name in names.items():
            rates = out[label].get(case)
            if rates:
                med = statistics.median(rates)
                print(
                    common.markdown_row(
                        [name, f"{med:,.0f}", common.join_runs(rates), common.ratio(med, xr), f"{1e6 / med:.1f}"]
                    )
                )
    if not args.hiredis:
        print("\n(hiredis rows: not run; pass --hiredis DIR, a folder holding the hiredis package)")
    return out


# --------------------------------------------------------------------------- 2. commits


def percentiles(seconds: list[float]) -> tuple[float, float]:
    """Median and p90 of ``seconds``, in µs."""
    a = np.asarray(seconds) * 1e6
    return float(np.median(a)), float(np.percentile(a, 90))


def timed_calls(fn: Callable[[], Any], n: int) -> list[float]:
    """Seconds of each of ``n`` calls of ``fn``."""
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def commit_calls(url: str, key: str, group: str, n: int) -> list[float]:
    """Seconds of each ``it.commit(step)``, after every one of ``n`` steps of 64 entries (0 workers)."""
    pipe = quern.Pipeline.from_source(RedisStreamSource(url, key, group=group)).map(fields).batch(64)
    out = []
    with pipe.iterator(num_workers=0) as it:
        for s in range(n):
            next(it)
            t0 = time.perf_counter()
            it.commit(s + 1)
            out.append(time.perf_counter() - t0)
    return out


def commits(client: Any, url: str, key: str, args: argparse.Namespace) -> dict:
    print(f"\n## 2. Commits ({args.commits:,} calls each; appendfsync always unless said)\n")
    n = args.commits
    sha = client.script_load(_COMMIT)
    calls = {
        "ping": ("redis-py `PING` (a round trip)", timed_calls(client.ping, n)),
        "eval": (
            "redis-py `EVAL` of the commit script (what `commit` sends)",
            _script_calls(client, "EVAL", _COMMIT, n),
        ),
        "evalsha": ("redis-py `EVALSHA` of the same script", _script_calls(client, "EVALSHA", sha, n)),
        "src-commit": ("`src.commit(step)` (the source's call, no iterator)", _source_commits(url, key, n)),
        "commit": (
            "`it.commit(step)`, 0 workers (its read-ahead thread running)",
            commit_calls(url, key, f"bench-always-{time.monotonic_ns()}", n),
        ),
    }
    client.config_set("appendfsync", "everysec")
    try:
        calls["eval-everysec"] = ("redis-py `EVAL`, `appendfsync everysec`", _script_calls(client, "EVAL", _COMMIT, n))
        calls["src-commit-everysec"] = ("`src.commit(step)`, `appendfsync everysec`", _source_commits(url, key, n))
        calls["commit-everysec"] = (
            "`it.commit(step)`, `appendfsync everysec`",
            commit_calls(url, key, f"bench-everysec-{time.monotonic_ns()}", n),
        )
    finally:
        client.config_set("appendfsync", "always")
    print(common.markdown_header(["call", "median µs", "p90 µs", "mean µs"]))
    out: dict[str, Any] = {}
    for name, (text, seconds) in calls.items():
        med, p90 = percentiles(seconds)
        out[name] = {"median_us": med, "p90_us": p90, "mean_us": statistics.fmean(seconds) * 1e6}
        print(common.markdown_row([text, f"{med:,.0f}", f"{p90:,.0f}", f"{out[name]['mean_us']:,.0f}"]))
    print(
        f"\nCommitting after every step of {BATCH} against never: one iterator over {args.read:,} entries, "
        f"blocks of {COMMIT_BLOCK} steps taking turns (off, on, off, ...):\n"
    )
    print(
        common.markdown_header(
            ["workers", "never: µs/step", "every step: µs/step", "cost", "blocks", "`src.commit`'s mean / step"]
        )
    )
    wait_us = out["src-commit"]["mean_us"]  # the round trip the trainer waits for (the rest of it.commit overlaps)
    for w in (0, 2):
        got = commit_blocks(url, key, args.read, w)
        off, on = statistics.median(got[False]), statistics.median(got[True])
        cost = 1 - off / on  # of the entries/s
        out[f"w{w}-blocks"] = {"off_us": got[False], "on_us": got[True], "cost": cost}
        print(
            common.markdown_row(
                [
                    w,
                    f"{off:,.0f}",
                    f"{on:,.0f}",
                    f"{(on / off - 1) * 100:+.1f}% a step ({-cost * 100:+.1f}% entries/s)",
                    f"{len(got[False])} + {len(got[True])}",
                    f"{wait_us / off * 100:.1f}% ({wait_us:,.0f} µs)",
                ]
            )
        )
    return out


def commit_blocks(url: str, key: str, n: int, workers: int) -> dict[bool, list[float]]:
    """µs per step of blocks of COMMIT_BLOCK steps, committing after each step (True) or not, taking turns."""
    pipe = quern.Pipeline.from_source(RedisStreamSource(url, key, group=f"bench-{time.monotonic_ns()}"))
    pipe = pipe.map(fields).batch(BATCH)
    out: dict[bool, list[float]] = {False: [], True: []}
    with common.started(pipe.iterator(num_workers=workers)) as it:
        for _ in range(2):  # the first batches: start-up
            next(it)
        for k in range((n // BATCH - 2) // COMMIT_BLOCK):
            on = k % 2 == 1
            t0 = time.perf_counter()
            for _ in range(COMMIT_BLOCK):
                next(it)
                if on:
                    it.commit(it.step)
            out[on].append((time.perf_counter() - t0) / COMMIT_BLOCK * 1e6)
    return out


def _source_commits(url: str, key: str, n: int) -> list[float]:
    """Seconds of each of ``n`` calls of ``src.commit(step)``, steps 1..n of a group of its own."""
    src = RedisStreamSource(url, key, group=f"bench-source-{time.monotonic_ns()}")
    steps = iter(range(1, n + 1))
    return timed_calls(lambda: src.commit(next(steps)), n)


def _script_calls(client: Any, command: str, script: str, n: int) -> list[float]:
    """Seconds of each of ``n`` ``EVAL``/``EVALSHA`` calls of the commit script, steps 1..n of a record of its own
    (one host, batch size 64, run 1: every call is taken)."""
    steps = iter(range(1, n + 1))
    key = f"bench:raw:{command}:{time.monotonic_ns()}"
    client.hset(key, mapping={"count": 1, "steps": "64 0 0", "run": 1, "base": 0})
    return timed_calls(lambda: client.execute_command(command, script, 1, key, 0, 1, "64 0 0", "1", next(steps), ""), n)


# --------------------------------------------------------------------------- 3. live tail


@contextlib.contextmanager
def producer(client: Any, key: str, rate: float, count: int) -> Iterator[dict[str, float]]:
    """A thread XADDing ``count`` entries to ``key`` at ``rate`` a second, each with its send time ``t``.

    Yields:
        ``{"seconds": ...}``, filled in when the thread is done (joined on exit).
    """
    done: dict[str, float] = {}

    def run() -> None:
        t0 = time.perf_counter()
        for i in range(count):
            wait = t0 + i / rate - time.perf_counter()
            if wait > 0:
                time.sleep(wait)
            client.xadd(key, {"t": repr(time.time()), "id": str(i)})
        done["seconds"] = time.perf_counter() - t0

    thread = threading.Thread(target=run, name="producer", daemon=True)
    thread.start()
    try:
        yield done
    finally:
        thread.join()


def live_pipeline(client: Any, url: str, key: str, rate: float, seconds: float, b: int, workers: int) -> dict:
    """Delays from XADD to next() returning, per entry and per batch's last entry.

    Only the batches whose entries were all sent ``SETTLE`` seconds or more after the first
    batch came count: the backlog of the start-up (the workers') is left out.
    """
    count = int(rate * seconds) // b * b
    every: list[float] = []
    last: list[float] = []
    with producer(client, key, rate, count) as done:
        pipe = quern.Pipeline.from_source(RedisStreamSource(url, key, timeout=30)).map(stamped).batch(b)
        with common.started(pipe.iterator(num_workers=workers)) as it:
            next(it)
            settled = time.time() + SETTLE
            for _ in range(1, count // b):
                batch = next(it)
                now = time.time()
                if batch["t"][0] >= settled:
                    every += (now - batch["t"]).tolist()
                    last.append(now - float(batch["t"][-1]))
    return {"every": every, "last": last, "produced_per_s": count / done["seconds"]}


def live_xread(client: Any, key: str, rate: float, seconds: float) -> dict:
    """The delays of a plain redis-py ``XREAD BLOCK`` loop, per entry as it arrives (after ``SETTLE`` s)."""
    count = int(rate * seconds)
    delays: list[float] = []
    seen, since = 0, b"0-0"
    settled = time.time() + SETTLE
    with producer(client, key, rate, count) as done:
        while seen < count:
            got = client.xread({key: since}, count=1000, block=5000)
            now = time.time()
            for _, entries in got:
                for entry_id, entry in entries:
                    t = float(entry[b"t"])
                    if t >= settled:
                        delays.append(now - t)
                    seen += 1
                    since = entry_id
    return {"every": delays, "last": delays, "produced_per_s": count / done["seconds"]}


def live_tail(client: Any, url: str, args: argparse.Namespace) -> dict:
    b = args.live_batch
    print(
        f"\n## 3. Live tail (a producer thread XADDing at a fixed rate; batches of {b}; {args.live_seconds:g} s each)\n"
    )
    cases = []
    for rate in args.rates:
        cases.append(
            (
                f"redis-py `XREAD BLOCK` loop, {rate:,.0f}/s",
                lambda r=rate: live_xread(client, f"xread-{r}", r, args.live_seconds),
            )
        )
        for w in (0, 2):
            cases.append(
                (
                    f"pipeline, `num_workers={w}`, {rate:,.0f}/s",
                    lambda r=rate, w=w: live_pipeline(client, url, f"live-{r}-{w}", r, args.live_seconds, b, w),
                )
            )
    print(
        common.markdown_header(
            [
                "consumer, rate",
                "produced/s",
                "every entry: median ms",
                "p90 ms",
                "last of its batch: median ms",
                "p90 ms",
            ]
        )
    )
    out = {}
    for name, run in cases:
        got = run()
        e50, e90 = (float(np.percentile(got["every"], p)) * 1e3 for p in (50, 90))
        l50, l90 = (float(np.percentile(got["last"], p)) * 1e3 for p in (50, 90))
        out[name] = {"produced_per_s": got["produced_per_s"], "every_ms": [e50, e90], "last_ms": [l50, l90]}
        last = ("-", "-") if "XREAD" in name else (f"{l50:.2f}", f"{l90:.2f}")
        print(common.markdown_row([name, f"{got['produced_per_s']:,.0f}", f"{e50:.2f}", f"{e90:.2f}", *last]))
    return out


# --------------------------------------------------------------------------- 4. the checks of issue 36


def checks(client: Any, url: str, args: argparse.Namespace) -> dict:
    """Seconds of each check a live stream makes since issue 36 (points 1-3), each timed alone."""
    n = args.commits
    print(f"\n## 4. Checks ({n:,} calls each)\n")
    src = RedisStreamSource(url, "small")
    pipe = quern.Pipeline.from_source(src).map(fields).batch(BATCH)
    pipe.batch_at(args.entries // BATCH - 1)  # an anchor kept beside the stream, far from the origin
    _, anchors_key, _ = src._keys()
    newest = client.zrevrange(anchors_key, 0, 0)[0].split(b" ")[0]
    small, big = client.xrange("small", count=1)[0][1], client.xrange("kb", count=1)[0][1]

    def anchor_check() -> None:
        client.zrevrange(anchors_key, 0, 0, withscores=True)
        entry_digest(client.xrange("small", newest, newest, count=1)[0][1])

    calls = {
        "ping": ("`PING` (a round trip)", timed_calls(client.ping, n)),
        "open": (
            "`RedisStreamSource(url, key)`: open, with its checks",
            timed_calls(lambda: RedisStreamSource(url, "small"), n),
        ),
        "anchor": ("of which the newest kept anchor's check", timed_calls(anchor_check, n)),
        "record": ("`src.commit_record()`: what an iterator's open adds", timed_calls(src.commit_record, n)),
        "iterator": (
            "`pipe.iterator().close()`, 0 workers (for scale)",
            timed_calls(lambda: pipe.iterator().close(), max(1, n // 10)),
        ),
        "digest": ("`entry_digest` of a small entry (3 fields)", timed_calls(lambda: entry_digest(small), n)),
        "digest-kb": (
            f"`entry_digest` of an entry with a {BLOB:,}-byte blob",
            timed_calls(lambda: entry_digest(big), n),
        ),
    }
    print(common.markdown_header(["call", "median µs", "p90 µs", "mean µs"]))
    out: dict[str, Any] = {}
    for name, (text, seconds) in calls.items():
        med, p90 = percentiles(seconds)
        out[name] = {"median_us": med, "p90_us": p90, "mean_us": statistics.fmean(seconds) * 1e6}
        print(common.markdown_row([text, f"{med:,.1f}", f"{p90:,.1f}", f"{out[name]['mean_us']:,.1f}"]))
    return out


# --------------------------------------------------------------------------- main


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--entries", type=int, default=200_000, help="entries of each stream (default 200,000)")
    ap.add_argument("--read", type=int, default=100_000, help="entries read by one run of section 1 (default 100,000)")
    ap.add_argument("--runs", type=int, default=3, help="interleaved rounds of section 1 (default 3)")
    ap.add_argument("--commits", type=int, default=1000, help="calls timed per row of section 2 (default 1,000)")
    ap.add_argument("--live-batch", type=int, default=16, help="batch size of section 3 (default 16)")
    ap.add_argument(
        "--live-seconds", type=float, default=4.0, help="seconds of producing per row of section 3 (default 4)"
    )
    ap.add_argument(
        "--rates", type=float, nargs="+", default=[100.0, 1000.0], help="producer rates of section 3 (default 100 1000)"
    )
    ap.add_argument("--hiredis", metavar="DIR", help="a folder holding the hiredis package: adds the hiredis rows")
    ap.add_argument(
        "--skip",
        action="append",
        default=[],
        choices=["throughput", "commits", "live", "checks"],
        help="skip a section (repeatable)",
    )
    args = common.parse_args(ap, child)
    if args is None:
        return
    if args.read > args.entries or args.read < 2 * BATCH:
        ap.error(f"--read must be in [{2 * BATCH}, --entries]")
    if args.commits * 64 > args.entries:
        ap.error("--commits * 64 must be at most --entries (a commit after each step of 64 entries)")
    from redisserver import RedisServer, redis_binary

    if redis_binary() is None:
        raise SystemExit("redis-server is not installed (make services installs it with apt-get)")
    import redis

    print("# Redis Streams: entries/s, commits, live-tail latency\n")
    with RedisServer() as srv:
        t_start = common.begin(
            **{"redis-py": redis.__version__, "redis-server": ".".join(map(str, srv.version))},
        )
        print(f"server: {srv.url}, appendonly yes, appendfsync always, save '' (folder {srv.dir})")
        client = redis.Redis.from_url(srv.url, protocol=2, socket_timeout=30)
        streams = {"3 small fields": "small", f"{BLOB:,}-byte blob": "kb"}
        for label, key in streams.items():
            seconds = fill(client, key, args.entries, big=key == "kb")
            info = client.memory_usage(key, samples=0) or 0
            print(
                f"filled {key!r}: {args.entries:,} entries ({label}) in {seconds:.1f} s, {info / 2**20:,.0f} MiB in the server"
            )
        figures: dict[str, Any] = {"entries": args.entries, "read": args.read}
        if "throughput" not in args.skip:
            figures["throughput"] = throughput(client, srv.url, streams, args)
        if "commits" not in args.skip:
            figures["commits"] = commits(client, srv.url, "small", args)
        if "live" not in args.skip:
            figures["live"] = live_tail(client, srv.url, args)
        if "checks" not in args.skip:
            figures["checks"] = checks(client, srv.url, args)
        client.close()
    print(f"\ntotal time {time.perf_counter() - t_start:.0f} s (the server stopped)")
    common.save_figures(args.json, figures)


if __name__ == "__main__":
    main()
