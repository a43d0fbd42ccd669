"""Faults of the live stream over Redis Streams: a consumer killed between commits, a redis-server
killed and restarted (or gone for good), wrong URLs and keys, a stream deleted and recreated or
with entries deleted from its middle, and closing an iterator whose threads wait for entries.

Every test starts its own redis-server (tests/redisserver.py) on 127.0.0.1; the trainer processes
run the installed package (``import quern``) with this interpreter, each with a timeout.
"""

from __future__ import annotations

import pickle
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pytest
from helpers import free_port
from redisserver import pad_of, produce

import quern
from quern import SourceError, StepError
from quern.pipeline.sources import RedisStreamSource

KEY = "ev"
B = 4  # rows of a step


def tonum(rec: dict) -> dict:
    return {"v": np.int64(int(rec["v"])), "pad": np.frombuffer(rec["pad"], dtype=np.uint8).copy()}


def live(src: RedisStreamSource) -> quern.Pipeline:
    return quern.Pipeline.from_source(src).map(tonum).batch(B)


def values(batch: dict) -> list[int]:
    return [int(x) for x in batch["v"]]


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and a[k].tobytes() == b[k].tobytes() for k in a)


def quern_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("quern-")}


def wait_until(cond: Any, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return bool(cond())


def non_redis_children() -> list[int]:
    out = []
    for p in psutil.Process().children(recursive=True):
        try:
            if p.name() != "redis-server" and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p.pid)
        except psutil.NoSuchProcess:
            pass
    return out


# ------------------------------------------------------------------ a trainer killed between commits

TRAINER = textwrap.dedent(
    """
    import os, sys
    import numpy as np
    import quern
    from quern.pipeline.sources import RedisStreamSource

    url, key, out, stop = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    B = int(sys.argv[5])

    def tonum(rec):
        return {"v": np.int64(int(rec["v"])), "pad": np.frombuffer(rec["pad"], dtype=np.uint8).copy()}

    src = RedisStreamSource(url, key, timeout=60, retry_seconds=10)
    start = src.committed()
    print("start", start, flush=True)
    pipe = quern.Pipeline.from_source(src).map(tonum).batch(B)
    with pipe.iterator(start_step=start) as it:
        for step in range(start, stop):
            batch = next(it)
            path = os.path.join(out, f"step{step:03d}")
            with open(path + ".tmp", "wb") as f:
                f.write(batch["v"].tobytes() + batch["pad"].tobytes())
            os.replace(path + ".tmp", path)  # this step was trained
            if (step + 1) % 5 == 0:  # a durable checkpoint that includes the step, then the commit
                with open(os.path.join(out, "checkpoint"), "w") as f:
                    f.write(str(step + 1))
                it.commit(step + 1)
    print("done", flush=True)
    """
)


def steps_written(folder: Path) -> dict[int, bytes]:
    return {
        int(p.name[4:]): p.read_bytes() for p in folder.iterdir() if p.name.startswith("step") and "." not in p.name
    }


