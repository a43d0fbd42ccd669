"""Tests of pipeline/iterate/auto.py: ``num_workers="auto"`` and ``num_threads="auto"``.

The choice never changes a byte: every step equals ``batch_at`` across the
switches from threads to more threads to worker processes, and the ledger
written across them checks. The choice itself is driven here by a clock the
test controls (timing claims are in ``benchmarks/``): the cheaper candidate
within 5% of the fastest is kept, and ``stats()["tuning"]`` says what was
tried, measured and chosen, and why.
"""

import time

import numpy as np
import pytest
import yaml
from helpers import quern_cmd, write_shards
from test_config import _good

import quern
from quern.pipeline.iterate import auto
from quern.pipeline.iterate.auto import AutoFeed, Candidate, candidates
from quern.pipeline.iterate.feed import FeedSettings


def _pipe(n=4000, pause=0.0, **kw):
    """Batches of 4 shuffled ints; each batch takes ``pause`` seconds more (a sleep)."""

    def slow(batch):
        time.sleep(pause)
        return batch

    pipe = quern.Pipeline.from_source(np.arange(n, dtype=np.int64), seed=7, **kw).shuffle().batch(4)
    return pipe.map_batch(slow) if pause else pipe


def test_candidates_cheapest_first():
    assert [c.name for c in candidates("auto", 1, cpus=4)] == ["num_threads=1", "num_workers=4"]
    assert [c.name for c in candidates(0, "auto", cpus=2)] == ["num_threads=1", "num_threads=2"]
    assert [c.name for c in candidates("auto", "auto", cpus=1)] == ["num_threads=1", "num_workers=1"]


def test_auto_yields_batch_at_across_every_switch_and_says_what_it_chose(tmp_path, monkeypatch):
    monkeypatch.setattr(auto, "WINDOW_SECONDS", 0.1)  # shorter windows: every candidate is measured in time
    monkeypatch.setattr(auto, "SETTLE_SECONDS", 0.05)
    monkeypatch.setattr(auto, "WORKER_START_S", 0.2)
    pipe = _pipe(n=8000, pause=0.001, num_epochs=1)
    ledger = tmp_path / "ledger-{process_index}.jsonl"
    with pipe.iterator(num_workers="auto", num_threads="auto", ledger=str(ledger)) as it:
        got = [b.copy() for b in it]
        tuning = it.stats()["tuning"]
    assert len(got) == pipe.num_steps == 2000
    for s in range(0, len(got)):
        np.testing.assert_array_equal(got[s], pipe.batch_at(s), err_msg=f"step {s}")
    assert tuning["tries"] == [c.name for c in candidates("auto", "auto")]  # threads, more threads, workers
    assert tuning["chose"] in tuning["tries"] and tuning["why"]
    assert 0 < tuning["at_step"] < 2000
    assert set(tuning["measured"]) == set(tuning["tries"])  # each measured, a switch at each
    assert quern.verify.check_ledger(pipe, str(tmp_path / "ledger-0.jsonl")).ok  # lines from every feed


def test_a_stream_too_short_to_measure_every_candidate_says_so_and_ends_right():
    pipe = _pipe(n=48, num_epochs=1)
    with pipe.iterator(num_workers="auto") as it:
        got = list(it)
        tuning = it.stats()["tuning"]
    assert [b.tolist() for b in got] == [pipe.batch_at(s).tolist() for s in range(12)]
    assert tuning["chose"] == "num_threads=1" and tuning["why"] == "the stream ended while num_threads=1 was measured"


def test_bad_values_are_refused_by_name():
    with pytest.raises(ValueError, match="num_workers must be an integer >= 0 or 'auto', got 'fast'"):
        _pipe().iterator(num_workers="fast")
    with pytest.raises(ValueError, match="num_threads must be an integer >= 1 or 'auto'"):
        _pipe().iterator(num_threads="many")


class _Clock:
    """A clock whose steps last ``cost[candidate]`` seconds, for the candidate serving."""

    def __init__(self, cost):
        self.t, self.cost, self.feed = 0.0, cost, None

    def __call__(self):
        if self.feed is not None:
            self.t += self.cost[self.feed.tries[self.feed._k].name]
        return self.t


