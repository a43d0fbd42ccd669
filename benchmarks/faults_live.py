"""Reliability scenarios of live streams and their commits (Redis; issue 36 points 1-3).

Each scenario is a function ``(trials, rng, tmp) -> (tried, held, notes)`` as in
:mod:`faults`, which runs the ones in :data:`SCENARIOS` with its own. They start one private
``redis-server`` on 127.0.0.1 (``tests/redisserver.py``), a stream of its own per trial; without
redis-server installed they try nothing (0 of 0, said in the notes).

* ``live resume remapped``: a trainer process (batch size 2-8, in log order or shuffled within
  windows of 2-4 steps, committing every 1-5 steps after writing a checkpoint) is SIGKILLed after
  a random number of steps (1-40); a second one resumes with another random batch size and
  window (the same ones in some trials) at ``src.committed(pipe)`` (or, in a quarter of the
  trials, at the old ``src.committed()``) and trains to the end of its start's window and 1-3
  windows more. Held when either every
  entry the restored model learned from (the first run's steps before its committed step, and
  the second run's) was trained exactly once, from entry 0 on without a gap, or the second
  trainer was refused with a ``ValueError`` naming what changed and the committed position, and
  the commit record is as it was.
* ``live late commits``: 3-5 runs one after another, each on 1-4 hosts (another count than the
  run before; an iterator and a source object per host, as separate processes would have)
  resuming at ``committed()``, the hosts' first commits racing each other (threads released at
  once), then committing random steps in random order, while a thread makes
  late commits of hosts of the runs a later run took the record over from (random hosts, one
  per run that never committed before; steps below and above the record's) at random moments
  and another reads
  ``committed()`` all along. Held when ``committed()`` never decreased, every late commit was
  ignored (with a warning), and after each run's hosts all committed step ``F`` it read ``F``.
* ``live recreated mid-read``: a source reads steps of a stream of 400-3,000 entries while the
  stream is deleted and recreated at a random moment with the same entry IDs and other fields in
  every entry, or with the same entries after one new first entry (every position shifted by
  one). (One recreated with the same origin entry is refused only by a read that starts from a
  changed anchor: the entries between anchors are not compared, so it is not a scenario here;
  tests/test_redis_stream_faults.py has it refused at open and from a kept anchor.) Held when every step read is the old stream's entries or a ``SourceError``
  (cause of the ``StepError``): never a step of the new stream's entries under the old positions.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import sys
import textwrap
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

import quern
from quern.pipeline.core.errors import SourceError, StepError
from quern.pipeline.sources import RedisStreamSource
from quern.pipeline.sources.live_commits import StepMap

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.join(os.path.dirname(HERE), "tests")
B_LATE = 12  # the batch size of ``live late commits``: 1, 2, 3 or 4 hosts

TRAINER = textwrap.dedent(
    """
    import os, sys
    import numpy as np
    import quern
    from quern.pipeline.sources import RedisStreamSource

    url, key, out = sys.argv[1], sys.argv[2], sys.argv[3]
    b, w, every, how, steps = (int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6]), sys.argv[7], int(sys.argv[8]))

    def tonum(rec):
        return {"v": np.int64(int(rec["v"]))}

    src = RedisStreamSource(url, key, timeout=30, retry_seconds=10)
    pipe = quern.Pipeline.from_source(src, seed=11)
    if w:
        pipe = pipe.shuffle("steps", steps=w)
    pipe = pipe.map(tonum).batch(b)
    start = src.committed(pipe) if how == "pipe" else src.committed()
    unit = max(w, 1)
    stop = -(-start // unit) * unit + steps  # to the end of the start's window, then `steps` more
    print("start", start, "stop", stop, flush=True)
    with pipe.iterator(start_step=start) as it:
        for step in range(start, stop):
            batch = next(it)
            path = os.path.join(out, f"step{step:04d}")
            with open(path + ".tmp", "wb") as f:
                f.write(batch["v"].tobytes())
            os.replace(path + ".tmp", path)  # this step was trained
            if (step + 1) % every == 0 or step + 1 == stop:  # a checkpoint with the step, then the commit
                it.commit(step + 1)
    print("done", flush=True)
    """
)


@contextlib.contextmanager
def _server() -> Iterator[Any]:
    """A private redis-server (``None`` where redis-server is not installed)."""
    if TESTS not in sys.path:
        sys.path.insert(1, TESTS)
    from redisserver import RedisServer, redis_binary

    if redis_binary() is None:
        yield None
        return
    with RedisServer() as srv:
        yield srv


def _produce(r: Any, key: str, start: int, stop: int, offset: int = 0) -> list[str]:
    """Entries ``v = i + offset`` for ``i`` in ``[start, stop)``; their IDs."""
    p = r.pipeline(transaction=False)
    for i in range(start, stop):
        p.xadd(key, {"v": str(i + offset)})
    return [x.decode() for x in p.execute()]


def _steps(folder: str) -> dict[int, list[int]]:
    out = {}
    for name in os.listdir(folder):
        if name.startswith("step") and "." not in name:
            with open(os.path.join(folder, name), "rb") as f:
                out[int(name[4:])] = np.frombuffer(f.read(), dtype=np.int64).tolist()
    return out


# --------------------------------------------------------------------------- live resume remapped


def _resume_trial(srv: Any, rng: random.Random, tmp: str, trial: int) -> tuple[bool, str]:
    key = f"remap{trial}"
    r = srv.client()
    _produce(r, key, 0, 3000)
    script = os.path.join(tmp, "live_trainer.py")
    if not os.path.exists(script):
        with open(script, "w") as f:
            f.write(TRAINER)
    first = StepMap(rng.choice([2, 3, 4, 6, 8]), rng.choice([0, 0, 2, 3, 4]), 11)
    first = StepMap(first.batch, first.window, 11 if first.window else 0)
    every = rng.randint(1, 5)
    run1, run2 = os.path.join(tmp, f"{key}-1"), os.path.join(tmp, f"{key}-2")
    os.mkdir(run1)
    os.mkdir(run2)
    cmd = [sys.executable, script, srv.url, key]
    proc = subprocess.Popen(
        [*cmd, run1, str(first.batch), str(first.window), str(every), "committed", "300"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    kill_after = rng.randint(1, 40)
    try:
        deadline = time.monotonic() + 60
        while len(os.listdir(run1)) < kill_after and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.002)
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    src = RedisStreamSource(srv.url, key, timeout=5)
    record = src.commit_record()
    done1 = 0 if record is None else record.done
    restored = {s: v for s, v in _steps(run1).items() if s < done1}  # what the model restored learned from
    if sorted(restored) != list(range(done1)):
        return False, f"the first run's steps before its commit {done1} are not all there"
    second = StepMap(rng.choice([2, 3, 4, 6, 8]), rng.choice([0, 0, 2, 3, 4]), 11)
    second = StepMap(second.batch, second.window, 11 if second.window else 0)
    if rng.random() < 0.25:
        second = first
    how = "committed" if rng.random() < 0.25 else "pipe"
    steps = max(second.window, 1) * rng.randint(1, 3)
    done = subprocess.run(
        [*cmd, run2, str(second.batch), str(second.window), "1", how, str(steps)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    after = src.commit_record()
    what = f"{first} -> {second} ({how}) after commit {done1}"
    if done.returncode != 0:
        position = f"position {first.position(done1)}"
        names = [position, *second.changes(first).split(", ")] if record is not None else []
        ok = "ValueError" in done.stderr and all(n and n in done.stderr for n in names) and after == record
        return ok and second != first, f"{what}: refused: {done.stderr.strip().splitlines()[-1][:300]}"
    got = sorted(v for run in (restored, _steps(run2)) for entries in run.values() for v in entries)
    stop = int(done.stdout.split()[3])
    ok = got == list(range(stop * second.batch))
    return ok, f"{what}: trained {len(got)} entries{'' if ok else ' (lost or repeated)'}"


def live_resume_remapped(trials: int, rng: random.Random, tmp: str) -> tuple[int, int, str]:
    with _server() as srv:
        if srv is None:
            return 0, 0, "not run: redis-server is not installed"
        held, refused, bad = 0, 0, []
        for trial in range(trials):
            ok, note = _resume_trial(srv, rng, tmp, trial)
            held += ok
            refused += ok and "refused" in note
            if not ok:
                bad.append(note)
    notes = f"{trials - refused} continued exactly, {refused} refused naming what changed"
    return trials, held, notes + (f"; FAILED: {bad[:2]}" if bad else "")


# --------------------------------------------------------------------------- live late commits


def _late_trial(srv: Any, rng: random.Random, trial: int) -> tuple[bool, str]:
    key = f"late{trial}"
    _produce(srv.client(), key, 0, 4000)
    watch = RedisStreamSource(srv.url, key, timeout=5)
    seen: list[int] = []
    stop = threading.Event()
    problems: list[str] = []

    def poll() -> None:
        while not stop.is_set():
            seen.append(watch.committed())

    old: list[tuple[RedisStreamSource, Any, int, int, int]] = []  # (source, its run, host, hosts, record run)
    lock = threading.Lock()
    chance = random.Random(rng.random())  # the late thread's own
    late_ones = [0]

    def late() -> None:
        while not stop.is_set():
            time.sleep(chance.uniform(0, 0.004))
            record = watch.commit_record()
            with lock:
                gone = [o for o in old if record is not None and o[4] != record.run]  # runs taken over since
                if not gone or record is None:
                    continue
                src, its, h, n, _ = gone[chance.randrange(len(gone))]
            step = max(0, record.done + chance.randint(-8, 8))
            late_ones[0] += 1
            if src.commit(step, h, n, run=its):  # False: ignored (with a warning)
                problems.append(f"a late commit({step}) of host {h} of {n} was taken")

    threads = [threading.Thread(target=poll, daemon=True), threading.Thread(target=late, daemon=True)]
    for t in threads:
        t.start()
    n = 0
    try:
        for _ in range(rng.randint(3, 5)):
            n = rng.choice([k for k in (1, 2, 3, 4) if k != n])  # another host count than the run before
            start = watch.committed()
            hosts = []
            for h in range(n):
                src = RedisStreamSource(srv.url, key, timeout=5)
                hosts.append(
                    (
                        src,
                        quern.Pipeline.from_source(src).batch(B_LATE).iterator(start, process_index=h, process_count=n),
                    )
                )
            final = start + rng.randint(1, 10)
            barrier = threading.Barrier(n)

            def first(h: int, hosts: list = hosts, barrier: threading.Barrier = barrier, start: int = start) -> None:
                it = hosts[h][1]  # the hosts' first commits race (a peer's take-over is joined, not taken again)
                next(it)
                barrier.wait()
                it.commit(start + 1)

            racing = [threading.Thread(target=first, args=(h,)) for h in range(n)]
            for t in racing:
                t.start()
            for t in racing:
                t.join(30)
            order = [
                (h, s)
                for h in range(n)
                for s in sorted(rng.sample(range(start + 1, final + 1), rng.randint(1, final - start)))
            ]
            rng.shuffle(order)
            for h in range(n):
                order.append((h, final))
            for h, s in order:
                it = hosts[h][1]
                while it.step < s:
                    next(it)
                it.commit(s)
            got = watch.committed()
            if got != final:
                problems.append(f"after a run on {n} hosts committed {final}: committed() is {got}")
            record = watch.commit_record()
            run = -1 if record is None else record.run
            with lock:
                for h, (src, it) in enumerate(hosts):
                    it.close()
                    old.append((src, it._live_run, h, n, run))  # its later commits carry its run, as it.commit's
                never = RedisStreamSource(srv.url, key, timeout=5)  # a host of it whose first commit comes late
                old.append((never, never.resuming(StepMap(B_LATE), start, n - 1, n), n - 1, n, run))
    finally:
        stop.set()
        for t in threads:
            t.join(10)
    if any(b < a for a, b in zip(seen, seen[1:])):
        problems.append(f"committed() went backwards: {next((a, b) for a, b in zip(seen, seen[1:]) if b < a)}")
    return not problems, "; ".join(problems[:2]) or f"{len(seen)} reads of committed(), {late_ones[0]} late commits"


def live_late_commits(trials: int, rng: random.Random, tmp: str) -> tuple[int, int, str]:
    with _server() as srv:
        if srv is None:
            return 0, 0, "not run: redis-server is not installed"
        held, bad, reads, lates = 0, [], 0, 0
        for trial in range(trials):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)  # each late commit's (counted by its result)
                ok, note = _late_trial(srv, rng, trial)
            held += ok
            if ok:
                reads += int(note.split()[0])
                lates += int(note.split()[-3])
            else:
                bad.append(note)
    return (
        trials,
        held,
        f"{lates:,} late commits ignored; {reads:,} reads of committed(), none lower than the one before"
        + (f"; FAILED: {bad[:2]}" if bad else ""),
    )


# --------------------------------------------------------------------------- live recreated mid-read


def _recreated_trial(srv: Any, rng: random.Random, trial: int) -> tuple[bool, str, int]:
    key = f"recreated{trial}"
    r = srv.client()
    n = rng.randint(400, 3000)
    ids = _produce(r, key, 0, n)
    b = rng.choice([4, 8, 16])
    pipe = quern.Pipeline.from_source(RedisStreamSource(srv.url, key, timeout=5)).batch(b)
    how = rng.choice(["all", "shifted"])
    delay = rng.uniform(0, 0.05)

    def recreate() -> None:
        time.sleep(delay)
        r2 = srv.client()
        r2.delete(key)
        p = r2.pipeline(transaction=False)
        if how == "shifted":  # one new entry first, then the old entries: every position moves by one
            p.xadd(key, {"v": "-1"}, id="0-1")
        for i, entry_id in enumerate(ids):
            p.xadd(key, {"v": str(i if how == "shifted" else i + 100_000)}, id=entry_id)
        p.execute()

    t = threading.Thread(target=recreate, daemon=True)
    t.start()
    refused = 0
    bad = []
    for _ in range(60):
        s = rng.randrange(n // b)
        try:
            got = [int(v) for v in pipe.batch_at(s)["v"]]
        except StepError as e:
            if not isinstance(e.__cause__, SourceError):
                bad.append(f"step {s}: {e!r}")
            refused += 1
            continue
        if got != list(range(s * b, (s + 1) * b)):
            bad.append(f"step {s} read {got[:3]}...")
    t.join(30)
    return not bad, "; ".join(bad[:2]), refused


def live_recreated_mid_read(trials: int, rng: random.Random, tmp: str) -> tuple[int, int, str]:
    with _server() as srv:
        if srv is None:
            return 0, 0, "not run: redis-server is not installed"
        held, bad, refused = 0, [], 0
        for trial in range(trials):
            ok, note, k = _recreated_trial(srv, rng, trial)
            held += ok
            refused += k
            if not ok:
                bad.append(note)
    return (
        trials,
        held,
        f"{refused} of {60 * trials} reads refused, the others the old entries"
        + (f"; FAILED: {bad[:2]}" if bad else ""),
    )


SCENARIOS: dict[str, Callable[[int, random.Random, str], tuple[int, int, str]]] = {
    "live resume remapped": live_resume_remapped,
    "live late commits": live_late_commits,
    "live recreated mid-read": live_recreated_mid_read,
}