def test_killed_consumer_resumes_at_the_commit_with_the_same_bytes(srv, tmp_path):
    r = srv.client()
    produce(r, 0, 12 * B)  # steps 0..11 exist: the first trainer then waits for step 12
    script = tmp_path / "trainer.py"
    script.write_text(TRAINER)
    first, second = tmp_path / "run1", tmp_path / "run2"
    first.mkdir()
    second.mkdir()
    cmd = [sys.executable, str(script), srv.url, KEY]
    proc = subprocess.Popen([*cmd, str(first), "20", str(B)], cwd=tmp_path, stdout=subprocess.PIPE, text=True)
    try:
        assert wait_until(lambda: len(steps_written(first)) >= 12 or proc.poll() is not None, 60), "no 12 steps"
        assert proc.poll() is None, "the first trainer ended by itself"
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    out1 = proc.stdout.read() if proc.stdout else ""
    assert out1.startswith("start 0") and "done" not in out1
    run1 = steps_written(first)
    assert sorted(run1) == list(range(12))
    src = RedisStreamSource(srv.url, KEY, timeout=5)
    assert src.committed() == 10 and (first / "checkpoint").read_text() == "10"

    produce(r, 12 * B, 20 * B)
    done = subprocess.run([*cmd, str(second), "20", str(B)], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["start", "10", "done"]
    run2 = steps_written(second)
    assert sorted(run2) == list(range(10, 20))
    assert all(run2[s] == run1[s] for s in (10, 11))  # replayed: the same bytes
    assert sorted(set(run1) | set(run2)) == list(range(20))  # none lost
    pipe = live(src)
    for s in range(20):
        want = pipe.batch_at(s)
        assert (run2 if s >= 10 else run1)[s] == want["v"].tobytes() + want["pad"].tobytes()
    assert src.committed() == 20


# ------------------------------------------------------------------ the server killed and restarted, or gone


@pytest.mark.parametrize("workers", [0, 2])
def test_server_killed_and_restarted_mid_run(srv, workers):
    # the server is killed and restarted by this (the main) thread: redis-server gets SIGTERM when
    # the thread that started it ends (tests/redisserver.py), so the consumer runs on a thread of its own
    r = srv.client()
    produce(r, 0, 10 * B)
    src = RedisStreamSource(srv.url, KEY, timeout=30, retry_seconds=30)
    pipe = live(src)
    want = [pipe.batch_at(s) for s in range(10)]
    took, killed = threading.Event(), threading.Event()
    got: list[dict] = []
    errors: list[BaseException] = []

    def consume() -> None:
        try:
            with pipe.iterator(num_workers=workers, prefetch=1) as it:
                got.extend(next(it) for _ in range(3))
                took.set()
                killed.wait(30)
                got.extend(next(it) for _ in range(3, 12))
        except BaseException as e:  # noqa: BLE001 (reported below)
            errors.append(e)
        finally:
            took.set()

    consumer = threading.Thread(target=consume, name="test-consumer", daemon=True)
    consumer.start()
    assert took.wait(60)
    srv.kill()
    killed.set()
    time.sleep(1.0)  # the consumer retries meanwhile
    srv.restart()
    produce(srv.client(), 10 * B, 12 * B)
    consumer.join(60)
    assert not consumer.is_alive()
    assert not errors, errors
    assert len(got) == 12
    assert all(same(got[s], want[s]) for s in range(10))
    assert [values(g) for g in got[10:]] == [list(range(40, 44)), list(range(44, 48))]
    assert srv.client().xlen(KEY) == 12 * B  # the AOF kept every entry


def test_server_that_stays_down_fails_naming_the_url(srv):
    produce(srv.client(), 0, 8 * B)
    src = RedisStreamSource(srv.url, KEY, timeout=30, retry_seconds=2)
    pipe = live(src)
    assert values(pipe.batch_at(0)) == list(range(B))
    srv.kill()
    t0 = time.monotonic()
    with pytest.raises(StepError, match=f"cannot reach Redis at {srv.url}") as e:
        pipe.batch_at(1)
    assert 2.0 <= time.monotonic() - t0 < 8  # retried for retry_seconds (then given up)
    assert isinstance(e.value.__cause__, SourceError)
    t0 = time.monotonic()
    with pytest.raises(Exception, match=f"cannot reach Redis at {srv.url}"):
        with pipe.iterator(2) as it:  # its open reads the commit record
            next(it)
    assert time.monotonic() - t0 < 10
    t0 = time.monotonic()
    with pytest.raises(SourceError, match=f"cannot reach Redis at {srv.url}"):
        src.committed()
    assert 2.0 <= time.monotonic() - t0 < 8


def test_server_back_within_retry_seconds_is_not_given_up_on(srv):
    """retry_seconds=3: a server back 2 s after it went away is reached again (the read is retried for 3 s)."""
    produce(srv.client(), 0, 4 * B)
    src = RedisStreamSource(srv.url, KEY, timeout=30, retry_seconds=3)
    pipe = live(src)
    assert values(pipe.batch_at(0)) == list(range(B))
    outcome: list[Any] = []

    def read() -> None:
        try:
            outcome.append(values(pipe.batch_at(1)))
        except BaseException as e:  # noqa: BLE001 (looked at below)
            outcome.append(e)

    srv.kill()
    t0 = time.monotonic()
    reader = threading.Thread(target=read, name="test-reader", daemon=True)
    reader.start()
    time.sleep(2.0)
    srv.restart()  # on this thread: see test_server_killed_and_restarted_mid_run
    back = time.monotonic() - t0
    reader.join(10)
    assert back < 2.8, f"the restart itself took until {back:.2f} s"
    assert outcome == [list(range(B, 2 * B))], f"server back after {back:.2f} s of retry_seconds=3: {outcome}"


def test_close_while_the_server_is_down(srv):
    produce(srv.client(), 0, 2 * B)
    before = quern_threads()
    it = live(RedisStreamSource(srv.url, KEY, timeout=30, retry_seconds=30)).iterator()
    next(it)
    next(it)
    time.sleep(0.3)  # the prefetch waits for step 2's entries
    srv.kill()
    time.sleep(0.3)  # ... and now retries
    t0 = time.monotonic()
    it.close()
    assert time.monotonic() - t0 < 3
    assert wait_until(lambda: not (quern_threads() - before), 4), [t.name for t in quern_threads() - before]


# ------------------------------------------------------------------ wrong URL, wrong key, another stream


def test_wrong_urls_fail_quickly_naming_the_url():
    url = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    t0 = time.monotonic()
    with pytest.raises(SourceError, match=f"cannot reach Redis at {url}"):
        RedisStreamSource(url, KEY, timeout=1)  # the default retry_seconds=30: not retried at open
    assert time.monotonic() - t0 < 5
    for bad in ("notaurl://127.0.0.1/0", "redis://127.0.0.1:notaport/0"):
        t0 = time.monotonic()
        with pytest.raises(SourceError, match=f"bad Redis URL '{bad}'"):
            RedisStreamSource(bad, KEY, timeout=1, retry_seconds=1)
        assert time.monotonic() - t0 < 1


def test_a_key_that_holds_a_string(srv):
    srv.client().set("s", "hello")
    with pytest.raises(SourceError, match=r"key 's' at .* does not hold a stream.*WRONGTYPE"):
        RedisStreamSource(srv.url, "s", timeout=1)


def test_a_key_that_does_not_exist_times_out_at_open(srv):
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="no entries in stream 'nothere'"):
        RedisStreamSource(srv.url, "nothere", timeout=1)
    assert 0.9 <= time.monotonic() - t0 < 4