def _drive(cost, steps=2000, tries=None):
    pipe = _pipe()
    clock = _Clock(cost)
    settings = FeedSettings(0, None, 0, 1, 2, None, False, False, False, False)
    feed = AutoFeed(pipe, settings, tries or candidates("auto", "auto", cpus=2), watch=False, clock=clock)
    clock.feed = feed
    try:
        for s in range(steps):
            np.testing.assert_array_equal(feed.get(s, stop=lambda: False, timeout=None), pipe.batch_at(s))
            if feed.decided and s > feed.tuning["at_step"] + 3:
                break
        return dict(feed.stats()["tuning"]), feed.tries[feed._k].name
    finally:
        feed.close()


def test_the_fastest_is_kept_and_a_cheaper_one_within_five_percent_wins():
    tuning, serving = _drive({"num_threads=1": 0.010, "num_threads=2": 0.008, "num_workers=2": 0.004})
    assert tuning["chose"] == serving == "num_workers=2" and "fastest" in tuning["why"]
    assert tuning["measured"]["num_workers=2"] == pytest.approx(250, rel=0.01)
    threads = [Candidate(1), Candidate(2)]
    tuning, serving = _drive({"num_threads=1": 0.0100, "num_threads=2": 0.0096}, tries=threads)
    assert tuning["chose"] == serving == "num_threads=1"  # the caller's step sets the pace: the cheapest
    assert "within 5% of the fastest" in tuning["why"]
    tuning, serving = _drive({"num_threads=1": 0.010, "num_threads=2": 0.005, "num_workers=2": 0.009})
    assert tuning["chose"] == serving == "num_threads=2"  # back from the workers to two threads


def test_workers_start_ahead_while_threads_serve(monkeypatch):
    monkeypatch.setattr(auto, "WORKER_START_S", 0.05)
    tuning, serving = _drive({"num_threads=1": 0.010, "num_workers=2": 0.002}, tries=[Candidate(1), Candidate(1, 2)])
    assert serving == "num_workers=2" and set(tuning["measured"]) == {"num_threads=1", "num_workers=2"}


def test_quern_bench_and_run_say_what_auto_chose(tmp_path):
    write_shards(tmp_path)
    (tmp_path / "p.yaml").write_text(yaml.safe_dump(_good(tmp_path)))
    env = {"QUERN_ALLOW": "test_config"}
    out = quern_cmd("bench", tmp_path / "p.yaml", "--steps", 30, "--workers", "auto", env=env).stdout
    (line,) = [x for x in out.splitlines() if x.startswith("tuning: ")]
    assert line == "tuning: not chosen yet (measuring num_threads=1); measured: nothing yet"  # 30 quick steps
    assert "30 steps, auto workers" in out
    out = quern_cmd("run", tmp_path / "p.yaml", "--steps", 20, "--workers", "auto", env=env).stdout
    assert "tuning: not chosen yet (measuring num_threads=1)" in out
    bad = quern_cmd("run", tmp_path / "p.yaml", "--workers", "many", check=False, env=env)
    assert bad.returncode == 2 and "--workers" in bad.stderr


def test_a_pipeline_workers_cannot_take_stays_on_threads_and_says_why(monkeypatch):
    import threading

    monkeypatch.setattr(auto, "WINDOW_SECONDS", 0.05)
    monkeypatch.setattr(auto, "SETTLE_SECONDS", 0.05)
    lock = threading.Lock()  # a lock does not pickle: no worker process can have this pipeline

    def locked(batch):
        with lock:
            time.sleep(0.0005)
        return batch

    pipe = _pipe().map_batch(locked)  # endless: the workers are tried, whatever the machine's pace
    with pipe.iterator(num_workers="auto") as it:
        for step, batch in enumerate(it):
            last, tuning = batch, it.stats()["tuning"]
            if tuning["chose"] or step > 20000:
                break
        np.testing.assert_array_equal(last, pipe.batch_at(step))
    assert tuning["chose"] == "num_threads=1" and tuning["why"].startswith("num_workers=")
    assert "cannot run this pipeline (TypeError" in tuning["why"] and it.worker_pids == []
