"""Tests of pipeline/plan/packing.py.

Across epochs, best_fit packing is a closed form: every epoch has the same number of rows
(best-fit decreasing depends on the lengths only), counted once and kept on disk, so a
cold resume in a later epoch plans only that epoch (issue 12, point 3)."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import assert_batches_equal

import quern
from quern.pipeline.order import packing

pytestmark = pytest.mark.timeout(120)

N = 2000
LENGTHS = (np.arange(N) * 7919) % 500 + 1


class Docs:
    def __len__(self):
        return N

    def __getitem__(self, i):
        return np.full(int(LENGTHS[i]), i, dtype=np.int32)

    def identity(self):
        return {"type": "SummaryDocs", "n": N}


def _pipe(tmp_path):
    return quern.Pipeline.from_source(Docs(), seed=9).shuffle().pack(256, cache_dir=tmp_path).batch(4)


def test_a_cold_resume_in_epoch_3_plans_only_epoch_3(tmp_path, monkeypatch):
    warm = _pipe(tmp_path)
    in_epoch_3 = warm.stream.rows_before(3) // 4 + 2  # a step in epoch 3 (plans epochs 0, 1, 2)
    want = warm.batch_at(in_epoch_3)
    planned = []
    real = packing.plan_epoch
    monkeypatch.setattr(packing, "plan_epoch", lambda *a, **k: planned.append(a[4]) or real(*a, **k))
    cold = _pipe(tmp_path)  # a fresh definition, as after a restart
    got = cold.batch_at(in_epoch_3)
    assert planned == [3]  # the rows per epoch came from the summary on disk
    assert_batches_equal(got, want)
    [summary] = list((tmp_path / "packing").glob("*.rows.json"))
    counts = {warm.stream.epoch(e)[0].rows for e in range(5)}
    assert len(counts) == 1  # the same in every epoch, whatever the order of the documents
    assert summary.read_text().startswith(f'{{"rows_per_epoch": {counts.pop()}, "check": "')


@pytest.mark.parametrize("damage", ["garbage", "negative", "empty", "another count"])
def test_a_damaged_summary_is_recomputed(tmp_path, monkeypatch, damage):
    warm = _pipe(tmp_path)
    step = warm.stream.rows_before(2) // 4 + 1
    want = warm.batch_at(step)
    [summary] = list((tmp_path / "packing").glob("*.rows.json"))
    good = summary.read_text()
    wrong = good.replace('"rows_per_epoch": ', '"rows_per_epoch": 1')  # a digit more: valid JSON, wrong count
    summary.write_text(
        {"garbage": "{not json", "negative": '{"rows_per_epoch": -5}', "empty": "", "another count": wrong}[damage]
    )
    got = _pipe(tmp_path).batch_at(step)
    assert_batches_equal(got, want)
