"""Tests of pipeline/iterate/timing.py: the stages a stuck thread is reported in.

The step runner declares its stage functions with ``Clock.stage``; ``stage_now``
finds them on a thread's stack by their code objects, whatever they are called.
"""

from __future__ import annotations

import sys
import threading

import numpy as np
import pytest

import quern
from quern.pipeline.core import timing
from quern.pipeline.core.timing import STAGE_FUNCTIONS, Clock, stage_now

pytestmark = pytest.mark.timeout(120)


def test_a_registered_function_on_a_stuck_threads_stack_is_reported_whatever_its_name():
    entered, release = threading.Event(), threading.Event()

    def a_name_no_report_knows(where: object) -> None:
        entered.set()
        release.wait(30)

    registered = Clock.stage("pack")(a_name_no_report_knows)
    assert registered is a_name_no_report_knows  # the function itself, unchanged
    try:
        thread = threading.Thread(target=lambda: registered("step 7 (host 0 of 1)"), daemon=True)
        thread.start()
        assert entered.wait(30)
        assert thread.ident is not None
        now = stage_now(sys._current_frames()[thread.ident])
        assert now.where == "step 7 (host 0 of 1)"
        assert now.stage == "stage 'pack'"
        assert "in step 7 (host 0 of 1), stage 'pack', at " in str(now)
    finally:
        release.set()
        STAGE_FUNCTIONS.pop(a_name_no_report_knows.__code__, None)
    thread.join(30)


def test_an_unregistered_function_is_in_no_stage_even_with_a_stage_name():
    def collate_rows(where: object) -> timing.StageNow:  # the name of a stage function, not registered
        return stage_now(sys._getframe())

    now = collate_rows("step 1")
    assert now.where == "" and str(now).startswith("in no stage of a step, at ")


def test_an_unknown_stage_kind_is_refused():
    with pytest.raises(ValueError, match="unknown stage kind 'nap'"):
        Clock.stage("nap")  # type: ignore[arg-type]


class _Docs:
    def __init__(self, base: int, n: int) -> None:
        self.base, self.n = base, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        return {"tokens": np.full(1 + (int(i) * 7) % 11, self.base + int(i), dtype=np.int32), "x": np.int64(i)}


class _Many:
    """A ``map`` transform with ``map_many``: one call per step's records."""

    def __call__(self, rec: dict) -> dict:
        return rec

    def map_many(self, recs: list) -> list:
        return list(recs)


def _plain(n: int = 200, base: int = 0, seed: int = 0) -> quern.Pipeline:
    return quern.Pipeline.from_source(_Docs(base, n), seed=seed)


def _pipelines(tmp_path) -> dict[str, quern.Pipeline]:
    """Pipelines between them running every stage of the step runner."""
    keep_x = lambda r: {"x": r["x"]}  # noqa: E731
    single = (
        _plain()
        .map(keep_x)
        .filter(lambda r: int(r["x"]) % 5 != 0, cache_dir=tmp_path, num_workers=1)
        .random_map(lambda r, rng: {"x": r["x"] + rng.integers(3)})
        .map(_Many())
        .batch(4)
        .map_batch(lambda b: {"x": b["x"] * 2})
        .random_map_batch(lambda b, keys: b)
    )
    packed = _plain(seed=1).shuffle().pack(16, key="tokens", cache_dir=tmp_path).batch(4).map_batch(lambda b: b)
    other = _plain(100, base=1000, seed=2)
    same_ops = quern.mix({"a": _plain().map(keep_x), "b": other.map(keep_x)}, weights=[0.5, 0.5], seed=3)
    own_ops = quern.mix(
        {"a": _plain().map(keep_x), "b": other.map(lambda r: {"x": r["x"] + 1})}, weights=[0.5, 0.5], seed=4
    )
    with_packed = quern.mix(
        {
            "a": _plain(seed=5).pack(16, key="tokens", cache_dir=tmp_path).map(lambda r: dict(r)),
            "b": _plain(100, base=1000, seed=6).pack(16, key="tokens", cache_dir=tmp_path),
        },
        weights=[0.5, 0.5],
        seed=7,
    )
    return {
        "single source": single,
        "packed": packed,
        "mixture, shared transforms": same_ops.batch(8),
        "mixture, own transforms": own_ops.batch(8),
        "mixture of packed": with_packed.batch(8),
    }


def _laps_and_stage_functions(run) -> list[tuple[str, bool]]:
    """Run ``run()`` under a profiler; per ``Clock.lap(stage)``, whether a registered stage function was entered
    (at any depth) since that clock's previous lap, or its making."""
    entered: dict[int, tuple[Clock, set]] = {}  # id(clock) -> (clock, code objects entered since its last lap)
    laps: list[tuple[str, bool]] = []

    def profile(frame, event, arg):
        if event != "call":
            return
        code = frame.f_code
        if code is Clock.__init__.__code__:
            clock = frame.f_locals["self"]
            entered[id(clock)] = (clock, set())
        elif code is Clock.lap.__code__:
            clock = frame.f_locals["self"]
            _, codes = entered.get(id(clock), (clock, set()))
            laps.append((frame.f_locals["stage"], any(c in STAGE_FUNCTIONS for c in codes)))
            entered[id(clock)] = (clock, set())
        else:
            for _, codes in entered.values():
                codes.add(code)

    sys.setprofile(profile)
    try:
        run()
    finally:
        sys.setprofile(None)
    return laps


def test_every_stage_the_runner_times_runs_in_a_registered_stage_function(tmp_path):
    for name, pipe in _pipelines(tmp_path).items():
        laps = _laps_and_stage_functions(lambda pipe=pipe: [pipe.batch_at(s) for s in range(3)])
        assert laps, f"{name}: no stage was timed: the test itself is broken"
        unregistered = sorted({stage for stage, ok in laps if not ok})
        assert unregistered == [], f"{name}: stages timed with no registered stage function running: {unregistered}"
    assert set(STAGE_FUNCTIONS.values()) >= {"read", "record", "collate", "batch", "pack"}


def test_each_stage_kind_is_reported_from_inside_the_runner(tmp_path):
    """A user function called by each stage (a source's read, transforms) sees itself in that stage."""
    reports: list[str] = []

    class Seen:
        def __len__(self) -> int:
            return 40

        def __getitem__(self, i: int) -> dict:
            reports.append(str(stage_now(sys._getframe())))
            return {"x": np.int64(i)}

    def rec(r: dict) -> dict:
        reports.append(str(stage_now(sys._getframe())))
        return r

    def bat(b: dict) -> dict:
        reports.append(str(stage_now(sys._getframe())))
        return b

    pipe = quern.Pipeline.from_source(Seen(), seed=0).map(rec).batch(4).map_batch(bat)
    pipe.batch_at(2)
    assert any(", stage 'read' of source " in r for r in reports), reports
    assert any("stage map[0] " in r and "rec, row 0 = record 8 of source " in r for r in reports), reports
    assert any("stage map_batch[0] " in r and ".bat (" in r for r in reports), reports
    assert all(r.startswith("in step 2 (") for r in reports), reports
