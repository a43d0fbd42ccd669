"""The live stream over Redis Streams (pipeline/sources/redis_stream.py, pipeline/streams/live.py).

Every test starts its own redis-server (tests/redisserver.py) on 127.0.0.1 and writes entries with
redis-py. This file covers what a step is (records, positions, transforms, host slices, workers,
``explain``, the steps shuffle), waiting for entries that do not exist yet (``batch_at``, the iterator,
``timeout=``), trimming, commits (hosts, host-count changes) and what a live pipeline refuses.
Failures of the server, the consumer and the stream: test_redis_stream_faults.py.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from redisserver import RedisServer, pad_of, produce

import quern
from quern import SourceError, StepError, StreamTimeoutError
from quern.pipeline.sources import RedisStreamSource
from quern.pipeline.sources.redis_stream import entry_digest

KEY = "ev"


def produce_later(r: Any, start: int, stop: int, delay: float) -> threading.Thread:
    """A producer thread that adds entries ``[start, stop)`` after ``delay`` seconds (started)."""

    def run() -> None:
        time.sleep(delay)
        produce(r, start, stop)

    t = threading.Thread(target=run, name="test-producer", daemon=True)
    t.start()
    return t


def tonum(rec: dict) -> dict:
    """An entry as arrays: ``v`` (int64) and ``pad`` (uint8)."""
    return {"v": np.int64(int(rec["v"])), "pad": np.frombuffer(rec["pad"], dtype=np.uint8).copy()}


def noisy(rec: dict, rng: Any) -> dict:
    """A random transform: ``noise``, drawn from the record's own generator."""
    return {**tonum(rec), "noise": rng.random()}


def plus_one(batch: dict) -> dict:
    """A batch transform: ``w = v + 1``."""
    return {**batch, "w": batch["v"] + 1}


def values(batch: dict) -> list[int]:
    return [int(x) for x in batch["v"]]


def same(a: dict, b: dict) -> bool:
    """The two batches hold the same keys and the same bytes."""
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and a[k].tobytes() == b[k].tobytes() for k in a
    )


def source(srv: RedisServer, **kw: Any) -> RedisStreamSource:
    kw.setdefault("timeout", 5)
    kw.setdefault("retry_seconds", 5)
    return RedisStreamSource(srv.url, KEY, **kw)


def live(src: RedisStreamSource, b: int = 8, seed: int = 0, steps: int | None = None) -> quern.Pipeline:
    pipe = quern.Pipeline.from_source(src, seed=seed)
    if steps is not None:
        pipe = pipe.shuffle("steps", steps=steps)
    return pipe.map(tonum).batch(b)


# ------------------------------------------------------------------ records, steps, positions


def test_record_is_the_entry_fields_as_a_dict(srv):
    r = srv.client()
    ids = produce(r, 0, 20)
    src = source(srv)
    assert src.origin == (0, ids[0])
    digest = entry_digest({b"v": b"0", b"pad": pad_of(0)})
    assert src.origin_digest == digest
    assert src.identity() == {
        "type": "RedisStreamSource",
        "name": KEY,
        "key": KEY,
        "origin": [0, ids[0]],
        "origin_digest": digest,
    }
    rows = src.read_many(np.array([3, 0, 3]))
    assert rows == [{"v": b"3", "pad": pad_of(3)}, {"v": b"0", "pad": pad_of(0)}, {"v": b"3", "pad": pad_of(3)}]
    assert all(type(k) is str and type(v) is bytes for row in rows for k, v in row.items())
    seen: list[dict] = []
    pipe = quern.Pipeline.from_source(src).map(lambda rec: seen.append(rec) or tonum(rec)).batch(4)
    pipe.batch_at(2)
    assert seen == [{"v": str(i).encode(), "pad": pad_of(i)} for i in range(8, 12)]
    with pytest.raises(TypeError, match="live stream"):
        len(src)


