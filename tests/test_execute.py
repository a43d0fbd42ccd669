"""pipeline/execute/ and pipeline/steps.py: the step runner: any list of steps computed with one bulk read, each result
bit-identical to ``batch_at``, a failing step not stopping the later ones; the per-stage timings;
the check that every batch splits over the hosts; the bulk-read size policy."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import assert_batches_equal

import quern
from quern.pipeline import execute

BAD = 13  # the record the failing transform refuses


def fails_on_13(rec):
    if int(rec["x"]) == BAD:
        raise ValueError("thirteen")
    return {"x": rec["x"] * 2}


def _pipe(fn=None, seed=0):
    pipe = quern.Pipeline.from_source({"x": np.arange(40, dtype=np.int64)}, seed=seed)
    pipe = pipe.map(fn) if fn is not None else pipe.shuffle().map(lambda r: {"x": r["x"] + 1})
    return pipe.batch(4)


class Docs:
    def __len__(self):
        return 200

    def __getitem__(self, i):
        return {"tokens": np.full(int(i) % 60 + 1, i, np.int32)}

    def identity(self):
        return {"type": "ExecuteDocs", "n": 200}


def test_results_come_for_the_steps_asked_in_their_order_and_equal_batch_at():
    pipe = _pipe()
    results = list(execute.step_results(pipe, [7, 2, 30, 2]))
    assert [r.step for r in results] == [7, 2, 30, 2] and all(r.error is None for r in results)
    for r in results:
        assert_batches_equal(r.batch, pipe.batch_at(r.step), f"step {r.step}")


def test_a_failing_step_is_a_result_and_the_later_steps_still_come():
    pipe = _pipe(fails_on_13)  # not shuffled: record 13 is in step 3
    results = list(execute.step_results(pipe, range(2, 6)))
    assert [r.error is None for r in results] == [True, False, True, True]
    err = results[1].error
    assert isinstance(err, quern.StepError) and "step 3 (host 0 of 1)" in str(err) and "thirteen" in str(err)
    assert results[1].batch is None
    assert_batches_equal(results[2].batch, {"x": np.arange(16, 20) * 2})


def test_batches_at_raises_the_first_failing_steps_error():
    pipe = _pipe(fails_on_13)
    assert_batches_equal(execute.batches_at(pipe, 0, 3)[2], {"x": np.arange(8, 12) * 2})
    with pytest.raises(quern.StepError, match=r"step 3 \(host 0 of 1\)"):
        execute.batches_at(pipe, 1, 5)


@pytest.mark.parametrize(
    "step,count,error", [(0, 0, ValueError), (-1, 1, ValueError), (0.5, 1, TypeError), (0, 1.0, TypeError)]
)
def test_bad_steps_and_counts_are_refused(step, count, error):
    with pytest.raises(error):
        execute.batches_at(_pipe(), step, count)


def test_the_seconds_of_each_stage_are_added_up():
    timings: dict[str, float] = {}
    execute.batches_at(_pipe(), 0, 3, timings=timings)
    assert {execute.READ, execute.COLLATE} <= set(timings) and all(t >= 0 for t in timings.values())
    before = dict(timings)
    execute.batches_at(_pipe(), 3, 1, timings=timings)
    assert all(timings[k] >= before[k] for k in before)


def test_check_hosts_refuses_a_batch_that_does_not_split(tmp_path):
    execute.check_hosts(_pipe(), 4)  # a plain batch of 4: one row per host
    bucketed = quern.Pipeline.from_source(Docs(), seed=1).shuffle()
    bucketed = bucketed.bucket([16, 32], [4, 2], key="tokens", cache_dir=tmp_path)
    execute.check_hosts(bucketed, 2)
    with pytest.raises(ValueError, match="bucket 'len<=32' has batch size 2, which is not divisible by the host count"):
        execute.check_hosts(bucketed, 4)


@pytest.mark.parametrize(
    "rows,target,most,steps", [(16, 1000, 64, 62), (16, 1000, 8, 8), (16, 4, 64, 1), (0, 100, 5, 5), (1000, 1, 3, 1)]
)
def test_steps_per_read_aims_at_the_target_records(rows, target, most, steps):
    assert execute.steps_per_read(rows, target, most) == steps
