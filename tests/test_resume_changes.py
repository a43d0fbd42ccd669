"""A refused resume names the first part of the definition that changed, with both values
(pipeline/identity/changes.py, pipeline/definition/identify.py)."""

from __future__ import annotations

import json

import numpy as np
import pytest

import quern

DOCS = [np.arange(1, 2 + i % 40, dtype=np.int32) for i in range(200)]


def _packed(seq_len=512, seed=1, shuffle=True, batch=4):
    pipe = quern.Pipeline.from_source(DOCS, seed=seed)
    return (pipe.shuffle() if shuffle else pipe).pack(seq_len).batch(batch)


def _refusal(saved, now) -> str:
    state = json.loads(json.dumps(saved.state_at(6)))  # as a checkpoint file holds it
    with pytest.raises(ValueError) as e:
        now.check_state(state)
    return str(e.value)


@pytest.mark.parametrize(
    "change,expected",
    [
        ({"seq_len": 1024}, "packing.seq_len: 512 -> 1024"),
        ({"seed": 2}, "packing.inner.seed: 1 -> 2"),
        ({"shuffle": False}, 'packing.inner.shuffle.0: "global" -> null'),
        ({"batch": 8}, "batch.0: 4 -> 8"),
    ],
    ids=["seq_len", "seed", "shuffle", "batch"],
)
def test_a_refused_resume_names_the_first_difference_and_both_values(change, expected):
    message = _refusal(_packed(), _packed(**change))
    assert f"the first difference (saved -> now): {expected}" in message, message
    assert message.endswith("pass force=True to resume anyway")


def test_a_changed_transform_is_named_by_its_place():
    base = quern.Pipeline.from_source({"x": np.arange(20)}, seed=0)
    saved = base.map(lambda r: r).batch(2)
    now = base.map(lambda r: {"x": r["x"] + 1}).batch(2)
    message = _refusal(saved, now)
    assert "the first difference (saved -> now): record_ops.0." in message, message


def test_a_state_saved_without_a_description_is_refused_as_before():
    state = _packed().state_at(6)
    del state["description"]
    with pytest.raises(ValueError) as e:
        _packed(seq_len=1024).check_state(state)
    assert "the first difference" not in str(e.value) and "does not match this pipeline's" in str(e.value)
    assert _packed().check_state(state) == 6


def test_verify_names_the_first_difference_from_the_ledger(tmp_path):
    """A ledger's first line under a fingerprint holds the description's leaves: checked against another
    definition, and compared with another run's ledger, the first difference is named with both values."""
    from quern.verify import check_ledger, compare_ledgers

    runs = {}
    for seq_len in (512, 1024):
        path = tmp_path / f"ledger-{seq_len}.jsonl"
        with _packed(seq_len=seq_len).iterator(ledger=path) as it:
            for _ in range(3):
                next(it)
        runs[seq_len] = path
    with pytest.raises(
        ValueError, match=r"the first difference \(logged -> this pipeline\): packing.seq_len: 512 -> 1024"
    ):
        check_ledger(_packed(seq_len=1024), str(runs[512]))
    result = compare_ledgers(str(runs[512]), str(runs[1024]))
    assert any("the first difference (A -> B): packing.seq_len: 512 -> 1024" in d.text for d in result.differences)