def test_a_stream_that_comes_while_the_source_opens(srv):
    r = srv.client()

    def later() -> None:
        time.sleep(0.5)
        produce(r, 0, 2 * B)

    threading.Thread(target=later, daemon=True).start()
    src = RedisStreamSource(srv.url, KEY, timeout=10)
    assert values(live(src).batch_at(1)) == list(range(B, 2 * B))


def test_a_stream_deleted_and_recreated_is_refused_at_open(srv):
    r = srv.client()
    produce(r, 0, 3 * B)
    src = RedisStreamSource(srv.url, KEY, timeout=2)
    live(src).batch_at(1)
    r.delete(KEY)
    with pytest.raises(SourceError, match="no longer exists"):
        RedisStreamSource(srv.url, KEY, timeout=2)
    produce(r, 0, 3 * B)  # the same key, a new stream (new IDs)
    with pytest.raises(SourceError, match="recreated"):
        RedisStreamSource(srv.url, KEY, timeout=2)
    produce(r, 3 * B, 6 * B)  # longer than the old one: still another stream
    with pytest.raises(SourceError, match="recreated"):
        RedisStreamSource(srv.url, KEY, timeout=2)


def test_a_stream_recreated_while_a_source_reads_it(srv):
    """An open source whose stream is deleted and recreated under its key refuses it, as a source opened
    anew does, instead of reading the new stream's entries at positions of the old one."""
    r = srv.client()
    produce(r, 0, 10 * B)
    src = RedisStreamSource(srv.url, KEY, timeout=1)
    pipe = live(src)
    old = {s: values(pipe.batch_at(s)) for s in (2, 9)}
    assert old == {2: list(range(2 * B, 3 * B)), 9: list(range(9 * B, 10 * B))}
    r.delete(KEY)
    p = r.pipeline(transaction=False)
    for i in range(15 * B):
        p.xadd(KEY, {"v": str(1000 + i), "pad": pad_of(i)})
    p.execute()
    got = {}
    for s in (2, 3, 9, 12):
        try:
            got[s] = values(pipe.batch_at(s))
        except StepError as e:
            assert isinstance(e.__cause__, SourceError), e
    assert got == {}, f"steps read from the recreated stream as if it were the old one: {got}"


def recreate(r: Any, ids: list[str], value: Any) -> None:
    """Delete the stream and add entries with the same IDs again, entry ``i`` with ``v = value(i)``."""
    r.delete(KEY)
    p = r.pipeline(transaction=False)
    for i, entry_id in enumerate(ids):
        p.xadd(KEY, {"v": str(value(i)), "pad": pad_of(i)}, id=entry_id)
    p.execute()