def test_step_is_the_entries_of_its_positions_in_id_order(srv):
    r = srv.client()
    produce(r, 0, 64)
    pipe = live(source(srv)).map_batch(plus_one)
    for s in (0, 3, 7):
        batch = pipe.batch_at(s)
        assert values(batch) == list(range(8 * s, 8 * s + 8))
        assert [bytes(row) for row in batch["pad"]] == [pad_of(i) for i in range(8 * s, 8 * s + 8)]
        assert batch["w"].tolist() == [v + 1 for v in values(batch)]
    with pipe.iterator() as it:
        got = [next(it) for _ in range(8)]
    assert all(same(g, pipe.batch_at(s)) for s, g in enumerate(got))


def test_host_slices_are_rows_of_the_same_entries(srv):
    r = srv.client()
    produce(r, 0, 64)
    for pipe in (live(source(srv)), live(source(srv), steps=2)):
        for s in (0, 5):
            whole = pipe.batch_at(s)
            parts = [pipe.batch_at(s, h, 4) for h in range(4)]
            assert [len(p["v"]) for p in parts] == [2, 2, 2, 2]
            assert np.concatenate([p["v"] for p in parts]).tolist() == values(whole)
            assert np.concatenate([p["pad"] for p in parts]).tobytes() == whole["pad"].tobytes()
        with pipe.iterator(3, process_index=1, process_count=2) as it:
            for s in range(3, 6):
                assert same(next(it), pipe.batch_at(s, 1, 2))


def test_workers_give_the_batches_of_batch_at(srv):
    r = srv.client()
    produce(r, 0, 48)
    src = source(srv)
    noisy_pipe = quern.Pipeline.from_source(src, seed=3).random_map(noisy).batch(8)
    for pipe in (live(src).map_batch(plus_one), live(src, steps=3), noisy_pipe):
        want = [pipe.batch_at(s) for s in range(6)]
        with pipe.iterator(num_workers=2) as it:
            assert all(same(next(it), want[s]) for s in range(6))
    pipe = live(src)
    with pipe.iterator(2, num_workers=2, process_index=1, process_count=2) as it:
        for s in range(2, 6):
            assert same(next(it), pipe.batch_at(s, 1, 2))
        it.commit(6)
    assert src.committed() == 0  # host 0 of the two has not committed
    src.commit(6, 0, 2)
    assert src.committed() == 6


def test_workers_wait_for_entries_that_come_later(srv):
    r = srv.client()
    produce(r, 0, 16)
    pipe = live(source(srv, timeout=20))
    with pipe.iterator(num_workers=2) as it:
        assert values(next(it)) == list(range(8))
        assert values(next(it)) == list(range(8, 16))
        produce_later(r, 16, 40, delay=0.5)
        for s in (2, 3, 4):
            assert values(next(it)) == list(range(8 * s, 8 * s + 8))


def test_explain_names_entry_ids(srv):
    r = srv.client()
    ids = produce(r, 0, 40)
    pipe = live(source(srv))
    assert pipe.explain(1) == [[(KEY, ids[p])] for p in range(8, 16)]
    assert pipe.explain(2, 1, 2) == [[(KEY, ids[p])] for p in range(20, 24)]
    assert all(isinstance(e, str) for row in pipe.explain(0) for _, e in row)
    shuffled = live(source(srv), steps=2)
    batch = shuffled.batch_at(1)
    assert shuffled.explain(1) == [[(KEY, ids[v])] for v in values(batch)]  # each row's own entry


def test_shuffle_steps_permutes_groups_of_whole_steps(srv):
    r = srv.client()
    produce(r, 0, 96)
    b, w = 8, 3
    pipe = live(source(srv), b=b, seed=7, steps=w)
    order = [values(pipe.batch_at(s)) for s in range(12)]
    for g in range(4):
        group = sum(order[g * w : (g + 1) * w], [])
        assert sorted(group) == list(range(g * w * b, (g + 1) * w * b))  # a permutation of its positions
    assert sum(order, []) != list(range(96))
    again = live(source(srv), b=b, seed=7, steps=w)  # same seed, another source object: same order
    assert [values(again.batch_at(s)) for s in range(12)] == order
    other = live(source(srv), b=b, seed=8, steps=w)
    assert [values(other.batch_at(s)) for s in range(12)] != order
    with other.iterator(num_workers=0) as it:
        assert [values(next(it)) for _ in range(6)] == [values(other.batch_at(s)) for s in range(6)]


