"""Where the time goes: stage timings, the caller's data wait and bubble rate, the
health by the 50% / 80% thresholds, and the adaptive prefetch window.

The figures are checked against sleeps of known length (lower bounds, which hold
on any machine) and against a consumer that is clearly faster or slower than the
loader; no test asserts a throughput."""

import gc
import time

import numpy as np
import pytest

import quern
from quern.pipeline.core import timing
from quern.pipeline.core.timing import StepClock, health, prefetch_window

# -------------------------------------------------------------------- pure pieces


@pytest.mark.parametrize(
    "wait, period, expected",
    [
        (0.0, 1.0, "healthy"),
        (0.2, 1.0, "healthy"),  # 0.2 of a 0.8 s step: 25%
        (0.33, 1.0, "healthy"),  # 0.33 / 0.67 = 49%
        (0.34, 1.0, "warning"),  # 0.34 / 0.66 = 52%
        (0.44, 1.0, "warning"),  # 0.44 / 0.56 = 79%
        (0.45, 1.0, "alarm"),  # 0.45 / 0.55 = 82%
        (1.0, 1.0, "alarm"),  # no step time at all: all wait
        (0.0, 0.0, "unknown"),
    ],
)
def test_health_compares_the_wait_with_the_step_time(wait, period, expected):
    assert health(wait, period) == expected


@pytest.mark.parametrize(
    "step, load, batch_bytes, budget, expected",
    [
        (0.100, 0.010, 1, 1 << 30, 20),  # 2 x 100 / 10
        (0.100, 0.030, 1, 1 << 30, 7),  # 6.67, rounded up
        (0.010, 0.050, 1, 1 << 30, 5),  # the least
        (None, 0.050, 1, 1 << 30, 5),  # nothing measured yet: the least
        (0.100, None, 1, 1 << 30, 5),
        (0.100, 0.0, 1, 1 << 30, timing.MAX_WINDOW),  # a free loader: the cap
        (10.0, 0.001, 1, 1 << 30, timing.MAX_WINDOW),
        (0.100, 0.001, 100, 1000, 10),  # the budget holds 10 batches
        (0.100, 0.001, 5000, 1000, 1),  # not even one: still one
    ],
)
def test_prefetch_window_is_the_rule_of_thumb_within_the_budget(step, load, batch_bytes, budget, expected):
    assert prefetch_window(step, load, batch_bytes=batch_bytes, budget=budget) == expected


def test_step_clock_leaves_the_first_batch_out_and_averages_the_window():
    clock = StepClock(window=3)
    assert clock.figures()["health"] == "unknown" and clock.step_time() is None
    t0 = clock.begin()
    time.sleep(0.03)  # start-up
    clock.end(t0)
    for _ in range(4):
        time.sleep(0.02)  # the caller's work
        t0 = clock.begin()
        time.sleep(0.01)  # waiting in next()
        clock.end(t0)
    f = clock.figures()
    assert f["steps"] == 5 and f["first_batch_s"] >= 0.03
    assert 0.01 <= f["data_wait"]["last"] and 0.01 <= f["data_wait"]["mean"] <= f["data_wait"]["max"]
    assert f["data_wait"]["total"] >= 0.04 and f["data_wait"]["total"] < 0.03 + 4 * 0.5  # the first is not in it
    assert f["step_period"]["mean"] >= 0.03
    assert 0 < f["bubble_rate"] < 1 and 0 < f["bubble_rate_total"] < 1
    assert len(clock.recent) == 3  # the window
    assert clock.step_time() >= 0.02


# -------------------------------------------------------------------- the iterators


def _pipe(n=4000, batch=32, sleep=0.0, **kw):
    def slow(b):
        time.sleep(sleep)
        return b

    p = quern.Pipeline.from_source({"x": np.arange(n, dtype=np.int64)}, seed=1, **kw).batch(batch)
    return p.map_batch(slow) if sleep else p


def _stage(stages, name):
    """The seconds of the one stage whose label names ``name`` (``"map[0] ...plus_one"``)."""
    (key,) = [k for k in stages if k.endswith(name)]
    return stages[key]


@pytest.mark.parametrize("workers", [0, 2])
def test_a_slow_loader_shows_as_data_wait_bubble_and_alarm(workers):
    pipe = _pipe(sleep=0.02)
    with pipe.iterator(num_workers=workers) as it:
        for _ in range(12):
            next(it)  # the caller does nothing: every step waits for the loader
        s = it.stats()
    assert s["steps"] == 12 and s["first_batch_s"] > 0
    # 20 ms a batch over `workers or 1` processes: the caller waits about that per step
    assert s["data_wait"]["mean"] >= 0.02 / max(workers, 1) * 0.5
    assert s["bubble_rate"] > 0.8 and s["bubble_rate_total"] > 0.8
    assert s["health"] == "alarm"