def test_a_stream_recreated_with_the_same_ids_and_other_content_is_refused(srv):
    """The same entry IDs, other fields: the origin entry's content differs, at open and at a read."""
    r = srv.client()
    ids = produce(r, 0, 10 * B)
    src = RedisStreamSource(srv.url, KEY, timeout=2)
    pipe = live(src)
    assert values(pipe.batch_at(2)) == list(range(8, 12))
    before = pipe.fingerprint()
    recreate(r, ids, lambda i: 1000 + i)
    with pytest.raises(SourceError, match=r"other fields.*recreated"):
        RedisStreamSource(srv.url, KEY, timeout=2)
    got = {}
    for s in (0, 2, 3, 9):  # step 0: read from the origin itself
        try:
            got[s] = values(pipe.batch_at(s))
        except StepError as e:
            assert isinstance(e.__cause__, SourceError) and "fields" in str(e.__cause__), e
    assert got == {}, f"steps read from the recreated stream as if it were the old one: {got}"
    for k in r.keys(f"{KEY}:quern:*"):  # a new record of the new stream: another identity
        r.delete(k)
    assert live(RedisStreamSource(srv.url, KEY, timeout=2)).fingerprint() != before


def test_a_stream_recreated_with_the_same_origin_entry_is_refused_by_its_anchors(srv):
    """The origin entry byte for byte the same, later entries other: the newest anchor kept beside the
    stream differs (at open), and so does any anchor a read starts from."""
    r = srv.client()
    ids = produce(r, 0, 3000)
    src = RedisStreamSource(srv.url, KEY, timeout=2)
    pipe = live(src)
    assert values(pipe.batch_at(625)) == list(range(2500, 2504))  # keeps an anchor beside the stream
    assert values(pipe.batch_at(100)) == list(range(400, 404))
    recreate(r, ids, lambda i: i if i == 0 else 1000 + i)
    with pytest.raises(SourceError, match="recreated"):
        RedisStreamSource(srv.url, KEY, timeout=2)
    with pytest.raises(StepError) as e:
        pipe.batch_at(700)  # read on from the newest anchor this source knows
    assert isinstance(e.value.__cause__, SourceError)


def test_entries_deleted_from_the_middle(srv):
    r = srv.client()
    ids = produce(r, 0, 10 * B)
    src = RedisStreamSource(srv.url, KEY, timeout=2)
    pipe = live(src)
    assert values(pipe.batch_at(1)) == list(range(B, 2 * B))
    r.xdel(KEY, ids[5 * B + 1])
    for s in (1, 5, 8):
        with pytest.raises(StepError, match=r"deleted from the middle.*XDEL") as e:
            pipe.batch_at(s)
        assert isinstance(e.value.__cause__, SourceError)
    with pytest.raises(SourceError, match="deleted from the middle"):
        RedisStreamSource(srv.url, KEY, timeout=2)  # a fresh source refuses it at open
    with pipe.iterator(6) as it:
        with pytest.raises(StepError, match="deleted from the middle"):
            next(it)


def test_entries_deleted_from_the_middle_before_any_source(srv):
    r = srv.client()
    ids = produce(r, 0, 10 * B)
    r.xdel(KEY, ids[7])
    with pytest.raises(SourceError, match="deleted from the middle"):
        RedisStreamSource(srv.url, KEY, timeout=2)


# ------------------------------------------------------------------ closing while waiting for entries


def test_close_while_prefetch_threads_wait(srv):
    r = srv.client()
    produce(r, 0, B)
    before = quern_threads()
    it = live(RedisStreamSource(srv.url, KEY, timeout=30)).iterator()
    assert values(next(it)) == list(range(B))
    assert wait_until(lambda: any(t.name.startswith("quern-step-") for t in quern_threads() - before), 3)
    t0 = time.monotonic()
    it.close()
    assert time.monotonic() - t0 < 3
    assert wait_until(lambda: not (quern_threads() - before), 4), [t.name for t in quern_threads() - before]