@pytest.mark.parametrize("mode", ["global", "block"])
def test_other_shuffle_modes_are_refused(srv, mode):
    produce(srv.client(), 0, 8)
    pipe = quern.Pipeline.from_source(source(srv))
    with pytest.raises(ValueError, match=f"mode '{mode}'.*steps"):
        pipe.shuffle(mode)
    with pytest.raises(ValueError, match="steps=W"):
        pipe.shuffle("steps")


def test_positions_are_not_renumbered_by_trimming(srv):
    r = srv.client()
    ids = produce(r, 0, 100)
    src = source(srv)
    pipe = live(src)
    before = [pipe.batch_at(s) for s in (4, 11)]
    r.xtrim(KEY, maxlen=70, approximate=False)  # positions 0..29 gone
    assert same(pipe.batch_at(4), before[0]) and same(pipe.batch_at(11), before[1])
    fresh = source(srv)
    assert fresh.origin == (0, ids[0]) and fresh.identity() == src.identity()
    assert same(live(fresh).batch_at(11), before[1])
    assert live(fresh).explain(11) == [[(KEY, ids[p])] for p in range(88, 96)]
    produce(r, 100, 112)
    assert values(live(fresh).batch_at(13)) == list(range(104, 112))


def test_a_stream_trimmed_before_it_was_first_read(srv):
    r = srv.client()
    ids = produce(r, 0, 100)
    r.xtrim(KEY, maxlen=40, approximate=False)  # the stream now starts at position 60
    src = source(srv)
    assert src.origin == (60, ids[60])
    pipe = live(src)
    assert values(pipe.batch_at(8)) == list(range(64, 72))
    assert pipe.explain(9) == [[(KEY, ids[p])] for p in range(72, 80)]
    with pytest.raises(StepError, match=r"step 7\b.*position 56\b.*trimmed"):
        pipe.batch_at(7)


def test_trimmed_entries_are_an_error_naming_step_and_first_missing_position(srv):
    r = srv.client()
    produce(r, 0, 100)
    src = source(srv)
    pipe = live(src)
    assert values(pipe.batch_at(0)) == list(range(8))
    r.xtrim(KEY, maxlen=80, approximate=False)  # positions 0..19 gone: step 2 (16..23) lacks 16..19
    with pytest.raises(StepError, match=r"step 2\b.*position 16\b.*trimmed") as e:
        pipe.batch_at(2)
    assert isinstance(e.value.__cause__, SourceError)
    assert values(pipe.batch_at(3)) == list(range(24, 32))  # held entirely: fine
    with pipe.iterator(1) as it:
        with pytest.raises(StepError, match=r"step 1\b.*position 8\b"):
            next(it)
    with live(source(srv)).iterator(2, num_workers=2) as it:
        with pytest.raises(StepError, match=r"step 2\b.*position 16\b"):
            next(it)


def test_far_positions_across_anchors(srv):
    """Thousands of entries: a fresh source finds far positions (anchors kept beside the stream), also after a trim."""
    r = srv.client()
    ids = produce(r, 0, 5000)
    first = live(source(srv))
    assert values(first.batch_at(400)) == list(range(3200, 3208))
    for pipe in (live(source(srv)), live(source(srv))):
        assert values(pipe.batch_at(610)) == list(range(4880, 4888))
        assert values(pipe.batch_at(250)) == list(range(2000, 2008))
    r.xtrim(KEY, maxlen=2500, approximate=False)  # starts at position 2500
    fresh = live(source(srv))
    assert values(fresh.batch_at(320)) == list(range(2560, 2568))
    assert values(fresh.batch_at(624)) == list(range(4992, 5000))
    assert fresh.explain(500) == [[(KEY, ids[p])] for p in range(4000, 4008)]
    with pytest.raises(StepError, match=r"position 2496\b"):
        fresh.batch_at(312)