def test_a_fast_loader_under_a_slow_step_is_healthy():
    pipe = _pipe()
    with pipe.iterator() as it:
        for _ in range(20):
            next(it)
            time.sleep(0.03)  # the training step
        s = it.stats()
    assert s["step_period"]["mean"] >= 0.03
    assert s["bubble_rate"] < 0.3 and s["health"] == "healthy", s


@pytest.mark.parametrize("workers", [0, 2])
def test_stage_timings_name_each_stage_and_count_its_time(workers):
    def plus_one(r):
        return {"x": r["x"] + 1}

    def nap(b):
        time.sleep(0.005)
        return b

    source = {"x": np.arange(160, dtype=np.int64)}
    pipe = quern.Pipeline.from_source(source, seed=1, num_epochs=1).map(plus_one).batch(16).map_batch(nap)
    with pipe.iterator(num_workers=workers) as it:
        assert len(list(it)) == 10
        s = it.stats()
    stages = s["stages"]
    assert {"read", "collate"} <= set(stages) and _stage(stages, "plus_one") >= 0, stages
    if workers:
        assert {"send", "handover"} <= set(stages)
    assert s["stage_steps"] == 10  # every step's stages (a worker sends a task's with its last batch)
    assert _stage(stages, "nap") >= 0.005 * s["stage_steps"]  # it slept that long per step computed
    assert all(v >= 0 for v in stages.values())


def test_timings_off_measures_no_stage_but_still_the_wait():
    with _pipe().iterator(timings=False) as it:
        for _ in range(5):
            next(it)
        s = it.stats()
    assert s["stages"] == {} and s["steps"] == 5 and "data_wait" in s


def test_stats_after_the_workers_stop_keep_their_figures():
    def same(b):
        return b

    pipe = _pipe(n=256, batch=32, num_epochs=1).map_batch(same)
    with pipe.iterator(num_workers=1) as it:
        got = list(it)
        s = it.stats()
    assert len(got) == 8 and s["steps"] == 8 and s["stage_steps"] == 8 and _stage(s["stages"], "same") >= 0


# -------------------------------------------------------------------- adaptive prefetch


def test_the_window_grows_when_the_loader_is_fast_and_the_step_slow():
    pipe = _pipe(n=100_000, batch=8)
    with pipe.iterator(read_ahead=1, prefetch=2) as it:  # fixed: 2 chunks of 1 step
        for _ in range(30):
            next(it)
            time.sleep(0.01)
        time.sleep(0.1)
        fixed = it.stats()["host_prefetch"]
    with pipe.iterator(read_ahead=1) as it:  # the default adapts
        for _ in range(30):
            next(it)
            time.sleep(0.01)
        time.sleep(0.2)  # let the threads fill the window
        adaptive = it.stats()["host_prefetch"]
    assert fixed["window"] == 0 and fixed["ready"] + fixed["in_flight"] <= 2
    assert adaptive["window"] > 5 and adaptive["depth"] == adaptive["window"]  # 2 x 10 ms / (well under 4 ms)
    assert adaptive["ready"] + adaptive["in_flight"] >= adaptive["window"] - 1


def test_the_memory_budget_caps_the_window():
    pipe = _pipe(n=100_000, batch=8)  # a batch: 8 int64 = 64 bytes
    with pipe.iterator(read_ahead=1, prefetch_memory=64 * 3) as it:
        for _ in range(20):
            next(it)
            time.sleep(0.01)
        time.sleep(0.1)
        hp = it.stats()["host_prefetch"]
    assert hp["window"] == 3 and hp["ready"] + hp["in_flight"] <= 3


def test_the_window_reaches_the_workers():
    pipe = _pipe(n=100_000, batch=8)
    with pipe.iterator(num_workers=2, read_ahead=1) as it:
        for _ in range(40):
            next(it)
            time.sleep(0.01)
        hp = it.stats()["host_prefetch"]
    # 2 workers x 2 tasks of 1 step would be 4; the window asks for more
    assert hp["window"] > 5 and hp["depth"] >= hp["window"]


@pytest.mark.parametrize("workers", [0, 2])
def test_the_depth_never_changes_a_batch(workers):
    pipe = _pipe(n=3000, batch=16)
    rng = np.random.default_rng(0)
    with pipe.iterator(num_workers=workers, read_ahead=2) as it:
        for s in range(60):
            b = next(it)
            np.testing.assert_array_equal(b["x"], pipe.batch_at(s)["x"])
            time.sleep(float(rng.choice([0.0, 0.0, 0.0, 0.01])))  # bursts and pauses move the window