def test_close_while_next_waits_in_another_thread(srv):
    r = srv.client()
    produce(r, 0, B)
    before = quern_threads()
    it = live(RedisStreamSource(srv.url, KEY, timeout=30)).iterator()
    next(it)
    outcome: list[BaseException | None] = []

    def consume() -> None:
        try:
            next(it)
            outcome.append(None)
        except BaseException as e:  # noqa: BLE001 (looked at below)
            outcome.append(e)

    consumer = threading.Thread(target=consume, name="test-consumer", daemon=True)
    consumer.start()
    time.sleep(0.5)
    t0 = time.monotonic()
    it.close()
    consumer.join(5)
    assert time.monotonic() - t0 < 3 and not consumer.is_alive()
    assert len(outcome) == 1 and outcome[0] is not None  # it gave up: no batch
    assert wait_until(lambda: not (quern_threads() - before), 4), [t.name for t in quern_threads() - before]


def test_close_with_workers_waiting(srv):
    r = srv.client()
    produce(r, 0, B)
    before = set(non_redis_children())
    it = live(RedisStreamSource(srv.url, KEY, timeout=30)).iterator(num_workers=2)
    assert values(next(it)) == list(range(B))
    time.sleep(0.5)  # the workers wait for steps 1, 2, ...
    assert set(non_redis_children()) - before
    t0 = time.monotonic()
    it.close()
    assert time.monotonic() - t0 < 3
    assert wait_until(lambda: not (set(non_redis_children()) - before), 4)


def test_a_stream_whose_count_of_entries_went_down_is_refused(srv):
    """Entries lost in a restart (entries-added goes down): the positions after them would name other entries."""
    r = srv.client()
    ids = produce(r, 0, 6 * B)
    pipe = live(RedisStreamSource(srv.url, KEY, timeout=5, retry_seconds=5))
    assert values(pipe.batch_at(4)) == list(range(4 * B, 5 * B))
    r.xtrim(KEY, maxlen=2 * B, approximate=False)
    r.execute_command("XSETID", KEY, ids[-1], "ENTRIESADDED", 5 * B)  # as if the last step's entries were lost
    with pytest.raises(StepError, match="fewer than the"):
        pipe.batch_at(5)


def test_a_trainer_reading_in_order_keeps_an_anchor_every_1024_positions(srv):
    """Read step by step (each read near the last), the source still keeps an anchor beside the stream
    in each block of 1,024 positions it read, so a stream recreated with the same IDs and origin entry
    but other later entries is refused at open, and by a read from a far resume step."""
    r = srv.client()
    ids = produce(r, 0, 2100)
    src = RedisStreamSource(srv.url, KEY, timeout=2)
    with live(src).iterator() as it:
        for _ in range(2100 // B):
            next(it)
        it.commit(300)
    kept = sorted(int(score) // 1024 for _, score in r.zrange(f"{KEY}:quern:anchors", 0, -1, withscores=True))
    assert kept == [0, 1, 2], kept
    recreate(r, ids, lambda i: i if i == 0 else 100_000 + i)
    with pytest.raises(SourceError, match="holds other fields.*recreated"):
        RedisStreamSource(srv.url, KEY, timeout=2)
    with pytest.raises(StepError) as e:  # the open source reads on from a kept anchor
        live(pickle.loads(pickle.dumps(src))).batch_at(400)  # a copy that knows only the origin (a worker's)
    assert isinstance(e.value.__cause__, SourceError) and "fields" in str(e.value.__cause__)


def test_a_stream_recreated_with_an_entry_before_its_origin_is_refused(srv):
    """The old entries with their IDs and fields, after one new first entry: every position shifts by
    one. Refused at open and by a source already open, at once (not a busy wait past its timeout)."""
    r = srv.client()
    ids = produce(r, 0, 25 * B)
    src = RedisStreamSource(srv.url, KEY, timeout=2)
    pipe = live(src)
    assert values(pipe.batch_at(0)) == [0, 1, 2, 3]
    r.delete(KEY)
    r.xadd(KEY, {"v": "1000", "pad": pad_of(0)}, id="0-1")
    p = r.pipeline(transaction=False)
    for i, entry_id in enumerate(ids):
        p.xadd(KEY, {"v": str(i), "pad": pad_of(i)}, id=entry_id)
    p.execute()
    with pytest.raises(SourceError, match=r"first entry is b'0-1' at position 0.*recreated"):
        RedisStreamSource(srv.url, KEY, timeout=2)
    for step in (0, 24, 25):
        began = time.monotonic()
        with pytest.raises(StepError) as e:
            pipe.batch_at(step)
        assert isinstance(e.value.__cause__, SourceError), e.value
        assert "not the stream this source read" in str(e.value.__cause__)
        assert time.monotonic() - began < 2, f"step {step} took {time.monotonic() - began:.1f} s"