# ------------------------------------------------------------------ waiting for entries


def test_batch_at_waits_for_entries_that_come_later(srv):
    r = srv.client()
    produce(r, 0, 10)
    pipe = live(source(srv, timeout=10))
    producer = produce_later(r, 10, 40, delay=0.6)
    t0 = time.monotonic()
    assert values(pipe.batch_at(3)) == list(range(24, 32))
    assert time.monotonic() - t0 >= 0.5
    producer.join(5)


def test_batch_at_times_out_naming_the_step(srv):
    produce(srv.client(), 0, 10)
    pipe = live(source(srv, timeout=1))
    t0 = time.monotonic()
    with pytest.raises(StreamTimeoutError, match=r"step 5\b") as e:
        pipe.batch_at(5)
    assert 0.9 <= time.monotonic() - t0 < 4
    assert isinstance(e.value, TimeoutError)


@pytest.mark.parametrize("workers", [0, 2])
def test_iterator_waits_and_its_prefetch_never_times_out_by_itself(srv, workers):
    r = srv.client()
    produce(r, 0, 16)
    pipe = live(source(srv, timeout=2))
    with pipe.iterator(num_workers=workers) as it:
        assert values(next(it)) == list(range(8))
        assert values(next(it)) == list(range(8, 16))
        time.sleep(3)  # longer than timeout, while the prefetch waits for steps 2, 3, ...
        produce(r, 16, 32)
        assert values(next(it)) == list(range(16, 24))
        assert values(next(it)) == list(range(24, 32))
        t0 = time.monotonic()
        with pytest.raises(StreamTimeoutError, match=r"step 4\b.*timeout=2") as e:
            next(it)
        assert 1.8 <= time.monotonic() - t0 < 5
        assert isinstance(e.value, TimeoutError)
        assert it.step == 4
        produce_later(r, 32, 48, delay=0.5)
        assert values(next(it)) == list(range(32, 40))  # next() again goes on waiting, then returns the step
        assert values(next(it)) == list(range(40, 48))


def test_iterator_with_workers_times_out_and_goes_on(srv):
    r = srv.client()
    produce(r, 0, 8)
    pipe = live(source(srv, timeout=1.5))
    with pipe.iterator(num_workers=2) as it:
        assert values(next(it)) == list(range(8))
        t0 = time.monotonic()
        with pytest.raises(StreamTimeoutError, match=r"step 1\b"):
            next(it)
        assert time.monotonic() - t0 < 5
        produce_later(r, 8, 24, delay=0.3)
        assert values(next(it)) == list(range(8, 16))
        assert values(next(it)) == list(range(16, 24))


def test_where_names_the_step_and_row_of_an_entry(srv):
    """``where(p)`` of a live stream: the step and row of the entry at position ``p`` (its record id),
    in log order and shuffled within windows of steps; the row ``explain`` names by that entry's ID."""
    r = srv.client()
    ids = produce(r, 0, 96)
    assert live(source(srv)).where(37) == [(4, 5)]
    for pipe in (live(source(srv)), live(source(srv), seed=3, steps=3)):
        for p in (0, 5, 37, 95, 96, 500):
            [(s, row)] = pipe.where(p, epochs=2)  # one pass: a live stream has no epochs
            if p < 96:
                assert pipe.explain(s)[row] == [(KEY, ids[p])]
                assert values(pipe.batch_at(s))[row] == p
            else:
                assert s >= 12  # an entry that does not exist yet: where it will be
    with pytest.raises(ValueError, match="record must be >= 0"):
        live(source(srv)).where(-1)