# -------------------------------------------------------------------- global iterator, registry


def test_the_global_iterator_times_the_device_put_and_reports_instead_of_its_host():
    pytest.importorskip("jax")
    import jax

    pipe = _pipe(n=512, batch=16)
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("data",))
    with quern.sharding.global_iterator(pipe, mesh) as it:
        for _ in range(5):
            next(it)
        s = it.stats()
        assert it in timing.LIVE and it._host not in timing.LIVE
    assert s["steps"] == 5 and s["stages"]["device_put"] > 0 and "read" in s["stages"]


def test_every_iterator_is_registered_until_it_is_closed_or_gone():
    it = _pipe().iterator()
    assert it in timing.LIVE
    it.close()
    assert it not in timing.LIVE
    it = _pipe().iterator()
    n = len(timing.LIVE)
    del it
    gc.collect()
    assert len(timing.LIVE) == n - 1


# -------------------------------------------------------------------- review fixes


def test_a_ctrl_c_in_the_prefetch_bookkeeping_loses_no_step():
    pipe = _pipe(n=2000, batch=8)
    it = pipe.iterator(read_ahead=2)
    calls = {"n": 0}
    feed = it._feed  # the threads' feed: its bookkeeping of the chunks in flight
    fill = feed._fill

    def interrupted_fill(**kw):
        calls["n"] += 1
        if calls["n"] == 4:
            raise KeyboardInterrupt
        fill(**kw)

    feed._fill = interrupted_fill
    got = []
    with it:
        while len(got) < 12:
            try:
                got.append(next(it)["x"])
            except KeyboardInterrupt:
                assert it.step == len(got)  # the step the interrupted call was making is made again
    for s, x in enumerate(got):
        np.testing.assert_array_equal(x, pipe.batch_at(s)["x"])


def test_the_packed_read_clock_starts_again_at_each_step():
    class Docs:
        def __len__(self):
            return 400

        def __getitem__(self, i):
            return {"tokens": np.arange(1 + int(i) % 7, dtype=np.int32)}

    def nap(b):
        time.sleep(0.01)
        return b

    pipe = quern.Pipeline.from_source(Docs(), seed=3).pack(16, key="tokens", lengths=[1 + i % 7 for i in range(400)])
    pipe = pipe.batch(4).map_batch(nap)
    with pipe.iterator(read_ahead=8) as it:
        for _ in range(16):
            next(it)
        stages = it.stats()["stages"]
    # the 10 ms nap of each step is its own stage, not also the next step's pack
    assert stages["pack"] < 0.3 * _stage(stages, "nap"), stages


def test_batch_nbytes_counts_what_object_arrays_point_to():
    strings = np.array(["x" * 1000] * 10, dtype=object)
    assert timing.batch_nbytes({"s": strings}) >= 10 * 1000
    assert timing.batch_nbytes({"a": np.zeros(100, np.int64), "b": b"12345"}) == 805
    assert timing.batch_nbytes({}) == 1


def test_the_budget_follows_the_largest_batch_measured():
    def grow(b):  # batches of strings: the first ones small, then large
        n = 10 if int(b["x"][0]) < 80 else 100_000
        return {"s": np.array(["y" * n] * len(b["x"]), dtype=object)}

    pipe = _pipe(n=100_000, batch=8).map_batch(grow)
    with pipe.iterator(read_ahead=1, prefetch=None, prefetch_memory=8 * 100_000 * 4) as it:
        for _ in range(40):
            next(it)
            time.sleep(0.005)
        window = it.stats()["host_prefetch"]["window"]
    assert window <= 4  # 4 batches of 8 x 100 kB fit the budget; the small first batches do not decide it


WINDOW_FDS = """
import resource, sys, time, os
resource.setrlimit(resource.RLIMIT_NOFILE, (200, 200))
import numpy as np, quern
pipe = quern.Pipeline.from_source({"x": np.arange(100_000, dtype=np.int64)}, seed=1).batch(8)
with pipe.iterator(num_workers=2, read_ahead=1) as it:
    for _ in range(80):
        next(it)
        time.sleep(0.02)  # a slow step over a fast loader: the window asks for many batches
    window = it.stats()["host_prefetch"]["window"]
    files = [open(os.devnull) for _ in range(90)]  # the process can still open files: half its room at least
    print(window, len(os.listdir("/proc/self/fd")))
"""


def test_the_window_leaves_the_process_file_descriptors():
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", WINDOW_FDS], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    window, fds = map(int, out.stdout.split())
    assert window > 20 and fds < 200