def test_edits_are_refused_as_the_lineage_guide_says(srv):
    produce(srv.client(), 0, 16)
    pipe = live(source(srv))
    with pytest.raises(ValueError, match=r"skip_steps\(\) does not apply to a live stream.*start_step"):
        pipe.skip_steps(1, 2)
    with pytest.raises(ValueError, match=r"exclude\(\) does not apply to a live stream"):
        pipe.exclude([3], from_step=1)
    guide = (Path(__file__).parents[1] / "docs" / "guides" / "lineage-and-edits.md").read_text()
    assert "works on every pipeline but a live stream, which refuses both edits" in guide


# ------------------------------------------------------------------ commits


def test_commit_after_the_step(srv):
    r = srv.client()
    produce(r, 0, 40)
    src = source(srv)
    pipe = live(src)
    assert src.committed() == 0
    with pipe.iterator() as it:
        for _ in range(3):
            next(it)
        with pytest.raises(ValueError, match=r"commit\(4\).*not yielded"):
            it.commit(4)
        assert src.committed() == 0
        it.commit(3)
        assert src.committed() == 3
        assert source(srv).committed() == 3  # in Redis: another source object sees it
        it.commit(1)  # commits only move forward
        assert src.committed() == 3
    with pipe.iterator(start_step=src.committed()) as it:
        assert values(next(it)) == list(range(24, 32))
        it.commit(4)
    assert source(srv).committed() == 4
    other_group = source(srv, group="other")
    assert other_group.committed() == 0


def test_commit_of_several_hosts_and_host_count_changes(srv):
    r = srv.client()
    produce(r, 0, 80)
    src = source(srv)
    pipe = live(src, b=4)

    def run(start: int, stop: int, h: int, hosts: int) -> None:
        with pipe.iterator(start, process_index=h, process_count=hosts) as it:
            for s in range(start, stop):
                assert same(next(it), pipe.batch_at(s, h, hosts))
            it.commit(stop)

    run(0, 10, 0, 2)
    assert src.committed() == 0  # host 1 has not committed
    run(0, 10, 1, 2)
    assert src.committed() == 10
    run(src.committed(), 15, 0, 1)  # one host resumes
    assert src.committed() == 15
    run(src.committed(), 17, 0, 4)  # four hosts: only host 0 commits
    assert src.committed() == 15
    for h in (1, 2):
        run(15, 17, h, 4)
    assert src.committed() == 15
    run(15, 16, 3, 4)
    assert src.committed() == 16
    run(16, 17, 3, 4)
    assert src.committed() == 17


def test_commit_refused_without_a_live_stream():
    pipe = quern.Pipeline.from_source({"x": np.arange(10)}).batch(2)
    with pipe.iterator() as it:
        next(it)
        with pytest.raises(ValueError, match="live stream"):
            it.commit(1)
        with pytest.raises(ValueError, match="live stream"):
            it.commit(0)


# ------------------------------------------------------------------ what a live pipeline refuses, its identity


def test_config_epochs_and_fingerprint(srv):
    r = srv.client()
    produce(r, 0, 16)
    produce(r, 0, 16, key="other")
    a, b = source(srv), source(srv)
    assert live(a).fingerprint() == live(b).fingerprint()
    assert live(a).fingerprint() != live(a, seed=1).fingerprint()
    assert live(a).fingerprint() != live(a, steps=2).fingerprint()
    assert live(a).fingerprint() != live(RedisStreamSource(srv.url, "other", timeout=5)).fingerprint()
    with pytest.raises(ValueError, match="config"):
        live(a).to_config()
    with pytest.raises(ValueError, match="num_epochs"):
        quern.Pipeline.from_source(a, num_epochs=1)


def test_step_timeout_is_refused_on_a_live_stream(srv):
    produce(srv.client(), 0, 8)
    pipe = live(source(srv))
    with pytest.raises(ValueError, match="step_timeout=5 on a live stream"):
        pipe.iterator(step_timeout=5)
